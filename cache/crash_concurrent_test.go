package cache

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
)

// TestCrashConcurrent crash-clones the devices at a random instant while
// several goroutines write, flush, FUA-write, zero and read their own
// regions and another switches modes, so crashes land in the middle of group
// commits, writeback and eviction. Durability is judged per block from what
// each goroutine had been told before the clone started: the allowed
// contents of a block are its last version covered by a Flush or FUA reply
// that returned before the clone, and every version written after it
// (including writes still in flight). Replay: -run TestCrashConcurrent -seed N.
func TestCrashConcurrent(t *testing.T) {
	def := 150
	if testing.Short() || raceEnabled {
		def = 30
	}
	first, n := stressSeeds(t, "CRASHCONC", def)
	if *flagSeed >= 0 {
		first, n = uint64(*flagSeed), 1
	}
	for seed := first; seed < first+n; seed++ {
		if !t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runCrashConcurrent(t, seed) }) {
			return
		}
	}
}

type ccVersion struct {
	idx  uint64
	data []byte
	// alt, if set, is also allowed: the block's content before a trim
	// (a trimmed block reads as zeroes or its old data), with any later
	// partial write applied.
	alt []byte
}

type ccWorker struct {
	id      int
	base    int64 // byte offset of the region
	size    int64
	mu      sync.Mutex
	cur     []byte
	hist    [][]ccVersion // per block
	durable []uint64      // per block: highest version idx known durable
	idx     uint64        // versions issued
	done    uint64        // highest write idx completed
	// alt, per block: the content a trimmed block may still read as (see
	// ccVersion.alt); nil once a write covers the whole block.
	alt [][]byte
}

func (w *ccWorker) reset(content []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cur = bytes.Clone(content)
	nb := int(w.size / blockSize)
	w.hist = make([][]ccVersion, nb)
	w.durable = make([]uint64, nb)
	w.alt = make([][]byte, nb)
	w.idx++
	for b := 0; b < nb; b++ {
		w.hist[b] = []ccVersion{{idx: w.idx, data: bytes.Clone(w.cur[b*blockSize : (b+1)*blockSize])}}
		w.durable[b] = w.idx
	}
	w.done = w.idx
}

// issue records a write of p at region offset off as a candidate before it
// is sent, and returns its version idx.
func (w *ccWorker) issue(p []byte, off int64) uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.idx++
	copy(w.cur[off:], p)
	for b := off / blockSize; b <= (off+int64(len(p))-1)/blockSize; b++ {
		if a := w.alt[b]; a != nil {
			if off <= b*blockSize && off+int64(len(p)) >= (b+1)*blockSize {
				w.alt[b] = nil
			} else {
				lo, hi := max(off, b*blockSize), min(off+int64(len(p)), (b+1)*blockSize)
				copy(a[lo-b*blockSize:hi-b*blockSize], p[lo-off:hi-off])
			}
		}
		w.hist[b] = append(w.hist[b], ccVersion{w.idx, bytes.Clone(w.cur[b*blockSize : (b+1)*blockSize]), bytes.Clone(w.alt[b])})
	}
	return w.idx
}

// trim records a trim of the whole blocks [first, first+n) of the region
// before it is sent: each reads as zeroes or as what it held, and may stay
// so (a trim need not discard anything).
func (w *ccWorker) trim(first, n int64) uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.idx++
	for b := first; b < first+n; b++ {
		blk := w.cur[b*blockSize : (b+1)*blockSize]
		if w.alt[b] == nil {
			w.alt[b] = bytes.Clone(blk)
		}
		clear(blk)
		w.hist[b] = append(w.hist[b], ccVersion{w.idx, bytes.Clone(blk), bytes.Clone(w.alt[b])})
	}
	return w.idx
}

// checkLive checks a read of [off, off+len(got)) of the region, which
// must return the latest completed writes (a trimmed block: zeroes or its
// alternative). REQUIRES: w.mu
func (w *ccWorker) checkLive(got []byte, off int64) error {
	for b := off / blockSize; b <= (off+int64(len(got))-1)/blockSize; b++ {
		lo, hi := max(off, b*blockSize), min(off+int64(len(got)), (b+1)*blockSize)
		g := got[lo-off : hi-off]
		if bytes.Equal(g, w.cur[lo:hi]) {
			continue
		}
		if a := w.alt[b]; a != nil && bytes.Equal(g, a[lo-b*blockSize:hi-b*blockSize]) {
			continue
		}
		return fmt.Errorf("worker %d: read at region offset %d+%d: block %d holds %s, want %s", w.id, off, len(got), b,
			describeSectors(g), describeSectors(w.cur[lo:hi]))
	}
	return nil
}

// checkCrash checks the region's content got after a crash, sector by
// sector (an unflushed write may be torn): each block holds its newest
// version known durable (durable, per block) or a version written since.
// REQUIRES: w.mu
func (w *ccWorker) checkCrash(got []byte, durable []uint64) error {
	for b := range w.hist {
		allowed := w.hist[b]
		// Drop versions older than the newest durable one.
		k := 0
		for j, ver := range allowed {
			if ver.idx <= durable[b] {
				k = j
			}
		}
		allowed = allowed[k:]
		g := got[b*blockSize : (b+1)*blockSize]
		for sct := 0; sct < blockSize; sct += 512 {
			ok := false
			for _, ver := range allowed {
				ok = ok || bytes.Equal(g[sct:sct+512], ver.data[sct:sct+512]) ||
					(ver.alt != nil && bytes.Equal(g[sct:sct+512], ver.alt[sct:sct+512]))
			}
			if !ok {
				var names []string
				for _, ver := range allowed {
					names = append(names, describeSectors(ver.data))
					if ver.alt != nil {
						names = append(names, "(or, trimmed) "+describeSectors(ver.alt))
					}
				}
				return fmt.Errorf("worker %d block %d sector %d holds %s; allowed %v", w.id, b, sct/512, describeSectors(g), names)
			}
		}
	}
	return nil
}

func (w *ccWorker) completed(idx uint64, off, n int64, fua bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done = max(w.done, idx)
	if fua {
		for b := off / blockSize; b <= (off+n-1)/blockSize; b++ {
			w.durable[b] = max(w.durable[b], idx)
		}
	}
}

func (w *ccWorker) flushed(upto uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for b := range w.durable {
		w.durable[b] = max(w.durable[b], upto)
	}
}

func runCrashConcurrent(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0xcc))
	const (
		nworkers = 3
		region   = 16 * blockSize
	)
	bs := int64(blockSize) * int64(2+rng.IntN(3))
	nb := int64(minBuckets + rng.IntN(4))
	cache := device.NewMem(cacheSizeForPaged(nb, bs, minJournalLen, 1, testIndexPages(seed)))
	back := device.NewMem(nworkers * region)
	specs := func() []BackingSpec { return []BackingSpec{{Name: "a", Dev: back}} }
	if _, err := Format(cache, specs(), FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: Mode(rng.IntN(4)), markShift: testMarkShift(seed), IndexPages: testIndexPages(seed)}); err != nil {
		t.Fatal(err)
	}
	workers := make([]*ccWorker, nworkers)
	for i := range workers {
		workers[i] = &ccWorker{id: i, base: int64(i) * region, size: region}
		workers[i].reset(make([]byte, region))
	}
	for round := 0; round < 3; round++ {
		s, err := Open(cache, specs(), OpenOptions{})
		if err != nil {
			t.Fatalf("seed %d round %d: open: %v", seed, round, err)
		}
		v := s.vols[0]
		var stop atomic.Bool
		var wg sync.WaitGroup
		errc := make(chan error, nworkers+1)
		for _, w := range workers {
			wg.Add(1)
			wseed := rng.Uint64()
			go func() {
				defer wg.Done()
				if err := w.run(v, rand.New(rand.NewPCG(wseed, 1)), &stop); err != nil {
					errc <- err
				}
			}()
		}
		wg.Add(1)
		mseed := rng.Uint64()
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(mseed, 2))
			for !stop.Load() {
				time.Sleep(time.Duration(r.IntN(2000)) * time.Microsecond)
				if r.IntN(2) == 0 {
					if err := v.SetMode(Mode(r.IntN(4))); err != nil {
						errc <- err
						return
					}
					continue
				}
				// All settings at once: bypass, promotion, writeback
				// targets (0 %: writeback runs all the time) and caps.
				st := v.Settings()
				st.SequentialCutoff = []int64{0, 16 << 10, 4 << 20}[r.IntN(3)]
				st.WritebackPercent = []int{0, 10, 100}[r.IntN(3)]
				st.Promote = []string{"always", "never", "after:2"}[r.IntN(3)]
				st.WritebackOrder = []WritebackOrder{OrderEpoch, OrderLBA}[r.IntN(2)]
				st.WritebackRateMax = []int64{0, 64 << 10}[r.IntN(2)]
				if err := v.SetSettings(st); err != nil {
					errc <- err
					return
				}
			}
		}()
		time.Sleep(time.Duration(rng.IntN(8000)) * time.Microsecond)
		// Durability as the workers know it now, before the clone starts.
		snap := make([][]uint64, nworkers)
		for i, w := range workers {
			w.mu.Lock()
			snap[i] = append([]uint64(nil), w.durable...)
			w.mu.Unlock()
		}
		cfg := device.CrashConfig{UnsyncedKeep: []float64{0, 0.5, 1}[rng.IntN(3)], TornProb: []float64{0, 0.2}[rng.IntN(2)], Rand: rng}
		// Both devices at one instant: a backing device cloned later
		// could hold writeback of data whose record the cache clone
		// lacks, which brings back an older clean entry over it.
		clones := device.CrashCloneAll(cfg, cache, back)
		cache2, back2 := clones[0], clones[1]
		stop.Store(true)
		wg.Wait()
		s.crashStop()
		close(errc)
		for err := range errc {
			t.Fatalf("seed %d round %d: %v", seed, round, err)
		}
		if err := s.Check(); err != nil {
			t.Fatalf("seed %d round %d: Check: %v", seed, round, err)
		}
		cache, back = cache2, back2
		s2, err := Open(cache, specs(), OpenOptions{})
		if err != nil {
			t.Fatalf("seed %d round %d: reopen after crash: %v", seed, round, err)
		}
		for i, w := range workers {
			got := make([]byte, region)
			if err := s2.vols[0].ReadAt(got, w.base); err != nil {
				t.Fatalf("seed %d round %d: read: %v", seed, round, err)
			}
			w.mu.Lock()
			err := w.checkCrash(got, snap[i])
			w.mu.Unlock()
			if err != nil {
				t.Fatalf("seed %d round %d: %v", seed, round, err)
			}
			w.reset(got)
		}
		if err := s2.Check(); err != nil {
			t.Fatalf("seed %d round %d: Check after reopen: %v", seed, round, err)
		}
		if err := checkCleanCoherent(s2); err != nil {
			t.Fatalf("seed %d round %d: after reopen: %v", seed, round, err)
		}
		s2.crashStop()
	}
}

func (w *ccWorker) run(v *Volume, rng *rand.Rand, stop *atomic.Bool) error {
	for op := uint64(0); !stop.Load(); op++ {
		off, n := w.randRange(rng)
		switch rng.IntN(10) {
		case 0, 1, 2, 3, 4:
			if _, err := w.write(v, rng, off, n); err != nil {
				return err
			}
		case 5:
			p := make([]byte, n)
			idx := w.issue(p, off)
			if err := v.WriteZeroes(w.base+off, n, false, true, false); err != nil {
				return fmt.Errorf("worker %d: write-zeroes: %w", w.id, err)
			}
			w.completed(idx, off, n, false)
		case 6:
			w.mu.Lock()
			upto := w.done
			w.mu.Unlock()
			if err := v.Flush(); err != nil {
				return fmt.Errorf("worker %d: flush: %w", w.id, err)
			}
			w.flushed(upto)
		default:
			got := make([]byte, n)
			if err := v.ReadAt(got, w.base+off); err != nil {
				return fmt.Errorf("worker %d: read: %w", w.id, err)
			}
			w.mu.Lock()
			err := w.checkLive(got, off)
			w.mu.Unlock()
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// randRange draws a range of the region: sector-granular, half of them
// block-aligned, up to 8 KiB.
func (w *ccWorker) randRange(rng *rand.Rand) (off, n int64) {
	off = rng.Int64N(w.size/512) * 512
	if rng.IntN(2) == 0 {
		off = off / blockSize * blockSize
	}
	return off, min(int64(1+rng.IntN(16))*512, w.size-off)
}

// write writes a stamped range at region offset off, with FUA one time in
// five, and tracks it.
func (w *ccWorker) write(v *Volume, rng *rand.Rand, off, n int64) (fua bool, err error) {
	p := make([]byte, n)
	fua = rng.IntN(5) == 0
	w.mu.Lock()
	tag := w.idx + 1
	w.mu.Unlock()
	stamp(p, uint64(w.id)<<40|tag, 0, w.base+off)
	idx := w.issue(p, off)
	if err := v.WriteAt(p, w.base+off, fua); err != nil {
		return fua, fmt.Errorf("worker %d: write: %w", w.id, err)
	}
	w.completed(idx, off, n, fua)
	return fua, nil
}
