package cache

// Eviction. When fewer than lowWater buckets are free, the gc goroutine
// frees sealed buckets, cheapest first (pickVictimsLocked): it writes their
// dirty blocks back to the backing devices (sorted by LBA, then synced:
// invariant 3) or moves them (gcMove), drops their clean entries, bumps
// their generation, journals the bump (a reuse record) and commits, and
// only then puts them on the free list. So a bucket is reused only after
// no live entry points into it (invariant 5), and after a crash the
// replayed reuse record drops any entry of the old generation that
// eviction dropped only in memory.

import (
	"cmp"
	"errors"
	"slices"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/internal/invariants"
)

// gcLoop frees buckets while free ones are short (needSpace). It is
// signalled (kick) by the allocations that take the free list under the
// low-water mark. A pass that stops short of it because nothing could be
// freed yet (reads pinning the only victims, writeback failing) tries
// again after gcRetry, or at the next signal if that comes first.
func (s *Set) gcLoop() {
	retry := time.NewTimer(gcRetry)
	retry.Stop()
	defer retry.Stop()
	for {
		for s.needSpace() {
			if !s.evictOne() {
				break
			}
		}
		var again <-chan time.Time
		if s.needSpace() {
			retry.Reset(gcRetry)
			again = retry.C
		}
		select {
		case <-s.stop:
			return
		case <-s.kickGC:
		case <-again:
		}
		retry.Stop()
	}
}

// gcRetry is how long gcLoop waits, unless signalled, before another pass
// after one that freed nothing while free buckets are still short.
const gcRetry = 100 * time.Millisecond

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
		b, a := &s.mu.Buckets[bi], &s.mu.alloc[bi]
		if a.pins > 0 && b.Live == 0 {
			continue
		}
		var key [3]uint64
		switch {
		case b.Live == 0:
			key = [3]uint64{0, 0, a.atime}
		case b.Dirty == 0:
			key = [3]uint64{1, a.atime, 0}
		default:
			key = [3]uint64{2, uint64(b.Live), a.atime}
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
// writes in flight, which pin the bucket. An index leaf that cannot be
// loaded ends the walk with its error: the entries found are not all
// (the set fails over: lazyleaves.go). The leaves a chunk loads are read
// without Set.mu (loadLeavesLocked).
func (s *Set) entriesIn(want func(loc int64) bool) ([]located, error) {
	var out []located
	for vi, v := range s.volList() {
		from, more := uint64(0), true
		for more {
			more = false
			visited := 0
			s.mu.Lock()
			// The next leaves to load, read without s.mu (a chunk
			// visits fewer leaves than maxUnlockedLeaves).
			v.loadLeavesLocked(from, index.MaxLBA-from)
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
			err := v.idx.Tree.TakeFault()
			s.mu.Unlock()
			if err != nil {
				return nil, err
			}
		}
	}
	return out, nil
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
		ls, err := s.entriesIn(func(loc int64) bool { return isVictim[loc/s.bpb] })
		if err != nil {
			// The victims' entries are not all known: none is freed.
			_ = s.failover(err)
			return false
		}
		for _, l := range ls {
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
	if s.mu.alloc[victim].state != bucketSealed {
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
		if _, err := s.vol(vi).wb.Evict(lbas); err != nil {
			s.log.Warn("writeback for eviction failed", "volume", s.vol(vi).name, "err", err)
		}
	}
	s.mu.Lock()
	b, a := &s.mu.Buckets[victim], &s.mu.alloc[victim]
	for _, it := range items {
		v := s.vols[it.vi]
		if e, ok := v.idx.Tree.Get(it.e); ok && !e.Dirty() && e.Block() == it.e.Block() {
			v.idx.Tree.Delete(e)
			s.mu.Unaccount(it.vi, e)
		}
	}
	if invariants.Enabled {
		// An index leaf the check cannot load (lazyleaves.go) is the
		// set failing over, not a broken invariant.
		if err := s.checkLocked(); err != nil && !errors.As(err, new(*index.FaultError)) {
			invariants.AssertionFailedf("after evicting bucket %d: %v", victim, err)
		}
	}
	if b.Live > 0 || a.pins > 0 || a.state != bucketSealed {
		// Dirty blocks that could not be written back yet (claimed by a
		// passthrough write, or failing), entries of writes that were in
		// flight during the walk, or reads in flight: retry later, after
		// the other sealed buckets.
		s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
		if a.state == bucketSealed {
			s.mu.sealed = append(s.mu.sealed, uint32(victim))
		}
		s.mu.Unlock()
		return false
	}
	s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
	b.Gen++
	a.state = bucketFreeing
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
	a.state, a.fill = bucketFree, 0
	s.mu.free = append(s.mu.free, uint32(victim))
	s.wakeLocked()
	s.stats.evictions.Add(1)
	return true
}

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
	s.mu.alloc[bi].pins++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.mu.alloc[bi].pins--
		s.mu.cond.Broadcast()
		s.mu.Unlock()
	}()
	buf := make([]byte, blockSize)
	for _, it := range items {
		if _, err := s.dev.ReadAt(buf, s.cacheOff(it.e.Block())); err != nil {
			s.cacheIOError("GC move read", err)
			continue // left for writeback, which reports it
		}
		if ondisk.CRC32C(buf) != it.e.CRC && !s.mirrorRepair(buf, it.e.Block(), it.e.CRC) {
			continue // left for writeback, which reports it
		}
		r, err := s.alloc(1, allocNoWait)
		if err != nil {
			return
		}
		if !s.mirrorHolds(r.loc) {
			// A mirrored set's B has no slot for the open bucket: the
			// rest is left for writeback (mirror.go).
			s.mu.Lock()
			s.unpinLocked(r.loc)
			s.mu.Unlock()
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

// freeEmptyBuckets frees every bucket no live block points into (sealed,
// or the open one once nothing in it is live) and that no request pins:
// what a detach leaves behind. It is eviction's last step for many buckets
// at once: each generation is bumped and journaled (a reuse record), one
// commit makes the records durable, and only then do the buckets go on the
// free list. A crash before the commit leaves the buckets out of
// circulation and recovery frees them (no entry points into them); after
// it, replay bumps their generations as eviction's records do. It returns
// the number of buckets freed.
func (s *Set) freeEmptyBuckets() (int, error) {
	if s.isFailed() {
		return 0, nil // nothing is written to a failed cache device
	}
	s.mu.Lock()
	if o := s.mu.open; o >= 0 {
		if a := &s.mu.alloc[o]; s.mu.Buckets[o].Live == 0 && a.pins == 0 && a.fill > 0 {
			a.state = bucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(o))
			s.mu.open = -1
		}
	}
	var freed []uint32
	s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(bi uint32) bool {
		b, a := &s.mu.Buckets[bi], &s.mu.alloc[bi]
		if b.Live > 0 || a.pins > 0 || a.state != bucketSealed {
			return false
		}
		b.Gen++
		a.state = bucketFreeing
		s.appendLocked(&ondisk.Rec{Type: ondisk.RecReuse, Bucket: bi, Gen: b.Gen})
		freed = append(freed, bi)
		return true
	})
	target := s.mu.seq
	s.mu.Unlock()
	if len(freed) == 0 {
		return 0, nil
	}
	err := s.commit(target)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		// The set has failed; keep the buckets out of circulation.
		return 0, err
	}
	for _, bi := range freed {
		a := &s.mu.alloc[bi]
		a.state, a.fill = bucketFree, 0
	}
	s.mu.free = append(s.mu.free, freed...)
	s.wakeLocked()
	s.stats.evictions.Add(uint64(len(freed)))
	return len(freed), nil
}
