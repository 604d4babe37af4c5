package cache

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// Checkpoints as index pages (ondisk.FeaturePagedIndex; docs/CACHE.md,
// "Index pages on the cache device"). The two checkpoint slots together
// are one page area (cache/internal/pages): root slots 0 and 1, then the
// pages. A checkpoint compares its snapshot of the index with the one
// the durable root holds (index.Diff skips the subtrees the two share),
// applies the differences to the page trees, and has the store write the
// pages that changed, then root generation g+1 into slot (g+1)%2, which
// is the checkpoint generation: the journal of generation g+1 starts at
// the journal block the root's payload names, exactly as after a
// checkpoint slot. Recovery reads the newest valid root, every page of
// its trees, and replays the journal since it; an Open after a clean
// shutdown reads the root, its inner pages and bucket table and builds
// the volumes' index trees from stubs of their leaves, loaded when first
// needed (lazyleaves.go).
//
// Trees: volume slot v's live entries are tree v, its superseded versions
// tree v|pages.SupTree; the bucket table holds the bucket generations.
// The index is in RAM (its leaves loaded, after a lazy Open, as they are
// needed): the pages are its durable form.

// pagedCachePages is the store's page cache: the leaves a checkpoint
// changes are read through it (a leaf changed since the last checkpoint
// is held by its tree until written).
const pagedCachePages = 256

// maxPagedVolumes bounds the volume slots of a paged set: a root names
// two trees a slot and carries each slot's flush epoch in one 4 KiB block.
const maxPagedVolumes = 40

// maxPagedBucketBlocks bounds the blocks of a paged set's bucket: the
// bucket table counts a bucket's live and dirty blocks in 16 bits.
const maxPagedBucketBlocks = 1<<16 - 1

// pagedIndex is a paged set's page store and the snapshot its durable
// root holds. Guarded by commitMu (checkpointLocked), like the slots.
type pagedIndex struct {
	st    *pages.Store
	trees []*index.Ptree // per volume slot; nil: empty
	sups  []*index.Stree
	// pages and bytes the last checkpoint wrote (for tests and stats).
	lastPages, lastBytes uint64
	// lazy: the volumes' trees were built from stubs naming the leaves
	// of the root Open found (lazyleaves.go); nil: every leaf was read.
	lazy *lazyLeaves
}

// pagedLayout is the page area of a paged set: both checkpoint slots.
func pagedLayout(sb *Superblock) pages.Layout {
	return pages.Layout{Off: sb.CkptOff[0], Pages: uint32(2*sb.CkptLen/pages.PageSize - 2), Nonce: sb.Nonce()}
}

// pagedSlotLen is the checkpoint slot length of a paged set of nbuckets
// buckets of bpb blocks: half its page area (pages.AreaPages), at least
// an ordinary slot's.
func pagedSlotLen(nbuckets, bpb int64) int64 {
	area := (2 + pages.AreaPages(nbuckets*bpb, nbuckets, 2*maxPagedVolumes)) * pages.PageSize
	half := (area/2 + blockSize - 1) / blockSize * blockSize
	return max(half, ondisk.CkptSlotLen(nbuckets, bpb, ondisk.MaxBackings))
}

// The root's payload: the journal block the generation starts at, each
// volume slot's flush epoch, the flags (always pagedFlags: a payload with
// other flags is corruption), then each volume slot's count of dirty live
// entries.
//
//	jblk u64 | nvols u16 | epoch u64 × nvols | flags u64 | dirty u64 × nvols
const (
	// pagedCounts: the bucket table's live and dirty counts are the
	// root's trees' (each bucket's entries and superseded versions, and
	// the dirty ones among them).
	pagedCounts = 1 << 0
	// pagedVolDirty: the payload ends with the dirty live entries of each
	// volume slot's tree, which an Open that loads leaves lazily takes
	// instead of counting them.
	pagedVolDirty = 1 << 1
	pagedFlags    = pagedCounts | pagedVolDirty
)

// encodePagedPayload encodes a payload: dirty has one count a volume slot.
func encodePagedPayload(jblk int64, epochs []uint64, dirty []int64) []byte {
	b := make([]byte, 18+16*len(epochs))
	binary.LittleEndian.PutUint64(b, uint64(jblk))
	binary.LittleEndian.PutUint16(b[8:], uint16(len(epochs)))
	for i, e := range epochs {
		binary.LittleEndian.PutUint64(b[10+8*i:], e)
	}
	binary.LittleEndian.PutUint64(b[10+8*len(epochs):], pagedFlags)
	for i := range epochs {
		binary.LittleEndian.PutUint64(b[18+8*len(epochs)+8*i:], uint64(dirty[i]))
	}
	return b
}

// decodePagedDirty returns the volume slots' dirty counts of a payload
// decodePagedPayload accepted.
func decodePagedDirty(b []byte, nvols int) []int64 {
	d := make([]int64, nvols)
	for i := range d {
		d[i] = int64(binary.LittleEndian.Uint64(b[18+8*nvols+8*i:]))
	}
	return d
}

func decodePagedPayload(b []byte, sb *Superblock) (jblk int64, epochs []uint64, flags uint64, err error) {
	bad := func(format string, args ...any) (int64, []uint64, uint64, error) {
		return 0, nil, 0, ondisk.Corruptf("index root payload", sb.CkptOff[0], 2*pages.PageSize, format, args...)
	}
	if len(b) < 10 {
		return bad("%d bytes", len(b))
	}
	j := binary.LittleEndian.Uint64(b)
	n := int(binary.LittleEndian.Uint16(b[8:]))
	if j >= uint64(sb.JournalLen/blockSize) || n > maxPagedVolumes || len(b) != 18+16*n {
		return bad("journal block %d, %d volume slots in %d bytes", j, n, len(b))
	}
	epochs = make([]uint64, n)
	for i := range epochs {
		epochs[i] = binary.LittleEndian.Uint64(b[10+8*i:])
	}
	if flags = binary.LittleEndian.Uint64(b[10+8*n:]); flags != pagedFlags {
		return bad("flags %#x, want %#x", flags, pagedFlags)
	}
	return int64(j), epochs, flags, nil
}

// formatPaged writes the first root (generation 1: no entries, the
// journal from block 0) of a paged set.
func formatPaged(dev device.Device, sb *Superblock, nvols int) error {
	return pages.Format(dev, pagedLayout(sb), encodePagedPayload(0, make([]uint64, nvols), make([]int64, nvols)))
}

// writePagedCheckpoint is checkpointLocked's write for a paged set: the
// pages that changed since the durable root, then root h.Gen. The
// snapshot (gens, epochs, trees, vers) is checkpointLocked's.
// REQUIRES: s.commitMu
func (s *Set) writePagedCheckpoint(h ondisk.CkptHeader, gens []uint32, epochs []uint64, trees []*index.Ptree, vers []ondisk.VerSnap) error {
	p := s.pg
	st := p.st
	if err := st.Err(); err != nil {
		return err
	}
	if h.Gen != st.Gen()+1 {
		return fmt.Errorf("%w: paged checkpoint of generation %d after root %d", ErrInvalid, h.Gen, st.Gen())
	}
	if len(trees) > maxPagedVolumes {
		return fmt.Errorf("%w: %d volume slots in a paged set (at most %d)", ErrInvalid, len(trees), maxPagedVolumes)
	}
	p0, b0 := st.PagesWritten, st.BytesWritten
	tab, err := st.Table(len(gens))
	if err != nil {
		return err
	}
	for i, g := range gens {
		r := tab.Get(i)
		r.Gen = g
		tab.Set(i, r) // an unchanged record changes no page
	}
	count := pagedCounter(tab, s.bpb)
	released := len(st.Alloc().ReleasedPages())
	var applied int
	counted := func(e index.Ent, dirty bool, d int) { applied++; count(e, dirty, d) }
	sups := make([]*index.Stree, len(trees))
	for vi := range max(len(trees), len(p.trees)) {
		var oldT, newT *index.Ptree
		var oldS, newS *index.Stree
		var epochOf func(uint32) uint64
		if vi < len(p.trees) {
			oldT, oldS = p.trees[vi], p.sups[vi]
		}
		if vi < len(trees) {
			newT, newS, epochOf = trees[vi], vers[vi].Sup, vers[vi].EpochOf
			sups[vi] = newS
		}
		if err := s.applyDiff(st, uint16(vi), oldT, newT, epochOf, counted); err != nil {
			return err
		}
		if err := s.applySupDiff(st, uint16(vi)|pages.SupTree, oldS, newS, epochOf, counted); err != nil {
			return err
		}
	}
	if p.lazy != nil {
		if err := s.pinReleasedStubs(trees, st.Alloc().ReleasedPages()[released:]); err != nil {
			return err
		}
	}
	dirty := make([]int64, len(trees))
	for vi := range dirty {
		dirty[vi] = int64(vers[vi].Dirty)
	}
	if err := st.Checkpoint(encodePagedPayload(h.JPos.Blk, epochs, dirty)); err != nil {
		return err
	}
	p.trees, p.sups = trees, sups
	p.lastPages, p.lastBytes = st.PagesWritten-p0, st.BytesWritten-b0
	if invariants.Enabled && applied > 0 {
		// (With no difference applied the page trees hold what they
		// held: checking would load every leaf of a lazy set.)
		s.mu.Lock()
		err := p.check(gens, s.bpb)
		s.mu.Unlock()
		if err != nil {
			return fmt.Errorf("paged checkpoint %d differs from its snapshot: %w", h.Gen, err)
		}
	}
	return nil
}

// pagedCounter moves the bucket table's live and dirty counts by one
// difference applied to the page trees: the durable root's counts are its
// trees' (pagedCounts), so they follow the differences.
func pagedCounter(tab *pages.Table, bpb int64) func(e index.Ent, dirty bool, d int) {
	return func(e index.Ent, dirty bool, d int) {
		b := int(int64(e.Block()) / bpb)
		r := tab.Get(b)
		r.Live = uint16(int(r.Live) + d)
		if dirty {
			r.Dirty = uint16(int(r.Dirty) + d)
		}
		tab.Set(b, r)
	}
}

// pagedBaseLocked is Open's step between recovery and its first
// checkpoint for a paged set. The page trees hold the checkpoint cd
// (read from them); recovery has rebuilt the index from cd and the
// journal. It applies the differences between cd's entries and the
// recovered trees to the page trees (their leaves read together,
// diffApplier) and takes the recovered trees' copy-on-write clones as
// the snapshot the page trees hold (pagedIndex.trees). So the page trees
// need no index tree of their own built at Open, and the checkpoint that
// follows compares trees that share every node recovery did not change.
// REQUIRES: s.commitMu, exclusive access (Open)
func (s *Set) pagedBaseLocked(cd *ondisk.CkptData) error {
	p := s.pg
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.lazy != nil {
		// The trees are built from the page trees' leaves, unchanged.
		p.trees = make([]*index.Ptree, len(s.vols))
		for vi, v := range s.vols {
			p.trees[vi] = v.idx.Tree.Clone()
		}
		for len(p.sups) < len(p.trees) {
			p.sups = append(p.sups, nil)
		}
		return nil
	}
	tab, err := p.st.Table(len(s.mu.Buckets))
	if err != nil {
		return err
	}
	count := pagedCounter(tab, s.bpb)
	epochOf := s.mu.SnapshotEpochs()
	p.trees = make([]*index.Ptree, max(len(cd.Vols), len(s.vols)))
	for len(p.sups) < len(p.trees) {
		p.sups = append(p.sups, nil)
	}
	for vi := range p.trees {
		var old []index.Ent
		if vi < len(cd.Vols) {
			old = cd.Vols[vi].Ents
		}
		var cur *index.Ptree
		if vi < len(s.vols) {
			cur = s.vols[vi].idx.Tree.Clone()
		}
		b := s.newDiffApplier(p.st, uint16(vi), false, epochOf, count)
		if err := index.DiffSorted(old, cur, b.add); err != nil {
			return err
		}
		if err := b.flush(); err != nil {
			return err
		}
		p.trees[vi] = cur
	}
	return nil
}

// slotOf is the leaf slot of entry e (live, or a superseded version).
// The slot's bucket generation is written 0: the engine drops a reused
// bucket's entries from the index itself, and an entry the same after
// its bucket was reused (same block, LBA and checksum) is no difference
// to Diff, so a generation written with the entry would go stale. The
// table holds the generations.
func (s *Set) slotOf(e index.Ent, sup bool, epochOf func(uint32) uint64) pages.Slot {
	sl := pages.Slot{LBA: e.LBA, Loc: e.Loc, CRC: e.CRC}
	if sup {
		sl.Loc |= index.DirtyBit
	}
	if sl.Loc&index.DirtyBit != 0 && epochOf != nil {
		sl.Epoch = epochOf(e.Block())
	}
	return sl
}

// diffBatch is the most differences applyDiff collects before applying
// them: the leaves they touch are read first, together (pages.Tree.Hold),
// rather than one read per leaf as Put and Delete would; the batch
// bounds what that costs in memory (~50 B a difference).
const diffBatch = 1 << 14

// change is one difference Diff reported.
type change struct {
	o, n         index.Ent
	inOld, inNew bool
}

// applyDiff applies the differences between the snapshots oldT (the
// durable root's) and newT to page tree id, in batches of diffBatch whose
// leaves are read together first, and counts them (count).
func (s *Set) applyDiff(st *pages.Store, id uint16, oldT, newT *index.Ptree, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) error {
	b := s.newDiffApplier(st, id, false, epochOf, count)
	if err := index.Diff(oldT, newT, b.add); err != nil {
		return err
	}
	return b.flush()
}

func (s *Set) applySupDiff(st *pages.Store, id uint16, oldS, newS *index.Stree, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) error {
	b := s.newDiffApplier(st, id, true, epochOf, count)
	if err := index.DiffSup(oldS, newS, b.add); err != nil {
		return err
	}
	return b.flush()
}

type diffApplier struct {
	s       *Set
	st      *pages.Store
	id      uint16
	sup     bool
	epochOf func(uint32) uint64
	count   func(index.Ent, bool, int)
	t       *pages.Tree
	batch   []change
	keys    []pages.Key
	err     error
}

func (s *Set) newDiffApplier(st *pages.Store, id uint16, sup bool, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) *diffApplier {
	return &diffApplier{s: s, st: st, id: id, sup: sup, epochOf: epochOf, count: count}
}

func (b *diffApplier) key(e index.Ent) pages.Key {
	if b.sup {
		return pages.Key{LBA: e.LBA, Sub: e.Block()}
	}
	return pages.Key{LBA: e.LBA}
}

func (b *diffApplier) add(o, n index.Ent, inOld, inNew bool) {
	if b.err != nil {
		return
	}
	b.batch = append(b.batch, change{o, n, inOld, inNew})
	if len(b.batch) == diffBatch {
		b.err = b.flush()
	}
}

// flush applies the batch: its leaves are held (read together), then
// each difference is put or deleted.
func (b *diffApplier) flush() error {
	if b.err != nil || len(b.batch) == 0 {
		return b.err
	}
	if b.t == nil {
		b.t = b.st.Tree(b.id)
	}
	b.keys = b.keys[:0]
	for _, c := range b.batch {
		if c.inOld {
			b.keys = append(b.keys, b.key(c.o))
		}
		if c.inNew {
			b.keys = append(b.keys, b.key(c.n))
		}
	}
	if err := b.t.Hold(b.keys); err != nil {
		return err
	}
	for _, c := range b.batch {
		if c.inOld {
			b.count(c.o, b.sup || c.o.Dirty(), -1)
		}
		var err error
		switch {
		case c.inNew:
			b.count(c.n, b.sup || c.n.Dirty(), +1)
			_, _, err = b.t.Put(b.s.slotOf(c.n, b.sup, b.epochOf))
		case b.sup:
			_, _, err = b.t.DeleteKey(b.key(c.o))
		default:
			_, _, err = b.t.Delete(c.o.LBA)
		}
		if err != nil {
			return err
		}
	}
	b.batch = b.batch[:0]
	return nil
}

// check verifies (invariants builds) that the page trees hold exactly the
// snapshot the durable root is said to hold.
func (p *pagedIndex) check(gens []uint32, bpb int64) error {
	for _, id := range p.st.TreeIDs() {
		vi := int(id &^ pages.SupTree)
		var want []index.Ent
		if id&pages.SupTree == 0 {
			if vi < len(p.trees) && p.trees[vi] != nil {
				p.trees[vi].Ascend(func(e index.Ent) bool { want = append(want, e); return true })
			}
		} else if vi < len(p.sups) && p.sups[vi] != nil {
			p.sups[vi].Ascend(func(e index.Ent) bool { want = append(want, e); return true })
		}
		i := 0
		var bad error
		err := p.st.Tree(id).Ascend(0, func(sl pages.Slot) bool {
			loc := sl.Loc
			if id&pages.SupTree != 0 {
				loc &^= index.DirtyBit
			}
			if i >= len(want) || (index.Ent{LBA: sl.LBA, Loc: loc, CRC: sl.CRC}) != want[i] {
				bad = fmt.Errorf("tree %#x slot %d: %+v", id, i, sl)
				return false
			}
			i++
			return true
		})
		if err != nil {
			return err
		}
		if bad != nil {
			return bad
		}
		if i != len(want) {
			return fmt.Errorf("tree %#x holds %d slots, the snapshot %d", id, i, len(want))
		}
	}
	tab, err := p.st.Table(len(gens))
	if err != nil {
		return err
	}
	cd := &ondisk.CkptData{Vols: make([]ondisk.CkptVol, len(p.trees))}
	for vi := range p.trees {
		if p.trees[vi] != nil {
			p.trees[vi].Ascend(func(e index.Ent) bool { cd.Vols[vi].Ents = append(cd.Vols[vi].Ents, e); return true })
		}
		if p.sups[vi] != nil {
			p.sups[vi].Ascend(func(e index.Ent) bool { cd.Vols[vi].Sup = append(cd.Vols[vi].Sup, index.Ver{Loc: e.Loc}); return true })
		}
	}
	return pagedCountsOf(cd, bpb, tab)
}

// readPagedCheckpoint is ReadCheckpoint for a paged set: the newest valid
// root and every page of its trees, as the checkpoint they stand for, with
// the store for the next checkpoint (openPagedRoot, then readPagedLeaves).
// Damage is a corruption error (IsCorruption), never a panic.
func readPagedCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (ondisk.CkptHeader, *ondisk.CkptData, *pagedIndex, string, error) {
	pr, err := openPagedRoot(dev, sb)
	if err != nil {
		return ondisk.CkptHeader{}, nil, nil, "", err
	}
	cd, p, err := readPagedLeaves(pr, sb, volBlocks, false)
	if err != nil {
		return ondisk.CkptHeader{}, nil, nil, "", err
	}
	return pr.hdr, cd, p, pr.warn, nil
}

// pagedRoot is what a paged Open reads first: the newest valid root, its
// inner pages and bucket table (pages.Open), and its payload.
type pagedRoot struct {
	st     *pages.Store
	hdr    ondisk.CkptHeader
	epochs []uint64 // each volume slot's flush epoch
	dirty  []int64  // each volume slot's dirty live entries; nil: the root does not say
	flags  uint64
	tab    *pages.Table
	warn   string // the other root is not intact
}

func openPagedRoot(dev device.Device, sb *Superblock) (*pagedRoot, error) {
	st, payload, err := pages.Open(dev, pagedLayout(sb), pagedCachePages)
	if err != nil {
		return nil, err
	}
	jblk, epochs, flags, err := decodePagedPayload(payload, sb)
	if err != nil {
		return nil, err
	}
	tab, err := st.Table(int(sb.NBuckets))
	if err != nil {
		return nil, ondisk.Corruptf("index root", sb.CkptOff[0], 2*pages.PageSize, "%v", err)
	}
	for _, id := range st.TreeIDs() {
		if vi := int(id &^ pages.SupTree); vi >= len(epochs) {
			return nil, ondisk.Corruptf("index root", sb.CkptOff[0], 2*pages.PageSize, "tree %#x beyond the root's %d volume slots", id, len(epochs))
		}
	}
	pr := &pagedRoot{st: st, epochs: epochs, dirty: decodePagedDirty(payload, len(epochs)), flags: flags, tab: tab,
		hdr: ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: st.Gen(), JPos: ondisk.JournalPos{Blk: jblk}}}
	if _, perr := st.Previous(); perr != nil {
		pr.warn = fmt.Sprintf("the other index root is not intact (%v): recovered from root generation %d", perr, st.Gen())
	}
	return pr, nil
}

// readPagedLeaves reads the leaves of the root pr as the checkpoint they
// stand for: in page order with few large reads (pages.Tree.ReadLeaves),
// decoded straight into the checkpoint's entries, which pass the checks a
// checkpoint slot's body passes (checkPagedData). With supOnly it reads
// only the trees of superseded versions (a lazy Open: lazyleaves.go), and
// the checks that need every entry are left to the leaves' loads and to
// `check`.
func readPagedLeaves(pr *pagedRoot, sb *Superblock, volBlocks []uint64, supOnly bool) (*ondisk.CkptData, *pagedIndex, error) {
	fail := func(err error) (*ondisk.CkptData, *pagedIndex, error) { return nil, nil, err }
	st, tab, epochs := pr.st, pr.tab, pr.epochs
	nv := len(epochs)
	total := uint32(sb.NBuckets * sb.BlocksPerBucket())
	cd := &ondisk.CkptData{Gens: make([]uint32, sb.NBuckets), Vols: make([]ondisk.CkptVol, nv)}
	for i := range cd.Gens {
		cd.Gens[i] = tab.Get(i).Gen
	}
	var epochOf []uint64
	if !supOnly {
		epochOf = make([]uint64, total)
	}
	p := &pagedIndex{st: st, trees: make([]*index.Ptree, nv), sups: make([]*index.Stree, nv)}
	for vi := range cd.Vols {
		cd.Vols[vi].Epoch, cd.Vols[vi].EpochOf = epochs[vi], epochOf
	}
	for _, id := range st.TreeIDs() {
		vi := int(id &^ pages.SupTree)
		sup := id&pages.SupTree != 0
		if supOnly && !sup {
			continue
		}
		t := st.Tree(id)
		leaves := make([][]index.Ent, t.Leaves())
		var eps [][]uint64 // superseded versions' epochs, by leaf
		if sup {
			eps = make([][]uint64, len(leaves))
		}
		err := t.ReadLeaves(func(i int, pg *pages.Page) error {
			es := make([]index.Ent, pg.Count())
			for j := range es {
				sl := pg.Slot(j)
				b := sl.Loc &^ index.DirtyBit
				if b >= total || sl.BGen != 0 || (sup && sl.Loc&index.DirtyBit == 0) || (sl.Loc&index.DirtyBit == 0 && sl.Epoch != 0) {
					return ondisk.Corruptf("index page", -1, pages.PageSize, "tree %#x: slot %+v names cache block %d of %d, a bucket generation, or an epoch for a clean block", id, sl, b, total)
				}
				es[j] = index.Ent{LBA: sl.LBA, Loc: sl.Loc, CRC: sl.CRC}
				if sup {
					es[j].Loc = b
					if j == 0 {
						eps[i] = make([]uint64, len(es))
					}
					eps[i][j] = sl.Epoch
				} else if sl.Loc&index.DirtyBit != 0 {
					epochOf[b] = sl.Epoch
				}
			}
			leaves[i] = es
			return nil
		})
		if err != nil {
			return fail(err)
		}
		n := 0
		for _, l := range leaves {
			n += len(l)
		}
		if n != t.Len() {
			return fail(ondisk.Corruptf("index root", sb.CkptOff[0], 2*pages.PageSize, "tree %#x: the root says %d slots, its leaves hold %d", id, t.Len(), n))
		}
		ents := make([]index.Ent, 0, n)
		for i, l := range leaves {
			ents = append(ents, l...)
			leaves[i] = nil
		}
		cv := &cd.Vols[vi]
		if !sup {
			cv.Ents = ents // p.trees: pagedBaseLocked
			continue
		}
		sp := index.NewStree()
		var vers []index.Ver
		k := 0
		for _, ep := range eps {
			for _, e := range ep {
				x := ents[k]
				vers = append(vers, index.Ver{Epoch: e, LBA: x.LBA, Loc: x.Loc, CRC: x.CRC})
				sp.ReplaceOrInsert(x)
				k++
			}
		}
		slices.SortFunc(vers, index.CmpVer)
		cv.Sup = vers
		p.sups[vi] = sp
	}
	if supOnly {
		return cd, p, nil
	}
	if err := checkPagedData(cd, sb, volBlocks); err != nil {
		return fail(ondisk.Placed(err, sb.CkptOff[0], 2*sb.CkptLen))
	}
	if err := pagedCountsOf(cd, sb.BlocksPerBucket(), tab); err != nil {
		return fail(err)
	}
	return cd, p, nil
}

// pagedCountsOf counts each bucket's live blocks (entries and superseded
// versions) and dirty ones in cd: a bucket table that says otherwise is
// corruption.
func pagedCountsOf(cd *ondisk.CkptData, bpb int64, tab *pages.Table) error {
	live := make([]uint16, tab.Len())
	dirty := make([]uint16, tab.Len())
	for _, cv := range cd.Vols {
		for _, e := range cv.Ents {
			b := int64(e.Block()) / bpb
			live[b]++
			if e.Dirty() {
				dirty[b]++
			}
		}
		for _, x := range cv.Sup {
			b := int64(x.Loc) / bpb
			live[b]++
			dirty[b]++
		}
	}
	for i := range live {
		r := tab.Get(i)
		if r.Live != live[i] || r.Dirty != dirty[i] {
			return ondisk.Corruptf("index page", -1, pages.PageSize, "bucket table: bucket %d counts %d live and %d dirty blocks, the trees name %d and %d", i, r.Live, r.Dirty, live[i], dirty[i])
		}
	}
	return nil
}

// checkPagedData checks the checkpoint read from pages as
// ondisk.DecodeCkptBody checks a checkpoint slot's body: every entry of
// a volume slot the superblock lists, in strictly increasing LBA order,
// naming a cache block of the set that nothing else names; a dirty
// entry's epoch at most its volume's; superseded versions in (epoch, lba)
// order, each of a block nothing else names and older than the dirty
// live entry of its LBA (invariant 13).
func checkPagedData(cd *ondisk.CkptData, sb *Superblock, volBlocks []uint64) error {
	total := uint64(sb.NBuckets * sb.BlocksPerBucket())
	seen := index.NewBitset(int(total))
	blocksOf := func(v int) uint64 {
		if v < len(volBlocks) {
			return volBlocks[v]
		}
		return 0
	}
	for vi := range cd.Vols {
		cv := &cd.Vols[vi]
		for i, x := range cv.Ents {
			if x.LBA >= blocksOf(vi) || uint64(x.Block()) >= total || (i > 0 && x.LBA <= cv.Ents[i-1].LBA) || seen.Get(int(x.Block())) {
				return ondisk.Badf("index pages", "volume %d entry %d (lba %d loc %d) out of order or out of range", vi, i, x.LBA, x.Block())
			}
			if x.Dirty() && cv.EpochOf[x.Block()] > cv.Epoch {
				return ondisk.Badf("index pages", "volume %d: epoch %d for cache block %d beyond the volume's epoch %d", vi, cv.EpochOf[x.Block()], x.Block(), cv.Epoch)
			}
			seen.Set(int(x.Block()))
		}
	}
	for vi := range cd.Vols {
		cv := &cd.Vols[vi]
		for i, x := range cv.Sup {
			if x.LBA >= blocksOf(vi) || uint64(x.Loc) >= total || seen.Get(int(x.Loc)) || x.Epoch > cv.Epoch {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v out of range or owned twice", vi, x)
			}
			j, found := slices.BinarySearchFunc(cv.Ents, x.LBA, func(e index.Ent, lba uint64) int { return cmp.Compare(e.LBA, lba) })
			if (i > 0 && !index.VerLess(cv.Sup[i-1], x)) || !found || !cv.Ents[j].Dirty() || cv.EpochOf[cv.Ents[j].Block()] <= x.Epoch {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v out of order or not older than a dirty entry", vi, x)
			}
			seen.Set(int(x.Loc))
		}
	}
	return nil
}

// readCheckpoint reads the set's newest checkpoint: a checkpoint slot, or
// for a paged set the newest root and its pages (pg then holds them).
func readCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (h ondisk.CkptHeader, cd *ondisk.CkptData, pg *pagedIndex, warn string, err error) {
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		return readPagedCheckpoint(dev, sb, volBlocks)
	}
	h, cd, warn, err = ondisk.ReadCheckpoint(dev, sb, volBlocks)
	return h, cd, nil, warn, err
}
