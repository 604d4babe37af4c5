package cache

import (
	"slices"
	"testing"
	"time"
)

// TestMeasureWarmWritePath measures what region marks cost the write path
// (docs/BENCHMARKS.md, "Engine measurements"): 4 KiB writes at random over
// an 8 GiB volume (8 mark regions) on the HDD model, each followed by a
// FLUSH, in writethrough and writearound mode, three times over. The
// volume holds 16 cached blocks, so its passthrough writes are journaled.
// It prints the median and 90th percentile of the write and of the FLUSH.
// (Its comparison with a set without marks, format version 2, was 169 vs
// 178 µs per writethrough write and no FLUSH difference measurable at load
// 21-26, 2026-12-02; Open now upgrades such a set.) Figures only; run with
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
			hdd := measureHDD(t, size, scale)
			s, v := measureModelSet(t, hdd, scale)
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
			t.Logf("run %d %-12v: write p50 %v p90 %v; flush p50 %v p90 %v; commits %d",
				rep, mode, q(wl, 0.5), q(wl, 0.9), q(fl, 0.5), q(fl, 0.9), s.Stats().Commits)
			s.crashStop()
		}
	}
}
