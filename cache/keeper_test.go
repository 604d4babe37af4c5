package cache

import (
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
	if err := v.s.Flush(); err != nil {
		t.Fatalf("flush while the store is away: %v", err)
	}
	if n := v.st.bypassBytes.Load(); n != 0 {
		t.Fatalf("%d bytes bypassed the cache", n)
	}
	t.Logf("backing syncs tried while away: %d", back.syncs.Load()-syncs0)
}
