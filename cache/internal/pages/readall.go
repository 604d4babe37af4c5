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
	slices.SortFunc(todo, func(a, b ref) int { return int(a.k.ptr.Page) - int(b.k.ptr.Page) })
	buf := make([]byte, readRun*PageSize)
	for a := 0; a < len(todo); {
		first := todo[a].k.ptr.Page
		if first >= t.st.lay.Pages {
			return t.st.readPageErr(todo[a].k.ptr)
		}
		b := a + 1
		for b < len(todo) {
			p := todo[b].k.ptr.Page
			if p >= t.st.lay.Pages || p-first >= readRun || p-todo[b-1].k.ptr.Page > readGap+1 {
				break
			}
			b++
		}
		last := todo[b-1].k.ptr.Page
		off := t.st.lay.pageOff(first)
		run := buf[:int(last-first+1)*PageSize]
		if _, err := t.st.dev.ReadAt(run, off); err != nil {
			return fmt.Errorf("pages: reading %d pages at %d: %w", last-first+1, off, err)
		}
		for _, r := range todo[a:b] {
			o := int(r.k.ptr.Page-first) * PageSize
			p := (*Page)(run[o : o+PageSize])
			if err := p.Verify(r.k.ptr, off+int64(o), KindLeaf, 0, t.id, t.st.lay.Nonce); err != nil {
				return err
			}
			if err := fn(r.i, p); err != nil {
				return err
			}
		}
		a = b
	}
	return nil
}

// readPageErr is readPage's error for a pointer beyond the area.
func (st *Store) readPageErr(ptr Ptr) error {
	_, err := st.readPage(ptr, KindLeaf, 0, 0)
	return err
}
