package cache

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/tiercache/tiercache/cache/internal/backoff"
	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// Set is an open cache set: one cache device serving several volumes.
//
// Lock order: Set.volMu, then Volume.gate (write side, briefly), then
// Volume.rmw, then Set.commitMu, then Set.sbMu, then Set.mu. No device I/O
// is done while holding Set.mu.
type Set struct {
	// dev is the cache device: the device Open was given, or the mirror
	// (mirp) put in its place by Open or by an attach (mirror.go).
	dev *mirror.Swappable
	// mirp is the mirror when the set is mirrored (FeatureMirror), else
	// nil; it becomes non-nil once, by an attach of a mirror while the set
	// serves (s.mir()).
	mirp atomic.Pointer[mirror.Mirror]
	// attachMu serializes attaches of a mirror; attaching is set while
	// one runs, from the mirror's attach to the end of its resilver
	// (resilver.go).
	attachMu  sync.Mutex
	attaching atomic.Bool
	lay       *Superblock // layout; immutable after Open (modes live in sb)
	// pg is the page store of a paged set (FeaturePagedIndex; nil
	// otherwise), guarded by commitMu (pagedckpt.go).
	pg    *pagedIndex
	nonce uint64
	bpb   int64
	log   *slog.Logger
	// vols is indexed by slot (the index in Superblock.Backings); a free
	// slot holds an empty placeholder volume (Volume.free), never nil.
	// Attach and detach replace the slice (never modify it in place) while
	// holding commitMu and mu: code holding either may read s.vols; code
	// holding neither (the I/O, writeback and eviction walks) reads the same
	// slice through volSnap (s.vol, s.volList). It never gets shorter while
	// the set is open (a trailing slot freed in the superblock stays here
	// as a placeholder), so a slot number read under one hold of mu is
	// still an index under the next.
	vols    []*Volume
	volSnap atomic.Pointer[[]*Volume]
	// volMu serializes attach and the final step of detach (slot changes).
	volMu sync.Mutex

	// commitMu serializes journal writes and checkpoints (group commit:
	// callers queue here and the holder writes everything pending).
	commitMu sync.Mutex
	// syncMu serializes syncBackings: a caller that finds a backing
	// device's unsynced flag clear must know that the sync which cleared
	// it has finished and recorded its failure, if any. After failover,
	// flushes sync the backing devices without commitMu, and one that
	// finds the flag taken by another's sync still in progress must not
	// return success for writes that sync then fails to make durable.
	// Taken under commitMu, never under mu.
	syncMu sync.Mutex
	jr     struct { // REQUIRES: commitMu
		gen  uint64
		pos  ondisk.JournalPos // where the next block goes
		used int64             // blocks written in this generation
		// taken: records taken by the commit in progress (or the last
		// one, if it failed), not yet durable; failover fences them.
		taken []byte
		headN uint64 // journal head records written (journalhead.go)
	}
	// lw: the lost-writes record (failover.go).
	lw lostState
	// noSpace: cache data writes failing with ENOSPC, written around the
	// cache (cacheIOError); its log lines are one per state change.
	noSpace *backoff.Retry
	durable atomic.Uint64         // records durable on the cache device
	failed  atomic.Pointer[error] // set by failover: passthrough mode (failover.go)
	errRun  atomic.Int32          // cache data I/O errors in a row

	wm warmState // region marks (marks.go)

	// sbMu serializes superblock updates.
	sbMu sync.Mutex
	sb   *Superblock // REQUIRES: sbMu

	mu struct {
		sync.Mutex
		cond *sync.Cond // free bucket, claim released, pins dropped
		index.Index
		alloc   []bucketAlloc // by bucket: the allocator's state (alloc.go)
		free    []uint32      // free buckets whose generation bump is durable
		sealed  []uint32      // FIFO of sealed buckets, oldest first
		open    int64         // open bucket or -1
		pending []byte        // encoded records not yet written
		seq     uint64        // records appended so far
		tick    uint64        // recency clock: bumped by reads and allocations
		// dirtyInval: sequence numbers of pending invalidation records
		// whose passthrough write replaced dirty data (failover.go).
		dirtyInval map[uint64]struct{}
		closed     bool
		// wake is closed (and cleared) by wakeLocked; allocFor waits on
		// it with a deadline, which cond cannot do.
		wake chan struct{}
		// released is closed (and cleared) when a writeback batch or a
		// passthrough write releases its claim (waitReleased); short when
		// an allocation finds free buckets short (shortChan). Channels,
		// not cond: their waiters also wait for a stop or a deadline.
		released, short chan struct{}
		// mirTried: s.durable at the last try to map the open bucket on
		// the mirror; mirClean: mapped buckets seen with nothing dirty,
		// and s.mu.seq then (mirror.go).
		mirTried uint64
		mirClean map[int64]uint64
	}

	kickGC     chan struct{}
	kickCommit chan struct{}
	// commitIdle is set while commitLoop waits for something to commit;
	// commitDue wakes it (noteCommitDue).
	commitIdle atomic.Bool
	commitDue  chan struct{}
	stop       chan struct{}
	wg         sync.WaitGroup
	stats      setStats
	knobs      testingKnobs // from OpenOptions; the zero value in production
	draining   atomic.Int32 // Drain calls running: background writeback pauses
}

// testingKnobs are the tests' controls of a set, given to Open in
// OpenOptions.testing. Production code leaves them zero.
type testingKnobs struct {
	// noBackground starts no background goroutine: the crash-point tests
	// drive commit, writeback and eviction themselves, so that the
	// sequence of device operations, and so crash point N, replays.
	noBackground bool
	// fixedJournal turns off the checkpoints invariants builds take at
	// random in commits (tests that look at the journal's records need
	// them to stay in the journal).
	fixedJournal bool
	// noYield turns off writeback's yielding to client reads of the
	// backing device (yieldToReads); the read-latency measurement turns it
	// off to compare.
	noYield bool
	// noThrottle turns off the throttling of foreground writes (throttle);
	// the latency measurement turns it off to tell its sleeps from other
	// waits.
	noThrottle bool
	// fixedDepth keeps writeback's queue depth at writeback.QueueDepth
	// instead of adapting it; the remote-drain measurement compares.
	fixedDepth bool
	// eagerOpen makes a paged set's clean Open read every leaf, as an
	// Open after a crash does, instead of building its trees from stubs
	// (lazyleaves.go): the measurement of a lazy Open compares.
	eagerOpen bool
	// lazyLeafCap, if not 0, replaces lazyLeafCap (the loaded leaves a
	// lazily opened paged set keeps): the tests drop leaves often.
	lazyLeafCap int
}

type setStats struct {
	commits, journalBlocks, checkpoints, evictions, writebackBlocks, gcMoves atomic.Uint64
	cacheErrors                                                              atomic.Uint64
	cacheNoSpace                                                             atomic.Uint64
	mirrorThrough                                                            atomic.Uint64 // blocks (mirror.go)
}

// newSet builds the Set of the superblock sb read from dev: no volume, an
// empty index, nothing started.
func newSet(dev device.Device, sb *Superblock, log *slog.Logger) *Set {
	s := &Set{dev: mirror.NewSwappable(dev), lay: sb.Clone(), sb: sb, nonce: sb.Nonce(), bpb: sb.BlocksPerBucket(), log: log,
		kickGC: make(chan struct{}, 1), kickCommit: make(chan struct{}, 1),
		commitDue: make(chan struct{}, 1), stop: make(chan struct{})}
	s.mu.cond = sync.NewCond(&s.mu.Mutex)
	s.mu.BPB = s.bpb
	s.initWarm(sb)
	return s
}

// spawn runs f in a background goroutine of the set (Close waits for it)
// and reports whether it did: a set opened with testingKnobs.noBackground
// runs none, its tests driving commit, writeback and eviction themselves.
// This is the one place that knob is read.
func (s *Set) spawn(f func()) bool {
	if s.knobs.noBackground {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
	return true
}

// newVolume builds the in-memory volume of slot vi. For a free slot
// (bi.Free()) it builds the empty placeholder that code indexing s.vols by
// slot finds there: no device, no blocks (so no journal record or
// checkpoint entry can name it), closed to I/O.
func (s *Set) newVolume(vi int, bi BackingInfo, dev device.Device) *Volume {
	v := &Volume{s: s, vi: vi, name: bi.Name, size: bi.Size, nblocks: uint64((bi.Size + blockSize - 1) / blockSize),
		back: dev, free: bi.Free(), gone: bi.Free()}
	cfg := bi.Settings
	if cfg.WritebackOrder == 0 {
		cfg = DefaultSettings()
		cfg.Mode = bi.Settings.Mode
	}
	v.cfg.Store(&cfg)
	if bi.InconsistentSince != 0 {
		v.ord.degraded.Store(true)
		v.ord.since.Store(bi.InconsistentSince)
	}
	s.initWriteback(v)
	// Replayable: until a checkpoint shows otherwise, a recovery may find
	// entries of the slot (Open replays them; a checkpoint clears it if
	// empty).
	v.idx.Vol = index.NewVol(bi.Name, v.nblocks)
	v.idx.wbInflight = map[uint32]struct{}{}
	return v
}

// setVols publishes a new slot list.
// REQUIRES: s.commitMu and s.mu, or exclusive access (Open)
func (s *Set) setVols(vols []*Volume) {
	s.vols = vols
	s.mu.Vols = make([]*index.Vol, len(vols))
	for i, v := range vols {
		s.mu.Vols[i] = &v.idx.Vol
	}
	s.volSnap.Store(&vols)
}

// vol returns the volume in slot vi, for callers holding neither mu nor
// commitMu. A slot detached meanwhile yields its empty placeholder.
func (s *Set) vol(vi int) *Volume {
	l := *s.volSnap.Load()
	if vi >= len(l) {
		return s.newVolume(vi, BackingInfo{}, nil)
	}
	return l[vi]
}

// volList returns the current slot list (free slots included), for
// callers holding neither mu nor commitMu.
func (s *Set) volList() []*Volume { return *s.volSnap.Load() }

func (s *Set) err() error {
	if p := s.failed.Load(); p != nil {
		return *p
	}
	return nil
}

// Volume returns the volume of the named backing device.
func (s *Set) Volume(name string) (*Volume, bool) {
	for _, v := range s.volList() {
		if !v.free && v.name == name {
			return v, true
		}
	}
	return nil, false
}

// Volumes returns the volumes in superblock (slot) order, free slots left
// out.
func (s *Set) Volumes() []*Volume {
	var out []*Volume
	for _, v := range s.volList() {
		if !v.free {
			out = append(out, v)
		}
	}
	return out
}

// Superblock returns a copy of the current superblock.
func (s *Set) Superblock() *Superblock {
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	return s.sb.Clone()
}

// Close shuts the set down cleanly: it stops the background goroutines,
// commits, writes a final checkpoint and sets the clean flag. Dirty data
// stays in the cache (use Drain first to detach). Close does not close the
// devices, which belong to the caller.
func (s *Set) Close() error {
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	s.mu.closed = true
	s.wakeLocked()
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
	if s.isFailed() {
		s.recordLostAtClose()
		// Leave the cache device as it is: not marked clean, so a reopen
		// (after the device is repaired) drops the clean entries, which
		// passthrough writes may have made stale, and recovers the dirty
		// ones, which fencing kept current.
		if err := s.syncBackings(); err != nil {
			return fmt.Errorf("close: %w", err)
		}
		return fmt.Errorf("close: cache set not closed cleanly: %w", s.err())
	}
	s.commitMu.Lock()
	err := s.checkpointLocked(0)
	s.commitMu.Unlock()
	if err != nil {
		return fmt.Errorf("close: %w", err)
	}
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	if err := s.updateSuperblockLocked(func(nsb *Superblock) error { nsb.Clean = true; return nil }); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	return nil
}

// updateSuperblockLocked applies change to the set's superblock through
// updateSuperblock: the copy becomes the set's superblock only once it is
// durable.
// REQUIRES: s.sbMu
func (s *Set) updateSuperblockLocked(change func(nsb *Superblock) error) error {
	nsb, err := updateSuperblock(s.dev, s.sb, change)
	if err != nil {
		return err
	}
	s.sb = nsb
	return nil
}

// updateSuperblock applies change to a copy of sb and writes the copy, with
// the next sequence number, over the older of the two copies on dev, and
// returns it. sb is not changed: after a failed write (or a refused change)
// it is still what the newest copy on disk holds.
func updateSuperblock(dev device.Device, sb *Superblock, change func(nsb *Superblock) error) (*Superblock, error) {
	nsb := sb.Clone()
	if err := change(nsb); err != nil {
		return nil, err
	}
	nsb.Seq = sb.Seq + 1
	if err := nsb.Validate(-1); err != nil {
		return nil, err
	}
	if err := ondisk.WriteSuperblock(dev, nsb); err != nil {
		return nil, err
	}
	return nsb, nil
}

// SetStats are whole-set counters.
type SetStats struct {
	Buckets, FreeBuckets, SealedBuckets int64
	// EmptyBuckets are sealed buckets no live block points into (their
	// data was overwritten or dropped): GC frees them first, without
	// writing anything back, when free buckets run short. A detach frees
	// those its volume left at once.
	EmptyBuckets                        int64
	CachedBlocks, DirtyBlocks           int64
	Commits, JournalBlocks, Checkpoints uint64
	// Evictions counts buckets freed: by GC, and the empty ones a detach
	// frees.
	Evictions, WritebackBlocks uint64
	// GCMoves counts live dirty blocks copied out of mostly-empty buckets
	// (instead of being written back) so the buckets could be reused.
	GCMoves uint64
	// CacheErrors counts failed cache device I/Os (data and metadata).
	CacheErrors uint64
	// CacheNoSpaceErrors counts cache data writes that failed with ENOSPC
	// (the cache file's file system is full) and went around the cache.
	CacheNoSpaceErrors uint64
	// Failed is set when the cache device failed and every volume is
	// served from its backing device (passthrough; failover.go); Cause
	// says why. UnreachableDirtyBlocks is then the dirty data (all
	// volumes) left on the failed device.
	Failed                 bool
	Cause                  string `json:",omitempty"`
	UnreachableDirtyBlocks int64
	// Mirror is the state of a mirrored set's two cache devices (nil for
	// a set on one).
	Mirror *MirrorStats `json:",omitempty"`
}

// Stats returns whole-set counters.
func (s *Set) Stats() SetStats {
	s.mu.Lock()
	st := SetStats{Buckets: int64(len(s.mu.Buckets)), FreeBuckets: int64(len(s.mu.free)), SealedBuckets: int64(len(s.mu.sealed))}
	for _, bi := range s.mu.sealed {
		if s.mu.Buckets[bi].Live == 0 {
			st.EmptyBuckets++
		}
	}
	for _, v := range s.vols {
		st.CachedBlocks += v.idx.Cached
		st.DirtyBlocks += v.idx.Dirty
	}
	s.mu.Unlock()
	st.Commits = s.stats.commits.Load()
	st.JournalBlocks = s.stats.journalBlocks.Load()
	st.Checkpoints = s.stats.checkpoints.Load()
	st.Evictions = s.stats.evictions.Load()
	st.WritebackBlocks = s.stats.writebackBlocks.Load()
	st.GCMoves = s.stats.gcMoves.Load()
	st.CacheErrors = s.stats.cacheErrors.Load()
	st.CacheNoSpaceErrors = s.stats.cacheNoSpace.Load()
	if err := s.err(); err != nil {
		st.Failed, st.Cause, st.UnreachableDirtyBlocks = true, err.Error(), st.DirtyBlocks
	}
	st.Mirror = s.mirrorStats()
	return st
}

var errNoSpace = errors.New("cache: no free bucket")
