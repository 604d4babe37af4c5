package cache

// The writeback mechanism: dirty blocks taken in LBA or epoch order,
// written to the backing devices, synced, and only then journaled clean
// (invariant 3); and Drain, which writes everything back.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// lockChunk bounds the index lookups done per hold of Set.mu by background
// work (about 100 µs), so foreground requests never wait long for it.
const lockChunk = 512

// dirtyScanLocked lists up to limit dirty blocks of volume vi from lba on,
// visiting at most maxVisit entries so that mu is held briefly even when
// the index is mostly clean. It skips the leaves whose epoch bound says
// they hold no dirty entry (a bound of +inf: clean since it was built or
// last raised). next is where to continue; done says the end of the index
// was reached.
// REQUIRES: s.mu
func (s *Set) dirtyScanLocked(vi int, from uint64, limit, maxVisit int) (out []uint64, next uint64, done bool) {
	done, next = true, from
	visited := 0
	s.vols[vi].idx.Tree.AscendAggAtMost(index.Ent{LBA: from}, math.MaxUint64-1, func(e index.Ent) bool {
		if visited >= maxVisit || len(out) >= limit {
			done, next = false, e.LBA
			return false
		}
		visited++
		if e.Dirty() {
			out = append(out, e.LBA)
		}
		return true
	})
	return out, next, done
}

// writeback writes the given dirty blocks (sorted LBAs) of volume vi to the
// backing device, syncs it and only then marks them clean (invariant 3).
//
// The blocks are cut into runs of consecutive LBAs (at most wbMaxRun
// blocks); runs are submitted in ascending LBA order with wbQueueDepth in
// flight, each reading its blocks from the cache, verifying them and
// writing them as one backing write. Memory is bounded by the queue depth,
// not by the batch, so a batch can cover a whole sweep of the disk.
//
// Each run claims its LBA range until its backing write is done, so a
// passthrough write (writearound, none, trim, zeroes) never overlaps it on
// the backing device and writeback cannot resurrect old data over a newer
// write; blocks with a passthrough write in flight are skipped. A block
// that changed meanwhile is left alone: the clean mark applies only if the
// entry still points at the cache block that was written back and that
// block's bucket generation is unchanged (so a bucket reused meanwhile can
// never have a new write marked clean). Buckets are pinned only while
// their blocks are read.
//
// A volume in epoch order ignores lbas and writes back the next batch of its
// oldest epoch instead (writebackEpoch): every writeback of such a volume,
// background, eviction or drain, keeps the order.
func (s *Set) writeback(vi int, lbas []uint64) (int, error) {
	return s.writebackLBAs(vi, lbas, nil)
}

// writebackLBAs is writeback that adds to rep (if set) what it could not
// write.
func (s *Set) writebackLBAs(vi int, lbas []uint64, rep *wbReport) (int, error) {
	if s.keepSuperseded(vi) {
		return s.writebackEpochLBAs(vi, lbas, rep)
	}
	v := s.vol(vi)
	var items []wbItem
	var runs []blockRange // index ranges into items
	// Collect in chunks: mu is never held for more than lockChunk lookups.
	for at := 0; at < len(lbas); at += lockChunk {
		s.mu.Lock()
		for _, lba := range lbas[at:min(at+lockChunk, len(lbas))] {
			e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
			if !ok || !e.Dirty() {
				continue
			}
			if _, ok := v.idx.wbInflight[e.Block()]; ok {
				continue // written by another batch, not yet marked clean
			}
			v.idx.wbInflight[e.Block()] = struct{}{}
			if len(items) > 0 && items[len(items)-1].lba+1 == lba && runs[len(runs)-1].n < wbMaxRun {
				runs[len(runs)-1].n++
			} else {
				runs = append(runs, blockRange{uint64(len(items)), 1})
			}
			b := &s.mu.Buckets[int64(e.Block())/s.bpb]
			items = append(items, wbItem{lba: lba, loc: e.Block(), crc: e.CRC, gen: b.Gen})
		}
		s.mu.Unlock()
	}
	return s.writeItems(vi, items, runs, rep)
}

// wbReport collects what writeback batches could not write.
type wbReport struct {
	corrupt []wbVersion // versions whose cached copy failed its checksum
}

// wbVersion names one block version: volume, LBA, cache block, checksum.
type wbVersion struct {
	vi  int
	lba uint64
	loc uint32
	crc uint32
}

// wbBufs holds run buffers (wbMaxRun blocks each) for writeItems. Reusing
// them keeps a sequential writeback from allocating and zeroing a fresh
// 2 MiB buffer per run, and the garbage collector from running for it: at
// full speed that was a fifth of writeback's CPU time, and writeback's CPU
// time is what decides its rate on a loaded machine
// (TestMeasureIdleWriteback). Large allocations are page-aligned, as
// O_DIRECT devices need.
var wbBufs = sync.Pool{New: func() any {
	b := make([]byte, wbMaxRun*blockSize)
	return &b
}}

// wbItem is one block version a writeback batch writes.
type wbItem struct {
	lba uint64
	loc uint32
	crc uint32
	gen uint32 // bucket generation when taken
	ok  bool   // written (and to be marked clean after the sync)
	bad bool   // failed its checksum
}

// writebackEpoch writes back up to n versions of the volume's oldest flush
// epoch that has dirty data (LBA-sorted; the versions of one epoch have
// distinct LBAs), syncs, and marks them clean, which releases superseded
// ones. It never takes a version of a later epoch while one of the oldest
// is left, even one in flight in another batch: so the backing device moves
// from one epoch to the next with a sync in between, and holds at any
// moment the image after some epoch plus part of the next one.
func (s *Set) writebackEpoch(vi, n int) (int, error) {
	return s.writebackEpochReport(vi, n, nil)
}

// writebackEpochReport is writebackEpoch that adds to rep (if set) what it
// could not write.
func (s *Set) writebackEpochReport(vi, n int, rep *wbReport) (int, error) {
	items := s.takeEpochBatch(vi, n)
	var runs []blockRange
	for i, it := range items {
		if i > 0 && items[i-1].lba+1 == it.lba && runs[len(runs)-1].n < wbMaxRun {
			runs[len(runs)-1].n++
		} else {
			runs = append(runs, blockRange{uint64(i), 1})
		}
	}
	return s.writeItems(vi, items, runs, rep)
}

// takeEpochBatch takes (into wbInflight) up to n versions of volume vi's
// oldest epoch for writebackEpoch, LBA-sorted. It sweeps from the volume's
// writeback cursor, wrapping at the end, as lba order does: within one
// epoch any order is allowed, and resuming where the last batch stopped
// reaches the blocks that have been dirty longest (densest, so the longest
// runs and shortest seeks) instead of going back to LBA 0 each batch to
// the blocks just cleaned and dirtied again. With no client flushes the
// whole workload is one epoch, so this is all of epoch order's writeback.
func (s *Set) takeEpochBatch(vi, n int) []wbItem {
	v := s.vol(vi)
	s.mu.Lock()
	oldest, ok := s.mu.OldestEpoch(vi)
	if !ok {
		s.mu.Unlock()
		return nil
	}
	hi := v.epochBatchLimit(oldest)
	start := v.wb.cursor.Load()
	items, next, more := s.takeEpochRangeLocked(vi, hi, start, math.MaxUint64, n, nil)
	if !more && start > 0 && len(items) < n {
		items, next, more = s.takeEpochRangeLocked(vi, hi, 0, start, n, items)
	}
	if more {
		v.wb.cursor.Store(next)
	} else {
		v.wb.cursor.Store(0)
	}
	s.mu.Unlock()
	slices.SortFunc(items, func(a, b wbItem) int { return cmp.Compare(a.lba, b.lba) })
	return items
}

// takeEpochRangeLocked appends to items versions of epochs up to hi with
// LBAs in [from, limit), in LBA order, until it holds n (hi is the oldest
// dirty epoch, or during a catch-up the last epoch before the cut: one
// version per LBA either way). more reports that it
// stopped early at LBA next. It scans in chunks of at most lockChunk
// entries per hold of mu (dropping it in between): the live entries of
// those epochs (in the leaves whose summary admits them), merged in LBA
// order with the superseded versions of those epochs in the LBA range the
// chunk covered. The oldest epoch cannot get older between chunks (new
// versions take the current epoch, GC moves keep theirs).
// REQUIRES: s.mu (dropped and retaken between chunks)
func (s *Set) takeEpochRangeLocked(vi int, hi, from, limit uint64, n int, items []wbItem) (_ []wbItem, next uint64, more bool) {
	v := s.vols[vi]
	var cand []index.Ver
	for {
		cand = cand[:0]
		visited := 0
		next, more = 0, false
		v.idx.Tree.AscendAggAtMost(index.Ent{LBA: from}, hi, func(e index.Ent) bool {
			if e.LBA >= limit {
				return false
			}
			if visited >= lockChunk || len(cand) >= n-len(items) {
				next, more = e.LBA, true
				return false
			}
			visited++
			if ep := s.mu.BlockEpoch(e.Block()); e.Dirty() && ep <= hi {
				cand = append(cand, index.Ver{Epoch: ep, LBA: e.LBA, Loc: e.Block(), CRC: e.CRC})
			}
			return true
		})
		end := limit
		if more {
			end = next
		}
		nlive := len(cand)
		v.idx.Sup.AscendAggAtMost(index.Ent{LBA: from}, hi, func(e index.Ent) bool {
			if e.LBA >= end {
				return false
			}
			if ep := s.mu.BlockEpoch(e.Loc); ep <= hi {
				cand = append(cand, index.Ver{Epoch: ep, LBA: e.LBA, Loc: e.Loc, CRC: e.CRC})
			}
			return true
		})
		if len(cand) > nlive {
			// LBA order (a catch-up's versions are of several epochs,
			// one per LBA).
			slices.SortFunc(cand, func(a, b index.Ver) int { return cmp.Or(cmp.Compare(a.LBA, b.LBA), cmp.Compare(a.Epoch, b.Epoch)) })
		}
		for _, x := range cand {
			if len(items) >= n {
				// Resume at the first version not taken.
				next, more = x.LBA, true
				break
			}
			if _, busy := v.idx.wbInflight[x.Loc]; busy {
				continue
			}
			v.idx.wbInflight[x.Loc] = struct{}{}
			b := &s.mu.Buckets[int64(x.Loc)/s.bpb]
			items = append(items, wbItem{lba: x.LBA, loc: x.Loc, crc: x.CRC, gen: b.Gen})
		}
		if !more || len(items) >= n {
			return items, next, more
		}
		from = next
		s.mu.Unlock()
		s.mu.Lock()
	}
}

// writebackEpochLBAs writes back, of the given LBAs, the live versions that
// belong to the volume's oldest epoch (within one epoch any order is
// allowed, so eviction can free its victim's blocks); when none does, it
// writes back a batch of the oldest epoch instead, so callers always see
// progress.
func (s *Set) writebackEpochLBAs(vi int, lbas []uint64, rep *wbReport) (int, error) {
	v := s.vol(vi)
	var items []wbItem
	var runs []blockRange
	s.mu.Lock()
	if oldest, ok := s.mu.OldestEpoch(vi); ok {
		hi := v.epochBatchLimit(oldest)
		for _, lba := range lbas {
			e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
			if !ok || !e.Dirty() || s.mu.BlockEpoch(e.Block()) > hi {
				continue
			}
			if _, busy := v.idx.wbInflight[e.Block()]; busy {
				continue
			}
			v.idx.wbInflight[e.Block()] = struct{}{}
			if len(items) > 0 && items[len(items)-1].lba+1 == lba && runs[len(runs)-1].n < wbMaxRun {
				runs[len(runs)-1].n++
			} else {
				runs = append(runs, blockRange{uint64(len(items)), 1})
			}
			items = append(items, wbItem{lba: lba, loc: e.Block(), crc: e.CRC, gen: s.mu.Buckets[int64(e.Block())/s.bpb].Gen})
		}
	}
	s.mu.Unlock()
	if len(items) == 0 {
		return s.writebackEpochReport(vi, max(len(lbas), 1), rep)
	}
	return s.writeItems(vi, items, runs, rep)
}

// hasVersionLocked reports whether the dirty version of lba at loc is still
// there (the live entry or a superseded one).
// REQUIRES: s.mu
func (s *Set) hasVersionLocked(vi int, lba uint64, loc uint32, crc uint32) bool {
	v := s.vols[vi]
	if e, ok := v.idx.Tree.Get(index.Ent{LBA: lba}); ok && e.Dirty() && e.Block() == loc && e.CRC == crc {
		return true
	}
	x, ok := v.idx.Sup.Get(index.Ent{LBA: lba, Loc: loc})
	return ok && x.CRC == crc
}

// writeItems writes a batch taken by writeback or writebackEpoch (items
// pinned and in wbInflight; runs cut at consecutive LBAs), syncs, and marks
// the written versions clean. The versions that failed their checksum are
// added to rep, if set.
func (s *Set) writeItems(vi int, items []wbItem, runs []blockRange, rep *wbReport) (int, error) {
	v := s.vol(vi)
	if len(items) == 0 {
		return 0, nil
	}
	claim := func(r blockRange) blockRange { return blockRange{items[r.lba].lba, r.n} }
	var written atomic.Int64
	defer func() {
		s.mu.Lock()
		for _, it := range items {
			delete(v.idx.wbInflight, it.loc)
		}
		s.notifyReleasedLocked()
		s.mu.Unlock()
	}()
	if err := s.commitBeforeWriteback(s.appended()); err != nil {
		return 0, fmt.Errorf("writeback: %w", err)
	}
	// Queue depth: up to the volume's depth (wbdepth.go) in runs, but at
	// most about its in-flight bytes, so long sequential runs reach the
	// disk nearly in order (a disk's write cache destages what arrives
	// first).
	runBytes := blockSize * len(items) / len(runs)
	qd := func() int {
		d := v.wb.depth.depth()
		if v.wb.reads.recent(wbIdle) {
			// A client read of the backing device waits behind every
			// write queued ahead of it.
			d = min(d, wbQueueDepth)
		}
		return max(2, min(d, v.wb.depth.inflightBytes()/runBytes))
	}
	v.wb.depth.begin(v.wb.disturbances())
	issued := make([]chan struct{}, len(runs))
	for i := range issued {
		issued[i] = make(chan struct{})
	}
	werr := parallel(len(runs), qd, func(k int) error {
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
		// Claim the run, unless a passthrough write holds part of it; an
		// item whose entry changed since it was collected is skipped.
		s.mu.Lock()
		claimed := !v.busyLocked(claim(r).lba, r.n)
		if claimed {
			v.idx.busy = append(v.idx.busy, claim(r))
		}
		// Buckets are pinned only from here until the blocks are read, so a
		// long batch never holds buckets back from eviction.
		valid := make([]bool, r.n)
		for i := range valid {
			it := &items[int(r.lba)+i]
			bi := int64(it.loc) / s.bpb
			valid[i] = claimed && s.mu.Buckets[bi].Gen == it.gen && s.hasVersionLocked(vi, it.lba, it.loc, it.crc)
			if valid[i] {
				s.mu.alloc[bi].pins++
			}
		}
		s.mu.Unlock()
		defer func() {
			if claimed {
				s.mu.Lock()
				v.releaseLocked([]blockRange{claim(r)})
				s.mu.Unlock()
			}
		}()
		its := items[r.lba : r.lba+r.n]
		pb := wbBufs.Get().(*[]byte)
		defer wbBufs.Put(pb)
		buf := (*pb)[:len(its)*blockSize]
		var rerr error
		for i := 0; i < len(its) && rerr == nil; {
			j := i + 1
			for j < len(its) && its[j].loc == its[j-1].loc+1 {
				j++
			}
			if _, err := s.dev.ReadAt(buf[i*blockSize:j*blockSize], s.cacheOff(its[i].loc)); err != nil {
				s.cacheIOError("writeback read", err)
				rerr = fmt.Errorf("writeback: reading cache: %w", err)
			} else {
				s.cacheIOOK()
			}
			i = j
		}
		s.mu.Lock()
		for i, it := range its {
			if valid[i] {
				s.unpinLocked(it.loc)
			}
		}
		s.mu.Unlock()
		if rerr == nil {
			for i := range its {
				if !valid[i] {
					continue
				}
				if got := ondisk.CRC32C(buf[i*blockSize : (i+1)*blockSize]); got != its[i].crc {
					v.st.checksumErrors.Add(1)
					its[i].bad = true
					s.log.Error("dirty block fails its checksum; not written back", "volume", v.name,
						"lba", its[i].lba, "cache_offset", s.cacheOff(its[i].loc), "expected", its[i].crc, "actual", got)
					continue
				}
				its[i].ok = true
			}
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
				v.yieldToReads()
				issue()
				t0 := time.Now()
				if err := v.writeBackingNoMark(buf[i*blockSize:j*blockSize], its[i].lba); err == nil {
					v.wb.depth.done(time.Since(t0), v.wb.disturbances())
				} else {
					rerr = fmt.Errorf("writeback to %s: %w", v.name, err)
					v.wb.backingErr.Store(&rerr)
					for x := i; x < len(its); x++ {
						its[x].ok = false
					}
				}
				written.Add(int64(j - i))
				i = j
			}
		}
		return rerr
	})
	if rep != nil {
		for _, it := range items {
			if it.bad {
				rep.corrupt = append(rep.corrupt, wbVersion{vi, it.lba, it.loc, it.crc})
			}
		}
	}
	if werr != nil {
		return 0, werr
	}
	if written.Load() == 0 {
		return 0, nil
	}
	if err := v.back.Sync(); err != nil {
		err = fmt.Errorf("writeback: syncing %s: %w", v.name, err)
		v.wb.backingErr.Store(&err)
		return 0, err
	}
	v.wb.backingErr.Store(nil)
	n := 0
	for at := 0; at < len(items); at += lockChunk {
		s.mu.Lock()
		for _, it := range items[at:min(at+lockChunk, len(items))] {
			if it.ok && s.mu.Buckets[int64(it.loc)/s.bpb].Gen == it.gen && s.mu.MarkClean(vi, it.lba, it.loc) {
				s.appendLocked(&ondisk.Rec{Type: ondisk.RecClean, Vol: uint16(vi), LBA: it.lba, Loc: it.loc})
				n++
			}
		}
		s.mu.Unlock()
	}
	v.st.writebackBytes.Add(uint64(n) * blockSize)
	s.stats.writebackBlocks.Add(uint64(n))
	return n, nil
}

// Drain writes every dirty block of every volume back to its backing device
// and commits (drain). Background writeback pauses meanwhile.
func (s *Set) Drain(ctx context.Context) error {
	s.draining.Add(1)
	defer func() {
		s.draining.Add(-1)
		s.kickWB()
	}()
	if err := s.drain(ctx, s.volList(), drainBatch, nil); err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	return nil
}

// drainChecksumTries: drain gives up on a dirty block version whose cached
// copy has failed its checksum in this many passes in a row (a read of the
// cache device may fail once; a corrupt block fails every time).
const drainChecksumTries = 3

// drain writes back every dirty block of vols and commits, in passes. A
// pass sweeps each volume's dirty blocks in LBA order in batches (the first
// of first blocks, doubling up to drainBatch: each batch ends with a
// backing sync), then commits; progress, if set, is called with the dirty
// blocks left after each batch. It returns:
//
//   - nil once no dirty block is left (each volume that left epoch order
//     returns to it: restoreOrder);
//   - the error of a backing write, a commit, the set or ctx;
//   - an *UnwritableError (ErrChecksum) when a pass wrote nothing back,
//     nothing was busy, and every version that failed its checksum in it
//     has failed it drainChecksumTries passes in a row.
//
// A pass that wrote nothing while blocks were busy (in a batch of
// background writeback or eviction, or claimed by a passthrough write)
// waits for a claim to be released before the next pass; a pass that
// wrote something, or whose failing versions have not yet failed often
// enough, is followed by the next at once. Under a constant stream of new
// dirty writes it may not finish.
func (s *Set) drain(ctx context.Context, vols []*Volume, first int, progress func(dirtyBlocks int64)) error {
	report := func() int64 {
		s.mu.Lock()
		left := int64(0)
		for _, v := range vols {
			left += v.idx.Dirty
		}
		s.mu.Unlock()
		if progress != nil {
			progress(left)
		}
		return left
	}
	report()
	fails := map[wbVersion]int{} // versions failing their checksum: passes in a row
	batch := first
	for {
		written := 0
		var rep wbReport
		for _, v := range vols {
			from := uint64(0)
			for end := false; !end; {
				if err := ctx.Err(); err != nil {
					return err
				}
				if err := s.err(); err != nil {
					return err
				}
				var lbas []uint64
				for len(lbas) < batch && !end {
					s.mu.Lock()
					got, next, done := s.dirtyScanLocked(v.vi, from, batch-len(lbas), lockChunk)
					s.mu.Unlock()
					lbas, from, end = append(lbas, got...), next, done
				}
				if len(lbas) > 0 {
					n, err := s.writebackLBAs(v.vi, lbas, &rep)
					if err != nil {
						return err
					}
					written += n
					report()
				}
				batch = min(2*batch, drainBatch)
			}
		}
		s.mu.Lock()
		target := s.mu.seq
		s.mu.Unlock()
		if err := s.commit(target); err != nil {
			return err
		}
		left := report()
		if left == 0 {
			for _, v := range vols {
				v.restoreOrder()
			}
			return nil
		}
		for _, x := range rep.corrupt {
			fails[x]++
		}
		s.mu.Lock()
		for x := range fails {
			if !s.hasVersionLocked(x.vi, x.lba, x.loc, x.crc) {
				delete(fails, x) // overwritten or dropped since
			}
		}
		s.mu.Unlock()
		if written > 0 {
			continue
		}
		released, busy := s.waitReleased(vols...)
		if !busy {
			if len(rep.corrupt) > 0 && !slices.ContainsFunc(rep.corrupt, func(x wbVersion) bool { return fails[x] < drainChecksumTries }) {
				return s.unwritable(rep.corrupt, left)
			}
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-released:
		}
	}
}

// unwritable builds drain's error for the versions given up on.
func (s *Set) unwritable(bad []wbVersion, left int64) error {
	e := &UnwritableError{N: len(bad), Dirty: left, Tries: drainChecksumTries}
	for _, x := range bad[:min(len(bad), maxUnwritableNamed)] {
		e.Blocks = append(e.Blocks, UnwritableBlock{Volume: s.vol(x.vi).name, LBA: x.lba, CacheOffset: s.cacheOff(x.loc)})
	}
	return e
}

// parallel runs f(0..n-1) with at most qd() calls in flight (asked again
// before each call starts: the depth adapts while a batch runs), started
// in order; after a call fails no new one starts. It returns every error
// of the calls that ran (errors.Join): two runs of a writeback batch can
// fail on the backing device at once, and each failure must reach the
// caller's log, not only the first (found by TestDeviceFailureModel/seq).
func parallel(n int, qd func() int, f func(i int) error) error {
	if n == 1 {
		return f(0)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex // guards inflight and errs
	cond := sync.NewCond(&mu)
	inflight := 0
	var errs []error
	for i := 0; i < n; i++ {
		mu.Lock()
		for inflight >= qd() && len(errs) == 0 {
			cond.Wait()
		}
		if len(errs) > 0 {
			mu.Unlock()
			break
		}
		inflight++
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := f(i)
			mu.Lock()
			inflight--
			if err != nil {
				errs = append(errs, err)
			}
			cond.Signal()
			mu.Unlock()
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
