package index

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// Lazy leaves. A tree built by BuildLazyPtree holds its leaves as stubs:
// a stub names where the leaf is (a StubRef, opaque to the tree: package
// cache puts an index page's number, generation and checksum in it) and
// is loaded by the tree's Loader the first time an operation touches it.
// The inner nodes are built from what the stubs say (each leaf's lower
// key bound and summary), so building reads no leaf.
//
// A stub's loaded leaf is shared by every tree that reaches the stub (a
// snapshot and the live tree, clones of each other) and never changed:
// the first change of it, as of any leaf a tree does not own, works on a
// copy that replaces the stub in the changing tree's (copied) parent. So
// Diff skips a stub both trees reach without loading it, and a loaded
// leaf can be dropped again at any time (the stub stays, and loads it
// anew when touched): the stubs' loaded leaves are a cache, bounded by
// the tree's cap (CLOCK: a leaf touched since the hand last passed it is
// kept once more). A changed leaf is the tree's own, resident until the
// tree is rebuilt; the bound is on the leaves that can be read again.
//
// Loading happens inside the operation that needs it, under the caller's
// lock (Diff, which runs on snapshots outside it, loads too: the stubs'
// state is atomic and the cache has its own lock). A caller that must not
// wait for the loader's I/O under its lock finds the stubs of a range
// under it (StubsIn), has the loader's source read them without it, and
// loads them under it again (LoadStubsIn) before the operation. A leaf that cannot be
// loaded (the loader's error, or ErrBadLeaf) never panics the operation:
// its stub becomes bad for good (every later touch returns the same
// *FaultError without calling the loader again), the tree's OnFault
// callback hears of it once, the operation goes on as if the leaf held no
// element (a change that falls in it is not made), and the operation's
// caller finds the *FaultError in TakeFault. A caller that must not see
// a partial answer faults the leaf in first (Fault) or checks TakeFault
// after the operation. A change never loads a leaf but its own: the
// neighbours a full leaf hands entries to, or a sparse leaf merges with,
// are only those already resident. What a StubRef names must stay
// readable while a stub names it: package cache keeps the page until the
// stub is loaded (its released pages).
// StubRef names a leaf that is not resident, for the tree's Loader.
type StubRef struct{ A, B uint64 }

// LeafStub describes one leaf of a tree built with stubs.
type LeafStub struct {
	// Key is at most the leaf's first element and above every element of
	// the leaves before it (the separator of the leaf).
	Key Ent
	// Agg is a lower bound of the summaries of the leaf's elements.
	Agg uint64
	Ref StubRef
}

// Loader appends the elements of the leaf ref names to dst, in the
// tree's order, and returns the result. It may be called concurrently.
type Loader func(ref StubRef, dst []Ent) ([]Ent, error)

// ErrBadLeaf marks a loaded leaf the tree cannot hold: empty, too many
// elements, out of order or outside its separators.
var ErrBadLeaf = errors.New("index: loaded leaf does not fit its place in the tree")

// FaultError is a leaf that could not be loaded: the stub's reference,
// the LBAs [Lo, Hi) its elements lie in (its separators when the tree was
// built: every element it holds is in them), and the loader's error (or
// ErrBadLeaf).
type FaultError struct {
	Ref    StubRef
	Lo, Hi uint64
	Err    error
}

func (e *FaultError) Error() string {
	return fmt.Sprintf("index: loading the leaf of LBAs [%d,%d) (%+v): %v", e.Lo, e.Hi, e.Ref, e.Err)
}
func (e *FaultError) Unwrap() error { return e.Err }

type stub[L any] struct {
	ref    StubRef
	lo, hi uint64 // the LBAs its elements lie in (FaultError)
	leaf   atomic.Pointer[L]
	bad    atomic.Pointer[FaultError] // its load failed: for good
	used   atomic.Bool                // touched since the cache's hand last passed it
	pinned atomic.Bool                // loaded for good (PinStubs): never dropped
}

// lazyState is a lazy tree's loader and cache of loaded stub leaves,
// shared by its clones.
type lazyState[L any] struct {
	load    Loader
	onFault func(*FaultError) // once per bad stub (nil: none)
	faults  atomic.Uint64     // leaves loaded
	// unloaded counts the stubs (of the tree and its clones) whose leaf
	// is not loaded, bad ones included: 0 once every stub's leaf is
	// resident, so a caller can skip looking for stubs (Unloaded).
	unloaded atomic.Int64
	mu       sync.Mutex
	cap      int
	ring     []*stub[L] // stubs whose leaf is loaded (or being dropped)
	hand     int
}

// BuildLazyPtree returns a tree of the leaves described by stubs (in key
// order), holding length elements in all, none resident: load loads a leaf
// when an operation first needs it, and at most capLeaves loaded leaves
// are kept (at least 1). onFault, if not nil, is called once for each
// stub whose leaf cannot be loaded, in the operation that found it (it
// must not use the tree).
func BuildLazyPtree(stubs []LeafStub, length int, load Loader, capLeaves int, onFault func(*FaultError)) *Ptree {
	t := NewPtree()
	t.lazy = &lazyState[pleaf]{load: load, onFault: onFault, cap: max(capLeaves, 1)}
	t.lazy.unloaded.Store(int64(len(stubs)))
	if len(stubs) == 0 {
		return t
	}
	type built struct {
		nd  *bnode[Ent, pleaf, *pleaf]
		key Ent
	}
	var level []built
	for k, s := range stubs {
		if len(level) == 0 || level[len(level)-1].nd.n == fanout {
			level = append(level, built{&bnode[Ent, pleaf, *pleaf]{cow: t.cow, leaves: true}, s.Key})
		}
		nd := level[len(level)-1].nd
		nd.insertChild(nd.n, s.Key, nil, nil, s.Agg)
		hi := uint64(MaxLBA)
		if k+1 < len(stubs) {
			hi = stubs[k+1].Key.LBA
		}
		nd.stubs[nd.n-1] = &stub[pleaf]{ref: s.Ref, lo: s.Key.LBA, hi: hi}
	}
	for len(level) > 1 {
		var up []built
		for _, b := range level {
			if len(up) == 0 || up[len(up)-1].nd.n == fanout {
				up = append(up, built{&bnode[Ent, pleaf, *pleaf]{cow: t.cow}, b.key})
			}
			nd := up[len(up)-1].nd
			nd.insertChild(nd.n, b.key, b.nd, nil, b.nd.minAgg())
		}
		level = up
	}
	t.root = level[0].nd
	t.length = length
	return t
}

// leafAt returns leaf child i of nd, loading it if it is a stub not
// resident. A leaf that cannot be loaded is noted for TakeFault and reads
// as an empty leaf (a new one, which nothing else reaches).
func (t *bptree[E, L, PL]) leafAt(nd *bnode[E, L, PL], i int) PL {
	if l := nd.lvs[i]; l != nil {
		return l
	}
	l, err := t.fault(nd, i)
	if err != nil {
		t.noteFault(err)
		return PL(new(L))
	}
	return l
}

// peekLeaf returns leaf child i of nd if it is resident (the tree's own
// or a stub's loaded leaf), else nil: it loads nothing.
func (t *bptree[E, L, PL]) peekLeaf(nd *bnode[E, L, PL], i int) PL {
	if l := nd.lvs[i]; l != nil {
		return l
	}
	if s := nd.stubs[i]; s != nil {
		if l := s.leaf.Load(); l != nil {
			s.used.Store(true)
			return PL(l)
		}
	}
	return nil
}

// ownLeaf makes l, the resident leaf child i of nd (a node the tree
// owns), the tree's own for changing: a copy that replaces a stub.
func (t *bptree[E, L, PL]) ownLeaf(nd *bnode[E, L, PL], i int, l PL) PL {
	l = t.mutLeaf(l)
	nd.lvs[i], nd.stubs[i] = l, nil
	return l
}

// mutLeafAt returns leaf child i of nd (a node the tree owns) for
// changing, loading it if it is a stub; nil if it cannot be loaded (noted
// for TakeFault).
func (t *bptree[E, L, PL]) mutLeafAt(nd *bnode[E, L, PL], i int) PL {
	l := nd.lvs[i]
	if l == nil {
		var err error
		if l, err = t.fault(nd, i); err != nil {
			t.noteFault(err)
			return nil
		}
	}
	return t.ownLeaf(nd, i, l)
}

// noteFault records err, a leaf that could not be loaded, for TakeFault
// (the first since the last TakeFault).
func (t *bptree[E, L, PL]) noteFault(err error) {
	if t.ferr == nil {
		t.ferr = err
	}
}

// TakeFault returns the first leaf that could not be loaded (a
// *FaultError) by an operation on t since the last call, or nil, and
// forgets it. A tree without stubs never has one.
func (t *bptree[E, L, PL]) TakeFault() error {
	err := t.ferr
	t.ferr = nil
	return err
}

// fault loads stub child i of nd, or returns its loaded leaf. A stub that
// cannot be loaded is bad for good: its *FaultError, without another
// load.
func (t *bptree[E, L, PL]) fault(nd *bnode[E, L, PL], i int) (PL, error) {
	s := nd.stubs[i]
	if l := s.leaf.Load(); l != nil {
		s.used.Store(true)
		return PL(l), nil
	}
	if fe := s.bad.Load(); fe != nil {
		return nil, fe
	}
	lz := t.lazy
	if lz == nil {
		return nil, &FaultError{Ref: s.ref, Lo: s.lo, Hi: s.hi, Err: fmt.Errorf("%w: a stub in a tree without a loader", ErrBadLeaf)}
	}
	l, err := t.loadStub(nd, i)
	if err != nil {
		fe := &FaultError{Ref: s.ref, Lo: s.lo, Hi: s.hi, Err: err}
		if !s.bad.CompareAndSwap(nil, fe) {
			return nil, s.bad.Load()
		}
		if lz.onFault != nil {
			lz.onFault(fe)
		}
		return nil, fe
	}
	return l, nil
}

// loadStub reads stub child i of nd with the tree's loader and checks the
// leaf against its place in the tree.
func (t *bptree[E, L, PL]) loadStub(nd *bnode[E, L, PL], i int) (PL, error) {
	s := nd.stubs[i]
	lz := t.lazy
	es, err := lz.load(s.ref, nil)
	if err != nil {
		return nil, err
	}
	var pl PL
	if len(es) == 0 || len(es) > pl.capacity() {
		return nil, fmt.Errorf("%w: %d elements", ErrBadLeaf, len(es))
	}
	ents := any(es).([]E)
	for j := 1; j < len(ents); j++ {
		if !pl.less(ents[j-1], ents[j]) {
			return nil, fmt.Errorf("%w: elements out of order", ErrBadLeaf)
		}
	}
	if (i > 0 && pl.less(ents[0], nd.keys[i])) || (i+1 < nd.n && !pl.less(ents[len(ents)-1], nd.keys[i+1])) {
		return nil, fmt.Errorf("%w: elements outside the separators", ErrBadLeaf)
	}
	l := PL(new(L)) // no tree's cow context: a change copies it
	fillLeaf(l, ents)
	if !s.leaf.CompareAndSwap(nil, (*L)(l)) {
		return PL(s.leaf.Load()), nil // loaded meanwhile (Diff, concurrently)
	}
	lz.faults.Add(1)
	lz.unloaded.Add(-1)
	lz.admit(s)
	return l, nil
}

// admit records that s's leaf is loaded, dropping another stub's loaded
// leaf when the cache is full: the first the hand finds untouched since
// it last passed.
func (lz *lazyState[L]) admit(s *stub[L]) {
	lz.mu.Lock()
	defer lz.mu.Unlock()
	if len(lz.ring) < lz.cap {
		lz.ring = append(lz.ring, s)
		return
	}
	for {
		v := lz.ring[lz.hand]
		if v.pinned.Load() {
			// Not the cache's any more: out of the ring.
			last := len(lz.ring) - 1
			lz.ring[lz.hand] = lz.ring[last]
			lz.ring = lz.ring[:last]
			if len(lz.ring) < lz.cap {
				lz.ring = append(lz.ring, s)
				return
			}
			if lz.hand >= len(lz.ring) {
				lz.hand = 0
			}
			continue
		}
		if v.used.Swap(false) {
			lz.hand = (lz.hand + 1) % len(lz.ring)
			continue
		}
		v.leaf.Store(nil)
		lz.unloaded.Add(1)
		lz.ring[lz.hand] = s
		lz.hand = (lz.hand + 1) % len(lz.ring)
		return
	}
}

// Faults returns how many leaves the tree and its clones have loaded.
func (t *bptree[E, L, PL]) Faults() uint64 {
	if t.lazy == nil {
		return 0
	}
	return t.lazy.faults.Load()
}

// Fault makes the leaf that holds or would hold e resident (loading it if
// it is a stub), returning its *FaultError if it cannot be loaded (also
// noted for TakeFault).
func (t *bptree[E, L, PL]) Fault(e E) error {
	if t.root == nil || t.lazy == nil || t.lazy.unloaded.Load() == 0 {
		return nil // every leaf resident: no descent
	}
	nd := t.root
	for !nd.leaves {
		nd = nd.kids[nd.childIndex(e)]
	}
	i := nd.childIndex(e)
	if nd.lvs[i] != nil {
		return nil
	}
	_, err := t.fault(nd, i)
	if err != nil {
		t.noteFault(err)
	}
	return err
}

// Unloaded returns how many stubs of the tree and its clones have no
// leaf loaded (bad ones included); 0 when none has, or the tree has no
// stubs. A stub a clone no longer reaches still counts: the count is an
// upper bound of the tree's own.
func (t *bptree[E, L, PL]) Unloaded() int64 {
	if t.lazy == nil {
		return 0
	}
	return t.lazy.unloaded.Load()
}

// eachLeafIn calls fn for each leaf child (nd, i) of the leaves that
// hold or would hold the elements in [from, to), in order, until fn
// returns false: the leaf of from first, even if to is not above from.
// It skips the children whose summary bound is above bound, as
// AscendAggAtMost does. It loads nothing.
func (t *bptree[E, L, PL]) eachLeafIn(from, to E, bound uint64, fn func(nd *bnode[E, L, PL], i int) bool) {
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
			if !seek && i > 0 && !pl.less(nd.keys[i], to) {
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
			if !fn(nd, i) {
				return false
			}
		}
		return true
	}
	walk(t.root, true)
}

// StubsIn returns the references of the stubs whose leaf is neither
// loaded nor bad among the first max leaves that hold or would hold the
// elements in [from, to) and whose summary bound is at most bound
// (math.MaxUint64: every leaf; else the leaves AscendAggAtMost visits):
// what an operation on the range would load (its start, for a range of
// more leaves). It loads nothing, and visits at most max leaves. Its caller may read them without its lock (the
// loader's reads may run concurrently) and have an operation under the
// lock find them read (LoadStubsIn).
func (t *bptree[E, L, PL]) StubsIn(from, to E, bound uint64, max int) []StubRef {
	if t.lazy == nil || t.lazy.unloaded.Load() == 0 {
		return nil
	}
	var refs []StubRef
	seen := 0
	t.eachLeafIn(from, to, bound, func(nd *bnode[E, L, PL], i int) bool {
		if s := nd.stubs[i]; nd.lvs[i] == nil && s.leaf.Load() == nil && s.bad.Load() == nil {
			refs = append(refs, s.ref)
		}
		seen++
		return seen < max
	})
	return refs
}

// LoadStubsIn loads the leaf of each stub, among the first max leaves
// that hold or would hold the elements in [from, to) with a summary bound
// at most bound (as StubsIn), whose reference want accepts and whose
// leaf is not loaded; it visits at most max leaves. A leaf that cannot be loaded makes its stub bad, as in any
// operation, but is not noted for TakeFault: the operation on the range
// that follows meets it and notes it.
func (t *bptree[E, L, PL]) LoadStubsIn(from, to E, bound uint64, max int, want func(StubRef) bool) {
	if t.lazy == nil {
		return
	}
	seen := 0
	t.eachLeafIn(from, to, bound, func(nd *bnode[E, L, PL], i int) bool {
		if s := nd.stubs[i]; nd.lvs[i] == nil && s.leaf.Load() == nil && want(s.ref) {
			_, _ = t.fault(nd, i)
		}
		seen++
		return seen < max
	})
}

// PinStubs loads, for good, the leaf of every stub of the tree whose
// reference match accepts: it is never dropped from then on, so what the
// reference names need not stay readable (package cache: the stub's page
// was released by the page trees). It loads nothing else.
func (t *bptree[E, L, PL]) PinStubs(match func(StubRef) bool) error {
	var err error
	var walk func(nd *bnode[E, L, PL])
	walk = func(nd *bnode[E, L, PL]) {
		for i := 0; i < nd.n && err == nil; i++ {
			switch {
			case !nd.leaves:
				walk(nd.kids[i])
			case nd.lvs[i] == nil && !nd.stubs[i].pinned.Load() && match(nd.stubs[i].ref):
				// Pinned first: the cache drops no pinned leaf.
				nd.stubs[i].pinned.Store(true)
				if _, err = t.fault(nd, i); err != nil {
					nd.stubs[i].pinned.Store(false)
				}
			}
		}
	}
	if t.root != nil {
		walk(t.root)
	}
	return err
}

// LeafCounts returns the tree's leaves: its own (changed since the tree
// was built, or made since), stubs whose leaf is loaded, and stubs not
// resident. It loads nothing.
func (t *bptree[E, L, PL]) LeafCounts() (own, loaded, stubs int) {
	var walk func(nd *bnode[E, L, PL])
	walk = func(nd *bnode[E, L, PL]) {
		for i := range nd.n {
			switch {
			case !nd.leaves:
				walk(nd.kids[i])
			case nd.lvs[i] != nil:
				own++
			case nd.stubs[i].leaf.Load() != nil:
				loaded++
			default:
				stubs++
			}
		}
	}
	if t.root != nil {
		walk(t.root)
	}
	return own, loaded, stubs
}
