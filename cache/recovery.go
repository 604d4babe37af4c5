package cache

// Open and recovery: the newest valid checkpoint plus the journal after it
// rebuild the index (docs/CACHE.md, "Recovery").
//
// The journal is read and decoded in full first (ondisk.ReplayJournal's
// reader goroutine), and every record is turned into per-block items keyed
// by (volume, LBA) in journal order (collector). The items are sorted by
// that key with a stable radix sort, so each LBA's records come together in
// journal order; each LBA's final state is then resolved from its
// checkpoint entry and superseded versions plus its records (resolver),
// walking the checkpoint's sorted entries and the sorted items together,
// and the trees are bulk-loaded once into nearly full leaves (install).
//
// The resolution gives the index that applying the records one by one in
// journal order gives (index.Index.Insert, MarkClean, Invalidate,
// DropBucket); that record-by-record replay is the resolver's test oracle
// (replay_oracle_test.go: applyLocked). Records of different LBAs
// interact only through cache blocks and buckets:
//
//   - a reuse record drops every version in its bucket: per bucket, the
//     reuse records' places in the journal are kept, and a version created
//     before a reuse of its bucket is dropped at that reuse;
//   - the generation an insert names must be its bucket's at that point
//     of the journal: checked while collecting, in journal order (against
//     the checkpoint's generations once the checkpoint is decoded);
//   - an insert into a cache block some version still names is corruption.
//     Blocks are handed out once per bucket generation, so while
//     collecting, a block inserted twice with no reuse of its bucket
//     between is an anomaly, and so is (while resolving) an insert before
//     any reuse of its bucket into a block a checkpoint version names,
//     whether or not that version was dropped before the insert. A version
//     alive at an insert into its block would be one of these two.
//
// Anything the record-by-record replay would reject, and anything a serving set never
// journals (a reuse of a bucket holding dirty data, superseded versions
// left without a newer dirty entry), is an anomaly:
// recovery then fails with a corruption error. Journal blocks pass their
// checksums before their records are collected, so an anomaly is metadata
// written wrong, not a torn write.

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"math"
	"math/bits"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/backoff"
	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// jrecs is the journal as read for recovery: its end, record count and
// head record, and the journal's own error.
type jrecs struct {
	n    int // records
	end  ondisk.JournalPos
	head ondisk.JournalHead // the journal head record
	err  error              // read error or corruption that ended the log
}

// Item kinds.
const (
	itemInsert = iota
	itemClean
	itemInval
)

// replayItem is one block's part of a record: an insert of one block, a
// clean, or one block of a small invalidation.
type replayItem struct {
	key   uint64 // itemKey(volume, LBA)
	epoch uint64 // insert
	seq   uint32 // place in the journal (1, 2, ...; 0 is the checkpoint)
	loc   uint32 // insert, clean: cache block
	crc   uint32 // insert
	kind  uint8
	dirty bool // insert
}

// itemKey orders by (volume, LBA) in one compare (LBA < 2^40).
func itemKey(vol int, lba uint64) uint64 { return uint64(vol)<<40 | lba }

func (it *replayItem) lba() uint64 { return it.key & (index.MaxLBA - 1) }

// bigInval is an invalidation of more than maxInvalItems blocks, kept as a
// range instead of per-block items.
type bigInval struct {
	lo, hi uint64
	seq    uint32
}

const maxInvalItems = 256

type reuseEv struct{ seq, gen uint32 }

// collector turns records into items in journal order (see the top of the
// file). It needs only the superblock's layout, not the checkpoint.
type collector struct {
	nblocks  []uint64 // per volume
	bpb      int64
	total    uint64 // cache blocks
	items    []replayItem
	big      [][]bigInval // per volume
	reuses   [][]reuseEv  // per bucket, in journal order
	gen0     []uint32     // per bucket: generation inserts before its first reuse name
	has0     index.Bitset // gen0 is set
	insWin   []uint32     // per cache block: 1 + reuses of its bucket at its last insert; 0: none
	firstWin []uint32     // per cache block: seq of its insert before any reuse of its bucket
	anyFirst bool
	volEpoch []uint64          // per volume: highest insert epoch
	marked   []map[uint64]bool // per volume: regions marked at the journal's end (RecMark, RecUnmark)
	seq      uint32
	anomaly  string
	tooLong  bool // more block records than seq counts: not corruption
}

func newCollector(s *Set, nbuckets int64) *collector {
	c := &collector{bpb: s.bpb, total: uint64(nbuckets * s.bpb)}
	for _, v := range s.vols {
		c.nblocks = append(c.nblocks, v.nblocks)
	}
	c.big = make([][]bigInval, len(s.vols))
	c.reuses = make([][]reuseEv, nbuckets)
	c.gen0 = make([]uint32, nbuckets)
	c.has0 = index.NewBitset(int(nbuckets))
	c.insWin = make([]uint32, c.total)
	c.firstWin = make([]uint32, c.total)
	c.volEpoch = make([]uint64, len(s.vols))
	c.marked = make([]map[uint64]bool, len(s.vols))
	return c
}

func (c *collector) fail(format string, args ...any) {
	if c.anomaly == "" {
		c.anomaly = fmt.Sprintf(format, args...)
	}
}

func (c *collector) next() uint32 {
	if c.seq == math.MaxUint32-1 {
		c.tooLong = true
		c.fail("journal too long")
		return c.seq
	}
	c.seq++
	return c.seq
}

// add collects r, the next record in journal order.
func (c *collector) add(r *ondisk.Rec) {
	if c.anomaly != "" {
		return
	}
	if r.Type != ondisk.RecReuse && int(r.Vol) >= len(c.nblocks) {
		c.fail("record of volume %d", r.Vol)
		return
	}
	switch r.Type {
	case ondisk.RecInsert:
		n := uint64(len(r.CRCs))
		loc := uint64(r.Loc)
		nb := c.nblocks[r.Vol]
		bpb := uint64(c.bpb)
		if n == 0 || r.LBA+n > nb || r.LBA+n < r.LBA || r.LBA+n > index.MaxLBA || loc+n > c.total || loc/bpb != (loc+n-1)/bpb {
			c.fail("insert out of range: %v", r)
			return
		}
		b := loc / bpb
		w := uint32(len(c.reuses[b]))
		switch {
		case w > 0 && c.reuses[b][w-1].gen != r.Gen:
			c.fail("insert into bucket %d generation %d", b, r.Gen)
			return
		case w == 0 && c.has0.Get(int(b)) && c.gen0[b] != r.Gen:
			c.fail("inserts into bucket %d generations %d and %d", b, c.gen0[b], r.Gen)
			return
		case w == 0:
			c.gen0[b] = r.Gen
			c.has0.Set(int(b))
		}
		for i := uint64(0); i < n; i++ {
			l := loc + i
			if c.insWin[l] == w+1 {
				c.fail("cache block %d inserted twice in one generation", l)
				return
			}
			c.insWin[l] = w + 1
			t := c.next()
			if w == 0 {
				c.firstWin[l] = t
				c.anyFirst = true
			}
			c.items = append(c.items, replayItem{key: itemKey(int(r.Vol), r.LBA+i), epoch: r.Epoch, seq: t,
				loc: uint32(l), crc: r.CRCs[i], kind: itemInsert, dirty: r.Dirty})
		}
		c.volEpoch[r.Vol] = max(c.volEpoch[r.Vol], r.Epoch)
	case ondisk.RecClean:
		if uint64(r.Loc) >= c.total {
			c.fail("clean out of range: %v", r)
			return
		}
		t := c.next()
		// No entry or version lies at or beyond the volume's end.
		if r.LBA < c.nblocks[r.Vol] {
			c.items = append(c.items, replayItem{key: itemKey(int(r.Vol), r.LBA), seq: t, loc: r.Loc, kind: itemClean})
		}
	case ondisk.RecInvalidate:
		n := min(r.N, 1<<48)
		if r.LBA+n < r.LBA {
			c.fail("invalidation wraps: %v", r)
			return
		}
		t := c.next()
		lo, hi := r.LBA, min(r.LBA+n, c.nblocks[r.Vol])
		switch {
		case lo >= hi:
		case hi-lo <= maxInvalItems:
			for x := lo; x < hi; x++ {
				c.items = append(c.items, replayItem{key: itemKey(int(r.Vol), x), seq: t, kind: itemInval})
			}
		default:
			c.big[r.Vol] = append(c.big[r.Vol], bigInval{lo: lo, hi: hi, seq: t})
		}
	case ondisk.RecReuse:
		if uint64(r.Bucket) >= uint64(len(c.reuses)) {
			c.fail("reuse of bucket %d", r.Bucket)
			return
		}
		t := c.next()
		c.reuses[r.Bucket] = append(c.reuses[r.Bucket], reuseEv{seq: t, gen: r.Gen})
	case ondisk.RecMark, ondisk.RecUnmark:
		// Regions are checked against no volume size: a mark names
		// where backing writes may go, and one beyond the end marks
		// nothing.
		if c.marked[r.Vol] == nil {
			c.marked[r.Vol] = map[uint64]bool{}
		}
		if r.Type == ondisk.RecMark {
			c.marked[r.Vol][r.Region] = true
		} else {
			delete(c.marked[r.Vol], r.Region)
		}
	default:
		c.fail("record type %d", r.Type)
	}
}

// radixSort sorts a stably by key(&a[i]) and returns the sorted slice
// (a or buf). Only the bits that differ between keys are sorted on, in
// at most 11-bit digits.
func radixSort[T any](a, buf []T, key func(*T) uint64) []T {
	if len(a) < 2 {
		return a
	}
	or, and := uint64(0), ^uint64(0)
	for i := range a {
		k := key(&a[i])
		or |= k
		and &= k
	}
	diff := or ^ and
	if diff == 0 {
		return a
	}
	lo := bits.TrailingZeros64(diff)
	nbits := 64 - bits.LeadingZeros64(diff) - lo
	passes := (nbits + 10) / 11
	width := (nbits + passes - 1) / passes
	buf = buf[:len(a)]
	count := make([]int, 1<<width)
	mask := uint64(1)<<width - 1
	for p := 0; p < passes; p++ {
		shift := lo + p*width
		clear(count)
		for i := range a {
			count[(key(&a[i])>>shift)&mask]++
		}
		sum := 0
		for d, n := range count {
			count[d] = sum
			sum += n
		}
		for i := range a {
			d := (key(&a[i]) >> shift) & mask
			buf[count[d]] = a[i]
			count[d]++
		}
		a, buf = buf, a
	}
	return a
}

// rver is a version of one LBA during resolution.
type rver struct {
	loc, crc uint32
	c        uint32 // seq of the insert that made it; 0: the checkpoint
	dirty    bool
	epoch    uint64
}

const seqEnd = math.MaxUint32 // after the journal

// resolvedVol is one volume's recovered index, as sorted arrays.
type resolvedVol struct {
	ents   []index.Ent // live entries, by LBA
	aggs   []uint64    // per leaf of leafBulkFill entries: the oldest dirty epoch (the tree's summary)
	dirty  []index.Ver // every dirty version, live and superseded: its block's epoch
	vers   []index.Ver // superseded versions, by LBA
	nsup   int64
	ndirty int64
	epoch  uint64
	// suspects: clean entries of marked regions (cleanKeepUnmarked), by
	// LBA, left out of ents; verifyClean may put them back.
	suspects []index.Ent
}

// cleanPolicy is what recovery does with clean entries.
type cleanPolicy uint8

const (
	// cleanDrop: an unclean shutdown without region marks (or with clean
	// entries untrusted): drop every clean entry.
	cleanDrop cleanPolicy = iota
	// cleanKeepUnmarked: an unclean shutdown with region marks: drop the
	// clean entries of the regions marked at the journal's end.
	cleanKeepUnmarked
	// cleanKeep: a clean shutdown, or read-only inspection.
	cleanKeep
)

// recoveryPolicy is the clean policy for a set with superblock sb.
func recoveryPolicy(sb *Superblock) cleanPolicy {
	switch {
	case sb.Clean:
		return cleanKeep
	case !sb.CleanUntrusted:
		return cleanKeepUnmarked
	}
	return cleanDrop
}

// resolver resolves each LBA's final state (see the top of the file).
type resolver struct {
	c        *collector
	cd       *ondisk.CkptData
	clean    cleanPolicy
	shift    uint8           // mark region shift
	marked   map[uint64]bool // the volume at hand's marked regions
	keepSup  []bool
	anyReuse bool
	anomaly  string
	dropped  int
	// The LBA at hand.
	live    rver
	hasLive bool
	sups    []rver
}

func (r *resolver) fail(format string, args ...any) {
	if r.anomaly == "" {
		r.anomaly = fmt.Sprintf(format, args...)
	}
}

// firstReuse returns the seq of the first reuse of loc's bucket in (c, t),
// or 0.
func (r *resolver) firstReuse(loc, c, t uint32) uint32 {
	for _, x := range r.c.reuses[int64(loc)/r.c.bpb] {
		if x.seq > c {
			if x.seq < t {
				return x.seq
			}
			return 0
		}
	}
	return 0
}

// ckptVersion checks a version of the checkpoint at cache block loc: an
// insert into its block before any reuse of the bucket hands the block out
// twice in one generation (see the top of the file).
func (r *resolver) ckptVersion(loc uint32) {
	if r.c.anyFirst && r.c.firstWin[loc] != 0 {
		r.fail("insert into cache block %d of a checkpoint entry", loc)
	}
}

// kill drops the versions whose bucket was reused before seq t.
func (r *resolver) kill(t uint32) {
	if !r.anyReuse {
		return
	}
	if r.hasLive {
		if d := r.firstReuse(r.live.loc, r.live.c, t); d != 0 {
			if r.live.dirty {
				r.fail("reuse drops dirty cache block %d", r.live.loc)
			}
			r.hasLive = false
		}
	}
	// A superseded version the serving set dropped without a record (it
	// left epoch order after the checkpoint) is dropped here by its
	// bucket's reuse.
	r.sups = slices.DeleteFunc(r.sups, func(x rver) bool { return r.firstReuse(x.loc, x.c, t) != 0 })
}

func (r *resolver) dropSups() { r.sups = r.sups[:0] }

// insert is index.Index.Insert.
func (r *resolver) insert(vi int, it *replayItem) {
	t := it.seq
	r.kill(t)
	if r.hasLive {
		if it.dirty && r.live.dirty && r.live.epoch < it.epoch && r.keepSup[vi] {
			r.sups = append(r.sups, r.live)
		}
	}
	if !it.dirty {
		r.dropSups()
	}
	r.live = rver{loc: it.loc, crc: it.crc, c: t, dirty: it.dirty, epoch: it.epoch}
	r.hasLive = true
}

// markClean is MarkClean.
func (r *resolver) markClean(t, loc uint32) {
	r.kill(t)
	if r.hasLive && r.live.loc == loc && r.live.dirty {
		r.live.dirty = false
		r.dropSups()
		return
	}
	for i := range r.sups {
		if r.sups[i].loc == loc {
			r.sups = append(r.sups[:i], r.sups[i+1:]...)
			return
		}
	}
}

// inval is Invalidate for one LBA.
func (r *resolver) inval(t uint32) {
	r.kill(t)
	r.hasLive = false
	r.dropSups()
}

// finish ends the LBA at hand and appends what survives to out.
func (r *resolver) finish(lba uint64, out *resolvedVol) {
	r.kill(seqEnd)
	if len(r.sups) > 0 {
		// Invariant 13, which replay keeps for a consistent journal; the
		// record-by-record replay decides (and Open's check reports)
		// otherwise.
		prev := uint64(0)
		for i, x := range r.sups {
			if (i > 0 && x.epoch <= prev) || !r.hasLive || !r.live.dirty || x.epoch >= r.live.epoch {
				r.fail("superseded versions of lba %d out of order", lba)
				return
			}
			prev = x.epoch
		}
		l := make([]index.Ver, len(r.sups))
		for i, x := range r.sups {
			l[i] = index.Ver{Epoch: x.epoch, LBA: lba, Loc: x.loc, CRC: x.crc}
			out.vers = append(out.vers, l[i])
			out.dirty = append(out.dirty, l[i])
		}
		out.nsup += int64(len(l))
	}
	if !r.hasLive {
		return
	}
	if !r.live.dirty && (r.clean == cleanDrop || r.clean == cleanKeepUnmarked && r.marked[lba>>r.shift]) {
		// dropCleanLocked: a clean entry may be stale after a crash.
		r.dropped++
		if r.clean == cleanKeepUnmarked {
			out.suspects = append(out.suspects, index.Ent{LBA: lba, Loc: r.live.loc, CRC: r.live.crc})
		}
		return
	}
	loc := r.live.loc
	if k := len(out.ents) / index.LeafBulkFill; k == len(out.aggs) {
		out.aggs = append(out.aggs, math.MaxUint64)
	}
	if r.live.dirty {
		loc |= index.DirtyBit
		out.dirty = append(out.dirty, index.Ver{Epoch: r.live.epoch, LBA: lba, Loc: r.live.loc})
		out.ndirty++
		k := len(out.ents) / index.LeafBulkFill
		out.aggs[k] = min(out.aggs[k], r.live.epoch)
	}
	out.ents = append(out.ents, index.Ent{LBA: lba, Loc: loc, CRC: r.live.crc})
}

// volume resolves volume vi from its checkpoint part cv (nil: none), its
// items (sorted) and big invalidations.
func (r *resolver) volume(vi int, cv *ondisk.CkptVol, items []replayItem, big []bigInval) resolvedVol {
	var out resolvedVol
	var ents []index.Ent
	var epochOf []uint64
	var supBy map[uint64][]index.Ver
	if cv != nil {
		ents, epochOf = cv.Ents, cv.EpochOf
		out.epoch = cv.Epoch
		for _, x := range cv.Sup {
			if supBy == nil {
				supBy = map[uint64][]index.Ver{}
			}
			supBy[x.LBA] = append(supBy[x.LBA], x)
		}
	}
	out.epoch = max(out.epoch, r.c.volEpoch[vi])
	out.ents = make([]index.Ent, 0, len(ents)+len(items))
	out.dirty = make([]index.Ver, 0, len(ents)+len(items))
	slices.SortFunc(big, func(a, b bigInval) int {
		if c := cmp.Compare(a.lo, b.lo); c != 0 {
			return c
		}
		return cmp.Compare(a.seq, b.seq)
	})
	var active []bigInval // big invalidations with lo <= the LBA at hand
	var cover []uint32    // their seqs covering it, in journal order
	bi := 0
	ci, ii := 0, 0
	for ci < len(ents) || ii < len(items) {
		var x uint64
		if ci < len(ents) && (ii >= len(items) || ents[ci].LBA <= items[ii].lba()) {
			x = ents[ci].LBA
		} else {
			x = items[ii].lba()
		}
		r.hasLive = false
		r.sups = r.sups[:0]
		if ci < len(ents) && ents[ci].LBA == x {
			e := ents[ci]
			ci++
			r.ckptVersion(e.Block())
			r.live = rver{loc: e.Block(), crc: e.CRC, dirty: e.Dirty()}
			if r.live.dirty {
				r.live.epoch = epochOf[e.Block()]
			}
			r.hasLive = true
			for _, y := range supBy[x] {
				r.ckptVersion(y.Loc)
				r.sups = append(r.sups, rver{loc: y.Loc, crc: y.CRC, dirty: true, epoch: y.Epoch})
			}
		}
		cover = cover[:0]
		if bi < len(big) || len(active) > 0 {
			for bi < len(big) && big[bi].lo <= x {
				active = append(active, big[bi])
				bi++
			}
			active = slices.DeleteFunc(active, func(b bigInval) bool { return b.hi <= x })
			for _, b := range active {
				cover = append(cover, b.seq)
			}
			slices.Sort(cover)
		}
		k := 0
		for ; ii < len(items) && items[ii].lba() == x; ii++ {
			it := &items[ii]
			for ; k < len(cover) && cover[k] < it.seq; k++ {
				r.inval(cover[k])
			}
			switch it.kind {
			case itemInsert:
				r.insert(vi, it)
			case itemClean:
				r.markClean(it.seq, it.loc)
			case itemInval:
				r.inval(it.seq)
			}
		}
		for ; k < len(cover); k++ {
			r.inval(cover[k])
		}
		r.finish(x, &out)
		if r.anomaly != "" {
			return out
		}
	}
	slices.SortFunc(out.vers, index.CmpVer)
	return out
}

// resolve runs the resolver over every volume. It does not touch s.
func (s *Set) resolve(c *collector, cd *ondisk.CkptData, clean cleanPolicy) (*resolver, []resolvedVol) {
	r := &resolver{c: c, cd: cd, clean: clean, shift: s.wm.shift, anomaly: c.anomaly}
	if r.anomaly != "" {
		return r, nil
	}
	for b := range c.gen0 {
		if c.has0.Get(b) && cd.Gens[b] != c.gen0[b] {
			r.fail("insert into bucket %d generation %d, bucket is at %d", b, c.gen0[b], cd.Gens[b])
			return r, nil
		}
	}
	for _, l := range c.reuses {
		r.anyReuse = r.anyReuse || len(l) > 0
	}
	for vi := range s.vols {
		r.keepSup = append(r.keepSup, s.keepSuperseded(vi))
	}
	items := radixSort(c.items, make([]replayItem, len(c.items)), func(it *replayItem) uint64 { return it.key })
	c.items = nil
	out := make([]resolvedVol, len(s.vols))
	for vi := range s.vols {
		lo, _ := slices.BinarySearchFunc(items, itemKey(vi, 0), func(it replayItem, k uint64) int { return cmp.Compare(it.key, k) })
		hi, _ := slices.BinarySearchFunc(items, itemKey(vi+1, 0), func(it replayItem, k uint64) int { return cmp.Compare(it.key, k) })
		var cv *ondisk.CkptVol
		if vi < len(cd.Vols) {
			cv = &cd.Vols[vi]
		}
		r.marked = c.marked[vi]
		out[vi] = r.volume(vi, cv, items[lo:hi], c.big[vi])
		if r.anomaly != "" {
			return r, nil
		}
	}
	return r, out
}

// resetIndexLocked sets up an empty index for recovery from a checkpoint
// with bucket generations gens.
// REQUIRES: exclusive access (Open)
func (s *Set) resetIndexLocked(nbuckets int64, gens []uint32) {
	s.mu.Buckets = make([]index.Bucket, nbuckets)
	s.mu.alloc = make([]bucketAlloc, nbuckets)
	s.mu.Owner = make([]uint64, nbuckets*s.bpb)
	s.mu.open = -1
	for i, g := range gens {
		s.mu.Buckets[i].Gen = g
	}
	for _, v := range s.vols {
		v.idx.Tree, v.idx.Sup = index.NewPtree(), index.NewStree()
		v.idx.NSup, v.idx.Dirty, v.idx.Cached, v.idx.epoch = 0, 0, 0, 0
	}
}

// install builds the index from resolved volumes: trees bulk-loaded,
// bucket generations, counts and epochs, and the reverse map.
// REQUIRES: exclusive access (Open), after resetIndexLocked
func (s *Set) install(c *collector, out []resolvedVol) {
	for b, l := range c.reuses {
		if len(l) > 0 {
			s.mu.Buckets[b].Gen = l[len(l)-1].gen
		}
	}
	for vi, rv := range out {
		v := s.vols[vi]
		v.idx.Tree = index.BuildPtree(rv.ents, rv.aggs)
		// Superseded versions are normally few: inserted one by one,
		// each with its epoch as its summary.
		v.idx.Sup = index.NewStree()
		for _, x := range rv.vers {
			v.idx.Sup.ReplaceOrInsertAgg(index.Ent{LBA: x.LBA, Loc: x.Loc, CRC: x.CRC}, x.Epoch)
		}
		v.idx.NSup = rv.nsup
		v.idx.Cached = int64(len(rv.ents))
		v.idx.Dirty = rv.ndirty
		v.idx.epoch = rv.epoch
		for _, e := range rv.ents {
			loc := e.Block()
			s.mu.Owner[loc] = index.OwnerKey(vi, e.LBA)
			s.mu.Buckets[int64(loc)/s.bpb].Live++
		}
		for _, x := range rv.vers {
			s.mu.Owner[x.Loc] = index.OwnerKey(vi, x.LBA)
			s.mu.Buckets[int64(x.Loc)/s.bpb].Live++
		}
		for _, x := range rv.dirty {
			s.mu.Buckets[int64(x.Loc)/s.bpb].Dirty++
		}
	}
	dirty := make([][]index.Ver, len(out))
	for vi := range out {
		dirty[vi] = out[vi].dirty
	}
	s.mu.BuildEpochTables(dirty)
}

// readJournal reads the journal after checkpoint h, handing each record to
// c in journal order (and to onRec first, if not nil).
func readJournal(dev device.Device, sb *Superblock, h ondisk.CkptHeader, c *collector, onRec func(*ondisk.Rec)) *jrecs {
	jr := &jrecs{}
	jr.end, jr.n, jr.head, jr.err = ondisk.ReplayJournal(dev, sb, h.Gen, h.JPos, func(r *ondisk.Rec) error {
		if onRec != nil {
			onRec(r)
		}
		c.add(r)
		return nil
	})
	return jr
}

// recoverIndex rebuilds the index from the checkpoint cd and the journal
// records c collected (see the top of the file), dropping clean entries
// as clean says. With verify, the clean entries of marked regions that the
// backing device shows current are kept (verifyClean). It returns how many
// clean entries it dropped and how many of the marked regions' it kept.
// REQUIRES: exclusive access (Open)
func (s *Set) recoverIndex(nbuckets int64, cd *ondisk.CkptData, c *collector, clean cleanPolicy, verify bool) (dropped, verified int, err error) {
	s.resetIndexLocked(nbuckets, cd.Gens)
	r, out := s.resolve(c, cd, clean)
	switch {
	case c.tooLong:
		return 0, 0, fmt.Errorf("journal too long to recover: more than %d block records", uint32(math.MaxUint32-1))
	case r.anomaly != "":
		return 0, 0, ondisk.Badf("journal records", "%s", r.anomaly)
	}
	if verify {
		for vi := range out {
			verified += s.verifyClean(vi, &out[vi])
		}
	}
	s.install(c, out)
	return r.dropped - verified, verified, nil
}

// verifyClean puts back into rv the suspect clean entries (those of
// regions marked at the journal's end) whose cached block equals the
// backing device's block now: a marked region's backing writes may have
// made some of its clean entries stale, and comparing tells which. Blocks
// are compared byte for byte (the backing block's checksum first, to skip
// the cache read of a stale one). An entry whose either read fails stays
// out. It returns how many it kept, and marks the backing device for a
// sync before the next checkpoint: what was read may still be in a page
// cache, and the checkpoint must not call it clean before it is durable.
// REQUIRES: exclusive access (Open), before install
func (s *Set) verifyClean(vi int, rv *resolvedVol) int {
	if len(rv.suspects) == 0 {
		return 0
	}
	v := s.vols[vi]
	const run = 256 // blocks read from the backing device at once
	back := make([]byte, run*blockSize)
	cblk := make([]byte, blockSize)
	var keep []index.Ent
	sus := rv.suspects
	for i := 0; i < len(sus); {
		j := i + 1
		for j < len(sus) && j-i < run && sus[j].LBA == sus[j-1].LBA+1 {
			j++
		}
		p := back[:(j-i)*blockSize]
		if err := v.readBacking(p, sus[i].LBA); err != nil {
			s.log.Warn("recovery: reading the backing device to verify clean cached blocks failed; they are dropped",
				"volume", v.name, "lba", sus[i].LBA, "blocks", j-i, "err", err)
			i = j
			continue
		}
		for k := i; k < j; k++ {
			b := p[(k-i)*blockSize : (k-i+1)*blockSize]
			if ondisk.CRC32C(b) != sus[k].CRC {
				continue // stale (or a torn backing write): dropped
			}
			if _, err := s.dev.ReadAt(cblk, s.cacheOff(sus[k].Loc)); err != nil {
				s.log.Warn("recovery: reading a clean cached block to verify it failed; it is dropped",
					"volume", v.name, "lba", sus[k].LBA, "cache_offset", s.cacheOff(sus[k].Loc), "err", err)
				continue
			}
			if !bytes.Equal(cblk, b) {
				continue
			}
			keep = append(keep, sus[k])
		}
		i = j
	}
	rv.suspects = nil
	if len(keep) == 0 {
		return 0
	}
	// Merge into the live entries (both by LBA; an LBA is in one or the
	// other) and recompute the per-leaf summaries.
	ents := make([]index.Ent, 0, len(rv.ents)+len(keep))
	a, b := rv.ents, keep
	for len(a) > 0 || len(b) > 0 {
		if len(b) == 0 || len(a) > 0 && a[0].LBA < b[0].LBA {
			ents, a = append(ents, a[0]), a[1:]
		} else {
			ents, b = append(ents, b[0]), b[1:]
		}
	}
	epochOf := map[uint32]uint64{}
	for _, x := range rv.dirty {
		epochOf[x.Loc] = x.Epoch
	}
	aggs := make([]uint64, (len(ents)+index.LeafBulkFill-1)/index.LeafBulkFill)
	for k := range aggs {
		aggs[k] = math.MaxUint64
	}
	for i, e := range ents {
		if e.Dirty() {
			aggs[i/index.LeafBulkFill] = min(aggs[i/index.LeafBulkFill], epochOf[e.Block()])
		}
	}
	rv.ents, rv.aggs = ents, aggs
	v.backingUnsynced.Store(true)
	return len(keep)
}

// OpenOptions configure Open.
type OpenOptions struct {
	// Force accepts a backing device whose ID differs from the one recorded
	// at Format (e.g. after the ID was regenerated), or has none. A size
	// mismatch is always refused: the index would address blocks beyond
	// the device.
	Force bool
	// AcceptJournalLoss recovers from what is left when acknowledged
	// metadata is damaged (a *JournalLossError): the writes the damaged
	// journal blocks or checkpoint recorded are undone, and logged as such.
	// Without it Open refuses.
	AcceptJournalLoss bool
	// ColdClean drops every clean entry in recovery, as after a crash of
	// a set without region marks. For a restart on a cache device that
	// failed over and could not record it (the log of that failover says
	// so): writes that went around it may have made its clean data stale.
	ColdClean bool
	// Mirror is the second cache device of a mirrored set (the first is
	// Open's cacheDev, which may then be nil when missing). A mirrored
	// set refuses to open without both unless one is marked failed in the
	// other's label, or MirrorMissing accepts a missing one.
	Mirror        device.Device
	MirrorMissing bool
	Logger        *slog.Logger
	testing       testingKnobs // tests only
}

// Open recovers a cache set: newest valid checkpoint plus journal replay.
// Then it writes a fresh checkpoint (so leftovers of a torn journal tail can
// never be replayed later), clears the clean flag and starts the background
// writeback/eviction and commit goroutines.
func Open(cacheDev device.Device, backings []BackingSpec, opts OpenOptions) (*Set, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var mir *mirror.Mirror
	var sb *Superblock
	var err error
	var label mirror.Label
	var labelled bool
	if cacheDev != nil && opts.Mirror == nil && cacheDev.Size() >= 2*ondisk.SBCopySize {
		if label, labelled, err = memberLabel(cacheDev); err != nil {
			return nil, fmt.Errorf("open: %w", err)
		}
	}
	switch {
	case opts.Mirror != nil || cacheDev == nil:
		mir, sb, err = mirror.Open(cacheDev, opts.Mirror, opts.MirrorMissing, log)
	case labelled:
		// One member of a mirrored set alone (mirror.Open checks the
		// superblock says so). It may be stale: its label must say the
		// other failed, or MirrorMissing accept it.
		a, b := cacheDev, device.Device(nil)
		if label.Role == mirror.B {
			a, b = nil, cacheDev
		}
		mir, sb, err = mirror.Open(a, b, opts.MirrorMissing, log)
	default:
		sb, _, err = ondisk.ReadSuperblock(cacheDev)
		if err == nil && sb.HasFeature(ondisk.FeatureMirror) {
			err = fmt.Errorf("open: %w: a mirrored set's member without a mirror label", ErrInvalid)
		}
	}
	if err != nil {
		return nil, err
	}
	if mir != nil {
		cacheDev = mir
	}
	byName := map[string]BackingSpec{}
	for _, b := range backings {
		byName[b.Name] = b
	}
	s := newSet(cacheDev, sb, log)
	if mir != nil {
		s.mirp.Store(mir)
	}
	s.mirrorWatch()
	if err := s.loadLostWrites(); err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	s.knobs = opts.testing
	s.noSpace = backoff.New(log, "cache device writes (ENOSPC: the file system under the cache is full; writing around the cache)")
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
		if bi.ID != "" && bi.ID != spec.ID && !opts.Force {
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
	type decoded struct {
		cd  *ondisk.CkptData
		err error
	}
	dch := make(chan decoded, 1)
	var hdr ondisk.CkptHeader
	var pr *pages.SetRoot
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		// The root, its inner pages and bucket table (pagedckpt.go);
		// the leaves once the journal is read: all of them, or for a
		// lazy Open those of the superseded versions (lazyleaves.go).
		// Through the set's device: the pages written later must reach
		// a mirror attached since (attach-mirror swaps that device).
		if pr, err = pages.OpenSet(s.dev, sb); err != nil {
			return nil, fmt.Errorf("open: %w", err)
		}
		hdr = pr.Hdr
		if pr.Warn != "" {
			log.Warn("recovering without the previous index root", "why", pr.Warn)
		}
	} else {
		var body []byte
		var warn string
		hdr, body, warn, err = ondisk.ReadCheckpointBody(cacheDev, sb)
		if err != nil {
			return nil, fmt.Errorf("open: %w", err)
		}
		if warn != "" {
			log.Warn("recovering from an older checkpoint", "why", warn)
		}
		// The checkpoint body is verified and decoded on another core
		// while the journal is read, decoded and collected. The device
		// sees the reads in the same order as a sequential recovery
		// would do them.
		go func() {
			cd, err := ondisk.DecodeCheckpoint(sb, hdr, body, volBlocks)
			dch <- decoded{cd, err}
		}()
	}
	c := newCollector(s, sb.NBuckets)
	jr := readJournal(cacheDev, sb, hdr, c, nil)
	policy := recoveryPolicy(sb)
	if opts.ColdClean && policy != cleanKeep {
		policy = cleanDrop
	}
	if mir != nil && mir.Primary() == mirror.B && policy != cleanKeep {
		// B holds no copy of most clean data: verifying it would read
		// the backing device for nothing.
		policy = cleanDrop
	}
	lazy := jr.err == nil && lazyEligible(pr, jr.n, policy, mir != nil, opts.testing)
	if pr != nil {
		cd, sups, err := pr.ReadCheckpoint(sb, volBlocks, lazy)
		if err == nil {
			s.pg = newPagedIndex(pr.Store, sups)
		}
		dch <- decoded{cd, err}
	}
	d := <-dch
	if d.err != nil {
		if jr.err != nil {
			// Both: a journal block and a checkpoint or leaf page that
			// could not be read.
			return nil, fmt.Errorf("open: %w", errors.Join(d.err, fmt.Errorf("replaying journal: %w", jr.err)))
		}
		return nil, fmt.Errorf("open: %w", d.err)
	}
	if IsJournalLoss(jr.err) && opts.AcceptJournalLoss {
		log.Error("recovering without acknowledged metadata (accepted by the operator): the writes it recorded are undone", "err", jr.err)
		jr.err = nil
	}
	s.jr.headN = jr.head.N
	loaded := time.Now()
	if jr.err != nil {
		return nil, fmt.Errorf("open: replaying journal: %w", jr.err)
	}
	var dropped, verified int
	if lazy {
		err = s.openLazyLocked(pr, d.cd)
	} else {
		dropped, verified, err = s.recoverIndex(sb.NBuckets, d.cd, c, policy, true)
	}
	if err != nil {
		return nil, fmt.Errorf("open: replaying journal: %w", err)
	}
	end, nrec := jr.end, jr.n
	s.dropUnkeptSupLocked()
	s.listBucketsLocked()
	if lazy {
		// Checking the index would load every leaf: the lists only (the
		// leaves are checked as they load, and by `check`).
		err = s.checkListsLocked()
	} else {
		err = s.checkIndexLocked(invariants.Enabled)
	}
	if err != nil {
		return nil, fmt.Errorf("open: recovered index inconsistent: %w", err)
	}
	// The reverse map served the replay; serving does without it.
	s.mu.Owner = nil
	if mir != nil {
		if err := s.mirrorLoadLocked(); err != nil {
			return nil, fmt.Errorf("open: %w", err)
		}
	}
	// New generation: the next journal block follows the replayed end, so
	// any torn leftovers of the old generation are foreign from now on.
	s.jr.gen, s.jr.pos = hdr.Gen, ondisk.JournalPos{Blk: end.Blk}
	if mir != nil {
		n, err := s.mirrorResync(!sb.Clean)
		if err != nil {
			return nil, fmt.Errorf("open: resyncing the mirror: %w", err)
		}
		if n > 0 {
			log.Warn("mirror resynced after an unclean shutdown", "blocks_copied_to_B", n)
		}
	}
	replayed := time.Now()
	s.commitMu.Lock()
	if s.pg != nil {
		err = s.pagedBaseLocked(d.cd)
	}
	if err == nil {
		err = s.checkpointLocked(0)
	}
	s.commitMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	log.Info("cache set recovered", "checkpoint_gen", hdr.Gen, "journal_records", nrec, "lazy_leaves", lazy,
		"entries", s.entries(), "dropped_clean", dropped, "clean_kept", policy.String(), "clean_verified", verified, "took", time.Since(start),
		"read_checkpoint_and_journal", loaded.Sub(start), "replay_journal", replayed.Sub(loaded), "write_checkpoint", time.Since(replayed))
	s.sbMu.Lock()
	// The checkpoint just written holds no clean entry the untrusted flag
	// was about.
	err = s.updateSuperblockLocked(func(nsb *Superblock) error { nsb.Clean, nsb.CleanUntrusted = false, false; return nil })
	s.wm.untrusted = false
	s.sbMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	s.spawn(s.gcLoop)
	s.spawn(s.commitLoop)
	for _, v := range s.vols {
		if !v.free {
			s.runWriteback(v)
		}
	}
	return s, nil
}

func (p cleanPolicy) String() string {
	return [...]string{"none (unclean shutdown)", "outside marked regions (unclean shutdown)", "all (clean shutdown)"}[p]
}

// dropUnkeptSupLocked drops the recovered superseded versions of volumes
// that do not keep them: a checkpoint written in epoch order still lists
// those the volume dropped when it left epoch order (degraded, or
// writeback_order changed to lba).
// REQUIRES: exclusive access (Open)
func (s *Set) dropUnkeptSupLocked() {
	for vi := range s.vols {
		if !s.keepSuperseded(vi) {
			s.mu.DropAllSup(vi)
		}
	}
}

// listBucketsLocked puts the recovered buckets on the sealed FIFO (those
// holding entries) or the free list.
// REQUIRES: exclusive access (Open)
func (s *Set) listBucketsLocked() {
	for i := range s.mu.Buckets {
		if s.mu.Buckets[i].Live > 0 {
			s.mu.alloc[i].state = bucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(i))
		} else {
			s.mu.free = append(s.mu.free, uint32(i))
		}
	}
}

func (s *Set) entries() (n int64) {
	for _, v := range s.vols {
		n += v.idx.Cached
	}
	return n
}
