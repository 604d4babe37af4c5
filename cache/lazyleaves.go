package cache

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/internal/invariants"
)

// Lazy leaves (docs/CACHE.md, "Index pages on the cache device"). A
// paged set opened after a clean shutdown, with no journal record since
// its root, reads the root, its inner pages, the bucket table and the
// trees of superseded versions (normally few), and not the leaves of the
// volumes' trees: each volume's index tree is built from stubs naming the
// root's leaves (index.BuildLazyPtree), and a leaf is read from the cache
// device (one 4 KiB read, verified against its parent as a page always
// is) the first time an operation touches it. A loaded leaf stays
// (lazyLeafCap); a leaf an operation changes becomes the tree's own and
// stays resident.
//
// What Open took from the root instead of the leaves: the buckets' live
// and dirty counts (the bucket table, pages.FlagCounts), each volume's dirty
// count (the root's payload, pages.FlagVolDirty) and entry count (the root).
// A dirty block's flush epoch is in its leaf slot: it enters the bucket's
// epoch table when the leaf is loaded the first time (lazyLeaves.first),
// which happens under Set.mu (every operation that can load a leaf it has
// not loaded before runs under it; Diff, outside it, only loads leaves
// that a change under it loaded first, or that were dropped since).
//
// A stub names a page of the root Open found, which stays intact while
// the page trees name it and for two roots after they release it
// (pages.Alloc). A checkpoint whose page trees release a page a stub of
// its snapshot names pins that stub's leaf (index.PinStubs: loaded for
// good) before the root is durable, so no stub outlives its page.
//
// Not lazy: an Open after a crash or with journal records since the root
// (the replay needs every entry), of a mirrored set, or with ColdClean:
// those read every leaf (pages.SetRoot.ReadCheckpoint).
//
// A leaf that cannot be read or fails its checks (an *index.FaultError)
// fails the set over, as a failed commit does: its stub stays bad (every
// operation that needs it finds the same error, without reading it
// again, and changes nothing in it), onLeafFault records it and kicks the
// commit loop, and the next commit, whoever runs it, fails the set over
// before writing anything (leafFaulted). failLocked fences each bad
// leaf's LBAs: its blocks may be dirty, and the volume's dirty count,
// from the root, counts them among the unreachable ones. Until then the
// operations that would act on a partial answer check TakeFault: a read
// fails the set over itself and is served as after failover (a bad leaf
// is unreachable data, EIO), a promotion is not made, eviction stops, a
// write over a bad leaf is neither in the index nor durable (its record
// is lost in the failover and counted lost). After failover a walk that
// meets a bad leaf (readFailed, fencedLocked) treats its range as dirty.
//
// Client reads, writes into the cache and passthrough writes, and the
// index walks of eviction, GC and scrub (entriesIn), read the leaves they
// need without Set.mu (loadLeavesLocked) and load them under it from
// memory; a read served asynchronously (StartReadAt) looks only at
// resident leaves and leaves the rest to ReadAt.
//
// Writeback's epoch-order scans do the same for the leaves their epoch
// bound admits (loadLeavesAtMostLocked) and for the oldest epoch
// (oldestEpochLocked).
//
// Known limits: writeback's lba-order lookups, Check and a failover's
// walks read the leaves they need under Set.mu; eviction, GC and Check walk the whole
// index and so load every leaf (once: see lazyLeafCap).

// lazyLeafCap bounds the loaded stub leaves a volume's tree keeps: 0, no
// bound below its leaves. The trees can drop loaded leaves (index:
// CLOCK, a dropped one read again when touched; the tests run with a cap
// of 2), but eviction and GC still walk the whole index for each batch of
// victims: with fewer leaves kept than the tree has, every batch would
// read every leaf again. Until they find their victims without the walk
// (docs/CACHE.md, "Recovery bounded by the journal", step 5) a loaded
// leaf stays, and the memory a lazy Open saves lasts until the first such
// walk.
const lazyLeafCap = 0

// lazyLeaves is a lazy set's state of its stubs' loads.
type lazyLeaves struct {
	mu sync.Mutex
	// first: the pages (of the root Open found) whose leaf was loaded
	// once: their dirty blocks' epochs are in the bucket tables.
	first index.Bitset
	// reads counts the leaves read (tests: Open reads none).
	reads atomic.Uint64
	// pre holds leaves read and verified without Set.mu for a load under
	// it (loadLeavesLocked), or the read's error, by the pointer they
	// were read for (guarded by mu): a page's contents at a pointer,
	// which carries the page's generation and checksum, never change
	// while a stub that is not loaded names it, so the loader takes the
	// page or the error instead of reading the device.
	pre map[pages.Ptr]preRead
	// faulted is the first leaf that could not be loaded (onLeafFault),
	// nil while none: the set fails over at the next commit.
	faulted atomic.Pointer[error]
	// bad lists the leaves that could not be loaded and failLocked has
	// not fenced yet (guarded by mu).
	bad []badLeaf
}

// preRead is a leaf's page read without Set.mu, or the read's error.
type preRead struct {
	pg  *pages.Page
	err error
}

// badLeaf is the range of LBAs [lo, hi) of volume slot vi whose leaf could
// not be loaded.
type badLeaf struct {
	vi     int
	lo, hi uint64
}

// onLeafFault returns volume slot vi's tree's OnFault: it records the bad
// leaf for failLocked and, for the first, logs it and kicks the commit
// loop, whose commit fails the set over. It runs inside the operation
// that found the leaf bad, under Set.mu or not: it takes only lz.mu.
func (s *Set) onLeafFault(vi int) func(*index.FaultError) {
	lz := s.pg.lazy
	name := s.vols[vi].name
	return func(fe *index.FaultError) {
		lz.mu.Lock()
		lz.bad = append(lz.bad, badLeaf{vi, fe.Lo, fe.Hi})
		lz.mu.Unlock()
		err := fmt.Errorf("volume %s: index leaf of blocks [%d,%d): %w", name, fe.Lo, fe.Hi, fe)
		if !lz.faulted.CompareAndSwap(nil, &err) {
			return
		}
		s.log.Error("an index leaf cannot be read from the cache device: failing over", "volume", name,
			"first_block", fe.Lo, "end_block", fe.Hi, "err", fe.Err)
		select {
		case s.kickCommit <- struct{}{}:
		default:
		}
	}
}

// leafFaulted returns the error of the first index leaf that could not be
// loaded, or nil: a set with one fails over at its next commit.
func (s *Set) leafFaulted() error {
	if s.pg == nil || s.pg.lazy == nil {
		return nil
	}
	if p := s.pg.lazy.faulted.Load(); p != nil {
		return *p
	}
	return nil
}

// fenceBadLeavesLocked fences the LBAs of every leaf that could not be
// loaded since the last call (failLocked).
// REQUIRES: s.mu
func (s *Set) fenceBadLeavesLocked() {
	if s.pg == nil || s.pg.lazy == nil {
		return
	}
	lz := s.pg.lazy
	lz.mu.Lock()
	bad := lz.bad
	lz.bad = nil
	lz.mu.Unlock()
	for _, b := range bad {
		s.vols[b.vi].addFenceLocked(b.lo, b.hi-b.lo)
	}
}

func stubRef(p pages.Ptr) index.StubRef {
	return index.StubRef{A: uint64(p.Page) | uint64(p.CRC)<<32, B: p.Gen}
}

func stubPtr(r index.StubRef) pages.Ptr {
	return pages.Ptr{Page: uint32(r.A), CRC: uint32(r.A >> 32), Gen: r.B}
}

// maxUnlockedLeaves bounds the leaves one operation reads without
// Set.mu (loadLeavesLocked: the stubs among the first maxUnlockedLeaves
// leaves of its range); an operation over more loads the rest under it.
const maxUnlockedLeaves = 64

// loadLeavesLocked makes resident the leaves of v's tree that an
// operation on [lba, lba+n) would load, reading them from the cache
// device without s.mu: it finds their stubs, releases s.mu, reads and
// verifies their pages, takes s.mu again and loads them (lazyLoader:
// the slots' checks and, on a leaf's first load, its epochs into the
// bucket tables, under s.mu as always), so other requests do not wait
// behind the reads. A page it cannot read or verify is the load's
// error, as if the load had read it: the set fails over, as after any
// load that fails (the error is not dropped for a second read, which
// might hide it). It does nothing for a set that is not lazy or
// whose leaves are all loaded. Because it may release s.mu, its caller
// calls it right after taking s.mu, before reading anything s.mu guards.
// A leaf the tree drops again before the operation reaches it (a bounded
// leaf cache) is read under s.mu. The volume need not be entered: a
// detached volume's tree stays (its stubs' pages, if reused since, fail
// their verification and are left to a load that never comes).
// REQUIRES: s.mu
func (v *Volume) loadLeavesLocked(lba, n uint64) {
	v.loadLeavesAtMostLocked(lba, lba+n, math.MaxUint64)
}

// loadLeavesAtMostLocked is loadLeavesLocked for [from, to) and the
// leaves whose epoch bound is at most bound, those an AscendAggAtMost
// with that bound visits (writeback's scans).
// REQUIRES: s.mu
func (v *Volume) loadLeavesAtMostLocked(from, to, bound uint64) {
	s := v.s
	if s.pg == nil || s.pg.lazy == nil || v.idx.Tree.Unloaded() == 0 {
		return
	}
	f, t := index.Ent{LBA: from}, index.Ent{LBA: min(to, index.MaxLBA)}
	refs := v.idx.Tree.StubsIn(f, t, bound, maxUnlockedLeaves)
	if len(refs) == 0 {
		return
	}
	v.readLeavesUnlocked(f, t, bound, refs)
}

// readLeavesUnlocked releases s.mu, reads and verifies the pages of refs
// (stubs of v's tree among the leaves of [from, to) with an epoch bound
// at most bound) into the lazy
// state's pre, takes s.mu again and loads the stubs of the range it read
// (their loads take the pages), dropping what no load took.
// REQUIRES: s.mu, the set lazy
func (v *Volume) readLeavesUnlocked(from, to index.Ent, bound uint64, refs []index.StubRef) {
	s := v.s
	lz, st, id := s.pg.lazy, s.pg.st, uint16(v.vi)
	s.mu.Unlock()
	read := make(map[index.StubRef]bool, len(refs))
	for _, r := range refs {
		ptr := stubPtr(r)
		lz.reads.Add(1)
		pg, err := st.ReadLeaf(ptr, id)
		lz.mu.Lock()
		if lz.pre == nil {
			lz.pre = map[pages.Ptr]preRead{}
		}
		_, dup := lz.pre[ptr]
		if !dup {
			lz.pre[ptr] = preRead{pg, err}
			read[r] = true
		}
		lz.mu.Unlock()
		if dup && err != nil {
			// Another operation's read of the page is there for the
			// load: this error would reach no one.
			v.undeliveredLeafError(err)
		}
	}
	s.mu.Lock()
	v.idx.Tree.LoadStubsIn(from, to, bound, maxUnlockedLeaves, func(r index.StubRef) bool { return read[r] })
	// What no load took (a stub loaded meanwhile, or no longer in the
	// range: its page may have been reused since, and its read failed) is
	// dropped.
	var lost []error
	lz.mu.Lock()
	for r := range read {
		if x, ok := lz.pre[stubPtr(r)]; ok && x.err != nil {
			lost = append(lost, x.err)
		}
		delete(lz.pre, stubPtr(r))
	}
	lz.mu.Unlock()
	for _, err := range lost {
		v.undeliveredLeafError(err)
	}
}

// undeliveredLeafError logs and counts a failed read of a leaf's page
// that no load returned (the leaf was loaded, or found bad, by another
// operation meanwhile): every cache device error is returned or logged.
func (v *Volume) undeliveredLeafError(err error) {
	v.s.stats.cacheErrors.Add(1)
	v.s.log.Warn("cache device I/O error", "op", "index leaf read (the leaf was loaded meanwhile)", "volume", v.name, "err", err)
}

// maxOldestTries bounds the leaves oldestEpochLocked reads without
// s.mu for one answer (each try loads one; a bounded leaf cache may drop
// one before the next try reaches it).
const maxOldestTries = 8

// oldestEpochLocked is s.mu.OldestEpoch(v.vi), the oldest flush epoch of
// the volume's dirty versions, with the leaves it needs read without
// s.mu (readLeavesUnlocked) when the set is lazy. Because it may release
// s.mu, its caller calls it right after taking s.mu.
// REQUIRES: s.mu, the volume entered
func (v *Volume) oldestEpochLocked() (uint64, bool) {
	s := v.s
	for range maxOldestTries {
		if s.pg == nil || s.pg.lazy == nil || v.idx.Tree.Unloaded() == 0 {
			break
		}
		e, ok, need := s.mu.OldestEpochResident(v.vi)
		if need == nil {
			return e, ok
		}
		v.readLeavesUnlocked(need.At, need.At, math.MaxUint64, []index.StubRef{need.Ref})
	}
	return s.mu.OldestEpoch(v.vi)
}

// lazyEligible reports whether Open may build the volumes' trees from
// stubs: a clean shutdown's root with nothing journaled since, its
// volumes' dirty counts in its payload, no mirror.
func lazyEligible(pr *pages.SetRoot, nrec int, policy cleanPolicy, mirrored bool, knobs testingKnobs) bool {
	return !knobs.eagerOpen && pr != nil && nrec == 0 && policy == cleanKeep && !mirrored && pr.Dirty != nil && pr.Flags&pages.FlagCounts != 0
}

// lazyLoader returns the loader of volume slot vi's stubs: it reads and
// verifies the leaf, checks each slot as pages.SetRoot.ReadCheckpoint
// does (cache block in range, no bucket generation, an epoch exactly on a
// dirty block and at most the volume's epoch at the root, volEpoch; an
// LBA of the volume), and on the leaf's first load puts its dirty blocks'
// epochs into the bucket tables.
// REQUIRES (of the loads): s.mu for a leaf's first load
func (s *Set) lazyLoader(vi int, nblocks, volEpoch uint64) index.Loader {
	p := s.pg
	lz := p.lazy
	id := uint16(vi)
	total := uint32(int64(len(s.mu.Buckets)) * s.bpb)
	return func(ref index.StubRef, dst []index.Ent) ([]index.Ent, error) {
		ptr := stubPtr(ref)
		lz.mu.Lock()
		pre, ok := lz.pre[ptr]
		delete(lz.pre, ptr)
		first := !lz.first.Get(int(ptr.Page))
		lz.mu.Unlock()
		pg, err := pre.pg, pre.err
		if !ok {
			lz.reads.Add(1)
			pg, err = p.st.ReadLeaf(ptr, id)
		}
		if err != nil {
			return nil, err
		}
		n := len(dst)
		for j := range pg.Count() {
			sl := pg.Slot(j)
			b := sl.Loc &^ index.DirtyBit
			dirty := sl.Loc&index.DirtyBit != 0
			if b >= total || sl.BGen != 0 || sl.LBA >= nblocks || (!dirty && sl.Epoch != 0) || sl.Epoch > volEpoch {
				return nil, ondisk.Corruptf("index page", -1, pages.PageSize, "tree %#x page %d: slot %+v names cache block %d of %d, lba %d of %d, a bucket generation, or an epoch for a clean block or beyond the volume's %d",
					id, ptr.Page, sl, b, total, sl.LBA, nblocks, volEpoch)
			}
			dst = append(dst, index.Ent{LBA: sl.LBA, Loc: sl.Loc, CRC: sl.CRC})
		}
		if first {
			for j, e := range dst[n:] {
				if e.Dirty() {
					s.mu.SetBlockEpoch(e.Block(), pg.Slot(j).Epoch)
				}
			}
			lz.mu.Lock()
			lz.first.Set(int(ptr.Page))
			lz.mu.Unlock()
		}
		return dst, nil
	}
}

// openLazyLocked builds the index of a lazy Open from the root pr and
// cd, its superseded versions (pages.SetRoot.ReadCheckpoint with supOnly): the
// buckets' generations and counts from the bucket table, each volume's
// tree of stubs, its counts and epoch, the superseded versions and their
// epochs. It checks what it can without the leaves: the counts agree with
// each other, the superseded versions' ranges and order (and, in
// invariants builds, each against the live entry of its LBA).
// REQUIRES: exclusive access (Open)
func (s *Set) openLazyLocked(pr *pages.SetRoot, cd *ondisk.CkptData) error {
	bad := func(format string, args ...any) error {
		return ondisk.Corruptf("index root", s.lay.CkptOff[0], 2*pages.PageSize, format, args...)
	}
	nb := int64(len(cd.Gens))
	s.mu.Buckets = make([]index.Bucket, nb)
	s.mu.alloc = make([]bucketAlloc, nb)
	s.mu.Owner = nil
	s.mu.open = -1
	var live, dirty int64
	for i := range s.mu.Buckets {
		r := pr.Table.Get(i)
		s.mu.Buckets[i] = index.Bucket{Gen: r.Gen, Live: uint32(r.Live), Dirty: uint32(r.Dirty)}
		live += int64(r.Live)
		dirty += int64(r.Dirty)
	}
	s.pg.lazy = &lazyLeaves{first: index.NewBitset(int(pr.Store.Alloc().Pages()))}
	has := map[uint16]bool{}
	for _, id := range pr.Store.TreeIDs() {
		has[id] = true
	}
	leafCap := lazyLeafCap
	if s.knobs.lazyLeafCap != 0 {
		leafCap = s.knobs.lazyLeafCap
	}
	capOf := func(leaves int) int {
		if leafCap == 0 {
			return leaves
		}
		return leafCap
	}
	vers := make([][]index.Ver, len(s.vols))
	var nlive, ndirty int64
	for vi, v := range s.vols {
		v.idx.Tree, v.idx.Sup = index.NewPtree(), index.NewStree()
		v.idx.NSup, v.idx.Dirty, v.idx.Cached, v.idx.epoch = 0, 0, 0, 0
		if vi >= len(cd.Vols) {
			continue
		}
		cv := &cd.Vols[vi]
		v.idx.epoch = cv.Epoch
		for _, x := range cv.Sup {
			v.idx.Sup.ReplaceOrInsertAgg(index.Ent{LBA: x.LBA, Loc: x.Loc, CRC: x.CRC}, x.Epoch)
		}
		v.idx.NSup = int64(len(cv.Sup))
		vers[vi] = cv.Sup
		nlive += v.idx.NSup
		ndirty += v.idx.NSup
		if !has[uint16(vi)] {
			if pr.Dirty[vi] != 0 {
				return bad("volume slot %d: no tree but %d dirty entries", vi, pr.Dirty[vi])
			}
			continue
		}
		t := pr.Store.Tree(uint16(vi))
		refs, err := t.LeafRefs()
		if err != nil {
			return err
		}
		stubs := make([]index.LeafStub, len(refs))
		for i, r := range refs {
			stubs[i] = index.LeafStub{Key: index.Ent{LBA: r.Key.LBA}, Agg: r.Agg, Ref: stubRef(r.Ptr)}
		}
		if d := pr.Dirty[vi]; d < 0 || d > int64(t.Len()) || (t.Len() > 0 && v.nblocks == 0) {
			return bad("volume slot %d (%d blocks): %d entries, %d dirty", vi, v.nblocks, t.Len(), d)
		}
		v.idx.Tree = index.BuildLazyPtree(stubs, t.Len(), s.lazyLoader(vi, v.nblocks, cv.Epoch), capOf(len(stubs)), s.onLeafFault(vi))
		v.idx.Cached = int64(t.Len())
		v.idx.Dirty = pr.Dirty[vi]
		nlive += v.idx.Cached
		ndirty += v.idx.Dirty
	}
	if nlive != live || ndirty != dirty {
		return bad("the bucket table counts %d live and %d dirty blocks, the trees and the root %d and %d", live, dirty, nlive, ndirty)
	}
	s.mu.BuildEpochTables(vers)
	// Invariant 13, as the pages package checks it: each superseded version
	// in range, of a block named once, in order; in invariants builds
	// also older than the dirty live entry of its LBA.
	total := uint64(nb * s.bpb)
	seen := map[uint32]bool{}
	for vi := range vers {
		v := s.vols[vi]
		for i, x := range vers[vi] {
			if x.LBA >= v.nblocks || uint64(x.Loc) >= total || seen[x.Loc] || x.Epoch > v.idx.epoch || (i > 0 && !index.VerLess(vers[vi][i-1], x)) {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v out of range, order, or owned twice", vi, x)
			}
			seen[x.Loc] = true
			if !invariants.Enabled {
				// Against its live entry only in invariants builds:
				// the leaves of the versions' LBAs, one read each,
				// are most of the tree when there are many (`check`
				// verifies them all).
				continue
			}
			if err := v.idx.Tree.Fault(index.Ent{LBA: x.LBA}); err != nil {
				return err
			}
			e, ok := v.idx.Tree.Get(index.Ent{LBA: x.LBA})
			if !ok || !e.Dirty() || seen[e.Block()] || s.mu.BlockEpoch(e.Block()) <= x.Epoch {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v not older than a dirty entry", vi, x)
			}
		}
	}
	return nil
}

// pinReleasedStubs pins the stubs of the snapshot trees whose page is one
// of released (released by the page trees in this checkpoint: intact
// until the root after next is durable), so that no stub outlives its
// page.
// REQUIRES: s.commitMu, not s.mu
func (s *Set) pinReleasedStubs(trees []*index.Ptree, released []uint32) error {
	if len(released) == 0 {
		return nil
	}
	rel := make(map[uint32]bool, len(released))
	for _, p := range released {
		rel[p] = true
	}
	// A stub loaded for the first time puts its epochs into the bucket
	// tables: under mu.
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range trees {
		if t == nil {
			continue
		}
		if err := t.PinStubs(func(r index.StubRef) bool { return rel[stubPtr(r).Page] }); err != nil {
			return err
		}
	}
	return nil
}
