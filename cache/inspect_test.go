package cache

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
)

// TestImageMatchesLiveIndex: OpenImage runs Open's recovery (keeping clean
// entries), so it must rebuild exactly the index the live set holds once
// everything is committed.
func TestImageMatchesLiveIndex(t *testing.T) {
	s, cdev, _ := newTestSet(t, 8, 64<<10, 1<<20, 1<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	p := make([]byte, blockSize)
	for i := 0; i < 600; i++ {
		v := s.Volumes()[rng.IntN(2)]
		p[0] = byte(i)
		if err := v.WriteAt(p, int64(rng.IntN(200))*blockSize, false); err != nil {
			t.Fatal(err)
		}
		if i%97 == 0 {
			if err := v.Flush(); err != nil {
				t.Fatal(err)
			}
		}
	}
	s.crashStop() // no background work from here on
	if err := s.Flush(); err != nil {
		t.Fatal(err)
	}
	im, err := OpenImage(cdev, ImageOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var live []IndexEntry
	for _, v := range s.vols {
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			live = append(live, IndexEntry{Volume: v.name, LBA: e.LBA, CacheBlock: e.Block(), CRC: e.CRC, Dirty: e.Dirty()})
			return true
		})
	}
	var got []IndexEntry
	im.Index(func(e IndexEntry) bool {
		got = append(got, IndexEntry{Volume: e.Volume, LBA: e.LBA, CacheBlock: e.CacheBlock, CRC: e.CRC, Dirty: e.Dirty})
		return true
	})
	if len(got) != len(live) {
		t.Fatalf("image has %d entries, live index %d", len(got), len(live))
	}
	for i := range got {
		if got[i] != live[i] {
			t.Fatalf("entry %d: image %+v, live %+v", i, got[i], live[i])
		}
	}
	rep, err := CheckOffline(context.Background(), cdev, nil)
	if err != nil || !rep.OK() {
		t.Fatalf("offline check after a workload: %v %v %+v", err, rep.Problems, rep.Scrub)
	}
}
