package index

// ptree is a volume's index: an ordered map from LBA to ent, kept as a
// copy-on-write B+tree whose leaves are packed sorted arrays. stree, the
// volume's superseded versions ordered by (LBA, cache block), is the same
// B+tree with the same slots and another order (sleaf).
//
// Why not a generic B-tree of ent: an ent is 16 bytes in memory (13 carry
// information: a 40-bit LBA, the 32-bit cache block with its dirty bit and
// the 32-bit checksum), and a B-tree that splits full nodes in the middle
// stays about 70 % full under random inserts, so google/btree cost about 25
// bytes per cached block. Here a leaf stores the fields as separate arrays
// (11 bytes a slot, no padding: see pleaf), and a full leaf first hands entries to a
// sibling with room, then splits two full leaves into three (2/3 full each),
// so that random inserts keep leaves above 2/3 and on average near 80 % full;
// appending past the last entry of the tree (LBA-ordered inserts) and bulk
// loading (recovery) fill leaves completely.
//
// Copy-on-write: Clone shares every node; each tree then copies a node
// before its first change (the node's cow tag is not the tree's), so a
// checkpoint can take a snapshot under Set.mu in O(1) and encode it outside.
//
// Summaries: every inner node keeps, per child, agg: a lower bound of a
// value (uint64) of the elements under the child. The index uses the flush
// epoch of each dirty entry (clean: MaxUint64), so epoch-ordered writeback
// finds the dirty entries of the oldest epoch by descending only into
// children whose bound is not above it, instead of keeping every dirty
// block a second time in an (epoch, LBA) tree (13 bytes a dirty block).
// The bound is kept only on insert (min with the new element's value),
// never raised by a removal, a clean mark or a split, so no write has to
// look up the values of other elements (a leaf's values are flush epochs
// of blocks spread over the whole cache). It is raised lazily: MinAgg
// scans the leaf its bounds point at, and if its exact minimum is higher,
// stores it and tries again. A bound that is too high would hide entries
// from writeback; check(sum) verifies every bound against the exact values.
//
// Structural invariants (ptree.check): all leaves at the same depth; a leaf
// holds 1..leafCap entries in strictly increasing LBA order; an inner node
// holds 1..fanout children; every entry under child i of an inner node is
// >= keys[i] (i > 0) and < keys[i+1]; length counts the entries.

import (
	"fmt"
	"math"
)

const (
	// leafCap: a leaf is 8+8+2+2+1+3*183 (+2 padding) +2*4*183 = 2036
	// bytes: with the 8-byte header Go puts before an object with
	// pointers larger than 512 bytes, just under the 2048-byte size class.
	LeafCap = 183
	fanout  = 64
	// leafBulkFill: bulk loading leaves a little room so that the first
	// random inserts after recovery move entries to a neighbour instead of
	// splitting at once.
	LeafBulkFill = LeafCap - LeafCap/16
	// maxIndexLBA bounds the LBAs a leaf can store (40 bits).
	MaxLBA = 1 << 40
)

type cowCtx struct{ _ int } // not zero-sized: every context has its own address

// leafOps is what the B+tree needs of a packed leaf type holding elements E.
type leafOps[E any] interface {
	cowp() **cowCtx
	count() int
	capacity() int
	less(a, b E) bool // the order; must not use the receiver (called on nil)
	search(k E) (int, bool)
	get(i int) E
	set(i int, e E)
	insertAt(i int, e E)
	removeAt(i int)
	setCount(n int)
	reset() // before the leaf is refilled (fillLeaf)
	own()   // after the leaf was copied (copy-on-write)
}

type leafPtr[L, E any] interface {
	*L
	leafOps[E]
}

// pleaf is a leaf of ptree: 11 bytes a slot. An LBA is 40 bits: the low 24
// are stored per slot (lo, 3 bytes); the high 16 are shared by the leaf's
// entries (hi) while they agree, which they do unless the leaf spans a
// multiple of 2^24 blocks (64 GiB): a leaf holds ~160 neighbouring cached
// blocks, so only a very sparse cache (under one cached block in 100,000)
// or a leaf that happens to straddle such a boundary needs them per slot
// (his, allocated then).
type pleaf struct {
	cow   *cowCtx
	his   *[LeafCap]uint16 // per-slot LBA bits 24..39, when not shared
	n     uint16
	hi    uint16 // LBA bits 24..39 of every entry (his == nil)
	hiSet bool   // hi is set (a leaf being filled takes its first entry's)
	lo    [3 * LeafCap]uint8
	loc   [LeafCap]uint32 // cache block | dirtyBit
	crc   [LeafCap]uint32
}

func (l *pleaf) cowp() **cowCtx   { return &l.cow }
func (l *pleaf) count() int       { return int(l.n) }
func (l *pleaf) setCount(n int)   { l.n = uint16(n) }
func (*pleaf) capacity() int      { return LeafCap }
func (*pleaf) less(a, b Ent) bool { return a.LBA < b.LBA }

func (l *pleaf) key(i int) uint64 {
	h := l.hi
	if l.his != nil {
		h = l.his[i]
	}
	lo := l.lo[3*i : 3*i+3 : 3*i+3]
	return uint64(h)<<24 | uint64(lo[2])<<16 | uint64(lo[1])<<8 | uint64(lo[0])
}

func (l *pleaf) get(i int) Ent { return Ent{LBA: l.key(i), Loc: l.loc[i], CRC: l.crc[i]} }

func (l *pleaf) set(i int, e Ent) {
	h := uint16(e.LBA >> 24)
	switch {
	case l.his != nil:
		l.his[i] = h
	case !l.hiSet:
		l.hi, l.hiSet = h, true
	case h != l.hi:
		his := new([LeafCap]uint16)
		for j := range his {
			his[j] = l.hi
		}
		his[i] = h
		l.his = his
	}
	lo := l.lo[3*i : 3*i+3 : 3*i+3]
	lo[0], lo[1], lo[2] = uint8(e.LBA), uint8(e.LBA>>8), uint8(e.LBA>>16)
	l.loc[i], l.crc[i] = e.Loc, e.CRC
}

// reset forgets the shared LBA bits before the leaf is refilled.
func (l *pleaf) reset() { l.his, l.hiSet = nil, false }

// own gives a copied leaf its own per-slot array.
func (l *pleaf) own() {
	if l.his != nil {
		c := *l.his
		l.his = &c
	}
}

// search returns the first slot whose key is >= k.lba, and whether it is k.lba.
func (l *pleaf) search(k Ent) (int, bool) {
	lo, hi := 0, int(l.n)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if l.key(m) < k.LBA {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < int(l.n) && l.key(lo) == k.LBA
}

func (l *pleaf) insertAt(i int, e Ent) {
	n := int(l.n)
	if l.his != nil {
		copy(l.his[i+1:n+1], l.his[i:n])
	}
	copy(l.lo[3*(i+1):3*(n+1)], l.lo[3*i:3*n])
	copy(l.loc[i+1:n+1], l.loc[i:n])
	copy(l.crc[i+1:n+1], l.crc[i:n])
	l.set(i, e)
	l.n++
}

func (l *pleaf) removeAt(i int) {
	n := int(l.n)
	if l.his != nil {
		copy(l.his[i:n-1], l.his[i+1:n])
	}
	copy(l.lo[3*i:3*(n-1)], l.lo[3*(i+1):3*n])
	copy(l.loc[i:n-1], l.loc[i+1:n])
	copy(l.crc[i:n-1], l.crc[i+1:n])
	l.n--
}

// sleaf is a leaf of stree, the superseded versions of a volume (epoch
// order): the same packed slots as pleaf, holding {lba, cache block, crc}
// ordered by (lba, cache block), since an LBA can have several superseded
// versions (of different epochs). The version's epoch is its cache
// block's (Set.blockEpoch), not stored again.
type sleaf struct{ pleaf }

func (*sleaf) less(a, b Ent) bool { return supLess(a, b) }

func supLess(a, b Ent) bool { return a.LBA < b.LBA || (a.LBA == b.LBA && a.Loc < b.Loc) }

func (l *sleaf) search(k Ent) (int, bool) {
	lo, hi := 0, int(l.n)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if supLess(l.get(m), k) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < int(l.n) && !supLess(k, l.get(lo))
}

// Ptree is the index of a volume (ent by LBA); Stree its superseded versions.
type (
	Ptree = bptree[Ent, pleaf, *pleaf]
	Stree = bptree[Ent, sleaf, *sleaf]
)

func NewPtree() *Ptree { return &Ptree{cow: new(cowCtx)} }
func NewStree() *Stree { return &Stree{cow: new(cowCtx)} }

// fillLeaf replaces the leaf's elements with es.
func fillLeaf[E any, PL leafOps[E]](l PL, es []E) {
	l.reset()
	for i, e := range es {
		l.set(i, e)
	}
	l.setCount(len(es))
}

func appendLeaf[E any, PL leafOps[E]](l PL, es []E) []E {
	for i := 0; i < l.count(); i++ {
		es = append(es, l.get(i))
	}
	return es
}

type bnode[E, L any, PL leafPtr[L, E]] struct {
	cow    *cowCtx
	n      int
	leaves bool                     // children are leaves (lvs), else inner nodes (kids)
	keys   [fanout]E                // keys[i]: lower bound of child i (keys[0] is not used)
	kids   [fanout]*bnode[E, L, PL] // inner children
	lvs    [fanout]PL               // leaf children
	// stubs[i] is leaf child i when it is not resident (lvs[i] nil):
	// where the tree's loader finds it (lazy.go).
	stubs [fanout]*stub[L]
	// agg[i] is a lower bound of the summary values of the elements under
	// child i (see "Summaries" above).
	agg [fanout]uint64
}

// minAgg returns the smallest of the node's children's summaries.
func (nd *bnode[E, L, PL]) minAgg() uint64 {
	m := uint64(math.MaxUint64)
	for _, a := range nd.agg[:nd.n] {
		m = min(m, a)
	}
	return m
}

// childIndex returns the child whose range holds k.
func (nd *bnode[E, L, PL]) childIndex(k E) int {
	var pl PL
	lo, hi := 0, nd.n-1 // first j in [0, n-1) with keys[j+1] > k
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if pl.less(k, nd.keys[m+1]) {
			hi = m
		} else {
			lo = m + 1
		}
	}
	return lo
}

func (nd *bnode[E, L, PL]) insertChild(j int, key E, kid *bnode[E, L, PL], lf PL, agg uint64) {
	n := nd.n
	copy(nd.keys[j+1:n+1], nd.keys[j:n])
	copy(nd.kids[j+1:n+1], nd.kids[j:n])
	copy(nd.lvs[j+1:n+1], nd.lvs[j:n])
	copy(nd.stubs[j+1:n+1], nd.stubs[j:n])
	copy(nd.agg[j+1:n+1], nd.agg[j:n])
	nd.keys[j], nd.kids[j], nd.lvs[j], nd.stubs[j], nd.agg[j] = key, kid, lf, nil, agg
	nd.n++
}

func (nd *bnode[E, L, PL]) removeChild(j int) {
	n := nd.n
	copy(nd.keys[j:n-1], nd.keys[j+1:n])
	copy(nd.kids[j:n-1], nd.kids[j+1:n])
	copy(nd.lvs[j:n-1], nd.lvs[j+1:n])
	copy(nd.stubs[j:n-1], nd.stubs[j+1:n])
	copy(nd.agg[j:n-1], nd.agg[j+1:n])
	nd.kids[n-1], nd.lvs[n-1], nd.stubs[n-1] = nil, nil, nil
	nd.n--
}

// bptree is the copy-on-write B+tree described at the top of the file.
type bptree[E, L any, PL leafPtr[L, E]] struct {
	root    *bnode[E, L, PL]
	length  int
	cow     *cowCtx
	scratch []E // overflow's buffer, kept between calls (not shared by clones)
	// lazy: the loader of the tree's stubs and its counters, shared by
	// clones (nil: every leaf resident; lazy.go).
	lazy *lazyState[L]
	// ferr: the first leaf an operation could not load since the last
	// TakeFault (lazy.go; not shared by clones).
	ferr error
}

// Len returns the number of elements.
func (t *bptree[E, L, PL]) Len() int { return t.length }

// Clone returns a copy of t in O(1); both trees copy shared nodes lazily.
func (t *bptree[E, L, PL]) Clone() *bptree[E, L, PL] {
	c := &bptree[E, L, PL]{root: t.root, length: t.length, cow: new(cowCtx), lazy: t.lazy}
	t.cow = new(cowCtx)
	return c
}

func (t *bptree[E, L, PL]) mutNode(nd *bnode[E, L, PL]) *bnode[E, L, PL] {
	if nd.cow == t.cow {
		return nd
	}
	c := new(bnode[E, L, PL])
	*c = *nd
	c.cow = t.cow
	return c
}

func (t *bptree[E, L, PL]) mutLeaf(l PL) PL {
	if *l.cowp() == t.cow {
		return l
	}
	c := PL(new(L))
	*c = *l
	c.own()
	*c.cowp() = t.cow
	return c
}

func (t *bptree[E, L, PL]) newLeaf() PL {
	l := PL(new(L))
	*l.cowp() = t.cow
	return l
}

func (t *bptree[E, L, PL]) leafOf(k E) PL {
	nd := t.root
	for !nd.leaves {
		nd = nd.kids[nd.childIndex(k)]
	}
	return t.leafAt(nd, nd.childIndex(k))
}

// Get returns the element equal to e (in the tree's order).
func (t *bptree[E, L, PL]) Get(e E) (E, bool) {
	var zero E
	if t.root == nil {
		return zero, false
	}
	l := t.leafOf(e)
	if i, ok := l.search(e); ok {
		return l.get(i), true
	}
	return zero, false
}

// Min returns the first element.
func (t *bptree[E, L, PL]) Min() (E, bool) {
	var zero E
	if t.root == nil {
		return zero, false
	}
	nd := t.root
	for !nd.leaves {
		nd = nd.kids[0]
	}
	l := t.leafAt(nd, 0)
	if l.count() == 0 {
		return zero, false // could not be loaded (TakeFault)
	}
	return l.get(0), true
}

type pathStep[E, L any, PL leafPtr[L, E]] struct {
	nd *bnode[E, L, PL]
	i  int
}

// mutPath makes the path from the root to the leaf holding k writable and
// returns it (the last step's node has leaf children) and the leaf: nil if
// it cannot be loaded (TakeFault).
func (t *bptree[E, L, PL]) mutPath(k E, path []pathStep[E, L, PL]) ([]pathStep[E, L, PL], PL) {
	t.root = t.mutNode(t.root)
	nd := t.root
	for {
		i := nd.childIndex(k)
		path = append(path, pathStep[E, L, PL]{nd, i})
		if nd.leaves {
			return path, t.mutLeafAt(nd, i)
		}
		c := t.mutNode(nd.kids[i])
		nd.kids[i] = c
		nd = c
	}
}

// ReplaceOrInsert sets the element equal to e to e and returns the
// previous one. The summaries on its path become 0 (a valid lower bound
// of anything): trees that use summaries call ReplaceOrInsertAgg.
func (t *bptree[E, L, PL]) ReplaceOrInsert(e E) (E, bool) {
	return t.ReplaceOrInsertAgg(e, 0)
}

// ReplaceOrInsertAgg is ReplaceOrInsert for an element whose summary value
// is v (or any lower bound of it).
func (t *bptree[E, L, PL]) ReplaceOrInsertAgg(e E, v uint64) (E, bool) {
	var zero E
	if t.root == nil {
		l := t.newLeaf()
		l.insertAt(0, e)
		t.root = &bnode[E, L, PL]{cow: t.cow, n: 1, leaves: true}
		t.root.lvs[0] = l
		t.root.agg[0] = v
		t.length = 1
		return zero, false
	}
	var buf [8]pathStep[E, L, PL]
	path, l := t.mutPath(e, buf[:0])
	if l == nil {
		return zero, false // not changed: its leaf cannot be loaded
	}
	for _, st := range path {
		st.nd.agg[st.i] = min(st.nd.agg[st.i], v)
	}
	p, found := l.search(e)
	if found {
		old := l.get(p)
		l.set(p, e)
		return old, true
	}
	t.length++
	if l.count() < l.capacity() {
		l.insertAt(p, e)
		return zero, false
	}
	t.overflow(path, l, p, e)
	return zero, false
}

// overflow inserts e at slot p of the full leaf l (child i of the last node
// of path): into a sibling with room if there is one, else by a 2-to-3
// split with a full sibling (a 1-to-2 split for an only child, and a
// lopsided one when appending past the end of the last leaf of a node).
func (t *bptree[E, L, PL]) overflow(path []pathStep[E, L, PL], l PL, p int, e E) {
	last := path[len(path)-1]
	parent, i := last.nd, last.i
	c := l.capacity()
	if cap(t.scratch) < 3*c+1 {
		t.scratch = make([]E, 0, 3*c+1)
	}
	merged := func(ls ...PL) []E {
		es := t.scratch[:0]
		for _, x := range ls {
			es = appendLeaf[E](x, es)
			if x == l {
				pos := len(es) - l.count() + p
				es = append(es, e)
				copy(es[pos+1:], es[pos:])
				es[pos] = e
			}
		}
		return es
	}
	// Only resident neighbours: a change loads no leaf but its own.
	var left, right PL
	if i > 0 {
		left = t.peekLeaf(parent, i-1)
	}
	if i+1 < parent.n {
		right = t.peekLeaf(parent, i+1)
	}
	// The 2-to-3 split's pair: l and its right neighbour, or its left one
	// for the last child.
	a, sib := i, right
	if i+1 == parent.n {
		a, sib = i-1, left
	}
	switch {
	case right != nil && right.count() < c:
		r := t.ownLeaf(parent, i+1, right)
		es := merged(l, r)
		h := len(es) / 2
		fillLeaf(l, es[:h])
		fillLeaf(r, es[h:])
		parent.keys[i+1] = r.get(0)
		parent.agg[i+1] = min(parent.agg[i+1], parent.agg[i])
	case left != nil && left.count() < c:
		lf := t.ownLeaf(parent, i-1, left)
		es := merged(lf, l)
		h := len(es) / 2
		fillLeaf(lf, es[:h])
		fillLeaf(l, es[h:])
		parent.keys[i] = l.get(0)
		parent.agg[i-1] = min(parent.agg[i-1], parent.agg[i])
	case p == l.count() && i+1 == parent.n:
		nl := t.newLeaf()
		nl.insertAt(0, e)
		t.addChild(path, len(path)-1, i+1, e, nil, nl, parent.agg[i])
	case parent.n > 1 && sib != nil:
		x, y := l, sib
		if a < i {
			x, y = sib, l
		}
		x, y = t.ownLeaf(parent, a, x), t.ownLeaf(parent, a+1, y)
		es := merged(x, y)
		n1 := len(es) / 3
		n2 := (len(es) - n1) / 2
		z := t.newLeaf()
		fillLeaf(x, es[:n1])
		fillLeaf(y, es[n1:n1+n2])
		fillLeaf(z, es[n1+n2:])
		parent.keys[a+1] = y.get(0)
		m := min(parent.agg[a], parent.agg[a+1])
		parent.agg[a], parent.agg[a+1] = m, m
		t.addChild(path, len(path)-1, a+2, z.get(0), nil, z, m)
	default:
		es := merged(l)
		h := len(es) / 2
		z := t.newLeaf()
		fillLeaf(l, es[:h])
		fillLeaf(z, es[h:])
		t.addChild(path, len(path)-1, i+1, z.get(0), nil, z, parent.agg[i])
	}
}

// addChild inserts a child (leaf lf, or inner node kid) with summary agg
// at position j of path[level].nd, splitting nodes up the path as needed.
func (t *bptree[E, L, PL]) addChild(path []pathStep[E, L, PL], level, j int, key E, kid *bnode[E, L, PL], lf PL, agg uint64) {
	nd := path[level].nd
	if nd.n < fanout {
		nd.insertChild(j, key, kid, lf, agg)
		return
	}
	m := fanout / 2
	r := &bnode[E, L, PL]{cow: t.cow, leaves: nd.leaves, n: nd.n - m}
	copy(r.keys[:], nd.keys[m:nd.n])
	copy(r.kids[:], nd.kids[m:nd.n])
	copy(r.lvs[:], nd.lvs[m:nd.n])
	copy(r.stubs[:], nd.stubs[m:nd.n])
	copy(r.agg[:], nd.agg[m:nd.n])
	for x := m; x < nd.n; x++ {
		nd.kids[x], nd.lvs[x], nd.stubs[x] = nil, nil, nil
	}
	nd.n = m
	if j <= m {
		nd.insertChild(j, key, kid, lf, agg)
	} else {
		r.insertChild(j-m, key, kid, lf, agg)
	}
	sep := r.keys[0]
	if level == 0 {
		root := &bnode[E, L, PL]{cow: t.cow, n: 2}
		root.kids[0], root.kids[1] = nd, r
		root.keys[1] = sep
		root.agg[0], root.agg[1] = nd.minAgg(), r.minAgg()
		t.root = root
		return
	}
	t.addChild(path, level-1, path[level-1].i+1, sep, r, nil, r.minAgg())
}

// Delete removes the element equal to e and returns it.
func (t *bptree[E, L, PL]) Delete(e E) (E, bool) {
	if _, ok := t.Get(e); !ok {
		var zero E
		return zero, false // no copy-on-write of the path for a miss
	}
	var buf [8]pathStep[E, L, PL]
	path, l := t.mutPath(e, buf[:0])
	if l == nil {
		var zero E
		return zero, false // its leaf, dropped since Get, could not be loaded again (TakeFault)
	}
	p, _ := l.search(e)
	old := l.get(p)
	l.removeAt(p)
	t.length--
	last := path[len(path)-1]
	parent, i := last.nd, last.i
	c := l.capacity()
	switch {
	case l.count() == 0:
		t.removeChild(path, len(path)-1, i)
	case l.count() < c/4:
		// Merge a sparse leaf into a resident neighbour that has room
		// for it.
		var left, right PL
		if i > 0 {
			left = t.peekLeaf(parent, i-1)
		}
		if i+1 < parent.n {
			right = t.peekLeaf(parent, i+1)
		}
		if right != nil && l.count()+right.count() <= c*3/4 {
			r := right
			for x := 0; x < r.count(); x++ {
				l.insertAt(l.count(), r.get(x))
			}
			parent.agg[i] = min(parent.agg[i], parent.agg[i+1])
			t.removeChild(path, len(path)-1, i+1)
		} else if left != nil && l.count()+left.count() <= c*3/4 {
			lf := t.ownLeaf(parent, i-1, left)
			for x := 0; x < l.count(); x++ {
				lf.insertAt(lf.count(), l.get(x))
			}
			parent.agg[i-1] = min(parent.agg[i-1], parent.agg[i])
			t.removeChild(path, len(path)-1, i)
		}
	}
	return old, true
}

// removeChild drops child j of path[level].nd, removing nodes left empty
// and collapsing a root with one inner child.
func (t *bptree[E, L, PL]) removeChild(path []pathStep[E, L, PL], level, j int) {
	nd := path[level].nd
	nd.removeChild(j)
	if nd.n == 0 {
		if level == 0 {
			t.root = nil
			return
		}
		t.removeChild(path, level-1, path[level-1].i)
		return
	}
	for t.root != nil && !t.root.leaves && t.root.n == 1 {
		t.root = t.root.kids[0]
	}
}

// Ascend calls fn for every element in order until fn returns false.
func (t *bptree[E, L, PL]) Ascend(fn func(E) bool) {
	var zero E
	t.ascend(zero, false, zero, false, math.MaxUint64, false, fn)
}

// AscendResident is Ascend over the resident leaves only: the elements
// of a stub whose leaf is not loaded are skipped, and nothing is loaded.
func (t *bptree[E, L, PL]) AscendResident(fn func(E) bool) {
	var zero E
	t.ascend(zero, false, zero, false, math.MaxUint64, true, fn)
}

// AscendGreaterOrEqual calls fn for the elements from e on.
func (t *bptree[E, L, PL]) AscendGreaterOrEqual(e E, fn func(E) bool) {
	var zero E
	t.ascend(e, true, zero, false, math.MaxUint64, false, fn)
}

// AscendRange calls fn for the elements in [from, to).
func (t *bptree[E, L, PL]) AscendRange(from, to E, fn func(E) bool) {
	t.ascend(from, true, to, true, math.MaxUint64, false, fn)
}

// AscendRangeResident is AscendRange over the resident leaves only: the
// elements of a stub whose leaf is not loaded are skipped, and nothing is
// loaded.
func (t *bptree[E, L, PL]) AscendRangeResident(from, to E, fn func(E) bool) {
	t.ascend(from, true, to, true, math.MaxUint64, true, fn)
}

// ascend walks the elements from from (if hasFrom) to before stop (if
// hasStop), skipping children whose summary is above bound, and with
// resident the leaves not resident (peekLeaf).
func (t *bptree[E, L, PL]) ascend(from E, hasFrom bool, stop E, hasStop bool, bound uint64, resident bool, fn func(E) bool) {
	if t.root == nil {
		return
	}
	var pl PL
	var walk func(nd *bnode[E, L, PL], seek bool) bool
	walk = func(nd *bnode[E, L, PL], seek bool) bool {
		i := 0
		if seek {
			i = nd.childIndex(from)
		}
		for ; i < nd.n; i, seek = i+1, false {
			if hasStop && i > 0 && !pl.less(nd.keys[i], stop) {
				return false
			}
			if nd.agg[i] > bound {
				continue
			}
			if !nd.leaves {
				if !walk(nd.kids[i], seek) {
					return false
				}
				continue
			}
			var l PL
			if resident {
				if l = t.peekLeaf(nd, i); l == nil {
					continue
				}
			} else {
				l = t.leafAt(nd, i)
			}
			p := 0
			if seek {
				p, _ = l.search(from)
			}
			for n := l.count(); p < n; p++ {
				x := l.get(p)
				if hasStop && !pl.less(x, stop) {
					return false
				}
				if !fn(x) {
					return false
				}
			}
		}
		return true
	}
	walk(t.root, hasFrom)
}

// buildPtree bulk-loads a tree from entries in strictly increasing LBA
// order (a checkpoint), with leaves leafBulkFill full.
func BuildPtree(es []Ent, aggs []uint64) *Ptree {
	t := NewPtree()
	t.bulkLoad(es, LeafBulkFill, aggs)
	return t
}

// bulkLoad fills an empty tree from elements in strictly increasing order,
// fill of them a leaf. aggs, if not nil, holds each leaf's summary (leaf k
// holds es[k*fill:(k+1)*fill]); without it the summaries are 0.
func (t *bptree[E, L, PL]) bulkLoad(es []E, fill int, aggs []uint64) {
	if len(es) == 0 {
		return
	}
	var level []*bnode[E, L, PL]
	var cur *bnode[E, L, PL]
	for at := 0; at < len(es); at += fill {
		l := t.newLeaf()
		fillLeaf(l, es[at:min(at+fill, len(es))])
		if cur == nil || cur.n == fanout {
			cur = &bnode[E, L, PL]{cow: t.cow, leaves: true}
			level = append(level, cur)
		}
		var a uint64
		if aggs != nil {
			a = aggs[at/fill]
		}
		cur.insertChild(cur.n, l.get(0), nil, l, a)
	}
	for len(level) > 1 {
		var up []*bnode[E, L, PL]
		cur = nil
		for _, nd := range level {
			if cur == nil || cur.n == fanout {
				cur = &bnode[E, L, PL]{cow: t.cow}
				up = append(up, cur)
			}
			cur.insertChild(cur.n, t.firstKey(nd), nd, nil, nd.minAgg())
		}
		level = up
	}
	t.root = level[0]
	t.length = len(es)
}

func (t *bptree[E, L, PL]) firstKey(nd *bnode[E, L, PL]) E {
	for !nd.leaves {
		nd = nd.kids[0]
	}
	return t.leafAt(nd, 0).get(0)
}

// ptreeStats describes a tree's shape (for the memory measurement).
type TreeStats struct {
	Leaves, Inner, Height int
}

func (t *bptree[E, L, PL]) Stats() (st TreeStats) {
	var walk func(nd *bnode[E, L, PL], depth int)
	walk = func(nd *bnode[E, L, PL], depth int) {
		st.Inner++
		st.Height = max(st.Height, depth+1)
		if nd.leaves {
			st.Leaves += nd.n
			return
		}
		for i := 0; i < nd.n; i++ {
			walk(nd.kids[i], depth+1)
		}
	}
	if t.root != nil {
		walk(t.root, 1)
	}
	return st
}

// check verifies the structural invariants listed at the top of the file.
func (t *bptree[E, L, PL]) Check() error {
	if t.root == nil {
		if t.length != 0 {
			return fmt.Errorf("index: empty tree with length %d", t.length)
		}
		return nil
	}
	var pl PL
	count := 0
	leafDepth := -1
	type bound struct {
		k  E
		ok bool
	}
	var walk func(nd *bnode[E, L, PL], depth int, lo, hi bound) error
	walk = func(nd *bnode[E, L, PL], depth int, lo, hi bound) error {
		if nd.n < 1 || nd.n > fanout {
			return fmt.Errorf("index: inner node with %d children", nd.n)
		}
		for i := 0; i < nd.n; i++ {
			clo, chi := lo, hi
			if i > 0 {
				k := nd.keys[i]
				if (i > 1 && !pl.less(nd.keys[i-1], k)) || (lo.ok && pl.less(k, lo.k)) || (hi.ok && !pl.less(k, hi.k)) {
					return fmt.Errorf("index: separator %v out of order or range at depth %d", k, depth)
				}
				clo = bound{k, true}
			}
			if i+1 < nd.n {
				chi = bound{nd.keys[i+1], true}
			}
			if !nd.leaves {
				if nd.kids[i] == nil {
					return fmt.Errorf("index: missing inner child at depth %d", depth)
				}
				if err := walk(nd.kids[i], depth+1, clo, chi); err != nil {
					return err
				}
				continue
			}
			if (nd.lvs[i] == nil) == (nd.stubs[i] == nil) {
				return fmt.Errorf("index: leaf child at depth %d is neither resident nor a stub, or both", depth)
			}
			l := nd.lvs[i]
			if l == nil {
				var err error
				if l, err = t.fault(nd, i); err != nil {
					return err
				}
			}
			if l.count() < 1 || l.count() > l.capacity() {
				return fmt.Errorf("index: leaf at depth %d missing or with a bad count", depth)
			}
			if leafDepth < 0 {
				leafDepth = depth
			} else if leafDepth != depth {
				return fmt.Errorf("index: leaves at depths %d and %d", leafDepth, depth)
			}
			for p := 0; p < l.count(); p++ {
				k := l.get(p)
				switch {
				case p > 0 && !pl.less(l.get(p-1), k):
					return fmt.Errorf("index: entries out of order at %v", k)
				case clo.ok && pl.less(k, clo.k):
					return fmt.Errorf("index: %v below its separator %v", k, clo.k)
				case chi.ok && !pl.less(k, chi.k):
					return fmt.Errorf("index: %v not below the next separator %v", k, chi.k)
				}
			}
			count += l.count()
		}
		return nil
	}
	if err := walk(t.root, 0, bound{}, bound{}); err != nil {
		return err
	}
	if count != t.length {
		return fmt.Errorf("index: %d entries, length %d", count, t.length)
	}
	return nil
}

// MinAgg returns the smallest summary value of any element (sum gives an
// element's value), raising stale bounds on the way: it follows the
// smallest bound down to a leaf and scans it; if the leaf's exact minimum
// is that bound, it is the tree's minimum (every other bound is at least
// as large), else the leaf's bound and those above it are raised and it
// tries again. Each retry raises a stale bound (a leaf's, or one above it,
// to the exact minimum of its children's bounds), so the work done is
// paid for by earlier removals.
func (t *bptree[E, L, PL]) MinAgg(sum func(E) uint64) (uint64, bool) {
	m, ok, _ := t.minAgg(sum, false)
	return m, ok
}

// StubAt names a stub an operation needs and did not load: its reference
// and a key of its leaf's range (for LoadStubsIn(At, At, ...)).
type StubAt[E any] struct {
	Ref StubRef
	At  E
}

// MinAggResident is MinAgg without loading a leaf: when the smallest
// bound leads to a leaf that is not resident, it returns that leaf's
// stub (need not nil) instead of an answer, having raised only bounds
// it found stale on the way (as MinAgg does). A bad stub's leaf is
// loaded as MinAgg loads it (a fault, noted for TakeFault).
func (t *bptree[E, L, PL]) MinAggResident(sum func(E) uint64) (m uint64, ok bool, need *StubAt[E]) {
	return t.minAgg(sum, true)
}

func (t *bptree[E, L, PL]) minAgg(sum func(E) uint64, resident bool) (uint64, bool, *StubAt[E]) {
	if t.root == nil {
		return 0, false, nil
	}
	var buf [8]pathStep[E, L, PL]
	for {
		bound := t.root.minAgg()
		// Follow the smallest bound, making the path writable (bounds
		// are raised in place).
		path := buf[:0]
		t.root = t.mutNode(t.root)
		nd := t.root
		var at E // a key of the leaf's range: its separator, or the zero key (the smallest)
		for {
			i := 0
			for j := 1; j < nd.n; j++ {
				if nd.agg[j] < nd.agg[i] {
					i = j
				}
			}
			if i > 0 {
				at = nd.keys[i]
			}
			path = append(path, pathStep[E, L, PL]{nd, i})
			if nd.leaves {
				break
			}
			c := t.mutNode(nd.kids[i])
			nd.kids[i] = c
			nd = c
		}
		li := path[len(path)-1].i
		var l PL
		if resident {
			if l = t.peekLeaf(nd, li); l == nil && nd.stubs[li].bad.Load() == nil {
				return 0, false, &StubAt[E]{Ref: nd.stubs[li].ref, At: at}
			}
		}
		if l == nil {
			l = t.leafAt(nd, li)
		}
		m := uint64(math.MaxUint64)
		for p := 0; p < l.count(); p++ {
			m = min(m, sum(l.get(p)))
		}
		if m == bound {
			return m, m != math.MaxUint64, nil
		}
		last := path[len(path)-1]
		last.nd.agg[last.i] = max(last.nd.agg[last.i], m)
		for k := len(path) - 2; k >= 0; k-- {
			st := path[k]
			st.nd.agg[st.i] = max(st.nd.agg[st.i], path[k+1].nd.minAgg())
		}
	}
}

// AscendAggAtMost calls fn, in order from from on, for the elements of
// every leaf whose bound is at most bound (so for every element whose value
// is at most bound, and others of the same leaves), until fn returns false.
func (t *bptree[E, L, PL]) AscendAggAtMost(from E, bound uint64, fn func(E) bool) {
	var zero E
	t.ascend(from, true, zero, false, bound, false, fn)
}

// checkAgg verifies that every summary is a lower bound of the values
// (sum) of the elements under its child.
func (t *bptree[E, L, PL]) CheckAgg(sum func(E) uint64) error {
	if t.root == nil {
		return nil
	}
	var walk func(nd *bnode[E, L, PL]) (uint64, error)
	walk = func(nd *bnode[E, L, PL]) (uint64, error) {
		m := uint64(math.MaxUint64)
		for i := 0; i < nd.n; i++ {
			c := uint64(math.MaxUint64)
			if nd.leaves {
				l := nd.lvs[i]
				if l == nil {
					var err error
					if l, err = t.fault(nd, i); err != nil {
						return 0, err
					}
				}
				for p := 0; p < l.count(); p++ {
					c = min(c, sum(l.get(p)))
				}
			} else {
				var err error
				if c, err = walk(nd.kids[i]); err != nil {
					return 0, err
				}
			}
			if nd.agg[i] > c {
				first := t.firstKeyOf(nd, i)
				return 0, fmt.Errorf("index: summary %d above the minimum %d of the child from %v", nd.agg[i], c, first)
			}
			m = min(m, c)
		}
		return m, nil
	}
	_, err := walk(t.root)
	return err
}

func (t *bptree[E, L, PL]) firstKeyOf(nd *bnode[E, L, PL], i int) E {
	if nd.leaves {
		return t.leafAt(nd, i).get(0)
	}
	return t.firstKey(nd.kids[i])
}
