package cache

import (
	"context"
	"flag"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/model"
)

// Writeback figures over the HDD model (docs/MODELS.md). Figures only,
// nothing asserted; run with
//
//	go test ./cache -run TestMeasureWriteback -measure -v
//
// Times are model time (wall time divided by the model's TimeScale).

const measureScale = 0.2 // the HDD model runs 5x faster than real time

func measureHDD(t *testing.T, size int64, scale float64) *model.HDD {
	t.Helper()
	return wrapHDD(t, device.NewMem(size), scale)
}

// wrapHDD puts the default HDD model, at time scale scale, over inner.
func wrapHDD(t *testing.T, inner device.Device, scale float64) *model.HDD {
	t.Helper()
	p := model.DefaultHDD()
	p.TimeScale = scale
	h, err := model.NewHDD(inner, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// measureSet formats a set of nb 1 MiB buckets on a memory cache device in
// front of back.
func measureSet(t *testing.T, nb int64, back device.Device, st Settings) *Set {
	t.Helper()
	return measureSetKnobs(t, nb, back, st, testingKnobs{})
}

// measureSetKnobs is measureSet with the set opened with knobs.
func measureSetKnobs(t *testing.T, nb int64, back device.Device, st Settings, knobs testingKnobs) *Set {
	t.Helper()
	return measureSetOn(t, device.NewMem(measureCacheSize(nb)), back, st, knobs)
}

// measureCacheSize is the size of a measureSetOn cache device of nb buckets.
func measureCacheSize(nb int64) int64 { return cacheSizeFor(nb, 1<<20, 8<<20, 1) }

// measureSetOn formats a set of 1 MiB buckets on cache (measureCacheSize
// bytes) in front of back, opened with knobs.
func measureSetOn(t *testing.T, cache device.Device, back device.Device, st Settings, knobs testingKnobs) *Set {
	t.Helper()
	const bs = 1 << 20
	jl := int64(8 << 20)
	specs := []BackingSpec{{Name: "hdd", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bs, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	v, _ := s.Volume("hdd")
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	return s
}

// measureModelSet is measureSetOn with a 64-bucket cache device behind the
// SSD model (TimeScale scale) in front of hdd, default settings; it
// returns the set and its volume.
func measureModelSet(t *testing.T, hdd device.Device, scale float64) (*Set, *Volume) {
	t.Helper()
	cdev, err := model.Wrap(model.KindSSD, device.NewMem(measureCacheSize(64)), model.Params{TimeScale: scale})
	if err != nil {
		t.Fatal(err)
	}
	s := measureSetOn(t, cdev, hdd, DefaultSettings(), testingKnobs{})
	v, _ := s.Volume("hdd")
	return s, v
}

func modelTime(d time.Duration, scale float64) time.Duration {
	return time.Duration(float64(d) / scale)
}

// randomLBAs returns n distinct random block numbers below span.
func randomLBAs(n int, span uint64, seed uint64) []uint64 {
	rng := rand.New(rand.NewPCG(seed, 1))
	seen := map[uint64]bool{}
	var out []uint64
	for len(out) < n {
		l := rng.Uint64N(span)
		if !seen[l] {
			seen[l] = true
			out = append(out, l)
		}
	}
	return out
}

// writeDirect writes 4 KiB blocks at lbas to d with qd writers taking them
// in the given order, then syncs; it returns the elapsed wall time.
func writeDirect(t *testing.T, d device.Device, lbas []uint64, qd int) time.Duration {
	t.Helper()
	buf := make([]byte, blockSize)
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(lbas)) {
					return
				}
				if _, err := d.WriteAt(buf, int64(lbas[i])*blockSize); err != nil {
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

func TestMeasureWriteback(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	// The 1 GiB is the whole disk (a random seek crosses a share of the
	// full stroke), or the first 1 GiB of a 3 TB disk (short seeks), the
	// geometry of the issue's figures (docs/CACHE.md, "Drain versus
	// arrival order"). TestDrainOrders in device/model gives the direct
	// writes' figures in virtual time (exact; these on the real clock add
	// the notification delays of a loaded box, five times over at
	// TimeScale 0.2).
	for _, capacity := range []int64{0, 3e12} {
		name := "whole disk"
		if capacity > 0 {
			name = "3 TB disk"
		}
		t.Run(name, func(t *testing.T) { measureDrainOrders(t, capacity) })
	}
}

func measureDrainOrders(t *testing.T, capacity int64) {
	const span = 1 << 30
	const nblk = 64 << 20 / blockSize // 64 MiB of 4 KiB blocks
	lbas := randomLBAs(nblk, span/blockSize, 42)
	quiet := DefaultSettings()
	quiet.WritebackPercent = 100 // no background writeback while filling
	hddOf := func(wt bool, scale float64) *model.HDD {
		p := model.DefaultHDD()
		p.TimeScale, p.Capacity, p.WriteThrough = scale, capacity, wt
		h, err := model.NewHDD(device.NewMem(span), p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		return h
	}

	// 1. Sorted writeback (Drain) of 64 MiB random dirty blocks over 1 GiB,
	// on the real clock: at 5x the engine would have to issue ~10,000
	// writes a second of wall time, and on a loaded 2-core box the disk
	// then waits for the engine's CPU (the 3 TB disk was busy 8.2 s of
	// 10.1 at 0.2), which a real disk never asks of it.
	hdd := hddOf(false, 1)
	s := measureSet(t, 160, hdd, quiet)
	v, _ := s.Volume("hdd")
	buf := make([]byte, blockSize)
	for _, l := range lbas {
		if err := v.WriteAt(buf, int64(l)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if st := v.Stats(); st.DirtyBlocks != nblk {
		t.Fatalf("%d dirty blocks before drain, want %d", st.DirtyBlocks, nblk)
	}
	start := time.Now()
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	sorted := time.Since(start)
	hs := hdd.Stats()
	t.Logf("sorted writeback (Drain, QD%d): %v for 64 MiB = %.1f MB/s; HDD writes %d, seeks %d, busy %v (seek %v, rotation %v, transfer %v)",
		writeback.QueueDepth, sorted.Round(time.Millisecond), 64*1.048576/sorted.Seconds(), hs.Writes, hs.Seeks, hs.BusyTime, hs.SeekTime, hs.RotationalWait, hs.TransferTime)

	// 2. The same writes in arrival order at the same queue depth.
	arr := modelTime(writeDirect(t, hddOf(false, measureScale), lbas, writeback.QueueDepth), measureScale)
	t.Logf("arrival order QD%d: %v; sorted is %.2fx faster (bar 2.5x)", writeback.QueueDepth, arr.Round(time.Millisecond), arr.Seconds()/sorted.Seconds())

	// 3. A QD1 writer in arrival order, with the drive's write cache on
	// (a write completes in the cache, which destages it reordered, so
	// QD1 is QD32) and off (each write on the platter before the next, as
	// a database writing with O_DSYNC or FUA sees: the writer the bar
	// means, docs/CACHE.md).
	qd1 := modelTime(writeDirect(t, hddOf(false, measureScale), lbas, 1), measureScale)
	t.Logf("arrival order QD1, drive write cache on: %v; sorted is %.2fx faster", qd1.Round(time.Millisecond), qd1.Seconds()/sorted.Seconds())
	qd1wt := modelTime(writeDirect(t, hddOf(true, measureScale), lbas, 1), measureScale)
	t.Logf("arrival order QD1, drive write cache off (each write durable): %v; sorted is %.2fx faster (bar 8x)", qd1wt.Round(time.Millisecond), qd1wt.Seconds()/sorted.Seconds())
}

// TestMeasureIdleWriteback measures idle writeback of 64 MiB of sequential
// dirty data against the disk's sequential write bandwidth over the same
// range, on the real clock (at 5x, the copying done by the memory devices
// of this test would count five times over against 64 MiB that the disk
// writes in about half a second). Besides the ratio it reports what the
// time went to: the disk's busy time, the process's CPU time, and how
// often the drive had nothing to do (its write cache empty with data still
// to come) while writeback ran.
//
//	go test ./cache -run TestMeasureIdleWriteback -measure -v
func TestMeasureIdleWriteback(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	const span = 1 << 30
	seqSt := DefaultSettings()
	seqSt.WritebackPercent = 100 // nothing in the background while filling
	seqSt.SequentialCutoff = 0
	for round := range 4 {
		// Rounds 0 and 2 keep the backing data in memory; 1 and 3 drop it
		// (the model's timing does not depend on it): copying 64 MiB into
		// a memory device is CPU that a real disk's DMA does not cost the
		// host, and on a loaded box it competes with writeback's own.
		inner := device.Device(device.NewMem(span))
		what := "backing data in memory"
		if round%2 == 1 {
			inner, what = nullBack{span}, "backing data dropped"
		}
		hdd := wrapHDD(t, inner, 1)
		s := measureSet(t, 160, hdd, seqSt)
		v, _ := s.Volume("hdd")
		big := make([]byte, 64<<10)
		for off := int64(0); off < 64<<20; off += int64(len(big)) {
			if err := v.WriteAt(big, off, false); err != nil {
				t.Fatal(err)
			}
		}
		for hdd.Stats().Writes == 0 {
			time.Sleep(100 * time.Microsecond)
		}
		idleFrom := time.Now()
		cpu0 := cpuTime()
		if f := os.Getenv("IDLEPROF"); f != "" && round == 0 {
			pf, _ := os.Create(f)
			pprof.StartCPUProfile(pf)
		}
		starved, samples := 0, 0
		for v.Stats().DirtyBlocks > 0 {
			if hs := hdd.Stats(); hs.DirtyBytes == 0 && hs.BytesWritten < 64<<20 {
				starved++
			}
			samples++
			time.Sleep(time.Millisecond)
		}
		idle := time.Since(idleFrom)
		cpu := cpuTime() - cpu0
		if round == 0 {
			pprof.StopCPUProfile()
		}
		hs := hdd.Stats()
		// The disk's own sequential bandwidth (its data dropped: a memory
		// device's copying on a loaded box would lower it, not the disk).
		raw := wrapHDD(t, nullBack{span}, 1)
		mib := make([]byte, 1<<20)
		start := time.Now()
		for off := int64(0); off < 64<<20; off += 1 << 20 {
			if _, err := raw.WriteAt(mib, off); err != nil {
				t.Fatal(err)
			}
		}
		if err := raw.Sync(); err != nil {
			t.Fatal(err)
		}
		rawT := time.Since(start)
		t.Logf("round %d (%s): idle sequential writeback of 64 MiB: %v (%.1f MB/s); raw 1 MiB QD1 writes: %v (%.1f MB/s); ratio %.0f%% (bar 80%%); HDD busy %v in %d writes; process CPU %v; drive cache empty with data to come in %d of %d 1 ms samples",
			round, what, idle.Round(time.Millisecond), 67.108864/idle.Seconds(), rawT.Round(time.Millisecond), 67.108864/rawT.Seconds(), 100*rawT.Seconds()/idle.Seconds(),
			hs.BusyTime.Round(time.Millisecond), hs.Writes, cpu.Round(time.Millisecond), starved, samples)
	}
}

// nullBack is a backing device that keeps no data (reads return zeroes).
type nullBack struct{ size int64 }

func (n nullBack) ReadAt(p []byte, off int64) (int, error)  { clear(p); return len(p), nil }
func (n nullBack) WriteAt(p []byte, off int64) (int, error) { return len(p), nil }
func (n nullBack) Sync() error                              { return nil }
func (n nullBack) Size() int64                              { return n.size }
func (n nullBack) Close() error                             { return nil }
func (n nullBack) String() string                           { return "null" }

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestMeasureForegroundLatency runs random 4 KiB writes and reads against a
// small cache (48 MiB) over a real-time HDD model while writeback and GC
// run, and reports foreground latency percentiles. "sustained": writes over
// 32 MiB (the dirty set fits the cache; overwrites make garbage, so GC and
// writeback run all the time) and reads of a hot 4 MiB inside it (hits):
// every wait is engine bookkeeping or deliberate throttling. "overload":
// writes over 96 MiB, faster than the disk can absorb; writes that find no
// free bucket go to the disk, and reads of data not cached wait for the disk.
func TestMeasureForegroundLatency(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	for _, tc := range []struct {
		name            string
		span, hot, base int64
	}{{"sustained", 32 << 20, 4 << 20, 0}, {"overload", 96 << 20, 4 << 20, 512 << 20}} {
		for _, order := range []string{"epoch", "lba"} {
			for _, throttle := range []bool{true, false} {
				name := tc.name + "/" + order
				if !throttle {
					name += "/nothrottle"
				}
				t.Run(name, func(t *testing.T) {
					measureLatency(t, tc.span, tc.hot, tc.base, order, throttle)
				})
			}
		}
	}
}

var flagLatencyProfile = flag.String("latencyprofile", "", "TestMeasureForegroundLatency: write mutex and block profiles of each run to FILE.<run>.{mutex,block}")

func measureLatency(t *testing.T, span, hot, hotBase int64, order string, throttle bool) {
	if *flagLatencyProfile != "" {
		runtime.SetMutexProfileFraction(1)
		runtime.SetBlockProfileRate(int(100 * time.Microsecond))
		defer func() {
			for _, k := range []string{"mutex", "block"} {
				f, err := os.Create(*flagLatencyProfile + "." + strings.ReplaceAll(t.Name(), "/", "_") + "." + k)
				if err != nil {
					t.Fatal(err)
				}
				pprof.Lookup(k).WriteTo(f, 0)
				f.Close()
			}
			runtime.SetMutexProfileFraction(0)
			runtime.SetBlockProfileRate(0)
		}()
	}
	hdd := measureHDD(t, 1<<30, 1)
	cfg := DefaultSettings()
	cfg.WritebackOrder = orderOf(order)
	s := measureSetKnobs(t, 48, hdd, cfg, testingKnobs{noThrottle: !throttle})
	v, _ := s.Volume("hdd")
	const dur = 6 * time.Second
	var mu sync.Mutex
	var wlat, rlat []time.Duration
	var wg sync.WaitGroup
	stop := time.Now().Add(dur)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 9))
			buf := make([]byte, blockSize)
			var mine []time.Duration
			for time.Now().Before(stop) {
				off := int64(rng.Uint64N(uint64(span/blockSize))) * blockSize
				t0 := time.Now()
				if err := v.WriteAt(buf, off, false); err != nil {
					t.Error(err)
					return
				}
				mine = append(mine, time.Since(t0))
				time.Sleep(200 * time.Microsecond)
			}
			mu.Lock()
			wlat = append(wlat, mine...)
			mu.Unlock()
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(7, 9))
		buf := make([]byte, blockSize)
		var mine []time.Duration
		for time.Now().Before(stop) {
			off := hotBase + int64(rng.Int64N(hot/blockSize))*blockSize
			t0 := time.Now()
			if err := v.ReadAt(buf, off); err != nil {
				t.Error(err)
				return
			}
			mine = append(mine, time.Since(t0))
			time.Sleep(100 * time.Microsecond)
		}
		mu.Lock()
		rlat = append(rlat, mine...)
		mu.Unlock()
	}()
	// The box's own noise: how late a goroutine doing nothing but 200 µs
	// sleeps wakes up. A write's latency above this is the engine's.
	var probe []time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		for time.Now().Before(stop) {
			t0 := time.Now()
			time.Sleep(200 * time.Microsecond)
			probe = append(probe, time.Since(t0)-200*time.Microsecond)
		}
	}()
	wg.Wait()
	pct := func(l []time.Duration, p float64) time.Duration {
		if len(l) == 0 {
			return 0
		}
		slices.Sort(l)
		return l[min(int(float64(len(l))*p), len(l)-1)]
	}
	st, ss := v.Stats(), s.Stats()
	t.Logf("writes: %d, p50 %v p99 %v p99.9 %v max %v; throttled %v, waited for space %v in total; cache-full bypass %d KiB",
		len(wlat), pct(wlat, .5), pct(wlat, .99), pct(wlat, .999), pct(wlat, 1), time.Duration(st.ThrottleNanos), time.Duration(st.SpaceWaitNanos), st.BypassCacheFullBytes>>10)
	t.Logf("reads: %d (hit requests %d, miss requests %d), p50 %v p99 %v p99.9 %v max %v",
		len(rlat), st.ReadHitOps, st.ReadMissOps, pct(rlat, .5), pct(rlat, .99), pct(rlat, .999), pct(rlat, 1))
	t.Logf("wake-up delay of a 200 µs sleep (the box's noise): p50 %v p99 %v p99.9 %v max %v",
		pct(probe, .5), pct(probe, .99), pct(probe, .999), pct(probe, 1))
	t.Logf("writeback %d MiB, evictions %d, GC moves %d, dirty now %d KiB",
		st.WritebackBytes>>20, ss.Evictions, ss.GCMoves, st.DirtyBlocks*4)
}

// TestMeasureEpochVsLBA runs a pgbench-like overwrite workload (random 4 KiB
// writes over a 16 MiB hot set of a 1 GiB volume, a flush every 50 writes,
// 4 writers) against a 64 MiB cache over the HDD model, once per writeback
// order, then drains, and reports what each order cost.
func TestMeasureEpochVsLBA(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	for _, order := range []string{"lba", "epoch"} {
		t.Run(order, func(t *testing.T) {
			hdd := measureHDD(t, 1<<30, measureScale)
			st := DefaultSettings()
			st.WritebackOrder = orderOf(order)
			s := measureSet(t, 64, hdd, st)
			v, _ := s.Volume("hdd")
			const writers, perWriter = 4, 10000
			var wg sync.WaitGroup
			var mu sync.Mutex
			var lat []time.Duration
			var maxSup atomic.Int64
			start := time.Now()
			for g := range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(g), 3))
					buf := make([]byte, blockSize)
					var mine []time.Duration
					for i := range perWriter {
						off := int64(rng.IntN(16<<20/blockSize)) * blockSize
						t0 := time.Now()
						if err := v.WriteAt(buf, off, false); err != nil {
							t.Error(err)
							return
						}
						mine = append(mine, time.Since(t0))
						if i%50 == 49 {
							if err := v.Flush(); err != nil {
								t.Error(err)
								return
							}
							if n := v.Stats().SupersededBlocks; n > maxSup.Load() {
								maxSup.Store(n)
							}
						}
					}
					mu.Lock()
					lat = append(lat, mine...)
					mu.Unlock()
				}()
			}
			wg.Wait()
			work := time.Since(start)
			mid := v.Stats()
			t1 := time.Now()
			if err := s.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			drain := time.Since(t1)
			slices.Sort(lat)
			st2, hs := v.Stats(), hdd.Stats()
			t.Logf("%s: workload %v wall (%d writes, p99 %v, p99.9 %v, throttled %v); then drain %v model; written back %d MiB in %d HDD writes (%d MiB of it during the workload); up to %d superseded versions",
				order, work.Round(time.Millisecond), len(lat), lat[len(lat)*99/100], lat[len(lat)*999/1000],
				time.Duration(st2.ThrottleNanos).Round(time.Millisecond), modelTime(drain, measureScale).Round(time.Millisecond),
				st2.WritebackBytes>>20, hs.Writes, mid.WritebackBytes>>20, maxSup.Load())
		})
	}
}
