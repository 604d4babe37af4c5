package cache

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/policy"
)

var flagRewrite = flagBool("rewrite", false, "regenerate the golden policy traces in testdata/policy from the reference model")

// TestPolicyGolden replays the traces in testdata/policy against a real
// volume and compares each request's outcome with the golden line (STYLE
// example 8). The golden outcomes come from refPolicy, a tiny reference
// model of the promotion and sequential-bypass rules; -rewrite regenerates
// them from it:
//
//	go test ./cache -run TestPolicyGolden -rewrite
//
// Trace lines (LBAs and lengths in 4 KiB blocks):
//
//	set key=value ...           change settings
//	room N                      another volume's dirty data leaves the cache N blocks of room for write streams
//	                            (at most what the volume's writeback target leaves)
//	read LBA N -> hit | miss [bypass] [promote=K]
//	write LBA N -> cache | bypass
//
// The set runs without background goroutines, so nothing is written back
// and the room is what the trace's writes leave (the test checks the
// engine's streamRoom against the model's after every room line).
func TestPolicyGolden(t *testing.T) {
	files, _ := filepath.Glob("testdata/policy/*.trace")
	if len(files) == 0 {
		t.Fatal("no traces in testdata/policy")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) { runPolicyTrace(t, f) })
	}
}

// Golden traces' cache: about 512 buckets of 16 blocks, and the volume that
// holds the other dirty data (room lines).
const (
	goldenBuckets = 512
	goldenBPB     = 16
	goldenOther   = goldenBuckets * goldenBPB // blocks of the other volume
)

func runPolicyTrace(t *testing.T, path string) {
	fh, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	fh.Close()
	// Nothing is evicted in these traces: every trace's writes, promotions
	// and other dirty data stay below the free reserve.
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, goldenBuckets, goldenBPB*blockSize, 4096*blockSize, goldenOther*blockSize)
	v, other := s.vols[0], s.vols[1]
	ost := other.Settings()
	ost.SequentialCutoff = 0
	if err := other.SetSettings(ost); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	ref := newRefPolicy(s.mu.CacheBlocks())
	s.mu.Unlock()
	var out []string
	for ln, line := range lines {
		op, want, _ := strings.Cut(line, " -> ")
		f := strings.Fields(op)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			out = append(out, line)
			continue
		}
		switch f[0] {
		case "set":
			st := v.Settings()
			for _, kv := range f[1:] {
				k, val, _ := strings.Cut(kv, "=")
				if err := ParseSetting(&st, k, val); err != nil {
					t.Fatalf("%s:%d: %v", path, ln+1, err)
				}
			}
			if err := v.SetSettings(st); err != nil {
				t.Fatal(err)
			}
			ref.st = st
			out = append(out, line)
			continue
		case "room":
			n, err := strconv.ParseInt(f[1], 10, 64)
			if len(f) != 2 || err != nil {
				t.Fatalf("%s:%d: bad line %q", path, ln+1, line)
			}
			more := ref.setRoom() - n
			if more < 0 || ref.other+more > goldenOther || ref.room() < n {
				t.Fatalf("%s:%d: %q: the room is %d blocks already, the other volume holds %d", path, ln+1, line, ref.room(), ref.other)
			}
			for done := int64(0); done < more; {
				k := min(more-done, 256)
				if err := other.WriteAt(make([]byte, k*blockSize), (ref.other+done)*blockSize, false); err != nil {
					t.Fatal(err)
				}
				done += k
			}
			ref.other += more
			if got := v.streamRoom(); got != n*blockSize {
				t.Fatalf("%s:%d: %q: the engine's room is %d blocks", path, ln+1, line, got/blockSize)
			}
			out = append(out, line)
			continue
		}
		if len(f) != 3 {
			t.Fatalf("%s:%d: bad line %q", path, ln+1, line)
		}
		lba, _ := strconv.ParseUint(f[1], 10, 64)
		n, _ := strconv.Atoi(f[2])
		var got, model string
		switch f[0] {
		case "read":
			got = engineRead(t, v, lba, n)
			model = ref.read(lba, n)
		case "write":
			got = engineWrite(t, v, lba, n)
			model = ref.write(lba, n)
		default:
			t.Fatalf("%s:%d: unknown op %q", path, ln+1, f[0])
		}
		if *flagRewrite {
			out = append(out, op+" -> "+model)
			continue
		}
		if got != want {
			t.Errorf("%s:%d: %s: engine %q, golden %q (reference model %q)", path, ln+1, op, got, want, model)
		}
	}
	if *flagRewrite {
		if err := os.WriteFile(path, []byte(strings.Join(out, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func engineRead(t *testing.T, v *Volume, lba uint64, n int) string {
	before := v.Stats()
	if err := v.ReadAt(make([]byte, n*blockSize), int64(lba)*blockSize); err != nil {
		t.Fatal(err)
	}
	after := v.Stats()
	var r []string
	switch {
	case after.ReadHitOps > before.ReadHitOps:
		r = append(r, "hit")
	default:
		r = append(r, "miss")
	}
	if after.BypassSequentialBytes > before.BypassSequentialBytes {
		r = append(r, "bypass")
	}
	if k := (after.PromoteBytes - before.PromoteBytes) / blockSize; k > 0 {
		r = append(r, fmt.Sprintf("promote=%d", k))
	}
	return strings.Join(r, " ")
}

func engineWrite(t *testing.T, v *Volume, lba uint64, n int) string {
	before := v.Stats()
	if err := v.WriteAt(make([]byte, n*blockSize), int64(lba)*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if v.Stats().BypassSequentialBytes > before.BypassSequentialBytes {
		return "bypass"
	}
	return "cache"
}

// refPolicy is the reference model: the rules of package policy's doc
// and policy.go's comment written as plainly as possible, over maps of
// cached and dirty blocks.
type refPolicy struct {
	st      Settings
	cached  map[uint64]bool
	dirty   map[uint64]bool // the volume's dirty blocks
	other   int64           // the other volume's dirty blocks (room lines)
	blocks  int64           // the cache's blocks
	misses  map[uint64]int
	streams []refStream // most recently used last
}

// refStream: a stream's byte range, its bytes, and the runs of blocks it
// has not written between its start and its end (holes, oldest first, at
// most policy.Holes).
type refStream struct {
	start, next, seen int64
	holes             [][2]int64 // [lo, hi) byte ranges
}

func newRefPolicy(blocks int64) *refPolicy {
	return &refPolicy{st: DefaultSettings(), cached: map[uint64]bool{}, dirty: map[uint64]bool{}, misses: map[uint64]int{}, blocks: blocks}
}

// room is the cache's room for write streams in blocks: the blocks below
// 70 % of the cache (where writes start to be throttled) not dirty, and at
// most what the volume's dirty blocks leave of writeback_percent of the
// cache.
func (r *refPolicy) room() int64 {
	return max(min(r.setRoom(), r.blocks*int64(r.st.WritebackPercent)/100-int64(len(r.dirty))), 0)
}

// setRoom is the blocks below 70 % of the cache not dirty in any volume.
func (r *refPolicy) setRoom() int64 { return r.blocks*7/10 - int64(len(r.dirty)) - r.other }

// seq: the most recently used remembered stream that the request belongs
// to takes it: starting at its end or at most policy.Window ahead and no more
// than the stream holds (the gap becomes a hole), filling part of a hole however far behind its
// end (the hole shrinks), or rewriting up to policy.Window behind its end (adds nothing, and is not sequential). Otherwise the request
// starts a new stream, forgetting the least recently used of 16. It
// bypasses if it is as large as the cutoff, or once its stream holds the
// cutoff and covers at least half of its span. The cutoff of a write in
// writeback mode is the larger of sequential_cutoff and the room (0
// disables either way).
func (r *refPolicy) seq(lba uint64, n int, write bool) bool {
	off, ln := int64(lba)*blockSize, int64(n)*blockSize
	cutoff := r.st.SequentialCutoff
	if write && r.st.Mode == Writeback && cutoff > 0 {
		cutoff = max(cutoff, r.room()*blockSize)
	}
	long := func(s refStream) bool {
		return cutoff > 0 && s.seen >= cutoff && s.next-s.start <= 2*s.seen
	}
	for i := len(r.streams) - 1; i >= 0; i-- {
		s := r.streams[i]
		w := policy.Window(ln)
		switch {
		case off >= s.next && off-s.next <= w && off-s.next <= s.seen:
			if off > s.next {
				s.holes = append(s.holes, [2]int64{s.next, off})
				if len(s.holes) > policy.Holes {
					s.holes = s.holes[1:]
				}
			}
			s.next, s.seen = off+ln, s.seen+ln
		case off < s.next && off >= s.start:
			fills := false
			for _, h := range s.holes {
				fills = fills || off < h[1] && h[0] < off+ln
			}
			if !fills && s.next-off > w {
				continue // too far behind to be a rewrite
			}
			before, seen := len(s.holes), s.seen
			var left [][2]int64
			for _, h := range s.holes {
				for b := h[0]; b < h[1]; b += blockSize {
					if b >= off && b < off+ln {
						s.seen += blockSize
						continue
					}
					if k := len(left); k > 0 && left[k-1][1] == b {
						left[k-1][1] = b + blockSize
					} else {
						left = append(left, [2]int64{b, b + blockSize})
					}
				}
			}
			s.holes = left
			if len(s.holes) > policy.Holes {
				s.holes = s.holes[len(s.holes)-policy.Holes:]
			}
			s.next = max(s.next, off+ln)
			if len(s.holes) == before && s.seen == seen {
				// A rewrite: part of the stream, not sequential.
				r.streams = append(append(r.streams[:i:i], r.streams[i+1:]...), s)
				return cutoff > 0 && ln >= cutoff
			}
		default:
			continue
		}
		r.streams = append(append(r.streams[:i:i], r.streams[i+1:]...), s)
		return cutoff > 0 && ln >= cutoff || long(s)
	}
	if len(r.streams) == policy.Streams {
		r.streams = r.streams[1:]
	}
	r.streams = append(r.streams, refStream{start: off, next: off + ln, seen: ln})
	return cutoff > 0 && ln >= cutoff
}

func (r *refPolicy) read(lba uint64, n int) string {
	seq := r.seq(lba, n, false)
	all := true
	for i := 0; i < n; i++ {
		all = all && r.cached[lba+uint64(i)]
	}
	if all {
		return "hit"
	}
	if seq {
		return "miss bypass"
	}
	need := r.st.PromoteNeed()
	k := 0
	for i := 0; i < n; i++ {
		b := lba + uint64(i)
		if r.cached[b] || need == 0 {
			continue
		}
		r.misses[b]++
		if r.misses[b] >= need {
			delete(r.misses, b)
			r.cached[b] = true
			k++
		}
	}
	if k > 0 {
		return fmt.Sprintf("miss promote=%d", k)
	}
	return "miss"
}

func (r *refPolicy) write(lba uint64, n int) string {
	seq := r.seq(lba, n, true)
	for i := 0; i < n; i++ {
		b := lba + uint64(i)
		r.cached[b] = !seq
		if !seq && r.st.Mode == Writeback {
			r.dirty[b] = true
		} else {
			delete(r.dirty, b)
		}
	}
	if seq {
		return "bypass"
	}
	return "cache"
}

// TestSequentialKernelTrace replays writes recorded as they reached
// Volume.WriteAt through real kernel paths (testdata/policy/*.writes, in
// arrival order; each file's header says how it was recorded) and checks
// how much of the file each wrote is found sequential at the default
// cutoff:
//   - dd of a 512 MiB file on ext4 on loop over nbdfuse: at least 448 MiB,
//     as TestKernelSequentialBypass requires through the binary;
//   - the kernel's NBD client with 4 connections and two writers in
//     alternate 1 MiB pieces of a 64 MiB file (TestKernelNBD's
//     c4-seq-bypass): at least 56 MiB (all but the first sequential_cutoff
//     and a little). Its writers drift more than 8 MiB apart; when a
//     late request had to be within policy.Window of the stream's end to fill
//     a hole, the one behind built a stream of its own, half holes, never
//     dense, and 33 MiB were found.
func TestSequentialKernelTrace(t *testing.T) {
	for _, tc := range []struct {
		trace      string
		file       func(lba, n int64) bool // the file's requests; the rest is ext4 metadata
		total, min int64                   // the file's MiB, and the least found sequential
	}{
		{"kernel-dd-loop-nbdfuse.writes", func(_, n int64) bool { return n >= 16 }, 500, 448},
		{"kernel-nbd-c4-two-writers.writes", func(lba, _ int64) bool { return lba >= 69632 && lba < 86016 }, 64, 56},
	} {
		t.Run(tc.trace, func(t *testing.T) {
			fh, err := os.Open("testdata/policy/" + tc.trace)
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			var p policy.State
			var file, seq int64
			sc := bufio.NewScanner(fh)
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) == 0 || strings.HasPrefix(f[0], "#") {
					continue
				}
				if len(f) != 3 || f[0] != "write" {
					t.Fatalf("bad line %q", sc.Text())
				}
				lba, err1 := strconv.ParseInt(f[1], 10, 64)
				n, err2 := strconv.ParseInt(f[2], 10, 64)
				if err1 != nil || err2 != nil {
					t.Fatalf("bad line %q", sc.Text())
				}
				isSeq := policy.Bypass(p.Sequential(lba*blockSize, n*blockSize), DefaultSettings().SequentialCutoff, 0)
				if tc.file(lba, n) {
					file += n * blockSize
					if isSeq {
						seq += n * blockSize
					}
				}
			}
			if err := sc.Err(); err != nil {
				t.Fatal(err)
			}
			if file < tc.total<<20 || seq < tc.min<<20 {
				t.Fatalf("%d of the file's %d MiB found sequential, want at least %d of %d", seq>>20, file>>20, tc.min, tc.total)
			}
			t.Logf("%d of the file's %d MiB found sequential", seq>>20, file>>20)
		})
	}
}

// TestStreamRoomBound writes streams twice the cache's size, one alone and
// then four interleaved, into a cache nothing is written back from, and
// checks what the room rule promises: the streams go to the cache first
// (together about half the room, or more when several share it) and
// never take the dirty data past the throttle point, however long they
// are; the rest bypasses.
func TestStreamRoomBound(t *testing.T) {
	for _, writers := range []int{1, 4} {
		t.Run(fmt.Sprintf("%d writers", writers), func(t *testing.T) {
			s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 4096*blockSize)
			v := s.vols[0]
			st := v.Settings()
			st.SequentialCutoff = 16 << 10
			if err := v.SetSettings(st); err != nil {
				t.Fatal(err)
			}
			room0 := v.streamRoom() / blockSize // blocks
			const req = 4                       // blocks per write
			total := 2 * 64 * 16 / writers      // blocks per writer: together twice the cache
			for i := 0; i < total/req; i++ {
				for w := 0; w < writers; w++ {
					off := int64(w*1024+i*req) * blockSize
					if err := v.WriteAt(make([]byte, req*blockSize), off, false); err != nil {
						t.Fatal(err)
					}
				}
			}
			vs := v.Stats()
			cached := int64(vs.WriteBytes-vs.BypassSequentialBytes) / blockSize
			t.Logf("room %d blocks; %d of %d blocks written went to the cache, %d dirty", room0, cached, vs.WriteBytes/blockSize, vs.DirtyBlocks)
			if vs.DirtyBlocks != cached || cached >= room0 {
				t.Errorf("%d blocks dirty, %d cached of %d written: want them equal and below the room (%d)", vs.DirtyBlocks, cached, vs.WriteBytes/blockSize, room0)
			}
			// n streams stop when each is as long as the room they left:
			// together n/(n+1) of it.
			if want := room0 * int64(writers) / int64(writers+1); cached < want-int64(writers*req) {
				t.Errorf("%d blocks of %d writers' streams went to the cache, want about %d (room %d)", cached, writers, want, room0)
			}
		})
	}
}

// TestStreamRoomShortFree: a cache whose free buckets are short has no room
// for streams even when nothing in it is dirty (eviction is behind; a
// stream would wait for it).
func TestStreamRoomShortFree(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 4096*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.Mode, st.SequentialCutoff = Writethrough, 0 // clean data, nothing bypassed
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	if v.streamRoom() == 0 {
		t.Fatal("no room in an empty cache")
	}
	for lba := int64(0); ; lba += 16 {
		s.mu.Lock()
		short := len(s.mu.free) < s.lowWater()
		s.mu.Unlock()
		if short {
			break
		}
		if err := v.WriteAt(make([]byte, 16*blockSize), lba*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if vs := v.Stats(); vs.DirtyBlocks != 0 || v.streamRoom() != 0 {
		t.Fatalf("free buckets short, %d blocks dirty: room %d bytes, want 0 dirty and no room", vs.DirtyBlocks, v.streamRoom())
	}
}

// TestStreamYieldRecorded: random writes and the part of a write stream
// that goes to the cache (room for it) do not make writeback yield; once
// the stream bypasses, the set tells the rate decision so
// (writeback.RateIn.Stream, whose rule writeback's TestRate holds), and
// wbRate writes nothing back although the volume is above its writeback
// target and busy.
// Regression test: a 512 MiB sequential write after 256 MiB of 4 KiB
// random overwrites of 32 MiB (S8, 256 MiB cache) ran at 0.81 (epoch) and
// 0.90 (lba) of the plain HDD model, with 25-44 MiB of the history's dirty
// data written back while the stream bypassed to the same disk.
func TestStreamYieldRecorded(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 4096*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.SequentialCutoff = 16 << 10
	st.WritebackOrder = OrderLBA
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	// Dirty data above the target (10 % of 1024 blocks), scattered.
	for i := int64(0); i < 200; i++ {
		if err := v.WriteAt(make([]byte, blockSize), (2048+i*7)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if v.streamBypassing() {
		t.Fatal("random writes recorded as a bypassing stream")
	}
	if r := s.wbRate(v); r == 0 {
		t.Fatalf("wbRate %d above the target with no stream, want writeback", r)
	}
	// A stream: the first part goes to the cache, the rest bypasses.
	for lba := int64(0); lba < 1024; lba += 4 {
		if err := v.WriteAt(make([]byte, 4*blockSize), lba*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	vs := v.Stats()
	if vs.BypassSequentialBytes == 0 || v.pol.StreamAt.Load() == 0 {
		t.Fatalf("%d bytes bypassed as sequential, stream recorded at %d: want both", vs.BypassSequentialBytes, v.pol.StreamAt.Load())
	}
	// Bypassing within writeback.IdleAfter (200 ms) of the last write:
	// asked again right after a write of the stream.
	if err := v.WriteAt(make([]byte, 4*blockSize), 1024*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if !v.streamBypassing() {
		t.Skip("the machine took longer than writeback.IdleAfter between two statements")
	}
	if r := s.wbRate(v); r != 0 {
		t.Errorf("wbRate %d while a stream bypasses, want 0 (yield)", r)
	}
}
