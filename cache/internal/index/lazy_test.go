package index

import (
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
)

// leafStore is a test's device of leaves: each leaf's elements by
// StubRef, with the loads counted and a failure to inject.
type leafStore struct {
	mu     sync.Mutex
	leaves map[StubRef][]Ent
	loads  int
	fail   StubRef // 0: none
	failed int     // loads of fail
}

func (ls *leafStore) load(ref StubRef, dst []Ent) ([]Ent, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.loads++
	if ref == ls.fail {
		ls.failed++
		return nil, errors.New("injected read error")
	}
	es, ok := ls.leaves[ref]
	if !ok {
		return nil, errors.New("no such leaf")
	}
	return append(dst, es...), nil
}

// stubsOf cuts the sorted entries es into leaves of up to per entries,
// stores them in a new leafStore and returns their stubs (summaries: the
// oldest epoch of the dirty entries, by epoch).
func stubsOf(es []Ent, per int, epoch func(Ent) uint64) (*leafStore, []LeafStub) {
	ls := &leafStore{leaves: map[StubRef][]Ent{}}
	var stubs []LeafStub
	for at := 0; at < len(es); at += per {
		l := es[at:min(at+per, len(es))]
		ref := StubRef{A: uint64(len(stubs) + 1), B: 7}
		agg := uint64(math.MaxUint64)
		for _, e := range l {
			agg = min(agg, epoch(e))
		}
		key := l[0]
		if at > 0 {
			// A separator below the first entry, above the previous leaf's.
			key = Ent{LBA: es[at-1].LBA + 1}
		}
		stubs = append(stubs, LeafStub{Key: Ent{LBA: key.LBA}, Agg: agg, Ref: ref})
		ls.leaves[ref] = l
	}
	return ls, stubs
}

func testEpoch(e Ent) uint64 {
	if !e.Dirty() {
		return math.MaxUint64
	}
	return uint64(e.CRC % 1000)
}

// TestLazyPtreeModel builds trees of stubs (leaves of 1 to 176 entries,
// as index pages hold) and drives them through random inserts, replaces,
// deletes and clones against a map, with caches of a few leaves and of
// all: building loads nothing, a lookup loads at most the one leaf it
// needs, the loaded stub leaves never exceed the cap, and everything else
// behaves as a tree built in memory (ptreeMatches, summaries).
func TestLazyPtreeModel(t *testing.T) {
	for seed := range uint64(12) {
		r := rand.New(rand.NewPCG(seed, 3))
		span := uint64(1 + r.IntN(200000))
		n := r.IntN(int(min(span, 30000)))
		ref := map[uint64]Ent{}
		for range n {
			lba := r.Uint64N(span)
			e := Ent{LBA: lba, Loc: r.Uint32() | uint32(r.IntN(2))<<31, CRC: r.Uint32()}
			ref[lba] = e
		}
		es := sortedEnts(ref)
		per := 1 + r.IntN(176)
		ls, stubs := stubsOf(es, per, testEpoch)
		capLeaves := 1 + r.IntN(8)
		if seed%3 == 0 {
			capLeaves = len(stubs) + 1
		}
		tr := BuildLazyPtree(stubs, len(es), ls.load, capLeaves, nil)
		if ls.loads != 0 || tr.Faults() != 0 {
			t.Fatalf("seed %d: building loaded %d leaves", seed, ls.loads)
		}
		if own, loaded, st := tr.LeafCounts(); own != 0 || loaded != 0 || st != len(stubs) {
			t.Fatalf("seed %d: built %d own, %d loaded, %d stubs of %d", seed, own, loaded, st, len(stubs))
		}
		for range 30 {
			before := ls.loads
			k := r.Uint64N(span + 2)
			e, ok := tr.Get(Ent{LBA: k})
			if w, wok := ref[k]; ok != wok || e != w {
				t.Fatalf("seed %d: Get %d: %+v %t, want %+v %t", seed, k, e, ok, w, wok)
			}
			if ls.loads-before > 1 {
				t.Fatalf("seed %d: a lookup loaded %d leaves", seed, ls.loads-before)
			}
			if _, loaded, _ := tr.LeafCounts(); loaded > capLeaves {
				t.Fatalf("seed %d: %d loaded stub leaves, cap %d", seed, loaded, capLeaves)
			}
		}
		if len(stubs) > 1 {
			if m, ok := tr.MinAgg(testEpoch); ok {
				want := uint64(math.MaxUint64)
				for _, e := range ref {
					want = min(want, testEpoch(e))
				}
				if m != want {
					t.Fatalf("seed %d: MinAgg %d, want %d", seed, m, want)
				}
			}
		}
		snap := tr.Clone()
		snapRef := maps(ref)
		for range r.IntN(3000) {
			lba := r.Uint64N(span + 10)
			switch r.IntN(3) {
			case 0:
				_, ok := tr.Delete(Ent{LBA: lba})
				if _, rok := ref[lba]; ok != rok {
					t.Fatalf("seed %d: Delete %d: %t, want %t", seed, lba, ok, rok)
				}
				delete(ref, lba)
			default:
				e := Ent{LBA: lba, Loc: r.Uint32() | uint32(r.IntN(2))<<31, CRC: r.Uint32()}
				tr.ReplaceOrInsertAgg(e, testEpoch(e))
				ref[lba] = e
			}
		}
		if _, loaded, _ := tr.LeafCounts(); loaded > capLeaves {
			t.Fatalf("seed %d: %d loaded stub leaves, cap %d", seed, loaded, capLeaves)
		}
		// Diff of the snapshot and the tree: exactly the changes.
		got := map[uint64]bool{}
		Diff(snap, tr, func(o, nw Ent, inOld, inNew bool) {
			lba := o.LBA
			if !inOld {
				lba = nw.LBA
			}
			got[lba] = true
			if w, ok := snapRef[lba]; ok != inOld || (ok && w != o) {
				t.Fatalf("seed %d: Diff old side %d: %+v %t, snapshot %+v %t", seed, lba, o, inOld, w, ok)
			}
			if w, ok := ref[lba]; ok != inNew || (ok && w != nw) {
				t.Fatalf("seed %d: Diff new side %d: %+v %t, tree %+v %t", seed, lba, nw, inNew, w, ok)
			}
		})
		for l, e := range ref {
			if w, ok := snapRef[l]; (!ok || w != e) && !got[l] {
				t.Fatalf("seed %d: Diff missed %d", seed, l)
			}
		}
		for l := range snapRef {
			if _, ok := ref[l]; !ok && !got[l] {
				t.Fatalf("seed %d: Diff missed the removal of %d", seed, l)
			}
		}
		if err := tr.CheckAgg(testEpoch); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		ptreeMatches(t, tr, ref, r, span+10)
		ptreeMatches(t, snap, snapRef, r, span+10)
	}
}

func sortedEnts(ref map[uint64]Ent) []Ent {
	tr := NewPtree()
	for _, e := range ref {
		tr.ReplaceOrInsert(e)
	}
	var es []Ent
	tr.Ascend(func(e Ent) bool { es = append(es, e); return true })
	return es
}

// TestLazyDiffSkipsStubs: a snapshot and a tree that changed a few
// entries share every other stub, and Diff loads no stub but those of
// the changed leaves (which the changes loaded already), however many
// there are.
func TestLazyDiffSkipsStubs(t *testing.T) {
	ref := map[uint64]Ent{}
	for i := range uint64(100000) {
		ref[2*i] = Ent{LBA: 2 * i, Loc: uint32(i), CRC: uint32(i)}
	}
	ls, stubs := stubsOf(sortedEnts(ref), 170, testEpoch)
	tr := BuildLazyPtree(stubs, len(ref), ls.load, 1<<20, nil)
	snap := tr.Clone()
	for _, lba := range []uint64{10, 50001, 123456, 199998} {
		tr.ReplaceOrInsertAgg(Ent{LBA: lba, Loc: 1 << 30, CRC: 1}, math.MaxUint64)
	}
	before := ls.loads
	n := 0
	Diff(snap, tr, func(o, nw Ent, inOld, inNew bool) { n++ })
	if n != 4 || ls.loads != before || before > 4 {
		t.Fatalf("Diff reported %d differences and loaded %d leaves (the changes %d), want 4, 0 and at most 4", n, ls.loads-before, before)
	}
	// And a clone of the snapshot without changes: nothing loaded at all.
	a := BuildLazyPtree(stubs, len(ref), ls.load, 1<<20, nil)
	b := a.Clone()
	before = ls.loads
	Diff(a, b, func(o, nw Ent, inOld, inNew bool) { t.Fatal("a difference between a tree and its clone") })
	if ls.loads != before {
		t.Fatalf("Diff of a tree of stubs and its clone loaded %d leaves", ls.loads-before)
	}
}

// TestLazyFaults: a leaf the loader cannot read is an error from Fault,
// and every operation that needs it goes on without it instead of
// panicking: a lookup misses, a walk skips it, a change in it is not made,
// MinAgg does not see it, Check, CheckAgg and Diff return it, and
// TakeFault reports it (its LBAs included) to the operation's caller; the
// stub stays bad without being read again and OnFault hears of it once. A
// loaded leaf that does not fit its separators or is out of order is
// ErrBadLeaf.
func TestLazyFaults(t *testing.T) {
	ref := map[uint64]Ent{}
	for i := range uint64(1000) {
		ref[i] = Ent{LBA: i, Loc: uint32(i) | DirtyBit, CRC: 1}
	}
	ls, stubs := stubsOf(sortedEnts(ref), 100, testEpoch)
	ls.fail = stubs[3].Ref
	var heard []*FaultError
	tr := BuildLazyPtree(stubs, len(ref), ls.load, 4, func(fe *FaultError) { heard = append(heard, fe) })
	if err := tr.Fault(Ent{LBA: 50}); err != nil {
		t.Fatal(err)
	}
	if err := tr.Fault(Ent{LBA: 350}); err == nil {
		t.Fatal("Fault of an unreadable leaf succeeded")
	}
	failed := ls.failed
	took := func(what string) {
		t.Helper()
		var fe *FaultError
		if err := tr.TakeFault(); !errors.As(err, &fe) || fe.Ref != stubs[3].Ref || fe.Lo != 300 || fe.Hi != 400 {
			t.Fatalf("%s over the unreadable leaf: TakeFault %v, want the leaf of [300,400)", what, err)
		}
		if err := tr.TakeFault(); err != nil {
			t.Fatalf("%s: a second TakeFault %v", what, err)
		}
	}
	if _, ok := tr.Get(Ent{LBA: 350}); ok {
		t.Fatal("Get in an unreadable leaf found an entry")
	}
	took("Get")
	n := 0
	tr.Ascend(func(e Ent) bool {
		if e.LBA >= 300 && e.LBA < 400 {
			t.Fatalf("Ascend visited %d of the unreadable leaf", e.LBA)
		}
		n++
		return true
	})
	if n != 900 {
		t.Fatalf("Ascend visited %d entries, want the other 900", n)
	}
	took("Ascend")
	if _, ok := tr.ReplaceOrInsertAgg(Ent{LBA: 333, Loc: 5, CRC: 5}, math.MaxUint64); ok {
		t.Fatal("ReplaceOrInsert in an unreadable leaf replaced an entry")
	}
	took("ReplaceOrInsert")
	if _, ok := tr.Get(Ent{LBA: 333}); ok || tr.Len() != 1000 {
		t.Fatalf("a change in an unreadable leaf was made (length %d)", tr.Len())
	}
	took("Get after the change")
	if _, ok := tr.Delete(Ent{LBA: 334}); ok {
		t.Fatal("Delete in an unreadable leaf deleted")
	}
	took("Delete")
	// Leaves 0..2 are the oldest epochs but for leaf 3's: MinAgg finds
	// the minimum of the others.
	want := uint64(math.MaxUint64)
	for lba, e := range ref {
		if lba < 300 || lba >= 400 {
			want = min(want, testEpoch(e))
		}
	}
	if m, ok := tr.MinAgg(testEpoch); !ok || m != want {
		t.Fatalf("MinAgg %d %t, want %d", m, ok, want)
	}
	_ = tr.TakeFault() // whether MinAgg passed through leaf 3 depends on the bounds
	if err := tr.Check(); err == nil {
		t.Fatal("Check of a tree with an unreadable leaf passed")
	}
	if err := tr.CheckAgg(testEpoch); err == nil {
		t.Fatal("CheckAgg of a tree with an unreadable leaf passed")
	}
	snap := tr.Clone()
	if err := Diff(nil, snap, func(Ent, Ent, bool, bool) {}); err == nil {
		t.Fatal("Diff over an unreadable leaf returned no error")
	}
	if ls.failed != failed {
		t.Fatalf("the bad stub was read %d more times", ls.failed-failed)
	}
	if len(heard) != 1 || heard[0].Ref != stubs[3].Ref {
		t.Fatalf("OnFault heard %v, want the one bad stub once", heard)
	}
	// A leaf holding an entry below its separator.
	ls.fail = StubRef{}
	ls.leaves[stubs[5].Ref] = append([]Ent{{LBA: 1}}, ls.leaves[stubs[5].Ref][1:]...)
	if err := tr.Fault(Ent{LBA: 550}); !errors.Is(err, ErrBadLeaf) {
		t.Fatalf("a leaf outside its separators: %v", err)
	}
	// Out of order.
	l := ls.leaves[stubs[6].Ref]
	l[3], l[4] = l[4], l[3]
	if err := tr.Fault(Ent{LBA: 650}); !errors.Is(err, ErrBadLeaf) {
		t.Fatalf("a leaf out of order: %v", err)
	}
}

// TestLazyPinStubs: a pinned stub's leaf stays loaded however many other
// leaves pass through a cache of one, so what its reference named may go.
func TestLazyPinStubs(t *testing.T) {
	ref := map[uint64]Ent{}
	for i := range uint64(2000) {
		ref[i] = Ent{LBA: i, Loc: uint32(i), CRC: 1}
	}
	ls, stubs := stubsOf(sortedEnts(ref), 100, testEpoch)
	tr := BuildLazyPtree(stubs, len(ref), ls.load, 1, nil)
	if err := tr.PinStubs(func(r StubRef) bool { return r == stubs[3].Ref }); err != nil {
		t.Fatal(err)
	}
	delete(ls.leaves, stubs[3].Ref)
	for i := range uint64(2000) {
		if e, ok := tr.Get(Ent{LBA: (i * 7919) % 2000}); !ok || e != ref[(i*7919)%2000] {
			t.Fatalf("Get %d: %+v %t", (i*7919)%2000, e, ok)
		}
	}
	if own, loaded, st := tr.LeafCounts(); own != 0 || loaded > 2 || st != len(stubs)-loaded {
		t.Fatalf("%d own, %d loaded, %d stubs", own, loaded, st)
	}
}

// TestLazyAscendResident: AscendResident visits the elements of the
// resident leaves only (the tree's own and the stubs' loaded ones) and
// loads nothing.
func TestLazyAscendResident(t *testing.T) {
	ref := map[uint64]Ent{}
	for i := range uint64(1000) {
		ref[i] = Ent{LBA: i, Loc: uint32(i), CRC: 1}
	}
	ls, stubs := stubsOf(sortedEnts(ref), 100, testEpoch)
	tr := BuildLazyPtree(stubs, len(ref), ls.load, 1<<20, nil)
	if err := tr.Fault(Ent{LBA: 250}); err != nil {
		t.Fatal(err)
	}
	tr.ReplaceOrInsertAgg(Ent{LBA: 777, Loc: 5, CRC: 5}, math.MaxUint64)
	loads := ls.loads
	var got []uint64
	tr.AscendResident(func(e Ent) bool { got = append(got, e.LBA); return true })
	if ls.loads != loads {
		t.Fatalf("AscendResident loaded %d leaves", ls.loads-loads)
	}
	if len(got) != 200 || got[0] != 200 || got[99] != 299 || got[100] != 700 || got[199] != 799 {
		t.Fatalf("AscendResident visited %d elements (%v...), want those of leaves 2 and 7", len(got), got[:min(len(got), 3)])
	}
}

// TestLazyLoadOutsideLock: the pieces a caller uses to read leaves
// without its lock. StubsIn names the stubs a range's operation would
// load (none resident or bad, among the first max leaves, the leaf of
// the range's start even for an empty range) and loads nothing;
// LoadStubsIn loads only those its filter accepts, among its first max
// leaves; AscendRangeResident skips the rest;
// MinAggResident names the leaf the oldest epoch is in while it is not
// resident and answers as MinAgg once it is; Unloaded counts down to 0
// as leaves load and up again as the cache drops them.
func TestLazyLoadOutsideLock(t *testing.T) {
	ref := map[uint64]Ent{}
	for i := range uint64(1000) {
		// Dirty, epochs falling with the LBA: the oldest is in the
		// last leaf.
		ref[i] = Ent{LBA: i, Loc: uint32(i) | DirtyBit, CRC: uint32(1999 - i)}
	}
	ls, stubs := stubsOf(sortedEnts(ref), 100, testEpoch)
	tr := BuildLazyPtree(stubs, len(ref), ls.load, 1<<20, nil)
	if n := tr.Unloaded(); n != 10 {
		t.Fatalf("Unloaded %d of a tree of 10 stubs, want 10", n)
	}
	refsIn := func(from, to uint64, max int) []StubRef {
		t.Helper()
		loads := ls.loads
		rs := tr.StubsIn(Ent{LBA: from}, Ent{LBA: to}, math.MaxUint64, max)
		if ls.loads != loads {
			t.Fatalf("StubsIn loaded %d leaves", ls.loads-loads)
		}
		return rs
	}
	if rs := refsIn(150, 420, 64); len(rs) != 4 || rs[0] != stubs[1].Ref || rs[3] != stubs[4].Ref {
		t.Fatalf("StubsIn [150,420): %v, want the stubs of leaves 1-4", rs)
	}
	if rs := refsIn(150, 420, 2); len(rs) != 2 || rs[1] != stubs[2].Ref {
		t.Fatalf("StubsIn [150,420) max 2: %v, want leaves 1-2", rs)
	}
	if rs := refsIn(300, 300, 64); len(rs) != 1 || rs[0] != stubs[3].Ref {
		t.Fatalf("StubsIn [300,300): %v, want leaf 3", rs)
	}
	// Only leaf 2 of [150,420) loaded.
	tr.LoadStubsIn(Ent{LBA: 150}, Ent{LBA: 420}, math.MaxUint64, 1<<30, func(r StubRef) bool { return r == stubs[2].Ref })
	if ls.loads != 1 || tr.Unloaded() != 9 {
		t.Fatalf("LoadStubsIn of one stub: %d loads, %d unloaded, want 1 and 9", ls.loads, tr.Unloaded())
	}
	if rs := refsIn(150, 420, 64); len(rs) != 3 || rs[1] != stubs[3].Ref {
		t.Fatalf("StubsIn [150,420) with leaf 2 loaded: %v, want leaves 1, 3, 4", rs)
	}
	if rs := refsIn(150, 1000, 3); len(rs) != 2 || rs[1] != stubs[3].Ref {
		t.Fatalf("StubsIn [150,1000) max 3 with leaf 2 loaded: %v, want leaves 1, 3 (of leaves 1-3)", rs)
	}
	var got []uint64
	tr.AscendRangeResident(Ent{LBA: 150}, Ent{LBA: 420}, func(e Ent) bool { got = append(got, e.LBA); return true })
	if ls.loads != 1 || len(got) != 100 || got[0] != 200 || got[99] != 299 {
		t.Fatalf("AscendRangeResident [150,420): %d elements from %v, %d loads; want leaf 2's, none", len(got), got[:min(len(got), 1)], ls.loads)
	}
	// The oldest epoch (LBA 999's, 0) is in leaf 9, not resident.
	_, _, need := tr.MinAggResident(testEpoch)
	if need == nil || need.Ref != stubs[9].Ref || ls.loads != 1 {
		t.Fatalf("MinAggResident with leaf 9 not resident: %+v, %d loads; want leaf 9's stub, no load", need, ls.loads)
	}
	tr.LoadStubsIn(need.At, need.At, math.MaxUint64, 1<<30, func(StubRef) bool { return true })
	m, ok, need := tr.MinAggResident(testEpoch)
	if want, wok := tr.Clone().MinAgg(testEpoch); need != nil || !ok || m != want || !wok {
		t.Fatalf("MinAggResident with leaf 9 resident: %d %v %+v, want %d (MinAgg)", m, ok, need, want)
	}
	// A cache of 2 leaves: a load over it drops one.
	ls2, stubs2 := stubsOf(sortedEnts(ref), 100, testEpoch)
	tr2 := BuildLazyPtree(stubs2, len(ref), ls2.load, 2, nil)
	tr2.LoadStubsIn(Ent{LBA: 0}, Ent{LBA: 300}, math.MaxUint64, 1<<30, func(StubRef) bool { return true })
	if ls2.loads != 3 || tr2.Unloaded() != 8 {
		t.Fatalf("3 loads into a cache of 2: %d loads, %d unloaded, want 3 and 8", ls2.loads, tr2.Unloaded())
	}
	// LoadStubsIn visits at most max leaves.
	ls3, stubs3 := stubsOf(sortedEnts(ref), 100, testEpoch)
	tr3 := BuildLazyPtree(stubs3, len(ref), ls3.load, 1<<20, nil)
	tr3.LoadStubsIn(Ent{LBA: 0}, Ent{LBA: 1000}, math.MaxUint64, 3, func(StubRef) bool { return true })
	if ls3.loads != 3 || tr3.Unloaded() != 7 {
		t.Fatalf("LoadStubsIn of 10 leaves with max 3: %d loads, %d unloaded, want 3 and 7", ls3.loads, tr3.Unloaded())
	}
	tr.LoadStubsIn(Ent{LBA: 0}, Ent{LBA: 1000}, math.MaxUint64, 1<<30, func(StubRef) bool { return true })
	if tr.Unloaded() != 0 || tr.StubsIn(Ent{}, Ent{LBA: 1000}, math.MaxUint64, 64) != nil {
		t.Fatalf("every leaf loaded: %d unloaded", tr.Unloaded())
	}
}
