package cache

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
)

// TestSettingsPersist: every key is validated, applied and survives a
// clean reopen and a crash (the superblock is written before SetSettings
// returns).
func TestSettingsPersist(t *testing.T) {
	s, cache, backs := newTestSet(t, 8, 4*blockSize, 64*blockSize)
	v := s.vols[0]
	if got := v.Settings(); got != DefaultSettings() {
		t.Fatalf("fresh volume settings %+v, want defaults %+v", got, DefaultSettings())
	}
	want := Settings{Mode: Writethrough, SequentialCutoff: 1 << 20, WritebackPercent: 40, WritebackOrder: OrderLBA, Promote: "after:3", WritebackRateMax: 8 << 20}
	if err := v.SetSettings(want); err != nil {
		t.Fatal(err)
	}
	bad := want
	bad.WritebackPercent = 101
	if err := v.SetSettings(bad); !errors.Is(err, ErrInvalid) {
		t.Fatalf("invalid settings: %v, want ErrInvalid", err)
	}
	if got := v.Settings(); got != want {
		t.Fatalf("settings %+v, want %+v", got, want)
	}
	specs := []BackingSpec{{Name: "a", Dev: backs[0]}}
	// Crash: clone without Close.
	cc := cache.CrashClone(device.CrashConfig{})
	s2, err := Open(cc, []BackingSpec{{Name: "a", Dev: backs[0].CrashClone(device.CrashConfig{})}}, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := s2.vols[0].Settings(); got != want {
		t.Fatalf("after crash: settings %+v, want %+v", got, want)
	}
	s2.crashStop()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s3, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	if got := s3.vols[0].Settings(); got != want {
		t.Fatalf("after reopen: settings %+v, want %+v", got, want)
	}
}

// TestSuperblockWithoutSettings: a superblock without its settings section
// (as the format before version 2 allowed) is refused as corruption.
func TestSuperblockWithoutSettings(t *testing.T) {
	sb := testSuperblock()
	b, err := sb.Encode()
	if err != nil {
		t.Fatal(err)
	}
	tl := 4
	for range sb.Backings {
		d := DefaultSettings()
		tl += 8 + 1 + 2 + len(d.WritebackOrder.String()) + 2 + len(d.Promote) + 8 + 8
	}
	old := append([]byte(nil), b[:len(b)-tl]...)
	le.PutUint32(old[12:], uint32(len(old)-ondisk.SBHeaderSize))
	le.PutUint32(old[16:], 0)
	le.PutUint32(old[16:], ondisk.CRC32C(old))
	if _, err := ondisk.DecodeSuperblock(old, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("superblock without settings: %v, want corruption", err)
	}
}

// TestIdleWriteback: with the client idle, dirty data goes to the backing
// device without any Drain, and the backing device then holds it.
func TestIdleWriteback(t *testing.T) {
	s, _, backs := newTestSet(t, 16, 8*blockSize, 256*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.WritebackPercent = 100 // only idleness triggers writeback
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 40*blockSize)
	for i := range data {
		data[i] = byte(i*7 + i/4096)
	}
	for i := 0; i < 40; i++ { // scattered: every third block
		if err := v.WriteAt(data[i*blockSize:(i+1)*blockSize], int64(i*3)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for v.Stats().DirtyBlocks > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d dirty blocks left after 5 s idle", v.Stats().DirtyBlocks)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got := make([]byte, blockSize)
	for i := 0; i < 40; i++ {
		if _, err := backs[0].ReadAt(got, int64(i*3)*blockSize); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data[i*blockSize:(i+1)*blockSize]) {
			t.Fatalf("backing block %d differs after idle writeback", i*3)
		}
	}
	if st := v.Stats(); st.WritebackBytes != 40*blockSize {
		t.Errorf("writeback bytes %d, want %d", st.WritebackBytes, 40*blockSize)
	}
}

// TestWritebackRate: the set feeds the rate decision (writeback.Rate,
// whose table is writeback's TestRate) the volume's dirty versions, its
// writeback_percent and whether its client is idle.
func TestWritebackRate(t *testing.T) {
	s, _, _ := newTestSet(t, 256, 64*blockSize, 4096*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.WritebackPercent = 10
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	s.crashStop() // no background goroutines touch the counters below
	total := s.mu.CacheBlocks()
	target := total / 10
	for _, tc := range []struct {
		dirty int64
		idle  bool
	}{
		{0, false}, {target, false}, {target + 1, false}, {(target+total)/2 - 1, false},
		{(target + total) / 2, false}, {total, false}, {1, true}, {target + 4000, false},
	} {
		s.mu.Lock()
		saved := v.idx.Dirty
		v.idx.Dirty = tc.dirty
		s.mu.Unlock()
		if tc.idle {
			v.lastIO.Store(0)
		} else {
			v.lastIO.Store(nowNanos())
		}
		got := s.wbRate(v)
		s.mu.Lock()
		v.idx.Dirty = saved
		s.mu.Unlock()
		want, _ := writeback.Rate(writeback.RateIn{Dirty: tc.dirty, CacheBlocks: total, Percent: 10, Urgent: tc.idle})
		if got != want {
			t.Errorf("dirty %d idle %t: rate %d, want %d", tc.dirty, tc.idle, got, want)
		}
	}
}

// slowDev delays every write, like a busy disk.
type slowDev struct {
	device.Device
	d time.Duration
}

func (s slowDev) WriteAt(p []byte, off int64) (int, error) {
	time.Sleep(s.d)
	return s.Device.WriteAt(p, off)
}

// TestWritesNeverStall: a writer that outruns a slow backing device over a
// small cache is throttled and, when no bucket is free in time, sent around
// the cache; no write waits anywhere near seconds.
func TestWritesNeverStall(t *testing.T) {
	jl := int64(minJournalLen)
	cache := device.NewMem(cacheSizeFor(8, 8*blockSize, jl, 1))
	back := device.NewMem(1024 * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: slowDev{back, 2 * time.Millisecond}}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 8 * blockSize, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.crashStop()
	checkAfter(t, s)
	v := s.vols[0]
	var worst time.Duration
	buf := make([]byte, blockSize)
	for i := 0; i < 600; i++ {
		t0 := time.Now()
		if err := v.WriteAt(buf, int64((i*37)%1024)*blockSize, false); err != nil {
			t.Fatal(err)
		}
		worst = max(worst, time.Since(t0))
	}
	st := v.Stats()
	t.Logf("worst write %v; throttled %v; cache-full bypass %d KiB; writeback %d KiB", worst, time.Duration(st.ThrottleNanos), st.BypassCacheFullBytes>>10, st.WritebackBytes>>10)
	if worst > 500*time.Millisecond {
		t.Errorf("a write took %v", worst)
	}
}

// TestDegradedWritesBackLikeLBA: a volume degraded from epoch order, with
// a busy client and dirty data under the writeback target, writes nothing
// back in the background, as a volume in lba order does; it writes back
// at full speed once it catches up (a cut) or its client is idle. With
// the target at 0 while degraded (before), a degraded volume took part of
// each write stream into the cache (streamRoom: the room below the
// target) and then wrote it back under the rest of the client's load,
// which bypassed to the same disk: in S8 (`go run ./cmd/tcbench cache
// --only S8`, one round, load 1.5) fillrandom after the history, degraded
// the whole job, ran 0.87 of the plain HDD model in epoch order against
// 0.98 in lba order, with 63 against 29 MiB of its streams cached and
// 54.6 against 25.1 MiB written back during it.
func TestDegradedWritesBackLikeLBA(t *testing.T) {
	s, _, _ := newTestSetKnobs(t, testingKnobs{noBackground: true}, 64, 16*blockSize, 1024*blockSize)
	v := s.vols[0]
	st := v.Settings()
	st.Mode, st.WritebackPercent, st.WritebackOrder = Writeback, 40, OrderEpoch
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, blockSize)
	for e := range 4 { // four small epochs, each overwriting the last
		for b := range 8 {
			writeStamped(t, v, p, uint64(e*8+b+1), b)
		}
		if err := v.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	busy := func() { v.lastIO.Store(nowNanos() + int64(time.Hour)) } // never idle
	busy()
	if s.mu.CacheBlocks()*40/100 <= v.Stats().DirtyBlocks {
		t.Fatal("dirty data not under the target: the test shows nothing")
	}
	v.degrade(degradeSuperseded)
	if st := v.Stats(); st.BackingConsistent || st.DirtyBlocks == 0 {
		t.Fatalf("after the degrade: consistent %v, %d dirty (want no, some)", st.BackingConsistent, st.DirtyBlocks)
	}
	if rate := s.wbRate(v); rate != 0 {
		t.Fatalf("degraded, busy client, dirty under the target: writeback rate %d, want 0 (as in lba order)", rate)
	}
	setWritebackOrder(t, v, "lba")
	if rate := s.wbRate(v); rate != 0 {
		t.Fatalf("lba order, same dirty data: writeback rate %d, want 0", rate)
	}
	setWritebackOrder(t, v, "epoch") // still degraded: dirty data of lba order
	v.lastIO.Store(0)
	if rate := s.wbRate(v); rate != -1 {
		t.Fatalf("degraded, idle client: writeback rate %d, want -1 (full speed: back to epoch order by a full drain)", rate)
	}
	busy()
	v.ord.at.Store(time.Now().Add(-catchUpAfter).UnixNano())
	if !v.catchUp() {
		t.Fatal("no catch-up")
	}
	if rate := s.wbRate(v); rate != -1 {
		t.Fatalf("catching up, busy client: writeback rate %d, want -1 (full speed)", rate)
	}
}
