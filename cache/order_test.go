package cache

import (
	"context"
	"maps"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/writeback"
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
			writeStamped(t, v, p, id, b)
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
			writeStamped(t, v2, p, id, b)
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

// TestCatchUpUnderWrites: a degraded volume whose writes never stop (no
// full drain ever comes) returns to epoch order by a catch-up. From the cut
// on, overwrites keep their older versions; writeback takes every version
// of before the cut in one pass and nothing after it, so once that is done
// the backing device alone is exactly the image at the cut; then the volume
// reports it consistent again, with dirty data still in the cache. A degrade
// during a catch-up ends it and keeps the first degrade's moment.
func TestCatchUpUnderWrites(t *testing.T) {
	const nblk = 64
	cache := device.NewMem(cacheSizeFor(32, 16*blockSize, minJournalLen, 1))
	back := device.NewMem(nblk * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 16 * blockSize, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	checkAfter(t, s)
	v := s.vols[0]
	setWritebackOrder(t, v, "epoch")
	p := make([]byte, blockSize)
	id := uint64(0)
	cur := map[int]uint64{} // newest id per block
	rng := rand.New(rand.NewPCG(14, 14))
	epochOfWrites := func(n int) {
		t.Helper()
		for range n {
			b := rng.IntN(nblk)
			id++
			writeStamped(t, v, p, id, b)
			cur[b] = id
		}
		if err := v.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	for range 4 {
		epochOfWrites(16)
	}
	v.degrade(degradeSuperseded)
	for range 4 {
		epochOfWrites(16) // degraded: no superseded version kept
	}
	if v.catchUp() {
		t.Fatal("catch-up right after the degrade, want one catchUpAfter later")
	}
	v.ord.at.Store(time.Now().Add(-catchUpAfter).UnixNano())
	// Writes in flight at the cut: the cut is between two writes of one
	// epoch.
	for range 5 {
		b := rng.IntN(nblk)
		id++
		writeStamped(t, v, p, id, b)
		cur[b] = id
	}
	if !v.catchUp() {
		t.Fatal("no catch-up")
	}
	atCut := maps.Clone(cur)
	// Writes go on (overwriting blocks dirty before the cut) while
	// writeback runs in small batches, until the catch-up is done.
	for round := 0; ; round++ {
		s.mu.Lock()
		caught := v.caughtUpLocked()
		s.mu.Unlock()
		if caught {
			break
		}
		if round > 1000 {
			t.Fatal("catch-up not done after 1000 rounds")
		}
		if st := v.Stats(); st.BackingConsistent || !st.CatchingUp || st.CatchUps != 1 {
			t.Fatalf("round %d: during the catch-up: consistent %v, catching up %v, %d catch-ups (want no, yes, 1)", round, st.BackingConsistent, st.CatchingUp, st.CatchUps)
		}
		epochOfWrites(4)
		if _, err := s.writebackSweep(v, 3); err != nil {
			t.Fatal(err)
		}
	}
	for b := range nblk {
		if _, err := back.ReadAt(p, int64(b)*blockSize); err != nil {
			t.Fatal(err)
		}
		if got := le.Uint64(p); got != atCut[b] {
			t.Fatalf("caught up: block %d holds write %d on the backing device, want %d (the image at the cut)", b, got, atCut[b])
		}
	}
	if !v.restoreOrder() {
		t.Fatal("caught up, but not restored")
	}
	st := v.Stats()
	if !st.BackingConsistent || !st.InconsistentSince.IsZero() || st.DirtyBlocks == 0 || !s.keepSuperseded(0) || st.CatchingUp {
		t.Fatalf("after the catch-up: consistent %v, since %v, %d dirty (want some), keeps superseded %v, catching up %v", st.BackingConsistent, st.InconsistentSince, st.DirtyBlocks, s.keepSuperseded(0), st.CatchingUp)
	}

	// Degraded again; a degrade during the catch-up ends it.
	v.degrade(degradeSuperseded)
	since := v.Stats().InconsistentSince
	epochOfWrites(16)
	v.ord.at.Store(time.Now().Add(-catchUpAfter).UnixNano())
	if !v.catchUp() {
		t.Fatal("no second catch-up")
	}
	epochOfWrites(16)
	v.degrade(degradeSequential)
	st = v.Stats()
	if st.BackingConsistent || !st.InconsistentSince.Equal(since) || st.CatchingUp || st.CatchUps != 2 || v.ord.cut.Load() != 0 || s.keepSuperseded(0) || st.SupersededBlocks != 0 {
		t.Fatalf("degraded during a catch-up: consistent %v, since %v (want %v), catching up %v, %d catch-ups (want 2), cut %d, keeps superseded %v, %d superseded",
			st.BackingConsistent, st.InconsistentSince, since, st.CatchingUp, st.CatchUps, v.ord.cut.Load(), s.keepSuperseded(0), st.SupersededBlocks)
	}
	if v.catchUp() {
		t.Fatal("catch-up right after the degrade that ended the last one")
	}
}

// writeStamped writes block b of v stamped with write id, through p.
func writeStamped(t *testing.T, v *Volume, p []byte, id uint64, b int) {
	t.Helper()
	stamp(p, id, 0, int64(b)*blockSize)
	if err := v.WriteAt(p, int64(b)*blockSize, false); err != nil {
		t.Fatal(err)
	}
}

// TestCatchUpWaitsForStreams: a degraded volume does not cut to catch up
// with epoch order while a write stream of it goes around the cache: the
// stream's next request would end the catch-up (a sequential write with
// older epochs dirty degrades), and until then the catch-up's writeback at
// full speed takes the disk from the stream. It cuts once no stream has
// bypassed for catchUpAfter.
// Regression test: S8 (256 MiB cache; db_bench fillrandom of 512 MiB on
// ext4 after 256 MiB of 4 KiB random overwrites of 32 MiB) ran at 0.94 of
// the plain HDD model in epoch order (rounds 0.97, 0.94, 0.93; lba order
// 0.98) on 1df9070: during fillrandom the epoch-order volume degraded on
// RocksDB's streams, cut 5 s later, and wrote back 23-32 MiB (the history's
// dirty data, past the file system) under the streams, against 0.7-1.4 MiB
// in lba order.
func TestCatchUpWaitsForStreams(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 4096*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.SequentialCutoff = 16 << 10
	st.WritebackOrder = OrderEpoch
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	// Small epochs of random writes past the stream's region: dirty data
	// above the writeback target (10 % of 1024 blocks), so the cache has
	// no room for a stream.
	rng := rand.New(rand.NewPCG(14, 8))
	for e := range 8 {
		for range 20 {
			if err := v.WriteAt(make([]byte, blockSize), int64(2048+rng.IntN(1024))*blockSize, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := v.Flush(); err != nil {
			t.Fatalf("flush %d: %v", e, err)
		}
	}
	if vs := v.Stats(); !vs.BackingConsistent || vs.WritebackDegrades != 0 {
		t.Fatalf("before the stream: consistent %v, %d degrades; want yes, 0", vs.BackingConsistent, vs.WritebackDegrades)
	}
	// A stream with older epochs dirty: it degrades the volume and
	// bypasses.
	for lba := int64(0); lba < 256; lba += 4 {
		if err := v.WriteAt(make([]byte, 4*blockSize), lba*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	vs := v.Stats()
	if vs.WritebackDegrades != 1 || vs.DegradeReason != string(degradeSequential) || vs.BypassSequentialBytes == 0 {
		t.Fatalf("after the stream: %d degrades (%s), %d bytes bypassed as sequential; want 1 (%s), some", vs.WritebackDegrades, vs.DegradeReason, vs.BypassSequentialBytes, degradeSequential)
	}
	// Degraded long ago, the stream's last bypass just now: no cut.
	v.ord.at.Store(time.Now().Add(-2 * catchUpAfter).UnixNano())
	v.pol.StreamAt.Store(time.Now().UnixNano())
	if v.catchUp() {
		t.Fatal("cut to catch up while a write stream bypasses the cache")
	}
	// The stream's last bypass a little less than catchUpAfter ago: no cut.
	v.pol.StreamAt.Store(time.Now().Add(-catchUpAfter + time.Second).UnixNano())
	if v.catchUp() {
		t.Fatal("cut to catch up within catchUpAfter of a stream's bypass")
	}
	// No stream for catchUpAfter: random writes go on, and it cuts.
	v.pol.StreamAt.Store(time.Now().Add(-catchUpAfter).UnixNano())
	if err := v.WriteAt(make([]byte, blockSize), 3000*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if !v.catchUp() {
		t.Fatal("no cut catchUpAfter after the stream's last bypass")
	}
	if vs := v.Stats(); !vs.CatchingUp || vs.CatchUps != 1 {
		t.Fatalf("after the cut: catching up %v, %d catch-ups; want yes, 1", vs.CatchingUp, vs.CatchUps)
	}
}

// TestRestoreWaitsForStreams: a volume that degraded on a write stream and
// then had all of its dirty data written back by background writeback
// returns to epoch order only once no stream has gone around the cache for
// catchUpAfter (the catch-up's rule), and then without another write.
//
// Regression test: in S8 (256 MiB cache; db_bench fillrandom of 512 MiB on
// ext4 after 256 MiB of 4 KiB random overwrites of 32 MiB) the epoch-order
// volume degraded 2-5 times per fillrandom on 6389efa: writeback emptied
// the cache in each of RocksDB's pauses between table files, the volume
// went back to epoch order (commit, backing sync, superblock), the pause's
// ext4 journal commits made small older epochs, and the next table file's
// first write degraded it again (a superblock write before it). Against
// lba order in the same round fillrandom ran 0.64-1.32x (median 0.85 over
// 7 rounds, load 5-11), the slowest rounds those with the most degrades.
func TestRestoreWaitsForStreams(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 4096*blockSize)
	v := s.vols[0]
	h := (*wbHost)(v)
	st := v.Settings()
	st.SequentialCutoff = 16 << 10
	st.WritebackOrder = OrderEpoch
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(14, 9))
	for e := range 4 {
		for range 20 {
			if err := v.WriteAt(make([]byte, blockSize), int64(2048+rng.IntN(1024))*blockSize, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := v.Flush(); err != nil {
			t.Fatalf("flush %d: %v", e, err)
		}
	}
	for lba := int64(0); lba < 256; lba += 4 {
		if err := v.WriteAt(make([]byte, 4*blockSize), lba*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if vs := v.Stats(); vs.WritebackDegrades != 1 || vs.BackingConsistent {
		t.Fatalf("after the stream: %d degrades, consistent %v; want 1, no", vs.WritebackDegrades, vs.BackingConsistent)
	}
	// Background writeback (lba order now) writes everything back.
	for v.hasDirty() {
		if _, err := v.wb.Sweep(writeback.FullBatch); err != nil {
			t.Fatal(err)
		}
	}
	// The stream's last bypass just now: no return, and a look again
	// within catchUpAfter.
	v.pol.StreamAt.Store(time.Now().UnixNano())
	if d := h.CheckOrder(); d <= 0 || d > catchUpAfter {
		t.Errorf("clean, stream just now: look again in %v; want in (0, %v]", d, catchUpAfter)
	}
	if vs := v.Stats(); vs.BackingConsistent {
		t.Fatal("back in epoch order while a write stream bypasses the cache")
	}
	// A little less than catchUpAfter ago: still no return.
	v.pol.StreamAt.Store(time.Now().Add(-catchUpAfter + time.Second).UnixNano())
	if d := h.CheckOrder(); d <= 0 || d > time.Second {
		t.Errorf("clean, stream %v ago: look again in %v; want in (0, 1s]", catchUpAfter-time.Second, d)
	}
	if vs := v.Stats(); vs.BackingConsistent {
		t.Fatal("back in epoch order within catchUpAfter of a stream's bypass")
	}
	// No stream for catchUpAfter: it returns, with no write needed.
	v.pol.StreamAt.Store(time.Now().Add(-catchUpAfter).UnixNano())
	if d := h.CheckOrder(); d != 0 {
		t.Errorf("returned: look again in %v; want 0", d)
	}
	if vs := v.Stats(); !vs.BackingConsistent || vs.WritebackDegrades != 1 {
		t.Fatalf("catchUpAfter after the stream: consistent %v, %d degrades; want yes, 1", vs.BackingConsistent, vs.WritebackDegrades)
	}
}

// TestRestoreOrderWaitsForBackingWrites: a degraded volume with no dirty
// data but a backing write in flight (a claim of a passthrough write or of
// a writeback batch) returns to epoch order once that write ends:
// restoreOrder waits for the claim and then restores. Before 0fa6c03 it
// gave up while any claim was held (and while writeback had versions in
// flight), so the volume stayed degraded until the loop looked again.
func TestRestoreOrderWaitsForBackingWrites(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 16, 1<<20, 64<<20)
	v := s.vols[0]
	st := v.Settings()
	st.WritebackOrder = OrderEpoch
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	v.degrade(degradeSequential)
	if st := v.Stats(); st.BackingConsistent || st.DirtyBlocks != 0 {
		t.Fatalf("after the degrade: consistent %v, %d dirty; want not consistent, none dirty", st.BackingConsistent, st.DirtyBlocks)
	}
	claim := blockRange{0, 8}
	s.mu.Lock()
	v.idx.busy = append(v.idx.busy, claim)
	s.mu.Unlock()
	done := make(chan bool, 1)
	go func() { done <- v.restoreOrder() }()
	// Until this test's goroutine waits in restoreOrder for the claim
	// (its stack says so; no other goroutine runs restoreOrder here).
	waiting := func() bool {
		buf := make([]byte, 1<<20)
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "TestRestoreOrderWaitsForBackingWrites.func") && strings.Contains(g, "sync.(*Cond).Wait") {
				return true
			}
		}
		return false
	}
	for !waiting() {
		select {
		case ok := <-done:
			t.Fatalf("restoreOrder returned %v with a backing write in flight; want it to wait for the write", ok)
		default:
			runtime.Gosched()
		}
	}
	s.mu.Lock()
	v.releaseLocked([]blockRange{claim})
	s.mu.Unlock()
	if !<-done {
		t.Fatal("restoreOrder: not restored once the backing write ended")
	}
	if st := v.Stats(); !st.BackingConsistent || !st.InconsistentSince.IsZero() {
		t.Fatalf("after the restore: consistent %v, inconsistent since %v; want consistent", st.BackingConsistent, st.InconsistentSince)
	}
}
