package index

import (
	"math/rand/v2"
	"testing"
)

// TestDiff compares Diff of a snapshot and a later clone with the
// difference of their contents, and checks that a few changes to a large
// tree visit about the changed leaves, not the tree.
func TestDiff(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 1))
		a := NewPtree()
		n := 1 + r.IntN(20000)
		for range n {
			a.ReplaceOrInsert(Ent{LBA: r.Uint64N(40000), Loc: r.Uint32(), CRC: r.Uint32()})
		}
		old := a.Clone()
		want := map[uint64][2]*Ent{}
		oldSet := map[uint64]Ent{}
		old.Ascend(func(e Ent) bool { oldSet[e.LBA] = e; return true })
		k := r.IntN(3000)
		if seed%4 == 0 {
			k = r.IntN(5)
		}
		for range k {
			lba := r.Uint64N(40000)
			if r.IntN(2) == 0 {
				a.Delete(Ent{LBA: lba})
			} else {
				a.ReplaceOrInsert(Ent{LBA: lba, Loc: r.Uint32(), CRC: r.Uint32()})
			}
		}
		newSet := map[uint64]Ent{}
		a.Ascend(func(e Ent) bool { newSet[e.LBA] = e; return true })
		for l, e := range oldSet {
			if f, ok := newSet[l]; !ok || f != e {
				e := e
				w := want[l]
				w[0] = &e
				want[l] = w
			}
		}
		for l, f := range newSet {
			if e, ok := oldSet[l]; !ok || f != e {
				f := f
				w := want[l]
				w[1] = &f
				want[l] = w
			}
		}
		got := 0
		last := int64(-1)
		Diff(old, a, func(o, nw Ent, inOld, inNew bool) {
			got++
			lba := o.LBA
			if !inOld {
				lba = nw.LBA
			}
			if int64(lba) <= last {
				t.Fatalf("seed %d: lba %d out of order", seed, lba)
			}
			last = int64(lba)
			w, ok := want[lba]
			if !ok || (w[0] != nil) != inOld || (w[1] != nil) != inNew || (inOld && *w[0] != o) || (inNew && *w[1] != nw) {
				t.Fatalf("seed %d: lba %d: got (%v %v %v %v), want %v %v", seed, lba, o, nw, inOld, inNew, w[0], w[1])
			}
		})
		if got != len(want) {
			t.Fatalf("seed %d: %d differences, want %d", seed, got, len(want))
		}
		// DiffSorted of old's elements reports exactly what Diff does.
		type rep struct {
			o, n         Ent
			inOld, inNew bool
		}
		var fromTree, fromSorted []rep
		Diff(old, a, func(o, n Ent, inOld, inNew bool) { fromTree = append(fromTree, rep{o, n, inOld, inNew}) })
		var oldEs []Ent
		old.Ascend(func(e Ent) bool { oldEs = append(oldEs, e); return true })
		DiffSorted(oldEs, a, func(o, n Ent, inOld, inNew bool) { fromSorted = append(fromSorted, rep{o, n, inOld, inNew}) })
		if len(fromSorted) != len(fromTree) {
			t.Fatalf("seed %d: DiffSorted %d differences, Diff %d", seed, len(fromSorted), len(fromTree))
		}
		for i := range fromTree {
			if fromSorted[i] != fromTree[i] {
				t.Fatalf("seed %d: difference %d: DiffSorted %+v, Diff %+v", seed, i, fromSorted[i], fromTree[i])
			}
		}
		cnt := 0
		DiffSorted(oldEs, nil, func(_, _ Ent, inOld, inNew bool) {
			if !inOld || inNew {
				t.Fatal("DiffSorted against nil: an element not only in old")
			}
			cnt++
		})
		if cnt != len(oldEs) {
			t.Fatalf("seed %d: DiffSorted against nil: %d, want %d", seed, cnt, len(oldEs))
		}
		// Against an empty tree, and with nil.
		cnt = 0
		Diff(nil, a, func(_, _ Ent, inOld, inNew bool) {
			if inOld || !inNew {
				t.Fatal("nil old tree: element only in old")
			}
			cnt++
		})
		if cnt != a.Len() {
			t.Fatalf("seed %d: diff against nil: %d, want %d", seed, cnt, a.Len())
		}
	}
}

// TestDiffSkipsShared: after one change to a tree of 500,000 entries,
// Diff compares about one leaf's worth of entries (it counts the
// callback plus the elements it steps over).
func TestDiffSkipsShared(t *testing.T) {
	es := make([]Ent, 500000)
	for i := range es {
		es[i] = Ent{LBA: uint64(2 * i), Loc: uint32(i)}
	}
	a := BuildPtree(es, nil)
	old := a.Clone()
	a.ReplaceOrInsert(Ent{LBA: 777777, Loc: 1})
	n := 0
	Diff(old, a, func(_, _ Ent, _, _ bool) { n++ })
	if n != 1 {
		t.Fatalf("%d differences, want 1", n)
	}
	// A shared leaf or node is skipped without visiting its entries.
	steps, _ := diffTrees(old, a, func(_, _ Ent, _, _ bool) {})
	if steps > 4*LeafCap {
		t.Fatalf("Diff stepped over %d entries for one change in %d", steps, a.Len())
	}
}
