package cache

import (
	"bytes"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestFileDevices runs a small workload over real files (O_DIRECT where the
// file system allows it), through a clean close and reopen, with a cache
// smaller than the data written.
func TestFileDevices(t *testing.T) {
	dir := t.TempDir()
	cachePath, backPath := filepath.Join(dir, "cache.img"), filepath.Join(dir, "back.img")
	if err := device.CreateSparse(cachePath, cacheSizeFor(8, 64<<10, minJournalLen, 1)); err != nil {
		t.Fatal(err)
	}
	if err := device.CreateSparse(backPath, 4<<20); err != nil {
		t.Fatal(err)
	}
	open := func() (*device.File, *device.File) {
		c, err := device.OpenFile(cachePath, device.FileOptions{})
		if err != nil {
			t.Fatal(err)
		}
		b, err := device.OpenFile(backPath, device.FileOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return c, b
	}
	c, b := open()
	specs := []BackingSpec{{Name: "a", Dev: b, ID: "file-a", Path: backPath}}
	if _, err := Format(c, specs, FormatOptions{BucketSize: 64 << 10, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(c, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v := s.vols[0]
	model := make([]byte, v.Size())
	rng := rand.New(rand.NewPCG(7, 7))
	for i := 0; i < 300; i++ {
		off := rng.Int64N(v.Size()/512) * 512
		n := min(int64(1+rng.IntN(64))*512, v.Size()-off)
		p := make([]byte, n)
		stamp(p, uint64(i+1), 0, off)
		if err := v.WriteAt(p, off, i%50 == 0); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
		if i%100 == 99 {
			if err := v.SetMode(Mode(rng.IntN(4))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	_ = b.Close()
	c, b = open()
	defer c.Close()
	defer b.Close()
	specs[0].Dev = b
	s, err = Open(c, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkAfter(t, s)
	got := make([]byte, len(model))
	if err := s.vols[0].ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("data differs after close and reopen")
	}
	if sb := s.Superblock(); sb.Backings[0].Path != backPath {
		t.Fatalf("path hint %q", sb.Backings[0].Path)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}
