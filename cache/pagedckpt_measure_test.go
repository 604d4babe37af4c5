package cache

import (
	"flag"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
)

var (
	flagPagedBlocks  = flag.String("pagedblocks", "1M", "TestMeasurePagedCheckpoint: cached 4 KiB blocks")
	flagPagedLoad    = flag.Duration("pagedload", 20*time.Second, "TestMeasurePagedCheckpoint: length of the 4 KiB random write load")
	flagPagedJournal = flag.String("pagedjournal", "8M", "TestMeasurePagedCheckpoint: journal size (a checkpoint is written when it fills)")
	flagPagedDir     = flag.String("pageddir", "", "TestMeasurePagedCheckpoint: directory for the sparse files (default: a test temp dir)")
	flagPagedProfile = flag.String("pagedprofile", "", "TestMeasurePagedCheckpoint: write CPU profiles of the paged sets' Opens to this file (clean) and this file.crash (after the crash)")
	flagPagedOnly    = flag.Bool("pagedonly", false, "TestMeasurePagedCheckpoint: measure only sets with index pages (two rounds)")
)

// countingWrites is a device that counts the bytes written into [lo, hi).
type countingWrites struct {
	device.Device
	lo, hi int64
	n      atomic.Int64
}

func (d *countingWrites) WriteAt(p []byte, off int64) (int, error) {
	if off < d.hi && off+int64(len(p)) > d.lo {
		d.n.Add(min(off+int64(len(p)), d.hi) - max(off, d.lo))
	}
	return d.Device.WriteAt(p, off)
}

// TestMeasurePagedCheckpoint compares a set with index pages
// (FormatOptions.IndexPages) with one without, in process, on sparse
// files: N cached dirty 4 KiB blocks (written once, in random order) in
// a cache of 2N blocks (1 MiB buckets, a journal of -pagedjournal: a
// checkpoint is written each time it fills), then 8
// writers of 4 KiB random overwrites of those blocks for -pagedload. It
// reports the writes per second, the checkpoints, and the bytes written
// into the checkpoint region per second; then the time Open takes after
// a clean Close and after a crash (the journal since the last
// checkpoint replayed). Figures only. Run under the bench lock:
//
//	flock /work/coord/bench.lock go test ./cache -run TestMeasurePagedCheckpoint -measure -v -timeout 1h -pagedblocks 1M
func TestMeasurePagedCheckpoint(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	n, err := parseCount(*flagPagedBlocks)
	if err != nil {
		t.Fatal(err)
	}
	dir := *flagPagedDir
	if dir == "" {
		dir = t.TempDir()
	}
	variants := []bool{false, true, false, true}
	if *flagPagedOnly {
		variants = []bool{true, true}
	}
	for _, paged := range variants {
		load, _ := os.ReadFile("/proc/loadavg")
		t.Logf("index pages %t, %d blocks; loadavg %s", paged, n, strings.TrimSpace(string(load)))
		measurePaged(t, dir, n, paged)
	}
}

func measurePaged(t *testing.T, dir string, n int64, paged bool) {
	const bs = 1 << 20
	nb := 2 * n * blockSize / bs
	cpath, bpath := filepath.Join(dir, "cache"), filepath.Join(dir, "back")
	defer os.Remove(cpath)
	defer os.Remove(bpath)
	jl, err := parseCount(*flagPagedJournal)
	if err != nil {
		t.Fatal(err)
	}
	csize := cacheSizeForPaged(nb, bs, jl, 1, paged)
	if err := device.CreateSparse(cpath, csize); err != nil {
		t.Fatal(err)
	}
	if err := device.CreateSparse(bpath, 2*n*blockSize); err != nil {
		t.Fatal(err)
	}
	cf, err := device.OpenFile(cpath, device.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer cf.Close()
	bf, err := device.OpenFile(bpath, device.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	specs := []BackingSpec{{Name: "a", Dev: bf}}
	sb, err := Format(cf, specs, FormatOptions{BucketSize: bs, JournalSize: jl, IndexPages: paged})
	if err != nil {
		t.Fatal(err)
	}
	dev := &countingWrites{Device: cf, lo: sb.CkptOff[0], hi: sb.CkptOff[0] + 2*sb.CkptLen}
	s, err := Open(dev, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, _ := s.Volume("a")
	st := DefaultSettings()
	st.WritebackRateMax = 4096 // keep the blocks dirty and cached
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	// Blocks at LBAs 2i: no two adjacent (no sequential run).
	perm := rand.New(rand.NewPCG(uint64(n), 1)).Perm(int(n))
	fill := time.Now()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := make([]byte, blockSize)
			for i := w; i < len(perm); i += 8 {
				b[0] = byte(i)
				if err := v.WriteAt(b, int64(2*perm[i])*blockSize, false); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := s.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Logf("  fill: %d blocks in %v; %d cached", n, time.Since(fill).Round(time.Millisecond), v.Stats().CachedBlocks)
	c0, b0 := s.Stats().Checkpoints, dev.n.Load()
	var writes atomic.Int64
	stop := time.Now().Add(*flagPagedLoad)
	start := time.Now()
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 9))
			b := make([]byte, blockSize)
			for time.Now().Before(stop) {
				b[0] = byte(r.Uint32())
				if err := v.WriteAt(b, int64(2*r.Int64N(n))*blockSize, false); err != nil {
					t.Error(err)
					return
				}
				writes.Add(1)
			}
		}()
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	ck, by := s.Stats().Checkpoints-c0, dev.n.Load()-b0
	t.Logf("  load: %.0f writes/s, %d checkpoints, %.1f MiB/s into the checkpoint region (%.2f MiB a checkpoint)",
		float64(writes.Load())/el, ck, float64(by)/el/(1<<20), float64(by)/float64(max(ck, 1))/(1<<20))
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if *flagPagedProfile != "" && paged {
		f, err := os.Create(*flagPagedProfile)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Now()
	s, err = Open(cf, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	clean := time.Since(t0)
	if *flagPagedProfile != "" && paged {
		pprof.StopCPUProfile()
	}
	// Overwrites since the Open's checkpoint, then a crash.
	v, _ = s.Volume("a")
	r := rand.New(rand.NewPCG(7, 7))
	b := make([]byte, blockSize)
	for range 20000 {
		if err := v.WriteAt(b, int64(2*r.Int64N(n))*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Flush(); err != nil {
		t.Fatal(err)
	}
	s.crashStop()
	if *flagPagedProfile != "" && paged {
		f, err := os.Create(*flagPagedProfile + ".crash")
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
	}
	t0 = time.Now()
	s, err = Open(cf, specs, OpenOptions{Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatal(err)
	}
	crashed := time.Since(t0)
	if *flagPagedProfile != "" && paged {
		pprof.StopCPUProfile()
	}
	t.Logf("  open: %v after a clean close, %v after a crash (20,000 writes since the checkpoint)", clean.Round(time.Millisecond), crashed.Round(time.Millisecond))
	_ = s.Close()
}
