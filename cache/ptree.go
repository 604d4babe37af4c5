package cache

// ptree is a volume's index: an ordered map from LBA to ent, kept as a
// copy-on-write B+tree whose leaves are packed sorted arrays.
//
// Why not a generic B-tree of ent: an ent is 16 bytes in memory (13 carry
// information: a 40-bit LBA, the 32-bit cache block with its dirty bit and
// the 32-bit checksum), and a B-tree that splits full nodes in the middle
// stays about 70 % full under random inserts, so google/btree cost about 25
// bytes per cached block. Here a leaf stores the fields as separate arrays
// (13 bytes a slot, no padding), and a full leaf first hands entries to a
// sibling with room, then splits two full leaves into three (2/3 full each),
// so that random inserts keep leaves above 2/3 and on average near 80 % full;
// appending past the last entry of the tree (LBA-ordered inserts) and bulk
// loading (recovery) fill leaves completely.
//
// Copy-on-write: Clone shares every node; each tree then copies a node
// before its first change (the node's cow tag is not the tree's), so a
// checkpoint can take a snapshot under Set.mu in O(1) and encode it outside.
//
// Structural invariants (ptree.check): all leaves at the same depth; a leaf
// holds 1..leafCap entries in strictly increasing LBA order; an inner node
// holds 1..fanout children; every entry under child i of an inner node is
// >= keys[i] (i > 0) and < keys[i+1]; length counts the entries.

import (
	"fmt"
	"sort"
)

const (
	// leafCap: a leaf is 8+2+156+3*4*156 = 2040 bytes, just under Go's
	// 2048-byte size class.
	leafCap = 156
	fanout  = 64
	// leafBulkFill: bulk loading leaves a little room so that the first
	// random inserts after recovery move entries to a neighbour instead of
	// splitting at once.
	leafBulkFill = leafCap - leafCap/16
	// maxIndexLBA bounds the LBAs a leaf can store (40 bits).
	maxIndexLBA = 1 << 40
)

type cowCtx struct{ _ int } // not zero-sized: every context has its own address

type pleaf struct {
	cow *cowCtx
	n   uint16
	hi  [leafCap]uint8 // LBA bits 32..39
	lo  [leafCap]uint32
	loc [leafCap]uint32 // cache block | dirtyBit
	crc [leafCap]uint32
}

func (l *pleaf) key(i int) uint64 { return uint64(l.hi[i])<<32 | uint64(l.lo[i]) }

func (l *pleaf) get(i int) ent { return ent{lba: l.key(i), loc: l.loc[i], crc: l.crc[i]} }

func (l *pleaf) set(i int, e ent) {
	l.hi[i], l.lo[i], l.loc[i], l.crc[i] = uint8(e.lba>>32), uint32(e.lba), e.loc, e.crc
}

// search returns the first slot whose key is >= k, and whether it is k.
func (l *pleaf) search(k uint64) (int, bool) {
	lo, hi := 0, int(l.n)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if l.key(m) < k {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < int(l.n) && l.key(lo) == k
}

func (l *pleaf) insertAt(i int, e ent) {
	n := int(l.n)
	copy(l.hi[i+1:n+1], l.hi[i:n])
	copy(l.lo[i+1:n+1], l.lo[i:n])
	copy(l.loc[i+1:n+1], l.loc[i:n])
	copy(l.crc[i+1:n+1], l.crc[i:n])
	l.set(i, e)
	l.n++
}

func (l *pleaf) removeAt(i int) {
	n := int(l.n)
	copy(l.hi[i:n-1], l.hi[i+1:n])
	copy(l.lo[i:n-1], l.lo[i+1:n])
	copy(l.loc[i:n-1], l.loc[i+1:n])
	copy(l.crc[i:n-1], l.crc[i+1:n])
	l.n--
}

// fill replaces the leaf's entries with es.
func (l *pleaf) fill(es []ent) {
	for i, e := range es {
		l.set(i, e)
	}
	l.n = uint16(len(es))
}

func (l *pleaf) appendTo(es []ent) []ent {
	for i := 0; i < int(l.n); i++ {
		es = append(es, l.get(i))
	}
	return es
}

type pnode struct {
	cow    *cowCtx
	n      int
	leaves bool           // children are leaves (lvs), else inner nodes (kids)
	keys   [fanout]uint64 // keys[i]: lower bound of child i (keys[0] is not used)
	kids   [fanout]*pnode // inner children
	lvs    [fanout]*pleaf // leaf children
}

// childIndex returns the child whose range holds k.
func (nd *pnode) childIndex(k uint64) int {
	return sort.Search(nd.n-1, func(j int) bool { return nd.keys[j+1] > k })
}

func (nd *pnode) insertChild(j int, key uint64, kid *pnode, lf *pleaf) {
	n := nd.n
	copy(nd.keys[j+1:n+1], nd.keys[j:n])
	copy(nd.kids[j+1:n+1], nd.kids[j:n])
	copy(nd.lvs[j+1:n+1], nd.lvs[j:n])
	nd.keys[j], nd.kids[j], nd.lvs[j] = key, kid, lf
	nd.n++
}

func (nd *pnode) removeChild(j int) {
	n := nd.n
	copy(nd.keys[j:n-1], nd.keys[j+1:n])
	copy(nd.kids[j:n-1], nd.kids[j+1:n])
	copy(nd.lvs[j:n-1], nd.lvs[j+1:n])
	nd.kids[n-1], nd.lvs[n-1] = nil, nil
	nd.n--
}

type ptree struct {
	root   *pnode
	length int
	cow    *cowCtx
}

func newPtree() *ptree { return &ptree{cow: new(cowCtx)} }

// Len returns the number of entries.
func (t *ptree) Len() int { return t.length }

// Clone returns a copy of t in O(1); both trees copy shared nodes lazily.
func (t *ptree) Clone() *ptree {
	c := &ptree{root: t.root, length: t.length, cow: new(cowCtx)}
	t.cow = new(cowCtx)
	return c
}

func (t *ptree) mutNode(nd *pnode) *pnode {
	if nd.cow == t.cow {
		return nd
	}
	c := new(pnode)
	*c = *nd
	c.cow = t.cow
	return c
}

func (t *ptree) mutLeaf(l *pleaf) *pleaf {
	if l.cow == t.cow {
		return l
	}
	c := new(pleaf)
	*c = *l
	c.cow = t.cow
	return c
}

// Get returns the entry of e.lba.
func (t *ptree) Get(e ent) (ent, bool) {
	nd := t.root
	if nd == nil {
		return ent{}, false
	}
	for !nd.leaves {
		nd = nd.kids[nd.childIndex(e.lba)]
	}
	l := nd.lvs[nd.childIndex(e.lba)]
	if i, ok := l.search(e.lba); ok {
		return l.get(i), true
	}
	return ent{}, false
}

type pathStep struct {
	nd *pnode
	i  int
}

// mutPath makes the path from the root to the leaf holding k writable and
// returns it (the last step's node has leaf children) and the leaf.
func (t *ptree) mutPath(k uint64, path []pathStep) ([]pathStep, *pleaf) {
	t.root = t.mutNode(t.root)
	nd := t.root
	for {
		i := nd.childIndex(k)
		path = append(path, pathStep{nd, i})
		if nd.leaves {
			l := t.mutLeaf(nd.lvs[i])
			nd.lvs[i] = l
			return path, l
		}
		c := t.mutNode(nd.kids[i])
		nd.kids[i] = c
		nd = c
	}
}

// ReplaceOrInsert sets the entry of e.lba to e and returns the previous one.
func (t *ptree) ReplaceOrInsert(e ent) (ent, bool) {
	if e.lba >= maxIndexLBA {
		panic(fmt.Sprintf("cache index: lba %d beyond 40 bits", e.lba)) // volumes are bounded by maxLBABlocks
	}
	if t.root == nil {
		l := &pleaf{cow: t.cow}
		l.insertAt(0, e)
		t.root = &pnode{cow: t.cow, n: 1, leaves: true}
		t.root.lvs[0] = l
		t.length = 1
		return ent{}, false
	}
	var buf [8]pathStep
	path, l := t.mutPath(e.lba, buf[:0])
	p, found := l.search(e.lba)
	if found {
		old := l.get(p)
		l.set(p, e)
		return old, true
	}
	t.length++
	if int(l.n) < leafCap {
		l.insertAt(p, e)
		return ent{}, false
	}
	t.overflow(path, l, p, e)
	return ent{}, false
}

// overflow inserts e at slot p of the full leaf l (child i of the last node
// of path): into a sibling with room if there is one, else by a 2-to-3
// split with a full sibling (a 1-to-2 split for an only child, and a
// lopsided one when appending past the end of the last leaf of a node).
func (t *ptree) overflow(path []pathStep, l *pleaf, p int, e ent) {
	last := path[len(path)-1]
	parent, i := last.nd, last.i
	var scratch [3*leafCap + 1]ent
	merged := func(es []ent, ls ...*pleaf) []ent {
		for _, x := range ls {
			if x == l {
				es = l.appendTo(es)
				pos := len(es) - int(l.n) + p
				es = append(es, ent{})
				copy(es[pos+1:], es[pos:])
				es[pos] = e
			} else {
				es = x.appendTo(es)
			}
		}
		return es
	}
	switch {
	case i+1 < parent.n && int(parent.lvs[i+1].n) < leafCap:
		r := t.mutLeaf(parent.lvs[i+1])
		parent.lvs[i+1] = r
		es := merged(scratch[:0], l, r)
		h := len(es) / 2
		l.fill(es[:h])
		r.fill(es[h:])
		parent.keys[i+1] = r.key(0)
	case i > 0 && int(parent.lvs[i-1].n) < leafCap:
		lf := t.mutLeaf(parent.lvs[i-1])
		parent.lvs[i-1] = lf
		es := merged(scratch[:0], lf, l)
		h := len(es) / 2
		lf.fill(es[:h])
		l.fill(es[h:])
		parent.keys[i] = l.key(0)
	case p == int(l.n) && i+1 == parent.n:
		nl := &pleaf{cow: t.cow}
		nl.insertAt(0, e)
		t.addChild(path, len(path)-1, i+1, e.lba, nl)
	case parent.n > 1:
		a := i
		if i+1 == parent.n {
			a = i - 1
		}
		x := t.mutLeaf(parent.lvs[a])
		y := t.mutLeaf(parent.lvs[a+1])
		parent.lvs[a], parent.lvs[a+1] = x, y
		es := merged(scratch[:0], x, y)
		n1 := len(es) / 3
		n2 := (len(es) - n1) / 2
		z := &pleaf{cow: t.cow}
		x.fill(es[:n1])
		y.fill(es[n1 : n1+n2])
		z.fill(es[n1+n2:])
		parent.keys[a+1] = y.key(0)
		t.addChild(path, len(path)-1, a+2, z.key(0), z)
	default:
		es := merged(scratch[:0], l)
		h := len(es) / 2
		z := &pleaf{cow: t.cow}
		l.fill(es[:h])
		z.fill(es[h:])
		t.addChild(path, len(path)-1, i+1, z.key(0), z)
	}
}

// addChild inserts a child (leaf lf, or inner node kid) at position j of
// path[level].nd, splitting nodes up the path as needed.
func (t *ptree) addChild(path []pathStep, level, j int, key uint64, lf *pleaf) {
	t.addChildNode(path, level, j, key, nil, lf)
}

func (t *ptree) addChildNode(path []pathStep, level, j int, key uint64, kid *pnode, lf *pleaf) {
	nd := path[level].nd
	if nd.n < fanout {
		nd.insertChild(j, key, kid, lf)
		return
	}
	m := fanout / 2
	r := &pnode{cow: t.cow, leaves: nd.leaves, n: nd.n - m}
	copy(r.keys[:], nd.keys[m:nd.n])
	copy(r.kids[:], nd.kids[m:nd.n])
	copy(r.lvs[:], nd.lvs[m:nd.n])
	for x := m; x < nd.n; x++ {
		nd.kids[x], nd.lvs[x] = nil, nil
	}
	nd.n = m
	if j <= m {
		nd.insertChild(j, key, kid, lf)
	} else {
		r.insertChild(j-m, key, kid, lf)
	}
	sep := r.keys[0]
	if level == 0 {
		root := &pnode{cow: t.cow, n: 2}
		root.kids[0], root.kids[1] = nd, r
		root.keys[1] = sep
		t.root = root
		return
	}
	t.addChildNode(path, level-1, path[level-1].i+1, sep, r, nil)
}

// Delete removes the entry of e.lba and returns it.
func (t *ptree) Delete(e ent) (ent, bool) {
	if _, ok := t.Get(e); !ok {
		return ent{}, false // no copy-on-write of the path for a miss
	}
	var buf [8]pathStep
	path, l := t.mutPath(e.lba, buf[:0])
	p, _ := l.search(e.lba)
	old := l.get(p)
	l.removeAt(p)
	t.length--
	last := path[len(path)-1]
	parent, i := last.nd, last.i
	switch {
	case l.n == 0:
		t.removeChild(path, len(path)-1, i)
	case int(l.n) < leafCap/4:
		// Merge a sparse leaf into a neighbour that has room for it.
		if i+1 < parent.n && int(l.n)+int(parent.lvs[i+1].n) <= leafCap*3/4 {
			r := parent.lvs[i+1]
			for x := 0; x < int(r.n); x++ {
				l.set(int(l.n), r.get(x))
				l.n++
			}
			t.removeChild(path, len(path)-1, i+1)
		} else if i > 0 && int(l.n)+int(parent.lvs[i-1].n) <= leafCap*3/4 {
			lf := t.mutLeaf(parent.lvs[i-1])
			parent.lvs[i-1] = lf
			for x := 0; x < int(l.n); x++ {
				lf.set(int(lf.n), l.get(x))
				lf.n++
			}
			t.removeChild(path, len(path)-1, i)
		}
	}
	return old, true
}

// removeChild drops child j of path[level].nd, removing nodes left empty
// and collapsing a root with one inner child.
func (t *ptree) removeChild(path []pathStep, level, j int) {
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

// Ascend calls fn for every entry in LBA order until fn returns false.
func (t *ptree) Ascend(fn func(ent) bool) { t.ascend(0, false, 0, false, fn) }

// AscendGreaterOrEqual calls fn for the entries from e.lba on.
func (t *ptree) AscendGreaterOrEqual(e ent, fn func(ent) bool) { t.ascend(e.lba, true, 0, false, fn) }

// AscendRange calls fn for the entries in [from.lba, to.lba).
func (t *ptree) AscendRange(from, to ent, fn func(ent) bool) {
	t.ascend(from.lba, true, to.lba, true, fn)
}

func (t *ptree) ascend(from uint64, hasFrom bool, stop uint64, hasStop bool, fn func(ent) bool) {
	if t.root == nil {
		return
	}
	var walk func(nd *pnode, seek bool) bool
	walk = func(nd *pnode, seek bool) bool {
		i := 0
		if seek {
			i = nd.childIndex(from)
		}
		for ; i < nd.n; i, seek = i+1, false {
			if hasStop && i > 0 && nd.keys[i] >= stop {
				return false
			}
			if !nd.leaves {
				if !walk(nd.kids[i], seek) {
					return false
				}
				continue
			}
			l := nd.lvs[i]
			p := 0
			if seek {
				p, _ = l.search(from)
			}
			for ; p < int(l.n); p++ {
				x := l.get(p)
				if hasStop && x.lba >= stop {
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
func buildPtree(es []ent) *ptree {
	t := newPtree()
	if len(es) == 0 {
		return t
	}
	var level []*pnode
	var cur *pnode
	for at := 0; at < len(es); at += leafBulkFill {
		l := &pleaf{cow: t.cow}
		l.fill(es[at:min(at+leafBulkFill, len(es))])
		if cur == nil || cur.n == fanout {
			cur = &pnode{cow: t.cow, leaves: true}
			level = append(level, cur)
		}
		cur.insertChild(cur.n, l.key(0), nil, l)
	}
	for len(level) > 1 {
		var up []*pnode
		cur = nil
		for _, nd := range level {
			if cur == nil || cur.n == fanout {
				cur = &pnode{cow: t.cow}
				up = append(up, cur)
			}
			cur.insertChild(cur.n, firstKey(nd), nd, nil)
		}
		level = up
	}
	t.root = level[0]
	t.length = len(es)
	return t
}

func firstKey(nd *pnode) uint64 {
	for !nd.leaves {
		nd = nd.kids[0]
	}
	return nd.lvs[0].key(0)
}

// ptreeStats describes a tree's shape (for the memory measurement).
type ptreeStats struct {
	leaves, inner, height int
}

func (t *ptree) stats() (st ptreeStats) {
	var walk func(nd *pnode, depth int)
	walk = func(nd *pnode, depth int) {
		st.inner++
		st.height = max(st.height, depth+1)
		if nd.leaves {
			st.leaves += nd.n
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
func (t *ptree) check() error {
	if t.root == nil {
		if t.length != 0 {
			return fmt.Errorf("index: empty tree with length %d", t.length)
		}
		return nil
	}
	count := 0
	leafDepth := -1
	var walk func(nd *pnode, depth int, lo uint64, hasLo bool, hi uint64, hasHi bool) error
	walk = func(nd *pnode, depth int, lo uint64, hasLo bool, hi uint64, hasHi bool) error {
		if nd.n < 1 || nd.n > fanout {
			return fmt.Errorf("index: inner node with %d children", nd.n)
		}
		for i := 0; i < nd.n; i++ {
			clo, chasLo := lo, hasLo
			if i > 0 {
				if (i > 1 && nd.keys[i] <= nd.keys[i-1]) || (hasLo && nd.keys[i] < lo) || (hasHi && nd.keys[i] >= hi) {
					return fmt.Errorf("index: separator %d out of order or range at depth %d", nd.keys[i], depth)
				}
				clo, chasLo = nd.keys[i], true
			}
			chi, chasHi := hi, hasHi
			if i+1 < nd.n {
				chi, chasHi = nd.keys[i+1], true
			}
			if !nd.leaves {
				if nd.kids[i] == nil {
					return fmt.Errorf("index: missing inner child at depth %d", depth)
				}
				if err := walk(nd.kids[i], depth+1, clo, chasLo, chi, chasHi); err != nil {
					return err
				}
				continue
			}
			l := nd.lvs[i]
			if l == nil || l.n < 1 || int(l.n) > leafCap {
				return fmt.Errorf("index: leaf at depth %d missing or with a bad count", depth)
			}
			if leafDepth < 0 {
				leafDepth = depth
			} else if leafDepth != depth {
				return fmt.Errorf("index: leaves at depths %d and %d", leafDepth, depth)
			}
			for p := 0; p < int(l.n); p++ {
				k := l.key(p)
				switch {
				case p > 0 && k <= l.key(p-1):
					return fmt.Errorf("index: entries out of order at lba %d", k)
				case chasLo && k < clo:
					return fmt.Errorf("index: lba %d below its separator %d", k, clo)
				case chasHi && k >= chi:
					return fmt.Errorf("index: lba %d not below the next separator %d", k, chi)
				}
			}
			count += int(l.n)
		}
		return nil
	}
	if err := walk(t.root, 0, 0, false, 0, false); err != nil {
		return err
	}
	if count != t.length {
		return fmt.Errorf("index: %d entries, length %d", count, t.length)
	}
	return nil
}
