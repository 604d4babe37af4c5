package index

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// BenchmarkInsert measures Index.Insert of a clean block over an existing
// entry at a random LBA of a volume with 1 M cached blocks (8 M-block
// volume, 2 M cache blocks) in three indexes side by side: a tree built
// in memory (eager), and lazy trees (BuildLazyPtree, 176-entry leaves, as
// index pages hold) with every leaf loaded but one (lazy-one-stub) and
// with every leaf loaded (lazy-all-loaded). Insert faults the entry's
// leaf in (Ptree.Fault) before it changes anything: a descent of its own
// in a lazy tree while any stub has no leaf loaded, none once every leaf
// is. The variants take turns in runs of 4,096 inserts (b.N each), so a
// noisy machine slows all three alike; reported: each one's ns/insert
// and the median over the turns of lazy-one-stub's time over
// lazy-all-loaded's (the descent) and over eager's. Every leaf is changed
// once before the timer starts, so no insert copies a leaf while timed.
func BenchmarkInsert(b *testing.B) {
	const n, nblocks, cacheBlocks, bpb = 1 << 20, 8 << 20, 2 << 20, 256
	rng := rand.New(rand.NewPCG(1, 2))
	ref := map[uint64]Ent{}
	for len(ref) < n {
		lba := rng.Uint64N(nblocks)
		ref[lba] = Ent{LBA: lba, Loc: uint32(len(ref)), CRC: 1}
	}
	es := sortedEnts(ref)
	variants := []string{"eager", "lazy-one-stub", "lazy-all-loaded"}
	type run struct {
		ix  *Index
		loc uint32
		ns  []float64 // per turn
	}
	runs := make([]*run, len(variants))
	for k, variant := range variants {
		ix := &Index{BPB: bpb, Buckets: make([]Bucket, cacheBlocks/bpb)}
		v := NewVol("v0", nblocks)
		ix.Vols = []*Vol{&v}
		for _, e := range es {
			ix.Buckets[int64(e.Loc)/bpb].Live++
		}
		if variant == "eager" {
			v.Tree = BuildPtree(es, nil)
		} else {
			ls, stubs := stubsOf(es, 176, func(Ent) uint64 { return ^uint64(0) })
			v.Tree = BuildLazyPtree(stubs, len(es), ls.load, len(stubs), nil)
			last := stubs[len(stubs)-1].Ref
			v.Tree.LoadStubsIn(Ent{}, Ent{LBA: MaxLBA}, math.MaxUint64, 1<<30, func(r StubRef) bool {
				return variant == "lazy-all-loaded" || r != last
			})
			if want := map[bool]int64{true: 0, false: 1}[variant == "lazy-all-loaded"]; v.Tree.Unloaded() != want {
				b.Fatalf("%d stubs unloaded, want %d", v.Tree.Unloaded(), want)
			}
		}
		runs[k] = &run{ix: ix, loc: n}
	}
	insert := func(r *run, lba uint64) {
		r.loc++
		if r.loc == cacheBlocks {
			r.loc = n
		}
		r.ix.Insert(0, lba, r.loc, 2, false, 0, false)
	}
	// The inserts go to the entries of the first 7/8 of the LBAs (not
	// the last leaf, which stays a stub in lazy-one-stub).
	lbas := make([]uint64, 1<<16)
	for i := range lbas {
		lbas[i] = es[rng.IntN(len(es)*7/8)].LBA
	}
	for _, r := range runs {
		for i := 0; i < len(es)*7/8; i += 64 {
			insert(r, es[i].LBA)
		}
	}
	const turn = 4096
	b.ResetTimer()
	for done := 0; done < b.N; done += turn {
		k := min(turn, b.N-done)
		for _, r := range runs {
			t0 := time.Now()
			for i := done; i < done+k; i++ {
				insert(r, lbas[i%len(lbas)])
			}
			r.ns = append(r.ns, float64(time.Since(t0).Nanoseconds())/float64(k))
		}
	}
	b.StopTimer()
	ratio := func(a, c *run) float64 {
		q := make([]float64, len(a.ns))
		for i := range q {
			q[i] = a.ns[i] / c.ns[i]
		}
		slices.Sort(q)
		return q[len(q)/2]
	}
	for k, r := range runs {
		var sum float64
		for _, x := range r.ns {
			sum += x
		}
		b.ReportMetric(sum/float64(len(r.ns)), variants[k]+"-ns/insert")
	}
	b.ReportMetric(ratio(runs[1], runs[2]), "one-stub/all-loaded")
	b.ReportMetric(ratio(runs[1], runs[0]), "one-stub/eager")
	b.ReportMetric(ratio(runs[2], runs[0]), "all-loaded/eager")
}
