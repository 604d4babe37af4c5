package pages

import (
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

// BenchmarkGet: a lookup of a random cached block among 1 M, in the
// in-memory index (index.Ptree) and in the paged tree with every leaf
// resident and with the leaves 10x the page cache (a memory device behind
// it: the CPU of a page read and its verification, not a device's
// latency). Run with
//
//	go test ./cache/internal/pages -run '^$' -bench BenchmarkGet -benchtime 2000000x
func BenchmarkGet(b *testing.B) {
	const n = 1 << 20
	rng := rand.New(rand.NewPCG(1, 1))
	lbas := make([]uint64, n)
	es := make([]index.Ent, n)
	for i := range lbas {
		lbas[i] = 4*uint64(i) + rng.Uint64N(4)
		es[i] = index.Ent{LBA: lbas[i], Loc: uint32(i)}
	}
	pt := index.BuildPtree(es, nil)
	lay := testLayout(1 << 15)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(b, dev, lay, 1)
	tr := st.Tree(0)
	for _, i := range rng.Perm(n) { // random inserts: leaves as a cache fills them
		if _, _, err := tr.Put(Slot{LBA: lbas[i], Loc: uint32(i)}); err != nil {
			b.Fatal(err)
		}
	}
	if err := st.Checkpoint(nil); err != nil {
		b.Fatal(err)
	}
	pages := st.alloc.Used()
	// The lookups' order: uniformly random.
	order := make([]uint64, 1<<16)
	for i := range order {
		order[i] = lbas[rng.IntN(n)]
	}
	b.Run("ptree", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			if _, ok := pt.Get(index.Ent{LBA: order[i%len(order)]}); !ok {
				b.Fatal("missing")
			}
		}
	})
	for _, c := range []struct {
		name  string
		pages int
	}{{"pages-resident", pages}, {"pages-cache-1/10", pages / 10}} {
		b.Run(c.name, func(b *testing.B) {
			st, _, err := Open(dev, lay, c.pages)
			if err != nil {
				b.Fatal(err)
			}
			tr := st.Tree(0)
			for _, l := range lbas { // warm the cache
				if _, _, err := tr.Get(l); err != nil {
					b.Fatal(err)
				}
			}
			m0 := st.cache.Misses
			for i := 0; b.Loop(); i++ {
				if _, ok, err := tr.Get(order[i%len(order)]); !ok || err != nil {
					b.Fatal("missing", err)
				}
			}
			b.ReportMetric(float64(st.cache.Misses-m0)/float64(b.N), "reads/op")
		})
	}
	b.Logf("%d entries, %d pages (%.1f slots a leaf)", n, pages, float64(n)/float64(pages))
}
