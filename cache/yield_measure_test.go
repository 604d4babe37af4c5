package cache

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestMeasureReadsDuringDrain measures what writeback's yielding to client
// reads (yieldToReads) buys: a QD1 reader of uncached random 4 KiB blocks
// while Drain writes back 32 MiB of random dirty blocks over the HDD
// model, with the yield on and off. Model time.
//
//	go test ./cache -run TestMeasureReadsDuringDrain -measure -v
func TestMeasureReadsDuringDrain(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	for _, yield := range []bool{false, true, false, true} {
		lat, drain, yields, reads := readsDuringDrain(t, yield)
		slices.Sort(lat)
		q := func(p float64) time.Duration {
			if len(lat) == 0 {
				return 0
			}
			return lat[min(len(lat)-1, int(p*float64(len(lat))))].Round(100 * time.Microsecond)
		}
		t.Logf("yield=%t: drain of 32 MiB %v; %d reads during it: p50 %v, p90 %v, p99 %v, max %v; %d yield waits",
			yield, drain.Round(time.Millisecond), reads, q(0.5), q(0.9), q(0.99), q(1), yields)
	}
}

func readsDuringDrain(t *testing.T, yield bool) (lat []time.Duration, drain time.Duration, yields uint64, reads int) {
	const span = 1 << 30
	const nblk = 32 << 20 / blockSize
	hdd := measureHDD(t, span, measureScale)
	st := DefaultSettings()
	st.WritebackPercent = 100 // nothing in the background while filling
	st.Promote = "never"      // the reader's blocks stay misses
	s := measureSetKnobs(t, 160, hdd, st, testingKnobs{noYield: !yield})
	v, _ := s.Volume("hdd")
	buf := make([]byte, blockSize)
	dirty := map[uint64]bool{}
	for _, l := range randomLBAs(nblk, span/blockSize, 7) {
		dirty[l] = true
		if err := v.WriteAt(buf, int64(l)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan time.Duration)
	go func() {
		start := time.Now()
		if err := s.Drain(context.Background()); err != nil {
			t.Error(err)
		}
		done <- time.Since(start)
	}()
	rng := rand.New(rand.NewPCG(3, 3))
	p := make([]byte, blockSize)
	for {
		select {
		case d := <-done:
			return lat, modelTime(d, measureScale), v.wb.Stats().Yields, len(lat)
		default:
		}
		l := rng.Uint64N(span / blockSize)
		if dirty[l] {
			continue
		}
		t0 := time.Now()
		if err := v.ReadAt(p, int64(l)*blockSize); err != nil {
			t.Fatal(err)
		}
		lat = append(lat, modelTime(time.Since(t0), measureScale))
	}
}

// TestMeasureEpochPassthroughWait measures how long a writethrough write
// and a 64 KiB write-zeroes wait in epoch order when 16 MiB of random
// dirty data in 64 flush epochs is in the cache, over the HDD model (route
// writes both into the cache as dirty data of the current epoch). Model
// time.
//
//	go test ./cache -run TestMeasureEpochPassthroughWait -measure -v
func TestMeasureEpochPassthroughWait(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	{
		const span = 1 << 30
		const nblk = 16 << 20 / blockSize
		hdd := measureHDD(t, span, measureScale)
		st := DefaultSettings()
		st.WritebackPercent = 100
		st.WritebackOrder = OrderEpoch
		s := measureSet(t, 160, hdd, st)
		v, _ := s.Volume("hdd")
		buf := make([]byte, blockSize)
		for i, l := range randomLBAs(nblk, span/blockSize, 11) {
			if err := v.WriteAt(buf, int64(l)*blockSize, false); err != nil {
				t.Fatal(err)
			}
			if i%(nblk/64) == 0 {
				if err := v.Flush(); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := v.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := v.SetMode(Writethrough); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		if err := v.WriteAt(buf, 5<<20, false); err != nil {
			t.Fatal(err)
		}
		wt := modelTime(time.Since(t0), measureScale)
		t0 = time.Now()
		if err := v.WriteZeroes(9<<20, 64<<10, false, true, false); err != nil {
			t.Fatal(err)
		}
		wz := modelTime(time.Since(t0), measureScale)
		vs := v.Stats()
		t.Logf("writethrough 4 KiB write %v, write-zeroes 64 KiB %v (dirty left %d blocks, %d bytes deferred into the cache)",
			wt.Round(100*time.Microsecond), wz.Round(100*time.Microsecond), vs.DirtyBlocks, vs.EpochDeferBytes)
	}
}
