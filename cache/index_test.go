package cache

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
)

// dumpIndex renders the first n blocks of volume vi: '.' not cached,
// 'd' dirty, 'c' clean.
func dumpIndex(s *Set, vi int, n int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := []byte(strings.Repeat(".", n))
	s.vols[vi].idx.Tree.Ascend(func(e index.Ent) bool {
		if int(e.LBA) < n {
			b[e.LBA] = 'c'
			if e.Dirty() {
				b[e.LBA] = 'd'
			}
		}
		return true
	})
	return string(b)
}

// TestIndexOps is a table of small scripts over one volume and the index
// state after each step. Commands: "<mode> lba n" writes n blocks in that
// mode (wb, wt, wa, none), "zero lba n", "trim lba n", "read lba n"
// (promotes), "drain", "sub off len" (a sub-block write in writeback).
func TestIndexOps(t *testing.T) {
	for _, tc := range []struct {
		name  string
		steps []string
	}{
		{"split-and-merge", []string{
			"wb 0 8 => dddddddd....",
			"wt 2 3 => ddcccddd....",
			"wa 3 1 => ddc.cddd....",
			"wb 3 2 => ddcddddd....",
			"none 7 3 => ddcdddd.....",
			"zero 0 2 => ..cdddd.....",
			"drain => ..ccccc.....",
			"read 6 4 => ..cccccccc..",
			"trim 5 2 => ..ccc..ccc..",
		}},
		{"sub-block-writes", []string{
			"sub 512 1024 => d...........",
			"sub 8190 4 => ddd.........", // straddles blocks 1 and 2
			"wa 1 1 => d.d.........",
			"sub 4096 512 => ddd.........",
		}},
		{"zero-edges", []string{
			"wb 0 4 => dddd........",
			// Zeroing [2048, 12288+2048): edges are sub-block writes, the
			// middle is passed down and invalidated.
			"zerob 2048 12288 => d..d........",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _, _ := newTestSet(t, 8, 4*blockSize, 12*blockSize)
			v := s.vols[0]
			// Background writeback paused (as while a Drain runs), so the
			// index states are deterministic.
			s.draining.Add(1)
			for _, step := range tc.steps {
				cmd, want, _ := strings.Cut(step, " => ")
				f := strings.Fields(cmd)
				arg := func(i int) int64 {
					n, err := strconv.ParseInt(f[i], 10, 64)
					if err != nil {
						t.Fatal(err)
					}
					return n
				}
				var err error
				switch f[0] {
				case "wb", "wt", "wa", "none":
					mode := map[string]Mode{"wb": Writeback, "wt": Writethrough, "wa": Writearound, "none": None}[f[0]]
					if err = v.SetMode(mode); err == nil {
						err = v.WriteAt(make([]byte, arg(2)*blockSize), arg(1)*blockSize, false)
					}
				case "sub":
					if err = v.SetMode(Writeback); err == nil {
						err = v.WriteAt(make([]byte, arg(2)), arg(1), false)
					}
				case "zero":
					err = v.WriteZeroes(arg(1)*blockSize, arg(2)*blockSize, false, true, false)
				case "zerob":
					err = v.WriteZeroes(arg(1), arg(2), false, true, false)
				case "trim":
					err = v.Trim(arg(1)*blockSize, arg(2)*blockSize, false)
				case "read":
					if err = v.SetMode(Writethrough); err == nil {
						err = v.ReadAt(make([]byte, arg(2)*blockSize), arg(1)*blockSize)
					}
				case "drain":
					err = s.Drain(context.Background())
				default:
					t.Fatalf("unknown command %q", cmd)
				}
				if err != nil {
					t.Fatalf("%s: %v", cmd, err)
				}
				if got := dumpIndex(s, 0, 12); got != want {
					t.Fatalf("%s: index %s, want %s", cmd, got, want)
				}
				if err := s.Check(); err != nil {
					t.Fatalf("%s: %v", cmd, err)
				}
			}
		})
	}
}

// TestChecksumClean: a clean block that fails its checksum is re-read from
// the backing device and dropped (invariant 4).
func TestChecksumClean(t *testing.T) {
	s, cache, _ := newTestSet(t, 8, 4*blockSize, 16*blockSize)
	v := s.vols[0]
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, blockSize)
	stamp(p, 1, 0, 3*blockSize)
	if err := v.WriteAt(p, 3*blockSize, false); err != nil {
		t.Fatal(err)
	}
	e, _ := v.idx.Tree.Get(index.Ent{LBA: 3})
	if err := cache.Corrupt(s.cacheOff(e.Block())+100, 1); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, blockSize)
	if err := v.ReadAt(got, 3*blockSize); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(p) {
		t.Fatal("wrong data returned")
	}
	if st := v.Stats(); st.ChecksumErrors != 1 || st.ChecksumRepairs != 1 || st.CachedBlocks != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestChecksumDirty: a dirty block that fails its checksum is an I/O error
// naming the device, offset and checksums; it is never returned.
func TestChecksumDirty(t *testing.T) {
	s, cache, _ := newTestSet(t, 8, 4*blockSize, 16*blockSize)
	v := s.vols[0]
	if err := v.WriteAt(make([]byte, 2*blockSize), 5*blockSize, false); err != nil {
		t.Fatal(err)
	}
	e, _ := v.idx.Tree.Get(index.Ent{LBA: 6})
	if err := cache.Corrupt(s.cacheOff(e.Block()), 1); err != nil {
		t.Fatal(err)
	}
	err := v.ReadAt(make([]byte, 3*blockSize), 4*blockSize)
	var ce *CorruptionError
	if !errors.Is(err, ErrChecksum) || !IsCorruption(err) || !errors.As(err, &ce) || ce.Offset != s.cacheOff(e.Block()) {
		t.Fatalf("read of corrupt dirty block: %v", err)
	}
	t.Log(err)
	// Block 5 is fine.
	if err := v.ReadAt(make([]byte, blockSize), 5*blockSize); err != nil {
		t.Fatal(err)
	}
	// Drain cannot write it back and says so instead of spinning.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Drain(ctx); !errors.Is(err, ErrChecksum) {
		t.Fatalf("drain: %v", err)
	}
}

// TestCheckCatchesCorruption breaks the index of a served set in each way
// Set.Check guards against (without the reverse map, which only recovery
// has) and expects Check to report it; the set is repaired afterwards so
// the end-of-test check passes.
func TestCheckCatchesCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(s *Set) (undo func())
		want    string
		// exactOnly: Open's check does not verify it (the tree
		// summaries: see checkIndexLocked).
		exactOnly bool
	}{
		{"block-named-twice", func(s *Set) func() {
			v := s.vols[0]
			a, _ := v.idx.Tree.Get(index.Ent{LBA: 1})
			b, _ := v.idx.Tree.Get(index.Ent{LBA: 2})
			v.idx.Tree.ReplaceOrInsert(index.Ent{LBA: 2, Loc: a.Loc, CRC: b.CRC})
			return func() { v.idx.Tree.ReplaceOrInsert(b) }
		}, "another entry names", false},
		{"bucket-count", func(s *Set) func() {
			e, _ := s.vols[0].idx.Tree.Get(index.Ent{LBA: 3})
			b := &s.mu.Buckets[int64(e.Block())/s.bpb]
			b.Live++
			return func() { b.Live-- }
		}, "accounted", false},
		{"dirty-count", func(s *Set) func() {
			v := s.vols[0]
			v.idx.Dirty++
			return func() { v.idx.Dirty-- }
		}, "dirty", false},
		// Superseded versions (lba 1 and 2, epoch 0).
		{"superseded-not-older", func(s *Set) func() {
			x := s.mu.SupOf(0, 1)[0]
			s.mu.SetBlockEpoch(x.Loc, 1)
			return func() { s.mu.SetBlockEpoch(x.Loc, x.Epoch) }
		}, "without a newer dirty live entry", false},
		{"superseded-count", func(s *Set) func() {
			s.vols[0].idx.NSup++
			return func() { s.vols[0].idx.NSup-- }
		}, "superseded", false},
		// Recovery's reverse map, right but for two blocks' owners swapped
		// (counts and uniqueness stay right).
		{"reverse-map-swapped", func(s *Set) func() {
			v := s.vols[0]
			buildOwner(s)
			a, _ := v.idx.Tree.Get(index.Ent{LBA: 1})
			b, _ := v.idx.Tree.Get(index.Ent{LBA: 2})
			o := s.mu.Owner
			o[a.Block()], o[b.Block()] = o[b.Block()], o[a.Block()]
			return func() { s.mu.Owner = nil }
		}, "owned by (vol 0, lba 2)|reverse map does not name", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _, _ := newTestSet(t, 8, 4*blockSize, 64*blockSize)
			// Epoch 0: blocks 0-7; epoch 1: blocks 1 and 2 again, whose
			// versions of epoch 0 are superseded (background writeback
			// paused so that they stay).
			s.draining.Add(1)
			defer s.draining.Add(-1)
			if err := s.vols[0].WriteAt(make([]byte, 8*blockSize), 0, false); err != nil {
				t.Fatal(err)
			}
			if err := s.vols[0].Flush(); err != nil {
				t.Fatal(err)
			}
			if err := s.vols[0].WriteAt(make([]byte, 2*blockSize), blockSize, false); err != nil {
				t.Fatal(err)
			}
			if err := s.Check(); err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			if s.mu.Owner != nil {
				t.Error("a served set keeps the reverse map")
			}
			undo := tc.corrupt(s)
			s.mu.Unlock()
			err := s.Check()
			s.mu.Lock()
			// Open's check (by fingerprint where Check looks up) must
			// catch it too.
			fast := s.checkIndexLocked(false)
			// And with a right reverse map, as in recovery, where it reads
			// the epochs in cache-block order.
			var fastOwned error
			if s.mu.Owner == nil {
				buildOwner(s)
				fastOwned = s.checkIndexLocked(false)
				s.mu.Owner = nil
			} else {
				fastOwned = fast
			}
			undo()
			s.mu.Unlock()
			// want: alternatives separated by "|".
			match := func(err error) bool {
				for _, w := range strings.Split(tc.want, "|") {
					if err != nil && strings.Contains(err.Error(), w) {
						return true
					}
				}
				return false
			}
			if !match(err) {
				t.Fatalf("Check after corrupting: %v, want %q", err, tc.want)
			}
			if tc.exactOnly {
				return
			}
			if !match(fastOwned) {
				t.Fatalf("Open's check with a reverse map after corrupting: %v, want %q", fastOwned, tc.want)
			}
			if !match(fast) {
				t.Fatalf("Open's check after corrupting: %v, want %q", fast, tc.want)
			}
		})
	}
}

// buildOwner builds recovery's reverse map from the index (entries and
// superseded versions).
// REQUIRES: s.mu
func buildOwner(s *Set) {
	s.mu.Owner = make([]uint64, s.mu.CacheBlocks())
	for vi, v := range s.vols {
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			s.mu.Owner[e.Block()] = index.OwnerKey(vi, e.LBA)
			return true
		})
		v.idx.Sup.Ascend(func(x index.Ent) bool {
			s.mu.Owner[x.Loc] = index.OwnerKey(vi, x.LBA)
			return true
		})
	}
}
