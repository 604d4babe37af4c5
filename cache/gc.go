package cache

// Allocation, writeback and eviction.
//
// Buckets are filled append-only, one open bucket at a time, and sealed into
// a FIFO when full. When fewer than lowWater buckets are free, the gc
// goroutine takes the oldest sealed bucket, writes its dirty blocks back to
// the backing devices (sorted by LBA, then synced: invariant 3), drops its
// clean entries, bumps its generation, journals the bump (recReuse) and
// commits, and only then puts it on the free list. So a bucket is reused
// only after no live entry points into it (invariant 5), and after a crash
// the replayed recReuse drops any entry of the old generation that eviction
// dropped only in memory. Issue 4 replaces FIFO by a smarter policy.

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
	"github.com/tiercache/tiercache/internal/invariants"
)

// run is a contiguous piece of cache blocks inside one bucket.
type run struct {
	loc uint32
	n   int
}

func (s *Set) lowWater() int { return max(2, len(s.mu.Buckets)/8) }

func (s *Set) kick() {
	select {
	case s.kickGC <- struct{}{}:
	default:
	}
}

// allocHow says how alloc may take space.
type allocHow int

const (
	allocWait    allocHow = iota // wait until a bucket is free (GC moves never use it)
	allocNoWait                  // use the free reserve, but fail rather than wait
	allocPromote                 // fail rather than use the free reserve
)

// allocFor is alloc for foreground writes: it may use the free reserve, and
// when no bucket is free it waits at most writeWaitMax for GC before giving
// up with errNoSpace (the caller then writes around the cache).
func (s *Set) allocFor(n int) (run, error) {
	deadline := time.Now().Add(writeWaitMax)
	for {
		r, err := s.alloc(n, allocNoWait)
		if !errors.Is(err, errNoSpace) || time.Now().After(deadline) {
			return r, err
		}
		s.kick()
		time.Sleep(200 * time.Microsecond)
	}
}

// writeWaitMax bounds how long a foreground write waits for a free bucket.
const writeWaitMax = 5 * time.Millisecond

// alloc hands out up to n blocks in the open bucket and pins the bucket until
// the caller calls unpin. allocWait blocks until space is free; allocNoWait
// fails when no bucket is free; allocPromote fails rather than use the free
// reserve. It never holds a pin while waiting, so waiters cannot starve gc.
func (s *Set) alloc(n int, how allocHow) (run, error) {
	wait := how == allocWait
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.mu.closed {
			return run{}, ErrClosed
		}
		if err := s.err(); err != nil {
			return run{}, err
		}
		if s.mu.open >= 0 {
			b := &s.mu.Buckets[s.mu.open]
			if int64(b.Fill) < s.bpb {
				k := min(n, int(s.bpb)-int(b.Fill))
				r := run{loc: uint32(s.mu.open*s.bpb) + b.Fill, n: k}
				b.Fill += uint32(k)
				b.Pins++
				s.mu.tick++
				b.Atime = s.mu.tick
				return r, nil
			}
			b.State = index.BucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(s.mu.open))
			s.mu.open = -1
		}
		if len(s.mu.free) < s.lowWater() {
			s.kick()
		}
		if len(s.mu.free) == 0 || (how == allocPromote && len(s.mu.free) < s.lowWater()) {
			if !wait {
				return run{}, errNoSpace
			}
			s.mu.cond.Wait()
			continue
		}
		bi := s.mu.free[0]
		s.mu.free = s.mu.free[1:]
		b := &s.mu.Buckets[bi]
		b.State, b.Fill = index.BucketOpen, 0
		s.mu.open = int64(bi)
	}
}

// REQUIRES: s.mu
func (s *Set) unpinLocked(loc uint32) {
	s.mu.Buckets[int64(loc)/s.bpb].Pins--
	s.mu.cond.Broadcast()
}

func (s *Set) cacheOff(loc uint32) int64 { return s.lay.BucketsOff + int64(loc)*blockSize }

func (s *Set) gcLoop() {
	defer s.wg.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-s.kickGC:
		case <-t.C:
		}
		for s.needSpace() {
			if !s.evictOne() {
				break
			}
		}
	}
}

func (s *Set) needSpace() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.mu.closed && s.err() == nil && len(s.mu.free) < s.lowWater() && len(s.mu.sealed) > 0
}

// pickVictimsLocked chooses up to k sealed buckets to free next, cheapest
// first:
//
//  1. an empty bucket (nothing to do but bump its generation);
//  2. a bucket holding only clean data, least recently used first (a
//     bucket-granularity LRU: atime is bumped by every read hit and by
//     allocation);
//  3. a bucket with dirty data, fewest live blocks first (its dirty blocks
//     are moved or written back; see evictVictim), then least recently used.
//
// Buckets with reads in flight and no live data are skipped (nothing to
// gain until the pins drop). The scan is linear in the sealed buckets, a
// few microseconds per thousand, under mu.
// REQUIRES: s.mu
func (s *Set) pickVictimsLocked(k int) []int64 {
	type cand struct {
		bi  int64
		key [3]uint64
	}
	var cands []cand
	for _, bi := range s.mu.sealed {
		b := &s.mu.Buckets[bi]
		if b.Pins > 0 && b.Live == 0 {
			continue
		}
		var key [3]uint64
		switch {
		case b.Live == 0:
			key = [3]uint64{0, 0, b.Atime}
		case b.Dirty == 0:
			key = [3]uint64{1, b.Atime, 0}
		default:
			key = [3]uint64{2, uint64(b.Live), b.Atime}
		}
		cands = append(cands, cand{int64(bi), key})
	}
	slices.SortStableFunc(cands, func(a, b cand) int { return slices.Compare(a.key[:], b.key[:]) })
	out := make([]int64, 0, min(k, len(cands)))
	for _, c := range cands[:min(k, len(cands))] {
		out = append(out, c.bi)
	}
	return out
}

// evictBatchMin: an eviction batch takes at least 1/evictBatchMin of the
// buckets (when that many are sealed), so that the index walk that finds
// the victims' entries (there is no reverse map) costs at most about
// evictBatchMin entry visits per freed cache block.
const evictBatchMin = 64

// located is an index entry found by a walk, with its volume.
type located struct {
	vi int
	e  index.Ent
}

// walkChunk bounds the entries an index walk visits per hold of Set.mu
// (a few tens of microseconds), so foreground requests never wait long
// for it.
const walkChunk = 4 * lockChunk

// entriesIn walks the index of every volume and returns the live entries
// naming a cache block for which want is true (in LBA order per volume). Set.mu is taken per walkChunk entries: entries can change
// between chunks, so callers re-check each one under mu before acting on
// it; entries moving into a sealed bucket meanwhile are only those of
// writes in flight, which pin the bucket.
func (s *Set) entriesIn(want func(loc int64) bool) []located {
	var out []located
	for vi, v := range s.volList() {
		from, more := uint64(0), true
		for more {
			more = false
			visited := 0
			s.mu.Lock()
			v.idx.Tree.AscendGreaterOrEqual(index.Ent{LBA: from}, func(e index.Ent) bool {
				if visited == walkChunk {
					from, more = e.LBA, true
					return false
				}
				visited++
				if want(int64(e.Block())) {
					out = append(out, located{vi, e})
				}
				return true
			})
			s.mu.Unlock()
		}
	}
	return out
}

// evictOne frees a batch of the cheapest sealed buckets (pickVictimsLocked):
// as many as are missing below the low-water mark, and at least
// 1/evictBatchMin of the cache. One index walk finds the entries of all of
// them. It reports whether it freed any.
func (s *Set) evictOne() bool {
	s.mu.Lock()
	k := max(s.lowWater()-len(s.mu.free), len(s.mu.Buckets)/evictBatchMin, 1)
	victims := s.pickVictimsLocked(k)
	isVictim := make(map[int64]bool, len(victims))
	walk := false
	for _, bi := range victims {
		isVictim[bi] = true
		walk = walk || s.mu.Buckets[bi].Live > 0
	}
	s.mu.Unlock()
	if len(victims) == 0 {
		return false
	}
	found := map[int64][]located{}
	if walk {
		for _, l := range s.entriesIn(func(loc int64) bool { return isVictim[loc/s.bpb] }) {
			bi := int64(l.e.Block()) / s.bpb
			found[bi] = append(found[bi], l)
		}
	}
	progress := false
	for _, bi := range victims {
		if s.evictVictim(bi, found[bi]) {
			progress = true
		}
	}
	return progress
}

// evictVictim frees sealed bucket victim, whose entries a walk found
// (items). It reports whether the bucket was freed.
func (s *Set) evictVictim(victim int64, items []located) bool {
	s.mu.Lock()
	vb := &s.mu.Buckets[victim]
	if vb.State != index.BucketSealed {
		s.mu.Unlock()
		return false
	}
	// A mostly empty bucket with dirty blocks: copy them into the open
	// bucket (a GC move) rather than write them back now: it costs at most
	// a quarter of a bucket (from the free reserve if need be) and frees a
	// whole one, without waiting for the backing device. Writeback then
	// still sees them, merged with their neighbours, at its own pace.
	if vb.Dirty > 0 && int64(vb.Live)*gcMoveFraction <= s.bpb && len(s.mu.free) >= 1 {
		s.mu.Unlock()
		s.gcMove(victim, items)
		s.mu.Lock()
	}
	perVol := map[int][]uint64{}
	for _, it := range items {
		if e, ok := s.vols[it.vi].idx.Tree.Get(it.e); ok && e.Dirty() && e.Block() == it.e.Block() {
			perVol[it.vi] = append(perVol[it.vi], e.LBA)
		}
	}
	s.mu.Unlock()
	for vi, lbas := range perVol {
		slices.Sort(lbas)
		if _, err := s.writeback(vi, lbas); err != nil {
			s.log.Warn("writeback for eviction failed", "volume", s.vol(vi).name, "err", err)
		}
	}
	s.mu.Lock()
	b := &s.mu.Buckets[victim]
	for _, it := range items {
		v := s.vols[it.vi]
		if e, ok := v.idx.Tree.Get(it.e); ok && !e.Dirty() && e.Block() == it.e.Block() {
			v.idx.Tree.Delete(e)
			s.mu.Unaccount(it.vi, e)
		}
	}
	if invariants.Enabled {
		if err := s.checkLocked(); err != nil {
			invariants.AssertionFailedf("after evicting bucket %d: %v", victim, err)
		}
	}
	if b.Live > 0 || b.Pins > 0 || b.State != index.BucketSealed {
		// Dirty blocks that could not be written back yet (claimed by a
		// passthrough write, or failing), entries of writes that were in
		// flight during the walk, or reads in flight: retry later, after
		// the other sealed buckets.
		s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
		if b.State == index.BucketSealed {
			s.mu.sealed = append(s.mu.sealed, uint32(victim))
		}
		s.mu.Unlock()
		return false
	}
	s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
	b.Gen++
	b.State = index.BucketFreeing
	s.appendLocked(&ondisk.Rec{Type: ondisk.RecReuse, Bucket: uint32(victim), Gen: b.Gen})
	target := s.mu.seq
	s.mu.Unlock()
	// The generation bump must be durable before new data lands in the
	// bucket: otherwise a crash could replay old entries over new bytes.
	err := s.commit(target)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		// The set has failed; keep the bucket out of circulation.
		return false
	}
	b.State, b.Fill = index.BucketFree, 0
	s.mu.free = append(s.mu.free, uint32(victim))
	s.mu.cond.Broadcast()
	s.stats.evictions.Add(1)
	return true
}

// lockChunk bounds the index lookups done per hold of Set.mu by background
// work (about 100 µs), so foreground requests never wait long for it.
const lockChunk = 512

// gcMoveFraction: a bucket whose live blocks fill at most 1/gcMoveFraction
// of it has its dirty blocks moved instead of written back when evicted.
const gcMoveFraction = 4

// gcMove copies the dirty blocks of bucket bi (of its entries found by a
// walk, items) into the open bucket. Each
// copy replaces the index entry only if the entry still points at the old
// block with the same checksum (no write, writeback or invalidation came in
// between); otherwise the copy is simply left unowned. The copies are
// journaled as inserts and become durable with the next commit, which
// syncs the cache device first (the flush protocol); until then replay
// still finds the old blocks, whose bucket is not reused before its reuse
// record, appended after these inserts, is durable.
func (s *Set) gcMove(bi int64, found []located) {
	type item struct {
		vi    int
		lba   uint64
		e     index.Ent
		epoch uint64
	}
	var items []item
	s.mu.Lock()
	for _, it := range found {
		if e, ok := s.vols[it.vi].idx.Tree.Get(it.e); ok && e.Dirty() && e.Block() == it.e.Block() {
			items = append(items, item{it.vi, e.LBA, e, s.mu.BlockEpoch(e.Block())})
		}
	}
	slices.SortFunc(items, func(a, b item) int { return cmp.Compare(a.e.Block(), b.e.Block()) })
	s.mu.Buckets[bi].Pins++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.mu.Buckets[bi].Pins--
		s.mu.cond.Broadcast()
		s.mu.Unlock()
	}()
	buf := make([]byte, blockSize)
	for _, it := range items {
		if _, err := s.dev.ReadAt(buf, s.cacheOff(it.e.Block())); err != nil {
			s.cacheIOError("GC move read", err)
			continue // left for writeback, which reports it
		}
		if ondisk.CRC32C(buf) != it.e.CRC {
			continue // left for writeback, which reports it
		}
		r, err := s.alloc(1, allocNoWait)
		if err != nil {
			return
		}
		_, werr := s.dev.WriteAt(buf, s.cacheOff(r.loc))
		if werr != nil {
			s.cacheIOError("GC move write", werr)
		}
		s.mu.Lock()
		if cur, ok := s.vols[it.vi].idx.Tree.Get(index.Ent{LBA: it.lba}); werr == nil && ok && cur == it.e {
			// Same epoch as the copied version: it replaces it (never
			// superseding it), and keeps its place in epoch order.
			s.mu.Insert(it.vi, it.lba, r.loc, it.e.CRC, true, it.epoch, s.keepSuperseded(it.vi))
			s.appendInsertLocked(it.vi, it.lba, r.loc, true, []uint32{it.e.CRC}, it.epoch)
			s.stats.gcMoves.Add(1)
		}
		s.unpinLocked(r.loc)
		s.mu.Unlock()
	}
}

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

// dirtyLBAsLocked lists up to max dirty blocks of volume vi from lba on.
// REQUIRES: s.mu
func (s *Set) dirtyLBAsLocked(vi int, from uint64, limit int) []uint64 {
	var out []uint64
	s.vols[vi].idx.Tree.AscendGreaterOrEqual(index.Ent{LBA: from}, func(e index.Ent) bool {
		if e.Dirty() {
			out = append(out, e.LBA)
		}
		return len(out) < limit
	})
	return out
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
	if s.keepSuperseded(vi) {
		return s.writebackEpochLBAs(vi, lbas)
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
	return s.writeItems(vi, items, runs)
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
}

// writebackEpoch writes back up to n versions of the volume's oldest flush
// epoch that has dirty data (LBA-sorted; the versions of one epoch have
// distinct LBAs), syncs, and marks them clean, which releases superseded
// ones. It never takes a version of a later epoch while one of the oldest
// is left, even one in flight in another batch: so the backing device moves
// from one epoch to the next with a sync in between, and holds at any
// moment the image after some epoch plus part of the next one.
func (s *Set) writebackEpoch(vi, n int) (int, error) {
	items := s.takeEpochBatch(vi, n)
	var runs []blockRange
	for i, it := range items {
		if i > 0 && items[i-1].lba+1 == it.lba && runs[len(runs)-1].n < wbMaxRun {
			runs[len(runs)-1].n++
		} else {
			runs = append(runs, blockRange{uint64(i), 1})
		}
	}
	return s.writeItems(vi, items, runs)
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
	start := v.wb.cursor.Load()
	items, next, more := s.takeEpochRangeLocked(vi, oldest, start, math.MaxUint64, n, nil)
	if !more && start > 0 && len(items) < n {
		items, next, more = s.takeEpochRangeLocked(vi, oldest, 0, start, n, items)
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

// takeEpochRangeLocked appends to items versions of epoch oldest with LBAs
// in [from, limit), in LBA order, until it holds n. more reports that it
// stopped early at LBA next. It scans in chunks of at most lockChunk
// entries per hold of mu (dropping it in between): the live entries of the
// oldest epoch (in the leaves whose summary admits it), merged in LBA
// order with the superseded versions of that epoch in the LBA range the
// chunk covered. The oldest epoch cannot get older between chunks (new
// versions take the current epoch, GC moves keep theirs).
// REQUIRES: s.mu (dropped and retaken between chunks)
func (s *Set) takeEpochRangeLocked(vi int, oldest, from, limit uint64, n int, items []wbItem) (_ []wbItem, next uint64, more bool) {
	v := s.vols[vi]
	var cand []index.Ver
	for {
		cand = cand[:0]
		visited := 0
		next, more = 0, false
		v.idx.Tree.AscendAggAtMost(index.Ent{LBA: from}, oldest, func(e index.Ent) bool {
			if e.LBA >= limit {
				return false
			}
			if visited >= lockChunk || len(cand) >= n-len(items) {
				next, more = e.LBA, true
				return false
			}
			visited++
			if e.Dirty() && s.mu.BlockEpoch(e.Block()) == oldest {
				cand = append(cand, index.Ver{Epoch: oldest, LBA: e.LBA, Loc: e.Block(), CRC: e.CRC})
			}
			return true
		})
		end := limit
		if more {
			end = next
		}
		nlive := len(cand)
		v.idx.Sup.AscendAggAtMost(index.Ent{LBA: from}, oldest, func(e index.Ent) bool {
			if e.LBA >= end {
				return false
			}
			if s.mu.BlockEpoch(e.Loc) == oldest {
				cand = append(cand, index.Ver{Epoch: oldest, LBA: e.LBA, Loc: e.Loc, CRC: e.CRC})
			}
			return true
		})
		if len(cand) > nlive {
			slices.SortFunc(cand, index.CmpVer)
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
func (s *Set) writebackEpochLBAs(vi int, lbas []uint64) (int, error) {
	v := s.vol(vi)
	var items []wbItem
	var runs []blockRange
	s.mu.Lock()
	if oldest, ok := s.mu.OldestEpoch(vi); ok {
		for _, lba := range lbas {
			e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
			if !ok || !e.Dirty() || s.mu.BlockEpoch(e.Block()) != oldest {
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
		return s.writebackEpoch(vi, max(len(lbas), 1))
	}
	return s.writeItems(vi, items, runs)
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
// the written versions clean.
func (s *Set) writeItems(vi int, items []wbItem, runs []blockRange) (int, error) {
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
		s.mu.Unlock()
	}()
	// Queue depth: up to wbQueueDepth runs, but at most about
	// wbInflightBytes in flight, so long sequential runs reach the disk
	// nearly in order (a disk's write cache destages what arrives first).
	qd := max(2, min(wbQueueDepth, wbInflightBytes/(blockSize*len(items)/len(runs))))
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
			b := &s.mu.Buckets[int64(it.loc)/s.bpb]
			valid[i] = claimed && b.Gen == it.gen && s.hasVersionLocked(vi, it.lba, it.loc, it.crc)
			if valid[i] {
				b.Pins++
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
				if err := v.writeBackingNoMark(buf[i*blockSize:j*blockSize], its[i].lba); err != nil {
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
// and commits. It returns when no dirty data is left, or with an error when
// some dirty data cannot be written back (failing checksum or device).
func (s *Set) Drain(ctx context.Context) error {
	s.draining.Add(1)
	defer s.draining.Add(-1)
	for {
		progress, left := 0, int64(0)
		failedBefore := s.checksumFailures()
		for vi := range s.volList() {
			from := uint64(0)
			for {
				if err := ctx.Err(); err != nil {
					return err
				}
				if err := s.err(); err != nil {
					return err
				}
				s.mu.Lock()
				lbas, next, done := s.dirtyScanLocked(vi, from, drainBatch, 4*wbBatch)
				s.mu.Unlock()
				if len(lbas) > 0 {
					n, err := s.writeback(vi, lbas)
					if err != nil {
						return fmt.Errorf("drain: %w", err)
					}
					progress += n
				}
				if done {
					break
				}
				from = next
			}
		}
		s.mu.Lock()
		for _, v := range s.vols {
			left += v.idx.Dirty
		}
		target := s.mu.seq
		s.mu.Unlock()
		if err := s.commit(target); err != nil {
			return fmt.Errorf("drain: %w", err)
		}
		if left == 0 {
			return nil
		}
		if progress == 0 {
			// Busy blocks get released quickly; failing ones never.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
			s.mu.Lock()
			still := int64(0)
			for _, v := range s.vols {
				still += v.idx.Dirty
			}
			s.mu.Unlock()
			if still == left && s.checksumFailures() > failedBefore {
				return fmt.Errorf("drain: %d dirty blocks cannot be written back: %w", left, ErrChecksum)
			}
		}
	}
}

func (s *Set) checksumFailures() (n uint64) {
	for _, v := range s.volList() {
		n += v.st.checksumErrors.Load()
	}
	return n
}

// parallel runs f(0..n-1) with at most qd calls in flight, started in
// order; after a call fails no new one starts. It returns every error of
// the calls that ran (errors.Join): two runs of a writeback batch can fail
// on the backing device at once, and each failure must reach the caller's
// log, not only the first (found by TestDeviceFailureModel/seq).
func parallel(n, qd int, f func(i int) error) error {
	if n == 1 {
		return f(0)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	sem := make(chan struct{}, qd)
	for i := 0; i < n; i++ {
		sem <- struct{}{}
		mu.Lock()
		stop := len(errs) > 0
		mu.Unlock()
		if stop {
			<-sem
			break
		}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := f(i); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
