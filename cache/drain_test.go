package cache

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/writeback"
)

// drainers are the two ways to drain a volume; they share Set.drain.
var drainers = []struct {
	name  string
	drain func(s *Set, v *Volume, progress func(int64)) error
}{
	{"Set.Drain", func(s *Set, v *Volume, _ func(int64)) error { return s.Drain(context.Background()) }},
	{"Volume.DrainDirty", func(s *Set, v *Volume, progress func(int64)) error {
		return v.DrainDirty(context.Background(), progress)
	}},
}

// TestDrainGivesUpOnChecksum: a dirty block whose cached copy fails its
// checksum is retried in writeback.DrainChecksumTries passes, then given up on with
// an *UnwritableError naming it; every other dirty block is written back.
func TestDrainGivesUpOnChecksum(t *testing.T) {
	for _, d := range drainers {
		t.Run(d.name, func(t *testing.T) {
			s, cache, backs := newTestSetKnobs(t, testingKnobs{noBackground: true}, 8, 4*blockSize, 64*blockSize)
			v := s.vols[0]
			for _, lba := range []int64{5, 6, 20} {
				if err := v.WriteAt(bytes.Repeat([]byte{byte(lba)}, blockSize), lba*blockSize, false); err != nil {
					t.Fatal(err)
				}
			}
			e, _ := v.idx.Tree.Get(index.Ent{LBA: 6})
			if err := cache.Corrupt(s.cacheOff(e.Block())+100, 1); err != nil {
				t.Fatal(err)
			}
			err := d.drain(s, v, nil)
			var ue *UnwritableError
			if !errors.As(err, &ue) || !errors.Is(err, ErrChecksum) || !IsCorruption(err) {
				t.Fatalf("drain: %v, want an *UnwritableError", err)
			}
			t.Log(err)
			want := UnwritableBlock{Volume: "a", LBA: 6, CacheOffset: s.cacheOff(e.Block())}
			if ue.N != 1 || len(ue.Blocks) != 1 || ue.Blocks[0] != want || ue.Dirty != 1 || ue.Tries != writeback.DrainChecksumTries {
				t.Fatalf("error %+v, want block %+v given up on after %d tries", ue, want, writeback.DrainChecksumTries)
			}
			if got := v.Stats().ChecksumErrors; got != writeback.DrainChecksumTries {
				t.Fatalf("%d checksum failures, want one per pass: %d", got, writeback.DrainChecksumTries)
			}
			for _, lba := range []int64{5, 20} {
				got := make([]byte, blockSize)
				if _, err := backs[0].ReadAt(got, lba*blockSize); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, bytes.Repeat([]byte{byte(lba)}, blockSize)) {
					t.Fatalf("lba %d not written back", lba)
				}
			}
		})
	}
}

// TestDrainRetriesChecksum: a block that fails its checksum in fewer than
// writeback.DrainChecksumTries passes in a row (here a cache read that returns bad
// data twice) is written back once it reads well, and the drain succeeds.
func TestDrainRetriesChecksum(t *testing.T) {
	s, cache, backs := newTestSetKnobs(t, testingKnobs{noBackground: true}, 8, 4*blockSize, 64*blockSize)
	v := s.vols[0]
	p := bytes.Repeat([]byte{6}, blockSize)
	if err := v.WriteAt(p, 6*blockSize, false); err != nil {
		t.Fatal(err)
	}
	e, _ := v.idx.Tree.Get(index.Ent{LBA: 6})
	off := s.cacheOff(e.Block()) + 100
	if err := cache.Corrupt(off, 1); err != nil {
		t.Fatal(err)
	}
	// progress is called before the first pass, then after each batch and
	// each pass's commit (two calls per pass here): after the commit of
	// pass writeback.DrainChecksumTries-1, repair the block.
	calls := 0
	progress := func(int64) {
		if calls++; calls == 1+2*(writeback.DrainChecksumTries-1) {
			if err := cache.Corrupt(off, 1); err != nil {
				t.Error(err)
			}
		}
	}
	if err := v.DrainDirty(context.Background(), progress); err != nil {
		t.Fatal(err)
	}
	if got := v.Stats().ChecksumErrors; got != writeback.DrainChecksumTries-1 {
		t.Fatalf("%d checksum failures, want %d", got, writeback.DrainChecksumTries-1)
	}
	got := make([]byte, blockSize)
	if _, err := backs[0].ReadAt(got, 6*blockSize); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, p) {
		t.Fatal("lba 6 not written back")
	}
}
