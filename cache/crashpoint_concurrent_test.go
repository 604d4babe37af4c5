package cache

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
)

var (
	flagCPCSeed = flag.Int64("cpc-seed", -1, "TestCrashPointsConcurrent: run this workload seed only")
	flagCPCAt   = flag.Int("cpc-at", -1, "TestCrashPointsConcurrent: run this crash point only (with -cpc-seed)")
)

// TestCrashPointsConcurrent cuts the power at device operation N (a write,
// write-zeroes, discard or sync of the cache or backing device, numbered in
// one sequence as in TestCrashPoints) while several clients write, FUA-write,
// zero, trim, read and flush their own regions of a volume concurrently, a
// settings goroutine switches modes and writeback orders, and the set's
// background goroutines (periodic commit, writeback, GC) run. Every device
// is cloned at that instant in three ways (unsynced data lost, kept, torn
// per sector), each clone is reopened, must pass Check, and every sector of
// every client's region must hold its newest version a successful Flush or
// FUA reply covered, or a version written since (ccWorker.checkCrash).
//
// Flush and FUA replies count whenever they return success, also after the
// crash instant: every device operation after it fails, so a flush that
// succeeds then claims only data that was durable at the instant, and the
// clone must hold it. (A write's failure after the crash is expected; one
// before it, with no fault injected, fails the test.)
//
// Per seed, a run without a crash counts the workload's device operations
// M; then crash points are drawn from the seed in [0, M) (all of them with
// TIERCACHE_CRASHPOINTCONC_POINTS=all). The seed fixes each client's
// operations, the settings changes, the geometry and N; the interleaving of
// the goroutines does not replay, so the operation at N differs between
// runs of the same (seed, N), and a replay repeats the workload, not the
// schedule. Replay: -run TestCrashPointsConcurrent -cpc-seed S -cpc-at N.
func TestCrashPointsConcurrent(t *testing.T) {
	def, points := 40, 24
	if testing.Short() || raceEnabled {
		def, points = 20, 16 // about 10 s with -race on 2 shared cores
	}
	first, n := stressSeeds(t, "CRASHPOINTCONC", def)
	all := false
	if v := os.Getenv("TIERCACHE_CRASHPOINTCONC_POINTS"); v == "all" {
		all = true
	} else if v != "" {
		var err error
		if points, err = strconv.Atoi(v); err != nil || points < 1 {
			t.Fatalf("TIERCACHE_CRASHPOINTCONC_POINTS=%q: want a positive number or all", v)
		}
	}
	if *flagCPCSeed >= 0 {
		first, n = uint64(*flagCPCSeed), 1
	}
	var st struct {
		runs, crashed, clones, afterCrashOK, workerErrs int
		ops                                             []int
	}
	start := time.Now()
	for seed := first; seed < first+n; seed++ {
		var ats []int
		if *flagCPCAt >= 0 {
			ats = []int{*flagCPCAt}
		} else {
			res := runCPC(t, seed, -1)
			if t.Failed() {
				return
			}
			st.runs++
			st.ops = append(st.ops, res.ops)
			prng := rand.New(rand.NewPCG(seed, 0x9c))
			if all {
				for at := 0; at < res.ops; at++ {
					ats = append(ats, at)
				}
			} else {
				for range points {
					ats = append(ats, prng.IntN(res.ops))
				}
			}
		}
		for _, at := range ats {
			res := runCPC(t, seed, at)
			if t.Failed() {
				return
			}
			st.runs++
			if res.crashed {
				st.crashed++
				st.clones += 3
			}
			st.afterCrashOK += res.afterCrashOK
			st.workerErrs += res.workerErrs
		}
	}
	t.Logf("seeds %d..%d: %d runs, %d power cuts (%d clones checked), device ops per uncut run %v; after the cut %d client requests failed and %d flush/FUA replies still succeeded; %v",
		first, first+n-1, st.runs, st.crashed, st.clones, summarizeInts(st.ops), st.workerErrs, st.afterCrashOK, time.Since(start).Round(time.Millisecond))
	if st.crashed == 0 && *flagCPCAt < 0 {
		t.Errorf("no run reached its crash point: the test checks nothing")
	}
}

// summarizeInts renders min..max of xs.
func summarizeInts(xs []int) string {
	if len(xs) == 0 {
		return "-"
	}
	lo, hi := xs[0], xs[0]
	for _, x := range xs {
		lo, hi = min(lo, x), max(hi, x)
	}
	return fmt.Sprintf("%d..%d", lo, hi)
}

type cpcResult struct {
	ops          int  // device operations counted
	crashed      bool // the crash point was reached
	afterCrashOK int  // flush/FUA replies that succeeded after the crash instant
	workerErrs   int  // client requests that failed (after the crash)
}

// runCPC runs seed's workload with the power cut at device operation at
// (-1: none) and checks what survives.
func runCPC(t *testing.T, seed uint64, at int) cpcResult {
	const (
		nworkers = 3
		region   = 12 * blockSize
		nops     = 40 // per client
	)
	rng := rand.New(rand.NewPCG(seed, 0xc0c))
	w := newWorld(cpCrash, at, rand.New(rand.NewPCG(seed, uint64(at+1))))
	bs := int64(blockSize) * int64(2+rng.IntN(3))
	nb := int64(minBuckets + rng.IntN(4))
	cache := w.add("cache", device.NewMem(cacheSizeForPaged(nb, bs, minJournalLen, 1, testIndexPages(seed))))
	back := w.add("back0", device.NewMem(nworkers*region))
	specs := []BackingSpec{{Name: "vol0", Dev: back}}
	mode := Mode(rng.IntN(4))
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: mode, markShift: testMarkShift(seed), IndexPages: testIndexPages(seed)}); err != nil {
		t.Fatal(err)
	}
	log := &cpLog{}
	s, err := Open(cache, specs, OpenOptions{Logger: slog.New(log)})
	if err != nil {
		t.Fatal(err)
	}
	v := s.vols[0]
	cfg := v.Settings()
	cfg.WritebackOrder = []WritebackOrder{OrderEpoch, OrderLBA}[rng.IntN(2)]
	cfg.WritebackPercent = []int{0, 10, 100}[rng.IntN(3)]
	if err := v.SetSettings(cfg); err != nil {
		t.Fatal(err)
	}
	workers := make([]*ccWorker, nworkers)
	for i := range workers {
		workers[i] = &ccWorker{id: i, base: int64(i) * region, size: region}
		workers[i].reset(make([]byte, region))
	}
	fail := func(format string, args ...any) {
		t.Helper()
		w.mu.Lock()
		ops := strings.Join(w.ops, "\n  ")
		w.mu.Unlock()
		log.mu.Lock()
		recs := strings.Join(log.recs, "\n  ")
		log.mu.Unlock()
		t.Fatalf("seed %d N=%d (%s), %v, order %s: %s\nreplay: go test ./cache -run 'TestCrashPointsConcurrent$' -cpc-seed %d -cpc-at %d -v (the interleaving does not replay)\noperations counted:\n  %s\nlog:\n  %s",
			seed, at, w.hit, mode, cfg.WritebackOrder, fmt.Sprintf(format, args...), seed, at, ops, recs)
	}

	var res cpcResult
	var mu sync.Mutex // guards res and errs
	var errs []string
	w.arm(true)
	var wg sync.WaitGroup
	for _, cw := range workers {
		wseed := rng.Uint64()
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, err := cw.runOps(v, rand.New(rand.NewPCG(wseed, 3)), nops, w.fired)
			mu.Lock()
			defer mu.Unlock()
			res.afterCrashOK += ok
			if err != nil {
				res.workerErrs++
				if !w.fired() || errors.Is(err, errWrongRead) {
					errs = append(errs, err.Error())
				}
			}
		}()
	}
	sseed := rng.Uint64()
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := rand.New(rand.NewPCG(sseed, 4))
		for range 4 {
			time.Sleep(time.Duration(r.IntN(1500)) * time.Microsecond)
			var err error
			if r.IntN(2) == 0 {
				err = v.SetMode(Mode(r.IntN(4)))
			} else {
				c := v.Settings()
				c.WritebackOrder = []WritebackOrder{OrderEpoch, OrderLBA}[r.IntN(2)]
				c.WritebackPercent = []int{0, 10, 100}[r.IntN(3)]
				err = v.SetSettings(c)
			}
			if err != nil {
				if !w.fired() {
					mu.Lock()
					errs = append(errs, fmt.Sprintf("settings: %v", err))
					mu.Unlock()
				}
				return
			}
		}
	}()
	wg.Wait()
	w.arm(false)
	res.ops = w.counted()
	res.crashed = w.fired()
	if len(errs) > 0 {
		s.crashStop()
		fail("%s", strings.Join(errs, "\n"))
	}
	durable := make([][]uint64, nworkers)
	for i, cw := range workers {
		cw.mu.Lock()
		durable[i] = append([]uint64(nil), cw.durable...)
		cw.mu.Unlock()
	}
	var images [][]*device.Mem
	var names []string
	if res.crashed {
		s.crashStop()
		images = w.clones
		for _, c := range w.cfgs {
			names = append(names, fmt.Sprintf("power cut at N (unsynced keep=%.1f torn=%.1f)", c.UnsyncedKeep, c.TornProb))
		}
	} else {
		// No crash: the set must read back exactly, and what was
		// flushed must survive a power cut now.
		if err := s.Check(); err != nil {
			s.crashStop()
			fail("Check: %v", err)
		}
		for _, cw := range workers {
			got := make([]byte, region)
			if err := v.ReadAt(got, cw.base); err != nil {
				s.crashStop()
				fail("read: %v", err)
			}
			cw.mu.Lock()
			err := cw.checkLive(got, 0)
			cw.mu.Unlock()
			if err != nil {
				s.crashStop()
				fail("live read after the workload: %v", err)
			}
		}
		var cut []*device.Mem
		for _, d := range w.devs {
			cut = append(cut, d.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 0}))
		}
		s.crashStop()
		images, names = [][]*device.Mem{cut}, []string{"power cut after the workload"}
	}
	for k, img := range images {
		s2, err := Open(img[0], []BackingSpec{{Name: "vol0", Dev: img[1]}}, OpenOptions{Logger: slog.New(&cpLog{}), testing: testingKnobs{noBackground: true}})
		if err != nil {
			fail("%s: reopen: %v", names[k], err)
		}
		if err := s2.Check(); err != nil {
			s2.crashStop()
			fail("%s: Check: %v", names[k], err)
		}
		if err := checkCleanCoherent(s2); err != nil {
			s2.crashStop()
			fail("%s: %v", names[k], err)
		}
		for i, cw := range workers {
			got := make([]byte, region)
			if err := s2.vols[0].ReadAt(got, cw.base); err != nil {
				s2.crashStop()
				fail("%s: read: %v", names[k], err)
			}
			cw.mu.Lock()
			err := cw.checkCrash(got, durable[i])
			cw.mu.Unlock()
			if err != nil {
				s2.crashStop()
				fail("%s: %v", names[k], err)
			}
		}
		s2.crashStop()
	}
	return res
}

// errWrongRead marks a read that returned data it must not (always a
// failure, before or after the crash).
var errWrongRead = errors.New("wrong data read")

// runOps runs n seeded operations of the client on its region. It stops at
// the first failed request (expected once crashed() is true) and returns
// that error, and how many Flush or FUA replies succeeded after crashed()
// became true.
func (w *ccWorker) runOps(v *Volume, rng *rand.Rand, n int, crashed func() bool) (afterCrashOK int, err error) {
	note := func() {
		if crashed() {
			afterCrashOK++
		}
	}
	for range n {
		off, ln := w.randRange(rng)
		switch k := rng.IntN(20); {
		case k < 9:
			fua, err := w.write(v, rng, off, ln)
			if err != nil {
				return afterCrashOK, err
			}
			if fua {
				note()
			}
		case k < 11:
			idx := w.issue(make([]byte, ln), off)
			if err := v.WriteZeroes(w.base+off, ln, false, true, false); err != nil {
				return afterCrashOK, fmt.Errorf("worker %d: write-zeroes: %w", w.id, err)
			}
			w.completed(idx, off, ln, false)
		case k < 13:
			a := (off + blockSize - 1) / blockSize
			b := (off + ln) / blockSize
			idx := w.trim(a, b-a)
			if err := v.Trim(w.base+off, ln, false); err != nil {
				return afterCrashOK, fmt.Errorf("worker %d: trim: %w", w.id, err)
			}
			w.completed(idx, off, ln, false)
		case k < 16:
			w.mu.Lock()
			upto := w.done
			w.mu.Unlock()
			if err := v.Flush(); err != nil {
				return afterCrashOK, fmt.Errorf("worker %d: flush: %w", w.id, err)
			}
			w.flushed(upto)
			note()
		default:
			got := make([]byte, ln)
			if err := v.ReadAt(got, w.base+off); err != nil {
				return afterCrashOK, fmt.Errorf("worker %d: read: %w", w.id, err)
			}
			w.mu.Lock()
			err := w.checkLive(got, off)
			w.mu.Unlock()
			if err != nil {
				return afterCrashOK, fmt.Errorf("%w: %w", errWrongRead, err)
			}
		}
	}
	return afterCrashOK, nil
}
