package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// TestFailoverFencesLostCleanInsert: a writethrough write replaces a block
// whose dirty version is durable in the cache, and the commit that would
// journal its clean insert fails the set over. The device still holds the
// dirty version and a reopen of the repaired device replays it, so the
// block must be fenced (a passthrough write to it refused) and the
// writethrough write counted as lost (Flush fails with ErrLostWrites).
// Without that, a later passthrough write was acknowledged and flushed, and
// the reopen brought the old dirty version back over it (found by
// TestDeviceFailureModel/cache seed 52: "vol0 block 31 holds w15").
func TestFailoverFencesLostCleanInsert(t *testing.T) {
	var failSyncs atomic.Bool
	// No background goroutines: no writeback can clean the dirty version
	// and no periodic commit can journal the clean insert before the fault.
	s, cacheMem, specs := newFaultSet(t, func(op faultdev.Op) faultdev.Fault {
		if failSyncs.Load() && op.Kind == faultdev.Sync {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	})
	var err error
	v := s.vols[0]
	setWritebackOrder(t, v, "lba")
	const off = 5 * blockSize
	data := func(wid uint64) []byte {
		p := make([]byte, blockSize)
		stamp(p, wid, 0, off)
		return p
	}
	// w1: dirty in the cache, durable.
	if err := v.WriteAt(data(1), off, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	// w2: writethrough, a clean insert over the dirty w1; its record is
	// pending when the cache device stops syncing.
	failSyncs.Store(true)
	if err := v.WriteAt(data(2), off, false); err != nil {
		t.Fatalf("writethrough write: %v", err)
	}
	err = v.Flush()
	if !s.isFailed() {
		t.Fatalf("flush with a failing cache sync did not fail the set over: %v", err)
	}
	if !errors.Is(err, ErrLostWrites) && !errors.Is(err, ErrCacheFailed) {
		t.Fatalf("flush at failover: %v, want an error (the writethrough write is rolled back by a reopen)", err)
	}
	if err := v.Flush(); !errors.Is(err, ErrLostWrites) {
		t.Fatalf("flush after failover: %v, want ErrLostWrites", err)
	}
	// w3: passthrough; the block must be fenced.
	if err := v.WriteAt(data(3), off, false); !errors.Is(err, ErrDirtyUnreachable) {
		t.Fatalf("passthrough write over the lost clean insert: %v, want ErrDirtyUnreachable", err)
	}
	s.crashStop()
	// Heal: the repaired cache device replays the durable dirty w1.
	s2, err := Open(cacheMem, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.crashStop()
	if err := s2.Check(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, blockSize)
	if err := s2.vols[0].ReadAt(got, off); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data(1)) && !bytes.Equal(got, data(2)) {
		t.Fatalf("after heal and reopen the block holds %s; want w1 or w2 (never acknowledged-and-flushed data rolled back)", describeSectors(got))
	}
}

// TestFlushRacingFailover: the periodic commit fails the set over while a
// Flush waits for commitMu, with a writeback write (its dirty insert) among
// the records it loses. The Flush then finds the set failed and its commit
// only syncs the backing devices; it must still fail (ErrLostWrites), not
// claim the lost write durable. The Flush is let in while the failing
// commit is stuck in its cache device sync; if it arrives only after the
// failover, it takes the failed-before path, which must fail the same way.
func TestFlushRacingFailover(t *testing.T) {
	s, armed, entered, release := newStuckSyncSet(t)
	var err error
	v := s.vols[0]
	p := make([]byte, blockSize)
	stamp(p, 1, 0, 0)
	if err := v.WriteAt(p, 0, false); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	go func() { _ = s.commit(s.appended()) }() // the periodic commit
	<-entered
	flushed := make(chan error)
	go func() { flushed <- v.Flush() }()
	time.Sleep(50 * time.Millisecond) // let the Flush reach commitMu
	close(release)
	err = <-flushed
	if !s.isFailed() {
		t.Fatal("the failing commit did not fail the set over")
	}
	if !errors.Is(err, ErrLostWrites) && !errors.Is(err, ErrCacheFailed) {
		t.Fatalf("flush racing a failover that lost a write: %v, want an error", err)
	}
	if err := v.Flush(); !errors.Is(err, ErrLostWrites) {
		t.Fatalf("flush after failover: %v, want ErrLostWrites", err)
	}
}

// TestFUARacingFailover: a FUA write goes into the cache while the periodic
// commit, stuck in its cache device sync, is about to fail the set over;
// the failover loses the write's record, and the FUA's own commit then
// finds the set failed and only syncs the backing devices. The write must
// fail (ErrLostWrites): a reopen of the repaired device does not have it.
func TestFUARacingFailover(t *testing.T) {
	s, armed, entered, release := newStuckSyncSet(t)
	v := s.vols[0]
	// Something pending, so that the periodic commit below syncs the
	// cache device (with nothing to commit it would return at once).
	q := make([]byte, blockSize)
	stamp(q, 3, 0, 16*blockSize)
	if err := v.WriteAt(q, 16*blockSize, false); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	go func() { _ = s.commit(s.appended()) }() // the periodic commit
	<-entered
	p := make([]byte, blockSize)
	stamp(p, 1, 0, 0)
	done := make(chan error)
	go func() { done <- v.WriteAt(p, 0, true) }()
	// Let the write reach the cache and its commit wait for commitMu.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		_, ok := v.idx.Tree.Get(index.Ent{LBA: 0})
		s.mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the FUA write did not reach the cache")
		}
	}
	time.Sleep(20 * time.Millisecond)
	close(release)
	err := <-done
	if !s.isFailed() {
		t.Fatal("the failing commit did not fail the set over")
	}
	if !errors.Is(err, ErrLostWrites) {
		t.Fatalf("FUA write whose record the failover lost: %v, want ErrLostWrites", err)
	}
	// A FUA write after the failover goes to the backing device: it succeeds.
	stamp(p, 2, 0, 8*blockSize)
	if err := v.WriteAt(p, 8*blockSize, true); err != nil {
		t.Fatalf("FUA write after failover: %v", err)
	}
}

// newStuckSyncSet is newFaultSet whose cache device, once armed is set,
// blocks its first sync until release is closed (entered is closed when it
// starts) and then fails it and every later sync: a commit stuck in its
// cache sync that will fail the set over.
func newStuckSyncSet(t *testing.T) (s *Set, armed *atomic.Bool, entered, release chan struct{}) {
	armed = new(atomic.Bool)
	entered, release = make(chan struct{}), make(chan struct{})
	s, _, _ = newFaultSet(t, stuckSync(armed, entered, release))
	return s, armed, entered, release
}

// stuckSync, once armed is set, blocks the first sync until release is
// closed (entered is closed when it starts) and then fails it and every
// later sync.
func stuckSync(armed *atomic.Bool, entered, release chan struct{}) faultdev.InjectorFunc {
	var once sync.Once
	return func(op faultdev.Op) faultdev.Fault {
		if !armed.Load() || op.Kind != faultdev.Sync {
			return faultdev.Fault{}
		}
		once.Do(func() {
			close(entered)
			<-release
		})
		return faultdev.Error(nil)
	}
}

// newFaultSet formats a writeback set of one 32-block volume on memory
// devices and opens it with inj on the cache device and no background
// goroutines (the tests drive commits themselves). It returns the bare
// cache device and the specs, for a reopen on the healed device.
func newFaultSet(t *testing.T, inj faultdev.InjectorFunc) (*Set, *device.Mem, []BackingSpec) {
	t.Helper()
	return newFaultSetKnobs(t, inj, testingKnobs{noBackground: true})
}

// newFaultSetKnobs is newFaultSet opened with knobs.
func newFaultSetKnobs(t *testing.T, inj faultdev.InjectorFunc, knobs testingKnobs) (*Set, *device.Mem, []BackingSpec) {
	t.Helper()
	bs := int64(4 * blockSize)
	cacheMem := device.NewMem(cacheSizeFor(minBuckets, bs, minJournalLen, 1))
	specs := []BackingSpec{{Name: "vol0", Dev: device.NewMem(32 * blockSize)}}
	if _, err := Format(cacheMem, specs, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: Writeback}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(faultdev.Wrap(cacheMem, inj), specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	return s, cacheMem, specs
}

// TestEpochWriteNotStuckOnOtherVolume: in epoch order a write that finds no
// free bucket waits for its volume's writeback to free space. When the
// cache is full of another volume's dirty data whose backing device is
// dead, no space ever comes; once the writer's own volume has nothing
// dirty left, the write must go around the cache instead of waiting
// forever (TestDeviceFailureModel/backing seed 5287 hung there).
func TestEpochWriteNotStuckOnOtherVolume(t *testing.T) {
	bs := int64(4 * blockSize)
	cache := device.NewMem(cacheSizeFor(minBuckets, bs, minJournalLen, 2))
	back0, back1 := device.NewMem(256*blockSize), device.NewMem(32*blockSize)
	specs := []BackingSpec{{Name: "vol0", Dev: back0}, {Name: "vol1", Dev: back1}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: Writeback}); err != nil {
		t.Fatal(err)
	}
	dead := faultdev.Wrap(back0, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if op.Kind != faultdev.Read {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))
	s, err := Open(cache, []BackingSpec{{Name: "vol0", Dev: dead}, {Name: "vol1", Dev: back1}}, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	v0, v1 := s.vols[0], s.vols[1]
	for _, v := range s.vols {
		st := v.Settings()
		st.WritebackOrder = OrderEpoch
		if err := v.SetSettings(st); err != nil {
			t.Fatal(err)
		}
	}
	p := make([]byte, blockSize)
	stamp(p, 1, 1, 0)
	if err := v1.WriteAt(p, 0, false); err != nil {
		t.Fatal(err)
	}
	// Fill the cache with vol0's dirty data; its writeback fails, so a
	// vol0 write finally fails instead of waiting for space.
	full := false
	for i := int64(0); i < back0.Size()/blockSize && !full; i++ {
		stamp(p, uint64(2+i), 0, i*blockSize)
		err := v0.WriteAt(p, i*blockSize, false)
		sweepLogged(s, v0, 1)
		full = err != nil
	}
	if !full {
		t.Fatal("vol0's dirty data did not fill the cache")
	}
	// A vol1 write waits for space; vol1's writeback then cleans its only
	// dirty block. The write must go around the cache.
	done := make(chan error, 1)
	stamp(p, 1000, 1, 8*blockSize)
	go func() { done <- v1.WriteAt(p, 8*blockSize, false) }()
	time.Sleep(20 * time.Millisecond)
	// vol1's only dirty block is written back by this sweep or by the
	// waiting write itself (with no writeback goroutine, a waiter writes
	// back its own volume), whichever comes first.
	sweepLogged(s, v1, 8)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("vol1 write: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a vol1 write waits forever for space that vol0's dead backing device holds")
	}
	if st := v1.Stats(); st.WritebackBytes != blockSize || st.DirtyBlocks != 0 {
		t.Fatalf("vol1: %d bytes written back, %d blocks dirty; want its one block written back and none dirty", st.WritebackBytes, st.DirtyBlocks)
	}
	got := make([]byte, blockSize)
	if err := v1.ReadAt(got, 8*blockSize); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("vol1 read back: %v, %s", err, describeSectors(got))
	}
}

// TestBackingSyncFailuresAllLogged: every failed backing device sync is
// logged, not only the first (later flushes return the first failure, so a
// second one was visible nowhere but a counter; found by
// TestDeviceFailureModel/seq, seeds 18, 80, 113 and others).
func TestBackingSyncFailuresAllLogged(t *testing.T) {
	log := &cpLog{}
	s, failing := newBackFaultSetLog(t, Writearound, faultdev.OnKind(faultdev.Sync, faultdev.Always(faultdev.Error(nil))), log)
	v := s.vols[0]
	p := make([]byte, blockSize)
	for i := range 3 {
		stamp(p, uint64(i+1), 0, 0)
		if err := v.WriteAt(p, 0, false); err != nil {
			t.Fatal(err)
		}
		if err := v.Flush(); !errors.Is(err, faultdev.ErrInjected) {
			t.Fatalf("flush %d with a failing backing sync: %v, want the injected error", i, err)
		}
	}
	if n, logged := failing.Injected(), log.count(); logged < int(n) {
		t.Fatalf("%d backing syncs failed, %d logged:\n%s", n, logged, log.all())
	}
}

// TestWritebackBatchReportsEveryError: two runs of one writeback batch
// fail on the backing device at the same time; the batch's error must
// carry both (parallel kept only the first, so the second failure vanished;
// found by TestDeviceFailureModel/seq, seeds 110 and 118).
func TestWritebackBatchReportsEveryError(t *testing.T) {
	var armed atomic.Bool
	s := newBackFaultSet(t, Writeback, func(op faultdev.Op) faultdev.Fault {
		if !armed.Load() || op.Kind != faultdev.Write {
			return faultdev.Fault{}
		}
		// Slow, so that the second run starts before the first fails.
		return faultdev.Fault{Latency: 50 * time.Millisecond, Fail: true, Err: &seqFault{dev: "back", op: op}}
	})
	v := s.vols[0]
	setWritebackOrder(t, v, "lba")
	p := make([]byte, blockSize)
	for _, lba := range []uint64{2, 9} { // two runs
		stamp(p, lba, 0, int64(lba)*blockSize)
		if err := v.WriteAt(p, int64(lba)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	armed.Store(true)
	_, err := s.writeback(0, []uint64{2, 9})
	if got := seqFaultsIn(err); len(got) != 2 {
		t.Fatalf("writeback of two runs, both failing: error %v carries %d of the 2 failures", err, len(got))
	}
}

// TestOlderEpochRetryFailuresLogged: in epoch order, a writethrough write
// arrives while an older epoch is dirty, and writing that epoch back fails
// three times before it works. Every failure must be in the log, without a
// line per retry.
//
// Until 0fa6c03 the write itself wrote the older epochs back first
// (drainOlderEpochs, retrying every 1 ms), and eb173b2 made that retry run
// log its distinct errors when it ended (only the first had been logged:
// TestDeviceFailureModel/seq seed 4954); this test checked that run.
// 0fa6c03 (issue 15, item 3: routing as a table, no request waits for
// older epochs) sends the write into the cache as deferred dirty data
// instead, and the background writeback retries the older epoch with
// backoff (cache/internal/backoff), which logged the first error and the
// last. The test now asserts the same of that retry run: the write
// succeeds at once (deferred), the older epoch gets written back, and each
// injected failure's error is in the log, in at most two lines (failing,
// recovered).
func TestOlderEpochRetryFailuresLogged(t *testing.T) {
	var toFail atomic.Int32
	var fired []string
	var mu sync.Mutex
	inj := faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if op.Kind != faultdev.Write || toFail.Add(-1) < 0 {
			return faultdev.Fault{}
		}
		f := &seqFault{dev: "back", op: op}
		mu.Lock()
		fired = append(fired, f.Error())
		mu.Unlock()
		return faultdev.Error(f)
	})
	log := &retryLog{recovered: make(chan struct{})}
	bs := int64(4 * blockSize)
	cache := device.NewMem(cacheSizeFor(minBuckets, bs, minJournalLen, 1))
	back := device.NewMem(32 * blockSize)
	if _, err := Format(cache, []BackingSpec{{Name: "vol0", Dev: back}}, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: Writeback}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, []BackingSpec{{Name: "vol0", Dev: faultdev.Wrap(back, inj)}}, OpenOptions{Logger: slog.New(log)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	v := s.vols[0]
	st := v.Settings()
	st.WritebackOrder = OrderEpoch
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	// The backing device fails the first three writes from here on: the
	// background writeback's attempts at the older epoch.
	toFail.Store(3)
	p := make([]byte, blockSize)
	stamp(p, 1, 0, 0)
	if err := v.WriteAt(p, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil { // a new epoch: the write is older
		t.Fatal(err)
	}
	if err := v.SetMode(Writethrough); err != nil {
		t.Fatal(err)
	}
	stamp(p, 2, 0, 8*blockSize)
	if err := v.WriteAt(p, 8*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if d := v.Stats().EpochDeferBytes; d != blockSize {
		t.Fatalf("EpochDeferBytes %d after a writethrough write over a dirty older epoch, want %d (deferred into the cache)", d, blockSize)
	}
	<-log.recovered
	mu.Lock()
	defer mu.Unlock()
	if len(fired) != 3 {
		t.Fatalf("%d writeback attempts failed, want 3 (the test's set-up is off)", len(fired))
	}
	lines := log.all()
	for _, f := range fired {
		if !strings.Contains(lines, f[strings.Index(f, "<"):]) {
			t.Errorf("failure %q is not in the log:\n%s", f, lines)
		}
	}
	if n := strings.Count(lines, "\n"); n > 2 {
		t.Errorf("%d log lines for one run of 3 failed attempts, want 2:\n%s", n, lines)
	}
}

// retryLog keeps the warnings and errors, and the lines of writeback's
// retries at every level, and closes recovered at the first "recovered"
// line of writeback.
type retryLog struct {
	mu        sync.Mutex
	text      strings.Builder
	recovered chan struct{}
	closed    bool
}

func (h *retryLog) Enabled(context.Context, slog.Level) bool { return true }

func (h *retryLog) Handle(_ context.Context, r slog.Record) error {
	retry := strings.HasPrefix(r.Message, "writeback to the backing device")
	if r.Level < slog.LevelWarn && !retry {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	fmt.Fprintf(&h.text, "%v %s", r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&h.text, " %s=%v", a.Key, a.Value.Resolve())
		return true
	})
	h.text.WriteByte('\n')
	if retry && strings.HasSuffix(r.Message, "recovered") && !h.closed {
		h.closed = true
		close(h.recovered)
	}
	return nil
}

func (h *retryLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *retryLog) WithGroup(string) slog.Handler      { return h }

func (h *retryLog) all() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.text.String()
}

// TestPassthroughRacingFailoverCountsLost: writeback writes a dirty block
// back and marks it clean (the clean mark pending); a client write to the
// block fails to go into the cache and goes around it, and while its backing
// write runs the set fails over, losing the clean mark. The cache device
// still holds the durable dirty version, which a reopen of the repaired
// device replays over the client's write: the write must count as lost
// (Flush fails with ErrLostWrites), not be claimed durable. Found by
// TestDeviceFailureModel/seq seed 11588 (after heal and reopen the block
// held the older write).
func TestPassthroughRacingFailoverCountsLost(t *testing.T) {
	var failCacheWrites atomic.Bool
	s, v, w2, reopenRead := newLostCleanMarkSet(t, func(op faultdev.Op) faultdev.Fault {
		if failCacheWrites.Load() && op.Kind == faultdev.Write {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}, Writeback)
	failCacheWrites.Store(true)
	if err := v.WriteAt(w2, lostMarkOff, false); err != nil {
		t.Fatalf("write around the failing cache: %v", err)
	}
	if !s.isFailed() {
		t.Fatal("the set did not fail over")
	}
	if err := v.Flush(); !errors.Is(err, ErrLostWrites) {
		t.Fatalf("flush after failover: %v, want ErrLostWrites; after reopen the block holds %s (the flushed write was w2)", err, describeSectors(reopenRead()))
	}
}

// lostMarkOff is the block newLostCleanMarkSet sets up.
const lostMarkOff = 5 * blockSize

// newLostCleanMarkSet is newFaultSet (inj on the cache device) in lba
// writeback order with the block at lostMarkOff written (w1), flushed
// (dirty and durable in the cache), switched to mode and written back, its
// clean mark pending; the next backing write fails the set over before it
// runs. It returns w2 (the block's next version, to write) and reopenRead,
// which stops the set, reopens the healed cache device and reads the block.
func newLostCleanMarkSet(t *testing.T, inj faultdev.InjectorFunc, mode Mode) (s *Set, v *Volume, w2 []byte, reopenRead func() []byte) {
	t.Helper()
	// fixedJournal: a checkpoint at random (invariants builds) in the
	// set-up would start a journal generation without the region's mark,
	// and the write under test would then commit one (failing over on the
	// journal write) before its backing write.
	s, cacheMem, specs := newFaultSetKnobs(t, inj, testingKnobs{noBackground: true, fixedJournal: true})
	v = s.vols[0]
	st := v.Settings()
	st.WritebackOrder = OrderLBA
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	w1, w2 := make([]byte, blockSize), make([]byte, blockSize)
	stamp(w1, 1, 0, lostMarkOff)
	stamp(w2, 2, 0, lostMarkOff)
	if err := v.WriteAt(w1, lostMarkOff, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := v.SetMode(mode); err != nil {
		t.Fatal(err)
	}
	// A backing write elsewhere in the block's mark region (all of the
	// volume) commits the region's mark, so that the write under test
	// commits nothing before its backing write.
	if err := v.Trim(0, blockSize, false); err != nil {
		t.Fatal(err)
	}
	if n := sweepLogged(s, v, 8); n != 1 {
		t.Fatalf("writeback wrote %d blocks, want 1", n)
	}
	var once sync.Once
	v.back = faultdev.Wrap(v.back, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if op.Kind == faultdev.Write {
			once.Do(func() { _ = s.failover(errors.New("test: cache device gone")) })
		}
		return faultdev.Fault{}
	}))
	reopenRead = func() []byte {
		t.Helper()
		s.crashStop()
		s2, err := Open(cacheMem, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err != nil {
			t.Fatal(err)
		}
		defer s2.crashStop()
		got := make([]byte, blockSize)
		if err := s2.vols[0].ReadAt(got, lostMarkOff); err != nil {
			t.Fatal(err)
		}
		return got
	}
	return s, v, w2, reopenRead
}

// TestFlushWaitsForConcurrentBackingSync: after failover a Flush only
// syncs the backing devices, outside commitMu. One Flush took the
// backing device's "written since the last sync" flag and is inside a sync
// that will fail; a second Flush, finding the flag clear and no failed sync
// recorded yet, returned success for writes that sync had not made durable
// (and never did). The second Flush must wait for the sync in progress and
// return its failure. Found by TestCrashPointsConcurrent (seed 19, N=133:
// a block read back older than a flushed write after the power cut, in
// about 2 of 3 loaded full-package runs; not once unloaded).
func TestFlushWaitsForConcurrentBackingSync(t *testing.T) {
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	s := newBackFaultSet(t, Writethrough, stuckSync(&armed, entered, release))
	v := s.vols[0]
	if err := s.failover(errors.New("test: cache device failed")); !errors.Is(err, ErrCacheFailed) {
		t.Fatalf("failover: %v", err)
	}
	p := make([]byte, blockSize)
	stamp(p, 1, 0, 0)
	if err := v.WriteAt(p, 0, false); err != nil { // passthrough
		t.Fatal(err)
	}
	errs := flushTwiceDuringSync(t, v, &armed, entered, release)
	if !errors.Is(errs[0], faultdev.ErrInjected) {
		t.Fatalf("flush whose backing sync failed: %v, want the injected error", errs[0])
	}
	if !errors.Is(errs[1], faultdev.ErrInjected) {
		t.Fatalf("flush that waited for a failed backing sync: %v, want the injected error", errs[1])
	}
}

// flushTwiceDuringSync arms a stuck backing sync, starts a flush of v and,
// once its sync is stuck (entered), a second flush, which must not return
// while the sync is held; then it releases the sync and returns both
// flushes' errors.
func flushTwiceDuringSync(t *testing.T, v *Volume, armed *atomic.Bool, entered, release chan struct{}) [2]error {
	t.Helper()
	armed.Store(true)
	first := make(chan error, 1)
	go func() { first <- v.Flush() }()
	<-entered
	second := make(chan error, 1)
	go func() { second <- v.Flush() }()
	select {
	case err := <-second:
		close(release)
		t.Fatalf("a flush returned %v while another flush's sync of the same writes was in progress", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	return [2]error{<-first, <-second}
}

// newBackFaultSet formats a set of one 32-block volume in mode on memory
// devices and opens it with inj on the backing device and no background
// goroutines.
func newBackFaultSet(t *testing.T, mode Mode, inj faultdev.InjectorFunc) *Set {
	t.Helper()
	s, _ := newBackFaultSetLog(t, mode, inj, nil)
	return s
}

// newBackFaultSetLog is newBackFaultSet logging to log (if not nil); it
// also returns the faulty backing device, whose counts the tests check.
func newBackFaultSetLog(t *testing.T, mode Mode, inj faultdev.Injector, log *cpLog) (*Set, *faultdev.Device) {
	t.Helper()
	bs := int64(4 * blockSize)
	cache := device.NewMem(cacheSizeFor(minBuckets, bs, minJournalLen, 1))
	back := device.NewMem(32 * blockSize)
	if _, err := Format(cache, []BackingSpec{{Name: "vol0", Dev: back}}, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: mode}); err != nil {
		t.Fatal(err)
	}
	opts := OpenOptions{testing: testingKnobs{noBackground: true}}
	if log != nil {
		opts.Logger = slog.New(log)
	}
	failing := faultdev.Wrap(back, inj)
	s, err := Open(cache, []BackingSpec{{Name: "vol0", Dev: failing}}, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	return s, failing
}

// TestWritethroughRacingFailoverCountsLost: writeback wrote a dirty block
// back and marked it clean (the mark still pending); a writethrough write
// of that block passed the failed-set check, and while its backing write
// ran, a failover lost the clean mark and fenced the block. The device
// still holds the durable dirty version. The write's clean insert, journaled
// after the failover, was dropped as a lost clean insert that replaced
// nothing dirty (the block was clean in memory), so the FUA succeeded, and
// a reopen of the repaired device replayed the older dirty version over
// it. The write must count as lost (ErrLostWrites), as a passthrough write
// in the same race does (TestPassthroughRacingFailoverCountsLost). Found by
// TestDeviceFailureModel/seq seed 1786 (about 1 replay in 5).
func TestWritethroughRacingFailoverCountsLost(t *testing.T) {
	s, v, w2, reopenRead := newLostCleanMarkSet(t, func(faultdev.Op) faultdev.Fault { return faultdev.Fault{} }, Writethrough)
	// Its backing write (after its cache write) fails the set over.
	err := v.WriteAt(w2, lostMarkOff, true)
	if !s.isFailed() {
		t.Fatal("the set did not fail over")
	}
	if !errors.Is(err, ErrLostWrites) {
		t.Fatalf("FUA writethrough write racing a failover that fenced its block: %v, want ErrLostWrites; after reopen the block holds %s (the write was w2)", err, describeSectors(reopenRead()))
	}
	if err := v.Flush(); !errors.Is(err, ErrLostWrites) {
		t.Fatalf("flush after the lost write: %v, want ErrLostWrites", err)
	}
}

// TestNoWritebackAfterFailover: once the set has failed over, writeback
// must not write a version whose insert record never became durable. The
// cache device's sync failed, so a reopen of the repaired device brings
// back the older clean version; written back, the newer data would sit on
// the backing device under that clean entry, and reads would return the
// older data (found by make stress, TestErrorPoints/gc seed 27: "a stale
// clean entry survived recovery", an eviction writing back after the
// failover its own commit caused).
func TestNoWritebackAfterFailover(t *testing.T) {
	var failSyncs atomic.Bool
	s, cacheMem, specs := newFaultSet(t, func(op faultdev.Op) faultdev.Fault {
		if failSyncs.Load() && op.Kind == faultdev.Sync {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	})
	v := s.vols[0]
	setWritebackOrder(t, v, "lba")
	const lba = 5
	data := func(wid uint64) []byte {
		p := make([]byte, blockSize)
		stamp(p, wid, 0, lba*blockSize)
		return p
	}
	// w1: cached, flushed and written back: a clean entry.
	if err := v.WriteAt(data(1), lba*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := v.wb.Sweep(writeback.FullBatch); err != nil {
		t.Fatal(err)
	}
	if v.hasDirty() {
		t.Fatal("w1 still dirty after a sweep")
	}
	// w2: dirty, its record not durable when the cache device stops
	// syncing; the flush fails the set over.
	if err := v.WriteAt(data(2), lba*blockSize, false); err != nil {
		t.Fatal(err)
	}
	failSyncs.Store(true)
	if err := v.Flush(); err == nil || !s.isFailed() {
		t.Fatalf("flush with a failing cache sync: %v, failed over %v; want an error and a failover", err, s.isFailed())
	}
	if _, err := v.wb.Evict([]uint64{lba}); !errors.Is(err, ErrCacheFailed) {
		t.Errorf("writeback after the failover: %v, want ErrCacheFailed", err)
	}
	got := make([]byte, blockSize)
	if _, err := specs[0].Dev.ReadAt(got, lba*blockSize); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data(1)) {
		t.Fatalf("backing device after writeback past the failover holds %s; want w1 (w2's record was never durable)", describeSectors(got))
	}
	s.crashStop()
	failSyncs.Store(false)
	s2, err := Open(cacheMem, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.crashStop()
	if err := checkCleanCoherent(s2); err != nil {
		t.Fatal(err)
	}
}
