package model

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// TestDrainOrders measures, in virtual time (exact model figures, the same
// on a loaded machine), the writes behind issue 4's writeback bar: 64 MiB
// of distinct random 4 KiB blocks over 1 GiB, written by the host straight
// to the HDD model in arrival order (QD32, QD1; the drive's write cache on
// and off) and in ascending LBA order at QD32 (what a sorted writeback
// without engine overhead sends), against the bar's physical limit, one
// revolution per track visited. Once with the 1 GiB as the whole disk (the
// cache measurements' set-up: a random seek crosses a share of the full
// stroke) and once as the first 1 GiB of a 3 TB disk (short seeks). Run:
//
//	go test ./device/model -run TestDrainOrders -calibrate -v
func TestDrainOrders(t *testing.T) {
	if !*calibrate {
		t.Skip("use -calibrate")
	}
	const span = gib
	const nblk = 64 << 20 / 4096
	rng := rand.New(rand.NewPCG(42, 1)) // cache/writeback_measure_test.go's randomLBAs(nblk, span/4096, 42)
	seen := map[uint64]bool{}
	var arrival []int64
	for len(arrival) < nblk {
		l := rng.Uint64N(span / 4096)
		if !seen[l] {
			seen[l] = true
			arrival = append(arrival, int64(l)*4096)
		}
	}
	sorted := slices.Clone(arrival)
	slices.Sort(sorted)
	for _, capacity := range []int64{0, 3e12} {
		name := "1 GiB = whole disk"
		if capacity > 0 {
			name = "1 GiB at the start of a 3 TB disk"
		}
		var limit time.Duration
		synctest.Test(t, func(t *testing.T) {
			h := virtualHDD(t, span, func(p *HDDParams) { p.Capacity = capacity })
			tracks := map[int64]bool{}
			for _, off := range arrival {
				tracks[h.g.track(off)] = true
			}
			limit = time.Duration(int64(len(tracks)) * h.g.rev)
			t.Logf("%s: %d tracks visited (of %d in the span); one revolution each: %v", name, len(tracks), h.g.track(span-1)+1, limit)
		})
		for _, c := range []struct {
			what  string
			offs  []int64
			qd    int
			tune  func(*HDDParams)
			ratio bool
		}{
			{"sorted, QD32, write cache on", sorted, 32, nil, false},
			{"sorted, QD32, write cache off", sorted, 32, func(p *HDDParams) { p.WriteThrough = true }, false},
			{"arrival, QD32, write cache on", arrival, 32, nil, true},
			{"arrival, QD32, write cache on, destage window 32", arrival, 32, func(p *HDDParams) { p.DestageQueue = 32 }, true},
			{"arrival, QD32, write cache off (NCQ 32 only)", arrival, 32, func(p *HDDParams) { p.WriteThrough = true }, true},
			{"arrival, QD1, write cache on", arrival, 1, nil, true},
			{"arrival, QD1, write cache off", arrival, 1, func(p *HDDParams) { p.WriteThrough = true }, true},
		} {
			synctest.Test(t, func(t *testing.T) {
				h := virtualHDD(t, span, func(p *HDDParams) {
					p.Capacity = capacity
					if c.tune != nil {
						c.tune(p)
					}
				})
				d := writeOffsets(t, h, c.offs, c.qd)
				st := h.Stats()
				t.Logf("%s: %s: %v (%.0f IOPS, %.2fx the one-revolution limit; seek %v, rotation %v)",
					name, c.what, d.Round(time.Millisecond), float64(len(c.offs))/d.Seconds(), d.Seconds()/limit.Seconds(), st.SeekTime.Round(time.Millisecond), st.RotationalWait.Round(time.Millisecond))
			})
		}
	}
}

// writeOffsets writes 4 KiB at each offset with qd writers taking them in
// order, then syncs, and returns the elapsed (virtual) time.
func writeOffsets(t *testing.T, h *HDD, offs []int64, qd int) time.Duration {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	buf := make([]byte, 4096)
	start := time.Now()
	for range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(offs)) {
					return
				}
				if _, err := h.WriteAt(buf, offs[i]); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := h.Sync(); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}
