package cache

// Background writeback and its rate control.
//
// Each volume has a writeback goroutine. It sweeps the volume's index in
// LBA order from a cursor (wrapping at the end), takes the next batch of
// dirty blocks, and hands them to writeback (gc.go), which merges adjacent
// blocks into writes of up to wbMaxRun blocks, keeps the volume's queue depth (wbdepth.go) of them in
// flight in ascending LBA order, syncs the backing device and only then
// journals the blocks clean (invariant 3). Sweeping in one direction over
// the whole volume is what turns random dirty blocks into an elevator pass
// over the disk; merging across flush epochs (only the newest version of a
// block exists in the index) is the `lba` order.
//
// How fast (per volume, re-decided before every batch):
//
//   - full speed (batches back to back) when the volume's client has been
//     idle for wbIdle, when the volume is not in writeback mode (what is
//     left dirty just drains), or when the set is short of free buckets;
//   - otherwise nothing while dirty data is under the target
//     (writeback_percent of the cache), and above it a rate that grows
//     with the excess: excess/wbHorizon, at least wbMinRate, so the excess
//     is cleared in about wbHorizon under constant load; at half way
//     between the target and a full cache, full speed;
//   - writeback_rate_max, when set, caps every background pass (eviction,
//     which must free buckets, and Drain are not capped).
//
// Foreground writes in writeback mode are throttled smoothly when dirty data
// nears the cache size: a sleep of up to throttleMax per write, growing
// with the square of how far the dirty share is past throttleStart. A write
// that finds no free bucket within writeWaitMax goes around the cache
// (counted as a cache-full bypass) instead of stalling.
//
// Epoch order (writeback_order=epoch, the default): the goroutine (and
// every other writeback of the volume: eviction, Drain) takes the next batch
// of the oldest flush epoch that still has dirty versions (writebackEpoch in
// gc.go), LBA-sorted, and never a version of a later epoch while one of the
// oldest is left; each batch ends with a backing sync before its clean
// marks, so epochs reach the disk in order with a sync in between.

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

const (
	wbQueueDepth    = 32                     // backing writes (and cache reads) in flight per batch, to start with (wbdepth.go)
	wbMaxRun        = 512                    // blocks per merged write (2 MiB)
	wbBatch         = 16384                  // blocks per batch at full speed (64 MiB: one sweep, one backing sync)
	wbBatchShort    = 1024                   // blocks per batch while free buckets are short
	drainBatch      = 65536                  // blocks per batch of Drain (256 MiB of disk; 24 B each in memory)
	wbInflightBytes = 4 << 20                // backing bytes in flight per batch at wbQueueDepth (at least 2 runs)
	wbPace          = 100 * time.Millisecond // a paced batch's length (at the rate decided)
	wbIdle          = 200 * time.Millisecond // no client request for this long: full speed
	wbHorizon       = 10                     // seconds to clear the excess over the target
	wbMinRate       = 256                    // blocks/s (1 MiB/s) once above the target
	throttleStart   = 0.70                   // dirty share of the cache where throttling starts
	throttleMax     = 4 * time.Millisecond   // per-write delay at a completely dirty cache
	throttleQuantum = 2 * time.Millisecond   // throttle delays accrue to this before a write sleeps them
)

// wbState is a volume's writeback state.
type wbState struct {
	kick chan struct{} // wakes the goroutine (settings changed)
	stop chan struct{} // closed by Detach: the goroutine exits...
	done chan struct{} // ...and closes done
	rate atomic.Int64  // bytes/s now: 0 idle, -1 full speed (Stats)
	// cursor is the next LBA of the sweep. Atomic: the goroutine sweeps,
	// and tests sweep beside it (two sweeps overlapping are safe:
	// wbInflight keeps a block in one batch at a time).
	cursor atomic.Uint64
	// backingErr: the last writeback batch failed on the backing device
	// with this error (cleared by the next one that syncs). A write
	// waiting for space that only writeback can free fails instead of
	// waiting.
	backingErr atomic.Pointer[error]
	// reads tracks client reads of the backing device: writeback yields
	// to them (yieldToReads).
	reads  readGate
	yields atomic.Uint64 // waits in yieldToReads (tests)
	grant  atomic.Int32  // writes left in the current burst
	// throttleDebt is foreground throttle delay (ns) accrued and not yet
	// slept (throttle).
	throttleDebt atomic.Int64
	// retry paces background writeback while it fails (backoff.go).
	retry *retryBackoff
	// depth is how many backing writes a batch keeps in flight (wbdepth.go).
	depth *depthCtl
	// wakeDirty: the goroutine sleeps until the volume's dirty versions
	// (Dirty+NSup) reach this many; a write that makes them reach it
	// kicks the goroutine (noteDirtyLocked). REQUIRES: Set.mu
	wakeDirty int64
}

// noteDirtyLocked kicks v's writeback goroutine when a write has brought
// the volume's dirty versions to the level it waits for.
// REQUIRES: s.mu
func (v *Volume) noteDirtyLocked() {
	if v.idx.Dirty+v.idx.NSup >= v.wb.wakeDirty {
		v.wb.wakeDirty = math.MaxInt64
		v.kickWB()
	}
}

func (v *Volume) kickWB() {
	select {
	case v.wb.kick <- struct{}{}:
	default:
	}
}

// disturbances counts what makes a window of writeback's latencies say
// nothing of the backing device alone: yields to client reads, and the
// client reads of the backing device themselves (wbdepth.go).
func (w *wbState) disturbances() uint64 { return w.yields.Load() + w.reads.all.Load() }

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
)

// yieldToReads delays the next writeback write to the backing device while
// client reads are going to it (bcache gives foreground I/O priority the
// same way): a read miss queued behind writeback writes on a disk waits
// for them (up to the HDD model's 1 s age limit). It does not wait when
// free buckets are short: then writeback is what unblocks writes.
func (v *Volume) yieldToReads() {
	s := v.s
	if s.knobs.noYield {
		return
	}
	wait := wbYieldMax
	if s.draining.Load() > 0 {
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
		idle := v.wb.reads.idleChan()
		n, since := v.wb.reads.n.Load(), nowNanos()-v.wb.reads.done.Load()
		if n == 0 && since >= int64(wbYieldQuiet) {
			return
		}
		if v.wb.grant.Load() > 0 {
			v.wb.grant.Add(-1)
			return
		}
		if deadline == nil {
			deadline = time.NewTimer(wait)
		}
		s.mu.Lock()
		short := len(s.mu.free) < s.lowWater()
		if s.mu.short == nil {
			s.mu.short = make(chan struct{})
		}
		shortC := s.mu.short
		s.mu.Unlock()
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
		v.wb.yields.Add(1)
		select {
		case <-idle:
		case <-quietC:
		case <-shortC:
			return
		case <-deadline.C:
			v.wb.grant.Store(wbYieldBurst - 1)
			return
		case <-s.stop:
			return
		}
	}
}

func nowNanos() int64 { return time.Now().UnixNano() }

// kickWB wakes every volume's writeback goroutine.
func (s *Set) kickWB() {
	for _, v := range s.volList() {
		select {
		case v.wb.kick <- struct{}{}:
		default:
		}
	}
}

// pressure returns the set's dirty share of the cache (superseded versions
// included), whether free buckets are short, the cache size in blocks, and
// how far the free list is below the low-water mark (0..1).
func (s *Set) pressure() (dirtyShare float64, short bool, total int64, freeLack float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d int64
	for _, v := range s.vols {
		d += v.idx.Dirty + v.idx.NSup
	}
	total = s.mu.CacheBlocks()
	lw := s.lowWater()
	if f := len(s.mu.free); f < lw {
		freeLack = float64(lw-f) / float64(lw)
	}
	return float64(d) / float64(total), len(s.mu.free) < lw, total, freeLack
}

// wbRate decides the volume's writeback rate in blocks per second; -1 means
// full speed, 0 nothing to do now. When it returns 0 it also sets the dirty
// level at which a write is to kick the goroutine (wakeDirty): the level
// where the decision changes.
func (s *Set) wbRate(v *Volume) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	v.wb.wakeDirty = math.MaxInt64
	dirty := v.idx.Dirty + v.idx.NSup
	if dirty == 0 {
		v.wb.wakeDirty = 1
		return 0
	}
	if s.draining.Load() > 0 {
		return 0 // Drain sweeps the disk itself (and kicks when done); a second sweep would fight it
	}
	if len(s.mu.free) < s.lowWater() || v.Mode() != Writeback || nowNanos()-v.lastIO.Load() > int64(wbIdle) {
		return -1
	}
	if v.ord.cut.Load() != 0 {
		return -1 // catching up with epoch order (order.go): the sooner the better
	}
	target := s.mu.CacheBlocks() * int64(v.cfg.Load().WritebackPercent) / 100
	if v.ord.degraded.Load() {
		// Degraded from epoch order (order.go): drain to come back.
		target = 0
	}
	if dirty <= target {
		v.wb.wakeDirty = target + 1
		return 0
	}
	if dirty >= (target+s.mu.CacheBlocks())/2 {
		return -1
	}
	return max((dirty-target)/wbHorizon, wbMinRate)
}

// writebackLoop is a volume's background writeback goroutine. It sleeps
// until something changes the decision: a kick (settings, mode, pressure,
// the end of a Drain, a write reaching wakeDirty, a writeback claim
// released), the client going idle (wbIdle after its last request), or
// the end of a pacing or retry delay; and it exits when the set or the
// volume stops.
func (s *Set) writebackLoop(v *Volume) {
	defer s.wg.Done()
	defer close(v.wb.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// sleep waits for d (forever: no deadline), for also, for a kick if
	// kicks, or for a stop (false).
	sleep := func(d time.Duration, kicks bool, also <-chan struct{}) bool {
		var tc <-chan time.Time
		if d != forever {
			timer.Reset(d)
			tc = timer.C
		}
		kick := v.wb.kick
		if !kicks {
			kick = nil
		}
		select {
		case <-s.stop:
			return false
		case <-v.wb.stop:
			return false
		case <-kick:
		case <-also:
		case <-tc:
		}
		return true
	}
	for {
		s.checkOrder(v)
		rate := s.wbRate(v)
		limit := int64(0) // blocks/s; 0 none
		if m := v.cfg.Load().WritebackRateMax; m > 0 {
			limit = max(m/blockSize, 1)
		}
		if limit > 0 && (rate < 0 || rate > limit) {
			rate = limit
		}
		switch {
		case rate < 0:
			v.wb.rate.Store(-1)
		default:
			v.wb.rate.Store(rate * blockSize)
		}
		if s.err() != nil {
			// Failed over (sticky): nothing is written back any more.
			if !sleep(forever, false, nil) {
				return
			}
			continue
		}
		if rate == 0 {
			// Until a write reaches wakeDirty, free buckets run short, or
			// the client has been idle for wbIdle (full speed then).
			d, short := forever, (<-chan struct{})(nil)
			if v.hasDirty() && s.draining.Load() == 0 {
				d = max(time.Duration(v.lastIO.Load()+int64(wbIdle)-nowNanos()), time.Millisecond)
				short = s.shortChan()
			}
			if !sleep(d, true, short) {
				return
			}
			continue
		}
		n := wbBatch
		if _, short, _, _ := s.pressure(); short {
			// Buckets are needed now: small batches get blocks marked
			// clean (and their buckets evictable) sooner.
			n = wbBatchShort
		}
		if rate > 0 {
			n = int(min(max(rate*int64(wbPace)/int64(time.Second), 1), wbBatch))
		}
		start := time.Now()
		before := v.dirtyVersions()
		done, err := s.writebackSweep(v, n)
		if err != nil {
			// A failing or full backing device: retry with backoff.
			if !sleep(v.wb.retry.Failed(err), false, nil) {
				return
			}
			continue
		}
		v.wb.retry.OK()
		if rate > 0 {
			// Pace: n blocks at rate blocks/s.
			d := time.Duration(int64(max(done, 1)) * int64(time.Second) / rate)
			d = max(d-time.Since(start), time.Microsecond)
			if !sleep(min(d, time.Second), true, nil) {
				return
			}
			continue
		}
		if done == 0 {
			// Everything found was busy (in another batch, or claimed by
			// a passthrough write) or failing its checksum: wait for a
			// claim to be released, or for a write to add a dirty
			// version (wakeDirty).
			released, busy := s.waitReleased(v)
			if !busy {
				released = nil
			}
			s.mu.Lock()
			cur := v.idx.Dirty + v.idx.NSup
			v.wb.wakeDirty = cur + 1
			s.mu.Unlock()
			if cur > before {
				continue // written meanwhile
			}
			if !sleep(forever, true, released) {
				return
			}
		}
	}
}

// forever: no deadline (writebackLoop's sleep).
const forever time.Duration = -1

// dirtyVersions returns the volume's dirty versions (live and superseded).
func (v *Volume) dirtyVersions() int64 {
	v.s.mu.Lock()
	defer v.s.mu.Unlock()
	return v.idx.Dirty + v.idx.NSup
}

// waitReleased returns a channel closed when a writeback batch or a
// passthrough write releases its claim, and whether one of vols has any
// now.
func (s *Set) waitReleased(vols ...*Volume) (_ <-chan struct{}, busy bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.released == nil {
		s.mu.released = make(chan struct{})
	}
	for _, v := range vols {
		busy = busy || len(v.idx.wbInflight) > 0 || len(v.idx.busy) > 0
	}
	return s.mu.released, busy
}

// notifyReleasedLocked wakes waitReleased's waiters.
// REQUIRES: s.mu
func (s *Set) notifyReleasedLocked() {
	if s.mu.released != nil {
		close(s.mu.released)
		s.mu.released = nil
	}
}

// shortChan returns a channel closed when an allocation next finds free
// buckets short (allocLocked).
func (s *Set) shortChan() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.short == nil {
		s.mu.short = make(chan struct{})
	}
	return s.mu.short
}

// checkOrder degrades v when epoch-order writeback is behind, returns it
// to epoch order once it has no dirty data or has caught up, and starts a
// catch-up when it has been degraded long enough (order.go).
func (s *Set) checkOrder(v *Volume) {
	s.mu.Lock()
	behind := s.keepSuperseded(v.vi) && s.behindLocked(v)
	caught := v.caughtUpLocked()
	s.mu.Unlock()
	switch {
	case behind:
		v.degrade(degradeSuperseded)
	case caught:
		v.restoreOrder()
	default:
		v.catchUp()
	}
}

// writebackSweep writes back up to n dirty blocks of v from its cursor,
// wrapping at the end of the volume, and returns how many were written and
// the error of a batch that failed.
func (s *Set) writebackSweep(v *Volume, n int) (int, error) {
	if s.keepSuperseded(v.vi) {
		return s.writebackEpoch(v.vi, n)
	}
	for range 2 {
		start := v.wb.cursor.Load()
		from := start
		var lbas []uint64
		for {
			s.mu.Lock()
			got, next, done := s.dirtyScanLocked(v.vi, from, n-len(lbas), 4096)
			s.mu.Unlock()
			lbas = append(lbas, got...)
			if done {
				v.wb.cursor.Store(0) // the next batch starts a new sweep
				break
			}
			from = next
			if len(lbas) >= n {
				v.wb.cursor.Store(next)
				break
			}
		}
		if len(lbas) > 0 {
			return s.writeback(v.vi, lbas)
		}
		if start == 0 {
			break
		}
	}
	return 0, nil
}

// throttle delays a foreground write in writeback mode when dirty data
// nears the cache size, or when GC is behind (the free list below its
// low-water mark), so writeback and eviction keep up without the cache
// running out of buckets. The delay is small and smooth: the square of the
// larger pressure times throttleMax.
func (v *Volume) throttle() {
	if v.s.knobs.noThrottle {
		return
	}
	share, _, _, lack := v.s.pressure()
	p := 0.0
	if share > throttleStart {
		p = min((share-throttleStart)/(1-throttleStart), 1)
	}
	p = max(p, lack)
	d := time.Duration(p * p * float64(throttleMax))
	if d <= 0 {
		return
	}
	v.s.kickWB()
	v.s.kick()
	if d = v.wb.accrue(d); d > 0 {
		time.Sleep(d)
		v.st.throttleNanos.Add(uint64(d))
	}
}

// accrue adds a write's throttle delay d to the volume's debt and returns
// how long this write is to sleep: the whole debt once it reaches
// throttleQuantum, else nothing. So the writes of a volume sleep the same
// total delay in fewer, longer sleeps. Every sleep risks waking late (on a
// loaded 2-core box a 200 µs sleep wakes up to 30-50 ms late at p99.9), so
// fewer sleeps means fewer writes in the latency tail
// (TestMeasureForegroundLatency). Safe for concurrent writers: each unit
// of debt is returned to exactly one of them.
func (w *wbState) accrue(d time.Duration) time.Duration {
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
