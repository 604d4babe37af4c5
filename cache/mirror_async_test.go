package cache

import (
	"bytes"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

// TestMirrorAsyncHit: a mirrored set whose A reads asynchronously serves
// hits on the asynchronous path (as a set on one device does); a dirty
// block whose read fails on A is served from B and A's copy rewritten
// (mirror read_retries and repairs), one whose copy on A is damaged is
// repaired from B (checksum repairs); neither counts as a cache device
// error nor fails the set over.
func TestMirrorAsyncHit(t *testing.T) {
	jl := int64(minJournalLen)
	a := &asyncMem{Mem: device.NewMem(cacheSizeFor(16, 64<<10, jl, 1))}
	back := device.NewMem(1024 * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	sb, err := Format(a.Mem, specs, FormatOptions{BucketSize: 64 << 10, JournalSize: jl, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	b := device.NewMem(sb.BucketsOff + 8*(64<<10+blockSize))
	if _, err := Format(a, specs, FormatOptions{BucketSize: 64 << 10, JournalSize: jl, Mirror: b}); err != nil {
		t.Fatal(err)
	}
	r := &mirrorRig{t: t, specs: specs, back: back}
	r.open(a, b, false)
	for lba := range uint64(8) {
		r.write(lba, 1)
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	read := func(lba uint64) error {
		t.Helper()
		p := make([]byte, blockSize)
		errc := make(chan error, 1)
		if !r.vol.StartReadAt(p, int64(lba)*blockSize, func(err error, _ func(func())) { errc <- err }) {
			t.Fatalf("lba %d: not started on the asynchronous path", lba)
		}
		if err := <-errc; err != nil {
			return err
		}
		if !bytes.Equal(p, mstamp(lba, 1)) {
			t.Fatalf("lba %d: wrong data", lba)
		}
		return nil
	}
	if err := read(1); err != nil {
		t.Fatal(err)
	}
	loc := func(lba uint64) int64 {
		r.set.mu.Lock()
		defer r.set.mu.Unlock()
		e, ok := r.vol.idx.Tree.Get(index.Ent{LBA: lba})
		if !ok || !e.Dirty() {
			t.Fatalf("lba %d not dirty in the cache", lba)
		}
		return r.set.cacheOff(e.Block())
	}
	bad := loc(2)
	a.mu.Lock()
	a.fail, a.failSync = func(off int64) bool { return off == bad }, true
	a.mu.Unlock()
	started := a.started
	for range 3 { // more than the errors in a row that fail a set over
		if err := read(2); err != nil {
			t.Fatalf("read failing on A: %v", err)
		}
	}
	a.mu.Lock()
	a.fail = nil
	a.mu.Unlock()
	if err := a.Mem.Corrupt(loc(3)+100, 8); err != nil {
		t.Fatal(err)
	}
	if err := read(3); err != nil {
		t.Fatalf("read of a block damaged on A: %v", err)
	}
	st, vs := r.set.Stats(), r.vol.Stats()
	if a.started-started != 4 || st.Failed || st.CacheErrors != 0 || st.Mirror.Degraded ||
		st.Mirror.ReadRetries != 3 || st.Mirror.Repairs != 4 || vs.ChecksumErrors != 1 || vs.ChecksumRepairs != 1 {
		t.Fatalf("async starts %d, failed %v, cache errors %d, mirror %+v, checksum errors %d repairs %d; want 4, false, 0, 3 retries and 4 repairs, 1 and 1",
			a.started-started, st.Failed, st.CacheErrors, st.Mirror, vs.ChecksumErrors, vs.ChecksumRepairs)
	}
	p := make([]byte, blockSize)
	for _, lba := range []uint64{2, 3} {
		if _, err := a.Mem.ReadAt(p, loc(lba)); err != nil || !bytes.Equal(p, mstamp(lba, 1)) {
			t.Fatalf("lba %d: A's copy not repaired (%v)", lba, err)
		}
	}
}
