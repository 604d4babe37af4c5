// Package index is the in-memory index of a cache set: which cache block
// holds each cached 4 KiB block of each volume, the live and dirty counts
// and flush epochs of each bucket, the superseded dirty versions kept in
// epoch order, and during recovery the reverse map. It does no I/O and
// knows nothing of devices; the engine (package cache) guards it with its
// lock and journals every change before it acknowledges one.
//
// The index keeps invariants 10 to 15 of docs/DESIGN.md, which Check
// verifies: no cache block is named twice and the reverse map agrees (10);
// bucket live and dirty counts match the entries, a bucket with live
// entries is never free, and a bucket has its epoch table exactly when it
// holds dirty blocks (11); per-volume counts match the trees (12); every
// superseded version is older than the dirty live entry of its LBA and the
// only version of its epoch (13); every tree summary is at most the oldest
// flush epoch under it (14); a volume that is not replayable has no entry
// (15).
//
// The index is one packed B+tree per volume (ptree.go: 13 bytes a cached
// 4 KiB block, leaves kept over 2/3 full) and a small table per bucket
// (with 2 bytes of flush epoch per block of a bucket holding dirty data);
// a tree may be built from stubs whose leaves a loader reads when an
// operation first needs them, keeping a bounded number loaded (lazy.go).
// The dirty blocks are not indexed a second time by epoch: the tree's
// inner nodes carry, per child, a lower bound of the oldest dirty epoch
// under it, which is what epoch-ordered writeback searches by.
// There is no reverse map (cache block -> LBA) while serving: eviction finds
// its victims' entries by walking the index once for a batch of victim
// buckets. Recovery builds the reverse map Owner for the journal replay (a
// reuse record drops the entries of one bucket; an insert into an owned
// block is corruption) and drops it before serving. An entry does not store
// its bucket generation: invariant 5 is kept by construction (live counts)
// in memory, and the generation is checked in the journal and at replay.
package index

import (
	"fmt"
	"math"
	"slices"

	"github.com/tiercache/tiercache/internal/invariants"
)

// Ent maps one 4 KiB block of a volume to a cache block.
type Ent struct {
	LBA uint64 // backing block number (byte offset / 4096)
	Loc uint32 // cache block number; top bit set when dirty
	CRC uint32 // crc32c of the 4 KiB block as written to the cache
}

const DirtyBit = 1 << 31

func (e Ent) Block() uint32 { return e.Loc &^ DirtyBit }
func (e Ent) Dirty() bool   { return e.Loc&DirtyBit != 0 }

// OwnerKey packs (volume, lba) for the reverse map; 0 means unowned.
func OwnerKey(vol int, lba uint64) uint64 { return uint64(vol+1)<<48 | lba }

func SplitOwner(k uint64) (vol int, lba uint64) { return int(k>>48) - 1, k & (1<<48 - 1) }

// Bucket is the index's part of a bucket: its generation and what of the
// index lies in it. The allocator's part (state, fill, pins, recency) is
// the engine's.
type Bucket struct {
	Gen   uint32
	Live  uint32 // entries pointing into this generation
	Dirty uint32 // dirty entries among live
	Ep    *Epochs
}

// Ver is one dirty version of a block, live or superseded, in the order
// epoch-ordered writeback takes them: by (epoch, lba), which names one
// version (invariant 13: superseded versions of an LBA are older than its
// live entry, and a same-epoch overwrite releases the old version).
type Ver struct {
	Epoch uint64
	LBA   uint64
	Loc   uint32
	CRC   uint32
}

func CmpVer(a, b Ver) int {
	if VerLess(a, b) {
		return -1
	}
	if VerLess(b, a) {
		return 1
	}
	return 0
}

func VerLess(a, b Ver) bool {
	if a.Epoch != b.Epoch {
		return a.Epoch < b.Epoch
	}
	return a.LBA < b.LBA
}

// Version fills in the cache block and checksum of the dirty version
// x (epoch, lba) of volume vi: the live entry's if it is dirty in that
// epoch, else the superseded version's of that epoch.
func (ix *Index) Version(vi int, x Ver) (Ver, bool) {
	v := ix.Vols[vi]
	if e, ok := v.Tree.Get(Ent{LBA: x.LBA}); ok && e.Dirty() && ix.BlockEpoch(e.Block()) == x.Epoch {
		x.Loc, x.CRC = e.Block(), e.CRC
		return x, true
	}
	for _, y := range ix.SupOf(vi, x.LBA) {
		if y.Epoch == x.Epoch {
			return y, true
		}
	}
	return x, false
}

// SupOf returns the superseded versions of lba (normally none).
func (ix *Index) SupOf(vi int, lba uint64) []Ver {
	var out []Ver
	ix.Vols[vi].Sup.AscendRange(Ent{LBA: lba}, Ent{LBA: lba + 1}, func(e Ent) bool {
		out = append(out, Ver{Epoch: ix.BlockEpoch(e.Loc), LBA: lba, Loc: e.Loc, CRC: e.CRC})
		return true
	})
	return out
}

// SupEpoch is Sup's summary value of a superseded version: its epoch.
func (ix *Index) SupEpoch(e Ent) uint64 { return ix.BlockEpoch(e.Loc) }

// Vol is a volume's part of the index.
type Vol struct {
	Name    string // for Check's messages
	NBlocks uint64 // the volume's size in blocks
	Tree    *Ptree
	// Sup: the superseded versions (epoch order) by (lba, cache block),
	// with per-child bounds of their epochs (ptree.go, sleaf).
	Sup    *Stree
	NSup   int64 // superseded versions in Sup
	Dirty  int64
	Cached int64
	// Replayable says a recovery could find an entry of this volume: the
	// newest durable checkpoint holds one, or an insert record of the
	// volume was appended since that checkpoint's snapshot. Invariant:
	// !Replayable implies the volume has no entry, live or superseded, in
	// memory either (every entry comes from a journaled insert or from
	// recovery, and a volume starts replayable until Open's checkpoint).
	// The engine keeps it; Check verifies the implication.
	Replayable bool
}

// NewVol returns an empty volume index.
func NewVol(name string, nblocks uint64) Vol {
	return Vol{Name: name, NBlocks: nblocks, Tree: NewPtree(), Sup: NewStree(), Replayable: true}
}

// Index is the in-memory index of a cache set: per bucket its live and
// dirty counts and the flush epochs of its dirty blocks, per volume the
// tree of entries and the superseded versions, and during recovery the
// reverse map Owner. It does no I/O. It is guarded by the caller's lock
// (Set.mu): every method requires it.
type Index struct {
	BPB     int64 // cache blocks per bucket
	Buckets []Bucket
	Vols    []*Vol   // by slot
	Owner   []uint64 // per cache block: OwnerKey or 0; only during recovery
	// epochSnap counts the snapshots of the bucket epoch tables
	// (SnapshotEpochs): a table made before the last one is copied before
	// it changes.
	epochSnap uint64
}

// CacheBlocks returns the number of cache blocks (buckets × blocks per bucket).
func (ix *Index) CacheBlocks() int64 { return int64(len(ix.Buckets)) * ix.BPB }

type Bitset []uint64

func NewBitset(n int) Bitset    { return make(Bitset, (n+63)/64) }
func (b Bitset) Get(i int) bool { return b[i/64]&(1<<(i%64)) != 0 }
func (b Bitset) Set(i int)      { b[i/64] |= 1 << (i % 64) }
func (b Bitset) Clear(i int)    { b[i/64] &^= 1 << (i % 64) }

// Insert makes lba of volume vi point at cache block loc, replacing any
// previous entry; a dirty block has the flush epoch epoch. With keepSup
// (the volume writes back in epoch order), a dirty entry of an earlier
// epoch that the new dirty entry replaces is kept as a superseded version
// (invariant 13). A clean insert means the backing device holds this data
// (writethrough, promotion): every older dirty version of the block is
// dropped, as writing one back later would put old data over it.
//
// If lba's leaf cannot be loaded (a lazy tree), nothing changes: the
// tree's TakeFault reports it.
func (ix *Index) Insert(vi int, lba uint64, loc uint32, crc uint32, dirty bool, epoch uint64, keepSup bool) {
	ix.initVersions()
	v := ix.Vols[vi]
	e := Ent{LBA: lba, Loc: loc, CRC: crc}
	if v.Tree.Fault(e) != nil {
		return
	}
	b := &ix.Buckets[int64(loc)/ix.BPB]
	agg := uint64(math.MaxUint64)
	if dirty {
		e.Loc |= DirtyBit
		// The epoch first: the old entry's release below must not drop
		// the bucket's epoch table if it is the same bucket.
		b.Dirty++
		ix.SetBlockEpoch(loc, epoch)
		agg = epoch
	}
	if old, ok := v.Tree.ReplaceOrInsertAgg(e, agg); ok {
		if oe := ix.BlockEpoch(old.Block()); dirty && old.Dirty() && oe < epoch && keepSup {
			v.Sup.ReplaceOrInsertAgg(Ent{LBA: lba, Loc: old.Block(), CRC: old.CRC}, oe)
			v.NSup++
			v.Dirty-- // counted as superseded from now on (bucket counts unchanged)
			v.Cached--
		} else {
			ix.Unaccount(vi, old)
		}
	}
	if !dirty {
		ix.dropSup(vi, lba)
	}
	if ix.Owner != nil {
		if invariants.Enabled && ix.Owner[loc] != 0 {
			invariants.AssertionFailedf("cache block %d given to vol %d lba %d is owned (%#x)", loc, vi, lba, ix.Owner[loc])
		}
		ix.Owner[loc] = OwnerKey(vi, lba)
	}
	b.Live++
	v.Cached++
	if dirty {
		v.Dirty++
	}
}

// EntEpoch is the index tree's summary value of an entry: its flush epoch
// if it is dirty, else MaxUint64 (ptree.go, "Summaries").
func (ix *Index) EntEpoch(e Ent) uint64 {
	if !e.Dirty() {
		return math.MaxUint64
	}
	return ix.BlockEpoch(e.Block())
}

// OldestEpoch returns the oldest flush epoch of volume vi's dirty
// versions: the smallest of the live entries' and the superseded
// versions' (both trees' summaries).
func (ix *Index) OldestEpoch(vi int) (uint64, bool) {
	v := ix.Vols[vi]
	e, ok := v.Tree.MinAgg(ix.EntEpoch)
	if x, sok := v.Sup.MinAgg(ix.SupEpoch); sok && (!ok || x < e) {
		return x, true
	}
	return e, ok
}

// OldestEpochResident is OldestEpoch without loading a leaf of the
// volume's tree (index.MinAggResident): when the answer needs a leaf that
// is not resident, it returns the leaf's stub instead.
func (ix *Index) OldestEpochResident(vi int) (uint64, bool, *StubAt[Ent]) {
	v := ix.Vols[vi]
	e, ok, need := v.Tree.MinAggResident(ix.EntEpoch)
	if need != nil {
		return 0, false, need
	}
	if x, sok := v.Sup.MinAgg(ix.SupEpoch); sok && (!ok || x < e) {
		return x, true, nil
	}
	return e, ok, nil
}

// Epochs holds the flush epochs of a bucket's dirty blocks (only
// dirty blocks have one). It is allocated with the bucket's first dirty
// block and dropped with its last, so a clean cache pays nothing for epochs.
// An epoch takes 2 bytes, relative to base: a bucket is filled within a
// short time, so its blocks' epochs are usually close (one flush per 4 KiB
// write still spans only the bucket's 256 blocks). When they span more
// than 2^16 (GC moved an old dirty block into the open bucket, or volumes
// with far-apart epoch counters share the bucket) the table widens to 4
// bytes relative to base, then to full 8-byte epochs. It stays wide until
// the bucket's last dirty block goes.
type Epochs struct {
	snap uint64 // Index.epochSnap when made: copied before a change once a snapshot shares it
	base uint64
	e16  []uint16 // epoch - base, while every epoch fits
	e32  []uint32 // epoch - base, once one did not fit in 16 bits
	e64  []uint64 // full epochs, once one did not fit in 32 bits
}

func newBucketEpochs(n int64, base uint64) *Epochs {
	return &Epochs{base: base, e16: make([]uint16, n)}
}

func (ep *Epochs) get(i int64) uint64 {
	switch {
	case ep.e16 != nil:
		return ep.base + uint64(ep.e16[i])
	case ep.e32 != nil:
		return ep.base + uint64(ep.e32[i])
	}
	return ep.e64[i]
}

// limit returns the largest offset the table can store.
func (ep *Epochs) limit() uint64 {
	if ep.e16 != nil {
		return math.MaxUint16
	}
	return math.MaxUint32
}

// maxOffset returns the largest offset stored (a scan of the table: only
// a rebase needs it).
func (ep *Epochs) maxOffset() uint64 {
	if ep.e16 != nil {
		return uint64(slices.Max(ep.e16))
	}
	return uint64(slices.Max(ep.e32))
}

// widen moves the table to the next wider representation.
func (ep *Epochs) widen() {
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

func (ep *Epochs) set(i int64, e uint64) {
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

// BlockEpoch returns the flush epoch of the dirty version at cache block loc.
func (ix *Index) BlockEpoch(loc uint32) uint64 {
	ep := ix.Buckets[int64(loc)/ix.BPB].Ep
	if ep == nil {
		return 0
	}
	return ep.get(int64(loc) % ix.BPB)
}

// SetBlockEpoch records the flush epoch of the dirty version at loc.
func (ix *Index) SetBlockEpoch(loc uint32, e uint64) {
	b := &ix.Buckets[int64(loc)/ix.BPB]
	switch {
	case b.Ep == nil:
		b.Ep = newBucketEpochs(ix.BPB, e)
		b.Ep.snap = ix.epochSnap
	case b.Ep.snap != ix.epochSnap:
		// A checkpoint's snapshot shares the table: change a copy.
		c := *b.Ep
		c.e16, c.e32, c.e64 = slices.Clone(c.e16), slices.Clone(c.e32), slices.Clone(c.e64)
		c.snap = ix.epochSnap
		b.Ep = &c
	}
	b.Ep.set(int64(loc)%ix.BPB, e)
}

// SnapshotEpochs returns the flush epoch of each dirty cache block as
// it is now, for a checkpoint encoded outside mu: it keeps the buckets'
// epoch tables, which SetBlockEpoch then copies before changing (a table is
// dropped, not changed, when its bucket's last dirty block goes).
func (ix *Index) SnapshotEpochs() func(loc uint32) uint64 {
	eps := make([]*Epochs, len(ix.Buckets))
	for i := range ix.Buckets {
		eps[i] = ix.Buckets[i].Ep
	}
	ix.epochSnap++
	bpb := ix.BPB
	return func(loc uint32) uint64 {
		ep := eps[int64(loc)/bpb]
		if ep == nil {
			return 0
		}
		return ep.get(int64(loc) % bpb)
	}
}

// undirty counts one dirty block of loc's bucket less, dropping the
// bucket's epoch table with its last dirty block.
func (ix *Index) undirty(loc uint32) {
	b := &ix.Buckets[int64(loc)/ix.BPB]
	b.Dirty--
	if b.Dirty == 0 {
		b.Ep = nil
	}
}

// initVersions allocates the version structures if they are not yet
// (a Set built by hand, as the read-only inspector does, has none).
func (ix *Index) initVersions() {
	for _, v := range ix.Vols {
		if v.Sup == nil {
			v.Sup = NewStree()
		}
	}
}

// InsertSup adds a superseded version read from a checkpoint.
func (ix *Index) InsertSup(vi int, x Ver) {
	ix.initVersions()
	v := ix.Vols[vi]
	ix.SetBlockEpoch(x.Loc, x.Epoch)
	v.Sup.ReplaceOrInsertAgg(Ent{LBA: x.LBA, Loc: x.Loc, CRC: x.CRC}, x.Epoch)
	v.NSup++
	if ix.Owner != nil {
		ix.Owner[x.Loc] = OwnerKey(vi, x.LBA)
	}
	b := &ix.Buckets[int64(x.Loc)/ix.BPB]
	b.Live++
	b.Dirty++
}

// ReleaseSup releases the superseded version of lba at loc, if there
// is one, and reports whether there was.
func (ix *Index) ReleaseSup(vi int, lba uint64, loc uint32) bool {
	v := ix.Vols[vi]
	if _, ok := v.Sup.Delete(Ent{LBA: lba, Loc: loc}); !ok {
		return false
	}
	v.NSup--
	if ix.Owner != nil {
		ix.Owner[loc] = 0
	}
	ix.Buckets[int64(loc)/ix.BPB].Live--
	ix.undirty(loc)
	return true
}

// dropSup releases every superseded version of lba.
func (ix *Index) dropSup(vi int, lba uint64) {
	ix.dropSupRange(vi, lba, 1)
}

// dropSupRange releases every superseded version of [lba, lba+n).
func (ix *Index) dropSupRange(vi int, lba, n uint64) {
	v := ix.Vols[vi]
	if v.NSup == 0 {
		return
	}
	var drop []Ent
	v.Sup.AscendRange(Ent{LBA: lba}, Ent{LBA: lba + n}, func(e Ent) bool {
		drop = append(drop, e)
		return true
	})
	for _, e := range drop {
		ix.ReleaseSup(vi, e.LBA, e.Loc)
	}
}

// DropAllSup releases every superseded version of volume vi (the
// volume left epoch order).
func (ix *Index) DropAllSup(vi int) {
	ix.dropSupRange(vi, 0, math.MaxUint64-1)
}

// Unaccount releases the cache block of an entry already removed from
// (or replaced in) the tree.
func (ix *Index) Unaccount(vi int, old Ent) {
	v := ix.Vols[vi]
	loc := old.Block()
	if invariants.Enabled && ((ix.Owner != nil && ix.Owner[loc] != OwnerKey(vi, old.LBA)) || ix.Buckets[int64(loc)/ix.BPB].Live == 0) {
		invariants.AssertionFailedf("releasing cache block %d of vol %d lba %d: bucket live %d",
			loc, vi, old.LBA, ix.Buckets[int64(loc)/ix.BPB].Live)
	}
	if ix.Owner != nil {
		ix.Owner[loc] = 0
	}
	b := &ix.Buckets[int64(loc)/ix.BPB]
	b.Live--
	v.Cached--
	if old.Dirty() {
		v.Dirty--
		ix.undirty(loc)
	}
}

// Invalidate drops every entry of volume vi in [lba, lba+n).
func (ix *Index) Invalidate(vi int, lba, n uint64) {
	v := ix.Vols[vi]
	var drop []Ent
	v.Tree.AscendRange(Ent{LBA: lba}, Ent{LBA: lba + n}, func(e Ent) bool {
		drop = append(drop, e)
		return true
	})
	for _, e := range drop {
		v.Tree.Delete(e)
		ix.Unaccount(vi, e)
	}
	// Superseded versions of the range: the backing device now holds newer
	// data (or zeroes) there.
	ix.dropSupRange(vi, lba, n)
}

// MarkClean records that the version of lba at cache block loc is on
// the backing device: the live entry, if it is still at loc, becomes clean
// (and older superseded versions of lba, which can only be left over from a
// failed writeback, are dropped); a superseded version at loc is released.
func (ix *Index) MarkClean(vi int, lba uint64, loc uint32) bool {
	v := ix.Vols[vi]
	e, ok := v.Tree.Get(Ent{LBA: lba})
	if !ok || e.Block() != loc || !e.Dirty() {
		return ix.ReleaseSup(vi, lba, loc)
	}
	e.Loc &^= DirtyBit
	v.Tree.ReplaceOrInsertAgg(e, math.MaxUint64)
	ix.undirty(loc)
	v.Dirty--
	ix.dropSup(vi, lba)
	return true
}

// DropBucket removes every entry pointing into bucket bi and returns
// how many of them were dirty (callers only drop buckets without dirty data;
// a non-zero result is a bug or corruption they report). It needs the
// reverse map owner, which exists only during recovery (journal replay).
func (ix *Index) DropBucket(bi int64, onlyClean bool) (droppedDirty int) {
	for loc := bi * ix.BPB; loc < (bi+1)*ix.BPB; loc++ {
		k := ix.Owner[loc]
		if k == 0 {
			continue
		}
		vi, lba := SplitOwner(k)
		v := ix.Vols[vi]
		e, ok := v.Tree.Get(Ent{LBA: lba})
		if !ok || int64(e.Block()) != loc {
			// A superseded version (dirty), or an inconsistency Check
			// reports.
			if !onlyClean && ix.ReleaseSup(vi, lba, uint32(loc)) {
				droppedDirty++
			}
			continue
		}
		if e.Dirty() {
			if onlyClean {
				continue
			}
			droppedDirty++
		}
		v.Tree.Delete(e)
		ix.Unaccount(vi, e)
	}
	return droppedDirty
}

// Check verifies invariants 10 to 15 and returns the first violation
// found (the engine adds its bucket lists). With exact false (Open, on a
// large index) it verifies everything exact does, two things by
// fingerprint instead of by lookup:
//
//   - verified exactly either way: tree structure (order, separators, leaf
//     counts, depth); every entry in range, in order, naming a cache block
//     no other entry or superseded version names (replay's double use of
//     a block); superseded versions agreeing with the reverse map;
//     per-volume dirty/cached/superseded counts; bucket live/dirty counts
//     against the index; no live entry in a free bucket; epoch tables
//     exactly on buckets with dirty blocks; every superseded version older
//     than a dirty live entry of its LBA, with its block's epoch, and the
//     only version of its epoch; the version tree's size equal to the
//     superseded count.
//   - the reverse map (recovery only) agreeing with every entry: exact
//     compares Owner[block] per entry (a random 8-byte read each); otherwise
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
//   - exact only: the index tree's summaries (invariant 14), recomputed
//     from every dirty entry's epoch (a random read of the epoch tables
//     each). Open skips it: recovery computes them with the same code as
//     serving does (bulk load with per-leaf minima, inserts).
func (ix *Index) Check(exact bool) error {
	if ix.Owner != nil && int64(len(ix.Owner)) != ix.CacheBlocks() {
		return fmt.Errorf("reverse map has %d blocks, cache %d", len(ix.Owner), ix.CacheBlocks())
	}
	ix.initVersions()
	nb := int64(len(ix.Buckets))
	liveB := make([]uint32, nb)
	dirtyB := make([]uint32, nb)
	owned := -1
	// !exact: fingerprints of the reverse map (one sequential pass) and of
	// the (block, owner) pairs the entries say it must hold.
	var ownFP, entOwnFP uint64
	if ix.Owner != nil {
		owned = 0
		for loc, k := range ix.Owner {
			if k != 0 {
				owned++
				if !exact {
					ownFP += pairHash(uint64(loc), k)
				}
			}
		}
	}
	// named: cache blocks named by an entry so far (invariant 10).
	named := NewBitset(int(nb * ix.BPB))
	total := 0
	for vi, v := range ix.Vols {
		if err := v.Tree.Check(); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
		if exact {
			if err := v.Tree.CheckAgg(ix.EntEpoch); err != nil {
				return fmt.Errorf("volume %s: %w", v.Name, err)
			}
		}
		var nd, nc int64
		var err error
		prev := int64(-1)
		v.Tree.Ascend(func(e Ent) bool {
			loc := int64(e.Block())
			switch {
			case int64(e.LBA) <= prev:
				err = fmt.Errorf("volume %s: entries out of order at lba %d", v.Name, e.LBA)
			case e.LBA >= v.NBlocks:
				err = fmt.Errorf("volume %s: lba %d beyond volume (%d blocks)", v.Name, e.LBA, v.NBlocks)
			case loc >= nb*ix.BPB:
				err = fmt.Errorf("volume %s: lba %d points at cache block %d beyond cache", v.Name, e.LBA, loc)
			case named.Get(int(loc)):
				err = fmt.Errorf("volume %s: lba %d -> cache block %d, which another entry names", v.Name, e.LBA, loc)
			case exact && ix.Owner != nil && ix.Owner[loc] != OwnerKey(vi, e.LBA):
				ov, ol := SplitOwner(ix.Owner[loc])
				err = fmt.Errorf("volume %s: lba %d -> cache block %d owned by (vol %d, lba %d)", v.Name, e.LBA, loc, ov, ol)
			}
			if err != nil {
				return false
			}
			if !exact && ix.Owner != nil {
				entOwnFP += pairHash(uint64(loc), OwnerKey(vi, e.LBA))
			}
			named.Set(int(loc))
			prev = int64(e.LBA)
			liveB[loc/ix.BPB]++
			nc++
			if e.Dirty() {
				dirtyB[loc/ix.BPB]++
				nd++
			}
			return true
		})
		if err != nil {
			return err
		}
		if nd != v.Dirty || nc != v.Cached {
			return fmt.Errorf("volume %s: counted %d dirty/%d cached, accounted %d/%d", v.Name, nd, nc, v.Dirty, v.Cached)
		}
		total += int(nc)
		// Invariant 13: superseded versions (few: each is checked exactly).
		if err := v.Sup.Check(); err != nil {
			return fmt.Errorf("volume %s: superseded versions: %w", v.Name, err)
		}
		if exact {
			if err := v.Sup.CheckAgg(ix.SupEpoch); err != nil {
				return fmt.Errorf("volume %s: superseded versions: %w", v.Name, err)
			}
		}
		var ns int64
		v.Sup.Ascend(func(e Ent) bool {
			x := Ver{Epoch: ix.BlockEpoch(e.Loc), LBA: e.LBA, Loc: e.Loc, CRC: e.CRC}
			live, ok := v.Tree.Get(Ent{LBA: x.LBA})
			loc := int64(x.Loc)
			switch {
			case loc >= nb*ix.BPB || named.Get(int(loc)) || (ix.Owner != nil && ix.Owner[loc] != OwnerKey(vi, x.LBA)):
				err = fmt.Errorf("volume %s: superseded version %+v out of range, not owned, or its block named twice", v.Name, x)
			case !ok || !live.Dirty() || ix.BlockEpoch(live.Block()) <= x.Epoch:
				err = fmt.Errorf("volume %s: superseded version %+v without a newer dirty live entry (%+v, %t)", v.Name, x, live, ok)
			}
			if err != nil {
				return false
			}
			if y, ok := ix.Version(vi, x); !ok || y != x {
				err = fmt.Errorf("volume %s: superseded version %+v resolves to %+v (%t): two versions of one epoch", v.Name, x, y, ok)
				return false
			}
			if !exact && ix.Owner != nil {
				entOwnFP += pairHash(uint64(loc), OwnerKey(vi, x.LBA))
			}
			named.Set(int(loc))
			liveB[loc/ix.BPB]++
			dirtyB[loc/ix.BPB]++
			ns++
			return true
		})
		if err != nil {
			return err
		}
		if ns != v.NSup {
			return fmt.Errorf("volume %s: %d superseded, accounted %d", v.Name, ns, v.NSup)
		}
		if !v.Replayable && nc+ns > 0 {
			// The skipped invalidations would have dropped these.
			return fmt.Errorf("volume %s: %d entries and %d superseded versions, but marked as having nothing a recovery could replay", v.Name, nc, ns)
		}
		total += int(ns)
	}
	if owned >= 0 && total != owned {
		return fmt.Errorf("%d index entries but %d owned cache blocks", total, owned)
	}
	if owned >= 0 && !exact && ownFP != entOwnFP {
		return fmt.Errorf("the reverse map does not name exactly the entries' cache blocks (fingerprint %#x, expected %#x)", ownFP, entOwnFP)
	}
	for i := range ix.Buckets {
		b := &ix.Buckets[i]
		if b.Live != liveB[i] || b.Dirty != dirtyB[i] {
			return fmt.Errorf("bucket %d (gen %d): accounted %d live/%d dirty, index has %d/%d",
				i, b.Gen, b.Live, b.Dirty, liveB[i], dirtyB[i])
		}
		if (b.Dirty > 0) != (b.Ep != nil) {
			return fmt.Errorf("bucket %d: %d dirty blocks, epoch table %t", i, b.Dirty, b.Ep != nil)
		}
	}
	return nil
}

// pairHash mixes a pair such as a version's (epoch, LBA) into 64 bits
// (splitmix64's finalizer, applied to a and again with b), for
// Check's order-independent sums.
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

// BuildEpochTables makes the epoch table of every bucket holding the dirty
// versions dirty (per volume) and sets their epochs (recovery): each table is sized once from the bucket's oldest and newest epoch (setting
// the epochs one by one would rebase or widen tables as they come).
func (ix *Index) BuildEpochTables(dirty [][]Ver) {
	nb := len(ix.Buckets)
	lo, hi := make([]uint64, nb), make([]uint64, nb)
	for i := range lo {
		lo[i] = math.MaxUint64
	}
	for _, d := range dirty {
		for _, x := range d {
			b := int64(x.Loc) / ix.BPB
			lo[b], hi[b] = min(lo[b], x.Epoch), max(hi[b], x.Epoch)
		}
	}
	for b := range ix.Buckets {
		if lo[b] > hi[b] {
			continue
		}
		ep := newBucketEpochs(ix.BPB, lo[b])
		ep.snap = ix.epochSnap
		for ep.e64 == nil && hi[b]-lo[b] > ep.limit() {
			ep.widen()
		}
		ix.Buckets[b].Ep = ep
	}
	for _, d := range dirty {
		for _, x := range d {
			ix.Buckets[int64(x.Loc)/ix.BPB].Ep.set(int64(x.Loc)%ix.BPB, x.Epoch)
		}
	}
}
