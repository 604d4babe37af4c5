package cache

import (
	"bytes"
	"context"
	"testing"
)

// TestEmptyBucketsAfterDetach: the buckets a detached volume filled stay
// sealed until GC needs them, and Stats counts them as empty (no live
// block), which is what 'tiercache usage' shows as reclaimable.
func TestEmptyBucketsAfterDetach(t *testing.T) {
	const bs = 64 << 10
	s, _, _ := newTestSet(t, 32, bs, 4<<20, 4<<20)
	a, _ := s.Volume("a")
	// Four buckets' worth of scattered writes, flushed: sealed buckets
	// full of a's blocks.
	data := bytes.Repeat([]byte{0x5a}, blockSize)
	for i := 0; i < 4*bs/blockSize; i++ {
		if err := a.WriteAt(data, int64(i)*2*blockSize, false); err != nil {
			t.Fatal(err)
		}
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
	if after.EmptyBuckets < 3 || after.EmptyBuckets > after.SealedBuckets {
		t.Errorf("after the detach: %d sealed, %d empty; want the >= 3 buckets a filled counted empty", after.SealedBuckets, after.EmptyBuckets)
	}
}
