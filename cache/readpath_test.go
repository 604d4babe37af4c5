package cache

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
)

// TestReadPiecesMixed reads random ranges of a volume whose blocks are a mix
// of dirty cached blocks (the backing device holds older data under them),
// clean cached blocks and uncached blocks, and checks each byte against the
// latest write (invariant 1). Promotion is off so the mix stays fixed.
func TestReadPiecesMixed(t *testing.T) {
	const nblk = 1024
	s, _, backs := newTestSet(t, 64, 64<<10, nblk*blockSize)
	v := s.vols[0]
	st := *v.cfg.Load()
	st.Promote = "never"
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, nblk*blockSize)
	stamp(want, 1, 0, 0)
	if _, err := backs[0].WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	p := make([]byte, blockSize)
	write := func(mode Mode, wid uint64, n int) {
		if err := v.SetMode(mode); err != nil {
			t.Fatal(err)
		}
		for range n {
			l := rng.Int64N(nblk)
			stamp(p, wid, 0, l*blockSize)
			if err := v.WriteAt(p, l*blockSize, false); err != nil {
				t.Fatal(err)
			}
			copy(want[l*blockSize:], p)
		}
	}
	write(Writethrough, 2, 150) // clean cached blocks
	write(Writeback, 3, 150)    // dirty ones, over stale backing data
	if st := v.Stats(); st.CachedBlocks == 0 || st.DirtyBlocks == 0 || st.CachedBlocks == nblk {
		t.Fatalf("want a mix of cached, dirty and uncached blocks: %+v", st)
	}
	for range 900 {
		off := rng.Int64N(nblk*blockSize - 1)
		n := 1 + rng.Int64N(min(300*blockSize, nblk*blockSize-off))
		got := make([]byte, n)
		if err := v.ReadAt(got, off); err != nil {
			t.Fatalf("read %d at %d: %v", n, off, err)
		}
		if string(got) != string(want[off:off+n]) {
			t.Fatalf("read %d at %d: wrong data", n, off)
		}
	}
}

// TestReadPiecesChecksum: inside a coalesced backing read, a clean cached
// block is served from the backing device (which holds the same bytes), so
// a corrupt cache copy of it is neither read nor returned; read alone, the
// corrupt copy is detected and re-read from the backing device; a dirty
// block that fails its checksum is an error (invariant 4).
func TestReadPiecesChecksum(t *testing.T) {
	s, cache, backs := newTestSet(t, 8, 16*blockSize, 64*blockSize)
	v := s.vols[0]
	old := make([]byte, 64*blockSize)
	stamp(old, 1, 0, 0)
	if _, err := backs[0].WriteAt(old, 0); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, blockSize)
	stamp(p, 2, 0, 10*blockSize)
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	if err := v.WriteAt(p, 10*blockSize, false); err != nil { // clean
		t.Fatal(err)
	}
	if err := v.SetMode(Writeback); err != nil {
		t.Fatal(err)
	}
	stamp(p, 3, 0, 20*blockSize)
	if err := v.WriteAt(p, 20*blockSize, false); err != nil { // dirty
		t.Fatal(err)
	}
	want := append([]byte(nil), old...)
	stamp(want[10*blockSize:11*blockSize], 2, 0, 10*blockSize)
	stamp(want[20*blockSize:21*blockSize], 3, 0, 20*blockSize)
	corrupt := func(lba uint64) {
		e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
		if !ok {
			t.Fatalf("lba %d not cached", lba)
		}
		if err := cache.Corrupt(s.cacheOff(e.Block())+7, 1); err != nil {
			t.Fatal(err)
		}
	}
	corrupt(10)
	got := make([]byte, 16*blockSize)
	if err := v.ReadAt(got, 4*blockSize); err != nil { // blocks 4-19: misses around clean block 10
		t.Fatal(err)
	}
	if string(got) != string(want[4*blockSize:20*blockSize]) {
		t.Fatal("wrong data around a corrupt clean block")
	}
	if st := v.Stats(); st.ChecksumErrors != 0 {
		t.Fatalf("clean block inside a coalesced read was read from the cache: %+v", st)
	}
	got = got[:blockSize]
	if err := v.ReadAt(got, 10*blockSize); err != nil { // a hit alone: from the cache
		t.Fatal(err)
	}
	if string(got) != string(want[10*blockSize:11*blockSize]) {
		t.Fatal("wrong data after repairing a clean block")
	}
	if st := v.Stats(); st.ChecksumErrors != 1 || st.ChecksumRepairs != 1 {
		t.Fatalf("stats %+v", st)
	}
	corrupt(20)
	err := v.ReadAt(make([]byte, 8*blockSize), 16*blockSize) // misses around dirty block 20
	if !errors.Is(err, ErrChecksum) {
		t.Fatalf("read over a corrupt dirty block: %v", err)
	}
}

// TestReadAtTier checks that ReadAtTier reports a read served wholly by
// the cache as TierCache and one needing the backing device as
// TierBacking, with the same data ReadAt returns, unaligned reads
// included.
func TestReadAtTier(t *testing.T) {
	const nblk = 64
	s, _, backs := newTestSet(t, 64, 64<<10, nblk*blockSize)
	v := s.vols[0]
	st := *v.cfg.Load()
	st.Promote = "never"
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, nblk*blockSize)
	stamp(want, 1, 0, 0)
	if _, err := backs[0].WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	if err := v.SetMode(Writeback); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4*blockSize)
	stamp(p, 2, 0, 8*blockSize)
	if err := v.WriteAt(p, 8*blockSize, false); err != nil { // blocks 8-11 cached
		t.Fatal(err)
	}
	copy(want[8*blockSize:], p)
	for _, tc := range []struct {
		off, n int64
		tier   Tier
	}{
		{8 * blockSize, 4 * blockSize, TierCache},
		{9*blockSize + 100, 1000, TierCache},
		{7 * blockSize, 2 * blockSize, TierBacking},
		{0, blockSize, TierBacking},
		{11*blockSize + 5, blockSize, TierBacking},
	} {
		got := make([]byte, tc.n)
		tier, err := v.ReadAtTier(got, tc.off)
		if err != nil {
			t.Fatalf("read %d at %d: %v", tc.n, tc.off, err)
		}
		if tier != tc.tier {
			t.Errorf("read %d at %d: tier %v, want %v", tc.n, tc.off, tier, tc.tier)
		}
		if string(got) != string(want[tc.off:tc.off+tc.n]) {
			t.Errorf("read %d at %d: wrong data", tc.n, tc.off)
		}
	}
}
