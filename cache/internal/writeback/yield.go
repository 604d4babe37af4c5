package writeback

// Sharing the devices with the client: writeback yields to client reads of
// the backing device, and foreground writes are throttled when dirty data
// nears the cache size.

import (
	"sync"
	"sync/atomic"
	"time"
)

const (
	// wbYieldQuiet: writeback issues its next backing write only once no
	// client read of the backing device is in progress or finished within
	// this window (a reader at queue depth 1 issues its next read well
	// within it).
	wbYieldQuiet = 2 * time.Millisecond
	// Under a constant read load writeback still progresses: after
	// waiting wbYieldMax (wbYieldMaxDrain while Drain runs: an operator
	// is waiting for it) it issues a burst of wbYieldBurst writes without
	// yielding, then yields again.
	wbYieldMax      = 50 * time.Millisecond
	wbYieldMaxDrain = 5 * time.Millisecond
	wbYieldBurst    = 8

	throttleMax     = 4 * time.Millisecond // per-write delay at a completely dirty cache
	throttleQuantum = 2 * time.Millisecond // throttle delays accrue to this before a write sleeps them
)

// ThrottleStart is the dirty share of the cache where throttling starts.
const ThrottleStart = 0.70

// ReadStart and ReadEnd bracket a client read of the backing device.
func (w *Writer) ReadStart() { w.reads.start() }

// ReadEnd: see ReadStart.
func (w *Writer) ReadEnd() { w.reads.end() }

// disturbances counts what makes a window of writeback's latencies say
// nothing of the backing device alone: yields to client reads, and the
// client reads of the backing device themselves (depth.go).
func (w *Writer) disturbances() uint64 { return w.yields.Load() + w.reads.all.Load() }

// readGate counts a volume's client reads of the backing device in
// progress and signals when the last one ends.
type readGate struct {
	n    atomic.Int32
	all  atomic.Uint64 // reads started
	done atomic.Int64  // when the last read ended (unix nanos)
	mu   sync.Mutex
	idle chan struct{} // closed when n drops to 0; nil while nobody waits
}

func (g *readGate) start() {
	g.all.Add(1)
	g.n.Add(1)
}

// recent reports whether a read is in progress or ended within d.
func (g *readGate) recent(d time.Duration) bool {
	return g.n.Load() > 0 || nowNanos()-g.done.Load() < int64(d)
}

func (g *readGate) end() {
	g.done.Store(nowNanos())
	if g.n.Add(-1) == 0 {
		g.mu.Lock()
		if g.idle != nil {
			close(g.idle)
			g.idle = nil
		}
		g.mu.Unlock()
	}
}

// idleChan returns a channel closed when the reads in progress now (if
// any) have ended.
func (g *readGate) idleChan() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.idle == nil {
		g.idle = make(chan struct{})
	}
	return g.idle
}

// yieldToReads delays the next writeback write to the backing device while
// client reads are going to it (bcache gives foreground I/O priority the
// same way): a read miss queued behind writeback writes on a disk waits
// for them (up to the HDD model's 1 s age limit). It does not wait when
// free buckets are short: then writeback is what unblocks writes.
func (w *Writer) yieldToReads() {
	if w.knobs.NoYield {
		return
	}
	wait := wbYieldMax
	if w.c.Draining() {
		wait = wbYieldMaxDrain
	}
	var deadline, quiet *time.Timer
	defer func() {
		for _, t := range []*time.Timer{deadline, quiet} {
			if t != nil {
				t.Stop()
			}
		}
	}()
	for {
		idle := w.reads.idleChan()
		n, since := w.reads.n.Load(), nowNanos()-w.reads.done.Load()
		if n == 0 && since >= int64(wbYieldQuiet) {
			return
		}
		if w.grant.Load() > 0 {
			w.grant.Add(-1)
			return
		}
		if deadline == nil {
			deadline = time.NewTimer(wait)
		}
		short, shortC := w.c.Short()
		if short {
			return
		}
		// Wait for the reads in progress to end, or for the quiet window
		// after the last one to pass.
		var quietC <-chan time.Time
		if n == 0 {
			d := time.Duration(int64(wbYieldQuiet) - since)
			if quiet == nil {
				quiet = time.NewTimer(d)
			} else {
				quiet.Reset(d)
			}
			quietC = quiet.C
		}
		w.yields.Add(1)
		select {
		case <-idle:
		case <-quietC:
		case <-shortC:
			return
		case <-deadline.C:
			w.grant.Store(wbYieldBurst - 1)
			return
		case <-w.stopC:
			return
		}
	}
}

// ThrottleDelay is the delay of a foreground write in writeback mode when
// the set's dirty share of the cache is share and its free list lacks
// lack (0..1) of its low-water mark: the square of the larger pressure
// times throttleMax, so that writeback and eviction keep up without the
// cache running out of buckets.
func ThrottleDelay(share, lack float64) time.Duration {
	p := 0.0
	if share > ThrottleStart {
		p = min((share-ThrottleStart)/(1-ThrottleStart), 1)
	}
	p = max(p, lack)
	return time.Duration(p * p * float64(throttleMax))
}

// Accrue adds a write's throttle delay d to the volume's debt and returns
// how long this write is to sleep: the whole debt once it reaches
// throttleQuantum, else nothing. So the writes of a volume sleep the same
// total delay in fewer, longer sleeps: every sleep risks waking late on a
// loaded machine, and fewer sleeps means fewer writes in the latency tail.
// Safe for concurrent writers: each unit of debt is returned to exactly
// one of them.
func (w *Writer) Accrue(d time.Duration) time.Duration {
	if w.throttleDebt.Add(int64(d)) < int64(throttleQuantum) {
		return 0
	}
	owed := w.throttleDebt.Swap(0)
	if owed < int64(throttleQuantum) {
		// Another writer took the debt first: give back what came in
		// since.
		w.throttleDebt.Add(owed)
		return 0
	}
	return time.Duration(owed)
}
