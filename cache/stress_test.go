package cache

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestConcurrentStress runs writers, readers, flushers, mode switches and
// drains at once over a tiny cache (run it with -race). Each writer owns a
// disjoint region, so the final content is known exactly.
func TestConcurrentStress(t *testing.T) {
	const (
		writers = 6
		region  = 24 * blockSize
	)
	s, _, _ := newTestSet(t, 6, 4*blockSize, writers*region)
	v := s.vols[0]
	model := make([]byte, writers*region)
	dur := 2 * time.Second
	if testing.Short() || raceEnabled {
		dur = 700 * time.Millisecond
	}
	deadline := time.Now().Add(dur)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			base := int64(w * region)
			mine := model[base : base+region]
			for i := uint64(1); time.Now().Before(deadline); i++ {
				off := rng.Int64N(region/512) * 512
				n := min(int64(1+rng.IntN(12))*512, region-off)
				switch rng.IntN(10) {
				case 0, 1, 2, 3, 4:
					p := make([]byte, n)
					stamp(p, uint64(w)<<32|i, 0, base+off)
					if err := v.WriteAt(p, base+off, rng.IntN(8) == 0); err != nil {
						errs <- err
						return
					}
					copy(mine[off:], p)
				case 5:
					if err := v.WriteZeroes(base+off, n, false, true, false); err != nil {
						errs <- err
						return
					}
					clear(mine[off : off+n])
				case 6:
					if err := v.Flush(); err != nil {
						errs <- err
						return
					}
				default:
					got := make([]byte, n)
					if err := v.ReadAt(got, base+off); err != nil {
						errs <- err
						return
					}
					if !bytes.Equal(got, mine[off:off+n]) {
						errs <- fmt.Errorf("writer %d: read at %d+%d differs", w, base+off, n)
						return
					}
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // mode switches and drains
		defer wg.Done()
		rng := rand.New(rand.NewPCG(99, 1))
		for time.Now().Before(deadline) {
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
			if rng.IntN(3) == 0 {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				if err := s.Drain(ctx); err != nil && ctx.Err() == nil {
					errs <- err
				}
				cancel()
				continue
			}
			if err := v.SetMode(Mode(rng.IntN(4))); err != nil {
				errs <- err
				return
			}
			if err := s.Check(); err != nil {
				errs <- err
				return
			}
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got := make([]byte, len(model))
	if err := v.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("final content differs from model")
	}
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Logf("stats: %+v", s.Stats())
}
