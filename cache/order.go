package cache

// Epoch order's escape hatch: degrading to LBA order when epoch order's
// writeback falls behind, and the return by a full drain or a catch-up
// (docs/CACHE.md, "Epoch order", which describes it once; why:
// docs/DESIGN.md). Here: degrade (superblock first, then the superseded
// versions dropped), catchUp (the cut), restoreOrder (the return, in
// memory, then a commit and backing sync, then the superblock), and
// degradeReason, the triggers.

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// degradeReason says why a volume left epoch order.
type degradeReason string

const (
	degradeSpace      degradeReason = "space-wait"
	degradeSequential degradeReason = "sequential-bypass"
	degradeSuperseded degradeReason = "superseded"
	degradeSettings   degradeReason = "order-change" // switched to epoch order with dirty data of lba order
	// A write-zeroes too large to write into the cache as zero blocks
	// while older epochs are dirty.
	degradeLargeZeroes degradeReason = "large-zeroes"
	// A write to the backing device routed before a flush made older
	// epochs of what was current (orderBeforeBacking).
	degradePassthrough degradeReason = "passthrough"
)

// supShareDegrade: superseded versions at this share of the cache, with
// free buckets short, degrade the volume.
const supShareDegrade = 0.25

// catchUpAfter is how long a degraded volume runs in lba order (since it
// degraded, or since its last catch-up ended in a degrade), and how long
// since a write stream of it last went around the cache, before it cuts
// to catch up with epoch order under writes that do not stop.
const catchUpAfter = 5 * time.Second

// orderState is a volume's epoch-order state.
type orderState struct {
	// mu serializes degrade and restore (their superblock writes).
	mu sync.Mutex
	// degraded: writeback runs in LBA order although the volume's setting
	// is epoch. Changed under Set.mu (read without it by keepSuperseded).
	degraded atomic.Bool
	// since is when the volume degraded (unix nanos), 0 when the backing
	// device is consistent; it stays set until the superblock says
	// consistent again.
	since    atomic.Int64
	degrades atomic.Uint64
	reason   atomic.Pointer[degradeReason]
	// at is when the volume last degraded (unix nanos; 0 at Open).
	at atomic.Int64
	// cut is the first epoch of a catch-up (versions of earlier epochs are
	// written back as one), 0 when none is running. Changed under Set.mu
	// with degraded.
	cut atomic.Uint64
	// catchUps counts the cuts made (VolumeStats.CatchUps).
	catchUps atomic.Uint64
}

// epochSetting reports whether the volume's setting is epoch order
// (whether or not it is degraded now).
func (s *Set) epochSetting(vi int) bool {
	cfg := s.vol(vi).cfg.Load()
	return cfg != nil && cfg.WritebackOrder == OrderEpoch
}

// degrade takes volume v out of epoch order (docs/CACHE.md, "Epoch order"). It
// does nothing if v is not in epoch order or already degraded. If the
// superblock cannot be written the set fails over instead.
func (v *Volume) degrade(why degradeReason) {
	s := v.s
	v.ord.mu.Lock()
	defer v.ord.mu.Unlock()
	if !s.epochSetting(v.vi) || v.ord.degraded.Load() || s.isFailed() {
		return
	}
	now := time.Now().UnixNano()
	v.ord.at.Store(now)
	if since := v.ord.since.Load(); since != 0 {
		now = since // a catch-up that degraded again: inconsistent since the first
	}
	if err := s.setInconsistentSince(v.vi, now); err != nil {
		// A metadata write the cache device failed: the set fails over
		// (failover.go), and what was to leave epoch order goes around
		// the cache from now on.
		s.failover(fmt.Errorf("volume %s leaving epoch order: %w", v.name, err))
		return
	}
	s.mu.Lock()
	v.ord.degraded.Store(true)
	v.ord.cut.Store(0)
	nsup := v.idx.NSup
	s.mu.DropAllSup(v.vi)
	s.mu.cond.Broadcast()
	s.mu.Unlock()
	v.ord.since.Store(now)
	v.ord.reason.Store(&why)
	v.ord.degrades.Add(1)
	s.log.Warn("writeback fell behind: leaving epoch order for lba order until the next full drain; the backing device alone is not consistent until then",
		"volume", v.name, "reason", string(why), "superseded_dropped_bytes", nsup*blockSize)
	s.kickWB()
	s.kick()
}

// catchUp cuts a degraded volume that still has dirty data back to epoch
// order (docs/CACHE.md, "Epoch order"), catchUpAfter after it degraded
// and after its last write stream went around the cache, with free
// buckets not short. It reports whether it cut.
func (v *Volume) catchUp() bool {
	s := v.s
	if !v.ord.degraded.Load() || v.ord.cut.Load() != 0 || time.Since(time.Unix(0, v.ord.at.Load())) < catchUpAfter || v.streamWithin(catchUpAfter) {
		return false
	}
	v.ord.mu.Lock()
	defer v.ord.mu.Unlock()
	if !s.epochSetting(v.vi) || s.isFailed() {
		return false
	}
	s.mu.Lock()
	if !v.ord.degraded.Load() || len(s.mu.free) < s.lowWater() || s.mu.closed {
		s.mu.Unlock()
		return false
	}
	v.idx.epoch++
	v.ord.cut.Store(v.idx.epoch)
	v.ord.degraded.Store(false)
	v.ord.catchUps.Add(1)
	dirty := v.idx.Dirty
	s.mu.Unlock()
	s.log.Info("catching up with epoch order: writing back the dirty data of before now in one pass; the backing device is consistent again when it is done",
		"volume", v.name, "dirty_bytes", dirty*blockSize)
	s.kickWB()
	return true
}

// caughtUpLocked reports whether a volume leaving lba order has nothing
// left to write before it is in epoch order proper: no dirty data, or (in
// a catch-up) none of an epoch before the cut.
// REQUIRES: s.mu
func (v *Volume) caughtUpLocked() bool {
	if v.idx.Dirty+v.idx.NSup == 0 {
		return true
	}
	cut := v.ord.cut.Load()
	if cut == 0 || v.ord.degraded.Load() {
		return false
	}
	oldest, ok := v.s.mu.OldestEpoch(v.vi)
	return !ok || oldest >= cut
}

// restoreWait is how long a degraded volume that has written back all of
// its dirty data (by background writeback, not a catch-up's cut or a
// Drain) waits before returning to epoch order: until no write stream has
// gone around the cache for catchUpAfter, as a catch-up does. A stream
// that pauses (RocksDB's between two table files) finds the volume still
// in lba order when it resumes; back in epoch order it would find the
// pause's small epochs dirty and degrade it again, each time with a
// superblock write on the stream's first request and a commit, backing
// sync and superblock write to come back.
func (v *Volume) restoreWait() time.Duration {
	if !v.ord.degraded.Load() || v.ord.cut.Load() != 0 {
		return 0
	}
	at := v.pol.StreamAt.Load()
	if at == 0 {
		return 0
	}
	return max(time.Duration(at+int64(catchUpAfter)-nowNanos()), 0)
}

// restoreOrder returns a degraded volume with no dirty data, or one whose
// catch-up has written back everything before its cut, to epoch order
// (docs/CACHE.md, "Epoch order"). It reports whether it did.
func (v *Volume) restoreOrder() bool {
	s := v.s
	if !v.ord.degraded.Load() && v.ord.since.Load() == 0 {
		return false
	}
	v.ord.mu.Lock()
	defer v.ord.mu.Unlock()
	s.mu.Lock()
	// Backing writes in flight (writeback's or passthrough's claims) end
	// first; a batch that took versions since cleaned writes nothing.
	for len(v.idx.busy) != 0 && v.caughtUpLocked() && !s.mu.closed {
		s.mu.cond.Wait()
	}
	if !v.caughtUpLocked() || s.mu.closed {
		s.mu.Unlock()
		return false
	}
	if s.epochSetting(v.vi) {
		v.ord.degraded.Store(false)
	}
	target := s.mu.seq
	s.mu.Unlock()
	if err := s.commit(target); err != nil {
		return false
	}
	if err := s.syncBackings(); err != nil {
		return false
	}
	if !s.epochSetting(v.vi) || v.ord.degraded.Load() {
		return false // left epoch order meanwhile: nothing to report consistent
	}
	if err := s.setInconsistentSince(v.vi, 0); err != nil {
		s.log.Warn("cannot record the return to epoch order", "volume", v.name, "err", err)
		return false
	}
	v.ord.cut.Store(0)
	since := v.ord.since.Swap(0)
	s.log.Info("back in epoch order: the backing device alone is consistent again", "volume", v.name,
		"inconsistent_for", time.Since(time.Unix(0, since)).Round(time.Millisecond).String())
	return true
}

// setInconsistentSince records t (0: consistent) for slot vi in the
// superblock.
func (s *Set) setInconsistentSince(vi int, t int64) error {
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	if s.sb.Backings[vi].InconsistentSince == t {
		return nil
	}
	err := s.updateSuperblockLocked(func(nsb *Superblock) error {
		nsb.Backings[vi].InconsistentSince = t
		return nil
	})
	if err != nil {
		return fmt.Errorf("recording the consistency of %s: %w", s.vol(vi).name, err)
	}
	return nil
}

// epochBatchLimit is the newest epoch a writeback batch of v may take when
// oldest is its oldest dirty epoch: oldest itself, or during a catch-up
// every epoch before the cut (they are written back as one).
func (v *Volume) epochBatchLimit(oldest uint64) uint64 {
	if cut := v.ord.cut.Load(); cut > oldest {
		return cut - 1
	}
	return oldest
}

// behindLocked reports whether epoch-order writeback of v cannot keep up
// with the space the cache needs: free buckets short and superseded
// versions at supShareDegrade of the cache.
// REQUIRES: s.mu
func (s *Set) behindLocked(v *Volume) bool {
	return len(s.mu.free) < s.lowWater() && float64(v.idx.NSup) >= supShareDegrade*float64(s.mu.CacheBlocks())
}

// fillOrderStats sets the writeback-order fields of st.
func (v *Volume) fillOrderStats(st *VolumeStats) {
	epoch := v.s.epochSetting(v.vi)
	since := v.ord.since.Load()
	st.BackingConsistent = epoch && since == 0 && !v.ord.degraded.Load()
	if since != 0 {
		st.InconsistentSince = time.Unix(0, since)
	}
	st.WritebackDegrades = v.ord.degrades.Load()
	if r := v.ord.reason.Load(); r != nil {
		st.DegradeReason = string(*r)
	}
	st.CatchingUp, st.CatchUps = v.ord.cut.Load() != 0, v.ord.catchUps.Load()
}
