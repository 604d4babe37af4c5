package pages

import "github.com/tiercache/tiercache/cache/internal/index"

// A checkpoint of a paged set applies the differences between the index
// snapshot the durable root holds and the new one to the page trees, and
// moves the bucket table's counts with them; the engine (package cache,
// pagedckpt.go) takes the snapshots and writes the root.

// TableCounter moves the bucket table's live and dirty counts by one
// difference applied to the page trees: the durable root's counts are its
// trees' (FlagCounts), so they follow the differences.
func TableCounter(tab *Table, bpb int64) func(e index.Ent, dirty bool, d int) {
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

// slotOf is the leaf slot of entry e (live, or a superseded version).
// The slot's bucket generation is written 0: the engine drops a reused
// bucket's entries from the index itself, and an entry the same after
// its bucket was reused (same block, LBA and checksum) is no difference
// to Diff, so a generation written with the entry would go stale. The
// table holds the generations.
func slotOf(e index.Ent, sup bool, epochOf func(uint32) uint64) Slot {
	sl := Slot{LBA: e.LBA, Loc: e.Loc, CRC: e.CRC}
	if sup {
		sl.Loc |= index.DirtyBit
	}
	if sl.Loc&index.DirtyBit != 0 && epochOf != nil {
		sl.Epoch = epochOf(e.Block())
	}
	return sl
}

// diffBatch is the most differences ApplyDiff collects before applying
// them: the leaves they touch are read first, together (Tree.Hold),
// rather than one read per leaf as Put and Delete would; the batch
// bounds what that costs in memory (~50 B a difference).
const diffBatch = 1 << 14

// change is one difference Diff reported.
type change struct {
	o, n         index.Ent
	inOld, inNew bool
}

// ApplyDiff applies the differences between the snapshots oldT (the
// durable root's) and newT to page tree id, in batches of diffBatch whose
// leaves are read together first, and counts them (count).
func ApplyDiff(st *Store, id uint16, oldT, newT *index.Ptree, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) error {
	b := newDiffApplier(st, id, false, epochOf, count)
	if err := index.Diff(oldT, newT, b.add); err != nil {
		return err
	}
	return b.flush()
}

// ApplySupDiff is ApplyDiff for the trees of superseded versions.
func ApplySupDiff(st *Store, id uint16, oldS, newS *index.Stree, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) error {
	b := newDiffApplier(st, id, true, epochOf, count)
	if err := index.DiffSup(oldS, newS, b.add); err != nil {
		return err
	}
	return b.flush()
}

// ApplyDiffSorted is ApplyDiff from old, the entries of the durable
// root's tree id in LBA order, to newT.
func ApplyDiffSorted(st *Store, id uint16, old []index.Ent, newT *index.Ptree, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) error {
	b := newDiffApplier(st, id, false, epochOf, count)
	if err := index.DiffSorted(old, newT, b.add); err != nil {
		return err
	}
	return b.flush()
}

type diffApplier struct {
	st      *Store
	id      uint16
	sup     bool
	epochOf func(uint32) uint64
	count   func(index.Ent, bool, int)
	t       *Tree
	batch   []change
	keys    []Key
	err     error
}

func newDiffApplier(st *Store, id uint16, sup bool, epochOf func(uint32) uint64, count func(index.Ent, bool, int)) *diffApplier {
	return &diffApplier{st: st, id: id, sup: sup, epochOf: epochOf, count: count}
}

func (b *diffApplier) key(e index.Ent) Key {
	if b.sup {
		return Key{LBA: e.LBA, Sub: e.Block()}
	}
	return Key{LBA: e.LBA}
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
			_, _, err = b.t.Put(slotOf(c.n, b.sup, b.epochOf))
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
