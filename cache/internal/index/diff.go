package index

// Diff calls fn for every element in which two trees differ, in order:
// (old, new, true, true) for an element of the same key whose fields
// changed, (old, _, true, false) for one only in old, (_, new, false,
// true) for one only in new. Subtrees the two trees share (the same node
// or leaf: copy-on-write never changes a node a clone can reach) are
// skipped whole, so comparing a checkpoint's snapshot with the previous
// one costs about the leaves changed between them, not the tree's size.
// Either tree may be nil (empty). Neither may change during the call. A
// leaf that cannot be loaded ends the comparison with its *FaultError
// (fn has then seen only part of the differences).
func Diff(old, new *Ptree, fn func(o, n Ent, inOld, inNew bool)) error {
	_, err := diffTrees(old, new, fn)
	return err
}

// DiffSorted is Diff with old given as its elements in increasing LBA
// order (a checkpoint's entries as read) instead of a tree. It compares
// every element of both; new may be nil (empty) and must not change
// during the call. A leaf of new that cannot be loaded ends it with its
// *FaultError.
func DiffSorted(old []Ent, new *Ptree, fn func(o, n Ent, inOld, inNew bool)) error {
	i := 0
	if new != nil {
		new.Ascend(func(e Ent) bool {
			for ; i < len(old) && old[i].LBA < e.LBA; i++ {
				fn(old[i], Ent{}, true, false)
			}
			if i < len(old) && old[i].LBA == e.LBA {
				if old[i] != e {
					fn(old[i], e, true, true)
				}
				i++
			} else {
				fn(Ent{}, e, false, true)
			}
			return true
		})
		if err := new.TakeFault(); err != nil {
			return err
		}
	}
	for ; i < len(old); i++ {
		fn(old[i], Ent{}, true, false)
	}
	return nil
}

// DiffSup is Diff for trees of superseded versions.
func DiffSup(old, new *Stree, fn func(o, n Ent, inOld, inNew bool)) error {
	_, err := diffTrees(old, new, fn)
	return err
}

// diffTrees returns the number of elements it stepped over one by one.
func diffTrees[L any, PL leafPtr[L, Ent]](a, b *bptree[Ent, L, PL], fn func(o, n Ent, inOld, inNew bool)) (steps int, err error) {
	var ca, cb dcur[L, PL]
	if a != nil {
		ca.t = a
		ca.init(a.root)
	}
	if b != nil {
		cb.t = b
		cb.init(b.root)
	}
	var pl PL
	var sa, sb []any
	for ca.id != nil || cb.id != nil {
		if ca.id != nil && cb.id != nil {
			// The largest subtree starting here in both.
			sa, sb = ca.starts(sa[:0]), cb.starts(sb[:0])
			ia, ib := -1, -1
			for i := len(sa) - 1; i >= 0 && ia < 0; i-- {
				for j := len(sb) - 1; j >= 0; j-- {
					if sa[i] == sb[j] {
						ia, ib = i, j
						break
					}
				}
			}
			if ia >= 0 {
				ca.skip(ia)
				cb.skip(ib)
				continue
			}
		}
		steps++
		// Both current leaves are needed from here on.
		if err := ca.loadErr(); err != nil {
			return steps, err
		}
		if err := cb.loadErr(); err != nil {
			return steps, err
		}
		switch {
		case cb.id == nil || (ca.id != nil && pl.less(ca.cur(), cb.cur())):
			fn(ca.cur(), Ent{}, true, false)
			ca.next()
		case ca.id == nil || pl.less(cb.cur(), ca.cur()):
			fn(Ent{}, cb.cur(), false, true)
			cb.next()
		default:
			if x, y := ca.cur(), cb.cur(); x != y {
				fn(x, y, true, true)
			}
			ca.next()
			cb.next()
		}
	}
	return steps, nil
}

// dcur is Diff's cursor: a position in a tree, the inner nodes above it
// (root first) with the child taken in each. A leaf is known by id (its
// stub if it has one, else the leaf) and loaded only when an element of
// it is needed, so a stub both trees share is skipped without a load.
type dcur[L any, PL leafPtr[L, Ent]] struct {
	t     *bptree[Ent, L, PL]
	stack []dframe[L, PL]
	id    any // the leaf's identity; nil: past the end
	leaf  PL  // the leaf, once loaded (nil: not yet)
	j     int
}

type dframe[L any, PL leafPtr[L, Ent]] struct {
	nd *bnode[Ent, L, PL]
	i  int
}

func (c *dcur[L, PL]) init(root *bnode[Ent, L, PL]) {
	if root == nil || root.n == 0 {
		return
	}
	c.descend(root)
}

// descend goes down the leftmost path of nd to its first leaf.
func (c *dcur[L, PL]) descend(nd *bnode[Ent, L, PL]) {
	for {
		c.stack = append(c.stack, dframe[L, PL]{nd, 0})
		if nd.leaves {
			c.at(nd, 0)
			return
		}
		nd = nd.kids[0]
	}
}

// at puts the cursor on the first element of leaf child i of nd.
func (c *dcur[L, PL]) at(nd *bnode[Ent, L, PL], i int) {
	c.j, c.leaf = 0, nd.lvs[i]
	if c.leaf != nil {
		c.id = c.leaf
	} else {
		c.id = nd.stubs[i]
	}
}

func (c *dcur[L, PL]) load() PL {
	if c.leaf == nil {
		_ = c.loadErr() // an empty leaf if it fails: diffTrees checks first
	}
	return c.leaf
}

// loadErr loads the cursor's leaf if it is not yet (nothing past the
// end), returning the *FaultError of a leaf that cannot be loaded (the
// cursor then holds an empty leaf).
func (c *dcur[L, PL]) loadErr() error {
	if c.id == nil || c.leaf != nil {
		return nil
	}
	f := c.stack[len(c.stack)-1]
	l, err := c.t.fault(f.nd, f.i)
	if err != nil {
		c.leaf = PL(new(L))
		return err
	}
	c.leaf = l
	return nil
}

func (c *dcur[L, PL]) cur() Ent { return c.load().get(c.j) }

func (c *dcur[L, PL]) next() {
	c.j++
	if c.j >= c.load().count() {
		c.nextChild(len(c.stack) - 1)
	}
}

// nextChild moves to the first leaf after the subtree of child stack[k].i
// of stack[k].nd.
func (c *dcur[L, PL]) nextChild(k int) {
	c.stack = c.stack[:k+1]
	for len(c.stack) > 0 {
		f := &c.stack[len(c.stack)-1]
		f.i++
		if f.i < f.nd.n {
			nd := f.nd
			if nd.leaves {
				c.at(nd, f.i)
				return
			}
			c.descend(nd.kids[f.i])
			return
		}
		c.stack = c.stack[:len(c.stack)-1]
	}
	c.id, c.leaf = nil, nil
}

// starts appends the subtrees that begin at the cursor, smallest first:
// the leaf, then each inner node whose first leaf it is.
func (c *dcur[L, PL]) starts(out []any) []any {
	if c.j != 0 {
		return out
	}
	out = append(out, c.id)
	for k := len(c.stack) - 1; k >= 0 && c.stack[k].i == 0; k-- {
		out = append(out, c.stack[k].nd)
	}
	return out
}

// skip moves past the subtree starts returned at index i.
func (c *dcur[L, PL]) skip(i int) {
	// Index 0 is the leaf, child stack[top].i of the bottom node; index
	// i > 0 is stack[top-i+1].nd, the child of stack[top-i].
	c.nextChild(len(c.stack) - 1 - i)
}
