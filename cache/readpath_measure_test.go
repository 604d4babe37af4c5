package cache

import (
	"context"
	"testing"
	"time"
)

// TestMeasurePartlyCachedRead is S1 of docs/BENCHMARKS.md in miniature, for
// readpath.go's concurrent, coalesced reads: 4 KiB random writes over 1/16
// of a region (the S1 density), drained so the backing device is up to
// date and the cache holds them clean, then a 1 MiB QD1 sequential read of
// the region, against the same read of the plain HDD model. Figures only; run
// with
//
//	go test ./cache -run TestMeasurePartlyCachedRead -measure -v
func TestMeasurePartlyCachedRead(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	const region = 256 << 20
	const scale = 0.5
	lbas := randomLBAs(region/blockSize/16, region/blockSize, 11)
	readAll := func(read func(p []byte, off int64) error) time.Duration {
		buf := make([]byte, 1<<20)
		start := time.Now()
		for off := int64(0); off < region; off += int64(len(buf)) {
			if err := read(buf, off); err != nil {
				t.Fatal(err)
			}
		}
		return modelTime(time.Since(start), scale)
	}
	plain := measureHDD(t, region, scale)
	base := readAll(func(p []byte, off int64) error { _, err := plain.ReadAt(p, off); return err })
	t.Logf("plain HDD model: %v (%.1f MB/s)", base.Round(time.Millisecond), region/1e6/base.Seconds())
	hdd := measureHDD(t, region, scale)
	s, v := measureModelSet(t, hdd, scale)
	p := make([]byte, blockSize)
	for _, l := range lbas {
		if err := v.WriteAt(p, int64(l)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	st0 := v.Stats()
	d := readAll(func(p []byte, off int64) error { return v.ReadAt(p, off) })
	st1 := v.Stats()
	hs := hdd.Stats()
	t.Logf("cached:   %v (%.1f MB/s) = %.3fx plain; hits %d MiB, %d cached blocks; HDD reads %d, buffer hits %d",
		d.Round(time.Millisecond), region/1e6/d.Seconds(), base.Seconds()/d.Seconds(),
		(st1.ReadHitBytes-st0.ReadHitBytes)>>20, st1.CachedBlocks, hs.Reads, hs.BufferHits)
}
