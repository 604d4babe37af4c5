package cache

import (
	"flag"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
)

var flagLazyBlocks = flag.String("lazyblocks", "1M", "TestMeasureLazyOpen: cached 4 KiB blocks (K, M suffixes; comma-separated)")

// fileReadCounter counts the bytes read from [lo, hi) of a device.
type fileReadCounter struct {
	device.Device
	lo, hi int64
	n      atomic.Int64
}

func (d *fileReadCounter) ReadAt(p []byte, off int64) (int, error) {
	if off < d.hi && off+int64(len(p)) > d.lo {
		d.n.Add(min(off+int64(len(p)), d.hi) - max(off, d.lo))
	}
	return d.Device.ReadAt(p, off)
}

// TestMeasureLazyOpen: what a paged set's Open after a clean shutdown
// reads and keeps, with N dirty cached blocks (the set of
// TestMeasureMetadataScale, made in process): the page-area bytes Open
// reads, the leaves it loads, the Go heap live after it (HeapAlloc after a GC,
// above the heap before it), and the same after 1,000 random reads of
// cached blocks. No timing (docs/BENCHMARKS.md, "Metadata at scale").
//
//	go test ./cache -run TestMeasureLazyOpen -measure -v -lazyblocks 1M,16M
func TestMeasureLazyOpen(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	*flagMetaPaged = true
	for _, f := range strings.Split(*flagLazyBlocks, ",") {
		n, err := parseCount(f)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		cachePath, lbas := metaSet(t, dir, n, 2*n)
		cf, err := device.OpenFile(cachePath, device.FileOptions{})
		if err != nil {
			t.Fatal(err)
		}
		bf, err := device.OpenFile(dir+"/hdd.img", device.FileOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sb, err := ReadSuperblock(cf)
		if err != nil {
			t.Fatal(err)
		}
		heap := func() int64 {
			runtime.GC()
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			return int64(ms.HeapAlloc)
		}
		h0 := heap()
		dev := &fileReadCounter{Device: cf, lo: sb.CkptOff[0], hi: sb.CkptOff[0] + 2*sb.CkptLen}
		s, err := Open(dev, []BackingSpec{{Name: "hdd", Dev: bf, ID: sb.Backings[0].ID}}, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err != nil {
			t.Fatal(err)
		}
		h1 := heap()
		var loads uint64
		if s.pg.lazy != nil {
			loads = s.pg.lazy.reads.Load()
		}
		leaves := s.pg.st.Tree(0).Leaves()
		t.Logf("%d cached blocks, %d leaves: lazy %t; Open read %.2f MiB of the page area (%d pages), loaded %d leaves; heap %.1f MiB above before Open (%.2f B a block)",
			n, leaves, s.pg.lazy != nil, float64(dev.n.Load())/(1<<20), dev.n.Load()/blockSize, loads, float64(h1-h0)/(1<<20), float64(h1-h0)/float64(n))
		v, _ := s.Volume("hdd")
		b := make([]byte, blockSize)
		r := rand.New(rand.NewPCG(1, 2))
		for range 1000 {
			if err := v.ReadAt(b, int64(lbas[r.IntN(len(lbas))])*blockSize); err != nil {
				t.Fatal(err)
			}
		}
		h2 := heap()
		if s.pg.lazy != nil {
			loads = s.pg.lazy.reads.Load()
		}
		t.Logf("  after 1,000 random reads of cached blocks: %d leaves loaded, heap %.1f MiB above before Open (%.2f B a block)", loads, float64(h2-h0)/(1<<20), float64(h2-h0)/float64(n))
		runtime.KeepAlive(lbas) // in every heap figure
		s.crashStop()
		cf.Close()
		bf.Close()
	}
}
