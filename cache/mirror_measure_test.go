package cache

import (
	"flag"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/model"
)

var (
	flagMirrorModel = flag.String("mirrormodel", "", "TestMeasureMirrorCost: put each member on its own device model (ssd or nvme, over memory) instead of an O_DIRECT file")
	flagMirrorScale = flag.Float64("mirrorscale", 1, "TestMeasureMirrorCost: the models' TimeScale (wall time per model time; 4 runs them 4x slower)")
	flagMirrorB     = flag.Int64("mirrorbslots", 0, "TestMeasureMirrorCost: B's bucket slots (0: a quarter of A's buckets)")
)

// TestMeasureMirrorCost measures what a mirror costs the write path
// (docs/BENCHMARKS.md, "Engine measurements"): 4 KiB random writes in
// writeback mode at queue depth 8 for 2 s (IOPS), then 300 writes each
// followed by a FLUSH at queue depth 1 (FLUSH latency), on a set whose
// cache is one device and on the same set mirrored on a second one (B a
// quarter of A's size unless -mirrorbslots). The devices are O_DIRECT
// files in TIERCACHE_MEASURE_DIR (or the test's temporary directory), or
// with -mirrormodel two devices of the same model (device/model), each
// its own drive: on a machine with one disk that is the only way to give
// each member its own queue. The two configurations alternate, five
// rounds each; it prints every round and the medians. The backing device
// is memory (writeback in the background costs the same in both). Figures
// only; run with
//
//	go test ./cache -run TestMeasureMirrorCost -measure -v [-mirrormodel ssd -mirrorbslots 192]
func TestMeasureMirrorCost(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	dir := os.Getenv("TIERCACHE_MEASURE_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	const (
		nb     = 192 // 1 MiB buckets
		volume = 1 << 30
		qd     = 8
		span   = 2 * time.Second
	)
	var closeAfter []device.Device
	open := func(name string, size int64) device.Device {
		if *flagMirrorModel != "" {
			d, err := model.Wrap(*flagMirrorModel, device.NewMem(size), model.Params{TimeScale: *flagMirrorScale})
			if err != nil {
				t.Fatal(err)
			}
			// Closed (and its memory dropped) at the end of the round.
			closeAfter = append(closeAfter, d)
			return d
		}
		p := filepath.Join(dir, name)
		os.Remove(p)
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		f.Close()
		t.Cleanup(func() { os.Remove(p) })
		d, err := device.OpenFile(p, device.FileOptions{Direct: device.DirectAuto})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	type result struct {
		iops       float64
		f50, f90   time.Duration
		slotsUsed  int64
		throughBlk uint64
	}
	results := map[bool][]result{}
	for round := range 5 {
		for _, mirrored := range []bool{round%2 == 1, round%2 == 0} {
			a := open("a.img", measureCacheSize(nb))
			back := device.NewMem(volume)
			specs := []BackingSpec{{Name: "v", Dev: back}}
			opts := FormatOptions{BucketSize: 1 << 20, JournalSize: 8 << 20}
			var b device.Device
			if mirrored {
				sb, err := Format(a, specs, FormatOptions{BucketSize: 1 << 20, JournalSize: 8 << 20, DryRun: true})
				if err != nil {
					t.Fatal(err)
				}
				slots := int64(nb / 4)
				if *flagMirrorB > 0 {
					slots = *flagMirrorB
				}
				b = open("b.img", sb.BucketsOff+slots*(1<<20+blockSize))
				opts.Mirror = b
			}
			if _, err := Format(a, specs, opts); err != nil {
				t.Fatal(err)
			}
			s, err := Open(a, specs, OpenOptions{Mirror: b})
			if err != nil {
				t.Fatal(err)
			}
			v, _ := s.Volume("v")
			var ops atomic.Int64
			var wg sync.WaitGroup
			deadline := time.Now().Add(span)
			t0 := time.Now()
			for w := range qd {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(round), uint64(w)))
					p := make([]byte, blockSize)
					for time.Now().Before(deadline) {
						if err := v.WriteAt(p, int64(rng.Uint64N(volume/blockSize))*blockSize, false); err != nil {
							t.Error(err)
							return
						}
						ops.Add(1)
					}
				}()
			}
			wg.Wait()
			iops := float64(ops.Load()) / time.Since(t0).Seconds()
			var fl []time.Duration
			rng := rand.New(rand.NewPCG(uint64(round), 99))
			p := make([]byte, blockSize)
			for range 300 {
				if err := v.WriteAt(p, int64(rng.Uint64N(volume/blockSize))*blockSize, false); err != nil {
					t.Fatal(err)
				}
				t1 := time.Now()
				if err := v.Flush(); err != nil {
					t.Fatal(err)
				}
				fl = append(fl, time.Since(t1))
			}
			slices.Sort(fl)
			r := result{iops: iops, f50: fl[len(fl)/2].Round(time.Microsecond), f90: fl[len(fl)*9/10].Round(time.Microsecond)}
			if m := s.Stats().Mirror; m != nil {
				r.slotsUsed, r.throughBlk = m.SlotsUsed, m.WritethroughBlocks
			}
			results[mirrored] = append(results[mirrored], r)
			t.Logf("round %d mirrored %-5t: %6.0f write IOPS (QD%d), FLUSH p50 %v p90 %v; B slots used %d, written through %d blocks",
				round, mirrored, r.iops, qd, r.f50, r.f90, r.slotsUsed, r.throughBlk)
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			for _, d := range closeAfter {
				d.Close()
			}
			closeAfter = nil
		}
	}
	med := func(rs []result, f func(result) float64) float64 {
		x := make([]float64, len(rs))
		for i, r := range rs {
			x[i] = f(r)
		}
		slices.Sort(x)
		return x[len(x)/2]
	}
	iops := func(r result) float64 { return r.iops }
	f50 := func(r result) float64 { return float64(r.f50) }
	single, mirror := results[false], results[true]
	t.Logf("medians: write IOPS single %.0f, mirrored %.0f (%.2fx); FLUSH p50 single %v, mirrored %v (%.2fx)",
		med(single, iops), med(mirror, iops), med(mirror, iops)/med(single, iops),
		time.Duration(med(single, f50)), time.Duration(med(mirror, f50)), med(mirror, f50)/med(single, f50))
}
