package cache

import (
	"context"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestDegradeSurvivesCrash checks that leaving epoch order is durable
// before it takes effect, and the return too: a crash while degraded
// reopens degraded (inconsistent since the same moment, no superseded
// version replayed, writeback in lba order) with every acknowledged
// flushed write readable, and a full drain after the reopen records the
// return, which a second crash keeps.
func TestDegradeSurvivesCrash(t *testing.T) {
	const nblk = 64
	cache := device.NewMem(cacheSizeFor(16, 16*blockSize, minJournalLen, 1))
	back := device.NewMem(nblk * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 16 * blockSize, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	open := func(c, b *device.Mem) (*Set, *Volume) {
		t.Helper()
		s, err := Open(c, []BackingSpec{{Name: "a", Dev: b}}, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.crashStop)
		return s, s.vols[0]
	}
	s, v := open(cache, back)
	setWritebackOrder(t, v, "epoch")
	p := make([]byte, blockSize)
	want := map[int]uint64{}
	id := uint64(0)
	// Three epochs overwriting the same blocks: superseded versions.
	for range 3 {
		for b := range 8 {
			id++
			stamp(p, id, 0, int64(b)*blockSize)
			if err := v.WriteAt(p, int64(b)*blockSize, false); err != nil {
				t.Fatal(err)
			}
			want[b] = id
		}
		if err := v.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if st := v.Stats(); st.SupersededBlocks != 16 || !st.BackingConsistent {
		t.Fatalf("before the degrade: %d superseded, consistent %v; want 16, true", st.SupersededBlocks, st.BackingConsistent)
	}
	v.degrade(degradeSpace)
	st := v.Stats()
	if st.BackingConsistent || st.InconsistentSince.IsZero() || st.SupersededBlocks != 0 || st.DegradeReason != string(degradeSpace) || st.WritebackDegrades != 1 {
		t.Fatalf("after the degrade: %+v", st)
	}
	since := st.InconsistentSince
	// Written back in lba order now: part of it, then the crash.
	if _, err := s.writebackEpoch(0, 3); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	verify := func(v *Volume) {
		t.Helper()
		for b, id := range want {
			if err := v.ReadAt(p, int64(b)*blockSize); err != nil {
				t.Fatal(err)
			}
			if got := le.Uint64(p); got != id {
				t.Fatalf("block %d: id %d, want %d", b, got, id)
			}
		}
	}
	cfg := device.CrashConfig{UnsyncedKeep: 0}
	c2, b2 := cache.CrashClone(cfg), back.CrashClone(cfg)
	s2, v2 := open(c2, b2)
	st = v2.Stats()
	if st.BackingConsistent || !st.InconsistentSince.Equal(since) || st.SupersededBlocks != 0 {
		t.Fatalf("reopened after a crash while degraded: consistent %v, since %v (want %v), %d superseded",
			st.BackingConsistent, st.InconsistentSince, since, st.SupersededBlocks)
	}
	if s2.keepSuperseded(0) {
		t.Fatal("reopened degraded volume keeps superseded versions")
	}
	verify(v2)
	if err := s2.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := v2.Stats(); !st.BackingConsistent || !st.InconsistentSince.IsZero() {
		t.Fatalf("after a full drain: consistent %v, since %v", st.BackingConsistent, st.InconsistentSince)
	}
	if !s2.keepSuperseded(0) {
		t.Fatal("back in epoch order, the volume keeps no superseded version")
	}
	// Epoch order again: an overwrite in a later epoch keeps the older
	// version.
	for range 2 {
		for b := range 2 {
			id++
			stamp(p, id, 0, int64(b)*blockSize)
			if err := v2.WriteAt(p, int64(b)*blockSize, false); err != nil {
				t.Fatal(err)
			}
			want[b] = id
		}
		if err := v2.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	s3, v3 := open(c2.CrashClone(cfg), b2.CrashClone(cfg))
	if st := v3.Stats(); !st.BackingConsistent {
		t.Fatalf("reopened after the return: consistent %v, since %v", st.BackingConsistent, st.InconsistentSince)
	}
	if st := v3.Stats(); st.SupersededBlocks != 2 || !s3.keepSuperseded(0) {
		t.Fatalf("reopened after the return: %d superseded versions replayed, want 2", st.SupersededBlocks)
	}
	verify(v3)
}

// TestOrderChangeIntoEpochWithDirtyData: switching from lba to epoch order
// with dirty data (written back in lba order) starts degraded, until the
// next full drain.
func TestOrderChangeIntoEpochWithDirtyData(t *testing.T) {
	s, v := newEpochSetNoBackground(t, 8, 64)
	setWritebackOrder(t, v, "lba")
	if st := v.Stats(); st.BackingConsistent {
		t.Fatal("lba order reports a consistent backing device")
	}
	p := make([]byte, blockSize)
	if err := v.WriteAt(p, 0, false); err != nil {
		t.Fatal(err)
	}
	setWritebackOrder(t, v, "epoch")
	if st := v.Stats(); st.BackingConsistent || st.DegradeReason != string(degradeSettings) {
		t.Fatalf("into epoch order with dirty data: consistent %v, reason %q", st.BackingConsistent, st.DegradeReason)
	}
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := v.Stats(); !st.BackingConsistent {
		t.Fatal("not consistent after a full drain")
	}
}
