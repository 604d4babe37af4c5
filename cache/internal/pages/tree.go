package pages

import (
	"fmt"
	"math"
	"slices"
)

// Tree is one volume's entries as a B+tree whose leaves are pages: inner
// nodes resident (each also a page on the device), leaves read through
// the store's page cache when clean and held by the tree when changed
// since the last checkpoint.
//
// Copy-on-write: a page on the device is never changed. The first change
// of a leaf or inner node after a checkpoint works on a copy and releases
// the page it came from (Alloc.Release); the next checkpoint writes the
// copy to a free page. So the durable root's pages stay intact until a
// newer root is durable, and a checkpoint writes only the pages changed
// since the last one, plus the inner nodes above them.
//
// Structural invariants (Check): every leaf at depth level of the root;
// every node holds 1..cap children; a leaf 1..LeafCap slots in strictly
// increasing LBA order; every key under child i of a node is >= its key
// and < the key of child i+1; kid.agg <= the oldest dirty epoch under it;
// length counts the slots; every node but the root holds at least 2/5 of
// its capacity (minFill: a leaf 70 slots, an inner node 44 children), a
// root of a level above 1 at least two children, so a tree of n slots
// takes at most n/70 leaves (a single leaf below that). Removals restore
// the bound with a sibling on either side (rebalance).
//
// A Tree is guarded by the caller's lock; every method requires it. Page
// reads happen inside the call (the engine would drop its lock around
// them: docs/CACHE.md).
type Tree struct {
	id     uint16
	st     *Store
	root   *node // nil: empty
	length int
	ndirty int // leaves held changed (not in the cache)
}

type node struct {
	level   int // 1: the children are leaves
	kids    []kid
	dirty   bool // changed since its page was written, or never written
	written bool // ptr names its page
	ptr     Ptr
}

type kid struct {
	key Key
	agg uint64 // lower bound of the oldest dirty epoch under it
	// ptr: the child's page (written: ptr.Gen != 0). For an inner child
	// the node's own ptr is authoritative; this copy is what the parent's
	// page records.
	ptr   Ptr
	node  *node // inner child (level > 1)
	dirty *Page // leaf changed since written (or never written): not in the cache
}

// ID returns the tree's number (the volume slot, | SupTree for its
// superseded versions).
func (t *Tree) ID() uint16 { return t.id }

func (t *Tree) sup() bool { return t.id&SupTree != 0 }

// Len returns the number of slots.
func (t *Tree) Len() int { return t.length }

// Dirty returns the number of leaves changed since the last checkpoint.
func (t *Tree) Dirty() int { return t.ndirty }

func (n *node) childIndex(k Key) int {
	// The last child whose key is <= k (0 if none).
	i, _ := slices.BinarySearchFunc(n.kids, k, func(c kid, k Key) int {
		if keyLess(k, c.key) {
			return 1
		}
		return -1
	})
	return max(i-1, 0)
}

// leaf returns the leaf of kid k for reading.
func (t *Tree) leaf(k *kid) (*Page, error) {
	if k.dirty != nil {
		return k.dirty, nil
	}
	if p, ok := t.st.cache.Get(k.ptr.Page); ok {
		return p, nil
	}
	p, err := t.st.readPage(k.ptr, KindLeaf, 0, t.id)
	if err != nil {
		return nil, err
	}
	t.st.cache.Put(k.ptr.Page, p)
	return p, nil
}

// mutLeaf returns the leaf of kid k for changing: a copy of its page, the
// page released.
func (t *Tree) mutLeaf(k *kid) (*Page, error) {
	if k.dirty != nil {
		return k.dirty, nil
	}
	p, err := t.leaf(k)
	if err != nil {
		return nil, err
	}
	c := new(Page)
	*c = *p
	t.st.cache.Drop(k.ptr.Page)
	t.st.alloc.Release(k.ptr.Page)
	k.dirty = c
	k.ptr = Ptr{}
	t.ndirty++
	return c, nil
}

// touch marks n changed, releasing its page.
func (t *Tree) touch(n *node) {
	if n.dirty {
		return
	}
	n.dirty = true
	if n.written {
		t.st.alloc.Release(n.ptr.Page)
		n.written, n.ptr = false, Ptr{}
	}
}

type step struct {
	n *node
	i int
}

// descend returns the path from the root to the leaf level for key k.
func (t *Tree) descend(k Key, path []step) []step {
	n := t.root
	for {
		i := n.childIndex(k)
		path = append(path, step{n, i})
		if n.level == 1 {
			return path
		}
		n = n.kids[i].node
	}
}

// Get returns the slot of lba (in a tree of live entries).
func (t *Tree) Get(lba uint64) (Slot, bool, error) { return t.GetKey(Key{LBA: lba}) }

// GetKey returns the slot of key k.
func (t *Tree) GetKey(k Key) (Slot, bool, error) {
	if t.root == nil {
		return Slot{}, false, t.st.err
	}
	n := t.root
	for n.level > 1 {
		n = n.kids[n.childIndex(k)].node
	}
	p, err := t.leaf(&n.kids[n.childIndex(k)])
	if err != nil {
		return Slot{}, false, err
	}
	i, ok := p.SearchKey(k, t.sup())
	if !ok {
		return Slot{}, false, nil
	}
	return p.Slot(i), true, nil
}

// Put inserts s, or replaces the slot of its key (its LBA; in a tree of
// superseded versions its LBA and cache block), and returns the slot
// replaced.
func (t *Tree) Put(s Slot) (old Slot, replaced bool, err error) {
	if t.st.err != nil {
		return Slot{}, false, t.st.err
	}
	if err := CheckSlot(s); err != nil {
		return Slot{}, false, err
	}
	agg := uint64(math.MaxUint64)
	if s.Loc&dirtyBit != 0 {
		agg = s.Epoch
	}
	k := SlotKeyOf(s, t.sup())
	if t.root == nil {
		p := new(Page)
		p.Init(KindLeaf, 0, t.id)
		p.InsertSlot(0, s)
		t.root = &node{level: 1, dirty: true, kids: []kid{{key: k, agg: agg, dirty: p}}}
		t.ndirty++
		t.length++
		return Slot{}, false, nil
	}
	var buf [8]step
	path := t.descend(k, buf[:0])
	for _, st := range path {
		t.touch(st.n)
		c := &st.n.kids[st.i]
		c.agg = min(c.agg, agg)
		if keyLess(k, c.key) {
			c.key = k // only child 0 of a node can be above k
		}
	}
	last := path[len(path)-1]
	lk := &last.n.kids[last.i]
	p, err := t.mutLeaf(lk)
	if err != nil {
		return Slot{}, false, err
	}
	i, found := p.SearchKey(k, t.sup())
	if found {
		old = p.Slot(i)
		p.SetSlot(i, s)
		return old, true, nil
	}
	t.length++
	if p.Count() < LeafCap {
		p.InsertSlot(i, s)
		return Slot{}, false, nil
	}
	// Split: the upper half goes to a new leaf after this one.
	r := new(Page)
	r.Init(KindLeaf, 0, t.id)
	half := LeafCap / 2
	for j := half; j < LeafCap; j++ {
		r.InsertSlot(j-half, p.Slot(j))
	}
	for p.Count() > half {
		p.RemoveSlot(p.Count() - 1)
	}
	if i <= half {
		p.InsertSlot(i, s)
	} else {
		r.InsertSlot(i-half, s)
	}
	t.ndirty++
	// Both halves' bounds stay the old one (a lower bound of each).
	t.addKid(path, len(path)-1, kid{key: r.SlotKey(0, t.sup()), agg: lk.agg, dirty: r})
	return Slot{}, false, nil
}

// addKid puts c after path[level]'s child, splitting nodes upwards.
func (t *Tree) addKid(path []step, level int, c kid) {
	for {
		st := path[level]
		n := st.n
		n.kids = slices.Insert(n.kids, st.i+1, c)
		if len(n.kids) <= InnerCap {
			return
		}
		half := len(n.kids) / 2
		r := &node{level: n.level, dirty: true, kids: slices.Clone(n.kids[half:])}
		n.kids = slices.Clip(n.kids[:half])
		rc := kid{key: r.kids[0].key, agg: minAgg(r.kids), node: r}
		if level == 0 {
			t.root = &node{level: n.level + 1, dirty: true, kids: []kid{
				{key: n.kids[0].key, agg: minAgg(n.kids), node: n}, rc}}
			return
		}
		path[level-1].n.kids[path[level-1].i].agg = minAgg(n.kids)
		c, level = rc, level-1
	}
}

func minAgg(ks []kid) uint64 {
	m := uint64(math.MaxUint64)
	for _, k := range ks {
		m = min(m, k.agg)
	}
	return m
}

// Delete removes the slot of lba (in a tree of live entries) and returns
// it.
func (t *Tree) Delete(lba uint64) (Slot, bool, error) { return t.DeleteKey(Key{LBA: lba}) }

// DeleteKey removes the slot of key k and returns it.
func (t *Tree) DeleteKey(k Key) (Slot, bool, error) {
	if t.st.err != nil {
		return Slot{}, false, t.st.err
	}
	if t.root == nil {
		return Slot{}, false, nil
	}
	var buf [8]step
	path := t.descend(k, buf[:0])
	last := path[len(path)-1]
	lk := &last.n.kids[last.i]
	// Look first: a miss changes nothing.
	p, err := t.leaf(lk)
	if err != nil {
		return Slot{}, false, err
	}
	if _, ok := p.SearchKey(k, t.sup()); !ok {
		return Slot{}, false, nil
	}
	for _, st := range path {
		t.touch(st.n)
	}
	if p, err = t.mutLeaf(lk); err != nil {
		return Slot{}, false, err
	}
	i, _ := p.SearchKey(k, t.sup())
	old := p.Slot(i)
	p.RemoveSlot(i)
	t.length--
	if err := t.rebalance(path); err != nil {
		return Slot{}, false, err
	}
	return old, true, nil
}

// Fill bounds. Every node but the root holds at least minFill(cap) of its
// cap entries (leaf slots, or inner children), so the pages a tree of n
// slots takes are bounded: at most n/minFill(LeafCap) leaves, each inner
// level at most 1/minFill(InnerCap) of the one below. A node a removal
// leaves below the bound is merged with its left or right sibling (the
// same parent's) when the two fit in mergeInto(cap), else it takes
// entries from the fuller of the two so both hold half of their sum
// (which is then more than mergeInto(cap) >= 2*minFill(cap)). Splits make
// halves of cap/2 (cap+1 entries) >= minFill(cap). The merged node keeps
// cap/8 free, so the next inserts do not split it at once.
func minFill(cap int) int   { return cap * 2 / 5 }
func mergeInto(cap int) int { return cap - cap/8 }

var (
	minLeaf  = minFill(LeafCap)  // 70
	minInner = minFill(InnerCap) // 44
)

// rebalance restores the fill bounds along path after a removal from its
// leaf: an underfull node is merged with or refilled from a sibling, level
// by level up to the root; a root with one inner child is replaced by it,
// and a root leaf left empty empties the tree. The nodes on path are
// touched (changed) already.
func (t *Tree) rebalance(path []step) error {
	for level := len(path) - 1; level >= 0; level-- {
		st := path[level]
		n := st.n
		if level == len(path)-1 {
			p := n.kids[st.i].dirty // the leaf just changed
			switch {
			case p.Count() == 0 && len(n.kids) == 1:
				// Only a root can have a single child (and only a
				// tree read from a device that breaks the bound an
				// inner one): drop it, and the node it empties.
				n.kids = n.kids[:0]
				t.ndirty--
			case p.Count() < minLeaf && len(n.kids) > 1:
				if err := t.fixLeaf(n, st.i); err != nil {
					return err
				}
			default:
				return t.shrinkRoot()
			}
		} else {
			c := n.kids[st.i].node
			switch {
			case len(c.kids) == 0:
				n.kids = slices.Delete(n.kids, st.i, st.i+1)
			case len(c.kids) < minInner && len(n.kids) > 1:
				t.fixInner(n, st.i)
			default:
				return t.shrinkRoot()
			}
		}
	}
	return t.shrinkRoot()
}

// shrinkRoot drops an empty root and replaces a root with a single inner
// child by that child.
func (t *Tree) shrinkRoot() error {
	for t.root != nil && t.root.level > 1 && len(t.root.kids) == 1 {
		t.touch(t.root) // releases its page
		t.root = t.root.kids[0].node
	}
	if t.root != nil && len(t.root.kids) == 0 {
		t.touch(t.root)
		t.root = nil
	}
	return nil
}

// sibling picks the sibling of child i of n to rebalance with: the one
// that fits a merge (the smaller, if both do), else the fuller one. size
// returns a child's entry count.
func sibling(n *node, i, cnt, cap int, size func(j int) (int, error)) (j int, merge bool, err error) {
	fits := func(m int) bool { return cnt+m <= mergeInto(cap) }
	best, bestN := -1, 0
	for _, c := range [2]int{i - 1, i + 1} {
		if c < 0 || c >= len(n.kids) {
			continue
		}
		m, err := size(c)
		if err != nil {
			return 0, false, err
		}
		switch {
		case best < 0,
			fits(m) && !fits(bestN),
			fits(m) && fits(bestN) && m < bestN,
			!fits(m) && !fits(bestN) && m > bestN:
			best, bestN = c, m
		}
	}
	return best, fits(bestN), nil
}

// fixLeaf merges or refills leaf child i of n (changed, underfull) with a
// sibling.
func (t *Tree) fixLeaf(n *node, i int) error {
	cnt := n.kids[i].dirty.Count()
	j, merge, err := sibling(n, i, cnt, LeafCap, func(j int) (int, error) {
		p, err := t.leaf(&n.kids[j])
		if err != nil {
			return 0, err
		}
		return p.Count(), nil
	})
	if err != nil {
		return err
	}
	l, r := min(i, j), max(i, j)
	lp, err := t.mutLeaf(&n.kids[l])
	if err != nil {
		return err
	}
	if merge {
		rp, err := t.leaf(&n.kids[r])
		if err != nil {
			return err
		}
		for k := range rp.Count() {
			lp.InsertSlot(lp.Count(), rp.Slot(k))
		}
		n.kids[l].agg = min(n.kids[l].agg, n.kids[r].agg)
		t.dropLeaf(&n.kids[r])
		n.kids = slices.Delete(n.kids, r, r+1)
		return nil
	}
	rp, err := t.mutLeaf(&n.kids[r])
	if err != nil {
		return err
	}
	half := (lp.Count() + rp.Count()) / 2
	for lp.Count() < half { // right to left
		lp.InsertSlot(lp.Count(), rp.Slot(0))
		rp.RemoveSlot(0)
	}
	for lp.Count() > half { // left to right
		rp.InsertSlot(0, lp.Slot(lp.Count()-1))
		lp.RemoveSlot(lp.Count() - 1)
	}
	n.kids[l].agg, n.kids[r].agg = lp.MinEpoch(), rp.MinEpoch()
	n.kids[r].key = rp.SlotKey(0, t.sup())
	return nil
}

// dropLeaf forgets leaf kid k, merged into its sibling: a held leaf is
// discarded, a written one's page released.
func (t *Tree) dropLeaf(k *kid) {
	if k.dirty != nil {
		k.dirty = nil
		t.ndirty--
		return
	}
	t.st.cache.Drop(k.ptr.Page)
	t.st.alloc.Release(k.ptr.Page)
	k.ptr = Ptr{}
}

// fixInner merges or refills inner child i of n (touched, underfull) with
// a sibling.
func (t *Tree) fixInner(n *node, i int) {
	c := n.kids[i].node
	j, merge, _ := sibling(n, i, len(c.kids), InnerCap, func(j int) (int, error) { return len(n.kids[j].node.kids), nil })
	l, r := min(i, j), max(i, j)
	ln, rn := n.kids[l].node, n.kids[r].node
	t.touch(ln)
	t.touch(rn) // released: merged away, or changed
	if merge {
		ln.kids = append(ln.kids, rn.kids...)
		n.kids[l].agg = min(n.kids[l].agg, n.kids[r].agg)
		n.kids = slices.Delete(n.kids, r, r+1)
		return
	}
	all := append(slices.Clip(ln.kids), rn.kids...)
	half := len(all) / 2
	ln.kids, rn.kids = slices.Clip(all[:half]), slices.Clone(all[half:])
	n.kids[l].agg, n.kids[r].agg = minAgg(ln.kids), minAgg(rn.kids)
	n.kids[r].key = rn.kids[0].key
}

// Ascend calls fn for each slot with LBA >= from, in order, until fn
// returns false.
func (t *Tree) Ascend(from uint64, fn func(Slot) bool) error {
	return t.AscendAggAtMost(from, math.MaxUint64, fn)
}

// AscendKey calls fn for each slot with key >= from, in order, until fn
// returns false.
func (t *Tree) AscendKey(from Key, fn func(Slot) bool) error {
	if t.root == nil {
		return t.st.err
	}
	_, err := t.ascend(t.root, from, math.MaxUint64, fn)
	return err
}

// AscendAggAtMost calls fn, in order from from on, for the slots of every
// leaf whose bound is at most bound (every dirty slot of an epoch at most
// bound, and the other slots of those leaves), until fn returns false. A
// leaf whose bound is higher is not read: writeback finds the oldest
// epoch's blocks from the resident inner nodes.
func (t *Tree) AscendAggAtMost(from, bound uint64, fn func(Slot) bool) error {
	if t.root == nil {
		return t.st.err
	}
	_, err := t.ascend(t.root, Key{LBA: from}, bound, fn)
	return err
}

// OldestEpoch returns the oldest flush epoch of the tree's dirty slots. It
// follows the smallest bound to a leaf; if the leaf's exact minimum is
// higher (a clean mark or a removal left the bound low) it raises the
// bounds on that path, in memory only (a lower bound on the device stays
// valid), and tries again.
func (t *Tree) OldestEpoch() (uint64, bool, error) {
	var buf [8]*kid
	for {
		if t.root == nil {
			return 0, false, t.st.err
		}
		bound := minAgg(t.root.kids)
		if bound == math.MaxUint64 {
			return 0, false, nil
		}
		path := buf[:0]
		n := t.root
		for {
			i := 0
			for j := 1; j < len(n.kids); j++ {
				if n.kids[j].agg < n.kids[i].agg {
					i = j
				}
			}
			path = append(path, &n.kids[i])
			if n.level == 1 {
				break
			}
			n = n.kids[i].node
		}
		lk := path[len(path)-1]
		p, err := t.leaf(lk)
		if err != nil {
			return 0, false, err
		}
		m := p.MinEpoch()
		if m == bound {
			return m, true, nil
		}
		lk.agg = max(lk.agg, m)
		for j := len(path) - 2; j >= 0; j-- {
			path[j].agg = max(path[j].agg, minAgg(path[j].node.kids))
		}
	}
}

func (t *Tree) ascend(n *node, from Key, bound uint64, fn func(Slot) bool) (bool, error) {
	for i := n.childIndex(from); i < len(n.kids); i++ {
		k := &n.kids[i]
		if k.agg > bound {
			continue
		}
		if n.level > 1 {
			if more, err := t.ascend(k.node, from, bound, fn); !more || err != nil {
				return more, err
			}
			continue
		}
		p, err := t.leaf(k)
		if err != nil {
			return false, err
		}
		j, _ := p.SearchKey(from, t.sup())
		for ; j < p.Count(); j++ {
			if !fn(p.Slot(j)) {
				return false, nil
			}
		}
	}
	return true, nil
}

// Check verifies the tree's structural invariants, reading every leaf.
func (t *Tree) Check() error {
	if t.root == nil {
		if t.length != 0 || t.ndirty != 0 {
			return errorf("tree %d: empty with length %d, %d dirty leaves", t.id, t.length, t.ndirty)
		}
		return nil
	}
	var count, dirty int
	var prev *Key
	var walk func(n *node, lo Key, hasLo bool, hi Key, hasHi bool) error
	oneLeaf := t.root.level == 1 && len(t.root.kids) == 1
	walk = func(n *node, lo Key, hasLo bool, hi Key, hasHi bool) error {
		if len(n.kids) == 0 || len(n.kids) > InnerCap {
			return errorf("tree %d: node of level %d with %d children", t.id, n.level, len(n.kids))
		}
		if n != t.root && len(n.kids) < minInner || n == t.root && n.level > 1 && len(n.kids) < 2 {
			return errorf("tree %d: node of level %d with %d children, under the fill bound", t.id, n.level, len(n.kids))
		}
		if !n.dirty && !n.written {
			return errorf("tree %d: clean node of level %d without a page", t.id, n.level)
		}
		for i := range n.kids {
			k := &n.kids[i]
			if i > 0 && !keyLess(n.kids[i-1].key, k.key) {
				return errorf("tree %d: level %d keys out of order", t.id, n.level)
			}
			clo, chasLo := lo, hasLo
			if i > 0 {
				clo, chasLo = k.key, true
			}
			chi, chasHi := hi, hasHi
			if i+1 < len(n.kids) {
				chi, chasHi = n.kids[i+1].key, true
			}
			var minEp uint64
			if n.level > 1 {
				if k.node == nil || k.node.level != n.level-1 || k.dirty != nil {
					return errorf("tree %d: level %d child %d is not a node of level %d", t.id, n.level, i, n.level-1)
				}
				if err := walk(k.node, clo, chasLo, chi, chasHi); err != nil {
					return err
				}
				minEp = t.subtreeMin(k.node)
			} else {
				if k.node != nil || (k.dirty == nil && k.ptr.Gen == 0) {
					return errorf("tree %d: leaf child %d neither held nor written", t.id, i)
				}
				if k.dirty != nil {
					dirty++
				}
				p, err := t.leaf(k)
				if err != nil {
					return err
				}
				if p.Count() == 0 || p.Count() > LeafCap || !oneLeaf && p.Count() < minLeaf {
					return errorf("tree %d: leaf with %d slots (fill bound %d)", t.id, p.Count(), minLeaf)
				}
				if keyLess(p.SlotKey(0, t.sup()), k.key) {
					return errorf("tree %d: leaf child %d key %+v above its first slot", t.id, i, k.key)
				}
				for j := range p.Count() {
					l := p.SlotKey(j, t.sup())
					if prev != nil && !keyLess(*prev, l) {
						return errorf("tree %d: key %+v after %+v", t.id, l, *prev)
					}
					if (chasLo && keyLess(l, clo)) || (chasHi && !keyLess(l, chi)) {
						return errorf("tree %d: key %+v outside its child's key range", t.id, l)
					}
					prev = &l
					count++
				}
				minEp = p.MinEpoch()
			}
			if k.agg > minEp {
				return errorf("tree %d: level %d child %d bound %d above its oldest dirty epoch %d", t.id, n.level, i, k.agg, minEp)
			}
		}
		return nil
	}
	if err := walk(t.root, Key{}, false, Key{}, false); err != nil {
		return err
	}
	if count != t.length || dirty != t.ndirty {
		return errorf("tree %d: %d slots and %d dirty leaves, accounted %d and %d", t.id, count, dirty, t.length, t.ndirty)
	}
	return nil
}

func (t *Tree) subtreeMin(n *node) uint64 {
	m := uint64(math.MaxUint64)
	for i := range n.kids {
		k := &n.kids[i]
		if n.level > 1 {
			m = min(m, t.subtreeMin(k.node))
			continue
		}
		if p, err := t.leaf(k); err == nil {
			m = min(m, p.MinEpoch())
		}
	}
	return m
}

func (t *Tree) String() string {
	h := 0
	if t.root != nil {
		h = t.root.level
	}
	return fmt.Sprintf("tree %d: %d slots, height %d, %d dirty leaves", t.id, t.length, h, t.ndirty)
}
