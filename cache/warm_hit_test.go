package cache

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestWarmHitRatio is the warm-after-crash promise measured: in every mode,
// a fixed read set's hit ratio just before a power cut at a random point
// of a mixed workload and just after the restart differ by at most 5
// percentage points, and every block reads back allowed data.
//
// The workload, with the background goroutines running: reads of random
// blocks (promoted on miss), writes of one block (nine in ten in a hot
// area of a quarter of the volume the read set is not in, the rest
// anywhere, read set included), trims, and a FLUSH every 16 operations. The
// read set (a quarter of the volume) is read and flushed once before the
// workload. Regions are 16 blocks.
//
// Seeds: TIERCACHE_WARMHIT_SEEDS (default 4 per mode), from
// TIERCACHE_WARMHIT_START; a failure prints its seed.
func TestWarmHitRatio(t *testing.T) {
	first, n := stressSeeds(t, "WARMHIT", 4)
	for _, mode := range []Mode{Writeback, Writethrough, Writearound, None} {
		t.Run(mode.String(), func(t *testing.T) {
			var worst float64
			for seed := first; seed < first+n; seed++ {
				before, after := runWarmHit(t, mode, seed)
				d := before - after
				if d < 0 {
					d = -d
				}
				worst = max(worst, d)
				if d > 0.05 {
					t.Fatalf("seed %d: read set hit ratio %.3f before the power cut, %.3f after the restart (replay: -run 'TestWarmHitRatio/%v' with TIERCACHE_WARMHIT_START=%d TIERCACHE_WARMHIT_SEEDS=1)",
						seed, before, after, mode, seed)
				}
			}
			t.Logf("%d seeds: largest hit ratio change %.1f points", n, 100*worst)
		})
	}
}

// runWarmHit runs one seed of TestWarmHitRatio and returns the read set's
// hit ratio before the power cut and after the restart.
func runWarmHit(t *testing.T, mode Mode, seed uint64) (before, after float64) {
	t.Helper()
	const nblk = 512
	rng := rand.New(rand.NewPCG(seed, 0x3a2))
	cache := device.NewMem(cacheSizeFor(nblk/16+8, 16*blockSize, minJournalLen, 1))
	back := device.NewMem(nblk * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 16 * blockSize, JournalSize: minJournalLen, Mode: Writethrough, markShift: 4}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.crashStop() }()
	v := s.vols[0]
	// The model: per block its allowed contents (three-state oracle:
	// durable, plus what was written since the last FLUSH).
	cur := make([][]byte, nblk)
	cand := make([][][]byte, nblk)
	for b := range cur {
		cur[b] = make([]byte, blockSize)
		cand[b] = [][]byte{cur[b]}
	}
	hot := nblk * 3 / 4
	readSet := rng.Perm(hot)[:nblk/4]
	id := uint64(0)
	check := func(what string, b int, got []byte) {
		for _, c := range cand[b] {
			if bytes.Equal(got, c) {
				return
			}
		}
		t.Fatalf("seed %d %v: %s: block %d holds %s", seed, mode, what, b, describeSectors(got))
	}
	read := func(what string, b int) {
		got := make([]byte, blockSize)
		if err := v.ReadAt(got, int64(b)*blockSize); err != nil {
			t.Fatalf("seed %d: %s: %v", seed, what, err)
		}
		check(what, b, got)
	}
	flush := func() {
		if err := v.Flush(); err != nil {
			t.Fatalf("seed %d: flush: %v", seed, err)
		}
		for b := range cand {
			cand[b] = [][]byte{cur[b]}
		}
	}
	// hitRatio reads the read set through v and returns the share of its
	// bytes served from the cache.
	hitRatio := func(v *Volume, what string) float64 {
		st0 := v.Stats()
		for _, b := range readSet {
			read(what, b)
		}
		st := v.Stats()
		hit, miss := st.ReadHitBytes-st0.ReadHitBytes, st.ReadMissBytes-st0.ReadMissBytes
		return float64(hit) / float64(hit+miss)
	}
	hitRatio(v, "warm-up")
	flush()
	if err := v.SetMode(mode); err != nil {
		t.Fatal(err)
	}
	for range 50 + rng.IntN(400) {
		switch p := rng.IntN(100); {
		case p < 45:
			read("workload read", rng.IntN(nblk))
		case p < 90:
			b := hot + rng.IntN(nblk-hot)
			if rng.IntN(10) == 0 {
				b = rng.IntN(nblk)
			}
			id++
			p := make([]byte, blockSize)
			stamp(p, id, 0, int64(b)*blockSize)
			if err := v.WriteAt(p, int64(b)*blockSize, false); err != nil {
				t.Fatalf("seed %d: write: %v", seed, err)
			}
			cur[b] = p
			cand[b] = append(cand[b], p)
		case p < 94:
			b := hot + rng.IntN(nblk-hot)
			if err := v.Trim(int64(b)*blockSize, blockSize, false); err != nil {
				t.Fatalf("seed %d: trim: %v", seed, err)
			}
			// A trim may leave the old data or zeroes.
			z := make([]byte, blockSize)
			cand[b] = append(cand[b], z)
			cur[b] = z
		default:
			flush()
		}
		if rng.IntN(16) == 0 {
			flush()
		}
	}
	before = hitRatio(v, "before the power cut")
	clones := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: []float64{0, 0.5, 1}[rng.IntN(3)], Rand: rng}, cache, back)
	s.crashStop()
	s2, err := Open(clones[0], []BackingSpec{{Name: "a", Dev: clones[1]}}, OpenOptions{})
	if err != nil {
		t.Fatalf("seed %d: reopen: %v", seed, err)
	}
	defer s2.crashStop()
	if err := checkCleanCoherent(s2); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	v = s2.vols[0]
	after = hitRatio(v, "after the restart")
	for b := range nblk {
		read("after the restart", b)
	}
	if err := s2.Check(); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	return before, after
}
