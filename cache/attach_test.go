package cache

import (
	"bytes"
	"context"
	"testing"
)

func TestDrainDirtyAndDetach(t *testing.T) {
	s, _, backs := newTestSet(t, 8, 64<<10, 4<<20, 4<<20)
	a, b := s.Volumes()[0], s.Volumes()[1]
	opsWriteBlocks(t, a, 20)
	opsWriteBlocks(t, b, 5)
	var seen []int64
	if err := a.DrainDirty(context.Background(), func(n int64) { seen = append(seen, n) }); err != nil {
		t.Fatal(err)
	}
	// Background writeback may have cleaned some blocks already.
	if a.DirtyBlocks() != 0 || b.DirtyBlocks() > 5 {
		t.Fatalf("after drain: a %d b %d dirty", a.DirtyBlocks(), b.DirtyBlocks())
	}
	if len(seen) < 2 || seen[0] > 20 || seen[len(seen)-1] != 0 {
		t.Errorf("progress: %v", seen)
	}
	if err := b.Detach(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	if st := b.Stats(); st.CachedBlocks != 0 || st.DirtyBlocks != 0 || b.Mode() != None {
		t.Fatalf("after detach: %+v", st)
	}
	if s.Superblock().Backings[1].Mode != None {
		t.Error("mode none not persisted")
	}
	// The backing device alone holds every write.
	for i := 0; i < 5; i++ {
		p := make([]byte, blockSize)
		if _, err := backs[1].ReadAt(p, int64(2*i)*blockSize); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, bytes.Repeat([]byte{byte(i + 1)}, blockSize)) {
			t.Fatalf("backing block %d incomplete after detach", 2*i)
		}
	}
}

func TestDrainDirtyCanceled(t *testing.T) {
	s, _, _ := newTestSet(t, 8, 64<<10, 4<<20)
	v := s.Volumes()[0]
	opsWriteBlocks(t, v, 3)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := v.DrainDirty(ctx, nil); err == nil {
		t.Fatal("drain with a canceled context succeeded")
	}
}
