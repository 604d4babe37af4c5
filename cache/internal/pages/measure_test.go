package pages

import (
	"flag"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
)

var (
	flagMeasure = flag.Bool("measure", false, "run TestMeasure* (figures only)")
	flagSizes   = flag.String("pagesizes", "1M,4M", "TestMeasurePages: cached block counts (K, M suffixes)")
)

func parseCount(s string) (int, error) {
	m := 1
	switch {
	case strings.HasSuffix(s, "K"):
		m, s = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		m, s = 1<<20, strings.TrimSuffix(s, "M")
	}
	n, err := strconv.Atoi(s)
	return n * m, err
}

func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestMeasurePages measures the page layer at each size in -pagesizes (N
// cached blocks of a cache of N blocks in 1 MiB buckets, at random LBAs
// of a volume of 4N): the leaves' fill after random inserts, the pages
// and bytes a checkpoint writes after k random 4 KiB overwrites (each
// changes the entry and the summaries of the bucket of its new block and
// of its old one), against the 28 B per cached block of today's whole
// checkpoint; Open's time and page reads; and the heap the store holds
// (inner nodes, bucket table, page cache at 0.05 % of the cache device)
// per cached block after Open and after 100,000 random lookups: heap of
// the library on a memory device, not a process's RSS (the engine does
// not use the library). Figures only. Run with
//
//	go test ./cache/internal/pages -run TestMeasurePages -measure -v -pagesizes 1M,4M
func TestMeasurePages(t *testing.T) {
	if !*flagMeasure {
		t.Skip("figures only: -measure")
	}
	for _, sz := range strings.Split(*flagSizes, ",") {
		n, err := parseCount(sz)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(sz, func(t *testing.T) { measurePages(t, n) })
	}
}

func measurePages(t *testing.T, n int) {
	rng := rand.New(rand.NewPCG(uint64(n), 20))
	nbuckets := max(1, n/256)
	pagesArea := uint32(n/40 + 4096) // leaves at the fill bound, the table, two intervals
	lay := testLayout(pagesArea)
	dev := &countDev{Mem: device.NewMem(lay.Off + lay.Len()), cut: -1}
	st := newTestStore(t, dev, lay, 1)
	tr := st.Tree(0)
	tb, err := st.Table(nbuckets)
	if err != nil {
		t.Fatal(err)
	}
	lbas := make([]uint64, 0, n)
	seen := make(map[uint64]bool, n)
	t0 := time.Now()
	for len(lbas) < n {
		l := rng.Uint64N(4 * uint64(n))
		if seen[l] {
			continue
		}
		seen[l] = true
		loc := uint32(len(lbas))
		if _, _, err := tr.Put(Slot{LBA: l, Loc: loc, CRC: uint32(l)}); err != nil {
			t.Fatal(err)
		}
		lbas = append(lbas, l)
	}
	for b := range nbuckets {
		tb.Set(b, Bucket{Gen: 1, Live: 256, Fill: 256})
	}
	seen = nil
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	leaves, inner, least := treeShape(t, tr)
	t.Logf("N=%d: built in %v: %d leaves (%.1f slots a leaf, %.0f %% full, fewest %d), %d inner pages, table %d pages; %d pages written (%.1f B per block)",
		n, time.Since(t0).Round(time.Millisecond), leaves, float64(n)/float64(leaves), 100*float64(n)/float64(leaves)/LeafCap, least, inner,
		len(tb.levels[0]), st.PagesWritten, float64(st.PagesWritten*PageSize)/float64(n))

	// A checkpoint after k random overwrites: a new cache block for the
	// LBA (the open bucket's summary) and the old block superseded (its
	// bucket's summary).
	next := uint32(n)
	for _, k := range []int{1000, 10000, 100000} {
		w0, b0 := st.PagesWritten, st.BytesWritten
		for range k {
			i := rng.IntN(n)
			old, _, err := tr.Get(lbas[i])
			if err != nil {
				t.Fatal(err)
			}
			next = (next + 1) % uint32(n)
			if _, _, err := tr.Put(Slot{LBA: lbas[i], Loc: next | dirtyBit, CRC: 1, Epoch: 7}); err != nil {
				t.Fatal(err)
			}
			ob, nb := int(old.Loc&^dirtyBit)/256%nbuckets, int(next)/256%nbuckets
			x := tb.Get(ob)
			x.Live--
			tb.Set(ob, x)
			y := tb.Get(nb)
			y.Dirty++
			y.Oldest = 7
			tb.Set(nb, y)
		}
		dl, dt := tr.Dirty(), tb.Dirty()
		c0 := time.Now()
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
		w, b := st.PagesWritten-w0, st.BytesWritten-b0
		t.Logf("N=%d: checkpoint after %d random overwrites: %d pages (%d leaves, %d table pages, %d inner/directory), %.1f MiB in %v; a whole checkpoint is %.1f MiB (28 B a block)",
			n, k, w, dl, dt, int(w)-dl-dt, float64(b)/(1<<20), time.Since(c0).Round(time.Millisecond), float64(28*n)/(1<<20))
	}

	// Open: the root, every inner page, the table; the heap it holds.
	cachePages := max(1, n*2/PageSize) // 0.05 % of the cache device
	st, tr, tb = nil, nil, nil
	h0 := heapInUse()
	r0 := dev.reads
	o0 := time.Now()
	st, _, err = Open(dev, lay, cachePages)
	if err != nil {
		t.Fatal(err)
	}
	openTime, openReads := time.Since(o0), dev.reads-r0
	h1 := heapInUse()
	tr = st.Tree(0)
	r1 := dev.reads
	for range 100000 {
		if _, ok, err := tr.Get(lbas[rng.IntN(n)]); !ok || err != nil {
			t.Fatal("lookup", err)
		}
	}
	lookReads := dev.reads - r1
	h2 := heapInUse()
	t.Logf("N=%d: Open %v, %d page reads; heap %.2f B a block after Open, %.2f B with the page cache full (%d pages = 0.05 %% of the cache device); 100,000 random lookups read %d pages",
		n, openTime.Round(time.Millisecond), openReads, float64(h1-h0)/float64(n), float64(h2-h0)/float64(n), cachePages, lookReads)
	runtime.KeepAlive(st)
	runtime.KeepAlive(lbas)
}
