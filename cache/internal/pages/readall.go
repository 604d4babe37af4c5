package pages

import (
	"fmt"
	"slices"
)

// readRun is the most pages ReadLeaves reads with one read, and readGap
// the most unneeded pages between two it needs that it reads through
// rather than starting another read.
const (
	readRun = 64
	readGap = 8
)

// Leaves returns the number of leaves of the tree (from the resident
// inner nodes; no reads).
func (t *Tree) Leaves() int {
	n := 0
	t.eachLeaf(func(*kid) { n++ })
	return n
}

func (t *Tree) eachLeaf(fn func(*kid)) {
	var walk func(n *node)
	walk = func(n *node) {
		for i := range n.kids {
			if n.level > 1 {
				walk(n.kids[i].node)
			} else {
				fn(&n.kids[i])
			}
		}
	}
	if t.root != nil {
		walk(t.root)
	}
}

// ReadLeaves calls fn for every leaf of the tree with its position in
// key order (0 to Leaves()-1) and its page, which fn must not keep or
// change. The leaves not held or cached are read in the order of their
// pages on the device, with few large reads (runs of up to readRun
// pages, reading through gaps of up to readGap pages), each verified
// against its parent as a single read would (Verify); so fn sees the
// leaves in page order, not key order. It does not fill the page cache
// (a reader of every leaf would only evict the hot ones). The first
// error, a corruption error for damage, ends it.
func (t *Tree) ReadLeaves(fn func(i int, p *Page) error) error {
	type ref struct {
		i int
		k *kid
	}
	var todo []ref
	i := 0
	var err error
	t.eachLeaf(func(k *kid) {
		defer func() { i++ }()
		if err != nil {
			return
		}
		if k.dirty != nil {
			err = fn(i, k.dirty)
			return
		}
		if p, ok := t.st.cache.Get(k.ptr.Page); ok {
			err = fn(i, p)
			return
		}
		todo = append(todo, ref{i, k})
	})
	if err != nil {
		return err
	}
	kids := make([]*kid, len(todo))
	for j, r := range todo {
		kids[j] = r.k
	}
	return t.readRuns(kids, func(j int, p *Page) error { return fn(todo[j].i, p) })
}

// readRuns reads the leaves of kids (none held) in the order of their
// pages on the device, with few large reads (runs of up to readRun
// pages, reading through gaps of up to readGap pages), verifies each
// against its parent as a single read would (Verify), and calls fn with
// each leaf's index in kids and its page, which fn must not keep or
// change. The first error, a corruption error for damage, ends it.
func (t *Tree) readRuns(kids []*kid, fn func(j int, p *Page) error) error {
	order := make([]int, len(kids))
	for j := range order {
		order[j] = j
	}
	slices.SortFunc(order, func(a, b int) int { return int(kids[a].ptr.Page) - int(kids[b].ptr.Page) })
	page := func(j int) uint32 { return kids[order[j]].ptr.Page }
	buf := make([]byte, min(len(kids), readRun)*PageSize)
	for a := 0; a < len(order); {
		first := page(a)
		if first >= t.st.lay.Pages {
			return t.st.readPageErr(kids[order[a]].ptr)
		}
		b := a + 1
		for b < len(order) {
			p := page(b)
			if p >= t.st.lay.Pages || p-first >= readRun || p-page(b-1) > readGap+1 {
				break
			}
			b++
		}
		last := page(b - 1)
		off := t.st.lay.pageOff(first)
		n := int(last-first+1) * PageSize
		if n > len(buf) {
			buf = make([]byte, readRun*PageSize)
		}
		run := buf[:n]
		if _, err := t.st.dev.ReadAt(run, off); err != nil {
			return fmt.Errorf("pages: reading %d pages at %d: %w", last-first+1, off, err)
		}
		for _, j := range order[a:b] {
			k := kids[j]
			o := int(k.ptr.Page-first) * PageSize
			p := (*Page)(run[o : o+PageSize])
			if err := p.Verify(k.ptr, off+int64(o), KindLeaf, 0, t.id, t.st.lay.Nonce); err != nil {
				return err
			}
			if err := fn(j, p); err != nil {
				return err
			}
		}
		a = b
	}
	return nil
}

// Hold makes every leaf that holds or would hold one of keys a changed
// copy held by the tree (as the first change of it does: its page is
// released), reading the leaves neither held nor cached as ReadLeaves
// does, with few large reads in page order. For a caller about to
// change every such leaf (a checkpoint applying a sorted batch of
// differences), so that Put and Delete find them without a read each.
// The nodes above them are touched. keys need not be sorted.
func (t *Tree) Hold(keys []Key) error {
	if t.st.err != nil {
		return t.st.err
	}
	if t.root == nil {
		return nil
	}
	var todo []*kid
	seen := make(map[*kid]bool)
	var buf [8]step
	for _, k := range keys {
		path := t.descend(k, buf[:0])
		last := path[len(path)-1]
		lk := &last.n.kids[last.i]
		if lk.dirty != nil || seen[lk] {
			continue
		}
		seen[lk] = true
		for _, st := range path {
			t.touch(st.n)
		}
		if _, ok := t.st.cache.Get(lk.ptr.Page); ok {
			if _, err := t.mutLeaf(lk); err != nil {
				return err
			}
			continue
		}
		todo = append(todo, lk)
	}
	return t.readRuns(todo, func(j int, p *Page) error {
		k := todo[j]
		c := new(Page)
		*c = *p
		t.st.alloc.Release(k.ptr.Page)
		k.dirty = c
		k.ptr = Ptr{}
		t.ndirty++
		return nil
	})
}

// readPageErr is readPage's error for a pointer beyond the area.
func (st *Store) readPageErr(ptr Ptr) error {
	_, err := st.readPage(ptr, KindLeaf, 0, 0)
	return err
}

// LeafRef is where one leaf of a tree is, as its parent names it.
type LeafRef struct {
	Key Key    // at most the leaf's first key, above the keys of the leaves before it
	Agg uint64 // a lower bound of the oldest dirty epoch in it (MaxUint64: none)
	Ptr Ptr
}

// LeafRefs returns the tree's leaves in key order as the resident inner
// nodes name them (no reads), for a tree with no leaf held changed (just
// opened, or just checkpointed): each is on the device, and ReadLeaf reads
// it.
func (t *Tree) LeafRefs() ([]LeafRef, error) {
	if t.ndirty != 0 {
		return nil, errorf("tree %d: %d leaves held changed", t.id, t.ndirty)
	}
	var out []LeafRef
	t.eachLeaf(func(k *kid) { out = append(out, LeafRef{Key: k.key, Agg: k.agg, Ptr: k.ptr}) })
	return out, nil
}

// ReadLeaf reads and verifies the leaf of tree at ptr, bypassing the page
// cache. It reads only what does not change while the store is used
// (the device and the layout), so it may run concurrently with the
// store's other methods, without the caller's lock.
func (st *Store) ReadLeaf(ptr Ptr, tree uint16) (*Page, error) {
	return st.readPage(ptr, KindLeaf, 0, tree)
}
