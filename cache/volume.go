package cache

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/policy"
	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// Volume is one backing device seen through the cache: what an NBD export
// serves. It satisfies nbd.Backend, nbd.Trimmer, nbd.ZeroWriter and
// nbd.Prefetcher (checked in volume_test.go; cache does not import nbd).
//
// The cache works in 4 KiB blocks. A write that covers part of a block
// reads the rest of the block through the index first (read-modify-write);
// such writes take rmw exclusively so that two of them never merge with a
// stale copy of each other's block.
type Volume struct {
	s       *Set
	vi      int
	name    string
	size    int64
	nblocks uint64
	back    device.Device
	// free marks the placeholder of a free slot (see Set.vols).
	free bool

	// gate admits client calls (enter/exit): held shared by each call,
	// taken exclusively by Detach to wait for the calls in flight and set
	// gone, after which every call fails with ErrDetached.
	gate sync.RWMutex
	gone bool // REQUIRES: gate
	// detaching is set while a Detach runs (one at a time).
	detaching atomic.Bool

	// rmw is held shared by every write and exclusively by writes that
	// read-modify-write a partial block.
	rmw sync.RWMutex
	// backingUnsynced is set after every write to the backing device that
	// a journal record may depend on (writeback's are not: it syncs before
	// it marks anything clean) and cleared (then synced) by commit.
	backingUnsynced atomic.Bool
	// backSyncErr: the first failed sync of the backing device (sticky;
	// see syncBackings).
	backSyncErr atomic.Pointer[error]
	st          volStats
	// cfg: the settings the superblock holds (the mode included), replaced
	// whole after each superblock update that changes them, under rmw.
	cfg    atomic.Pointer[Settings]
	pol    policy.State
	lastIO atomic.Int64     // unix nanos of the last client request (idle detection)
	wb     writeback.Writer // the volume's writeback (package writeback)
	ord    orderState       // epoch order degraded or not (order.go)
	// wlog: the last wlogSize writes' blocks, for promotions
	// (writtenSinceLocked); guarded by s.mu.
	wlog [wlogSize]wlogEnt

	idx volIndex // guarded by s.mu
	fo  foState  // failover state (failover.go), guarded by s.mu
}

type volStats struct {
	readOps, writeOps, flushOps, trimOps, zeroOps     atomic.Uint64
	readBytes, writeBytes, hitBytes, missBytes        atomic.Uint64
	bypassBytes, promoteBytes, writebackBytes         atomic.Uint64
	checksumErrors, checksumRepairs, promoteSkipBytes atomic.Uint64
	readHitOps, readMissOps, promoteOps               atomic.Uint64
	bypass                                            [bypassFailed + 1]atomic.Uint64 // bytes by reason
	throttleNanos, spaceWaitNanos                     atomic.Uint64
	unreachableReads, fencedWrites, backingSyncErrors atomic.Uint64
	epochDeferBytes                                   atomic.Uint64
}

// VolumeStats are a volume's counters.
type VolumeStats struct {
	Mode                        Mode
	ReadOps, WriteOps, FlushOps uint64
	TrimOps, ZeroOps            uint64
	ReadBytes, WriteBytes       uint64
	ReadHitBytes, ReadMissBytes uint64
	BypassBytes                 uint64 // written straight to the backing device (writearound, none, zeroes, sequential, cache full)
	PromoteBytes                uint64 // read misses copied into the cache
	WritebackBytes              uint64
	// ReadHitOps counts reads served entirely from the cache; ReadMissOps
	// reads that needed the backing device for at least one block.
	ReadHitOps, ReadMissOps uint64
	PromoteOps              uint64 // promotions (runs of blocks copied in)
	// Bytes that skipped the cache, by reason: writes sent to the backing
	// device and read misses not promoted because they were part of a
	// stream longer than sequential_cutoff; writes in writearound/none mode
	// and write-zeroes; read misses not promoted because the free reserve
	// was low (congestion); writes sent around because no bucket was free
	// in time (cache full).
	BypassSequentialBytes, BypassModeBytes      uint64
	BypassCongestionBytes, BypassCacheFullBytes uint64
	// BypassCacheFailedBytes: writes sent to the backing device because
	// the cache device failed a write, or failed over (failover.go).
	BypassCacheFailedBytes uint64
	// WritebackRate is the background writeback target in bytes/s now
	// (0 while under the dirty target; -1 at full speed: idle or draining).
	WritebackRate int64
	// ThrottleNanos is the total time foreground writes were delayed to
	// let writeback catch up when dirty data nears the cache size.
	ThrottleNanos uint64
	// SpaceWaitNanos is the total time foreground writes waited for a free
	// bucket (at most 5 ms each in lba order, where a write then goes
	// around the cache; unbounded in epoch order, where it may not).
	SpaceWaitNanos  uint64
	ChecksumErrors  uint64 // cached blocks that failed verification (clean ones were repaired)
	ChecksumRepairs uint64 // of those, served intact: clean ones re-read from the backing device, a mirrored set's from the other copy
	CachedBlocks    int64
	DirtyBlocks     int64
	// SupersededBlocks are older dirty versions kept for epoch-ordered
	// writeback (not counted in CachedBlocks or DirtyBlocks).
	SupersededBlocks int64
	// After the cache device failed (SetStats.Failed; failover.go):
	// UnreachableDirtyBlocks is the volume's dirty data left on it
	// (DirtyBlocks, which reads and writes cannot reach), LostWriteBlocks
	// the dirty blocks whose journal records never became durable (writes
	// acknowledged before the failure and not flushed: every Flush fails
	// while it is not 0). UnreachableReadErrors counts reads that failed
	// on dirty data the cache device could not return (before or after
	// failover), FencedWriteErrors writes refused after failover because
	// the failed cache may hold a newer durable version of their blocks.
	UnreachableDirtyBlocks, LostWriteBlocks  int64
	UnreachableReadErrors, FencedWriteErrors uint64
	// BackingSyncErrors counts failed syncs of the backing device; after
	// the first, every Flush and FUA request of the volume fails.
	BackingSyncErrors uint64
	// EpochDeferBytes: writethrough, writearound and none writes and
	// small write-zeroes written into the cache as dirty data of the
	// current epoch, because older epochs were still dirty (epoch order;
	// see olderEpochsDirty).
	EpochDeferBytes uint64
	// BackingConsistent: the volume is in epoch order and the backing
	// device alone holds the image after some flush plus part of the
	// next epoch. False in lba order, and while the volume is degraded
	// (order.go): from InconsistentSince until the first full drain.
	BackingConsistent bool
	InconsistentSince time.Time // zero while consistent
	// WritebackDegrades counts the times epoch order degraded to lba
	// order since the server started; DegradeReason is the last reason
	// ("space-wait", "sequential-bypass", "superseded", "order-change").
	WritebackDegrades uint64
	DegradeReason     string
	// CatchingUp: a catch-up to epoch order is running (order.go): the
	// volume is degraded, cut an epoch, and writeback is taking
	// everything dirty from before the cut in one LBA sweep; the backing
	// device is consistent again once that is written back. CatchUps
	// counts the catch-ups started since the server started.
	CatchingUp bool
	CatchUps   uint64
	// WritebackFailures counts background writeback batches that failed
	// (a failing or full backing device); WritebackFailing is set while
	// they keep failing and writeback retries with backoff (package backoff).
	WritebackFailures uint64
	WritebackFailing  bool
}

// enter admits a client call (I/O, flush, settings); exit must follow. It
// fails once the volume is detached: its slot may then hold another volume.
func (v *Volume) enter() error {
	v.gate.RLock()
	if v.gone {
		v.gate.RUnlock()
		return fmt.Errorf("volume %s: %w", v.name, ErrDetached)
	}
	return nil
}

func (v *Volume) exit() { v.gate.RUnlock() }

// Name is the backing device's name in the cache set.
func (v *Volume) Name() string { return v.name }

// Size is the volume size in bytes (the backing device's size).
func (v *Volume) Size() int64 { return v.size }

// Mode returns the current cache mode.
func (v *Volume) Mode() Mode { return v.cfg.Load().Mode }

// SetMode switches the cache mode at run time and records it in the
// superblock. Leaving writeback keeps dirty data readable (reads consult the
// index in every mode); the writeback loop writes it back in the background.
func (v *Volume) SetMode(m Mode) error {
	if !m.Valid() {
		return fmt.Errorf("%w: mode %d", ErrInvalid, int(m))
	}
	return v.updateSettings("set mode of", func(st Settings) Settings { st.Mode = m; return st })
}

// Stats returns the volume's counters.
func (v *Volume) Stats() VolumeStats {
	st := VolumeStats{Mode: v.Mode(),
		ReadOps: v.st.readOps.Load(), WriteOps: v.st.writeOps.Load(), FlushOps: v.st.flushOps.Load(),
		TrimOps: v.st.trimOps.Load(), ZeroOps: v.st.zeroOps.Load(),
		ReadBytes: v.st.readBytes.Load(), WriteBytes: v.st.writeBytes.Load(),
		ReadHitBytes: v.st.hitBytes.Load(), ReadMissBytes: v.st.missBytes.Load(),
		BypassBytes: v.st.bypassBytes.Load(), PromoteBytes: v.st.promoteBytes.Load(),
		WritebackBytes: v.st.writebackBytes.Load(),
		ChecksumErrors: v.st.checksumErrors.Load(), ChecksumRepairs: v.st.checksumRepairs.Load(),
		ReadHitOps: v.st.readHitOps.Load(), ReadMissOps: v.st.readMissOps.Load(), PromoteOps: v.st.promoteOps.Load(),
		BypassSequentialBytes: v.st.bypass[bypassSequential].Load(), BypassModeBytes: v.st.bypass[bypassMode].Load(),
		BypassCongestionBytes: v.st.bypass[bypassCongested].Load(), BypassCacheFullBytes: v.st.bypass[bypassFull].Load(),
		BypassCacheFailedBytes: v.st.bypass[bypassFailed].Load(),
		ThrottleNanos:          v.st.throttleNanos.Load(), SpaceWaitNanos: v.st.spaceWaitNanos.Load(),
		UnreachableReadErrors: v.st.unreachableReads.Load(), FencedWriteErrors: v.st.fencedWrites.Load(),
		BackingSyncErrors: v.st.backingSyncErrors.Load(), EpochDeferBytes: v.st.epochDeferBytes.Load()}
	v.fillOrderStats(&st)
	wst := v.wb.Stats()
	st.WritebackRate, st.WritebackFailures, st.WritebackFailing = wst.Rate, wst.Failures, wst.Failing
	v.s.mu.Lock()
	st.CachedBlocks, st.DirtyBlocks, st.SupersededBlocks = v.idx.Cached, v.idx.Dirty, v.idx.NSup
	st.LostWriteBlocks = v.fo.lost
	if v.s.isFailed() {
		st.UnreachableDirtyBlocks = v.idx.Dirty
	}
	v.s.mu.Unlock()
	return st
}

func (v *Volume) checkIO(off int64, n int64) error {
	if off < 0 || n < 0 || off > v.size || n > v.size-off {
		return fmt.Errorf("volume %s: %d bytes at %d: %w", v.name, n, off, device.ErrOutOfRange)
	}
	return nil
}

// blockSpan returns the blocks covering [off, off+n).
func blockSpan(off, n int64) (first uint64, count int) {
	first = uint64(off >> blockShift)
	last := uint64((off + n - 1) >> blockShift)
	return first, int(last - first + 1)
}

// readBacking reads whole blocks from the backing device; the part of the
// last block beyond the device's end reads as zeroes.
func (v *Volume) readBacking(p []byte, lba uint64) error {
	off := int64(lba) << blockShift
	n := min(int64(len(p)), v.size-off)
	if n < int64(len(p)) {
		clear(p[max(n, 0):])
	}
	if n <= 0 {
		return nil
	}
	if _, err := v.back.ReadAt(p[:n], off); err != nil {
		return fmt.Errorf("reading %s at %d: %w", v.name, off, err)
	}
	return nil
}

// markBackingUnsynced notes a write to the backing device that commit
// must sync (backingUnsynced) and tells commitLoop.
func (v *Volume) markBackingUnsynced() {
	v.backingUnsynced.Store(true)
	v.s.noteCommitDue()
}

// writeBacking writes whole blocks, clipped at the device's end, and marks
// the backing device for commit's sync.
func (v *Volume) writeBacking(p []byte, lba uint64) error {
	if err := v.writeBackingNoMark(p, lba); err != nil {
		return err
	}
	v.markBackingUnsynced()
	return nil
}

// writeBackingNoMark is writeBacking for writeback, which syncs the backing
// device itself before it marks anything clean (invariant 3). Marking
// would make every client FLUSH during writeback wait for the backing
// device to destage writeback's writes, which no record of the flush
// depends on.
func (v *Volume) writeBackingNoMark(p []byte, lba uint64) error {
	off := int64(lba) << blockShift
	n := min(int64(len(p)), v.size-off)
	if n <= 0 {
		return nil
	}
	if _, err := v.back.WriteAt(p[:n], off); err != nil {
		return fmt.Errorf("writing %s at %d: %w", v.name, off, err)
	}
	return nil
}

// ReadAt fills p with the volume's data at off.
func (v *Volume) ReadAt(p []byte, off int64) error {
	_, err := v.ReadAtTier(p, off)
	return err
}

// promoteMode says what readBlocks does with read misses.
type promoteMode int

const (
	promoteNo        promoteMode = iota // internal read (read-modify-write)
	promotePolicy                       // client read: the volume's promote setting decides
	promoteSeqBypass                    // client read in a sequential stream: not promoted
	promoteForce                        // NBD_CMD_CACHE: always promoted
)

// olderEpochsDirty reports, in epoch order (not degraded), whether dirty
// versions of an epoch before the current one are in the cache: nothing
// may reach the backing device before them (route).
func (v *Volume) olderEpochsDirty() bool {
	s := v.s
	if !s.keepSuperseded(v.vi) || s.isFailed() {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	oldest, ok := v.oldestEpochLocked()
	return ok && oldest < v.idx.epoch
}

// epochZeroInCache is the largest write-zeroes or trim written into the
// cache as zero blocks while older epochs are dirty (route), and the
// largest trim written so over a backing that keeps unsynced writes.
const epochZeroInCache = 1 << 20

// zeroPieceBlocks is the most zero blocks routeBlocks writes into the
// cache at once.
const zeroPieceBlocks = epochZeroInCache / blockSize

// orderBeforeBacking is called before a write to the backing device that
// route allowed: if a flush made older epochs of what was current since
// (older epochs dirty now), the volume leaves epoch order rather than
// wait for them.
func (v *Volume) orderBeforeBacking() {
	if v.olderEpochsDirty() {
		v.degrade(degradePassthrough)
	}
}

// hasDirty reports whether the volume has dirty data in the cache.
func (v *Volume) hasDirty() bool {
	v.s.mu.Lock()
	defer v.s.mu.Unlock()
	return v.idx.Dirty+v.idx.NSup > 0
}

// touch records foreground activity (idle detection for writeback).
func (v *Volume) touch() { v.lastIO.Store(nowNanos()) }

// readBlocks reads n whole blocks. Cached blocks come from the cache and are
// verified (invariant 4); the rest come from the backing device and may be
// promoted into the cache.
func (v *Volume) readBlocks(buf []byte, lba uint64, n int, pm promoteMode) error {
	_, err := v.readBlocksHit(buf, lba, n, pm)
	return err
}

// readBlocksHit is readBlocks; hit reports that every block was cached.
func (v *Volume) readBlocksHit(buf []byte, lba uint64, n int, pm promoteMode) (hit bool, err error) {
	s := v.s
	if s.isFailed() {
		return false, v.readFailed(buf, lba, n)
	}
	var hits []index.Ent
	s.mu.Lock()
	v.loadLeavesLocked(lba, uint64(n))
	s.mu.tick++
	v.idx.Tree.AscendRange(index.Ent{LBA: lba}, index.Ent{LBA: lba + uint64(n)}, func(e index.Ent) bool {
		hits = append(hits, e)
		a := &s.mu.alloc[int64(e.Block())/s.bpb]
		a.pins++
		a.atime = s.mu.tick // recency for eviction
		return true
	})
	if err := v.idx.Tree.TakeFault(); err != nil {
		// An index leaf of the range cannot be loaded: the set fails
		// over, and the read is served as after it (the leaf's blocks
		// are unreachable).
		v.releaseHitsLocked(hits, nil)
		s.mu.Unlock()
		cause := s.leafFaulted()
		if cause == nil {
			cause = err
		}
		_ = s.failover(cause)
		return false, v.readFailed(buf, lba, n)
	}
	muts := v.idx.mutations
	busy := v.busyLocked(lba, uint64(n))
	s.mu.Unlock()
	var drop []index.Ent
	defer func() {
		s.mu.Lock()
		v.releaseHitsLocked(hits, drop)
		s.mu.Unlock()
	}()
	// Cached and backing pieces, all in flight at once (readpath.go).
	misses, fromBacking, err := v.readPieces(buf, lba, n, hits)
	if err != nil {
		return false, err
	}
	hit = len(misses) == 0
	// Verify every block read from the cache.
	drop, err = v.verifyHits(buf, lba, hits, fromBacking)
	if err != nil {
		return false, err
	}
	if pm == promoteNo {
		return hit, nil
	}
	hitBytes := uint64(len(hits)) * blockSize
	v.st.hitBytes.Add(hitBytes)
	v.st.missBytes.Add(uint64(n)*blockSize - hitBytes)
	if len(misses) == 0 {
		v.st.readHitOps.Add(1)
		return hit, nil
	}
	v.st.readMissOps.Add(1)
	missBytes := uint64(n)*blockSize - hitBytes
	switch {
	case v.Mode() == None:
		v.st.bypass[bypassMode].Add(missBytes)
		return hit, nil
	case pm == promoteSeqBypass:
		v.st.bypass[bypassSequential].Add(missBytes)
		return hit, nil
	case busy:
		return hit, nil
	}
	need := v.cfg.Load().PromoteNeed()
	for _, m := range misses {
		// Split each miss into runs of blocks the policy promotes (each
		// block's miss counted once).
		yes := make([]bool, m.n)
		for i := range yes {
			yes[i] = pm == promoteForce || v.pol.PromoteMiss(m.lba+uint64(i), need)
		}
		for i := uint64(0); i < m.n; {
			if !yes[i] {
				i++
				continue
			}
			j := i + 1
			for j < m.n && yes[j] {
				j++
			}
			at := int(m.lba+i-lba) * blockSize
			v.promote(buf[at:at+int(j-i)*blockSize], m.lba+i, muts)
			i = j
		}
	}
	return hit, nil
}

// promote copies blocks just read from the backing device into the cache as
// clean entries, unless one of them was written since the read looked up
// the index (muts: the copy could then be stale; writtenSinceLocked).
// Best effort: it never waits for space.
func (v *Volume) promote(data []byte, lba uint64, muts uint64) {
	s := v.s
	n := len(data) / blockSize
	for done := 0; done < n; {
		r, err := s.alloc(n-done, allocPromote)
		if err != nil {
			v.st.promoteSkipBytes.Add(uint64(n-done) * blockSize)
			v.st.bypass[bypassCongested].Add(uint64(n-done) * blockSize)
			return
		}
		// Our own copy: data is the caller's buffer, which it may reuse
		// after ReadAt returns, but not before we return.
		p := data[done*blockSize : (done+r.n)*blockSize]
		crcs := make([]uint32, r.n)
		for i := range crcs {
			crcs[i] = ondisk.CRC32C(p[i*blockSize : (i+1)*blockSize])
		}
		_, werr := s.dev.WriteAt(p, s.cacheOff(r.loc))
		if werr != nil {
			s.cacheIOError("promotion write", werr)
		} else {
			s.cacheIOOK()
		}
		s.mu.Lock()
		ok := werr == nil && !v.writtenSinceLocked(muts, lba+uint64(done), uint64(r.n))
		if ok {
			v.idx.Tree.AscendRange(index.Ent{LBA: lba + uint64(done)}, index.Ent{LBA: lba + uint64(done+r.n)}, func(index.Ent) bool {
				ok = false
				return false
			})
			ok = ok && v.idx.Tree.TakeFault() == nil // a leaf that cannot be loaded: the set fails over
		}
		if ok {
			for i := 0; i < r.n; i++ {
				s.mu.Insert(v.vi, lba+uint64(done+i), r.loc+uint32(i), crcs[i], false, v.idx.epoch, s.keepSuperseded(v.vi))
			}
			s.appendInsertLocked(v.vi, lba+uint64(done), r.loc, false, crcs, v.idx.epoch)
		}
		s.unpinLocked(r.loc)
		s.mu.Unlock()
		if !ok {
			v.st.promoteSkipBytes.Add(uint64(n-done) * blockSize)
			return
		}
		v.st.promoteBytes.Add(uint64(r.n) * blockSize)
		v.st.promoteOps.Add(1)
		done += r.n
	}
}

// wlogSize is how many recent writes a volume remembers for promotions
// (writtenSinceLocked); a read that overlapped more writes than this
// promotes nothing.
const wlogSize = 256

// wlogEnt is one remembered write: its number (idx.mutations after it) and
// its blocks.
type wlogEnt struct {
	seq uint64
	r   blockRange
}

// noteWriteLocked counts a write of [lba, lba+n) (a write into the cache,
// or the claim of a write to the backing device) and remembers its blocks.
// REQUIRES: s.mu
func (v *Volume) noteWriteLocked(lba, n uint64) {
	v.idx.mutations++
	v.wlog[v.idx.mutations%wlogSize] = wlogEnt{v.idx.mutations, blockRange{lba, n}}
}

// writtenSinceLocked reports whether [lba, lba+n) may have been written
// since idx.mutations was muts: a write counted since overlaps it, or more
// writes came than the log remembers, or one was counted without its
// blocks.
// REQUIRES: s.mu
func (v *Volume) writtenSinceLocked(muts, lba, n uint64) bool {
	if v.idx.mutations-muts > wlogSize {
		return true
	}
	for k := muts + 1; k <= v.idx.mutations; k++ {
		e := v.wlog[k%wlogSize]
		if e.seq != k || e.r.overlaps(lba, n) {
			return true
		}
	}
	return false
}

// REQUIRES: s.mu
func (v *Volume) busyLocked(lba, n uint64) bool {
	for _, r := range v.idx.busy {
		if r.overlaps(lba, n) {
			return true
		}
	}
	return false
}

// claimLocked marks [lba, lba+n) as having a backing write in flight,
// waiting for overlapping claims (writeback or another passthrough write)
// to finish. Client writes claim through claimBacking (marks.go).
// REQUIRES: s.mu
func (v *Volume) claimLocked(lba, n uint64) {
	for v.busyLocked(lba, n) {
		v.s.mu.cond.Wait()
	}
	v.idx.busy = append(v.idx.busy, blockRange{lba, n})
	v.noteWriteLocked(lba, n)
}

// REQUIRES: s.mu
func (v *Volume) releaseLocked(rs []blockRange) {
	for _, r := range rs {
		for i, b := range v.idx.busy {
			if b == r {
				v.idx.busy = append(v.idx.busy[:i], v.idx.busy[i+1:]...)
				break
			}
		}
	}
	v.s.mu.cond.Broadcast()
	v.s.notifyReleasedLocked()
}

// WriteAt writes p at off. With fua the write is durable when WriteAt
// returns; otherwise at the next Flush (invariant 2).
func (v *Volume) WriteAt(p []byte, off int64, fua bool) error {
	_, err := v.WriteAtTier(p, off, fua)
	return err
}

// Tier is the device a write was acknowledged from.
type Tier uint8

const (
	TierCache   Tier = iota // the cache device alone (writeback)
	TierBacking             // the backing device, alone or with the cache (writethrough, around the cache)
)

func (t Tier) String() string { return [...]string{"cache", "backing"}[t] }

// WriteAtTier is WriteAt, and says which device the write went to (the
// latency histograms split writes by it, as reads by hit and miss).
func (v *Volume) WriteAtTier(p []byte, off int64, fua bool) (Tier, error) {
	tier := TierCache
	err := v.modify(off, int64(len(p)), fua, func() (err error) {
		if len(p) > 0 {
			v.st.writeOps.Add(1)
			v.st.writeBytes.Add(uint64(len(p)))
			v.touch()
			tier, err = v.write(p, off, v.seqWrite(off, int64(len(p))))
		}
		return err
	})
	return tier, err
}

// modify runs op, a request that changes [off, off+n) (write, trim,
// write-zeroes), inside the volume's gate, after refusing a range outside
// the volume; with fua it then makes the volume's completed writes durable
// (commitFUA), failing with ErrLostWrites if the cache device failed
// meanwhile with writes only in it.
func (v *Volume) modify(off, n int64, fua bool, op func() error) error {
	if err := v.enter(); err != nil {
		return err
	}
	defer v.exit()
	lost0 := v.lostCount()
	if err := v.checkIO(off, n); err != nil {
		return err
	}
	if err := op(); err != nil {
		return err
	}
	if fua {
		return v.commitFUA(lost0)
	}
	return nil
}

// wholeBlocks returns the blocks [a, b) wholly inside [off, off+n), the
// volume's last block counting as whole as far as the volume goes; a >= b
// when there is none.
func (v *Volume) wholeBlocks(off, n int64) (a, b uint64) {
	a = uint64((off + blockSize - 1) / blockSize)
	if off+n == v.size {
		return a, v.nblocks
	}
	return a, uint64((off + n) / blockSize)
}

func (s *Set) appended() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.seq
}

// write writes p at off; seq says the write belongs to a sequential stream
// longer than the cutoff, which bypasses the cache (invalidating what it
// covers, as in writearound). It returns the tier the write went to.
func (v *Volume) write(p []byte, off int64, seq bool) (Tier, error) {
	first, n := blockSpan(off, int64(len(p)))
	aligned := off%blockSize == 0 && len(p)%blockSize == 0
	if aligned {
		v.rmw.RLock()
		defer v.rmw.RUnlock()
	} else {
		v.rmw.Lock()
		defer v.rmw.Unlock()
	}
	// The engine's own copy: checksums are computed over bytes no client
	// can change any more.
	buf := make([]byte, n*blockSize)
	if !aligned {
		if off%blockSize != 0 {
			if err := v.readBlocks(buf[:blockSize], first, 1, promoteNo); err != nil {
				return TierCache, err
			}
		}
		if end := off + int64(len(p)); end%blockSize != 0 && (n > 1 || off%blockSize == 0) {
			last := first + uint64(n-1)
			if err := v.readBlocks(buf[(n-1)*blockSize:], last, 1, promoteNo); err != nil {
				return TierCache, err
			}
		}
	}
	copy(buf[off-int64(first)<<blockShift:], p)
	return v.routeBlocks(opWrite, buf, first, uint64(n), seq)
}

// routeBlocks carries out route's decision for the whole blocks
// [lba, lba+n): data (opWrite) in buf; zeroes and trims have none.
// It returns the tier the blocks went to (TierBacking when any did).
// REQUIRES: v.rmw (shared or exclusive)
func (v *Volume) routeBlocks(op routeOp, buf []byte, lba, n uint64, seq bool) (Tier, error) {
	in := routeIn{mode: v.Mode(), op: op, seq: seq, failed: v.s.isFailed(), small: n*blockSize <= epochZeroInCache,
		keeps: op != opWrite && v.backingKeepsUnsynced()}
	if in.olderDirtyMatters() {
		in.olderDirty = v.olderEpochsDirty()
	}
	out := route(in)
	if out.degrade != "" {
		v.degrade(out.degrade)
	}
	switch out.dest {
	case toCacheDirty, toCacheClean:
		if buf != nil {
			if out.deferred {
				v.st.epochDeferBytes.Add(uint64(len(buf)))
			}
			return v.writeCache(buf, lba, out.dest == toCacheDirty)
		}
		// Zero blocks, a piece at a time: a write-zeroes may be larger
		// than any buffer the engine should hold.
		tier := TierCache
		for done := uint64(0); done < n; {
			k := min(n-done, zeroPieceBlocks)
			if out.deferred {
				v.st.epochDeferBytes.Add(k * blockSize)
			}
			t, err := v.writeCache(make([]byte, k*blockSize), lba+done, out.dest == toCacheDirty)
			if t == TierBacking {
				tier = TierBacking
			}
			if err != nil {
				return tier, err
			}
			done += k
		}
		return tier, nil
	case toAround:
		switch op {
		case opWrite:
			return TierBacking, v.writeAround(buf, lba, out.why)
		case opZeroes:
			return TierBacking, v.zeroAround(lba, n)
		default:
			return TierBacking, v.discardAround(lba, n)
		}
	}
	return TierCache, nil
}

// writeCache writes whole blocks into the cache, dirty (writeback) or, for
// writethrough, to the backing device too and clean. A write larger than the
// open bucket goes in pieces; NBD does not promise atomic writes. It
// returns TierBacking when any of it went to the backing device.
func (v *Volume) writeCache(buf []byte, lba uint64, writeback bool) (Tier, error) {
	s := v.s
	dirty, tier := writeback, TierCache
	if !writeback {
		tier = TierBacking
	}
	n := len(buf) / blockSize
	if dirty {
		v.throttle()
	}
	for done := 0; done < n; {
		t0 := time.Now()
		if s.isFailed() {
			return TierBacking, v.writeAround(buf[done*blockSize:], lba+uint64(done), bypassFailed)
		}
		r, err := s.allocFor(n - done)
		if errors.Is(err, errNoSpace) && s.keepSuperseded(v.vi) && v.hasDirty() {
			// Epoch order: never around the cache while older epochs are
			// in it; wait for writeback to free space instead.
			r, err = v.allocWaitWriteback(n - done)
		}
		if d := time.Since(t0); d > 100*time.Microsecond {
			v.st.spaceWaitNanos.Add(uint64(d))
		}
		if errors.Is(err, ErrCacheFailed) {
			// Failed over while waiting for space.
			return TierBacking, v.writeAround(buf[done*blockSize:], lba+uint64(done), bypassFailed)
		}
		if errors.Is(err, errNoSpace) {
			// No bucket came free in time: send the rest around the
			// cache rather than stall the client (invalidating any older
			// cached copy, as writearound does).
			return TierBacking, v.writeAround(buf[done*blockSize:], lba+uint64(done), bypassFull)
		}
		if err != nil {
			return TierCache, fmt.Errorf("volume %s: %w", v.name, err)
		}
		// A mirrored set with B out of slots: the piece goes to the
		// backing device too (mirror.go).
		dirty = writeback && s.mirrorHolds(r.loc)
		if !dirty {
			tier = TierBacking
			if writeback {
				s.stats.mirrorThrough.Add(uint64(r.n))
			}
		}
		p := buf[done*blockSize : (done+r.n)*blockSize]
		at := lba + uint64(done)
		crcs := make([]uint32, r.n)
		for i := range crcs {
			crcs[i] = ondisk.CRC32C(p[i*blockSize : (i+1)*blockSize])
		}
		fail := func(err error) error {
			s.mu.Lock()
			s.unpinLocked(r.loc)
			s.mu.Unlock()
			return fmt.Errorf("volume %s: %w", v.name, err)
		}
		if _, err := s.dev.WriteAt(p, s.cacheOff(r.loc)); err != nil {
			// The cache cannot take the data: send it around the cache
			// (invalidating older cached copies), as a full cache does.
			s.mu.Lock()
			s.unpinLocked(r.loc)
			s.mu.Unlock()
			s.cacheIOError("write", err)
			return TierBacking, v.writeAround(buf[done*blockSize:], lba+uint64(done), bypassFailed)
		}
		s.cacheWriteOK()
		var claim []blockRange
		if !dirty {
			v.orderBeforeBacking()
			// Writethrough: the backing write must not interleave with a
			// writeback of an older version of these blocks.
			if err := v.claimBacking(at, uint64(r.n)); err != nil {
				return TierBacking, fail(err)
			}
			claim = []blockRange{{at, uint64(r.n)}}
			if err := v.writeBacking(p, at); err != nil {
				s.mu.Lock()
				v.releaseLocked(claim)
				s.mu.Unlock()
				return TierBacking, fail(err)
			}
		}
		s.mu.Lock()
		v.loadLeavesLocked(at, uint64(r.n))
		// A clean insert over a dirty block: if its record is lost in a
		// failover, the device still holds the dirty version (failover.go).
		// So does a clean insert over a fenced block when the set failed
		// over during this write (after the check at the top of the loop):
		// the fence may stand for a lost clean mark of a writeback, and in
		// memory the block is clean, but the device still holds the
		// durable dirty version that a reopen of the repaired device
		// replays over this write. The insert's record is lost too, so the
		// write counts as lost, as a passthrough write in the same race
		// does.
		dropsDirty := !dirty && (v.dirtyInLocked(at, uint64(r.n)) ||
			s.isFailed() && v.fenceOverlapsLocked(at, uint64(r.n)))
		from := s.mu.seq
		for i := 0; i < r.n; i++ {
			s.mu.Insert(v.vi, at+uint64(i), r.loc+uint32(i), crcs[i], dirty, v.idx.epoch, s.keepSuperseded(v.vi))
		}
		s.appendInsertLocked(v.vi, at, r.loc, dirty, crcs, v.idx.epoch)
		if dirty {
			v.noteDirtyLocked()
		}
		s.noteInvalidateLocked(v, from, at, uint64(r.n), dropsDirty)
		v.noteWriteLocked(at, uint64(r.n))
		v.releaseLocked(claim)
		s.unpinLocked(r.loc)
		s.mu.Unlock()
		done += r.n
	}
	return tier, nil
}

// writeAround writes whole blocks to the backing device and invalidates
// them in the cache (writearound and none modes). The invalidation is
// journaled after the backing write, and commit syncs the backing device
// before writing the journal, so a durable invalidation never exposes older
// backing data than what it replaced.
func (v *Volume) writeAround(buf []byte, lba uint64, why bypassReason) error {
	return v.passthrough(lba, uint64(len(buf)/blockSize), func() error {
		v.st.bypassBytes.Add(uint64(len(buf)))
		v.st.bypass[why].Add(uint64(len(buf)))
		return v.writeBacking(buf, lba)
	})
}

// zeroAround zeroes whole blocks on the backing device (its Zeroer, or
// zero buffers) and drops them from the cache.
func (v *Volume) zeroAround(lba, n uint64) error {
	a, b := int64(lba)<<blockShift, min(int64(lba+n)<<blockShift, v.size)
	z, isZeroer := v.back.(device.Zeroer)
	return v.passthrough(lba, n, func() error {
		v.st.bypassBytes.Add(uint64(b - a))
		v.st.bypass[bypassMode].Add(uint64(b - a))
		if isZeroer {
			if err := z.WriteZeroes(a, b-a); err != nil {
				return fmt.Errorf("zeroing %s at %d: %w", v.name, a, err)
			}
			v.markBackingUnsynced()
			return nil
		}
		zero := make([]byte, min(b-a, 1<<20))
		for at := a; at < b; at += int64(len(zero)) {
			k := min(int64(len(zero)), b-at)
			if _, err := v.back.WriteAt(zero[:k], at); err != nil {
				return fmt.Errorf("zeroing %s at %d: %w", v.name, at, err)
			}
			v.markBackingUnsynced()
		}
		return nil
	})
}

// discardAround discards whole blocks on the backing device and drops them
// from the cache. After failover a range the failed cache may still hold
// newer data for is skipped (a trim is advisory).
func (v *Volume) discardAround(lba, n uint64) error {
	d := v.back.(device.Discarder)
	if v.s.isFailed() {
		v.s.mu.Lock()
		fenced := v.fencedLocked(lba, n)
		v.s.mu.Unlock()
		if fenced {
			return nil
		}
	}
	return v.passthrough(lba, n, func() error {
		start, end := int64(lba)<<blockShift, min(int64(lba+n)<<blockShift, v.size)
		if err := d.Discard(start, end-start); err != nil {
			return fmt.Errorf("discarding %s at %d: %w", v.name, start, err)
		}
		v.markBackingUnsynced()
		return nil
	})
}

// passthrough runs op (a backing write of [lba, lba+n)) under a claim, then
// drops the cached blocks of the range and journals that.
//
// After failover (failover.go) a range with fenced blocks is refused, and
// nothing is journaled: the invalidation is in memory only (a reopen after
// an unclean close drops clean entries anyway).
func (v *Volume) passthrough(lba, n uint64, op func() error) error {
	s := v.s
	v.orderBeforeBacking()
	if err := v.claimBacking(lba, n); err != nil {
		return err
	}
	claim := []blockRange{{lba, n}}
	s.mu.Lock()
	failed := s.isFailed()
	if failed && v.fencedLocked(lba, n) {
		v.releaseLocked(claim)
		s.mu.Unlock()
		return v.fenceErr(lba, n)
	}
	s.mu.Unlock()
	err := op()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		v.loadLeavesLocked(lba, n)
		dropsDirty := v.dirtyInLocked(lba, n)
		had := v.idx.Cached + v.idx.NSup // the volume's entries before the drop
		s.mu.Invalidate(v.vi, lba, n)
		if !failed {
			if s.isFailed() && v.fenceOverlapsLocked(lba, n) {
				// The set failed over during the backing write, and
				// the failover fenced part of the range: a record
				// about it was lost (a writeback's clean mark, say),
				// so the cache device may still hold a durable dirty
				// version that a reopen of the repaired device would
				// replay over this write. It counts as lost, as a
				// lost invalidation of dirty data does.
				dropsDirty = true
			}
			// Journaled even if nothing is cached now (replay may
			// resurrect entries that eviction dropped only in memory),
			// unless no recovery could find any entry of the volume
			// (idx.Replayable): then the record would cancel nothing,
			// and a FLUSH in none mode needs no journal commit, only
			// the backing device's sync. After a failover the record
			// still goes to appendLocked, which fences the range
			// (lostLocked).
			if v.idx.Replayable || s.isFailed() {
				s.appendLocked(&ondisk.Rec{Type: ondisk.RecInvalidate, Vol: uint16(v.vi), LBA: lba, N: n})
				s.noteInvalidateLocked(v, s.mu.seq-1, lba, n, dropsDirty)
			} else if had != 0 {
				invariants.AssertionFailedf("volume %s: invalidation of [%d, +%d) skipped with %d entries in the volume",
					v.name, lba, n, had)
			}
		}
		v.noteWriteLocked(lba, n)
	}
	v.releaseLocked(claim)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.name, err)
	}
	return nil
}

// Flush makes every write completed before the call durable, whichever
// connection sent it. It also advances the volume's flush epoch, recorded in
// every later journal insert.
func (v *Volume) Flush() error {
	if err := v.enter(); err != nil {
		return err
	}
	defer v.exit()
	v.st.flushOps.Add(1)
	s := v.s
	if !s.isFailed() {
		s.mu.Lock()
		v.idx.epoch++
		target := s.mu.seq
		s.mu.Unlock()
		err := s.commit(target)
		if err == nil && s.isFailed() && s.durable.Load() < target {
			// Another commit (the periodic one) failed the set over
			// with records this flush covers not durable, and commit
			// only synced the backing devices: as if this flush's own
			// commit had failed it over.
			err = s.err()
		}
		if err == nil {
			return v.durableErr()
		}
		if !errors.Is(err, ErrCacheFailed) || s.lostAny() {
			// A commit covers every volume; if one lost writes, this
			// one failed to make them durable too.
			return err
		}
		// This commit failed the set over, losing nothing: what the
		// flush covers is on the backing devices; sync them, as below.
	}
	s.mu.Lock()
	lost := v.fo.lost
	s.mu.Unlock()
	if lost > 0 {
		return fmt.Errorf("volume %s: flush: %d bytes written before the cache device failed were only in the cache: %w (%w)",
			v.name, lost*blockSize, ErrLostWrites, s.err())
	}
	if err := s.commit(0); err != nil {
		return err
	}
	return v.durableErr()
}

// Trim discards whole blocks inside [off, off+length): they are dropped from
// the cache and discarded on the backing device (route decides: in epoch
// order or over an object-store image they may instead be written into the
// cache as zero blocks, or left alone). Afterwards they read as zeroes or
// old data. Partial blocks at the edges are left alone. When the backing
// device cannot discard, Trim does nothing (allowed by NBD).
func (v *Volume) Trim(off, length int64, fua bool) error {
	return v.modify(off, length, fua, func() error {
		v.st.trimOps.Add(1)
		a, b := v.wholeBlocks(off, length)
		if _, ok := v.back.(device.Discarder); !ok || a >= b {
			return nil
		}
		v.rmw.RLock()
		defer v.rmw.RUnlock()
		_, err := v.routeBlocks(opTrim, nil, a, b-a, false)
		return err
	})
}

// WriteZeroes zeroes [off, off+length). Whole blocks are zeroed on the
// backing device (its Zeroer, or zero buffers) and dropped from the cache,
// unless route writes them into the cache as zero blocks (small ones in
// epoch order, all of them in writeback mode over an object-store image);
// partial edge blocks go through the normal write path. A fast zero
// (fastOnly) is refused where zeroing would cost what writing does: a
// backing device without a Zeroer, or zero blocks of any size written
// into the cache.
func (v *Volume) WriteZeroes(off, length int64, fua, mayTrim, fastOnly bool) error {
	return v.modify(off, length, fua, func() error {
		if _, isZeroer := v.back.(device.Zeroer); fastOnly && !isZeroer {
			return fmt.Errorf("volume %s: fast zero: %w", v.name, errors.ErrUnsupported)
		}
		if fastOnly && !v.s.isFailed() && (routeIn{mode: v.Mode(), op: opZeroes, keeps: v.backingKeepsUnsynced()}).keepsInCache() {
			return fmt.Errorf("volume %s: fast zero: zeroes go into the cache as data over this backing: %w", v.name, errors.ErrUnsupported)
		}
		v.st.zeroOps.Add(1)
		end := off + length
		a, b := v.wholeBlocks(off, length)
		head, tail := end, end // no whole block: all of it is edge
		if a < b {
			head, tail = int64(a)*blockSize, min(int64(b)*blockSize, end)
		}
		if head > off {
			if _, err := v.write(make([]byte, head-off), off, false); err != nil {
				return err
			}
		}
		if tail < end {
			if _, err := v.write(make([]byte, end-tail), tail, false); err != nil {
				return err
			}
		}
		if a >= b {
			return nil
		}
		v.rmw.RLock()
		defer v.rmw.RUnlock()
		_, err := v.routeBlocks(opZeroes, nil, a, b-a, false)
		return err
	})
}

// Prefetch brings [off, off+length) into the cache (NBD_CMD_CACHE).
func (v *Volume) Prefetch(off, length int64) error {
	if err := v.enter(); err != nil {
		return err
	}
	defer v.exit()
	if err := v.checkIO(off, length); err != nil {
		return err
	}
	if length == 0 || v.Mode() == None || v.s.isFailed() {
		return nil
	}
	first, n := blockSpan(off, length)
	const chunk = 256
	buf := make([]byte, min(chunk, n)*blockSize)
	for done := 0; done < n; done += chunk {
		k := min(chunk, n-done)
		if err := v.readBlocks(buf[:k*blockSize], first+uint64(done), k, promoteForce); err != nil {
			return err
		}
	}
	return nil
}
