package cache

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// keeperDev is a backing device that keeps what a failed Sync could not
// make durable (device.SyncKeeper), as an object-store image does; while
// down, every Sync fails (the store is away) and writes still succeed
// (they go to memory).
type keeperDev struct {
	*device.Mem
	down  atomic.Bool
	syncs atomic.Int64
}

var errStoreAway = errors.New("keeperDev: the store is away")

func (d *keeperDev) Sync() error {
	d.syncs.Add(1)
	if d.down.Load() {
		return errStoreAway
	}
	return d.Mem.Sync()
}

func (d *keeperDev) KeepsUnsynced() bool { return true }

// TestKeeperStreamAbsorbed: in writeback mode over a backing that keeps
// unsynced writes (an object-store image), a sequential stream past
// sequential_cutoff, with no room for it under writeback_percent=0, is
// absorbed by the cache instead of bypassing it, so FLUSH and FUA need
// only the cache device while the store is away.
//
// Regression test (issue 22): ext4 on an object-store export went
// read-only during a store outage (kernel "I/O error ... op WRITE flags
// 0x9800", "Aborting journal"): its journal, a sequential stream, went
// around the cache into the image's memory, and the next FUA's commit then
// had to sync the image, which failed. Before the fix the first three
// writes below went to TierBacking and the first FUA write failed with
// errStoreAway (`go test -run TestKeeperStreamAbsorbed ./cache`).
func TestKeeperStreamAbsorbed(t *testing.T) {
	const nBuckets, bucketSize = 16, 256 << 10
	jl := int64(minJournalLen)
	cache := device.NewMem(cacheSizeFor(nBuckets, bucketSize, jl, 1))
	back := &keeperDev{Mem: device.NewMem(8 << 20)}
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	checkAfter(t, s)
	v := s.vols[0]
	st := v.Settings()
	st.Mode = Writeback
	st.WritebackPercent = 0
	st.SequentialCutoff = 64 << 10
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	back.down.Store(true)
	syncs0 := back.syncs.Load()
	p := make([]byte, 64<<10)
	for i := range 16 {
		for j := range p {
			p[j] = byte(i*31 + j)
		}
		fua := i%4 == 3
		tier, err := v.WriteAtTier(p, int64(i)*int64(len(p)), fua)
		if err != nil {
			t.Fatalf("write %d (fua %v) while the store is away: %v", i, fua, err)
		}
		if tier != TierCache {
			t.Fatalf("write %d of a stream went to the %v while the store is away", i, tier)
		}
	}
	if err := v.WriteZeroes(2<<20, 1<<20, false, true, true); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("fast zero into the cache: %v, want ErrUnsupported", err)
	}
	if err := v.s.Flush(); err != nil {
		t.Fatalf("flush while the store is away: %v", err)
	}
	if n := v.st.bypassBytes.Load(); n != 0 {
		t.Fatalf("%d bytes bypassed the cache", n)
	}
	t.Logf("backing syncs tried while away: %d", back.syncs.Load()-syncs0)
}

// TestKeeperZeroesTrimAbsorbed: in writeback mode over a backing that
// keeps unsynced writes (an object-store image), write-zeroes (large and
// small, aligned or not) and trims (small and large), some with FUA, while
// the store is away succeed, as does a FLUSH, with nothing sent around the
// cache; once the store is back, writeback drains and the backing device
// holds the zeroes, the data written before and around them, and for each
// trimmed block zeroes or its old data.
//
// Regression test (issue 22): a write-zeroes larger than 1 MiB with older
// epochs dirty degraded the volume to lba order and went to the image's
// memory, and a trim with none dirty was discarded there; the FUA commit
// then had to sync the image and failed with errStoreAway
// (`go test -run TestKeeperZeroesTrimAbsorbed ./cache`).
func TestKeeperZeroesTrimAbsorbed(t *testing.T) {
	const nBuckets, bucketSize = 32, 256 << 10
	const size = 8 << 20
	jl := int64(minJournalLen)
	cache := device.NewMem(cacheSizeFor(nBuckets, bucketSize, jl, 1))
	back := &keeperDev{Mem: device.NewMem(size)}
	old := make([]byte, size)
	for i := range old {
		old[i] = byte(i/blockSize*13+1) | 1
	}
	if _, err := back.Mem.WriteAt(old, 0); err != nil {
		t.Fatal(err)
	}
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	checkAfter(t, s)
	v := s.vols[0]
	st := v.Settings()
	st.Mode = Writeback
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), old...)
	trimmed := make([]bool, size/blockSize) // zeroes or old data
	zero := func(off, n int64, fua bool) {
		t.Helper()
		if err := v.WriteZeroes(off, n, fua, true, false); err != nil {
			t.Fatalf("write-zeroes [%d, +%d) fua %v while the store is away: %v", off, n, fua, err)
		}
		clear(want[off : off+n])
	}
	trim := func(off, n int64, fua bool) {
		t.Helper()
		if err := v.Trim(off, n, fua); err != nil {
			t.Fatalf("trim [%d, +%d) fua %v while the store is away: %v", off, n, fua, err)
		}
		for b := off / blockSize; b < (off+n)/blockSize; b++ {
			trimmed[b] = true
		}
	}
	back.down.Store(true)
	trim(4<<20, 64<<10, true) // small, nothing dirty
	// Dirty data of an older epoch: from here on epoch order holds
	// everything later back from the image.
	d := make([]byte, 256<<10)
	for i := range d {
		d[i] = byte(i*7) | 2
	}
	if err := v.WriteAt(d, 0, false); err != nil {
		t.Fatal(err)
	}
	copy(want, d)
	if err := v.s.Flush(); err != nil {
		t.Fatalf("flush while the store is away: %v", err)
	}
	zero(1<<20, 2<<20, true)         // large, older epochs dirty
	zero(5<<20+100, 10000, false)    // unaligned: edges written, 1 whole block
	trim(4<<20+64<<10, 64<<10, true) // small, older epochs dirty
	trim(6<<20, 2<<20, true)         // large
	zero(3<<20+4096, 8192, true)     // small, after the large ones
	// Data over part of the large trim.
	if err := v.WriteAt(d[:8192], 7<<20, true); err != nil {
		t.Fatal(err)
	}
	copy(want[7<<20:], d[:8192])
	trimmed[7<<20/blockSize], trimmed[7<<20/blockSize+1] = false, false
	if err := v.WriteZeroes(2<<20, 1<<20, false, true, true); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("fast zero into the cache: %v, want ErrUnsupported", err)
	}
	if err := v.s.Flush(); err != nil {
		t.Fatalf("flush while the store is away: %v", err)
	}
	if n := v.st.bypassBytes.Load(); n != 0 {
		t.Fatalf("%d bytes went around the cache while the store was away", n)
	}
	if vs := v.Stats(); vs.WritebackDegrades != 0 {
		t.Fatalf("the volume left epoch order: %s", vs.DegradeReason)
	}
	check := func(what string, got []byte) {
		t.Helper()
		for b := 0; b < size/blockSize; b++ {
			g, w := got[b*blockSize:(b+1)*blockSize], want[b*blockSize:(b+1)*blockSize]
			if bytes.Equal(g, w) || trimmed[b] && bytes.Equal(g, make([]byte, blockSize)) {
				continue
			}
			t.Fatalf("%s: block %d (offset %d) is wrong (first byte %d, want %d)", what, b, b*blockSize, g[0], w[0])
		}
	}
	got := make([]byte, size)
	if err := v.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	check("read while the store is away", got)
	back.down.Store(false)
	if err := v.DrainDirty(context.Background(), nil); err != nil {
		t.Fatalf("drain once the store is back: %v", err)
	}
	if _, err := back.Mem.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	check("the backing device after the drain", got)
}
