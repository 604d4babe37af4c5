package writeback

// The mechanism: one batch of dirty versions written to the backing
// device, synced, and only then marked clean (invariant 3).

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// report collects what batches could not write.
type report struct {
	corrupt []Item // versions whose cached copy failed its checksum
	// cut: the batch stopped issuing backing writes because its stop
	// said so; resume is the LBA of the first run it did not issue.
	cut    bool
	resume uint64
}

// bufs holds run buffers for write, one pool per size: bufs[k] holds
// buffers of 1<<k blocks, up to wbMaxRun. Reusing them keeps writeback
// from allocating and zeroing a fresh buffer per run, and the garbage
// collector from running for it; sizing them to the run keeps a batch of
// one-block runs (random dirty blocks) at the queue depth's blocks rather
// than the queue depth's 2 MiB. Buffers of a power-of-two multiple of 4 KiB
// are 4 KiB-aligned (Go's size classes; page-aligned above 32 KiB), as
// O_DIRECT devices need.
var bufs [runBufSizes]sync.Pool

// runBufSizes: buffers of 1, 2, 4 ... wbMaxRun blocks.
const runBufSizes = 10

// runBuf returns a pooled buffer of at least n blocks (1 <= n <= wbMaxRun);
// putRunBuf returns it to its pool.
func runBuf(n int) *[]byte {
	k := bits.Len(uint(n - 1))
	pb, _ := bufs[k].Get().(*[]byte)
	if pb == nil {
		b := make([]byte, blockSize<<k)
		pb = &b
	}
	return pb
}

func putRunBuf(pb *[]byte) {
	bufs[bits.Len(uint(cap(*pb)/blockSize-1))].Put(pb)
}

// blockRange is a range of items: [at, at+n).
type blockRange struct{ at, n int }

// cutRuns cuts items (sorted by LBA) into runs of consecutive LBAs of at
// most wbMaxRun blocks.
func cutRuns(items []Item) []blockRange {
	var runs []blockRange
	for i, it := range items {
		if i > 0 && items[i-1].LBA+1 == it.LBA && runs[len(runs)-1].n < wbMaxRun {
			runs[len(runs)-1].n++
		} else {
			runs = append(runs, blockRange{i, 1})
		}
	}
	return runs
}

// write writes a batch of items taken from the volume (sorted by LBA, each
// in this batch only), syncs the backing device, and has the written
// versions marked clean; it returns how many were. Versions that failed
// their checksum are added to rep, if set.
//
// The items are cut into runs of consecutive LBAs (at most wbMaxRun
// blocks); runs are submitted in ascending LBA order with the volume's
// queue depth in flight, each reading its blocks from the cache, verifying
// them and writing them as one backing write. Memory is bounded by the
// queue depth, not by the batch, so a batch can cover a whole sweep of the
// disk.
//
// Each run claims its LBA range until its backing write is done, so a
// passthrough write (writearound, none, trim, zeroes) never overlaps it on
// the backing device and writeback cannot resurrect old data over a newer
// write; a run with a passthrough write in flight is skipped. A version
// that changed meanwhile is left alone (Claim's valid; MarkClean checks
// again). Buckets are pinned only while their blocks are read, so a long
// batch never holds buckets back from eviction.
//
// stop, if set, is asked before each run starts and again just before it
// issues its backing write (runs issue in LBA order): once it says true
// the batch issues nothing more. The runs already issued complete, are
// synced and marked clean as in any batch; the others stay dirty (in epoch
// order they are of the oldest epoch still, so the order holds), and rep
// (if set) records the cut and where the batch stopped. The background
// loop stops a batch so when a write stream starts bypassing the cache to
// the same disk (Run).
func (w *Writer) write(items []Item, rep *report, stop func() bool) (int, error) {
	if len(items) == 0 {
		return 0, nil
	}
	c := w.c
	runs := cutRuns(items)
	var written atomic.Int64
	defer c.Release(items)
	if err := c.BeforeBacking(); err != nil {
		return 0, fmt.Errorf("writeback: %w", err)
	}
	// Queue depth: up to the volume's depth (depth.go) in runs, but at
	// most about its in-flight bytes, so long sequential runs reach the
	// disk nearly in order (a disk's write cache destages what arrives
	// first).
	runBytes := blockSize * len(items) / len(runs)
	qd := func() int {
		d := w.depth.depth()
		if w.reads.recent(wbIdle) {
			// A client read of the backing device waits behind every
			// write queued ahead of it.
			d = min(d, wbQueueDepth)
		}
		return max(2, min(d, w.depth.inflightBytes()/runBytes))
	}
	w.depth.begin(w.disturbances())
	issued := make([]chan struct{}, len(runs))
	for i := range issued {
		issued[i] = make(chan struct{})
	}
	// cut is the index of the first run not issued once stop said so
	// (len(runs): not cut). Runs decide in LBA order (after turn), so
	// every run before it was issued and none after it is.
	var cut atomic.Int64
	cut.Store(int64(len(runs)))
	stopped := func(k int) bool {
		if int64(k) >= cut.Load() {
			return true
		}
		if stop == nil || !stop() {
			return false
		}
		for c := cut.Load(); int64(k) < c && !cut.CompareAndSwap(c, int64(k)); c = cut.Load() {
		}
		return true
	}
	werr := parallel(len(runs), qd, func() bool { return cut.Load() < int64(len(runs)) }, func(k int) error {
		r := runs[k]
		// Backing writes are issued in LBA order: each run issues its
		// write only after the previous run has issued its own.
		turn := func() {
			if k > 0 {
				<-issued[k-1]
			}
		}
		var once sync.Once
		issue := func() { once.Do(func() { close(issued[k]) }) }
		defer func() { turn(); issue() }()
		its := items[r.at : r.at+r.n]
		if int64(k) >= cut.Load() {
			// Cut before this run: not worth reading the cache for it.
			return nil
		}
		valid := make([]bool, r.n)
		if c.Claim(its, valid) {
			defer c.Unclaim(its)
		}
		pb := runBuf(len(its))
		defer putRunBuf(pb)
		buf := (*pb)[:len(its)*blockSize]
		var rerr error
		for i := 0; i < len(its) && rerr == nil; {
			j := i + 1
			for j < len(its) && its[j].Loc == its[j-1].Loc+1 {
				j++
			}
			if err := c.ReadCache(buf[i*blockSize:j*blockSize], its[i].Loc); err != nil {
				rerr = fmt.Errorf("writeback: reading cache: %w", err)
			}
			i = j
		}
		if rerr != nil {
			c.Unpin(its, valid)
			return rerr
		}
		// Checked while pinned: Corrupt may repair a block from its other
		// copy, which must still be the block's.
		for i := range its {
			if !valid[i] {
				continue
			}
			p := buf[i*blockSize : (i+1)*blockSize]
			if got := ondisk.CRC32C(p); got != its[i].CRC && !c.Corrupt(its[i], p, got) {
				its[i].bad = true
				continue
			}
			its[i].ok = true
		}
		c.Unpin(its, valid)
		for i := 0; i < len(its) && rerr == nil; {
			if !its[i].ok {
				i++
				continue
			}
			j := i + 1
			for j < len(its) && its[j].ok {
				j++
			}
			turn()
			w.yieldToReads()
			if stopped(k) {
				for x := i; x < len(its); x++ {
					its[x].ok = false
				}
				break
			}
			issue()
			t0 := time.Now()
			if err := c.WriteBacking(buf[i*blockSize:j*blockSize], its[i].LBA); err == nil {
				w.depth.done(time.Since(t0), w.disturbances())
			} else {
				rerr = fmt.Errorf("writeback to %s: %w", c.Name(), err)
				w.backingErr.Store(&rerr)
				for x := i; x < len(its); x++ {
					its[x].ok = false
				}
			}
			written.Add(int64(j - i))
			i = j
		}
		return rerr
	})
	if rep != nil {
		for _, it := range items {
			if it.bad {
				rep.corrupt = append(rep.corrupt, it)
			}
		}
		if k := cut.Load(); k < int64(len(runs)) {
			rep.cut, rep.resume = true, items[runs[k].at].LBA
		}
	}
	if werr != nil {
		return 0, werr
	}
	if written.Load() == 0 {
		return 0, nil
	}
	if err := c.SyncBacking(); err != nil {
		err = fmt.Errorf("writeback: syncing %s: %w", c.Name(), err)
		w.backingErr.Store(&err)
		return 0, err
	}
	w.backingErr.Store(nil)
	return c.MarkClean(items), nil
}

// parallel runs f(0..n-1) with at most qd() calls in flight (asked again
// before each call starts: the depth adapts while a batch runs), started
// in order; after a call fails, or once done (if set) says true, no new one
// starts. It returns every error of the calls that ran (errors.Join): two
// runs of a batch can fail on the backing device at once, and each failure
// must reach the caller's log, not only the first. A goroutine that
// finished a call takes the next one to start, if any: a batch of many
// short runs starts a goroutine (and grows its stack) per call in flight,
// not per call.
func parallel(n int, qd func() int, done func() bool, f func(i int) error) error {
	if n == 1 {
		return f(0)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex // guards inflight, idle and errs
	cond := sync.NewCond(&mu)
	inflight, idle := 0, 0
	var errs []error
	next := make(chan int) // the next call, to an idle goroutine
	run := func(i int) {
		defer wg.Done()
		for ok := true; ok; i, ok = <-next {
			err := f(i)
			mu.Lock()
			inflight--
			idle++
			if err != nil {
				errs = append(errs, err)
			}
			cond.Signal()
			mu.Unlock()
		}
	}
	for i := 0; i < n; i++ {
		mu.Lock()
		for inflight >= qd() && len(errs) == 0 {
			cond.Wait()
		}
		if len(errs) > 0 || (done != nil && done()) {
			mu.Unlock()
			break
		}
		inflight++
		reuse := idle > 0
		if reuse {
			idle--
		}
		mu.Unlock()
		if reuse {
			next <- i
		} else {
			wg.Add(1)
			go run(i)
		}
	}
	close(next)
	wg.Wait()
	return errors.Join(errs...)
}
