package cache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
)

// TestMeasureCliff reproduces, scaled down, the cliff of a cache full of
// dirty data and superseded versions (issue 14): 4 KiB random overwrites of
// a region at queue depth 16 with a flush every 32 writes, until dirty data
// plus superseded versions fill most of the cache, then a sequential write
// of half the cache in 1 MiB requests at queue depth 4. The same
// sequential write goes straight to a second HDD model for comparison.
// Figures only; run with
//
//	go test ./cache -run TestMeasureCliff -measure -v
func TestMeasureCliff(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	for _, order := range []string{"lba", "epoch"} {
		t.Run(order, func(t *testing.T) { measureCliff(t, order) })
	}
}

// cliffResult is what measureCliffRun saw.
type cliffResult struct {
	fillWrites        int
	fillWall          time.Duration
	seqBytes, seqWant int64
	seqWall           time.Duration
	finished          bool
	p999, maxWait     time.Duration
	before, after     VolumeStats
	freeBefore        int
	bareWall          time.Duration
}

func (r cliffResult) String() string {
	ratio := 0.0
	if r.seqWall > 0 && r.bareWall > 0 {
		ratio = float64(r.seqBytes) / r.seqWall.Seconds() / (float64(r.seqWant) / r.bareWall.Seconds())
	}
	return fmt.Sprintf("fill: %d writes in %v wall, then %d MiB dirty + %d MiB superseded, %d free buckets; "+
		"sequential: %d MiB in %v wall (finished %v; bare model %v wall, %.2fx of bare), p99.9 write %v, max %v, "+
		"space waits %v, bypassed sequential %d MiB, cache-full %d MiB, written back %d MiB; degrades %d (%s), backing consistent %v",
		r.fillWrites, r.fillWall.Round(time.Millisecond),
		r.before.DirtyBlocks*blockSize>>20, r.before.SupersededBlocks*blockSize>>20, r.freeBefore,
		r.seqBytes>>20, r.seqWall.Round(time.Millisecond), r.finished, r.bareWall.Round(time.Millisecond), ratio,
		r.p999.Round(time.Microsecond), r.maxWait.Round(time.Microsecond),
		time.Duration(r.after.SpaceWaitNanos-r.before.SpaceWaitNanos).Round(time.Millisecond),
		(r.after.BypassSequentialBytes-r.before.BypassSequentialBytes)>>20,
		(r.after.BypassCacheFullBytes-r.before.BypassCacheFullBytes)>>20,
		(r.after.WritebackBytes-r.before.WritebackBytes)>>20,
		r.after.WritebackDegrades, r.after.DegradeReason, r.after.BackingConsistent)
}

func measureCliff(t *testing.T, order string) {
	const (
		buckets   = 128      // 128 MiB cache
		region    = 16 << 20 // overwritten region
		seqAt     = 512 << 20
		seqBytes  = 64 << 20
		fillLimit = 60 * time.Second
		seqLimit  = 60 * time.Second
	)
	hdd := measureHDD(t, 1<<30, measureScale)
	st := DefaultSettings()
	st.WritebackOrder = orderOf(order)
	s := measureSet(t, buckets, hdd, st)
	v, _ := s.Volume("hdd")
	r := cliffRun(t, s, v, region, seqAt, seqBytes, fillLimit, seqLimit)
	bare := measureHDD(t, 1<<30, measureScale)
	r.bareWall = seqWriteDirect(t, bare, seqAt, seqBytes)
	t.Logf("%s: %v", order, r)
}

// fillWrites bounds the first phase (in lba order the cache never fills
// with superseded versions).
const fillWrites = 40000

// cliffRun runs the two phases on v and returns what it saw.
func cliffRun(t *testing.T, s *Set, v *Volume, region, seqAt, seqBytes int64, fillLimit, seqLimit time.Duration) cliffResult {
	var r cliffResult
	// Phase 1: random overwrites at QD16, a flush every 32 writes per
	// writer, until dirty + superseded fill 85 % of the cache (or
	// fillWrites writes, or time).
	total := s.mu.CacheBlocks()
	var stop atomic.Bool
	var writes atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 14))
			buf := make([]byte, blockSize)
			for i := 0; !stop.Load(); i++ {
				buf[0] = byte(i)
				off := int64(rng.IntN(int(region/blockSize))) * blockSize
				if err := v.WriteAt(buf, off, false); err != nil {
					t.Error(err)
					return
				}
				writes.Add(1)
				if i%32 == 31 {
					if err := v.Flush(); err != nil {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	for time.Since(start) < fillLimit && writes.Load() < fillWrites {
		time.Sleep(20 * time.Millisecond)
		st := v.Stats()
		if float64(st.DirtyBlocks+st.SupersededBlocks) >= 0.85*float64(total) {
			break
		}
	}
	stop.Store(true)
	wg.Wait()
	r.fillWrites, r.fillWall = int(writes.Load()), time.Since(start)
	r.before = v.Stats()
	s.mu.Lock()
	r.freeBefore = len(s.mu.free)
	s.mu.Unlock()
	// Phase 2: a sequential write, 1 MiB requests at QD4.
	const req = 1 << 20
	var next atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	deadline := time.Now().Add(seqLimit)
	start = time.Now()
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, req)
			for time.Now().Before(deadline) {
				i := next.Add(1) - 1
				if i*req >= seqBytes {
					return
				}
				t0 := time.Now()
				if err := v.WriteAt(buf, seqAt+i*req, false); err != nil {
					t.Error(err)
					return
				}
				d := time.Since(t0)
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := v.Flush(); err != nil {
		t.Error(err)
	}
	r.seqWall = time.Since(start)
	r.after = v.Stats()
	r.seqBytes = int64(len(lat)) * req
	r.seqWant = seqBytes
	r.finished = r.seqBytes >= seqBytes
	slices.Sort(lat)
	if len(lat) > 0 {
		r.p999, r.maxWait = lat[len(lat)*999/1000], lat[len(lat)-1]
	}
	return r
}

// seqWriteDirect writes n bytes at off to d in 1 MiB requests at QD4, then
// syncs; it returns the wall time.
func seqWriteDirect(t *testing.T, d device.Device, off, n int64) time.Duration {
	t.Helper()
	const req = 1 << 20
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, req)
			for {
				i := next.Add(1) - 1
				if i*req >= n {
					return
				}
				if _, err := d.WriteAt(buf, off+i*req); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}
