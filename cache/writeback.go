package cache

// Background writeback and its rate control.
//
// Each volume has a writeback goroutine. It sweeps the volume's index in
// LBA order from a cursor (wrapping at the end), takes the next batch of
// dirty blocks, and hands them to writeback (gc.go), which merges adjacent
// blocks into writes of up to wbMaxRun blocks, keeps wbQueueDepth of them in
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
	"sync/atomic"
	"time"
)

const (
	wbQueueDepth    = 32      // backing writes (and cache reads) in flight per batch
	wbMaxRun        = 512     // blocks per merged write (2 MiB)
	wbBatch         = 16384   // blocks per batch at full speed (64 MiB: one sweep, one backing sync)
	wbBatchShort    = 1024    // blocks per batch while free buckets are short
	drainBatch      = 65536   // blocks per batch of Drain (256 MiB of disk; 24 B each in memory)
	wbInflightBytes = 4 << 20 // backing bytes in flight per batch (at least 2 runs)
	wbTick          = 100 * time.Millisecond
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
	// fgReads counts client reads of the backing device in progress,
	// fgReadDone is when the last one finished (unix nanos): writeback
	// yields to them (yieldToReads).
	fgReads    atomic.Int32
	fgReadDone atomic.Int64
	yields     atomic.Uint64 // 500 µs waits in yieldToReads (tests)
	grant      atomic.Int32  // writes left in the current burst
	// throttleDebt is foreground throttle delay (ns) accrued and not yet
	// slept (throttle).
	throttleDebt atomic.Int64
	// retry paces background writeback while it fails (backoff.go).
	retry *retryBackoff
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
	deadline := time.Now().Add(wait)
	for {
		busy := v.wb.fgReads.Load() > 0 || nowNanos()-v.wb.fgReadDone.Load() < int64(wbYieldQuiet)
		if !busy {
			return
		}
		if v.wb.grant.Load() > 0 {
			v.wb.grant.Add(-1)
			return
		}
		if time.Now().After(deadline) {
			v.wb.grant.Store(wbYieldBurst - 1)
			return
		}
		s.mu.Lock()
		short := len(s.mu.free) < s.lowWater()
		s.mu.Unlock()
		if short {
			return
		}
		v.wb.yields.Add(1)
		time.Sleep(500 * time.Microsecond)
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
// full speed, 0 nothing to do now.
func (s *Set) wbRate(v *Volume) int64 {
	s.mu.Lock()
	dirty := v.idx.Dirty + v.idx.NSup
	short := len(s.mu.free) < s.lowWater()
	total := s.mu.CacheBlocks()
	s.mu.Unlock()
	if dirty == 0 {
		return 0
	}
	cfg := v.cfg.Load()
	if s.draining.Load() > 0 {
		return 0 // Drain sweeps the disk itself; a second sweep would fight it
	}
	if short || v.Mode() != Writeback || nowNanos()-v.lastIO.Load() > int64(wbIdle) {
		return -1
	}
	if v.ord.cut.Load() != 0 {
		return -1 // catching up with epoch order (order.go): the sooner the better
	}
	target := total * int64(cfg.WritebackPercent) / 100
	if v.ord.degraded.Load() {
		// Degraded from epoch order (order.go): drain to come back.
		target = 0
	}
	if dirty <= target {
		return 0
	}
	if dirty >= (target+total)/2 {
		return -1
	}
	return max((dirty-target)/wbHorizon, wbMinRate)
}

// writebackLoop is a volume's background writeback goroutine.
func (s *Set) writebackLoop(v *Volume) {
	defer s.wg.Done()
	defer close(v.wb.done)
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
		if rate == 0 || s.err() != nil {
			select {
			case <-s.stop:
				return
			case <-v.wb.stop:
				return
			case <-v.wb.kick:
			case <-time.After(wbTick):
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
			n = int(min(max(rate*int64(wbTick)/int64(time.Second), 1), wbBatch))
		}
		start := time.Now()
		done, err := s.writebackSweep(v, n)
		if err != nil {
			// A failing or full backing device: retry with backoff.
			select {
			case <-s.stop:
				return
			case <-v.wb.stop:
				return
			case <-time.After(v.wb.retry.Failed(err)):
			}
			continue
		}
		v.wb.retry.OK()
		if rate > 0 {
			// Pace: n blocks at rate blocks/s.
			d := time.Duration(int64(max(done, 1)) * int64(time.Second) / rate)
			d = max(d-time.Since(start), 0)
			select {
			case <-s.stop:
				return
			case <-v.wb.stop:
				return
			case <-v.wb.kick:
			case <-time.After(min(d, time.Second)):
			}
			continue
		}
		select {
		case <-s.stop:
			return
		case <-v.wb.stop:
			return
		default:
		}
		if done == 0 {
			// Everything found was busy or failing: do not spin.
			select {
			case <-s.stop:
				return
			case <-v.wb.stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
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
