package cache

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device/faultdev"
)

// opsWriteBlocks writes n 4 KiB blocks with distinct contents at every other
// block, flushes, and returns the pattern.
func opsWriteBlocks(t *testing.T, v *Volume, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		p := bytes.Repeat([]byte{byte(i + 1)}, blockSize)
		if err := v.WriteAt(p, int64(2*i)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
}

func TestScrubOnlineFindsCorruptDirtyBlock(t *testing.T) {
	s, cdev, _ := newTestSet(t, 8, 64<<10, 4<<20)
	v := s.Volumes()[0]
	opsWriteBlocks(t, v, 10)
	var calls int
	rep, err := s.Scrub(context.Background(), func(done, total int64) { calls++ })
	if err != nil || !rep.OK() || rep.Blocks != 10 || rep.DirtyBlocks != 10 || calls == 0 {
		t.Fatalf("clean scrub: %+v err %v calls %d", rep, err, calls)
	}
	// Corrupt the cache copy of lba 4 (dirty: exists nowhere else).
	var off int64 = -1
	s.mu.Lock()
	if e, ok := v.idx.Tree.Get(index.Ent{LBA: 4}); ok {
		off = s.cacheOff(e.Block())
	}
	s.mu.Unlock()
	if off < 0 {
		t.Fatal("lba 4 not cached")
	}
	if _, err := cdev.WriteAt([]byte("garbage"), off+100); err != nil {
		t.Fatal(err)
	}
	rep, err = s.Scrub(context.Background(), nil)
	if err != nil || rep.OK() || rep.Bad != 1 || rep.BadDirty != 1 || len(rep.Problems) != 1 {
		t.Fatalf("scrub after corruption: %+v err %v", rep, err)
	}
	if !strings.Contains(rep.Problems[0], "lba 4") || !strings.Contains(rep.Problems[0], "checksum") {
		t.Errorf("problem does not name the block: %q", rep.Problems[0])
	}
}

func TestCheckOfflineAndImage(t *testing.T) {
	// The records must stay in the journal: a random checkpoint (invariants
	// builds) would leave it empty, 3 % a commit.
	s, cdev, _ := newTestSetKnobs(t, testingKnobs{fixedJournal: true}, 8, 64<<10, 4<<20, 1<<20)
	v := s.Volumes()[0]
	opsWriteBlocks(t, v, 7)
	// Not closed: the image is rebuilt from checkpoint + journal, as after a crash.
	var recs []string
	im, err := OpenImage(cdev, ImageOptions{OnRecord: func(r string) { recs = append(recs, r) }})
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) == 0 || !strings.HasPrefix(recs[0], "insert") {
		t.Errorf("journal records: %q", recs)
	}
	vs := im.Volumes()
	if len(vs) != 2 || vs[0].Name != "a" || vs[0].DirtyBlocks != 7 || vs[1].CachedBlocks != 0 {
		t.Errorf("volumes: %+v", vs)
	}
	var ents []IndexEntry
	im.Index(func(e IndexEntry) bool { ents = append(ents, e); return true })
	if len(ents) != 7 || ents[1].LBA != 2 || !ents[1].Dirty {
		t.Errorf("index: %+v", ents)
	}
	rep, err := CheckOffline(context.Background(), cdev, CheckOptions{})
	if err != nil || !rep.OK() || rep.Scrub.Blocks != 7 {
		t.Fatalf("check: %+v %+v err %v", rep, rep.Scrub, err)
	}
	// Damage superblock copy 0: reported, the set still loads from copy 1.
	if _, err := cdev.WriteAt([]byte("XXXX"), 40); err != nil {
		t.Fatal(err)
	}
	rep, err = CheckOffline(context.Background(), cdev, CheckOptions{})
	if err != nil || rep.OK() || len(rep.Problems) != 1 || !strings.Contains(rep.Problems[0], "superblock copy 0") {
		t.Fatalf("check after damage: %q err %v", rep.Problems, err)
	}
}

func TestCheckOfflineNotFormatted(t *testing.T) {
	s, _, backs := newTestSet(t, 8, 64<<10, 4<<20)
	_ = s
	if _, err := CheckOffline(context.Background(), backs[0], CheckOptions{}); err == nil {
		t.Fatal("check of a device without a cache set succeeded")
	}
}

// TestScrubConcurrentWithWrites: a scrub that races writes, overwrites and
// eviction on a small cache must not report blocks that changed under it.
func TestScrubConcurrentWithWrites(t *testing.T) {
	s, _, _ := newTestSet(t, 8, 64<<10, 4<<20)
	v := s.Volumes()[0]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		p := make([]byte, blockSize)
		for i := 0; ctx.Err() == nil; i++ {
			p[0] = byte(i)
			// 8 buckets of 16 blocks: 300 distinct blocks force eviction.
			if err := v.WriteAt(p, int64(i*7%300)*blockSize, false); err != nil {
				done <- err
				return
			}
			if i%50 == 0 {
				if err := v.Flush(); err != nil {
					done <- err
					return
				}
			}
		}
		done <- nil
	}()
	for i := 0; i < 20; i++ {
		rep, err := s.Scrub(context.Background(), nil)
		if err != nil || !rep.OK() {
			t.Fatalf("scrub %d during writes: %+v err %v", i, rep, err)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestCheckOfflineReadError: a cache block the device cannot read is
// reported as a read error of that block only, not of its whole run.
func TestCheckOfflineReadError(t *testing.T) {
	s, cdev, _ := newTestSet(t, 8, 64<<10, 4<<20)
	v := s.Volumes()[0]
	if err := v.WriteAt(bytes.Repeat([]byte{7}, 8*blockSize), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	var bad int64 = -1
	s.mu.Lock()
	if e, ok := v.idx.Tree.Get(index.Ent{LBA: 3}); ok {
		bad = s.cacheOff(e.Block())
	}
	s.mu.Unlock()
	if bad < 0 {
		t.Fatal("lba 3 not cached")
	}
	dev := faultdev.Wrap(cdev, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if op.Kind == faultdev.Read && op.Offset <= bad && bad < op.Offset+op.Len {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))
	rep, err := CheckOffline(context.Background(), dev, CheckOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() || rep.Scrub.ReadErrors != 1 || rep.Scrub.Blocks != 8 || !strings.Contains(rep.Scrub.Problems[0], "lba 3") {
		t.Fatalf("report %+v", rep.Scrub)
	}
}

func TestVolumeCached(t *testing.T) {
	s, _, _ := newTestSet(t, 8, 64<<10, 1<<20)
	v := s.Volumes()[0]
	if err := v.WriteAt(make([]byte, 2*blockSize), blockSize, false); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		off, n int64
		want   bool
	}{{blockSize, 2 * blockSize, true}, {blockSize + 100, 10, true}, {0, blockSize, false}, {blockSize, 3 * blockSize, false}, {0, 0, false}, {1 << 20, 1, false}} {
		if got := v.Cached(c.off, c.n); got != c.want {
			t.Errorf("Cached(%d, %d) = %v, want %v", c.off, c.n, got, c.want)
		}
	}
}
