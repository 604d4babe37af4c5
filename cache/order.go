package cache

// Epoch order's escape hatch: degrading to LBA order.
//
// In epoch order the backing device alone holds the image after some
// client flush plus part of the next epoch (invariant 8). That costs the
// cache room and the disk time: every superseded version of a block is
// kept until its epoch is written back, and each epoch is written back
// with a backing sync before the next. A workload of many small epochs
// overwriting a region fills the cache with superseded versions faster
// than writeback can retire them; a sequential stream could only bypass
// the cache after every older epoch was written back. Waiting for either
// would stall the client, so instead the volume degrades:
//
//   - the moment is recorded in the superblock (BackingInfo.InconsistentSince)
//     before anything else changes, so a restart keeps saying so and
//     recovery keeps no superseded version;
//   - the superseded versions are dropped and writeback runs in LBA order
//     (keepSuperseded is false), sequential streams and writes that find
//     no free bucket go around the cache as in lba order;
//   - once the volume has no dirty data left (the next full drain), it
//     returns to epoch order by itself: in memory under Set.mu at the
//     moment the last dirty block is marked clean (so every later write
//     keeps its older versions again), then, after a commit has made the
//     clean marks durable and synced the backing device, in the
//     superblock. Stats report the backing device consistent only from
//     then on.
//
// The volume degrades when (degradeReason):
//
//   - a write in epoch order finds no free bucket after helping
//     writeback once (allocWaitWriteback);
//   - a sequential stream longer than sequential_cutoff arrives while
//     older epochs are dirty;
//   - free buckets are short and superseded versions hold a quarter of
//     the cache (writebackLoop): writeback in epoch order cannot free
//     space fast enough.

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
}

// epochSetting reports whether the volume's setting is epoch order
// (whether or not it is degraded now).
func (s *Set) epochSetting(vi int) bool {
	cfg := s.vol(vi).cfg.Load()
	return cfg != nil && cfg.WritebackOrder == OrderEpoch
}

// degrade takes volume v out of epoch order (see the file comment). It
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
	if err := s.setInconsistentSince(v.vi, now); err != nil {
		// A metadata write the cache device failed: the set fails over
		// (failover.go), and what was to leave epoch order goes around
		// the cache from now on.
		s.failover(fmt.Errorf("volume %s leaving epoch order: %w", v.name, err))
		return
	}
	s.mu.Lock()
	v.ord.degraded.Store(true)
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

// restoreOrder returns a degraded volume with no dirty data to epoch order
// (see the file comment). It reports whether it did.
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
	for len(v.idx.busy) != 0 && v.idx.Dirty+v.idx.NSup == 0 && !s.mu.closed {
		s.mu.cond.Wait()
	}
	if v.idx.Dirty+v.idx.NSup != 0 || s.mu.closed {
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
	if !s.epochSetting(v.vi) {
		return false // left epoch order meanwhile: nothing to report consistent
	}
	if err := s.setInconsistentSince(v.vi, 0); err != nil {
		s.log.Warn("cannot record the return to epoch order", "volume", v.name, "err", err)
		return false
	}
	since := v.ord.since.Swap(0)
	s.log.Info("back in epoch order after a full drain: the backing device alone is consistent again", "volume", v.name,
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
}
