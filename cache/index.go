package cache

// The index. Invariants kept in this file (checked by Set.Check):
//
//  1. No cache block is named by two entries (live or superseded, of any
//     volume). During recovery, while the reverse map owner exists,
//     owner[loc] is (volume, lba) of the entry naming loc, and every
//     non-zero owner[loc] is named by exactly one entry.
//  2. bucket.live counts the entries pointing into the bucket, and
//     bucket.dirty those of them that are dirty. A bucket with live > 0 is
//     open or sealed, never free (invariant 5: a bucket is reused only after
//     no live entry points into its current generation). A bucket has its
//     epoch table (bucket.ep) exactly when dirty > 0.
//  3. Volume.idx.dirty and .cached equal the dirty and total entry counts of
//     the volume's tree.
//  4. Superseded versions (epoch order): a dirty version overwritten in a
//     later flush epoch stays owned (owner map, bucket live and dirty
//     counts) in idx.sup until its epoch is written back. Every superseded
//     version of an LBA is older (lower epoch) than the live entry of that
//     LBA, which exists and is dirty. A superseded version's epoch is its
//     block's (bucket.ep), and the summaries of idx.sup bound them as
//     those of the index tree bound the dirty entries' (invariant 5).
//  5. Every summary in the index tree (and in idx.sup) is at most the
//     oldest flush epoch of the dirty entries (superseded versions) under it (ptree.go, "Summaries"; the epochs are
//     the blocks' in bucket.ep): epoch-ordered writeback finds the
//     oldest epoch's live entries through them.
//
// The index is one packed B+tree per volume (ptree.go: 13 bytes a cached
// 4 KiB block, leaves kept over 2/3 full) and a small table per bucket
// (with 2 bytes of flush epoch per block of a bucket holding dirty data).
// The dirty blocks are not indexed a second time by epoch: the tree's
// inner nodes carry, per child, a lower bound of the oldest dirty epoch
// under it, which is what epoch-ordered writeback searches by.
// There is no reverse map (cache block -> LBA) while serving: eviction finds
// its victims' entries by walking the index once for a batch of victim
// buckets (gc.go), a few entries per hold of Set.mu. Recovery builds the
// reverse map owner for the journal replay (a reuse record drops the
// entries of one bucket; an insert into an owned block is corruption) and
// drops it before serving. The entry does not store the bucket generation:
// invariant 5 is kept by construction (live counts) in memory, and the
// generation is checked where it matters, in the journal and at replay.

import (
	"fmt"
	"math"
	"slices"

	"github.com/tiercache/tiercache/internal/invariants"
)

// ent maps one 4 KiB block of a volume to a cache block.
type ent struct {
	lba uint64 // backing block number (byte offset / 4096)
	loc uint32 // cache block number; top bit set when dirty
	crc uint32 // crc32c of the 4 KiB block as written to the cache
}

const dirtyBit = 1 << 31

func (e ent) block() uint32 { return e.loc &^ dirtyBit }
func (e ent) dirty() bool   { return e.loc&dirtyBit != 0 }

// ownerKey packs (volume, lba) for the reverse map; 0 means unowned.
func ownerKey(vol int, lba uint64) uint64 { return uint64(vol+1)<<48 | lba }

func splitOwner(k uint64) (vol int, lba uint64) { return int(k>>48) - 1, k & (1<<48 - 1) }

type bucketState uint8

const (
	bucketFree    bucketState = iota // on the free list, ready to open
	bucketOpen                       // being filled append-only
	bucketSealed                     // full (or recovered with live data); in the FIFO
	bucketFreeing                    // emptied; its reuse record is being made durable
)

func (s bucketState) String() string {
	return [...]string{"free", "open", "sealed", "freeing"}[s]
}

type bucket struct {
	gen   uint32
	live  uint32 // entries pointing into this generation
	dirty uint32 // dirty entries among live
	pins  int32  // reads and unfinished writes in flight into the bucket
	fill  uint32 // blocks handed out (open bucket)
	state bucketState
	atime uint64 // Set.mu.tick at the last read hit or allocation (eviction recency)
	ep    *bucketEpochs
}

// ver is one dirty version of a block, live or superseded, in the order
// epoch-ordered writeback takes them: by (epoch, lba), which names one
// version (invariant 4: superseded versions of an LBA are older than its
// live entry, and a same-epoch overwrite releases the old version).
type ver struct {
	epoch uint64
	lba   uint64
	loc   uint32
	crc   uint32
}

func cmpVer(a, b ver) int {
	if verLess(a, b) {
		return -1
	}
	if verLess(b, a) {
		return 1
	}
	return 0
}

func verLess(a, b ver) bool {
	if a.epoch != b.epoch {
		return a.epoch < b.epoch
	}
	return a.lba < b.lba
}

// versionLocked fills in the cache block and checksum of the dirty version
// x (epoch, lba) of volume vi: the live entry's if it is dirty in that
// epoch, else the superseded version's of that epoch.
// REQUIRES: s.mu
func (s *Set) versionLocked(vi int, x ver) (ver, bool) {
	v := s.vols[vi]
	if e, ok := v.idx.tree.Get(ent{lba: x.lba}); ok && e.dirty() && s.blockEpoch(e.block()) == x.epoch {
		x.loc, x.crc = e.block(), e.crc
		return x, true
	}
	for _, y := range s.supOfLocked(vi, x.lba) {
		if y.epoch == x.epoch {
			return y, true
		}
	}
	return x, false
}

// supOfLocked returns the superseded versions of lba (normally none).
// REQUIRES: s.mu
func (s *Set) supOfLocked(vi int, lba uint64) []ver {
	var out []ver
	s.vols[vi].idx.sup.AscendRange(ent{lba: lba}, ent{lba: lba + 1}, func(e ent) bool {
		out = append(out, ver{epoch: s.blockEpoch(e.loc), lba: lba, loc: e.loc, crc: e.crc})
		return true
	})
	return out
}

// supEpoch is idx.sup's summary value of a superseded version: its epoch.
// REQUIRES: s.mu
func (s *Set) supEpoch(e ent) uint64 { return s.blockEpoch(e.loc) }

// volIndex is a volume's part of the index. Guarded by Set.mu.
type volIndex struct {
	tree *ptree
	// sup: the superseded versions (epoch order) by (lba, cache block),
	// with per-child bounds of their epochs (ptree.go, sleaf).
	sup  *stree
	nsup int64        // superseded versions in sup
	busy []blockRange // backing writes in flight (claims)
	// wbInflight holds the cache blocks a writeback batch has taken and not
	// yet marked clean, so that two batches (background, eviction, Drain)
	// never write the same version twice.
	wbInflight map[uint32]struct{}
	mutations  uint64 // bumped by every write; promotion checks it
	epoch      uint64 // client flush epoch, bumped by Flush
	dirty      int64
	cached     int64
	// replayable says a recovery could find an entry of this volume: the
	// newest durable checkpoint holds one, or an insert record of the
	// volume was appended since that checkpoint's snapshot. Invariant:
	// !replayable implies the volume has no entry, live or superseded, in
	// memory either (every entry comes from a journaled insert or from
	// recovery, and a volume starts replayable until Open's checkpoint).
	// Passthrough skips its invalidation record while it is false: no
	// record or checkpoint entry exists that the record could cancel
	// (docs/CACHE.md, "Flush protocol"). Set by appendInsertEpochLocked,
	// cleared only by a durable checkpoint whose snapshot held no entry of
	// the volume when no insert of it was appended after the snapshot.
	replayable bool
	// insertSeq is Set.mu.seq just after the volume's last insert record.
	insertSeq uint64
}

// cacheBlocks returns the number of cache blocks (buckets × blocks per bucket).
func (s *Set) cacheBlocks() int64 { return int64(len(s.mu.buckets)) * s.bpb }

type blockRange struct{ lba, n uint64 }

func (r blockRange) overlaps(lba, n uint64) bool { return r.lba < lba+n && lba < r.lba+r.n }

type bitset []uint64

func newBitset(n int) bitset    { return make(bitset, (n+63)/64) }
func (b bitset) get(i int) bool { return b[i/64]&(1<<(i%64)) != 0 }
func (b bitset) set(i int)      { b[i/64] |= 1 << (i % 64) }
func (b bitset) clear(i int)    { b[i/64] &^= 1 << (i % 64) }

// insertLocked makes lba of volume v point at cache block loc, replacing any
// previous entry; a dirty block gets the volume's current flush epoch.
// REQUIRES: s.mu
func (s *Set) insertLocked(vi int, lba uint64, loc uint32, crc uint32, dirty bool) {
	s.insertEpochLocked(vi, lba, loc, crc, dirty, s.vols[vi].idx.epoch)
}

// insertEpochLocked is insertLocked with the flush epoch of a dirty block
// given. In epoch order, a dirty entry of an earlier epoch that the new
// dirty entry replaces is kept as a superseded version (invariant 4). A
// clean insert means the backing device holds this data (writethrough,
// promotion): every older dirty version of the block is dropped, as writing
// one back later would put old data over it.
// REQUIRES: s.mu
func (s *Set) insertEpochLocked(vi int, lba uint64, loc uint32, crc uint32, dirty bool, epoch uint64) {
	s.initVersionsLocked()
	v := s.vols[vi]
	e := ent{lba: lba, loc: loc, crc: crc}
	b := &s.mu.buckets[int64(loc)/s.bpb]
	agg := uint64(math.MaxUint64)
	if dirty {
		e.loc |= dirtyBit
		// The epoch first: the old entry's release below must not drop
		// the bucket's epoch table if it is the same bucket.
		b.dirty++
		s.setBlockEpoch(loc, epoch)
		agg = epoch
	}
	if old, ok := v.idx.tree.ReplaceOrInsertAgg(e, agg); ok {
		if oe := s.blockEpoch(old.block()); dirty && old.dirty() && oe < epoch && s.keepSuperseded(vi) {
			v.idx.sup.ReplaceOrInsertAgg(ent{lba: lba, loc: old.block(), crc: old.crc}, oe)
			v.idx.nsup++
			v.idx.dirty-- // counted as superseded from now on (bucket counts unchanged)
			v.idx.cached--
		} else {
			s.unaccountLocked(vi, old)
		}
	}
	if !dirty {
		s.dropSupLocked(vi, lba)
	}
	if s.mu.owner != nil {
		if invariants.Enabled && s.mu.owner[loc] != 0 {
			invariants.AssertionFailedf("cache block %d given to vol %d lba %d is owned (%#x)", loc, vi, lba, s.mu.owner[loc])
		}
		s.mu.owner[loc] = ownerKey(vi, lba)
	}
	b.live++
	v.idx.cached++
	if dirty {
		v.idx.dirty++
	}
}

// entEpoch is the index tree's summary value of an entry: its flush epoch
// if it is dirty, else MaxUint64 (ptree.go, "Summaries").
// REQUIRES: s.mu
func (s *Set) entEpoch(e ent) uint64 {
	if !e.dirty() {
		return math.MaxUint64
	}
	return s.blockEpoch(e.block())
}

// oldestEpochLocked returns the oldest flush epoch of volume vi's dirty
// versions: the smallest of the live entries' and the superseded
// versions' (both trees' summaries).
// REQUIRES: s.mu
func (s *Set) oldestEpochLocked(vi int) (uint64, bool) {
	v := s.vols[vi]
	e, ok := v.idx.tree.MinAgg(s.entEpoch)
	if x, sok := v.idx.sup.MinAgg(s.supEpoch); sok && (!ok || x < e) {
		return x, true
	}
	return e, ok
}

// bucketEpochs holds the flush epochs of a bucket's dirty blocks (only
// dirty blocks have one). It is allocated with the bucket's first dirty
// block and dropped with its last, so a clean cache pays nothing for epochs.
// An epoch takes 2 bytes, relative to base: a bucket is filled within a
// short time, so its blocks' epochs are usually close (one flush per 4 KiB
// write still spans only the bucket's 256 blocks). When they span more
// than 2^16 (GC moved an old dirty block into the open bucket, or volumes
// with far-apart epoch counters share the bucket) the table widens to 4
// bytes relative to base, then to full 8-byte epochs. It stays wide until
// the bucket's last dirty block goes.
type bucketEpochs struct {
	snap uint64 // Set.mu.epochSnap when made: copied before a change once a snapshot shares it
	base uint64
	e16  []uint16 // epoch - base, while every epoch fits
	e32  []uint32 // epoch - base, once one did not fit in 16 bits
	e64  []uint64 // full epochs, once one did not fit in 32 bits
}

func newBucketEpochs(n int64, base uint64) *bucketEpochs {
	return &bucketEpochs{base: base, e16: make([]uint16, n)}
}

func (ep *bucketEpochs) get(i int64) uint64 {
	switch {
	case ep.e16 != nil:
		return ep.base + uint64(ep.e16[i])
	case ep.e32 != nil:
		return ep.base + uint64(ep.e32[i])
	}
	return ep.e64[i]
}

// limit returns the largest offset the table can store.
func (ep *bucketEpochs) limit() uint64 {
	if ep.e16 != nil {
		return math.MaxUint16
	}
	return math.MaxUint32
}

// maxOffset returns the largest offset stored (a scan of the table: only
// a rebase needs it).
func (ep *bucketEpochs) maxOffset() uint64 {
	if ep.e16 != nil {
		return uint64(slices.Max(ep.e16))
	}
	return uint64(slices.Max(ep.e32))
}

// widen moves the table to the next wider representation.
func (ep *bucketEpochs) widen() {
	if ep.e16 != nil {
		ep.e32 = make([]uint32, len(ep.e16))
		for i, x := range ep.e16 {
			ep.e32[i] = uint32(x)
		}
		ep.e16 = nil
		return
	}
	ep.e64 = make([]uint64, len(ep.e32))
	for i, x := range ep.e32 {
		ep.e64[i] = ep.base + uint64(x)
	}
	ep.e32 = nil
}

func (ep *bucketEpochs) set(i int64, e uint64) {
	for ep.e64 == nil {
		limit := ep.limit()
		switch {
		case e >= ep.base && e-ep.base <= limit:
			if ep.e16 != nil {
				ep.e16[i] = uint16(e - ep.base)
			} else {
				ep.e32[i] = uint32(e - ep.base)
			}
			return
		case e < ep.base && ep.base-e <= limit-ep.maxOffset():
			// Rebase downwards: every recorded epoch still fits.
			shift := ep.base - e
			for j := range ep.e16 {
				ep.e16[j] += uint16(shift)
			}
			for j := range ep.e32 {
				ep.e32[j] += uint32(shift)
			}
			ep.base = e
		default:
			ep.widen()
		}
	}
	ep.e64[i] = e
}

// blockEpoch returns the flush epoch of the dirty version at cache block loc.
// REQUIRES: s.mu
func (s *Set) blockEpoch(loc uint32) uint64 {
	ep := s.mu.buckets[int64(loc)/s.bpb].ep
	if ep == nil {
		return 0
	}
	return ep.get(int64(loc) % s.bpb)
}

// setBlockEpoch records the flush epoch of the dirty version at loc.
// REQUIRES: s.mu
func (s *Set) setBlockEpoch(loc uint32, e uint64) {
	b := &s.mu.buckets[int64(loc)/s.bpb]
	switch {
	case b.ep == nil:
		b.ep = newBucketEpochs(s.bpb, e)
		b.ep.snap = s.mu.epochSnap
	case b.ep.snap != s.mu.epochSnap:
		// A checkpoint's snapshot shares the table: change a copy.
		c := *b.ep
		c.e16, c.e32, c.e64 = slices.Clone(c.e16), slices.Clone(c.e32), slices.Clone(c.e64)
		c.snap = s.mu.epochSnap
		b.ep = &c
	}
	b.ep.set(int64(loc)%s.bpb, e)
}

// snapshotEpochsLocked returns the flush epoch of each dirty cache block as
// it is now, for a checkpoint encoded outside mu: it keeps the buckets'
// epoch tables, which setBlockEpoch then copies before changing (a table is
// dropped, not changed, when its bucket's last dirty block goes).
// REQUIRES: s.mu
func (s *Set) snapshotEpochsLocked() func(loc uint32) uint64 {
	eps := make([]*bucketEpochs, len(s.mu.buckets))
	for i := range s.mu.buckets {
		eps[i] = s.mu.buckets[i].ep
	}
	s.mu.epochSnap++
	bpb := s.bpb
	return func(loc uint32) uint64 {
		ep := eps[int64(loc)/bpb]
		if ep == nil {
			return 0
		}
		return ep.get(int64(loc) % bpb)
	}
}

// undirtyLocked counts one dirty block of loc's bucket less, dropping the
// bucket's epoch table with its last dirty block.
// REQUIRES: s.mu
func (s *Set) undirtyLocked(loc uint32) {
	b := &s.mu.buckets[int64(loc)/s.bpb]
	b.dirty--
	if b.dirty == 0 {
		b.ep = nil
	}
}

// initVersionsLocked allocates the version structures if they are not yet
// (a Set built by hand, as the read-only inspector does, has none).
// REQUIRES: s.mu
func (s *Set) initVersionsLocked() {
	for _, v := range s.vols {
		if v.idx.sup == nil {
			v.idx.sup = newStree()
		}
	}
}

// keepSuperseded reports whether volume vi keeps superseded dirty versions
// (epoch order, on a set whose checkpoint slots can hold them).
func (s *Set) keepSuperseded(vi int) bool {
	cfg := s.vol(vi).cfg.Load()
	return s.epochOK && cfg != nil && cfg.WritebackOrder == "epoch"
}

// insertSupLocked adds a superseded version read from a checkpoint.
// REQUIRES: s.mu
func (s *Set) insertSupLocked(vi int, x ver) {
	s.initVersionsLocked()
	v := s.vols[vi]
	s.setBlockEpoch(x.loc, x.epoch)
	v.idx.sup.ReplaceOrInsertAgg(ent{lba: x.lba, loc: x.loc, crc: x.crc}, x.epoch)
	v.idx.nsup++
	if s.mu.owner != nil {
		s.mu.owner[x.loc] = ownerKey(vi, x.lba)
	}
	b := &s.mu.buckets[int64(x.loc)/s.bpb]
	b.live++
	b.dirty++
}

// releaseSupLocked releases the superseded version of lba at loc, if there
// is one, and reports whether there was.
// REQUIRES: s.mu
func (s *Set) releaseSupLocked(vi int, lba uint64, loc uint32) bool {
	v := s.vols[vi]
	if _, ok := v.idx.sup.Delete(ent{lba: lba, loc: loc}); !ok {
		return false
	}
	v.idx.nsup--
	if s.mu.owner != nil {
		s.mu.owner[loc] = 0
	}
	s.mu.buckets[int64(loc)/s.bpb].live--
	s.undirtyLocked(loc)
	return true
}

// dropSupLocked releases every superseded version of lba.
// REQUIRES: s.mu
func (s *Set) dropSupLocked(vi int, lba uint64) {
	s.dropSupRangeLocked(vi, lba, 1)
}

// dropSupRangeLocked releases every superseded version of [lba, lba+n).
// REQUIRES: s.mu
func (s *Set) dropSupRangeLocked(vi int, lba, n uint64) {
	v := s.vols[vi]
	if v.idx.nsup == 0 {
		return
	}
	var drop []ent
	v.idx.sup.AscendRange(ent{lba: lba}, ent{lba: lba + n}, func(e ent) bool {
		drop = append(drop, e)
		return true
	})
	for _, e := range drop {
		s.releaseSupLocked(vi, e.lba, e.loc)
	}
}

// dropAllSupLocked releases every superseded version of volume vi (the
// volume left epoch order).
// REQUIRES: s.mu
func (s *Set) dropAllSupLocked(vi int) {
	s.dropSupRangeLocked(vi, 0, math.MaxUint64-1)
}

// unaccountLocked releases the cache block of an entry already removed from
// (or replaced in) the tree.
// REQUIRES: s.mu
func (s *Set) unaccountLocked(vi int, old ent) {
	v := s.vols[vi]
	loc := old.block()
	if invariants.Enabled && ((s.mu.owner != nil && s.mu.owner[loc] != ownerKey(vi, old.lba)) || s.mu.buckets[int64(loc)/s.bpb].live == 0) {
		invariants.AssertionFailedf("releasing cache block %d of vol %d lba %d: bucket live %d",
			loc, vi, old.lba, s.mu.buckets[int64(loc)/s.bpb].live)
	}
	if s.mu.owner != nil {
		s.mu.owner[loc] = 0
	}
	b := &s.mu.buckets[int64(loc)/s.bpb]
	b.live--
	v.idx.cached--
	if old.dirty() {
		v.idx.dirty--
		s.undirtyLocked(loc)
	}
}

// invalidateLocked drops every entry of volume vi in [lba, lba+n).
// REQUIRES: s.mu
func (s *Set) invalidateLocked(vi int, lba, n uint64) {
	v := s.vols[vi]
	var drop []ent
	v.idx.tree.AscendRange(ent{lba: lba}, ent{lba: lba + n}, func(e ent) bool {
		drop = append(drop, e)
		return true
	})
	for _, e := range drop {
		v.idx.tree.Delete(e)
		s.unaccountLocked(vi, e)
	}
	// Superseded versions of the range: the backing device now holds newer
	// data (or zeroes) there.
	s.dropSupRangeLocked(vi, lba, n)
}

// markCleanLocked records that the version of lba at cache block loc is on
// the backing device: the live entry, if it is still at loc, becomes clean
// (and older superseded versions of lba, which can only be left over from a
// failed writeback, are dropped); a superseded version at loc is released.
// REQUIRES: s.mu
func (s *Set) markCleanLocked(vi int, lba uint64, loc uint32) bool {
	v := s.vols[vi]
	e, ok := v.idx.tree.Get(ent{lba: lba})
	if !ok || e.block() != loc || !e.dirty() {
		return s.releaseSupLocked(vi, lba, loc)
	}
	e.loc &^= dirtyBit
	v.idx.tree.ReplaceOrInsertAgg(e, math.MaxUint64)
	s.undirtyLocked(loc)
	v.idx.dirty--
	s.dropSupLocked(vi, lba)
	return true
}

// dropBucketLocked removes every entry pointing into bucket bi and returns
// how many of them were dirty (callers only drop buckets without dirty data;
// a non-zero result is a bug or corruption they report). It needs the
// reverse map owner, which exists only during recovery (journal replay).
// REQUIRES: s.mu
func (s *Set) dropBucketLocked(bi int64, onlyClean bool) (droppedDirty int) {
	for loc := bi * s.bpb; loc < (bi+1)*s.bpb; loc++ {
		k := s.mu.owner[loc]
		if k == 0 {
			continue
		}
		vi, lba := splitOwner(k)
		v := s.vols[vi]
		e, ok := v.idx.tree.Get(ent{lba: lba})
		if !ok || int64(e.block()) != loc {
			// A superseded version (dirty), or an inconsistency Check
			// reports.
			if !onlyClean && s.releaseSupLocked(vi, lba, uint32(loc)) {
				droppedDirty++
			}
			continue
		}
		if e.dirty() {
			if onlyClean {
				continue
			}
			droppedDirty++
		}
		v.idx.tree.Delete(e)
		s.unaccountLocked(vi, e)
	}
	return droppedDirty
}

// Check verifies the index and allocator invariants listed at the top of
// index.go and the bucket lists. Tests run it after every test; `tiercache
// check` runs it on an opened set. It returns the first violation found.
func (s *Set) Check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checkLocked()
}

// REQUIRES: s.mu
func (s *Set) checkLocked() error { return s.checkIndexLocked(true) }

// checkIndexLocked is Check. With exact false (production Open: 0.1 s of
// CPU instead of 0.65-0.7 s on 1M dirty entries) it verifies everything
// exact does, two things by fingerprint instead of by lookup:
//
//   - verified exactly either way: tree structure (order, separators, leaf
//     counts, depth); every entry in range, in order, naming a cache block
//     no other entry or superseded version names (replay's double use of
//     a block); superseded versions agreeing with the reverse map;
//     per-volume dirty/cached/superseded counts; bucket live/dirty counts
//     against the index; bucket lists and states (invariant 5); epoch
//     tables exactly on buckets with dirty blocks; every superseded version
//     older than a dirty live entry of its LBA, with its block's epoch, and
//     the only version of its epoch; the version tree's size equal to the
//     superseded count.
//   - the reverse map (recovery only) agreeing with every entry: exact
//     compares owner[block] per entry (a random 8-byte read each); otherwise
//     the sum of a mix of (block, owner) over one sequential pass of the map
//     must equal the same sum over the entries and superseded versions
//     (with each block named once and the owned count equal to the entry
//     count, checked exactly).
//   - the version tree holding exactly the (epoch, LBA) of every
//     superseded version: exact looks each one up; otherwise the sum of a
//     64-bit mix of (epoch, LBA) over them must equal the same sum over
//     one in-order walk of the version tree. With equal sizes and distinct
//     tree keys, a missing, stray or wrong-epoch version (what a replay bug
//     would leave) passes only if two sums of 64-bit hashes collide by
//     chance.
//   - exact only: the index tree's summaries (invariant 5), recomputed
//     from every dirty entry's epoch (a random read of the epoch tables
//     each). Open skips it: recovery computes them with the same code as
//     serving does (bulk load with per-leaf minima, inserts), which Check
//     after every test and the invariants build verify.
//
// Check (tests after every test, `tiercache check`, GC under the
// invariants tag) and Open built with -tags invariants use exact.
// REQUIRES: s.mu
func (s *Set) checkIndexLocked(exact bool) error {
	if s.mu.owner != nil && int64(len(s.mu.owner)) != s.cacheBlocks() {
		return fmt.Errorf("reverse map has %d blocks, cache %d", len(s.mu.owner), s.cacheBlocks())
	}
	s.initVersionsLocked()
	nb := int64(len(s.mu.buckets))
	liveB := make([]uint32, nb)
	dirtyB := make([]uint32, nb)
	owned := -1
	// !exact: fingerprints of the reverse map (one sequential pass) and of
	// the (block, owner) pairs the entries say it must hold.
	var ownFP, entOwnFP uint64
	if s.mu.owner != nil {
		owned = 0
		for loc, k := range s.mu.owner {
			if k != 0 {
				owned++
				if !exact {
					ownFP += pairHash(uint64(loc), k)
				}
			}
		}
	}
	// named: cache blocks named by an entry so far (invariant 1).
	named := newBitset(int(nb * s.bpb))
	total := 0
	for vi, v := range s.vols {
		if err := v.idx.tree.check(); err != nil {
			return fmt.Errorf("volume %s: %w", v.name, err)
		}
		if exact {
			if err := v.idx.tree.checkAgg(s.entEpoch); err != nil {
				return fmt.Errorf("volume %s: %w", v.name, err)
			}
		}
		var nd, nc int64
		var err error
		prev := int64(-1)
		v.idx.tree.Ascend(func(e ent) bool {
			loc := int64(e.block())
			switch {
			case int64(e.lba) <= prev:
				err = fmt.Errorf("volume %s: entries out of order at lba %d", v.name, e.lba)
			case e.lba >= v.nblocks:
				err = fmt.Errorf("volume %s: lba %d beyond volume (%d blocks)", v.name, e.lba, v.nblocks)
			case loc >= nb*s.bpb:
				err = fmt.Errorf("volume %s: lba %d points at cache block %d beyond cache", v.name, e.lba, loc)
			case named.get(int(loc)):
				err = fmt.Errorf("volume %s: lba %d -> cache block %d, which another entry names", v.name, e.lba, loc)
			case exact && s.mu.owner != nil && s.mu.owner[loc] != ownerKey(vi, e.lba):
				ov, ol := splitOwner(s.mu.owner[loc])
				err = fmt.Errorf("volume %s: lba %d -> cache block %d owned by (vol %d, lba %d)", v.name, e.lba, loc, ov, ol)
			}
			if err != nil {
				return false
			}
			if !exact && s.mu.owner != nil {
				entOwnFP += pairHash(uint64(loc), ownerKey(vi, e.lba))
			}
			named.set(int(loc))
			prev = int64(e.lba)
			liveB[loc/s.bpb]++
			nc++
			if e.dirty() {
				dirtyB[loc/s.bpb]++
				nd++
			}
			return true
		})
		if err != nil {
			return err
		}
		if nd != v.idx.dirty || nc != v.idx.cached {
			return fmt.Errorf("volume %s: counted %d dirty/%d cached, accounted %d/%d", v.name, nd, nc, v.idx.dirty, v.idx.cached)
		}
		total += int(nc)
		// Invariant 4: superseded versions (few: each is checked exactly).
		if err := v.idx.sup.check(); err != nil {
			return fmt.Errorf("volume %s: superseded versions: %w", v.name, err)
		}
		if exact {
			if err := v.idx.sup.checkAgg(s.supEpoch); err != nil {
				return fmt.Errorf("volume %s: superseded versions: %w", v.name, err)
			}
		}
		var ns int64
		v.idx.sup.Ascend(func(e ent) bool {
			x := ver{epoch: s.blockEpoch(e.loc), lba: e.lba, loc: e.loc, crc: e.crc}
			live, ok := v.idx.tree.Get(ent{lba: x.lba})
			loc := int64(x.loc)
			switch {
			case loc >= nb*s.bpb || named.get(int(loc)) || (s.mu.owner != nil && s.mu.owner[loc] != ownerKey(vi, x.lba)):
				err = fmt.Errorf("volume %s: superseded version %+v out of range, not owned, or its block named twice", v.name, x)
			case !ok || !live.dirty() || s.blockEpoch(live.block()) <= x.epoch:
				err = fmt.Errorf("volume %s: superseded version %+v without a newer dirty live entry (%+v, %t)", v.name, x, live, ok)
			}
			if err != nil {
				return false
			}
			if y, ok := s.versionLocked(vi, x); !ok || y != x {
				err = fmt.Errorf("volume %s: superseded version %+v resolves to %+v (%t): two versions of one epoch", v.name, x, y, ok)
				return false
			}
			if !exact && s.mu.owner != nil {
				entOwnFP += pairHash(uint64(loc), ownerKey(vi, x.lba))
			}
			named.set(int(loc))
			liveB[loc/s.bpb]++
			dirtyB[loc/s.bpb]++
			ns++
			return true
		})
		if err != nil {
			return err
		}
		if ns != v.idx.nsup {
			return fmt.Errorf("volume %s: %d superseded, accounted %d", v.name, ns, v.idx.nsup)
		}
		if !v.idx.replayable && nc+ns > 0 {
			// The skipped invalidations would have dropped these.
			return fmt.Errorf("volume %s: %d entries and %d superseded versions, but marked as having nothing a recovery could replay", v.name, nc, ns)
		}
		total += int(ns)
	}
	if owned >= 0 && total != owned {
		return fmt.Errorf("%d index entries but %d owned cache blocks", total, owned)
	}
	if owned >= 0 && !exact && ownFP != entOwnFP {
		return fmt.Errorf("the reverse map does not name exactly the entries' cache blocks (fingerprint %#x, expected %#x)", ownFP, entOwnFP)
	}
	inFree := make([]bool, nb)
	for _, bi := range s.mu.free {
		if inFree[bi] {
			return fmt.Errorf("bucket %d twice on the free list", bi)
		}
		inFree[bi] = true
	}
	inFIFO := make([]bool, nb)
	for _, bi := range s.mu.sealed {
		if inFIFO[bi] {
			return fmt.Errorf("bucket %d twice in the sealed FIFO", bi)
		}
		inFIFO[bi] = true
	}
	for i := range s.mu.buckets {
		b := &s.mu.buckets[i]
		if b.live != liveB[i] || b.dirty != dirtyB[i] {
			return fmt.Errorf("bucket %d (%v gen %d): accounted %d live/%d dirty, index has %d/%d",
				i, b.state, b.gen, b.live, b.dirty, liveB[i], dirtyB[i])
		}
		if (b.state == bucketFree) != inFree[i] {
			return fmt.Errorf("bucket %d is %v, on free list %t", i, b.state, inFree[i])
		}
		if (b.state == bucketSealed) != inFIFO[i] {
			return fmt.Errorf("bucket %d is %v, in sealed FIFO %t", i, b.state, inFIFO[i])
		}
		if (b.state == bucketFree || b.state == bucketFreeing) && b.live != 0 {
			return fmt.Errorf("bucket %d is %v with %d live entries (invariant 5)", i, b.state, b.live)
		}
		if b.state == bucketOpen && int64(i) != s.mu.open {
			return fmt.Errorf("bucket %d open but open bucket is %d", i, s.mu.open)
		}
		if (b.dirty > 0) != (b.ep != nil) {
			return fmt.Errorf("bucket %d: %d dirty blocks, epoch table %t", i, b.dirty, b.ep != nil)
		}
		if b.fill > uint32(s.bpb) || b.pins < 0 {
			return fmt.Errorf("bucket %d: fill %d pins %d", i, b.fill, b.pins)
		}
	}
	return nil
}

// pairHash mixes a pair such as a version's (epoch, LBA) into 64 bits
// (splitmix64's finalizer, applied to a and again with b), for
// checkIndexLocked's order-independent sums.
func pairHash(a, b uint64) uint64 {
	return mix64(mix64(a+0x9E3779B97F4A7C15) ^ b)
}

func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	return x ^ x>>31
}
