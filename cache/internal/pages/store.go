package pages

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// The page area on the cache device, at Layout.Off:
//
//	| root slot 0 (4 KiB) | root slot 1 (4 KiB) | page 0 | page 1 | ... | page N-1 |
//
// A root (root.go) names every tree's root page and carries the caller's
// payload (the engine's: where the journal that follows it starts). Root
// g goes to slot g%2, after every page it names is durable, and is synced
// before anything relies on it; Open takes the valid root with the
// highest generation.

// Layout places a page area on a device.
type Layout struct {
	Off   int64  // byte offset of root slot 0
	Pages uint32 // pages after the two root slots
	Nonce uint64 // the set's: every page and root carries it
}

// Len returns the bytes the area takes.
func (l Layout) Len() int64 { return 2*PageSize + int64(l.Pages)*PageSize }

func (l Layout) pageOff(p uint32) int64 { return l.Off + 2*PageSize + int64(p)*PageSize }

// Store is the page area in use: the trees, the page cache and the
// allocation. It is guarded by the caller's lock.
type Store struct {
	dev   device.Device
	lay   Layout
	cache *Cache
	alloc *Alloc
	gen   uint64 // the durable root's generation
	root  Root   // the durable root (Verify)
	trees map[uint16]*Tree
	table *Table // nil: none
	// err is sticky: after a failed write or sync nothing more is written
	// (a page the device may not hold could otherwise be named by a root).
	err error
	// prevGen is the generation of the root in the other slot, intact (0:
	// none); prevErr why there is none.
	prevGen uint64
	prevErr error

	// PagesWritten and BytesWritten count the checkpoints' writes (pages
	// and roots).
	PagesWritten, BytesWritten uint64
}

// Format writes the first root (generation 1, no trees) of an empty page
// area.
func Format(dev device.Device, lay Layout, payload []byte) error {
	if lay.Off < 0 || lay.Off+lay.Len() > dev.Size() || lay.Pages == 0 {
		return fmt.Errorf("pages: area of %d pages at %d does not fit a device of %d bytes", lay.Pages, lay.Off, dev.Size())
	}
	b, err := encodeRoot(Root{Gen: 1, Nonce: lay.Nonce, Pages: lay.Pages, Payload: payload})
	if err != nil {
		return err
	}
	if _, err := dev.WriteAt(make([]byte, PageSize), lay.Off); err != nil {
		return err
	}
	if _, err := dev.WriteAt(b, lay.Off+PageSize); err != nil {
		return err
	}
	return dev.Sync()
}

// Open reads the newest valid root and every inner page of its trees (the
// leaves are read when needed), with a page cache of cachePages leaves.
// It returns the root's payload. The pages the root in the other slot
// names are kept until the next root is durable (Alloc), found from its
// inner pages that differ from the newest root's; Previous says whether
// that root is intact.
func Open(dev device.Device, lay Layout, cachePages int) (*Store, []byte, error) {
	var roots [2]*Root
	var errs [2]error
	var zero [2]bool
	for i := range 2 {
		b := make([]byte, PageSize)
		off := lay.Off + int64(i)*PageSize
		if _, err := dev.ReadAt(b, off); err != nil {
			// An unreadable slot may hold the newest root.
			return nil, nil, fmt.Errorf("pages: reading root slot %d: %w", i, err)
		}
		r, err := decodeRoot(b, off, lay)
		if err == nil && r.Gen%2 != uint64(i) {
			err = ondisk.Corruptf("index root", off, PageSize, "generation %d in slot %d", r.Gen, i)
		}
		if err != nil {
			errs[i], zero[i] = err, ondisk.IsZero(b)
			continue
		}
		roots[i] = &r
	}
	bi := 0
	if roots[0] == nil || roots[1] != nil && roots[1].Gen > roots[0].Gen {
		bi = 1
	}
	best, other := roots[bi], roots[1-bi]
	if best == nil {
		return nil, nil, fmt.Errorf("pages: no valid root: slot 0: %v; slot 1: %w", errs[0], errs[1])
	}
	st := &Store{dev: dev, lay: lay, cache: NewCache(cachePages), alloc: NewAlloc(lay.Pages), gen: best.Gen,
		root: *best, trees: map[uint16]*Tree{}}
	if !zero[1-bi] {
		st.prevErr = errs[1-bi] // a slot never written is no root
	}
	inner := map[uint32]uint64{} // the newest root's inner pages: generation
	for _, tr := range best.Trees {
		if tr.ID == TableTree {
			var err error
			if st.table, err = st.loadTable(tr, inner); err != nil {
				return nil, nil, err
			}
			continue
		}
		t := &Tree{id: tr.ID, st: st, length: int(tr.Count)}
		if tr.Level > 0 {
			n, err := st.loadNode(tr.Root, tr.Level, tr.ID, inner)
			if err != nil {
				return nil, nil, err
			}
			t.root = n
		}
		st.trees[tr.ID] = t
	}
	if other != nil {
		st.prevGen = other.Gen
		for _, tr := range other.Trees {
			if tr.Level == 0 {
				continue
			}
			if err := st.keepNode(tr.Root, tr.Level, tr.ID, inner); err != nil {
				if !IsCorruption(err) {
					return nil, nil, err
				}
				// The previous root is damaged; what it names that is
				// marked stays kept until the next root.
				st.prevGen, st.prevErr = 0, err
				break
			}
		}
	}
	return st, best.Payload, nil
}

// Previous returns the generation of the root in the other slot, whose
// pages are intact (kept until the next root is durable), or 0 and why
// there is none (nil: the slot was never written).
func (st *Store) Previous() (uint64, error) { return st.prevGen, st.prevErr }

// loadNode reads the inner page at ptr and, below it, every inner page,
// marking every page named (leaves included) as in use and recording the
// inner pages' generations in inner.
func (st *Store) loadNode(ptr Ptr, level uint8, tree uint16, inner map[uint32]uint64) (*node, error) {
	if err := st.alloc.MarkUsed(ptr.Page); err != nil {
		return nil, err
	}
	p, err := st.readPage(ptr, KindInner, level, tree)
	if err != nil {
		return nil, err
	}
	inner[ptr.Page] = ptr.Gen
	n := &node{level: int(level), written: true, ptr: ptr, kids: make([]kid, p.Count())}
	for i := range n.kids {
		c := p.Child(i)
		n.kids[i] = kid{key: c.Key, agg: c.Agg, ptr: c.Ptr}
		if level > 1 {
			if n.kids[i].node, err = st.loadNode(c.Ptr, level-1, tree, inner); err != nil {
				return nil, err
			}
		} else if err := st.alloc.MarkUsed(c.Ptr.Page); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// keepNode marks the pages of the previous root's subtree at ptr that the
// newest root does not name as kept. An inner page the newest root names
// with the same generation is the same subtree (a page is written once a
// generation and never changed while a root names it): it is not read.
func (st *Store) keepNode(ptr Ptr, level uint8, tree uint16, inner map[uint32]uint64) error {
	if g, ok := inner[ptr.Page]; ok && g == ptr.Gen {
		return nil
	}
	if _, err := st.alloc.MarkKept(ptr.Page); err != nil {
		return err
	}
	p, err := st.readPage(ptr, KindInner, level, tree)
	if err != nil {
		return err
	}
	for i := range p.Count() {
		c := p.Child(i)
		if level > 1 {
			if err := st.keepNode(c.Ptr, level-1, tree, inner); err != nil {
				return err
			}
		} else if _, err := st.alloc.MarkKept(c.Ptr.Page); err != nil {
			return err
		}
	}
	return nil
}

// readPage reads and verifies the page at ptr.
func (st *Store) readPage(ptr Ptr, kind, level uint8, tree uint16) (*Page, error) {
	if ptr.Page >= st.lay.Pages {
		return nil, ondisk.Corruptf("index page", -1, PageSize, "page %d beyond the page area (%d pages)", ptr.Page, st.lay.Pages)
	}
	off := st.lay.pageOff(ptr.Page)
	p := new(Page)
	if _, err := st.dev.ReadAt(p[:], off); err != nil {
		return nil, fmt.Errorf("pages: reading page %d at %d: %w", ptr.Page, off, err)
	}
	if err := p.Verify(ptr, off, kind, level, tree, st.lay.Nonce); err != nil {
		return nil, err
	}
	return p, nil
}

// Tree returns the tree id, creating an empty one. TableTree is not a
// tree (Table).
func (st *Store) Tree(id uint16) *Tree {
	if id == TableTree {
		panic("pages: tree number TableTree is the bucket table's")
	}
	t, ok := st.trees[id]
	if !ok {
		t = &Tree{id: id, st: st}
		st.trees[id] = t
	}
	return t
}

// Gen returns the durable root's generation.
func (st *Store) Gen() uint64 { return st.gen }

// Cache returns the page cache.
func (st *Store) Cache() *Cache { return st.cache }

// Alloc returns the page area's allocation.
func (st *Store) Alloc() *Alloc { return st.alloc }

// Err returns the sticky write error, if any.
func (st *Store) Err() error { return st.err }

// Checkpoint writes every page changed since the last checkpoint (leaves,
// then the inner nodes above them), syncs, writes the next root with
// payload into its slot and syncs again. When it returns nil the new root
// is durable, the pages only the previous root named are free and those
// only the old one names are kept (Alloc). An error is sticky (Err): the
// store writes nothing more.
func (st *Store) Checkpoint(payload []byte) error {
	if st.err != nil {
		return st.err
	}
	gen := st.gen + 1
	released := st.alloc.Released()
	w := &pageWriter{st: st, gen: gen}
	root := Root{Gen: gen, Nonce: st.lay.Nonce, Pages: st.lay.Pages, Payload: payload}
	ids := make([]uint16, 0, len(st.trees))
	for id := range st.trees {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		t := st.trees[id]
		rt := RootTree{ID: id, Count: uint64(t.length), Agg: math.MaxUint64}
		if t.root != nil {
			agg, err := w.flushNode(t, t.root)
			if err != nil {
				return st.fail(err)
			}
			rt.Level, rt.Root, rt.Agg = uint8(t.root.level), t.root.ptr, agg
		}
		root.Trees = append(root.Trees, rt)
	}
	if st.table != nil {
		rt, err := st.table.flush(w)
		if err != nil {
			return st.fail(err)
		}
		root.Trees = append(root.Trees, rt)
	}
	if err := w.flush(); err != nil {
		return st.fail(err)
	}
	if err := st.dev.Sync(); err != nil {
		return st.fail(fmt.Errorf("pages: syncing pages: %w", err))
	}
	b, err := encodeRoot(root)
	if err != nil {
		return st.fail(err)
	}
	if _, err := st.dev.WriteAt(b, st.lay.Off+int64(gen%2)*PageSize); err != nil {
		return st.fail(fmt.Errorf("pages: writing root: %w", err))
	}
	if err := st.dev.Sync(); err != nil {
		return st.fail(fmt.Errorf("pages: syncing root: %w", err))
	}
	st.BytesWritten += PageSize
	st.prevGen, st.prevErr = st.gen, nil
	st.gen, st.root = gen, root
	st.alloc.Durable(released)
	return nil
}

func (st *Store) fail(err error) error {
	st.err = err
	return err
}

// pageWriter collects a checkpoint's pages and writes runs of
// consecutive page numbers with one write each.
type pageWriter struct {
	st      *Store
	gen     uint64
	pending []pendingPage
}

type pendingPage struct {
	page uint32
	buf  *Page
}

// flushNode writes n's changed leaves and nodes below it, then n if it
// changed, and returns the exact oldest dirty epoch under n as far as
// its children's bounds say (a written leaf's bound is made exact).
func (w *pageWriter) flushNode(t *Tree, n *node) (uint64, error) {
	for i := range n.kids {
		k := &n.kids[i]
		switch {
		case n.level > 1:
			if k.node.dirty {
				agg, err := w.flushNode(t, k.node)
				if err != nil {
					return 0, err
				}
				k.agg = agg
			}
			k.ptr = k.node.ptr
		case k.dirty != nil:
			p, err := w.st.alloc.Alloc()
			if err != nil {
				return 0, err
			}
			k.agg = k.dirty.MinEpoch()
			k.ptr = Ptr{Page: p, Gen: w.gen, CRC: k.dirty.Seal(p, w.gen, w.st.lay.Nonce)}
			w.pending = append(w.pending, pendingPage{p, k.dirty})
			w.st.cache.Put(p, k.dirty)
			k.dirty = nil
			t.ndirty--
		}
	}
	if n.dirty {
		pg := new(Page)
		pg.Init(KindInner, uint8(n.level), t.id)
		for _, k := range n.kids {
			pg.AppendChild(Child{Key: k.key, Ptr: k.ptr, Agg: k.agg})
		}
		p, err := w.st.alloc.Alloc()
		if err != nil {
			return 0, err
		}
		n.ptr = Ptr{Page: p, Gen: w.gen, CRC: pg.Seal(p, w.gen, w.st.lay.Nonce)}
		n.dirty, n.written = false, true
		w.pending = append(w.pending, pendingPage{p, pg})
	}
	return minAgg(n.kids), nil
}

func (w *pageWriter) flush() error {
	slices.SortFunc(w.pending, func(a, b pendingPage) int { return int(a.page) - int(b.page) })
	for i := 0; i < len(w.pending); {
		j := i + 1
		for j < len(w.pending) && w.pending[j].page == w.pending[j-1].page+1 && j-i < 256 {
			j++
		}
		buf := make([]byte, 0, (j-i)*PageSize)
		for _, pp := range w.pending[i:j] {
			buf = append(buf, pp.buf[:]...)
		}
		off := w.st.lay.pageOff(w.pending[i].page)
		if _, err := w.st.dev.WriteAt(buf, off); err != nil {
			return fmt.Errorf("pages: writing %d pages at %d: %w", j-i, off, err)
		}
		w.st.PagesWritten += uint64(j - i)
		w.st.BytesWritten += uint64(len(buf))
		i = j
	}
	w.pending = nil
	return nil
}

// IsCorruption reports whether err is a page or root failing its checks.
func IsCorruption(err error) bool { return errors.Is(err, ErrCorrupt) }
