package cache

import (
	"cmp"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// BackingSpec names a backing device supplied to Format or Open.
type BackingSpec struct {
	Name string
	Dev  device.Device
	// ID is a stable identity supplied by the caller (e.g. a UUID kept in
	// an xattr or a partition label). It may be empty; when both the
	// superblock and the spec have one, Open requires them to match.
	ID string
	// Path is recorded in the superblock at Format as a hint for finding
	// the device again; it is not checked.
	Path string
}

// FormatOptions configure Format.
type FormatOptions struct {
	BucketSize int64 // default 1 MiB; a multiple of 4 KiB, at least 8 KiB
	Mode       Mode  // initial mode of every volume (zero value: Writeback)
	Force      bool  // overwrite an existing cache set
	Progress   func(done, total int64)
	// JournalSize is the journal region size; 0 picks cache size/64
	// clamped to [256 KiB, 64 MiB]. (Added beyond the API: tests
	// use a tiny journal to force checkpoints.)
	JournalSize int64
}

// OpenOptions configure Open.
type OpenOptions struct {
	// Force accepts a backing device whose ID differs from the one recorded
	// at Format (e.g. after the ID was regenerated). A size mismatch is
	// always refused: the index would address blocks beyond the device.
	Force  bool
	Logger *slog.Logger
	// noBackground (tests only) starts no background goroutine: the
	// crash-point tests drive commit, writeback and eviction themselves, so
	// that the sequence of device operations, and so crash point N, replays.
	noBackground bool
}

const (
	defaultBucketSize = 1 << 20
	minBuckets        = ondisk.MinBuckets
	minJournalLen     = ondisk.MinJournalLen
	commitInterval    = time.Second // bound on unflushed work lost in a crash
	pendingKick       = 256 << 10   // journal bytes that wake the committer
)

// Format writes a new, empty cache set onto cacheDev. It writes only the
// cache device: backing devices keep their bytes (they are only measured).
// minDeviceSize is the smallest cache device Format lays out minBuckets
// buckets of bs on (journal length jl, 0 for the default): the bucket count
// Format starts its search from, and the layout of that many, must both
// fit.
func minDeviceSize(bs, jl, bpb int64) int64 {
	size := int64(0)
	for range 3 { // the default journal grows with the device
		j := jl
		if j == 0 {
			j = min(max(size/64, 256<<10), 64<<20)
		}
		head := 2*ondisk.SBCopySize + j
		per := bs + 2*(4+bpb*(ondisk.CkptEntrySize+ondisk.CkptEpochExtra))
		search := head + 2*ondisk.CkptLenEpoch(0, bpb, ondisk.MaxBackings) + bs + minBuckets*per
		align := min(bs, 1<<20)
		layout := (head+2*ondisk.CkptLenEpoch(minBuckets, bpb, ondisk.MaxBackings)+align-1)/align*align + minBuckets*bs
		size = (max(search, layout) + 4095) / 4096 * 4096
	}
	return size
}

func Format(cacheDev device.Device, backings []BackingSpec, opts FormatOptions) (*Superblock, error) {
	// No backing device is fine: they can be attached later (Set.Attach).
	if len(backings) > ondisk.MaxBackings {
		return nil, fmt.Errorf("%w: %d backing devices (want at most %d)", ErrInvalid, len(backings), ondisk.MaxBackings)
	}
	if !opts.Mode.Valid() {
		return nil, fmt.Errorf("%w: mode %v", ErrInvalid, opts.Mode)
	}
	if !opts.Force {
		sb, err := ReadSuperblock(cacheDev)
		if err == nil {
			return nil, fmt.Errorf("%w (set %x, %d backing devices); use force to overwrite", ErrAlreadyFormatted, sb.SetUUID, sb.LiveBackings())
		}
		if !errors.Is(err, ErrNotFormatted) && !IsCorruption(err) {
			// The device could not be read: it may hold a set.
			return nil, fmt.Errorf("format: checking for an existing cache set: %w", err)
		}
	}
	progress := func(done int64) {
		if opts.Progress != nil {
			opts.Progress(done, 3)
		}
	}
	progress(0)
	bs := opts.BucketSize
	if bs == 0 {
		bs = defaultBucketSize
	}
	if bs < 2*blockSize || bs%blockSize != 0 || bs > 1<<30 {
		return nil, fmt.Errorf("%w: bucket size %d (want a multiple of 4096 between 8 KiB and 1 GiB)", ErrInvalid, bs)
	}
	devSize := cacheDev.Size()
	jl := opts.JournalSize
	if jl == 0 {
		jl = min(max(devSize/64, 256<<10), 64<<20)
	}
	jl = jl / blockSize * blockSize
	if jl < minJournalLen {
		return nil, fmt.Errorf("%w: journal size %d (at least %d)", ErrInvalid, jl, minJournalLen)
	}
	sb := &Superblock{Version: ondisk.FormatVersion, Seq: 1, BlockSize: blockSize, BucketSize: bs,
		JournalOff: 2 * ondisk.SBCopySize, JournalLen: jl}
	if _, err := rand.Read(sb.SetUUID[:]); err != nil {
		return nil, err
	}
	for _, b := range backings {
		if b.Dev == nil || b.Name == "" {
			return nil, fmt.Errorf("%w: backing %q without name or device", ErrInvalid, b.Name)
		}
		st := DefaultSettings()
		st.Mode = opts.Mode
		sb.Backings = append(sb.Backings, BackingInfo{Name: b.Name, ID: b.ID, Size: b.Dev.Size(), Mode: opts.Mode, Path: b.Path, Settings: st})
	}
	// Solve for the bucket count: each bucket costs its size plus its share
	// of two checkpoint slots.
	bpb := bs / blockSize
	// Checkpoint slots have room for maxBackings volumes (a few KiB), so
	// that attach never needs a larger slot.
	fixed := sb.JournalOff + jl + 2*ondisk.CkptLenEpoch(0, bpb, ondisk.MaxBackings) + bs
	per := bs + 2*(4+bpb*(ondisk.CkptEntrySize+ondisk.CkptEpochExtra))
	n := (devSize - fixed) / per
	for ; n >= minBuckets; n-- {
		sb.NBuckets = n
		sb.CkptOff[0] = sb.JournalOff + jl
		sb.CkptLen = ondisk.CkptLenEpoch(n, bpb, ondisk.MaxBackings)
		sb.CkptOff[1] = sb.CkptOff[0] + sb.CkptLen
		align := min(bs, 1<<20)
		sb.BucketsOff = (sb.CkptOff[1] + sb.CkptLen + align - 1) / align * align
		if sb.BucketsOff+n*bs <= devSize {
			break
		}
	}
	if n > ondisk.MaxCacheBlocks/bpb {
		n = ondisk.MaxCacheBlocks / bpb
		sb.NBuckets = n
	}
	if n < minBuckets {
		return nil, fmt.Errorf("%w: cache device of %d bytes holds fewer than %d buckets of %d bytes: it needs at least %d bytes (%.1f MiB) with this bucket size; a smaller bucket size needs less",
			ErrInvalid, devSize, minBuckets, bs, minDeviceSize(bs, opts.JournalSize, bpb), float64(minDeviceSize(bs, opts.JournalSize, bpb))/(1<<20))
	}
	if err := sb.Validate(devSize); err != nil {
		return nil, fmt.Errorf("format: computed layout invalid: %w", err)
	}
	// Empty checkpoint of generation 1, then the superblock copies.
	trees := make([]*index.Ptree, len(backings))
	for i := range trees {
		trees[i] = index.NewPtree()
	}
	// Destroy the superblock of any earlier set on the device first, and
	// make that durable: the steps below overwrite its checkpoint slots, and
	// a crash among them must not leave its superblock valid (it would open
	// from an older checkpoint, or none, and serve stale data). A crash from
	// here on leaves a device with no set, which Format accepts again.
	zero := make([]byte, blockSize)
	for _, off := range []int64{0, ondisk.SBCopySize} {
		if _, err := cacheDev.WriteAt(zero, off); err != nil {
			return nil, fmt.Errorf("format: erasing superblock copy at %d: %w", off, err)
		}
	}
	if err := cacheDev.Sync(); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	// Invalidate the other slot so a stale checkpoint of an earlier set on
	// this device is never considered (the nonce would reject it too).
	if _, err := cacheDev.WriteAt(zero, sb.CkptOff[0]); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	h := ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: 1}
	if err := ondisk.WriteCheckpoint(cacheDev, sb, h, make([]uint32, n), make([]uint64, len(backings)), trees, nil); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(1)
	if err := ondisk.WriteSuperblock(cacheDev, sb); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(2)
	sb.Seq++
	if err := ondisk.WriteSuperblock(cacheDev, sb); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(3)
	return sb.Clone(), nil
}

// Set is an open cache set: one cache device serving several volumes.
//
// Lock order: Set.volMu, then Volume.gate (write side, briefly), then
// Volume.rmw, then Set.commitMu, then Set.sbMu, then Set.mu. No device I/O
// is done while holding Set.mu.
type Set struct {
	dev   device.Device
	lay   *Superblock // layout; immutable after Open (modes live in sb)
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
	// found the flag taken by another's sync still in progress returned
	// success for writes that sync then failed to make durable
	// (TestFlushWaitsForConcurrentBackingSync). Taken under commitMu,
	// never under mu.
	syncMu sync.Mutex
	jr     struct { // REQUIRES: commitMu
		gen  uint64
		pos  ondisk.JournalPos // where the next block goes
		used int64             // blocks written in this generation
		// taken: records taken by the commit in progress (or the last
		// one, if it failed), not yet durable; failover fences them.
		taken []byte
	}
	// fixedJournal turns off the checkpoints invariants builds take at
	// random in commits (tests that look at the journal's records need
	// them to stay in the journal).
	fixedJournal atomic.Bool
	durable      atomic.Uint64         // records durable on the cache device
	failed       atomic.Pointer[error] // set by failover: passthrough mode (failover.go)
	errRun       atomic.Int32          // cache data I/O errors in a row

	// sbMu serializes superblock updates.
	sbMu sync.Mutex
	sb   *Superblock // REQUIRES: sbMu

	mu struct {
		sync.Mutex
		cond *sync.Cond // free bucket, claim released, pins dropped
		index.Index
		free    []uint32 // free buckets whose generation bump is durable
		sealed  []uint32 // FIFO of sealed buckets, oldest first
		open    int64    // open bucket or -1
		pending []byte   // encoded records not yet written
		seq     uint64   // records appended so far
		tick    uint64   // recency clock: bumped by reads and allocations
		// dirtyInval: sequence numbers of pending invalidation records
		// whose passthrough write replaced dirty data (failover.go).
		dirtyInval map[uint64]struct{}
		closed     bool
	}

	kickGC     chan struct{}
	kickCommit chan struct{}
	stop       chan struct{}
	wg         sync.WaitGroup
	stats      setStats
	// noBackground: OpenOptions.noBackground (tests); no goroutine runs.
	noBackground bool
	draining     atomic.Int32 // Drain calls running: background writeback pauses
	// epochOK: the checkpoint slots can hold superseded versions and
	// per-entry epochs (sets formatted before epoch order have smaller
	// slots; there writeback_order=epoch acts as lba).
	epochOK bool
}

type setStats struct {
	commits, journalBlocks, checkpoints, evictions, writebackBlocks, gcMoves atomic.Uint64
	cacheErrors                                                              atomic.Uint64
}

// Open recovers a cache set: newest valid checkpoint plus journal replay.
// Then it writes a fresh checkpoint (so leftovers of a torn journal tail can
// never be replayed later), clears the clean flag and starts the background
// writeback/eviction and commit goroutines.
func Open(cacheDev device.Device, backings []BackingSpec, opts OpenOptions) (*Set, error) {
	sb, _, err := ondisk.ReadSuperblock(cacheDev)
	if err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	byName := map[string]BackingSpec{}
	for _, b := range backings {
		byName[b.Name] = b
	}
	s := &Set{dev: cacheDev, lay: sb.Clone(), sb: sb, nonce: sb.Nonce(), bpb: sb.BlocksPerBucket(), log: log,
		kickGC: make(chan struct{}, 1), kickCommit: make(chan struct{}, 1), stop: make(chan struct{})}
	s.mu.cond = sync.NewCond(&s.mu.Mutex)
	s.mu.BPB = s.bpb
	volBlocks := make([]uint64, len(sb.Backings))
	var vols []*Volume
	for i, bi := range sb.Backings {
		if bi.Free() {
			vols = append(vols, s.newVolume(i, bi, nil))
			continue
		}
		spec, ok := byName[bi.Name]
		if !ok || spec.Dev == nil {
			return nil, &BackingMismatchError{Name: bi.Name, Field: "missing"}
		}
		delete(byName, bi.Name)
		if got := spec.Dev.Size(); got != bi.Size {
			return nil, &BackingMismatchError{Name: bi.Name, Field: "size", Expected: fmt.Sprint(bi.Size), Actual: fmt.Sprint(got)}
		}
		if bi.ID != "" && spec.ID != "" && bi.ID != spec.ID && !opts.Force {
			return nil, &BackingMismatchError{Name: bi.Name, Field: "id", Expected: bi.ID, Actual: spec.ID}
		}
		v := s.newVolume(i, bi, spec.Dev)
		volBlocks[i] = v.nblocks
		vols = append(vols, v)
	}
	for name := range byName {
		return nil, &BackingMismatchError{Name: name, Field: "unknown"}
	}
	s.setVols(vols)
	start := time.Now()
	hdr, body, err := ondisk.ReadCheckpointBody(cacheDev, sb)
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	s.epochOK = sb.CkptLen >= ondisk.CkptLenEpoch(sb.NBuckets, s.bpb, len(sb.Backings))
	// The checkpoint body is verified and decoded on another core while
	// the journal is read, decoded and collected (replay.go). The device
	// sees the same reads in the same order as before.
	type decoded struct {
		cd  *ondisk.CkptData
		err error
	}
	dch := make(chan decoded, 1)
	go func() {
		cd, err := ondisk.DecodeCheckpoint(sb, hdr, body, volBlocks)
		dch <- decoded{cd, err}
	}()
	c := newCollector(s, sb.NBuckets)
	jr := readJournal(cacheDev, sb, hdr, c)
	d := <-dch
	if d.err != nil {
		return nil, fmt.Errorf("open: %w", d.err)
	}
	loaded := time.Now()
	dropped, fast, err := s.recoverIndex(sb.NBuckets, d.cd, c, jr, sb.Clean)
	if err != nil {
		return nil, fmt.Errorf("open: replaying journal: %w", err)
	}
	end, nrec := jr.end, jr.n
	s.listBucketsLocked()
	if err := s.checkIndexLocked(invariants.Enabled); err != nil {
		return nil, fmt.Errorf("open: recovered index inconsistent: %w", err)
	}
	// The reverse map served the replay; serving does without it.
	s.mu.Owner = nil
	// New generation: the next journal block follows the replayed end, so
	// any torn leftovers of the old generation are foreign from now on.
	s.jr.gen, s.jr.pos = hdr.Gen, ondisk.JournalPos{Blk: end.Blk}
	replayed := time.Now()
	s.commitMu.Lock()
	err = s.checkpointLocked()
	s.commitMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	log.Info("cache set recovered", "checkpoint_gen", hdr.Gen, "journal_records", nrec, "bulk_replay", fast,
		"entries", s.entries(), "dropped_clean", dropped, "took", time.Since(start),
		"read_checkpoint_and_journal", loaded.Sub(start), "replay_journal", replayed.Sub(loaded), "write_checkpoint", time.Since(replayed))
	s.sbMu.Lock()
	s.sb.Clean = false
	s.sb.Seq++
	err = ondisk.WriteSuperblock(cacheDev, s.sb)
	s.sbMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	for _, v := range s.vols {
		if v.cfg.Load().WritebackOrder == "epoch" && !s.epochOK {
			log.Warn("writeback_order=epoch needs checkpoint slots sized by a newer Format; writing back in lba order", "volume", v.name)
		}
	}
	if opts.noBackground {
		s.noBackground = true
		for _, v := range s.vols {
			close(v.wb.done) // no writeback goroutine to wait for (detach)
		}
		return s, nil
	}
	s.wg.Add(2)
	go s.gcLoop()
	go s.commitLoop()
	for _, v := range s.vols {
		if !v.free {
			s.wg.Add(1)
			go s.writebackLoop(v)
		}
	}
	return s, nil
}

// listBucketsLocked puts the recovered buckets on the sealed FIFO (those
// holding entries) or the free list.
// REQUIRES: exclusive access (Open)
func (s *Set) listBucketsLocked() {
	for i := range s.mu.Buckets {
		if s.mu.Buckets[i].Live > 0 {
			s.mu.Buckets[i].State = index.BucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(i))
		} else {
			s.mu.free = append(s.mu.free, uint32(i))
		}
	}
}

// newVolume builds the in-memory volume of slot vi. For a free slot
// (bi.Free()) it builds the empty placeholder that code indexing s.vols by
// slot finds there: no device, no blocks (so no journal record or
// checkpoint entry can name it), closed to I/O.
func (s *Set) newVolume(vi int, bi BackingInfo, dev device.Device) *Volume {
	v := &Volume{s: s, vi: vi, name: bi.Name, size: bi.Size, nblocks: uint64((bi.Size + blockSize - 1) / blockSize),
		back: dev, free: bi.Free(), gone: bi.Free()}
	v.mode.Store(int32(bi.Mode))
	cfg := bi.Settings
	if cfg.WritebackOrder == "" {
		cfg = DefaultSettings()
		cfg.Mode = bi.Mode
	}
	v.cfg.Store(&cfg)
	v.wb.kick = make(chan struct{}, 1)
	v.wb.stop = make(chan struct{})
	v.wb.done = make(chan struct{})
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

// loadCheckpointLocked builds volume vi's index from its checkpoint part:
// the entries (in strictly increasing LBA order, as decodeCkptBody checked)
// are bulk-loaded into nearly full leaves, each leaf's summary (its dirty
// entries' oldest epoch) computed on the way; the bucket counts, epochs
// and the recovery-time reverse map follow. Inserting one by one instead
// cost 1.9 s for 1M entries (random B-tree inserts).
// REQUIRES: s.mu (or exclusive access during Open)
func (s *Set) loadCheckpointLocked(vi int, cv *ondisk.CkptVol) {
	v := s.vols[vi]
	v.idx.epoch = cv.Epoch
	aggs := make([]uint64, (len(cv.Ents)+index.LeafBulkFill-1)/index.LeafBulkFill)
	for i := range aggs {
		aggs[i] = math.MaxUint64
	}
	for i, e := range cv.Ents {
		loc := e.Block()
		if s.mu.Owner != nil {
			s.mu.Owner[loc] = index.OwnerKey(vi, e.LBA)
		}
		b := &s.mu.Buckets[int64(loc)/s.bpb]
		b.Live++
		v.idx.Cached++
		if e.Dirty() {
			var ep uint64 // a checkpoint without the epoch section: 0
			if cv.EpochOf != nil {
				ep = cv.EpochOf[loc]
			}
			b.Dirty++
			v.idx.Dirty++
			s.mu.SetBlockEpoch(loc, ep)
			aggs[i/index.LeafBulkFill] = min(aggs[i/index.LeafBulkFill], ep)
		}
	}
	v.idx.Tree = index.BuildPtree(cv.Ents, aggs)
	v.idx.Sup = index.NewStree()
	for _, x := range cv.Sup {
		s.mu.InsertSup(vi, x)
	}
}

// replayBatch bounds the insert records sortedApplier sorts at a time.
const replayBatch = 1 << 16

// sortedApplier returns apply, which applies journal records in order but
// runs of insert records (up to replayBatch) sorted by (volume, LBA),
// stably, and flush, which applies the last run. Within a run this order
// is equivalent to the journal's: inserts of different blocks commute (no
// record in the run changes a bucket generation or drops entries), and
// inserts of one LBA keep their order (records are split per block, since
// multi-block records may overlap); an insert into a block owned earlier
// in the run is corruption in either order.
func (s *Set) sortedApplier() (apply func(*ondisk.Rec) error, flush func() error) {
	// One item per block: records of several blocks can overlap (a later
	// write over part of an earlier one), and only per-block items sort
	// into a per-LBA order. seq (the item's place in the journal) makes
	// the sort stable.
	type item struct {
		// ownerKey(vol, lba): sorts by (volume, LBA) in one compare. It
		// is exact for every record applyLocked accepts (LBA < 2^40,
		// volume a slot); a record it rejects fails Open whatever order
		// the batch was applied in.
		key uint64
		seq uint32
		r   *ondisk.Rec
		i   uint32 // block within r
		all bool   // apply r whole
	}
	var batch []item
	flush = func() error {
		slices.SortFunc(batch, func(a, b item) int {
			if c := cmp.Compare(a.key, b.key); c != 0 {
				return c
			}
			return cmp.Compare(a.seq, b.seq)
		})
		// one is reused for the per-block records: a copy per item
		// escaped to the heap (one allocation per replayed block).
		var one ondisk.Rec
		for _, it := range batch {
			r := it.r
			if !it.all && len(r.CRCs) > 1 {
				one = *r
				one.LBA, one.Loc, one.CRCs = r.LBA+uint64(it.i), r.Loc+it.i, r.CRCs[it.i:it.i+1]
				r = &one
			}
			if err := s.applyLocked(r); err != nil {
				return fmt.Errorf("%v (in a run of inserts sorted by LBA): %w", r, err)
			}
		}
		batch = batch[:0]
		return nil
	}
	apply = func(r *ondisk.Rec) error {
		if r.Type == ondisk.RecInsert {
			// A record that leaves its bucket is kept whole for applyLocked
			// to reject.
			n := uint32(len(r.CRCs))
			if n == 0 || int64(r.Loc)/s.bpb != (int64(r.Loc)+int64(n)-1)/s.bpb {
				batch = append(batch, item{key: index.OwnerKey(int(r.Vol), r.LBA), seq: uint32(len(batch)), r: r, all: true})
				n = 0
			}
			for i := range n {
				batch = append(batch, item{key: index.OwnerKey(int(r.Vol), r.LBA+uint64(i)), seq: uint32(len(batch)), r: r, i: i})
			}
			if len(batch) < replayBatch {
				return nil
			}
			return flush()
		}
		if err := flush(); err != nil {
			return err
		}
		return s.applyLocked(r)
	}
	return apply, flush
}

// dropCleanLocked drops every clean entry. Open does this after a crash: a
// passthrough write (writearound, none, write-zeroes) may have reached the
// backing device while the journal record invalidating the cached copy was
// lost, and a clean entry would then serve stale data until evicted and flip
// to the backing data afterwards. Dirty entries are kept: they are newer than
// anything on the backing device. The cost is a cold clean cache after a
// crash; an intent record before each passthrough write would keep it warm.
// REQUIRES: s.mu (or exclusive access during Open)
func (s *Set) dropCleanLocked() int {
	n := 0
	for vi, v := range s.vols {
		var drop []index.Ent
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			if !e.Dirty() {
				drop = append(drop, e)
			}
			return true
		})
		for _, e := range drop {
			v.idx.Tree.Delete(e)
			s.mu.Unaccount(vi, e)
		}
		n += len(drop)
	}
	return n
}

func (s *Set) entries() (n int64) {
	for _, v := range s.vols {
		n += v.idx.Cached
	}
	return n
}

// applyLocked replays one journal record. Records come from a checksummed
// block, but their contents are still validated before use.
// REQUIRES: s.mu (or exclusive access during Open)
func (s *Set) applyLocked(r *ondisk.Rec) error {
	total := uint64(s.mu.CacheBlocks())
	vol := func() (*Volume, error) {
		if int(r.Vol) >= len(s.vols) {
			return nil, ondisk.Corruptf("journal record", 0, 0, "volume %d of %d", r.Vol, len(s.vols))
		}
		return s.vols[r.Vol], nil
	}
	switch r.Type {
	case ondisk.RecInsert:
		v, err := vol()
		if err != nil {
			return err
		}
		n := uint64(len(r.CRCs))
		loc := uint64(r.Loc)
		if r.LBA+n > v.nblocks || r.LBA+n < r.LBA || loc+n > total || loc/uint64(s.bpb) != (loc+n-1)/uint64(s.bpb) {
			return ondisk.Corruptf("journal record", 0, 0, "insert out of range: %v", r)
		}
		b := &s.mu.Buckets[loc/uint64(s.bpb)]
		if b.Gen != r.Gen {
			return ondisk.Corruptf("journal record", 0, 0, "insert into bucket %d generation %d, bucket is at %d", loc/uint64(s.bpb), r.Gen, b.Gen)
		}
		for i := uint64(0); i < n; i++ {
			if k := s.mu.Owner[loc+i]; k != 0 {
				// The block is being reused within its generation only if
				// the journal is wrong.
				return ondisk.Corruptf("journal record", 0, 0, "insert into owned cache block %d", loc+i)
			}
			s.mu.Insert(int(r.Vol), r.LBA+i, uint32(loc+i), r.CRCs[i], r.Dirty, r.Epoch, s.keepSuperseded(int(r.Vol)))
		}
		v.idx.epoch = max(v.idx.epoch, r.Epoch)
	case ondisk.RecClean:
		if _, err := vol(); err != nil {
			return err
		}
		if uint64(r.Loc) >= total {
			return ondisk.Corruptf("journal record", 0, 0, "clean out of range: %v", r)
		}
		s.mu.MarkClean(int(r.Vol), r.LBA, r.Loc)
	case ondisk.RecInvalidate:
		if _, err := vol(); err != nil {
			return err
		}
		s.mu.Invalidate(int(r.Vol), r.LBA, min(r.N, 1<<48))
	case ondisk.RecReuse:
		if int64(r.Bucket) >= int64(len(s.mu.Buckets)) {
			return ondisk.Corruptf("journal record", 0, 0, "reuse of bucket %d", r.Bucket)
		}
		if d := s.mu.DropBucket(int64(r.Bucket), false); d > 0 {
			s.log.Error("journal reuses a bucket holding dirty data; dropped", "bucket", r.Bucket, "dirty_blocks", d)
		}
		s.mu.Buckets[r.Bucket].Gen = r.Gen
	default:
		return ondisk.Corruptf("journal record", 0, 0, "type %d", r.Type)
	}
	return nil
}

// appendLocked queues a journal record; it becomes durable at the next
// commit (Flush, FUA, a full buffer, or the periodic commit).
// REQUIRES: s.mu
func (s *Set) appendLocked(r *ondisk.Rec) {
	if s.isFailed() {
		// Nothing reaches the journal any more.
		s.lostLocked(r, false)
		s.mu.seq++
		return
	}
	s.mu.pending = ondisk.AppendRec(s.mu.pending, r)
	s.mu.seq++
	if len(s.mu.pending) >= pendingKick {
		select {
		case s.kickCommit <- struct{}{}:
		default:
		}
	}
}

// appendInsertLocked journals a run, split into records of maxInsertRun,
// with the volume's current flush epoch.
// REQUIRES: s.mu
func (s *Set) appendInsertLocked(vi int, lba uint64, loc uint32, dirty bool, crcs []uint32) {
	s.appendInsertEpochLocked(vi, lba, loc, dirty, crcs, s.vols[vi].idx.epoch)
}

// appendInsertEpochLocked journals a run written in the given epoch.
// REQUIRES: s.mu
func (s *Set) appendInsertEpochLocked(vi int, lba uint64, loc uint32, dirty bool, crcs []uint32, epoch uint64) {
	gen := s.mu.Buckets[int64(loc)/s.bpb].Gen
	for len(crcs) > 0 {
		k := min(len(crcs), ondisk.MaxInsertRun)
		s.appendLocked(&ondisk.Rec{Type: ondisk.RecInsert, Vol: uint16(vi), LBA: lba, Loc: loc, Gen: gen, Dirty: dirty,
			Epoch: epoch, CRCs: crcs[:k]})
		lba += uint64(k)
		loc += uint32(k)
		crcs = crcs[k:]
	}
	v := s.vols[vi]
	v.idx.Replayable = true
	v.idx.insertSeq = s.mu.seq
}

func (s *Set) err() error {
	if p := s.failed.Load(); p != nil {
		return *p
	}
	return nil
}

// commit makes durable every record appended up to target and every backing
// write completed so far (invariant 2). Concurrent callers share one journal
// write and one device sync: whoever holds commitMu writes everything
// pending, and the callers queued behind it usually find their records
// already durable.
func (s *Set) commit(target uint64) error {
	if s.isFailed() {
		// Passthrough: what is durable is what the backing devices hold.
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.backingsSynced() {
		return nil
	}
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if s.isFailed() {
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.backingsSynced() {
		return nil
	}
	return s.commitLocked(false)
}

// backingsSynced reports whether every backing write completed before the
// call is durable, as far as commit is concerned (a failed sync is left to
// durableErr). A clear flag may have been taken by a syncBackings whose
// sync is still running: waiting for syncMu waits for it. Without the wait
// a flush that found no record to commit (a passthrough write whose
// invalidation was skipped, idx.Replayable) returned while another
// commit's backing sync covering its write was in flight, and a crash then
// lost the write (TestFlushWaitsForInFlightBackingSync; found by
// TestCrashPointsConcurrent seed 17 in none mode).
// REQUIRES: not s.mu
func (s *Set) backingsSynced() bool {
	if s.backingsUnsynced() {
		return false
	}
	s.syncMu.Lock()
	//lint:ignore SA2001 taking the lock is the wait for a sync in flight
	s.syncMu.Unlock()
	return !s.backingsUnsynced()
}

func (s *Set) backingsUnsynced() bool {
	for _, v := range s.volList() {
		if v.backingUnsynced.Load() {
			return true
		}
	}
	return false
}

// commitLocked is the flush protocol:
//
//  1. take the pending records (under mu);
//  2. sync every backing device written since its last sync, so that a
//     record that depends on backing data (a clean insert, an invalidation)
//     is never durable before that data;
//  3. sync the cache device, making the data of every taken record durable;
//  4. write the records as journal blocks (or a checkpoint when the journal
//     is full), and sync again.
//
// REQUIRES: s.commitMu
func (s *Set) commitLocked(forceCkpt bool) error {
	if s.isFailed() {
		return s.syncBackings()
	}
	s.mu.Lock()
	stream := s.mu.pending
	s.mu.pending = nil
	s.jr.taken = append(s.jr.taken, stream...)
	upto := s.mu.seq
	blocks := ondisk.PackRecords(stream)
	jblocks := s.lay.JournalLen / blockSize
	// In invariants builds, checkpoint at random to exercise generation
	// switches and slot alternation far more often than a full journal does.
	if forceCkpt || int64(len(blocks)) > jblocks-s.jr.used || (invariants.Sometimes(3) && !s.fixedJournal.Load()) {
		s.mu.Unlock()
		// A checkpoint covers the taken records (it snapshots the index,
		// which already reflects them).
		return s.checkpointLockedUnlocked(upto)
	}
	s.mu.Unlock()
	if err := s.syncBackingsForCommit(); err != nil {
		return err
	}
	if len(blocks) == 0 {
		s.setDurable(upto)
		return nil
	}
	if err := s.dev.Sync(); err != nil {
		return s.failLocked(fmt.Errorf("syncing cache device: %w", err))
	}
	mb := int(ondisk.MaxBatchBlocks(jblocks))
	for len(blocks) > 0 {
		k := min(len(blocks), mb)
		batch := blocks[:k]
		blocks = blocks[k:]
		batchStart := s.jr.pos.Seq
		buf := make([]byte, 0, k*blockSize)
		for i, p := range batch {
			buf = append(buf, ondisk.EncodeJournalBlock(ondisk.BlockHeader{Nonce: s.nonce, Gen: s.jr.gen, Seq: batchStart + uint64(i), BatchStart: batchStart}, p)...)
		}
		// The region is circular: at most two writes.
		first := min(int64(k), jblocks-s.jr.pos.Blk)
		off := s.lay.JournalOff + s.jr.pos.Blk*blockSize
		if _, err := s.dev.WriteAt(buf[:first*blockSize], off); err != nil {
			return s.failLocked(fmt.Errorf("writing journal at %d: %w", off, err))
		}
		if first < int64(k) {
			if _, err := s.dev.WriteAt(buf[first*blockSize:], s.lay.JournalOff); err != nil {
				return s.failLocked(fmt.Errorf("writing journal at %d: %w", s.lay.JournalOff, err))
			}
		}
		if err := s.dev.Sync(); err != nil {
			return s.failLocked(fmt.Errorf("syncing journal: %w", err))
		}
		s.jr.pos = ondisk.JournalPos{Blk: (s.jr.pos.Blk + int64(k)) % jblocks, Seq: s.jr.pos.Seq + uint64(k)}
		s.jr.used += int64(k)
		s.stats.journalBlocks.Add(uint64(k))
	}
	s.stats.commits.Add(1)
	s.setDurable(upto)
	return nil
}

func (s *Set) setDurable(upto uint64) {
	s.jr.taken = nil
	s.mu.Lock()
	for q := range s.mu.dirtyInval {
		if q <= upto {
			delete(s.mu.dirtyInval, q)
		}
	}
	s.mu.Unlock()
	if upto > s.durable.Load() {
		s.durable.Store(upto)
	}
}

// checkpointLocked writes a checkpoint of the current state, covering every
// record appended so far.
// REQUIRES: s.commitMu
func (s *Set) checkpointLocked() error {
	s.mu.Lock()
	s.jr.taken = append(s.jr.taken, s.mu.pending...)
	s.mu.pending = nil
	upto := s.mu.seq
	s.mu.Unlock()
	return s.checkpointLockedUnlocked(upto)
}

// checkpointLockedUnlocked snapshots the index (B-tree clones are
// copy-on-write, so this is cheap under mu), makes every dependency
// durable, writes the checkpoint into the other slot and starts a new
// journal generation at the current journal position.
// REQUIRES: s.commitMu, not s.mu; the records up to upto were taken.
func (s *Set) checkpointLockedUnlocked(taken uint64) error {
	s.mu.Lock()
	// Records appended between taking them and now are also reflected in
	// the snapshot; taking them again keeps them out of the new journal.
	s.jr.taken = append(s.jr.taken, s.mu.pending...)
	s.mu.pending = nil
	upto := max(taken, s.mu.seq)
	gens := make([]uint32, len(s.mu.Buckets))
	for i := range s.mu.Buckets {
		gens[i] = s.mu.Buckets[i].Gen
	}
	trees := make([]*index.Ptree, len(s.vols))
	epochs := make([]uint64, len(s.vols))
	var vers []ondisk.VerSnap
	if s.epochOK {
		vers = make([]ondisk.VerSnap, len(s.vols))
	}
	var epochOf func(loc uint32) uint64
	if vers != nil {
		epochOf = s.mu.SnapshotEpochs()
	}
	// The volumes this checkpoint holds no entry of: once it is durable,
	// a recovery starts from it and finds none of theirs unless an insert
	// is appended after this snapshot (idx.Replayable).
	vols := s.vols
	empty := make([]bool, len(vols))
	for i, v := range s.vols {
		empty[i] = v.idx.Tree.Len() == 0 && v.idx.NSup == 0
		trees[i] = v.idx.Tree.Clone()
		epochs[i] = v.idx.epoch
		if vers != nil {
			// The trees and the epoch tables are copy-on-write.
			vers[i] = ondisk.VerSnap{EpochOf: epochOf, Sup: v.idx.Sup.Clone(), Dirty: int(v.idx.Dirty)}
		}
	}
	s.mu.Unlock()
	if err := s.syncBackingsForCommit(); err != nil {
		return err
	}
	if err := s.dev.Sync(); err != nil {
		return s.failLocked(fmt.Errorf("syncing cache device: %w", err))
	}
	h := ondisk.CkptHeader{Nonce: s.nonce, Gen: s.jr.gen + 1, JPos: ondisk.JournalPos{Blk: s.jr.pos.Blk}}
	if err := ondisk.WriteCheckpoint(s.dev, s.lay, h, gens, epochs, trees, vers); err != nil {
		return s.failLocked(err)
	}
	s.jr.gen, s.jr.pos, s.jr.used = h.Gen, h.JPos, 0
	s.stats.checkpoints.Add(1)
	s.setDurable(upto)
	s.mu.Lock()
	for i, v := range vols {
		// The slot list changes only under commitMu (held), but compare
		// anyway: the flag belongs to the volume the snapshot saw.
		if empty[i] && i < len(s.vols) && s.vols[i] == v && v.idx.insertSeq <= upto {
			v.idx.Replayable = false
		}
	}
	s.mu.Unlock()
	return nil
}

// commitLoop commits periodically and when enough records are pending, so
// that unflushed work lost in a crash is bounded even without FLUSH.
func (s *Set) commitLoop() {
	defer s.wg.Done()
	t := time.NewTicker(commitInterval)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		case <-s.kickCommit:
		}
		s.mu.Lock()
		target := s.mu.seq
		s.mu.Unlock()
		_ = s.commit(target) // a failure is sticky and reported to clients
	}
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
	s.mu.cond.Broadcast()
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
	if s.isFailed() {
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
	err := s.checkpointLocked()
	s.commitMu.Unlock()
	if err != nil {
		return fmt.Errorf("close: %w", err)
	}
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	s.sb.Clean = true
	s.sb.Seq++
	if err := ondisk.WriteSuperblock(s.dev, s.sb); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	return nil
}

// Flush makes every write completed so far, on every volume, durable (one
// group commit for the whole set).
func (s *Set) Flush() error {
	if err := s.commit(s.appended()); err != nil {
		return err
	}
	var errs []error
	for _, v := range s.volList() {
		errs = append(errs, v.durableErr())
	}
	return errors.Join(errs...)
}

// crashStop stops the background goroutines without writing anything, as if
// the process died. Tests use it after cloning the devices for a crash.
func (s *Set) crashStop() {
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return
	}
	s.mu.closed = true
	s.mu.cond.Broadcast()
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
}

// SetStats are whole-set counters.
type SetStats struct {
	Buckets, FreeBuckets, SealedBuckets int64
	CachedBlocks, DirtyBlocks           int64
	Commits, JournalBlocks, Checkpoints uint64
	Evictions, WritebackBlocks          uint64
	// GCMoves counts live dirty blocks copied out of mostly-empty buckets
	// (instead of being written back) so the buckets could be reused.
	GCMoves uint64
	// CacheErrors counts failed cache device I/Os (data and metadata).
	CacheErrors uint64
	// Failed is set when the cache device failed and every volume is
	// served from its backing device (passthrough; failover.go); Cause
	// says why. UnreachableDirtyBlocks is then the dirty data (all
	// volumes) left on the failed device.
	Failed                 bool
	Cause                  string `json:",omitempty"`
	UnreachableDirtyBlocks int64
}

// Stats returns whole-set counters.
func (s *Set) Stats() SetStats {
	s.mu.Lock()
	st := SetStats{Buckets: int64(len(s.mu.Buckets)), FreeBuckets: int64(len(s.mu.free)), SealedBuckets: int64(len(s.mu.sealed))}
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
	if err := s.err(); err != nil {
		st.Failed, st.Cause, st.UnreachableDirtyBlocks = true, err.Error(), st.DirtyBlocks
	}
	return st
}

var errNoSpace = errors.New("cache: no free bucket")
