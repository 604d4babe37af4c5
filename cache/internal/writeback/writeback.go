// Package writeback is the cache's writeback room: the mechanism that
// writes a batch of dirty block versions to a volume's backing device,
// syncs it and only then has them marked clean (invariant 3); the
// background loop that decides when and how fast each volume writes back;
// the entry points eviction and a write waiting for space use; and Drain,
// which writes everything back.
//
// It owns no index, journal or allocator state. The cache set provides
// those through Volume, one per volume (package cache, wbhost.go), as a
// device provides its bytes through device.Device: writeback takes dirty
// versions from it, claims and verifies them through it, and asks it to
// mark them clean. Writeback owns the per-volume state of the mechanism:
// the sweep cursor, the queue depth (depth.go), the retry backoff, the
// client reads of the backing device it yields to (yield.go) and the
// foreground throttle's debt.
//
// Entry points, one per caller:
//
//   - Writer.Run: the background loop (loop.go), one goroutine per volume;
//   - Writer.Evict: eviction writes back the dirty blocks of its victims;
//   - Writer.Help: a write in epoch order that found no free bucket writes
//     back a small batch of its volume's oldest epoch itself;
//   - Drain: everything of some volumes, in passes (drain.go).
//
// Every one of them writes through one mechanism (batch.go), so every
// writeback of a volume in epoch order keeps the order.
package writeback

import (
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/backoff"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

const (
	blockSize = ondisk.BlockSize

	wbQueueDepth    = 32                     // backing writes (and cache reads) in flight per batch, to start with (depth.go)
	wbMaxRun        = 512                    // blocks per merged write (2 MiB)
	wbBatch         = 16384                  // blocks per batch at full speed (64 MiB: one sweep, one backing sync)
	wbBatchShort    = 1024                   // blocks per batch while free buckets are short
	wbInflightBytes = 4 << 20                // backing bytes in flight per batch at wbQueueDepth (at least 2 runs)
	wbPace          = 100 * time.Millisecond // a paced batch's length (at the rate decided)
	wbIdle          = 200 * time.Millisecond // no client request for this long: full speed
	wbHorizon       = 10                     // seconds to clear the excess over the target
	wbMinRate       = 256                    // blocks/s (1 MiB/s) once above the target
)

// QueueDepth is the queue depth a batch starts with (and keeps with
// Knobs.FixedDepth).
const QueueDepth = wbQueueDepth

// FullBatch is the blocks of one background batch at full speed.
const FullBatch = wbBatch

// Item is one dirty block version a batch writes: its LBA, cache block
// and checksum, and the generation of the cache block's bucket when it was
// taken (a bucket reused meanwhile has another).
type Item struct {
	LBA uint64
	Loc uint32
	CRC uint32
	Gen uint32

	ok  bool // written (and to be marked clean after the sync)
	bad bool // failed its checksum
}

// Written reports whether the item reached the backing device in a batch
// that then synced it (MarkClean marks only those).
func (it *Item) Written() bool { return it.ok }

// Version names one dirty block version of the volume at index Vol of the
// Writers given to Drain.
type Version struct {
	Vol int
	LBA uint64
	Loc uint32
	CRC uint32
}

// Volume is the cache set's side of one volume's writeback. Every method
// is safe for concurrent use: it takes the set's lock itself where it needs
// it, and no lock of this package is held while it runs. Writeback calls
// them in this order for a batch: Take*, BeforeBacking, then per run of
// consecutive LBAs Claim, ReadCache, Unpin, WriteBacking, Unclaim; then
// SyncBacking, MarkClean, Release.
type Volume interface {
	// Name names the volume in errors.
	Name() string

	// ScanDirty lists up to limit dirty LBAs from from on, visiting at
	// most maxVisit index entries; next is where to continue, done says
	// the end of the volume was reached.
	ScanDirty(from uint64, limit, maxVisit int) (lbas []uint64, next uint64, done bool)
	// TakeLBAs takes into a batch, of the sorted lbas, the dirty live
	// versions no other batch holds; in epoch order (epoch true) only
	// those of the oldest dirty epoch. They stay the batch's until Release.
	TakeLBAs(lbas []uint64) (items []Item, epoch bool)
	// TakeEpoch takes into a batch up to n versions of the oldest dirty
	// epoch, sweeping from *cursor and wrapping (it advances the cursor),
	// sorted by LBA.
	TakeEpoch(n int, cursor *atomic.Uint64) []Item
	// EpochOrder reports whether the volume writes back in epoch order.
	EpochOrder() bool
	// Release ends a batch: its items are no longer in one, and waiters
	// of Released wake.
	Release(items []Item)

	// BeforeBacking makes durable what a backing write may depend on (the
	// journal records appended so far).
	BeforeBacking() error
	// Claim claims the LBAs of run (consecutive) against passthrough
	// writes; it fails if one holds part of them. For a claimed run it
	// sets valid[i] for each item still current (its version still
	// there, its bucket's generation unchanged) and pins its cache
	// block's bucket until Unpin.
	Claim(run []Item, valid []bool) bool
	// Unclaim releases Claim's claim.
	Unclaim(run []Item)
	// ReadCache reads len(p) bytes of cache blocks from loc on.
	ReadCache(p []byte, loc uint32) error
	// Unpin drops the pins Claim took for the valid items.
	Unpin(run []Item, valid []bool)
	// Corrupt reports an item whose cached copy p has checksum got. It
	// reports true when it replaced p with a good copy (the item is then
	// written back from p). The item is still pinned.
	Corrupt(it Item, p []byte, got uint32) bool
	// WriteBacking writes p to the backing device at block lba.
	WriteBacking(p []byte, lba uint64) error
	// SyncBacking makes the backing device's writes durable.
	SyncBacking() error
	// MarkClean marks clean the Written items whose version is still
	// current and journals it; it returns how many it marked.
	MarkClean(items []Item) int

	// HasVersion reports whether the dirty version is still in the cache.
	HasVersion(lba uint64, loc, crc uint32) bool
	// Dirty returns the volume's dirty blocks (Drain's progress).
	Dirty() int64
	// DirtyVersions returns its dirty versions, live and superseded.
	DirtyVersions() int64
	// Released returns a channel closed when a batch or a passthrough
	// write next releases a claim, and whether the volume has one now.
	Released() (_ <-chan struct{}, busy bool)
	// RestoreOrder returns a degraded volume to epoch order (after Drain
	// left it without dirty data).
	RestoreOrder()

	// Loop's view (loop.go).

	// CheckOrder degrades the volume, restores it or starts a catch-up. A
	// d > 0 asks the loop to call it again within d even if nothing else
	// happens (a return to epoch order that waits for a quiet moment).
	CheckOrder() (d time.Duration)
	// Rate decides the background rate (Rate in loop.go) from the set's
	// state and, when it is 0, sets the wake level (Writer.SetWake), both
	// under the set's lock.
	Rate() int64
	// WakeAbove sets the wake level one above the dirty versions now,
	// under the set's lock, and returns them.
	WakeAbove() int64
	// RateMax is writeback_rate_max in bytes/s (0: none).
	RateMax() int64
	// LastIO is when the client's last request came (unix nanos).
	LastIO() int64
	// Streaming reports whether a write stream of the volume is
	// bypassing the cache to the backing device now (RateIn.Stream).
	// Cheap (no lock): a running batch asks it before each run.
	Streaming() bool
	// Short reports whether free buckets are short, and returns a channel
	// closed when an allocation next finds them short.
	Short() (bool, <-chan struct{})
	// Draining reports whether a Drain is running on the set.
	Draining() bool
	// Failed reports whether the set has failed over (nothing is written
	// back any more).
	Failed() bool
}

// Set is the cache set's side of Drain.
type Set interface {
	// Err is the set's failure (sticky), if it failed over.
	Err() error
	// Commit makes durable every journal record appended so far.
	Commit() error
}

// Knobs are the tests' controls of writeback; production leaves them zero.
type Knobs struct {
	// NoYield turns off yielding to client reads of the backing device
	// (the read-latency measurement compares).
	NoYield bool
	// FixedDepth keeps the queue depth at QueueDepth (the remote-drain
	// measurement compares).
	FixedDepth bool
}

// Writer is a volume's writeback. Init it before use.
type Writer struct {
	c     Volume
	knobs Knobs
	stopC <-chan struct{} // the set's stop

	kick chan struct{} // wakes the loop (settings changed)
	stop chan struct{} // closed by Stop: the loop exits...
	done chan struct{} // ...and closes done
	rate atomic.Int64  // bytes/s now: 0 idle, -1 full speed (Stats)
	// cursor is the next LBA of the sweep. Atomic: the loop sweeps, and
	// tests sweep beside it (two sweeps overlapping are safe: a block is
	// in one batch at a time).
	cursor atomic.Uint64
	// backingErr: the last batch failed on the backing device with this
	// error (cleared by the next one that syncs). A write waiting for
	// space that only writeback can free fails instead of waiting.
	backingErr atomic.Pointer[error]
	// reads tracks client reads of the backing device: writeback yields
	// to them (yield.go).
	reads  readGate
	yields atomic.Uint64 // waits in yieldToReads
	grant  atomic.Int32  // writes left in the current burst
	// throttleDebt is foreground throttle delay (ns) accrued and not yet
	// slept (Accrue).
	throttleDebt atomic.Int64
	// retry paces the loop while batches fail (package backoff).
	retry *backoff.Retry
	// depth is how many backing writes a batch keeps in flight (depth.go).
	depth *depthCtl
	// wake: the loop sleeps until the volume's dirty versions reach this
	// many; a write that makes them reach it kicks the loop (NoteDirty).
	// Guarded by the cache set's lock, which Volume.Rate and WakeAbove hold
	// when they set it and writes hold when they compare, so that no
	// write slips between a decision and its level.
	wake int64
}

// Init readies w for the volume c named name; stop is the set's stop
// channel (closed when it closes).
func (w *Writer) Init(c Volume, log *slog.Logger, name string, stop <-chan struct{}, knobs Knobs) {
	w.c, w.knobs, w.stopC = c, knobs, stop
	w.kick = make(chan struct{}, 1)
	w.stop = make(chan struct{})
	w.done = make(chan struct{})
	w.retry = backoff.New(log, "writeback to the backing device", "volume", name)
	w.depth = newDepthCtl(knobs.FixedDepth)
}

// Kick wakes the loop (settings, mode or pressure changed).
func (w *Writer) Kick() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// NoteDirty kicks the loop when a write has brought the volume's dirty
// versions to the level it waits for.
// REQUIRES: the cache set's lock
func (w *Writer) NoteDirty(versions int64) {
	if versions >= w.wake {
		w.wake = 1<<63 - 1
		w.Kick()
	}
}

// SetWake sets the dirty versions at which a write kicks the loop.
// REQUIRES: the cache set's lock
func (w *Writer) SetWake(level int64) { w.wake = level }

// Stop stops the loop (Run returns) and waits for it; Restart readies w
// for another Run.
func (w *Writer) Stop() {
	close(w.stop)
	<-w.done
}

// Restart readies a stopped Writer for another Run.
func (w *Writer) Restart() { w.stop, w.done = make(chan struct{}), make(chan struct{}) }

// NoLoop records that no loop will run (the set is closed or its tests
// drive writeback themselves), so Stop does not wait for one.
func (w *Writer) NoLoop() { close(w.done) }

// Cursor is the sweep's cursor (Volume.TakeEpoch advances it).
func (w *Writer) Cursor() *atomic.Uint64 { return &w.cursor }

// BackingErr is the error of the last batch, if it failed on the backing
// device.
func (w *Writer) BackingErr() error {
	if p := w.backingErr.Load(); p != nil {
		return *p
	}
	return nil
}

// Stats are a volume's writeback figures.
type Stats struct {
	Rate     int64  // bytes/s now: 0 idle, -1 full speed
	Failures uint64 // failed background batches, ever
	Failing  bool   // batches keep failing; the loop retries with backoff
	Depth    int    // backing writes a batch keeps in flight
	Adjusts  uint64 // changes of Depth
	Yields   uint64 // waits for client reads of the backing device
}

// Stats returns the volume's writeback figures.
func (w *Writer) Stats() Stats {
	st := Stats{Rate: w.rate.Load(), Yields: w.yields.Load(), Depth: w.depth.depth()}
	if w.retry != nil {
		st.Failures, st.Failing = w.retry.Failures()
	}
	w.depth.mu.Lock()
	st.Adjusts = w.depth.mu.adjusts
	w.depth.mu.Unlock()
	return st
}

// Evict writes back, of the sorted lbas, the dirty versions no other batch
// holds (eviction frees its victims' buckets). In epoch order it writes
// those of the oldest epoch; when none is, a batch of the oldest epoch
// instead, so the caller always sees progress. It returns how many it
// marked clean.
func (w *Writer) Evict(lbas []uint64) (int, error) { return w.blocks(lbas, nil, nil) }

// blocks is Evict that adds to rep (if set) what it could not write, and
// stops issuing once stop (if set) says so (Writer.write).
func (w *Writer) blocks(lbas []uint64, rep *report, stop func() bool) (int, error) {
	items, epoch := w.c.TakeLBAs(lbas)
	if epoch && len(items) == 0 {
		items = w.c.TakeEpoch(max(len(lbas), 1), &w.cursor)
	}
	return w.write(items, rep, stop)
}

// Help writes back up to n versions of the volume's oldest epoch: a write
// in epoch order that found no free bucket helps free one.
func (w *Writer) Help(n int) (int, error) { return w.write(w.c.TakeEpoch(n, &w.cursor), nil, nil) }

// Sweep is one batch of the background loop: up to n dirty blocks from
// the cursor, wrapping at the end of the volume (in epoch order, of the
// oldest epoch). It returns how many it marked clean, and the error of a
// batch that failed.
func (w *Writer) Sweep(n int) (int, error) { return w.sweep(n, nil) }

// sweep is Sweep that stops issuing once stop (if set) says so; the cursor
// then points at the first block it did not issue, so the next batch
// resumes there.
func (w *Writer) sweep(n int, stop func() bool) (int, error) {
	var rep report
	defer func() {
		if rep.cut {
			w.cursor.Store(rep.resume)
		}
	}()
	if w.c.EpochOrder() {
		return w.write(w.c.TakeEpoch(n, &w.cursor), &rep, stop)
	}
	for range 2 {
		start := w.cursor.Load()
		from := start
		var lbas []uint64
		for {
			got, next, done := w.c.ScanDirty(from, n-len(lbas), sweepVisit)
			lbas = append(lbas, got...)
			if done {
				w.cursor.Store(0) // the next batch starts a new sweep
				break
			}
			from = next
			if len(lbas) >= n {
				w.cursor.Store(next)
				break
			}
		}
		if len(lbas) > 0 {
			return w.blocks(lbas, &rep, stop)
		}
		if start == 0 {
			break
		}
	}
	return 0, nil
}

// Index entries visited per ScanDirty call: by the loop's sweep, and by
// Drain (which scans in smaller pieces between its batches).
const (
	sweepVisit = 4096
	drainVisit = 512
)
