package cache

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// TestFormatMinimumSize: the refusal of a too small cache device names the
// smallest size that works, and that size is exact: one block less is
// refused, the size itself formats.
func TestFormatMinimumSize(t *testing.T) {
	for _, bs := range []int64{256 << 10, 1 << 20, 8 << 20} {
		_, err := Format(device.NewMem(1<<20), nil, FormatOptions{BucketSize: bs, Mode: Writeback})
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("bucket %d: a 1 MiB device: %v", bs, err)
		}
		need := minDeviceSize(bs, 0, bs/blockSize)
		if !strings.Contains(err.Error(), fmt.Sprintf("needs at least %d bytes", need)) {
			t.Errorf("bucket %d: the refusal does not name the minimum %d: %v", bs, need, err)
		}
		if _, err := Format(device.NewMem(need-blockSize), nil, FormatOptions{BucketSize: bs, Mode: Writeback}); !errors.Is(err, ErrInvalid) {
			t.Errorf("bucket %d: %d bytes (one block under the minimum) formatted: %v", bs, need-blockSize, err)
		}
		if _, err := Format(device.NewMem(need), nil, FormatOptions{BucketSize: bs, Mode: Writeback}); err != nil {
			t.Errorf("bucket %d: the minimum %d does not format: %v", bs, need, err)
		}
	}
}

// TestFormatPagedLimits: a set with index pages counts a bucket's live
// and dirty blocks in 16 bits (the bucket table) and names at most
// pages.MaxVolumes volume slots in a root, so format refuses a bucket of
// more than 65,535 blocks or more backing devices, saying why and
// writing nothing; the largest bucket it takes formats and opens, and a
// set without index pages takes the larger bucket.
func TestFormatPagedLimits(t *testing.T) {
	const limit = pages.MaxBucketBlocks * blockSize // 65,535 blocks
	if pages.MaxBucketBlocks != 65535 {
		t.Fatalf("pages.MaxBucketBlocks = %d, the table's counts are 16 bits", pages.MaxBucketBlocks)
	}
	back := []BackingSpec{{Name: "a", Dev: device.NewMem(1 << 30)}}
	for _, bs := range []int64{limit + blockSize, 1 << 30} {
		dev := device.NewMem(cacheSizeForPaged(minBuckets, bs, minJournalLen, 1, true))
		_, err := Format(dev, back, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, IndexPages: true})
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("bucket of %d blocks with index pages: %v, want ErrInvalid", bs/blockSize, err)
		}
		want := fmt.Sprintf("bucket size %d (a set with index pages takes buckets of at most %d bytes: the bucket table counts blocks in 16 bits)", bs, limit)
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
		if _, err := ReadSuperblock(dev); !errors.Is(err, ErrNotFormatted) {
			t.Errorf("a refused format left a superblock (or failed to read: %v)", err)
		}
		// Without index pages the same bucket is not refused for its size.
		if _, err := Format(dev, back, FormatOptions{BucketSize: bs, JournalSize: minJournalLen}); err != nil && strings.Contains(err.Error(), "16 bits") {
			t.Errorf("bucket of %d blocks without index pages: %v", bs/blockSize, err)
		}
	}

	// The limit itself formats, opens and takes writes.
	dev := device.NewMem(cacheSizeForPaged(minBuckets, limit, minJournalLen, 1, true))
	sb, err := Format(dev, back, FormatOptions{BucketSize: limit, JournalSize: minJournalLen, IndexPages: true, Mode: Writeback})
	if err != nil {
		t.Fatalf("bucket of 65,535 blocks with index pages: %v", err)
	}
	if !sb.HasFeature(ondisk.FeaturePagedIndex) || sb.BlocksPerBucket() != pages.MaxBucketBlocks {
		t.Fatalf("formatted %d blocks a bucket, paged %t", sb.BlocksPerBucket(), sb.HasFeature(ondisk.FeaturePagedIndex))
	}
	s, err := Open(dev, back, OpenOptions{})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	v, _ := s.Volume("a")
	buf := make([]byte, 64*blockSize)
	if err := v.WriteAt(buf, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(dev, back, OpenOptions{})
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	many := make([]BackingSpec, pages.MaxVolumes+1)
	for i := range many {
		many[i] = BackingSpec{Name: fmt.Sprintf("v%d", i), Dev: device.NewMem(1 << 20)}
	}
	dev = device.NewMem(cacheSizeForPaged(minBuckets, 1<<20, minJournalLen, len(many), true))
	_, err = Format(dev, many, FormatOptions{BucketSize: 1 << 20, JournalSize: minJournalLen, IndexPages: true})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("%d backing devices (a set with index pages holds at most %d)", len(many), pages.MaxVolumes)) {
		t.Errorf("%d backing devices with index pages: %v", len(many), err)
	}
}
