package pages

import (
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// Counts counts what a root names.
type Counts struct {
	Trees  int   // trees (the bucket table not counted)
	Inner  int64 // inner pages of the trees
	Leaves int64 // leaf pages
	Table  int64 // bucket table pages and their directory
	Slots  int64 // leaf slots (the trees' counts)
}

// Pages returns the pages counted.
func (c Counts) Pages() int64 { return c.Inner + c.Leaves + c.Table }

// Counts returns what the trees and the table in memory name, from the
// resident inner nodes (no reads). Right after Open, with nothing
// changed, that is what the durable root names.
func (st *Store) Counts() Counts {
	var c Counts
	var walk func(n *node)
	walk = func(n *node) {
		c.Inner++
		if n.level == 1 {
			c.Leaves += int64(len(n.kids))
			return
		}
		for i := range n.kids {
			walk(n.kids[i].node)
		}
	}
	for _, t := range st.trees {
		if t.length == 0 && t.root == nil {
			continue
		}
		c.Trees++
		c.Slots += int64(t.length)
		if t.root != nil {
			walk(t.root)
		}
	}
	if st.table != nil {
		for _, lv := range st.table.levels {
			c.Table += int64(len(lv))
		}
	}
	return c
}

// RootSlot is what one root slot of a page area holds.
type RootSlot struct {
	Root Root
	Err  error // not a valid root of the area (never written, torn, another set's)
	Zero bool  // the slot is all zeroes (never written)
}

// ReadRoots reads and verifies both root slots of the area lay. A read
// error is returned; a slot that does not hold a valid root says why in
// its Err.
func ReadRoots(dev device.Device, lay Layout) ([2]RootSlot, error) {
	var out [2]RootSlot
	for i := range out {
		b := make([]byte, PageSize)
		off := lay.Off + int64(i)*PageSize
		if _, err := dev.ReadAt(b, off); err != nil {
			return out, fmt.Errorf("pages: reading root slot %d: %w", i, err)
		}
		r, err := decodeRoot(b, off, lay)
		if err == nil && r.Gen%2 != uint64(i) {
			err = ondisk.Corruptf("index root", off, PageSize, "generation %d in slot %d", r.Gen, i)
		}
		out[i] = RootSlot{Root: r, Err: err, Zero: err != nil && ondisk.IsZero(b)}
	}
	return out, nil
}

// Verify reads back from the device every page the durable root names:
// each tree's inner pages and leaves, the bucket table's directory and
// table pages. Each page is verified against its parent's pointer (page
// number, generation, checksum), kind, level and tree, and its slots'
// order (Page.Verify); each child's keys against the range its parent
// gives it; each tree's slot count against the root's; the table's
// shape against its bucket count. progress, if not nil, is called after
// each page with the pages verified and the total (known once the inner
// pages are read). The first failure is returned, a corruption error
// (IsCorruption) for damage. Verify reads the device only: it does not
// use or change the page cache, and it sees the durable root, not what
// changed since.
func (st *Store) Verify(progress func(done, total int64)) (Counts, error) {
	var c Counts
	type bound struct {
		key Key
		set bool
	}
	type leafRef struct {
		ptr    Ptr
		tree   uint16
		key    Key    // the parent's key for it: at most its first slot's
		agg    uint64 // the parent's bound: at most its oldest dirty epoch
		lo, hi bound  // the range its slots' keys lie in
	}
	var leaves []leafRef
	var done int64
	tick := func() {
		done++
		if progress != nil {
			progress(done, c.Pages())
		}
	}
	// The inner pages first (a walk from the root), the leaves they name
	// after: the total is known before the bulk of the reading. A child's
	// range is [its key, the next child's key), the first child's lower
	// end its parent's (Tree.Check).
	var walk func(ptr Ptr, level uint8, tree uint16, lo, hi bound) error
	walk = func(ptr Ptr, level uint8, tree uint16, lo, hi bound) error {
		p, err := st.readPage(ptr, KindInner, level, tree)
		if err != nil {
			return err
		}
		c.Inner++
		off := st.lay.pageOff(ptr.Page)
		n := p.Count()
		for i := range n {
			ch := p.Child(i)
			clo, chi := lo, hi
			if i > 0 {
				clo = bound{ch.Key, true}
			}
			if i+1 < n {
				chi = bound{p.Key(i + 1), true}
			}
			if (lo.set && keyLess(ch.Key, lo.key) && i > 0) || (hi.set && !keyLess(ch.Key, hi.key)) {
				return ondisk.Corruptf("index page", off, PageSize, "inner page %d of tree %#x: child %d keyed outside the range its parent gives", ptr.Page, tree, i)
			}
			if level > 1 {
				if err := walk(ch.Ptr, level-1, tree, clo, chi); err != nil {
					return err
				}
				continue
			}
			leaves = append(leaves, leafRef{ptr: ch.Ptr, tree: tree, key: ch.Key, agg: ch.Agg, lo: clo, hi: chi})
		}
		return nil
	}
	for _, rt := range st.root.Trees {
		if rt.ID == TableTree || rt.Level == 0 {
			continue
		}
		c.Trees++
		if err := walk(rt.Root, rt.Level, rt.ID, bound{}, bound{}); err != nil {
			return c, err
		}
	}
	c.Leaves = int64(len(leaves))
	var tables []RootTree
	for _, rt := range st.root.Trees {
		if rt.ID == TableTree {
			tables = append(tables, rt)
			for _, w := range tableShape(int(rt.Count)) {
				c.Table += int64(w)
			}
		}
	}
	done = c.Inner
	if progress != nil {
		progress(done, c.Pages())
	}
	slots := map[uint16]int64{}
	var prev Key
	var prevTree uint16
	for i, l := range leaves {
		p, err := st.readPage(l.ptr, KindLeaf, 0, l.tree)
		if err != nil {
			return c, err
		}
		off := st.lay.pageOff(l.ptr.Page)
		bad := func(format string, args ...any) (Counts, error) {
			return c, ondisk.Corruptf("index page", off, PageSize, "leaf page %d of tree %#x: %s", l.ptr.Page, l.tree, fmt.Sprintf(format, args...))
		}
		sup := l.tree&SupTree != 0
		if keyLess(p.SlotKey(0, sup), l.key) {
			return bad("first slot below its parent's key")
		}
		if m := p.MinEpoch(); l.agg > m {
			return bad("its parent's bound %d is above its oldest dirty epoch %d", l.agg, m)
		}
		for j := range p.Count() {
			k := p.SlotKey(j, sup)
			if (l.lo.set && keyLess(k, l.lo.key)) || (l.hi.set && !keyLess(k, l.hi.key)) {
				return bad("slot %d outside the key range its parent gives", j)
			}
			if (i > 0 || j > 0) && prevTree == l.tree && !keyLess(prev, k) {
				return bad("slot %d not after the previous leaf's last", j)
			}
			prev, prevTree = k, l.tree
		}
		slots[l.tree] += int64(p.Count())
		c.Slots += int64(p.Count())
		tick()
	}
	for _, rt := range st.root.Trees {
		if rt.ID != TableTree && slots[rt.ID] != int64(rt.Count) {
			return c, ondisk.Corruptf("index root", -1, PageSize, "tree %#x: the root says %d slots, its leaves hold %d", rt.ID, rt.Count, slots[rt.ID])
		}
	}
	for _, rt := range tables {
		// loadTable's checks, into a table not kept.
		v := &Store{dev: st.dev, lay: st.lay, alloc: NewAlloc(st.lay.Pages)}
		if _, err := v.loadTable(rt, map[uint32]uint64{}); err != nil {
			return c, err
		}
		for range c.Table {
			tick()
		}
	}
	return c, nil
}
