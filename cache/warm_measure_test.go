package cache

import (
	"slices"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/model"
)

// TestMeasureWarmWritePath measures what region marks cost the write path
// (docs/BENCHMARKS.md, "Engine measurements"): 4 KiB writes at random over
// an 8 GiB volume (8 mark regions) on the HDD model, each followed by a
// FLUSH, in writethrough and writearound mode, on a set with the
// warm-clean feature and on the same set rewritten as format version 2
// (no marks), three times over. The volume holds 16 cached blocks, so its
// passthrough writes are journaled. It prints the median and 90th
// percentile of the write and of the FLUSH. Figures only; run with
//
//	go test ./cache -run TestMeasureWarmWritePath -measure -v
func TestMeasureWarmWritePath(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	const (
		size  = 8 << 30
		n     = 400
		scale = 0.5
	)
	lbas := randomLBAs(n, size/blockSize, 21)
	for rep := range 3 {
		for _, mode := range []Mode{Writethrough, Writearound} {
			for _, warm := range []bool{true, false} {
				hdd := measureHDD(t, size, scale)
				cdev, err := model.Wrap(model.KindSSD, device.NewMem(measureCacheSize(64)), model.Params{TimeScale: scale})
				if err != nil {
					t.Fatal(err)
				}
				s := measureSetOn(t, cdev, hdd, DefaultSettings(), testingKnobs{})
				if !warm {
					// The same set as format version 2: no marks.
					s.crashStop()
					sb, err := ReadSuperblock(cdev)
					if err != nil {
						t.Fatal(err)
					}
					sb.Features, sb.MarkShift, sb.Version = 0, 0, ondisk.FormatVersion
					sb.Seq++
					if err := ondisk.WriteSuperblock(cdev, sb); err != nil {
						t.Fatal(err)
					}
					if s, err = Open(cdev, []BackingSpec{{Name: "hdd", Dev: hdd}}, OpenOptions{}); err != nil {
						t.Fatal(err)
					}
					t.Cleanup(s.crashStop)
				}
				v, _ := s.Volume("hdd")
				p := make([]byte, blockSize)
				// Something cached clean (16 writethrough blocks, not at
				// the LBAs written below), so the volume's passthrough
				// writes are journaled (replayable).
				if err := v.SetMode(Writethrough); err != nil {
					t.Fatal(err)
				}
				for l := range uint64(16) {
					if err := v.WriteAt(p, int64(l)*blockSize, false); err != nil {
						t.Fatal(err)
					}
				}
				if err := v.SetMode(mode); err != nil {
					t.Fatal(err)
				}
				var wl, fl []time.Duration
				for _, l := range lbas {
					t0 := time.Now()
					if err := v.WriteAt(p, int64(l)*blockSize, false); err != nil {
						t.Fatal(err)
					}
					t1 := time.Now()
					if err := v.Flush(); err != nil {
						t.Fatal(err)
					}
					wl = append(wl, modelTime(t1.Sub(t0), scale))
					fl = append(fl, modelTime(time.Since(t1), scale))
				}
				q := func(d []time.Duration, f float64) time.Duration {
					slices.Sort(d)
					return d[int(f*float64(len(d)-1))].Round(time.Microsecond)
				}
				t.Logf("run %d %-12v warm-clean %-5t: write p50 %v p90 %v; flush p50 %v p90 %v; commits %d",
					rep, mode, warm, q(wl, 0.5), q(wl, 0.9), q(fl, 0.5), q(fl, 0.9), s.Stats().Commits)
				s.crashStop()
			}
		}
	}
}
