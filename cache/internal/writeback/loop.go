package writeback

// The background loop and its rate control.
//
// Each volume has a loop (Run). It sweeps the volume's index in LBA order
// from a cursor (wrapping at the end), takes the next batch of dirty
// blocks, and writes them (batch.go), which merges adjacent blocks into
// writes of up to wbMaxRun blocks, keeps the volume's queue depth
// (depth.go) of them in flight in ascending LBA order, syncs the backing
// device and only then has the blocks journaled clean (invariant 3).
// Sweeping in one direction over the whole volume is what turns random
// dirty blocks into an elevator pass over the disk; merging across flush
// epochs (only the newest version of a block exists in the index) is the
// `lba` order.
//
// How fast (per volume, re-decided before every batch: Rate):
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
//     which must free buckets, and Drain are not capped);
//   - nothing, whatever else holds, while a write stream of the volume
//     bypasses the cache to the backing device (until it pauses for
//     wbIdle) and dirty data is below the full-speed level: the stream and
//     writeback share the disk's head.
//
// A batch already running when the decision changes to nothing (the
// client is busy again with dirty data under the target, or a stream
// starts) stops issuing at its next run (yieldToClient).
//
// Epoch order (writeback_order=epoch, the default): the loop (and every
// other writeback of the volume: eviction, Help, Drain) takes the next
// batch of the oldest flush epoch that still has dirty versions
// (Volume.TakeEpoch), LBA-sorted, and never a version of a later epoch
// while one of the oldest is left; each batch ends with a backing sync
// before its clean marks, so epochs reach the disk in order with a sync in
// between.

import (
	"time"
)

// RateIn is what the rate decision reads of the set and the volume.
type RateIn struct {
	Dirty       int64 // the volume's dirty versions (live and superseded)
	CacheBlocks int64
	Percent     int  // writeback_percent: the dirty target
	Draining    bool // a Drain runs (it sweeps the disk itself)
	Urgent      bool // free buckets short, not in writeback mode, client idle, or catching up with epoch order
	// Stream: a write stream of the volume is going around the cache to
	// the backing device (it bypassed within IdleAfter).
	Stream bool
}

// Rate decides a volume's background rate in blocks per second: -1 full
// speed, 0 nothing to do now. With 0 it also returns the dirty versions at
// which a write is to kick the loop (wake; no level: 1<<63-1): where the
// decision changes.
func Rate(in RateIn) (rate, wake int64) {
	const never = 1<<63 - 1
	if in.Dirty == 0 {
		return 0, 1
	}
	if in.Draining {
		return 0, never // Drain sweeps the disk itself (and kicks when done); a second sweep would fight it
	}
	// A volume degraded from epoch order has this target too, as in lba
	// order: it returns to epoch order by a catch-up or, once its client
	// is idle, a full drain (both Urgent). Writing all of its dirty data
	// back under load would only move the disk's head off the client's
	// requests.
	target := in.CacheBlocks * int64(in.Percent) / 100
	full := (target + in.CacheBlocks) / 2
	if in.Stream && in.Dirty < full {
		// Yield to the stream: every batch would move the disk's head
		// off it and back. Below full the rest of the cache is free or
		// clean, which eviction frees without writing anything back, so
		// nothing waits for writeback meanwhile (free buckets short
		// included).
		return 0, full
	}
	if in.Urgent {
		return -1, never
	}
	if in.Dirty <= target {
		return 0, target + 1
	}
	if in.Dirty >= full {
		return -1, never
	}
	return max((in.Dirty-target)/wbHorizon, wbMinRate), never
}

// IdleAfter is how long after a client's last request its volume counts
// as idle (background writeback at full speed).
const IdleAfter = wbIdle

// forever: no deadline (Run's sleep).
const forever time.Duration = -1

// Run is the volume's background loop; it returns when the set stops (the
// stop channel given to Init) or Stop is called. It sleeps until something
// changes the decision: a kick (settings, mode, pressure, the end of a
// Drain, a write reaching the wake level, a claim released), the client
// going idle (wbIdle after its last request), the end of a pacing or
// retry delay, or the time CheckOrder asked to be called again at.
func (w *Writer) Run() {
	defer close(w.done)
	c := w.c
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
		kick := w.kick
		if !kicks {
			kick = nil
		}
		select {
		case <-w.stopC:
			return false
		case <-w.stop:
			return false
		case <-kick:
		case <-also:
		case <-tc:
		}
		return true
	}
	for {
		again := c.CheckOrder()
		rate := c.Rate()
		limit := int64(0) // blocks/s; 0 none
		if m := c.RateMax(); m > 0 {
			limit = max(m/blockSize, 1)
		}
		if limit > 0 && (rate < 0 || rate > limit) {
			rate = limit
		}
		switch {
		case rate < 0:
			w.rate.Store(-1)
		default:
			w.rate.Store(rate * blockSize)
		}
		if c.Failed() {
			// Failed over (sticky): nothing is written back any more.
			if !sleep(forever, false, nil) {
				return
			}
			continue
		}
		if rate == 0 {
			// Until a write reaches the wake level, free buckets run
			// short, or the client has been idle for wbIdle (full speed
			// then).
			d, short := forever, (<-chan struct{})(nil)
			if c.DirtyVersions() > 0 && !c.Draining() {
				d = max(time.Duration(c.LastIO()+int64(wbIdle)-nowNanos()), time.Millisecond)
				_, short = c.Short()
			}
			if again > 0 && (d == forever || again < d) {
				d = again
			}
			if !sleep(d, true, short) {
				return
			}
			continue
		}
		n := wbBatch
		if short, _ := c.Short(); short {
			// Buckets are needed now: small batches get blocks marked
			// clean (and their buckets evictable) sooner.
			n = wbBatchShort
		}
		if rate > 0 {
			n = int(min(max(rate*int64(wbPace)/int64(time.Second), 1), wbBatch))
		}
		start := time.Now()
		before := c.DirtyVersions()
		done, err := w.sweep(n, w.yieldToClient)
		if err != nil {
			// A failing or full backing device: retry with backoff.
			if !sleep(w.retry.Failed(err), false, nil) {
				return
			}
			continue
		}
		w.retry.OK()
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
			// version (the wake level).
			released, busy := c.Released()
			if !busy {
				released = nil
			}
			if c.WakeAbove() > before {
				continue // written meanwhile
			}
			if !sleep(forever, true, released) {
				return
			}
		}
	}
}

// yieldToClient is a background batch's stop (Writer.write): true once
// the rate decision, asked again, says to write nothing now: the volume's
// client is busy again and its dirty data is under the target, or a write
// stream bypasses the cache (RateIn.Stream). A batch started at full
// speed while the volume was idle is up to wbBatch blocks, seconds of the
// disk (of scattered blocks on an HDD, minutes); without this it would go
// on under the client's requests until its end, moving the disk's head off
// a stream and back, and taking cache-device reads and CPU from the
// client's requests while nothing needs the writeback yet. While the
// client stays idle and no stream bypasses, the decision is full speed and
// is not asked (it takes the set's lock).
func (w *Writer) yieldToClient() bool {
	c := w.c
	if nowNanos()-c.LastIO() > int64(wbIdle) && !c.Streaming() {
		return false
	}
	return c.Rate() == 0
}

func nowNanos() int64 { return time.Now().UnixNano() }
