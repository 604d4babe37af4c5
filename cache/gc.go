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
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/tiercache/tiercache/internal/invariants"
)

// run is a contiguous piece of cache blocks inside one bucket.
type run struct {
	loc uint32
	n   int
}

func (s *Set) lowWater() int { return max(2, len(s.mu.buckets)/8) }

func (s *Set) kick() {
	select {
	case s.kickGC <- struct{}{}:
	default:
	}
}

// alloc hands out up to n blocks in the open bucket and pins the bucket until
// the caller calls unpin. With wait it blocks until space is free; without
// it (promotion), it fails rather than use the free reserve. It never holds
// a pin while waiting, so waiters cannot starve gc.
func (s *Set) alloc(n int, wait bool) (run, error) {
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
			b := &s.mu.buckets[s.mu.open]
			if int64(b.fill) < s.bpb {
				k := min(n, int(s.bpb)-int(b.fill))
				r := run{loc: uint32(s.mu.open*s.bpb) + b.fill, n: k}
				b.fill += uint32(k)
				b.pins++
				return r, nil
			}
			b.state = bucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(s.mu.open))
			s.mu.open = -1
		}
		if len(s.mu.free) < s.lowWater() {
			s.kick()
		}
		if len(s.mu.free) == 0 || (!wait && len(s.mu.free) < s.lowWater()) {
			if !wait {
				return run{}, errNoSpace
			}
			s.mu.cond.Wait()
			continue
		}
		bi := s.mu.free[0]
		s.mu.free = s.mu.free[1:]
		b := &s.mu.buckets[bi]
		b.state, b.fill = bucketOpen, 0
		s.mu.open = int64(bi)
	}
}

// REQUIRES: s.mu
func (s *Set) unpinLocked(loc uint32) {
	s.mu.buckets[int64(loc)/s.bpb].pins--
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
		// Volumes that left writeback mode trickle their dirty data out.
		for _, v := range s.vols {
			if v.Mode() != Writeback {
				s.mu.Lock()
				lbas := s.dirtyLBAsLocked(v.vi, 0, 256)
				s.mu.Unlock()
				if len(lbas) > 0 {
					if _, err := s.writeback(v.vi, lbas); err != nil {
						s.log.Warn("background writeback failed", "volume", v.name, "err", err)
					}
				}
			}
		}
	}
}

func (s *Set) needSpace() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.mu.closed && s.err() == nil && len(s.mu.free) < s.lowWater() && len(s.mu.sealed) > 0
}

// evictOne frees the oldest sealed bucket it can. It reports whether it made
// progress.
func (s *Set) evictOne() bool {
	s.mu.Lock()
	var victim int64 = -1
	for _, bi := range s.mu.sealed {
		if s.mu.buckets[bi].pins == 0 || s.mu.buckets[bi].live > 0 {
			victim = int64(bi)
			break
		}
	}
	if victim < 0 {
		s.mu.Unlock()
		return false
	}
	perVol := map[int][]uint64{}
	for loc := victim * s.bpb; loc < (victim+1)*s.bpb; loc++ {
		if k := s.mu.owner[loc]; k != 0 {
			vi, lba := splitOwner(k)
			if e, ok := s.vols[vi].idx.tree.Get(ent{lba: lba}); ok && e.dirty() {
				perVol[vi] = append(perVol[vi], lba)
			}
		}
	}
	s.mu.Unlock()
	for vi, lbas := range perVol {
		slices.Sort(lbas)
		if _, err := s.writeback(vi, lbas); err != nil {
			s.log.Warn("writeback for eviction failed", "volume", s.vols[vi].name, "err", err)
		}
	}
	s.mu.Lock()
	b := &s.mu.buckets[victim]
	s.dropBucketLocked(victim, true)
	if invariants.Enabled {
		if err := s.checkLocked(); err != nil {
			invariants.AssertionFailedf("after evicting bucket %d: %v", victim, err)
		}
	}
	if b.live > 0 || b.pins > 0 || b.state != bucketSealed {
		// Dirty blocks that could not be written back yet (claimed by a
		// passthrough write, or failing), or reads in flight: retry later,
		// after the other sealed buckets.
		s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
		if b.state == bucketSealed {
			s.mu.sealed = append(s.mu.sealed, uint32(victim))
		}
		s.mu.Unlock()
		return false
	}
	s.mu.sealed = slices.DeleteFunc(s.mu.sealed, func(x uint32) bool { return int64(x) == victim })
	b.gen++
	b.state = bucketFreeing
	s.appendLocked(&rec{typ: recReuse, bucket: uint32(victim), gen: b.gen})
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
	b.state, b.fill = bucketFree, 0
	s.mu.free = append(s.mu.free, uint32(victim))
	s.mu.cond.Broadcast()
	s.stats.evictions.Add(1)
	return true
}

// dirtyLBAsLocked lists up to max dirty blocks of volume vi from lba on.
// REQUIRES: s.mu
func (s *Set) dirtyLBAsLocked(vi int, from uint64, limit int) []uint64 {
	var out []uint64
	s.vols[vi].idx.tree.AscendGreaterOrEqual(ent{lba: from}, func(e ent) bool {
		if e.dirty() {
			out = append(out, e.lba)
		}
		return len(out) < limit
	})
	return out
}

// writeback writes the given dirty blocks (sorted LBAs) of volume vi to the
// backing device, syncs it and only then marks them clean (invariant 3). A
// block that changed meanwhile is left alone: the clean mark applies only if
// the entry still points at the cache block that was written back. Blocks
// with a passthrough write in flight are skipped; the passthrough write and
// writeback never overlap on the backing device, so writeback cannot
// resurrect old data over a newer write or zeroes.
func (s *Set) writeback(vi int, lbas []uint64) (int, error) {
	v := s.vols[vi]
	type item struct {
		lba uint64
		loc uint32
		crc uint32
		ok  bool
	}
	var items []item
	var claims []blockRange
	s.mu.Lock()
	for _, lba := range lbas {
		e, ok := v.idx.tree.Get(ent{lba: lba})
		if !ok || !e.dirty() || v.busyLocked(lba, 1) {
			continue
		}
		if len(items) > 0 && items[len(items)-1].lba+1 == lba {
			claims[len(claims)-1].n++
		} else {
			claims = append(claims, blockRange{lba, 1})
		}
		items = append(items, item{lba: lba, loc: e.block(), crc: e.crc})
		s.mu.buckets[int64(e.block())/s.bpb].pins++
	}
	v.idx.busy = append(v.idx.busy, claims...)
	s.mu.Unlock()
	if len(items) == 0 {
		return 0, nil
	}
	release := func() {
		s.mu.Lock()
		for _, it := range items {
			s.unpinLocked(it.loc)
		}
		v.releaseLocked(claims)
		s.mu.Unlock()
	}
	buf := make([]byte, len(items)*blockSize)
	// Read from the cache, merging consecutive cache blocks.
	for i := 0; i < len(items); {
		j := i + 1
		for j < len(items) && items[j].loc == items[j-1].loc+1 {
			j++
		}
		if _, err := s.dev.ReadAt(buf[i*blockSize:j*blockSize], s.cacheOff(items[i].loc)); err != nil {
			release()
			return 0, fmt.Errorf("writeback: reading cache: %w", err)
		}
		i = j
	}
	for i := range items {
		p := buf[i*blockSize : (i+1)*blockSize]
		if got := crc32c(p); got != items[i].crc {
			v.st.checksumErrors.Add(1)
			s.log.Error("dirty block fails its checksum; not written back", "volume", v.name,
				"lba", items[i].lba, "cache_offset", s.cacheOff(items[i].loc), "expected", items[i].crc, "actual", got)
			continue
		}
		items[i].ok = true
	}
	// Write to the backing device, merging consecutive LBAs.
	var werr error
	written := 0
	for i := 0; i < len(items); {
		if !items[i].ok {
			i++
			continue
		}
		j := i + 1
		for j < len(items) && items[j].ok && items[j].lba == items[j-1].lba+1 {
			j++
		}
		if err := v.writeBacking(buf[i*blockSize:j*blockSize], items[i].lba); err != nil {
			werr = fmt.Errorf("writeback to %s: %w", v.name, err)
			break
		}
		written += j - i
		i = j
	}
	release()
	if werr != nil {
		return 0, werr
	}
	if written == 0 {
		return 0, nil
	}
	if err := v.back.Sync(); err != nil {
		return 0, fmt.Errorf("writeback: syncing %s: %w", v.name, err)
	}
	s.mu.Lock()
	n := 0
	for _, it := range items {
		if it.ok && s.markCleanLocked(vi, it.lba, it.loc) {
			s.appendLocked(&rec{typ: recClean, vol: uint16(vi), lba: it.lba, loc: it.loc})
			n++
		}
	}
	s.mu.Unlock()
	v.st.writebackBytes.Add(uint64(n) * blockSize)
	s.stats.writebackBlocks.Add(uint64(n))
	return n, nil
}

// Drain writes every dirty block of every volume back to its backing device
// and commits. It returns when no dirty data is left, or with an error when
// some dirty data cannot be written back (failing checksum or device).
func (s *Set) Drain(ctx context.Context) error {
	for {
		progress, left := 0, int64(0)
		failedBefore := s.checksumFailures()
		for vi := range s.vols {
			from := uint64(0)
			for {
				if err := ctx.Err(); err != nil {
					return err
				}
				if err := s.err(); err != nil {
					return err
				}
				s.mu.Lock()
				lbas := s.dirtyLBAsLocked(vi, from, 1024)
				s.mu.Unlock()
				if len(lbas) == 0 {
					break
				}
				n, err := s.writeback(vi, lbas)
				if err != nil {
					return fmt.Errorf("drain: %w", err)
				}
				progress += n
				from = lbas[len(lbas)-1] + 1
			}
		}
		s.mu.Lock()
		for _, v := range s.vols {
			left += v.idx.dirty
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
				still += v.idx.dirty
			}
			s.mu.Unlock()
			if still == left && s.checksumFailures() > failedBefore {
				return fmt.Errorf("drain: %d dirty blocks cannot be written back: %w", left, ErrChecksum)
			}
		}
	}
}

func (s *Set) checksumFailures() (n uint64) {
	for _, v := range s.vols {
		n += v.st.checksumErrors.Load()
	}
	return n
}
