package index

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// newTestIndex returns an index of nb buckets of bpb blocks and one volume
// of nblocks blocks (the engine's allocator is not part of the index).
func newTestIndex(nb, bpb int64, nblocks uint64) *Index {
	ix := &Index{BPB: bpb, Buckets: make([]Bucket, nb)}
	v := NewVol("v0", nblocks)
	ix.Vols = []*Vol{&v}
	return ix
}

// TestCheckCatchesTreeCorruption: Check finds a tree whose length or
// summaries are wrong (the corruptions that need the trees' insides; the
// engine's TestCheckCatchesCorruption covers the rest through a Set).
func TestCheckCatchesTreeCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(ix *Index) (undo func())
		want    string
		// exactOnly: Open's check does not verify it (the tree summaries).
		exactOnly bool
	}{
		{"tree-structure", func(ix *Index) func() {
			tr := ix.Vols[0].Tree
			saved := tr.length
			tr.length++
			return func() { tr.length = saved }
		}, "length", false},
		{"superseded-summary-too-high", func(ix *Index) func() {
			tr := ix.Vols[0].Sup
			saved := tr.root.agg[0]
			tr.root.agg[0] = saved + 1
			return func() { tr.root.agg[0] = saved }
		}, "summary", true},
		// A summary above its child's oldest dirty epoch would hide
		// those entries from epoch-ordered writeback.
		{"summary-too-high", func(ix *Index) func() {
			tr := ix.Vols[0].Tree
			saved := tr.root.agg[0]
			tr.root.agg[0] = saved + 1
			return func() { tr.root.agg[0] = saved }
		}, "summary", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Epoch 0: blocks 0-7; epoch 1: blocks 1 and 2 again, whose
			// versions of epoch 0 are superseded.
			ix := newTestIndex(8, 4, 64)
			for i := range uint64(8) {
				ix.Insert(0, i, uint32(i), 0, true, 0, true)
			}
			ix.Insert(0, 1, 8, 0, true, 1, true)
			ix.Insert(0, 2, 9, 0, true, 1, true)
			if ix.Vols[0].NSup != 2 {
				t.Fatalf("%d superseded versions, want 2", ix.Vols[0].NSup)
			}
			if err := ix.Check(true); err != nil {
				t.Fatal(err)
			}
			undo := tc.corrupt(ix)
			exact, fast := ix.Check(true), ix.Check(false)
			undo()
			if err := ix.Check(true); err != nil {
				t.Fatalf("after undo: %v", err)
			}
			if exact == nil || !strings.Contains(exact.Error(), tc.want) {
				t.Fatalf("Check after corrupting: %v, want %q", exact, tc.want)
			}
			if !tc.exactOnly && (fast == nil || !strings.Contains(fast.Error(), tc.want)) {
				t.Fatalf("Open's check after corrupting: %v, want %q", fast, tc.want)
			}
		})
	}
}

// TestIndexModel runs random inserts (clean and dirty, in rising epochs,
// with and without superseded versions), invalidations, clean marks and
// bucket drops against a reference model of the live entries, and checks
// the index against the model and its own invariants after each step.
func TestIndexModel(t *testing.T) {
	const nb, bpb, nblocks = 16, 8, 48
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 3))
		ix := newTestIndex(nb, bpb, nblocks)
		ix.Owner = make([]uint64, nb*bpb) // as in recovery: DropBucket needs it
		keep := seed%2 == 0
		type live struct {
			loc   uint32
			dirty bool
			epoch uint64
		}
		model := map[uint64]live{}
		used := make([]bool, nb*bpb) // a block is handed out once per test
		next := func() (uint32, bool) {
			for range 64 {
				loc := rng.IntN(nb * bpb)
				if !used[loc] {
					used[loc] = true
					return uint32(loc), true
				}
			}
			return 0, false
		}
		epoch := uint64(0)
		for step := range 400 {
			switch op := rng.IntN(10); {
			case op < 5:
				loc, ok := next()
				if !ok {
					break
				}
				lba := rng.Uint64N(nblocks)
				dirty := rng.IntN(3) > 0
				ix.Insert(0, lba, loc, uint32(step), dirty, epoch, keep)
				model[lba] = live{loc, dirty, epoch}
			case op == 5:
				epoch++
			case op == 6:
				lba, n := rng.Uint64N(nblocks), 1+rng.Uint64N(4)
				ix.Invalidate(0, lba, n)
				for l := lba; l < lba+n; l++ {
					delete(model, l)
				}
			case op == 7:
				// Write back the oldest epoch: every version of it clean.
				old, ok := ix.OldestEpoch(0)
				if !ok {
					break
				}
				var vs []Ver
				ix.Vols[0].Tree.Ascend(func(e Ent) bool {
					if e.Dirty() && ix.BlockEpoch(e.Block()) == old {
						vs = append(vs, Ver{Epoch: old, LBA: e.LBA, Loc: e.Block(), CRC: e.CRC})
					}
					return true
				})
				ix.Vols[0].Sup.Ascend(func(e Ent) bool {
					if ix.SupEpoch(e) == old {
						vs = append(vs, Ver{Epoch: old, LBA: e.LBA, Loc: e.Loc, CRC: e.CRC})
					}
					return true
				})
				if len(vs) == 0 {
					t.Fatalf("seed %d step %d: oldest epoch %d has no version", seed, step, old)
				}
				for _, x := range vs {
					if !ix.MarkClean(0, x.LBA, x.Loc) {
						t.Fatalf("seed %d step %d: MarkClean(%+v) found nothing", seed, step, x)
					}
					if m, ok := model[x.LBA]; ok && m.loc == x.Loc {
						m.dirty = false
						model[x.LBA] = m
					}
				}
			default:
				// Drop the clean entries of a bucket (eviction's reuse).
				bi := rng.Int64N(nb)
				if d := ix.DropBucket(bi, true); d != 0 {
					t.Fatalf("seed %d step %d: DropBucket(onlyClean) dropped %d dirty", seed, step, d)
				}
				for lba, m := range model {
					if int64(m.loc)/bpb == bi && !m.dirty {
						delete(model, lba)
					}
				}
			}
			if err := ix.Check(true); err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
			if err := ix.Check(false); err != nil {
				t.Fatalf("seed %d step %d (fast): %v", seed, step, err)
			}
			v := ix.Vols[0]
			if v.Tree.Len() != len(model) || v.Cached != int64(len(model)) {
				t.Fatalf("seed %d step %d: %d entries (%d counted), model %d", seed, step, v.Tree.Len(), v.Cached, len(model))
			}
			var dirty int64
			for lba, m := range model {
				e, ok := v.Tree.Get(Ent{LBA: lba})
				if !ok || e.Block() != m.loc || e.Dirty() != m.dirty {
					t.Fatalf("seed %d step %d: lba %d is %+v (%t), model %+v", seed, step, lba, e, ok, m)
				}
				if m.dirty {
					dirty++
					if got := ix.BlockEpoch(m.loc); got != m.epoch {
						t.Fatalf("seed %d step %d: lba %d epoch %d, model %d", seed, step, lba, got, m.epoch)
					}
				}
			}
			if v.Dirty != dirty {
				t.Fatalf("seed %d step %d: %d dirty, model %d", seed, step, v.Dirty, dirty)
			}
			if !keep && v.NSup != 0 {
				t.Fatalf("seed %d step %d: %d superseded versions without keepSup", seed, step, v.NSup)
			}
		}
	}
}

// TestBucketEpochsWiden sets random epochs in a bucket's table, near each
// other, then far below and above (rebase, 32-bit and 64-bit tables), and
// reads every one back.
func TestBucketEpochsWiden(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for round := range 200 {
		const n = 64
		base := rng.Uint64N(1 << 40)
		ep := newBucketEpochs(n, base)
		want := map[int64]uint64{}
		for range 100 {
			i := rng.Int64N(n)
			var e uint64
			switch r := rng.IntN(20); {
			case round%4 == 0 || r < 15:
				e = base + rng.Uint64N(1000) - 500 // close: stays 16-bit
			case r < 18:
				e = base + rng.Uint64N(1<<24)
			case r < 19:
				e = base - rng.Uint64N(1<<20)
			default:
				e = rng.Uint64()
			}
			ep.set(i, e)
			want[i] = e
			for j, w := range want {
				if got := ep.get(j); got != w {
					t.Fatalf("round %d: block %d epoch %d, want %d (base %d, widths %t/%t/%t)", round, j, got, w, ep.base, ep.e16 != nil, ep.e32 != nil, ep.e64 != nil)
				}
			}
		}
		if round%4 == 0 && ep.e16 == nil {
			t.Fatalf("round %d: epochs within 1000 of each other widened the table", round)
		}
	}
}
