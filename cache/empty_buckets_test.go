package cache

import (
	"bytes"
	"context"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestDetachFreesBuckets: the buckets a detached volume filled go back on
// the free list when the detach returns (they stayed sealed and empty until
// GC ran short, and 'tiercache usage' showed them used until a restart), a
// bucket another volume still uses stays, and a power loss right after the
// detach recovers to the same free buckets.
func TestDetachFreesBuckets(t *testing.T) {
	const bs = 64 << 10
	s, cdev, backs := newTestSet(t, 32, bs, 4<<20, 4<<20)
	a, _ := s.Volume("a")
	b, _ := s.Volume("b")
	// Four buckets' worth of scattered writes of a, flushed, then one block
	// of b: sealed buckets full of a's blocks, and the open bucket shared.
	data := bytes.Repeat([]byte{0x5a}, blockSize)
	for i := 0; i < 4*bs/blockSize; i++ {
		if err := a.WriteAt(data, int64(i)*2*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.WriteAt(data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	before := s.Stats()
	if before.SealedBuckets < 3 || before.EmptyBuckets != 0 {
		t.Fatalf("before the detach: %d sealed, %d empty; want >= 3 sealed, none empty", before.SealedBuckets, before.EmptyBuckets)
	}
	if err := a.Detach(context.Background(), DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	after := s.Stats()
	// b's block keeps its bucket (the open one) and only it.
	if after.EmptyBuckets != 0 || after.SealedBuckets != 0 || after.FreeBuckets != after.Buckets-1 {
		t.Fatalf("after detaching a: %d sealed, %d empty, %d of %d free; want none sealed, all free but b's bucket",
			after.SealedBuckets, after.EmptyBuckets, after.FreeBuckets, after.Buckets)
	}
	if after.Evictions < uint64(before.SealedBuckets) {
		t.Errorf("evictions %d after freeing %d sealed buckets", after.Evictions, before.SealedBuckets)
	}
	// The freed buckets take new writes of b, which read back.
	for i := 0; i < 3*bs/blockSize; i++ {
		if err := b.WriteAt(bytes.Repeat([]byte{byte(i)}, blockSize), int64(i+1)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	holding := int64(0) // buckets b's blocks are in
	for i := range s.mu.Buckets {
		if s.mu.Buckets[i].Live > 0 {
			holding++
		}
	}
	s.mu.Unlock()
	// Power loss now: recovery agrees on what is free.
	s.crashStop()
	s2, err := Open(cdev.CrashClone(device.CrashConfig{}), []BackingSpec{{Name: "b", Dev: backs[1].CrashClone(device.CrashConfig{})}}, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.crashStop() })
	checkAfter(t, s2)
	if got := s2.Stats(); got.SealedBuckets != holding || got.FreeBuckets != got.Buckets-holding {
		t.Errorf("after recovery: %d sealed, %d of %d free; before the crash b's blocks were in %d buckets, the rest free",
			got.SealedBuckets, got.FreeBuckets, got.Buckets, holding)
	}
	b2, _ := s2.Volume("b")
	p := make([]byte, blockSize)
	for i := 0; i < 3*bs/blockSize; i++ {
		if err := b2.ReadAt(p, int64(i+1)*blockSize); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, bytes.Repeat([]byte{byte(i)}, blockSize)) {
			t.Fatalf("b block %d after recovery: %x..., want %02x", i+1, p[:4], byte(i))
		}
	}
}
