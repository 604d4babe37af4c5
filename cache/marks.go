package cache

// Region marks: what keeps the clean cache warm after a crash. The rules
// are described once, in docs/CACHE.md, "Region marks"; here is where
// each is kept:
//
//   - a backing write that can make a clean entry stale waits for its
//     region's mark to be durable, claimed in the same hold of Set.mu
//     (claimBacking);
//   - a checkpoint snapshot leaves out the clean entries of claimed
//     ranges (snapshotCleanExcluding), and marks lapse at every
//     checkpoint (resetMarksLocked);
//   - an unmark ends an idle region's mark (lapseMarksLocked, markIdle);
//   - writeback writes a version back only once its insert is durable
//     (commitBeforeWriteback);
//   - after a failover, or a commit that failed without one, a backing
//     write into an uncovered region first sets the superblock's
//     clean-untrusted flag (untrustClean), so the next recovery is cold;
//   - recovery verifies the clean entries of the regions marked at the
//     journal's end against the backing device (verifyClean, recovery.go).

import (
	"fmt"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// markIdle is how long a region sees no new backing write before its mark
// ends. Shorter ends marks sooner (less of the cache goes cold in a crash)
// but marks a region written now and then again, one commit each time.
const markIdle = 5 * time.Second

// regionMark is a region whose mark record was appended in the current
// journal generation.
type regionMark struct {
	seq  uint64 // Set.mu.seq just after the mark record: covered once durable
	last int64  // nowNanos of the last backing write that started in it
}

// warmState is the set's side of the marks.
type warmState struct {
	shift uint8 // log2 of a region's blocks
	// untrusted: the superblock says clean entries are untrusted (after a
	// failover); untrustErr: setting it failed. REQUIRES: sbMu
	untrusted  bool
	untrustErr error
}

func (s *Set) initWarm(sb *Superblock) {
	s.wm.shift = sb.MarkShift
	s.wm.untrusted = sb.CleanUntrusted
}

// claimBacking claims [lba, lba+n) for a backing write that can make a
// clean entry stale, and returns once the range's regions are covered
// (rule 1 above): it appends the marks missing and commits them. The caller
// releases the claim (releaseLocked) as with claim.
func (v *Volume) claimBacking(lba, n uint64) error {
	s := v.s
	s.mu.Lock()
	v.claimLocked(lba, n)
	if n == 0 {
		s.mu.Unlock()
		return nil
	}
	// With no entry of the volume findable by any recovery (Replayable
	// clear), no clean entry can go stale; an insert appended while the
	// claim is held cannot be of this range (promotion drops it, other
	// writers wait for the claim).
	need := v.idx.Replayable
	target, uncovered := uint64(0), false
	now := nowNanos()
	durable := s.durable.Load()
	for r := lba >> s.wm.shift; need && r <= (lba+n-1)>>s.wm.shift; r++ {
		m := v.idx.marks[r]
		if m == nil {
			if s.isFailed() {
				uncovered = true
				continue
			}
			s.appendLocked(&ondisk.Rec{Type: ondisk.RecMark, Vol: uint16(v.vi), Region: r})
			m = &regionMark{seq: s.mu.seq}
			if v.idx.marks == nil {
				v.idx.marks = map[uint64]*regionMark{}
			}
			v.idx.marks[r] = m
		}
		m.last = now
		if m.seq > durable {
			target = max(target, m.seq)
		}
	}
	failed := s.isFailed()
	s.mu.Unlock()
	if target != 0 && !failed {
		if err := s.commitRecords(target); err != nil && !s.isFailed() {
			// A backing device that cannot sync (any volume's) fails
			// every commit. This volume's write must not fail for it
			// (rule 6): the clean data is marked untrusted instead.
			if uerr := s.untrustClean(fmt.Sprintf("a commit failed (%v)", err)); uerr != nil {
				v.releaseClaim(lba, n)
				return fmt.Errorf("volume %s: marking the region of a backing write: %w", v.name, err)
			}
		}
		// The set failed over meanwhile (this commit or another), or the
		// commit failed: the write goes on uncovered.
		uncovered = s.durable.Load() < target
	} else if target != 0 {
		uncovered = true
	}
	if uncovered {
		// Best effort: the write goes to the backing device either way
		// (a failed-over set keeps serving); see untrustClean.
		_ = s.untrustClean("the cache device failed")
	}
	return nil
}

func (v *Volume) releaseClaim(lba, n uint64) {
	v.s.mu.Lock()
	v.releaseLocked([]blockRange{{lba, n}})
	v.s.mu.Unlock()
}

// untrustClean sets the superblock's clean-untrusted flag (once) so that
// the next recovery drops every clean entry: the set writes a backing
// device where its journal cannot say so (rules 5 and 6 above); why says
// what stopped the journal, for the log. It
// returns the error of the attempt if the flag could not be written (it is
// tried once).
func (s *Set) untrustClean(why string) error {
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	if s.wm.untrusted || s.wm.untrustErr != nil {
		return s.wm.untrustErr
	}
	err := s.updateSuperblockLocked(func(nsb *Superblock) error { nsb.CleanUntrusted = true; return nil })
	if err != nil {
		s.wm.untrustErr = fmt.Errorf("marking the cache's clean data untrusted: %w", err)
		s.log.Error("could not record that the cache's clean data is now untrusted: if the cache device works again, start the next server on it with --cold-clean, or it may serve older cached data for blocks written since then",
			"why", why, "err", err)
		return s.wm.untrustErr
	}
	s.wm.untrusted = true
	s.log.Warn("the cache's clean data is marked untrusted: a backing write went ahead without its region's mark, and the next start recovers the clean cache cold", "why", why)
	return nil
}

// resetMarksLocked starts a journal generation's covered set empty (rule
// 2): called at a checkpoint's snapshot.
// REQUIRES: s.mu
func (s *Set) resetMarksLocked() {
	for _, v := range s.vols {
		v.idx.marks = nil
	}
}

// snapshotCleanExcluding returns the checkpoint snapshot of volume v's
// tree: t, with the clean entries of the ranges claimed for backing writes
// left out (rule 2). t is a clone and may be changed.
// REQUIRES: s.mu
func (s *Set) snapshotCleanExcluding(v *Volume, t *index.Ptree) *index.Ptree {
	if len(v.idx.busy) == 0 {
		return t
	}
	var drop []index.Ent
	for _, r := range v.idx.busy {
		t.AscendRange(index.Ent{LBA: r.lba}, index.Ent{LBA: r.lba + r.n}, func(e index.Ent) bool {
			if !e.Dirty() {
				drop = append(drop, e)
			}
			return true
		})
	}
	for _, e := range drop {
		t.Delete(e)
	}
	return t
}

// lapseMarksLocked appends an unmark for each region with no backing write
// in flight and none started for markIdle (rule 3).
// REQUIRES: s.mu
func (s *Set) lapseMarksLocked(now int64) {
	if s.isFailed() {
		return
	}
	for _, v := range s.vols {
		for r, m := range v.idx.marks {
			if now-m.last < int64(markIdle) || v.busyRegionLocked(r) {
				continue
			}
			delete(v.idx.marks, r)
			s.appendLocked(&ondisk.Rec{Type: ondisk.RecUnmark, Vol: uint16(v.vi), Region: r})
		}
	}
}

// busyRegionLocked reports whether a claim overlaps region r.
// REQUIRES: s.mu
func (v *Volume) busyRegionLocked(r uint64) bool {
	sh := v.s.wm.shift
	return v.busyLocked(r<<sh, 1<<sh)
}

// commitBeforeWriteback makes the insert records of the versions a
// writeback batch is about to write durable (rule 4): target is Set.mu.seq
// when the batch collected them.
func (s *Set) commitBeforeWriteback(target uint64) error {
	if s.durable.Load() >= target {
		return nil
	}
	if err := s.err(); err != nil {
		// Failed over: records not durable by now never will be, and a
		// version written back without its insert record would lie under
		// the older clean version recovery brings back.
		return err
	}
	err := s.commit(target)
	if err != nil && !s.isFailed() {
		// Another volume's backing device that cannot sync must not stop
		// this writeback (rule 6): with the clean data untrusted, no
		// recovery brings back the older clean entries.
		if uerr := s.untrustClean(fmt.Sprintf("a commit before writeback failed (%v)", err)); uerr == nil {
			return nil
		}
	}
	return err
}
