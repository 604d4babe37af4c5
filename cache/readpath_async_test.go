package cache

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

// asyncMem is a memory cache device that starts reads asynchronously
// (device.AsyncReader): by default each on a new goroutine; hold makes it
// keep the completions for the test to deliver, refuse makes it refuse
// starts, and fail, if set, fails reads (async ones; sync too with
// failSync) at the device offsets it reports. A held completion takes the
// later of the batch the test delivers it in (runBatch).
type asyncMem struct {
	*device.Mem
	mu       sync.Mutex
	hold     bool
	refuse   bool
	held     []func(later func(func()))
	started  int
	fail     func(off int64) bool
	failSync bool
}

func (d *asyncMem) StartReadAt(p []byte, off int64, done func(int, error, func(func()))) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.refuse {
		return false
	}
	d.started++
	fail := d.fail != nil && d.fail(off)
	run := func(later func(func())) {
		if fail {
			done(0, &device.IOError{Op: "read", Path: "asyncmem", Off: off, Len: int64(len(p)), Err: syscall.EIO}, later)
			return
		}
		n, err := d.Mem.ReadAt(p, off)
		done(n, err, later)
	}
	if d.hold {
		d.held = append(d.held, run)
	} else {
		go device.WithLater(run)
	}
	return true
}

func (d *asyncMem) ReadAt(p []byte, off int64) (int, error) {
	d.mu.Lock()
	fail := d.failSync && d.fail != nil && d.fail(off)
	d.mu.Unlock()
	if fail {
		return 0, &device.IOError{Op: "read", Path: "asyncmem", Off: off, Len: int64(len(p)), Err: syscall.EIO}
	}
	return d.Mem.ReadAt(p, off)
}

// newAsyncSet is newTestSet with the cache on an asyncMem, and one volume
// of nblk blocks with promotion off, its backing device stamped with
// write 1: blocks 8-11 are cached clean (write 2), 16-19 dirty (write 3).
func newAsyncSet(t *testing.T, nblk int64) (*Set, *Volume, *asyncMem, []byte) {
	t.Helper()
	jl := int64(minJournalLen)
	cache := &asyncMem{Mem: device.NewMem(cacheSizeFor(16, 64<<10, jl, 1))}
	back := device.NewMem(nblk * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 64 << 10, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	checkAfter(t, s)
	v := s.vols[0]
	st := *v.cfg.Load()
	st.Promote = "never"
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, nblk*blockSize)
	stamp(want, 1, 0, 0)
	if _, err := back.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		mode Mode
		wid  uint64
		lba  int64
	}{{Writethrough, 2, 8}, {Writeback, 3, 16}} {
		if err := v.SetMode(w.mode); err != nil {
			t.Fatal(err)
		}
		p := want[w.lba*blockSize : (w.lba+4)*blockSize]
		stamp(p, w.wid, 0, w.lba*blockSize)
		if err := v.WriteAt(p, w.lba*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	return s, v, cache, want
}

// startRead is StartReadAt waiting for done; started false: not started.
func startRead(v *Volume, p []byte, off int64) (started bool, err error) {
	res := make(chan error, 1)
	if !v.StartReadAt(p, off, func(err error, later func(func())) { later(func() { res <- err }) }) {
		return false, nil
	}
	return true, <-res
}

// TestStartReadAtHit: whole-block reads held in one run of the cache are
// started asynchronously and return the latest data, counted as hits;
// misses, partial hits, unaligned and overlong reads are not started and
// change no counter. A device that refuses the start still gets the read
// done (on a goroutine). Set.Check (checkAfter) finds no pin left.
func TestStartReadAtHit(t *testing.T) {
	_, v, cache, want := newAsyncSet(t, 64)
	for _, c := range []struct {
		off, n int64
		start  bool
	}{
		{8 * blockSize, 4 * blockSize, true},
		{9 * blockSize, blockSize, true},
		{16 * blockSize, 4 * blockSize, true},
		{19 * blockSize, blockSize, true},
		{0, blockSize, false},                  // miss
		{7 * blockSize, 2 * blockSize, false},  // partial
		{11 * blockSize, 6 * blockSize, false}, // two runs with a gap
		{9*blockSize + 512, blockSize, false},  // unaligned
		{8 * blockSize, maxAsyncHit + blockSize, false},
	} {
		before := v.Stats()
		p := make([]byte, c.n)
		started, err := startRead(v, p, c.off)
		if started != c.start {
			t.Fatalf("%d at %d: started %v", c.n, c.off, started)
		}
		after := v.Stats()
		if !started {
			if after.ReadOps != before.ReadOps || after.ReadHitOps != before.ReadHitOps {
				t.Fatalf("%d at %d: not started, but counted", c.n, c.off)
			}
			continue
		}
		if err != nil || string(p) != string(want[c.off:c.off+c.n]) {
			t.Fatalf("%d at %d: %v or wrong data", c.n, c.off, err)
		}
		if after.ReadOps != before.ReadOps+1 || after.ReadHitOps != before.ReadHitOps+1 ||
			after.ReadHitBytes != before.ReadHitBytes+uint64(c.n) {
			t.Fatalf("%d at %d: counters %+v -> %+v", c.n, c.off, before, after)
		}
	}
	cache.mu.Lock()
	cache.refuse = true
	cache.mu.Unlock()
	p := make([]byte, blockSize)
	if started, err := startRead(v, p, 17*blockSize); !started || err != nil || string(p) != string(want[17*blockSize:18*blockSize]) {
		t.Fatalf("refused by the device: started %v, %v", started, err)
	}
}

// TestStartReadAtChecksum: a corrupt clean block is re-read from the
// backing device and dropped from the cache, a corrupt dirty one fails
// the read with ErrChecksum: readBlocksHit's repair and error path.
func TestStartReadAtChecksum(t *testing.T) {
	s, v, cache, want := newAsyncSet(t, 64)
	corrupt := func(lba uint64) {
		e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
		if !ok {
			t.Fatalf("lba %d not cached", lba)
		}
		if err := cache.Corrupt(s.cacheOff(e.Block())+7, 1); err != nil {
			t.Fatal(err)
		}
	}
	corrupt(9)
	p := make([]byte, 4*blockSize)
	if started, err := startRead(v, p, 8*blockSize); !started || err != nil || string(p) != string(want[8*blockSize:12*blockSize]) {
		t.Fatalf("corrupt clean block: started %v, %v or wrong data", started, err)
	}
	if st := v.Stats(); st.ChecksumErrors != 1 || st.ChecksumRepairs != 1 {
		t.Fatalf("stats %+v", st)
	}
	if _, ok := v.idx.Tree.Get(index.Ent{LBA: 9}); ok {
		t.Fatal("the corrupt clean copy is still indexed")
	}
	corrupt(18)
	if started, err := startRead(v, p, 16*blockSize); !started || !errors.Is(err, ErrChecksum) {
		t.Fatalf("corrupt dirty block: started %v, %v", started, err)
	}
}

// TestStartReadAtDeviceError: a failed cache read is served around the
// cache, as readBlocksHit serves it: clean blocks from the backing device,
// dirty ones by a second (synchronous) cache read; a dirty block that
// cannot be read either fails with ErrDirtyUnreachable.
func TestStartReadAtDeviceError(t *testing.T) {
	_, v, cache, want := newAsyncSet(t, 64)
	cache.mu.Lock()
	cache.fail = func(int64) bool { return true }
	cache.mu.Unlock()
	for _, lba := range []int64{8, 16} {
		p := make([]byte, 4*blockSize)
		if started, err := startRead(v, p, lba*blockSize); !started || err != nil || string(p) != string(want[lba*blockSize:(lba+4)*blockSize]) {
			t.Fatalf("lba %d: started %v, %v or wrong data", lba, started, err)
		}
	}
	cache.mu.Lock()
	cache.failSync = true
	cache.mu.Unlock()
	if started, err := startRead(v, make([]byte, blockSize), 16*blockSize); !started || !errors.Is(err, ErrDirtyUnreachable) {
		t.Fatalf("unreadable dirty block: started %v, %v", started, err)
	}
}

// TestStartReadAtContended delivers a completion while the test holds the
// set mutex: the completion (on a device's reaper it must not wait) returns
// at once and the read finishes when the mutex is free.
func TestStartReadAtContended(t *testing.T) {
	s, v, cache, want := newAsyncSet(t, 64)
	cache.mu.Lock()
	cache.hold = true
	cache.mu.Unlock()
	p := make([]byte, blockSize)
	res := make(chan error, 1)
	if !v.StartReadAt(p, 10*blockSize, func(err error, _ func(func())) { res <- err }) {
		t.Fatal("not started")
	}
	cache.mu.Lock()
	held := cache.held
	cache.held = nil
	cache.mu.Unlock()
	if len(held) != 1 {
		t.Fatalf("%d reads held", len(held))
	}
	s.mu.Lock()
	device.WithLater(held[0]) // returns although s.mu is taken
	s.mu.Unlock()
	if err := <-res; err != nil || string(p) != string(want[10*blockSize:11*blockSize]) {
		t.Fatalf("%v or wrong data", err)
	}
}

// TestStartReadAtBatch delivers the completions of three hits as one
// device batch: each read's done gets the device's later, so what the
// dones leave to later runs after all three have returned (the NBD server
// writes the replies of a batch in one writev), not after each.
func TestStartReadAtBatch(t *testing.T) {
	_, v, cache, want := newAsyncSet(t, 64)
	cache.mu.Lock()
	cache.hold = true
	cache.mu.Unlock()
	lbas := []int64{8, 10, 17}
	ps := make([][]byte, len(lbas))
	dones, laters := 0, 0
	for i, lba := range lbas {
		ps[i] = make([]byte, blockSize)
		if !v.StartReadAt(ps[i], lba*blockSize, func(err error, later func(func())) {
			if err != nil {
				t.Errorf("read of block %d: %v", lba, err)
			}
			dones++
			later(func() {
				if dones != len(lbas) {
					t.Errorf("a later function ran after %d of the batch's %d dones", dones, len(lbas))
				}
				laters++
			})
		}) {
			t.Fatalf("block %d not started", lba)
		}
	}
	cache.mu.Lock()
	held := cache.held
	cache.held = nil
	cache.mu.Unlock()
	if len(held) != len(lbas) {
		t.Fatalf("%d reads held", len(held))
	}
	device.WithLater(func(later func(func())) {
		for _, run := range held {
			run(later)
		}
	})
	if laters != len(lbas) {
		t.Fatalf("%d later functions ran, want %d", laters, len(lbas))
	}
	for i, lba := range lbas {
		if string(ps[i]) != string(want[lba*blockSize:(lba+1)*blockSize]) {
			t.Errorf("block %d: wrong data", lba)
		}
	}
}

// TestStartReadAtDetachWaiting: while a started read keeps the volume
// entered and a Detach waits for it, StartReadAt declines (false) instead
// of waiting behind the detach: the NBD reader, holding a plug over the
// reads it started, must never wait for what only those reads can end.
// The detach then completes once the held reads are delivered.
func TestStartReadAtDetachWaiting(t *testing.T) {
	_, v, cache, _ := newAsyncSet(t, 64)
	cache.mu.Lock()
	cache.hold = true
	cache.mu.Unlock()
	var wg sync.WaitGroup
	start := func(p []byte) bool {
		wg.Add(1)
		if v.StartReadAt(p, 8*blockSize, func(error, func(func())) { wg.Done() }) {
			return true
		}
		wg.Done()
		return false
	}
	if !start(make([]byte, blockSize)) {
		t.Fatal("the first hit was not started")
	}
	detached := make(chan error, 1)
	go func() { detached <- v.Detach(context.Background(), DetachOptions{}) }()
	// Start hits until one is declined: the detach then waits for the
	// gate. Had StartReadAt waited for the gate, this would never end.
	declined := make(chan struct{})
	go func() {
		defer close(declined)
		for start(make([]byte, blockSize)) {
			runtime.Gosched()
		}
	}()
	select {
	case <-declined:
	case err := <-detached:
		t.Fatalf("Detach returned (%v) with a started read outstanding", err)
	case <-time.After(time.Minute):
		t.Fatal("StartReadAt waited behind a waiting Detach")
	}
	if v.gate.TryRLock() {
		v.gate.RUnlock()
		t.Fatal("StartReadAt declined, but no detach waits for the gate")
	}
	cache.mu.Lock()
	held := cache.held
	cache.held = nil
	cache.hold = false
	cache.mu.Unlock()
	device.WithLater(func(later func(func())) {
		for _, run := range held {
			run(later)
		}
	})
	wg.Wait()
	if err := <-detached; err != nil {
		t.Fatal(err)
	}
}

// TestReadHitAt: ReadHitAt serves the reads StartReadAt starts, on the
// caller's goroutine with the device's synchronous ReadAt (nothing is
// started), counted as hits; it refuses the others, changing no counter.
// Its end is readBlocksHit's: a corrupt clean block is re-read from the
// backing device and dropped, a corrupt dirty one fails with ErrChecksum,
// a failed device read is served around the cache, and a dirty block that
// cannot be read fails with ErrDirtyUnreachable. Set.Check (checkAfter)
// finds no pin left.
func TestReadHitAt(t *testing.T) {
	s, v, cache, want := newAsyncSet(t, 64)
	for _, c := range []struct {
		off, n int64
		serve  bool
	}{
		{8 * blockSize, 4 * blockSize, true},
		{9 * blockSize, blockSize, true},
		{16 * blockSize, 4 * blockSize, true},
		{0, blockSize, false},                  // miss
		{7 * blockSize, 2 * blockSize, false},  // partial
		{11 * blockSize, 6 * blockSize, false}, // two runs with a gap
		{9*blockSize + 512, blockSize, false},  // unaligned
		{8 * blockSize, maxAsyncHit + blockSize, false},
	} {
		before := v.Stats()
		p := make([]byte, c.n)
		served, err := v.ReadHitAt(p, c.off)
		if served != c.serve {
			t.Fatalf("%d at %d: served %v", c.n, c.off, served)
		}
		after := v.Stats()
		if !served {
			if err != nil || after.ReadOps != before.ReadOps || after.ReadHitOps != before.ReadHitOps {
				t.Fatalf("%d at %d: not served, but %v or counted", c.n, c.off, err)
			}
			continue
		}
		if err != nil || string(p) != string(want[c.off:c.off+c.n]) {
			t.Fatalf("%d at %d: %v or wrong data", c.n, c.off, err)
		}
		if after.ReadOps != before.ReadOps+1 || after.ReadHitOps != before.ReadHitOps+1 ||
			after.ReadHitBytes != before.ReadHitBytes+uint64(c.n) {
			t.Fatalf("%d at %d: counters %+v -> %+v", c.n, c.off, before, after)
		}
	}
	cache.mu.Lock()
	started := cache.started
	cache.mu.Unlock()
	if started != 0 {
		t.Fatalf("%d device reads started asynchronously", started)
	}

	corrupt := func(lba uint64) {
		e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
		if !ok {
			t.Fatalf("lba %d not cached", lba)
		}
		if err := cache.Corrupt(s.cacheOff(e.Block())+7, 1); err != nil {
			t.Fatal(err)
		}
	}
	corrupt(9)
	p := make([]byte, 4*blockSize)
	if served, err := v.ReadHitAt(p, 8*blockSize); !served || err != nil || string(p) != string(want[8*blockSize:12*blockSize]) {
		t.Fatalf("corrupt clean block: served %v, %v or wrong data", served, err)
	}
	if st := v.Stats(); st.ChecksumErrors != 1 || st.ChecksumRepairs != 1 {
		t.Fatalf("stats %+v", st)
	}
	if _, ok := v.idx.Tree.Get(index.Ent{LBA: 9}); ok {
		t.Fatal("the corrupt clean copy is still indexed")
	}
	corrupt(18)
	if served, err := v.ReadHitAt(p, 16*blockSize); !served || !errors.Is(err, ErrChecksum) {
		t.Fatalf("corrupt dirty block: served %v, %v", served, err)
	}

	cache.mu.Lock()
	cache.fail = func(int64) bool { return true }
	cache.failSync = true
	cache.mu.Unlock()
	p = make([]byte, 2*blockSize)
	if served, err := v.ReadHitAt(p, 10*blockSize); !served || err != nil || string(p) != string(want[10*blockSize:12*blockSize]) {
		t.Fatalf("failed read of clean blocks: served %v, %v or wrong data", served, err)
	}
	if served, err := v.ReadHitAt(make([]byte, blockSize), 16*blockSize); !served || !errors.Is(err, ErrDirtyUnreachable) {
		t.Fatalf("unreadable dirty block: served %v, %v", served, err)
	}
}
