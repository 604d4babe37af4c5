package writeback

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestRate: the rate decision, a table over dirty counts around the
// target (10 % of the cache) and half way to a full cache.
func TestRate(t *testing.T) {
	const total = 256 * 64
	target := int64(total / 10)
	for _, tc := range []struct {
		dirty  int64
		urgent bool
		want   int64
	}{
		{0, false, 0},
		{target, false, 0},
		{target + 1, false, wbMinRate},
		{target + wbHorizon*wbMinRate/2, false, wbMinRate},
		{(target+total)/2 - 1, false, ((target+total)/2 - 1 - target) / wbHorizon},
		{(target + total) / 2, false, -1},
		{total, false, -1},
		{1, true, -1},
		{target + 400*wbHorizon, false, 400}, // growing with the excess
	} {
		got, wake := Rate(RateIn{Dirty: tc.dirty, CacheBlocks: total, Percent: 10, Urgent: tc.urgent})
		if got != tc.want {
			t.Errorf("dirty %d urgent %t: rate %d, want %d", tc.dirty, tc.urgent, got, tc.want)
		}
		if got == 0 && wake != max(target+1, 1) && !(tc.dirty == 0 && wake == 1) {
			t.Errorf("dirty %d: wake level %d, want %d", tc.dirty, wake, target+1)
		}
	}
	if got, _ := Rate(RateIn{Dirty: target + 1, CacheBlocks: total, Percent: 10, Draining: true}); got != 0 {
		t.Errorf("draining: rate %d, want 0 (Drain sweeps itself)", got)
	}
	// A write stream bypassing to the backing device: nothing below the
	// full-speed level, however urgent otherwise (free buckets short, a
	// catch-up), and a kick at that level; full speed from it on.
	full := (target + total) / 2
	for _, tc := range []struct {
		dirty  int64
		urgent bool
		want   int64
	}{
		{1, false, 0},
		{target + 400*wbHorizon, false, 0},
		{target + 400*wbHorizon, true, 0},
		{full - 1, true, 0},
		{full, false, -1},
		{total, false, -1},
	} {
		got, wake := Rate(RateIn{Dirty: tc.dirty, CacheBlocks: total, Percent: 10, Urgent: tc.urgent, Stream: true})
		if got != tc.want {
			t.Errorf("stream, dirty %d urgent %t: rate %d, want %d", tc.dirty, tc.urgent, got, tc.want)
		}
		if got == 0 && wake != full {
			t.Errorf("stream, dirty %d: wake level %d, want %d", tc.dirty, wake, full)
		}
	}
}

// TestThrottleAccrues: throttle delays accrue per volume and are slept in
// pieces of at least throttleQuantum, and concurrent writers together
// sleep exactly the delays they accrued (none lost, none doubled).
func TestThrottleAccrues(t *testing.T) {
	var w Writer
	if got := w.Accrue(300 * time.Microsecond); got != 0 {
		t.Fatalf("first 300 µs: sleep %v, want 0 (below the quantum)", got)
	}
	var slept time.Duration
	n := 1
	for ; slept == 0; n++ {
		slept = w.Accrue(300 * time.Microsecond)
	}
	if want := time.Duration(n) * 300 * time.Microsecond; slept != want || slept < throttleQuantum {
		t.Fatalf("after %d writes of 300 µs: sleep %v, want %v (at least %v)", n, slept, want, throttleQuantum)
	}
	if got := w.Accrue(throttleMax); got != throttleMax {
		t.Fatalf("one write at the full delay: sleep %v, want %v", got, throttleMax)
	}

	const writers, each = 8, 5000
	var total atomic.Int64
	var wg sync.WaitGroup
	for g := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				d := time.Duration(1+(g*each+i)%997) * time.Microsecond
				if s := w.Accrue(d); s > 0 {
					if s < throttleQuantum {
						t.Errorf("slept %v, below the quantum", s)
					}
					total.Add(int64(s))
				}
			}
		}()
	}
	wg.Wait()
	var want int64
	for g := range writers {
		for i := range each {
			want += int64(time.Duration(1+(g*each+i)%997) * time.Microsecond)
		}
	}
	if got := total.Load() + w.throttleDebt.Load(); got != want {
		t.Errorf("slept %v plus %v still owed, want %v accrued", time.Duration(total.Load()), time.Duration(w.throttleDebt.Load()), time.Duration(want))
	}
}

// TestRunBuf: a run's buffer holds the run, is the smallest power-of-two
// size that does (a batch of one-block runs must not take a 2 MiB buffer
// per run in flight), and goes back to the pool of its size. The largest
// size is wbMaxRun blocks.
func TestRunBuf(t *testing.T) {
	if 1<<(runBufSizes-1) != wbMaxRun {
		t.Fatalf("largest run buffer %d blocks, wbMaxRun %d", 1<<(runBufSizes-1), wbMaxRun)
	}
	for _, tc := range []struct{ n, blocks int }{
		{1, 1}, {2, 2}, {3, 4}, {4, 4}, {5, 8}, {100, 128}, {257, 512}, {wbMaxRun, wbMaxRun},
	} {
		pb := runBuf(tc.n)
		if len(*pb) != tc.blocks*blockSize || cap(*pb) != tc.blocks*blockSize {
			t.Errorf("run of %d blocks: buffer len %d cap %d, want %d blocks", tc.n, len(*pb), cap(*pb), tc.blocks)
		}
		putRunBuf(pb)
	}
	// A returned buffer lands in its own size's pool: a later run of that
	// size may reuse it, one of another size never gets it.
	pb := runBuf(3)
	putRunBuf(pb)
	for range 4 {
		if q := runBuf(2); cap(*q) != 2*blockSize {
			t.Fatalf("run of 2 blocks got a buffer of %d bytes", cap(*q))
		}
	}
}

// TestParallel: parallel runs every call once with at most qd() in
// flight, qd changing while it runs; stops starting calls once done says
// so or a call fails, and returns every failure.
func TestParallel(t *testing.T) {
	const n = 2000
	var ran [n]atomic.Int32
	var inflight, most, started atomic.Int32
	f := func(i int) error {
		started.Add(1)
		k := inflight.Add(1)
		for m := most.Load(); k > m && !most.CompareAndSwap(m, k); m = most.Load() {
		}
		ran[i].Add(1)
		if i%7 == 0 {
			runtime.Gosched()
		}
		inflight.Add(-1)
		return nil
	}
	var asked atomic.Int32
	qd := func() int { return 1 + int(asked.Add(1)%8) } // 1..8
	if err := parallel(n, qd, nil, f); err != nil {
		t.Fatal(err)
	}
	for i := range ran {
		if got := ran[i].Load(); got != 1 {
			t.Fatalf("call %d ran %d times", i, got)
		}
	}
	if m := most.Load(); m < 1 || m > 8 {
		t.Fatalf("%d calls in flight at once, want 1..8", m)
	}

	started.Store(0)
	if err := parallel(n, func() int { return 4 }, func() bool { return started.Load() >= 50 }, func(int) error {
		started.Add(1)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got := started.Load(); got < 50 || got > 50+4 {
		t.Fatalf("done after 50 calls: %d started", got)
	}

	// Two calls in flight fail, the first after the second: both
	// failures are returned, and no call starts after the first of them
	// (a call's slot frees with its failure recorded).
	errA, errB := errors.New("a"), errors.New("b")
	started.Store(0)
	gate := make(chan struct{})
	err := parallel(n, func() int { return 2 }, nil, func(i int) error {
		started.Add(1)
		switch i {
		case 0:
			<-gate
			return errA
		case 1:
			defer close(gate)
			return errB
		}
		return nil
	})
	if !errors.Is(err, errA) || !errors.Is(err, errB) {
		t.Fatalf("parallel returned %v, want both failures", err)
	}
	if got := started.Load(); got != 2 {
		t.Fatalf("%d calls started, want 2 (none after a failure)", got)
	}
}
