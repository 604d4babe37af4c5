package cache

import (
	"testing"
	"time"
)

// waitUntil waits for cond, failing the test if it does not hold within a
// deadline far beyond any expected delay (a hang, not a slow machine).
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting for %s after 30 s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestCommitLoopWakes: an idle commitLoop waits for a signal, and both
// things it commits without a FLUSH wake it: a backing write that only
// needs a sync (a none-mode write on a volume no recovery could find an
// entry of appends no record) and an appended record.
func TestCommitLoopWakes(t *testing.T) {
	s, _, _ := newTestSet(t, 16, 64*blockSize, 1<<20)
	v := s.vols[0]
	if err := v.SetMode(None); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "commitLoop idle", s.commitIdle.Load)
	if err := v.WriteAt(make([]byte, blockSize), 0, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the backing write synced", func() bool { return !s.backingsUnsynced() })

	if err := v.SetMode(Writeback); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "commitLoop idle", s.commitIdle.Load)
	if err := v.WriteAt(make([]byte, blockSize), blockSize, false); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	target := s.mu.seq
	s.mu.Unlock()
	waitUntil(t, "the write's records durable", func() bool { return s.durable.Load() >= target })
	waitUntil(t, "commitLoop idle again", s.commitIdle.Load)
}

// TestGCLoopSignalled: allocations that take the free list below the
// low-water mark wake gcLoop, which frees buckets until it is at the mark
// again (no periodic poll does it). The last allocation of a burst, the
// one that takes the list under the mark and needs no bucket after it,
// must signal too: without that, about one run in thirty (-race,
// invariants) ended with one free bucket of a low-water mark of two and
// GC idle.
func TestGCLoopSignalled(t *testing.T) {
	s, _, _ := newTestSet(t, 16, 64*blockSize, 1<<24)
	v := s.vols[0]
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, blockSize)
	for i := int64(0); i < 3*16*64; i++ {
		// Scattered, so that no sequential stream bypasses the cache.
		if err := v.WriteAt(p, (i*7919)%(1<<12)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if s.Stats().Evictions == 0 {
		t.Fatal("three cache sizes of writes evicted nothing")
	}
	defer func() {
		if t.Failed() {
			s.mu.Lock()
			t.Logf("free %v, sealed %v, open %d, low-water mark %d", s.mu.free, s.mu.sealed, s.mu.open, s.lowWater())
			for i := range s.mu.alloc {
				t.Logf("bucket %d: %v, fill %d, pins %d, live %d, dirty %d", i, s.mu.alloc[i].state, s.mu.alloc[i].fill, s.mu.alloc[i].pins, s.mu.Buckets[i].Live, s.mu.Buckets[i].Dirty)
			}
			s.mu.Unlock()
		}
	}()
	waitUntil(t, "free buckets at the low-water mark", func() bool { return !s.needSpace() })
}
