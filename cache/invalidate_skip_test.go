package cache

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// Passthrough writes (none, writearound, write-zeroes, trim) skip their
// invalidation record when no recovery could find an entry of the volume
// (idx.Replayable), and keep it when one could. These tests pin both
// sides: the skip must save the journal commit of a FLUSH in none mode on
// an empty cache (docs/BENCHMARKS.md, "Reading the results", S6), and the record must stay
// when a durable insert of the range could otherwise come back on replay.

// openQuietSet formats and opens a set with one volume, no background
// goroutines and no random checkpoints, so that the journal holds exactly
// what the test's operations append.
func openQuietSet(t *testing.T, backSize int64) (*Set, *Volume, *device.Mem, *device.Mem) {
	t.Helper()
	const nb, bs = 8, 4 * blockSize
	jl := int64(minJournalLen)
	cache := device.NewMem(cacheSizeFor(nb, bs, jl, 1))
	back := device.NewMem(backSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bs, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: testingKnobs{noBackground: true, fixedJournal: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	checkAfter(t, s)
	v, _ := s.Volume("a")
	return s, v, cache, back
}

// crashReopen clones both devices as a crash would leave them (unsynced
// blocks lost) and opens the clone.
func crashReopen(t *testing.T, cache, back *device.Mem) (*Set, *Volume, *device.Mem) {
	t.Helper()
	c2, b2 := cache.CrashClone(device.CrashConfig{}), back.CrashClone(device.CrashConfig{})
	s2, err := Open(c2, []BackingSpec{{Name: "a", Dev: b2}}, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s2.crashStop)
	checkAfter(t, s2)
	v2, _ := s2.Volume("a")
	return s2, v2, c2
}

func replayable(s *Set, v *Volume) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return v.idx.Replayable
}

// imageHas reports whether the index rebuilt from dev (checkpoint plus
// journal, clean entries kept: what a recovery could bring back) has an
// entry for block lba of volume "a".
func imageHas(t *testing.T, dev *device.Mem, lba uint64) bool {
	t.Helper()
	im, err := OpenImage(dev.CrashClone(device.CrashConfig{}), ImageOptions{})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	im.Index(func(e IndexEntry) bool {
		found = found || e.Volume == "a" && e.LBA == lba
		return true
	})
	return found
}

func TestPassthroughSkipsInvalidateWhenNothingReplayable(t *testing.T) {
	const size = 1 << 20
	s, v, cache, back := openQuietSet(t, size)
	if err := v.SetMode(None); err != nil {
		t.Fatal(err)
	}
	if replayable(s, v) {
		t.Fatal("a freshly formatted volume is marked replayable after Open's checkpoint")
	}
	seq0, jb0 := s.appended(), s.stats.journalBlocks.Load()
	want := make([]byte, size)
	write := func(off int64, n int, fill byte, fua bool) {
		t.Helper()
		p := bytes.Repeat([]byte{fill}, n)
		if err := v.WriteAt(p, off, fua); err != nil {
			t.Fatal(err)
		}
		copy(want[off:], p)
	}
	write(0, 8192, 1, false)
	write(64<<10, 4096, 2, true) // FUA
	write(128<<10+512, 1000, 3, false)
	if err := v.WriteZeroes(0, 4096, false, false, false); err != nil {
		t.Fatal(err)
	}
	clear(want[:4096])
	if err := v.Trim(256<<10, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	clear(want[256<<10 : 320<<10]) // Mem discards to zeroes
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := s.appended(); got != seq0 {
		t.Errorf("%d journal records appended by passthrough writes with nothing replayable, want 0", got-seq0)
	}
	if got := s.stats.journalBlocks.Load(); got != jb0 {
		t.Errorf("%d journal blocks written, want 0", got-jb0)
	}
	// The data is on the backing device, and a crash keeps it.
	_, v2, _ := crashReopen(t, cache, back)
	got := make([]byte, size)
	if err := v2.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("after a crash the volume does not hold the flushed passthrough writes")
	}
}

func TestPassthroughKeepsInvalidateWhenReplayable(t *testing.T) {
	const size = 1 << 20
	s, v, cache, back := openQuietSet(t, size)
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	old := bytes.Repeat([]byte{0xaa}, blockSize)
	if err := v.WriteAt(old, 0, false); err != nil { // a clean insert of block 0
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if !replayable(s, v) {
		t.Fatal("a volume with a journaled insert is not marked replayable")
	}
	// Eviction drops clean entries in memory only (its reuse record
	// comes later, once the bucket is empty and unpinned): the durable
	// insert could bring block 0 back on replay.
	s.mu.Lock()
	s.mu.Invalidate(v.vi, 0, 1)
	s.mu.Unlock()
	if v.Cached(0, blockSize) {
		t.Fatal("block 0 still cached after the in-memory drop")
	}
	if !imageHas(t, cache, 0) {
		t.Fatal("the durable journal does not hold block 0's insert: the test cannot tell a kept record from a skipped one")
	}
	if err := v.SetMode(None); err != nil {
		t.Fatal(err)
	}
	seq0 := s.appended()
	newer := bytes.Repeat([]byte{0x55}, blockSize)
	if err := v.WriteAt(newer, 0, false); err != nil {
		t.Fatal(err)
	}
	// The region's mark (none in this journal generation yet) and the
	// invalidation.
	if got := s.appended() - seq0; got != 2 {
		t.Errorf("%d records appended by a passthrough write over a replayable volume, want 2 (the region's mark, the invalidation)", got)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if imageHas(t, cache, 0) {
		t.Fatal("after the flushed passthrough write, a recovery could still find block 0's old entry")
	}
	_, v2, _ := crashReopen(t, cache, back)
	got := make([]byte, blockSize)
	if err := v2.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, newer) {
		t.Fatalf("after a crash block 0 reads %#x..., want the flushed passthrough write %#x...", got[0], newer[0])
	}

	// A checkpoint of the now empty volume proves nothing can be
	// replayed: later passthrough writes skip the record.
	s.commitMu.Lock()
	err := s.checkpointLocked(0)
	s.commitMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if replayable(s, v) {
		t.Fatal("still replayable after a checkpoint of an empty volume")
	}
	seq0 = s.appended()
	if err := v.WriteAt(old, blockSize, false); err != nil {
		t.Fatal(err)
	}
	if got := s.appended() - seq0; got != 0 {
		t.Fatalf("%d records appended after the checkpoint proved the volume empty, want 0", got)
	}
}

// A checkpoint clears the mark only for a volume it holds no entry of.
func TestCheckpointKeepsReplayableWithEntries(t *testing.T) {
	s, v, _, _ := openQuietSet(t, 1<<20)
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	if err := v.WriteAt(make([]byte, blockSize), 8*blockSize, false); err != nil {
		t.Fatal(err)
	}
	s.commitMu.Lock()
	err := s.checkpointLocked(0)
	s.commitMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if !replayable(s, v) {
		t.Fatal("a checkpoint holding an entry of the volume cleared its replayable mark")
	}
	if err := v.SetMode(None); err != nil {
		t.Fatal(err)
	}
	seq0 := s.appended()
	if err := v.WriteAt(make([]byte, blockSize), 0, false); err != nil { // another block
		t.Fatal(err)
	}
	// The checkpoint ended the region's mark: a new one, and the
	// invalidation.
	if got := s.appended() - seq0; got != 2 {
		t.Fatalf("%d records appended by a passthrough write of a volume with entries, want 2 (the region's mark, the invalidation)", got)
	}
}

// TestFlushWaitsForInFlightBackingSync: with the invalidation skipped, a
// none-mode write leaves no record to commit, so a flush relies on the
// backing device's unsynced flag alone. Another flush's commit clears the
// flag before its backing sync; a flush that found it clear then must wait
// for that sync, not return at once (TestCrashPointsConcurrent seed 17: a
// crash during the sync lost a write whose flush had succeeded).
func TestFlushWaitsForInFlightBackingSync(t *testing.T) {
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	s := newBackFaultSet(t, None, func(op faultdev.Op) faultdev.Fault {
		if armed.Load() && op.Kind == faultdev.Sync {
			once.Do(func() {
				close(entered)
				<-release
			})
		}
		return faultdev.Fault{}
	})
	v := s.vols[0]
	for i := range 2 {
		if err := v.WriteAt(bytes.Repeat([]byte{byte(i + 1)}, blockSize), int64(i)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	if replayable(s, v) || s.durable.Load() < s.appended() {
		t.Fatal("the none-mode writes left records to commit: the test needs none")
	}
	for _, err := range flushTwiceDuringSync(t, v, &armed, entered, release) {
		if err != nil {
			t.Fatal(err)
		}
	}
}
