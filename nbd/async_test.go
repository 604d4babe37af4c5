package nbd

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

// asyncBackend is a memBackend that also starts reads asynchronously
// (AsyncReader), each completed on a goroutine of its own, except those
// at offsets refuse reports (started false: the worker path) and, while
// holding, those it keeps until release.
type asyncBackend struct {
	*memBackend
	refuse  func(off int64) bool
	started atomic.Int64

	mu      sync.Mutex
	holding bool
	held    []func(later func(func())) // done with the read's result
	onHold  chan struct{}              // if set, receives a token per read held
}

func (a *asyncBackend) StartReadAt(p []byte, off int64, done func(error, func(func()))) bool {
	if a.refuse != nil && a.refuse(off) {
		return false
	}
	a.started.Add(1)
	run := func() { runBatch(func(later func(func())) { done(a.memBackend.ReadAt(p, off), later) }) }
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.holding {
		a.held = append(a.held, func(later func(func())) { done(a.memBackend.ReadAt(p, off), later) })
		if a.onHold != nil {
			a.onHold <- struct{}{}
		}
		return true
	}
	go run()
	return true
}

// runBatch delivers completions as a device's batch: call calls their
// dones, and what those leave to later runs after it returns.
func runBatch(call func(later func(func()))) (laters int) {
	var fs []func()
	call(func(f func()) { fs = append(fs, f) })
	for _, f := range fs {
		f()
	}
	return len(fs)
}

// TestAsyncReads: READs the backend starts itself are answered with the
// right data, as are those it refuses (done by a worker), concurrently
// with writes; a 4 MiB reply, more than the socket takes at once, is
// finished by a writer goroutine after the non-blocking write.
func TestAsyncReads(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		mem := newMem(8 << 20)
		rng := rand.New(rand.NewPCG(5, 6))
		for i := range mem.data {
			mem.data[i] = byte(rng.Uint32())
		}
		want := append([]byte(nil), mem.data...)
		ab := &asyncBackend{memBackend: mem, refuse: func(off int64) bool { return off%(3<<12) == 0 }}
		ts := startServer(t, Config{}, Export{Name: "d", Backend: ab})
		c := ts.dial(t, "d", opts)
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got := make([]byte, 64<<10)
				for i := range 50 {
					n := 4096 * (1 + (g*7+i)%16)
					off := int64(g)<<20 + int64(i*4096)
					if err := c.ReadAt(got[:n], off); err != nil {
						t.Error(err)
						return
					}
					if !bytes.Equal(got[:n], want[off:off+int64(n)]) {
						t.Errorf("g%d i%d: %d at %d: wrong data", g, i, n, off)
						return
					}
				}
			}()
		}
		big := make([]byte, 4<<20)
		if err := c.ReadAt(big, 4096); err != nil || !bytes.Equal(big, want[4096:4096+len(big)]) {
			t.Fatalf("4 MiB read: %v or wrong data", err)
		}
		wg.Wait()
		if ab.started.Load() == 0 {
			t.Fatal("no read was started asynchronously")
		}
	})
}

// TestAsyncReadErrors: a started read that fails is answered with the
// error's errno; the connection goes on.
func TestAsyncReadErrors(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		mem := newMem(1 << 20)
		mem.readHook = func(off int64, n int) error {
			if off == 0 {
				return fmt.Errorf("disk on fire: %w", syscall.EIO)
			}
			return nil
		}
		ab := &asyncBackend{memBackend: mem}
		ts := startServer(t, Config{}, Export{Name: "d", Backend: ab})
		c := ts.dial(t, "d", opts)
		buf := make([]byte, 4096)
		wantErrno(t, "read", c.ReadAt(buf, 0), EIO)
		if err := c.ReadAt(buf, 4096); err != nil {
			t.Fatal(err)
		}
		if ab.started.Load() != 2 {
			t.Fatalf("%d reads started, want 2", ab.started.Load())
		}
	})
}

// TestAsyncReadBeforeDisc: a client sends READs and DISC at once; the
// server answers the READs and flushes only after they are complete (the
// reader waits for started reads as for workers). The four completions,
// delivered as one batch, leave one reply flush for after the batch.
func TestAsyncReadBeforeDisc(t *testing.T) {
	mem := newMem(1 << 20)
	ab := &asyncBackend{memBackend: mem, holding: true, onHold: make(chan struct{}, 4)}
	var completed atomic.Int64
	// DISC's flush reports; the shutdown's, after the test, does not
	// block (nor does DISC's if the test failed before reading it).
	flushedEarly := make(chan bool, 1)
	mem.flushHook = func() {
		select {
		case flushedEarly <- completed.Load() != 4:
		default:
		}
	}
	ts := startServer(t, Config{}, Export{Name: "d", Backend: ab})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	for i := range 4 {
		r.request(requestHeader{Type: cmdRead, Handle: uint64(i), Offset: uint64(i) * 4096, Length: 4096}, nil)
	}
	r.request(requestHeader{Type: cmdDisc}, nil)
	// The reader starts all four before it reads DISC; complete them.
	for range 4 {
		<-ab.onHold
	}
	ab.mu.Lock()
	held := ab.held
	ab.held = nil
	ab.mu.Unlock()
	// One batch: the four replies wait for one flush, after the last.
	laters := runBatch(func(later func(func())) {
		for _, f := range held {
			completed.Add(1) // before: the server may flush as soon as its reply is written
			f(later)
		}
	})
	if laters != 1 {
		t.Fatalf("a batch of 4 completions left %d flushes, want 1", laters)
	}
	for range 4 {
		errno, _ := r.simpleReply()
		if errno != 0 {
			t.Fatalf("errno %d", errno)
		}
		r.read(make([]byte, 4096))
	}
	if <-flushedEarly {
		t.Fatal("DISC's flush ran before the started reads completed")
	}
}

// hitBackend is an asyncBackend that also serves reads while the caller
// waits (HitReader), except those at offsets refuseHit reports; its
// served receives a token per read it serves.
type hitBackend struct {
	*asyncBackend
	refuseHit func(off int64) bool
	served    chan struct{}
}

func (h *hitBackend) ReadHitAt(p []byte, off int64) (bool, error) {
	if h.refuseHit(off) {
		return false, nil
	}
	h.served <- struct{}{}
	return true, h.memBackend.ReadAt(p, off)
}

// TestReadNow: a READ that arrives alone, with nothing in flight, is
// served by the backend's ReadHitAt on the reader (no read started), and a
// failing one is answered with its errno; a READ ReadHitAt refuses is
// started instead, and so are READs that arrive together (buffered, or
// with others in flight).
func TestReadNow(t *testing.T) {
	mem := newMem(1 << 20)
	rng := rand.New(rand.NewPCG(7, 8))
	for i := range mem.data {
		mem.data[i] = byte(rng.Uint32())
	}
	mem.readHook = func(off int64, n int) error {
		if off == 2*4096 {
			return fmt.Errorf("disk on fire: %w", syscall.EIO)
		}
		return nil
	}
	ab := &asyncBackend{memBackend: mem}
	hb := &hitBackend{asyncBackend: ab, refuseHit: func(off int64) bool { return off == 5*4096 }, served: make(chan struct{}, 16)}
	ts := startServer(t, Config{}, Export{Name: "d", Backend: hb})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	got := make([]byte, 4096)
	for i := range 6 {
		off := uint64(i) * 4096
		r.request(requestHeader{Type: cmdRead, Handle: uint64(i), Offset: off, Length: 4096}, nil)
		errno, handle := r.simpleReply()
		if handle != uint64(i) {
			t.Fatalf("read %d: reply for handle %d", i, handle)
		}
		if i == 2 {
			if errno != EIO {
				t.Fatalf("failing read: errno %d, want EIO", errno)
			}
			continue
		}
		if errno != 0 {
			t.Fatalf("read %d: errno %d", i, errno)
		}
		r.read(got)
		if !bytes.Equal(got, mem.data[off:off+4096]) {
			t.Fatalf("read %d: wrong data", i)
		}
	}
	if h, s := len(hb.served), ab.started.Load(); h != 5 || s != 1 {
		t.Fatalf("lone reads: %d served by ReadHitAt (want 5), %d started (want the refused one)", h, s)
	}
	for range 5 {
		<-hb.served
	}

	// Four READs in one write: the first three find more in the buffer,
	// the last finds the others in flight (their completions held).
	ab.mu.Lock()
	ab.holding, ab.onHold = true, make(chan struct{}, 4)
	ab.mu.Unlock()
	var burst []byte
	for i := range 4 {
		var b [requestHeaderSize]byte
		encodeRequest(b[:], requestHeader{Type: cmdRead, Handle: uint64(10 + i), Offset: uint64(8+i) * 4096, Length: 4096})
		burst = append(burst, b[:]...)
	}
	r.write(burst)
	for range 4 {
		select {
		case <-ab.onHold:
		case <-hb.served:
			t.Fatal("a read of the burst was served by ReadHitAt")
		}
	}
	ab.mu.Lock()
	held := ab.held
	ab.held, ab.holding = nil, false
	ab.mu.Unlock()
	runBatch(func(later func(func())) {
		for _, f := range held {
			f(later)
		}
	})
	for range 4 {
		errno, handle := r.simpleReply()
		if errno != 0 || handle < 10 || handle > 13 {
			t.Fatalf("burst: errno %d, handle %d", errno, handle)
		}
		off := (handle - 2) * 4096
		r.read(got)
		if !bytes.Equal(got, mem.data[off:off+4096]) {
			t.Fatalf("burst read %d: wrong data", handle)
		}
	}
}
