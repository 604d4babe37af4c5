package index

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"
)

// ptreeMatches compares t with the reference map: Len, Get of every key,
// full and ranged iteration, and the structural check.
func ptreeMatches(t *testing.T, tr *Ptree, ref map[uint64]Ent, rng *rand.Rand, span uint64) {
	t.Helper()
	if err := tr.Check(); err != nil {
		t.Fatal(err)
	}
	if tr.Len() != len(ref) {
		t.Fatalf("Len %d, reference %d", tr.Len(), len(ref))
	}
	keys := make([]uint64, 0, len(ref))
	for k := range ref {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	i := 0
	tr.Ascend(func(e Ent) bool {
		if i >= len(keys) || e != ref[keys[i]] {
			t.Fatalf("Ascend item %d: %+v, reference %v", i, e, ref[keys[min(i, len(keys)-1)]])
		}
		i++
		return true
	})
	if i != len(keys) {
		t.Fatalf("Ascend saw %d of %d", i, len(keys))
	}
	for range 20 {
		from := rng.Uint64N(span + 2)
		to := from + rng.Uint64N(span/4+2)
		var got []uint64
		tr.AscendRange(Ent{LBA: from}, Ent{LBA: to}, func(e Ent) bool { got = append(got, e.LBA); return len(got) < 50 })
		var want []uint64
		for _, k := range keys {
			if k >= from && k < to && len(want) < 50 {
				want = append(want, k)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("AscendRange [%d,%d): %v, want %v", from, to, got, want)
		}
		var ge []uint64
		tr.AscendGreaterOrEqual(Ent{LBA: from}, func(e Ent) bool { ge = append(ge, e.LBA); return len(ge) < 10 })
		j, _ := slices.BinarySearch(keys, from)
		if wantGE := keys[j:min(j+10, len(keys))]; !slices.Equal(ge, wantGE) && !(len(ge) == 0 && len(wantGE) == 0) {
			t.Fatalf("AscendGreaterOrEqual %d: %v, want %v", from, ge, wantGE)
		}
	}
	for range 50 {
		k := rng.Uint64N(span + 2)
		e, ok := tr.Get(Ent{LBA: k})
		r, rok := ref[k]
		if ok != rok || e != r {
			t.Fatalf("Get %d: %+v %t, reference %+v %t", k, e, ok, r, rok)
		}
	}
}

// TestPtreeModel drives the packed index through random inserts, replaces
// and deletes (dense, sparse, sequential and bulk-loaded key sets, with
// clones taken along the way) against a map, checking everything after
// each phase, and that a clone is unaffected by later changes to either tree.
func TestPtreeModel(t *testing.T) {
	for _, tc := range []struct {
		name   string
		span   uint64
		ops    int
		delPct int
		seq    bool
		bulk   bool
	}{
		{"dense", 3000, 20000, 40, false, false},
		{"sparse", MaxLBA - 1, 20000, 30, false, false},
		{"grow", 200000, 60000, 5, false, false},
		{"shrink", 5000, 30000, 70, false, false},
		{"sequential", 1 << 20, 40000, 0, true, false},
		{"bulk", 100000, 20000, 50, false, true},
		// Over 64*64 leaves: inner nodes split below the root (height 4).
		{"deep", 1 << 30, 560000, 1, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "deep" && (testing.Short() || raceEnabled) {
				t.Skip("slow under -short and -race")
			}
			rng := rand.New(rand.NewPCG(uint64(len(tc.name)), 7))
			ref := map[uint64]Ent{}
			tr := NewPtree()
			if tc.bulk {
				var es []Ent
				for k := uint64(0); k < tc.span; k += 1 + rng.Uint64N(3) {
					e := Ent{LBA: k, Loc: rng.Uint32(), CRC: rng.Uint32()}
					es = append(es, e)
					ref[k] = e
				}
				tr = BuildPtree(es, nil)
				ptreeMatches(t, tr, ref, rng, tc.span)
			}
			var snap *Ptree
			var snapRef map[uint64]Ent
			for op := 0; op < tc.ops; op++ {
				k := rng.Uint64N(tc.span)
				if tc.seq {
					k = uint64(op) * 3
				}
				if rng.IntN(100) < tc.delPct {
					old, ok := tr.Delete(Ent{LBA: k})
					r, rok := ref[k]
					if ok != rok || old != r {
						t.Fatalf("Delete %d: %+v %t, reference %+v %t", k, old, ok, r, rok)
					}
					delete(ref, k)
				} else {
					e := Ent{LBA: k, Loc: rng.Uint32(), CRC: rng.Uint32()}
					old, ok := tr.ReplaceOrInsert(e)
					r, rok := ref[k]
					if ok != rok || old != r {
						t.Fatalf("ReplaceOrInsert %d: %+v %t, reference %+v %t", k, old, ok, r, rok)
					}
					ref[k] = e
				}
				if op%(tc.ops/4) == tc.ops/8 {
					ptreeMatches(t, tr, ref, rng, tc.span)
					if snap != nil {
						ptreeMatches(t, snap, snapRef, rng, tc.span)
					}
					snap, snapRef = tr.Clone(), maps(ref)
				}
			}
			ptreeMatches(t, tr, ref, rng, tc.span)
			ptreeMatches(t, snap, snapRef, rng, tc.span)
			st := tr.Stats()
			if st.Leaves > 0 {
				t.Logf("%d entries in %d leaves (%.0f%% full), %d inner nodes, height %d",
					tr.Len(), st.Leaves, 100*float64(tr.Len())/float64(st.Leaves*LeafCap), st.Inner, st.Height)
			}
			if !tc.seq && tc.delPct <= 10 && tr.Len() > 10*LeafCap {
				if fill := float64(tr.Len()) / float64(st.Leaves*LeafCap); fill < 0.7 {
					t.Errorf("leaves %.0f%% full after random inserts; want above 70%%", 100*fill)
				}
			}
			if tc.seq {
				if fill := float64(tr.Len()) / float64(st.Leaves*LeafCap); fill < 0.95 {
					t.Errorf("leaves %.0f%% full after ascending inserts; want nearly full", 100*fill)
				}
			}
		})
	}
}

func maps(m map[uint64]Ent) map[uint64]Ent {
	c := make(map[uint64]Ent, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// TestPtreeCheckCatches corrupts a tree in each way check guards against
// and expects check to report it.
func TestPtreeCheckCatches(t *testing.T) {
	build := func() *Ptree {
		var es []Ent
		for k := uint64(0); k < 20*LeafCap; k++ {
			es = append(es, Ent{LBA: 2 * k})
		}
		return BuildPtree(es, nil)
	}
	for _, tc := range []struct {
		name    string
		corrupt func(tr *Ptree)
		want    string
	}{
		{"order", func(tr *Ptree) { l := tr.root.lvs[1]; l.set(3, Ent{LBA: l.key(5)}) }, "out of order"},
		{"separator", func(tr *Ptree) { tr.root.keys[2].LBA += 7 }, "separator"},
		{"below", func(tr *Ptree) {
			l := tr.root.lvs[2]
			l.set(0, Ent{LBA: tr.root.keys[2].LBA - 1})
		}, "below its separator"},
		{"length", func(tr *Ptree) { tr.length++ }, "length"},
		{"empty-leaf", func(tr *Ptree) { tr.root.lvs[0].n = 0 }, "bad count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := build()
			if err := tr.Check(); err != nil {
				t.Fatal(err)
			}
			tc.corrupt(tr)
			err := tr.Check()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("check after corrupting: %v, want %q", err, tc.want)
			}
		})
	}
}

// TestStreeModel runs the superseded-version tree (several versions per
// LBA, ordered by (LBA, cache block), epoch bounds from a value per cache
// block) against a map, with a snapshot: per-LBA ranges, MinAgg and the
// bounds after every batch.
func TestStreeModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 9))
	epochOf := map[uint32]uint64{}
	val := func(e Ent) uint64 { return epochOf[e.Loc] }
	ref := map[[2]uint64]uint32{} // (lba, loc) -> crc
	tr := NewStree()
	var snap *Stree
	var snapWant []Ent
	sorted := func() []Ent {
		var out []Ent
		for k, crc := range ref {
			out = append(out, Ent{LBA: k[0], Loc: uint32(k[1]), CRC: crc})
		}
		slices.SortFunc(out, func(a, b Ent) int {
			if supLess(a, b) {
				return -1
			}
			if supLess(b, a) {
				return 1
			}
			return 0
		})
		return out
	}
	all := func(tr *Stree) []Ent {
		var got []Ent
		tr.Ascend(func(e Ent) bool { got = append(got, e); return true })
		return got
	}
	for op := 0; op < 40000; op++ {
		lba, loc := rng.Uint64N(1500), uint32(rng.IntN(4000))
		if rng.IntN(100) < 45 {
			_, ok := tr.Delete(Ent{LBA: lba, Loc: loc})
			if _, in := ref[[2]uint64{lba, uint64(loc)}]; ok != in {
				t.Fatalf("Delete (%d, %d): %t", lba, loc, ok)
			}
			delete(ref, [2]uint64{lba, uint64(loc)})
		} else if _, in := ref[[2]uint64{lba, uint64(loc)}]; !in {
			epochOf[loc] = uint64(op / 500)
			tr.ReplaceOrInsertAgg(Ent{LBA: lba, Loc: loc, CRC: uint32(op)}, epochOf[loc])
			ref[[2]uint64{lba, uint64(loc)}] = uint32(op)
		}
		if op%2000 != 1999 {
			continue
		}
		if err := tr.Check(); err != nil {
			t.Fatal(err)
		}
		if err := tr.CheckAgg(val); err != nil {
			t.Fatal(err)
		}
		want := sorted()
		if got := all(tr); !slices.Equal(got, want) || tr.Len() != len(want) {
			t.Fatalf("op %d: Ascend: %d versions, want %d (Len %d)", op, len(got), len(want), tr.Len())
		}
		m := uint64(math.MaxUint64)
		for _, e := range want {
			m = min(m, val(e))
		}
		if got, ok := tr.MinAgg(val); ok != (len(want) > 0) || (ok && got != m) {
			t.Fatalf("op %d: MinAgg %d %t, want %d", op, got, ok, m)
		}
		q := rng.Uint64N(1500)
		var got, wantL []Ent
		tr.AscendRange(Ent{LBA: q}, Ent{LBA: q + 1}, func(e Ent) bool { got = append(got, e); return true })
		for _, e := range want {
			if e.LBA == q {
				wantL = append(wantL, e)
			}
		}
		if !slices.Equal(got, wantL) {
			t.Fatalf("op %d: versions of lba %d: %v, want %v", op, q, got, wantL)
		}
		if snap != nil && !slices.Equal(all(snap), snapWant) {
			t.Fatalf("op %d: the snapshot changed", op)
		}
		if rng.IntN(3) == 0 {
			snap, snapWant = tr.Clone(), want
		}
	}
}

// TestPtreeSummaryModel runs the tree's summaries (lower bounds of an
// element value, here the epoch a dirty entry's crc stands for) against a
// map: random dirty and clean inserts, replacements, clean marks and
// deletes, with clones, bulk loads and sparse and dense keys. After each
// batch every bound must hold (checkAgg), MinAgg must return the exact
// minimum, and AscendAggAtMost must yield every element at or below a
// bound.
func TestPtreeSummaryModel(t *testing.T) {
	val := func(e Ent) uint64 {
		if !e.Dirty() {
			return math.MaxUint64
		}
		return uint64(e.CRC)
	}
	for seed := range uint64(12) {
		rng := rand.New(rand.NewPCG(seed, 77))
		span := uint64(2000)
		if seed%3 == 0 {
			span = 200000
		}
		ref := map[uint64]Ent{}
		tr := NewPtree()
		if seed%4 == 1 {
			// Bulk-loaded, with exact leaf summaries.
			var es []Ent
			for k := uint64(0); k < span; k += 1 + rng.Uint64N(3) {
				e := Ent{LBA: k, Loc: uint32(k), CRC: uint32(rng.IntN(50))}
				if rng.IntN(2) == 0 {
					e.Loc |= DirtyBit
				}
				es = append(es, e)
				ref[k] = e
			}
			aggs := make([]uint64, (len(es)+LeafBulkFill-1)/LeafBulkFill)
			for i := range aggs {
				aggs[i] = math.MaxUint64
			}
			for i, e := range es {
				aggs[i/LeafBulkFill] = min(aggs[i/LeafBulkFill], val(e))
			}
			tr = BuildPtree(es, aggs)
		}
		var snap *Ptree
		epoch := uint32(0)
		for round := range 60 {
			for range 300 {
				k := rng.Uint64N(span)
				switch r := rng.IntN(10); {
				case r < 5: // a write: dirty in the current epoch, or clean
					e := Ent{LBA: k, Loc: uint32(k), CRC: epoch}
					if rng.IntN(3) > 0 {
						e.Loc |= DirtyBit
					}
					tr.ReplaceOrInsertAgg(e, val(e))
					ref[k] = e
				case r < 8: // a clean mark
					if e, ok := ref[k]; ok {
						e.Loc &^= DirtyBit
						tr.ReplaceOrInsertAgg(e, math.MaxUint64)
						ref[k] = e
					}
				default:
					tr.Delete(Ent{LBA: k})
					delete(ref, k)
				}
			}
			if rng.IntN(8) == 0 {
				epoch++
			}
			if rng.IntN(5) == 0 {
				snap = tr.Clone()
			}
			if err := tr.CheckAgg(val); err != nil {
				t.Fatalf("seed %d round %d: %v", seed, round, err)
			}
			want := uint64(math.MaxUint64)
			for _, e := range ref {
				want = min(want, val(e))
			}
			got, ok := tr.MinAgg(val)
			if ok != (want != math.MaxUint64) || (ok && got != want) {
				t.Fatalf("seed %d round %d: MinAgg %d %t, want %d", seed, round, got, ok, want)
			}
			if err := tr.CheckAgg(val); err != nil {
				t.Fatalf("seed %d round %d: after MinAgg: %v", seed, round, err)
			}
			ptreeMatches(t, tr, ref, rng, span)
			bound := want + uint64(rng.IntN(3))
			from := rng.Uint64N(span)
			var gotKeys, wantKeys []uint64
			tr.AscendAggAtMost(Ent{LBA: from}, bound, func(e Ent) bool {
				if val(e) <= bound {
					gotKeys = append(gotKeys, e.LBA)
				}
				return true
			})
			for k, e := range ref {
				if k >= from && val(e) <= bound {
					wantKeys = append(wantKeys, k)
				}
			}
			slices.Sort(wantKeys)
			if !slices.Equal(gotKeys, wantKeys) {
				t.Fatalf("seed %d round %d: AscendAggAtMost(%d, %d): %d elements, want %d", seed, round, from, bound, len(gotKeys), len(wantKeys))
			}
		}
		if snap != nil {
			if err := snap.Check(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestLeafSizes: a leaf (of ptree and stree), with the 8-byte header Go's
// allocator puts before an object with pointers larger than 512 bytes,
// fits its 2048-byte size class (one byte more and it takes a 2304-byte
// block: 12 % more memory per entry).
func TestLeafSizes(t *testing.T) {
	if n := unsafe.Sizeof(pleaf{}); n+8 > 2048 {
		t.Errorf("pleaf is %d bytes", n)
	}
}
