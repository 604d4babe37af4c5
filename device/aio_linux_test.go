package device

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"unsafe"
	"weak"
)

// TestAIOConcurrent drives a direct File's AIO path from more goroutines
// than it has slots: each writes blocks stamped with (goroutine, round) to
// its own offsets and reads them back, so a completion delivered to the
// wrong request, or a buffer reused before its completion, shows as a
// wrong stamp. After Close the reaper is gone. It runs with completions
// taken from the mapped ring (what this kernel offers; its absence fails
// the test) and through io_getevents (the path for a ring of another
// layout).
func TestAIOConcurrent(t *testing.T) {
	t.Run("ring", func(t *testing.T) { testAIOConcurrent(t, true) })
	t.Run("io_getevents", func(t *testing.T) { testAIOConcurrent(t, false) })
}

func testAIOConcurrent(t *testing.T, ring bool) {
	const (
		workers = aioDepth + 64
		rounds  = 20
		bs      = 4096
	)
	path := filepath.Join(t.TempDir(), "aio.img")
	if err := CreateSparse(path, workers*4*bs); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, FileOptions{Direct: DirectAuto})
	if err != nil {
		t.Fatal(err)
	}
	if !f.Direct() {
		f.Close()
		t.Skipf("%s: no O_DIRECT on this file system; the AIO path is not used", path)
	}
	if f.aio == nil {
		f.Close()
		t.Fatal("direct File without AIO (io_setup failed)")
	}
	if f.aio.ring == nil {
		f.Close()
		t.Fatal("the AIO context's completion ring has a layout userspace reaping does not know")
	}
	if !ring {
		f.aio.ring = nil // before any request: the reaper uses io_getevents
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wbuf := alignedBuf(2 * bs)
			rbuf := alignedBuf(2 * bs)
			for r := range rounds {
				// Alternate one- and two-block requests at the worker's
				// own offsets.
				n := bs * (1 + r%2)
				off := int64(w) * 4 * bs
				for i := 0; i < n; i += 8 {
					binary.LittleEndian.PutUint32(wbuf[i:], uint32(w))
					binary.LittleEndian.PutUint32(wbuf[i+4:], uint32(r))
				}
				if _, err := f.WriteAt(wbuf[:n], off); err != nil {
					errs <- err
					return
				}
				if _, err := f.ReadAt(rbuf[:n], off); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(rbuf[:n], wbuf[:n]) {
					t.Errorf("worker %d round %d: read back %x..., wrote %x...", w, r, rbuf[:8], wbuf[:8])
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	a := f.aio
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	// Close waited for the reaper (aio.close).
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.reaping || a.inflight != 0 || a.submitting || len(a.pending) != 0 {
		t.Errorf("after Close: reaping %t, inflight %d, submitting %t, pending %d", a.reaping, a.inflight, a.submitting, len(a.pending))
	}
	if len(a.slots) != aioDepth {
		t.Errorf("after Close: %d of %d slots free", len(a.slots), aioDepth)
	}
}

// alignedBuf returns n bytes aligned to the page size.
func alignedBuf(n int) []byte {
	b := make([]byte, n+int(pageSize))
	off := 0
	for ; !isPageAligned(b[off:]); off++ {
	}
	return b[off : off+n]
}

func isPageAligned(b []byte) bool {
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))%uintptr(pageSize) == 0
}

// TestAIOLayout checks the structs against linux/aio_abi.h.
func TestAIOLayout(t *testing.T) {
	var cb iocb
	var ev ioEvent
	if unsafe.Sizeof(cb) != 64 || unsafe.Offsetof(cb.opcode) != 16 || unsafe.Offsetof(cb.fildes) != 20 ||
		unsafe.Offsetof(cb.buf) != 24 || unsafe.Offsetof(cb.nbytes) != 32 || unsafe.Offsetof(cb.offset) != 40 {
		t.Errorf("struct iocb: size %d, offsets opcode %d fildes %d buf %d nbytes %d offset %d; want 64, 16 20 24 32 40",
			unsafe.Sizeof(cb), unsafe.Offsetof(cb.opcode), unsafe.Offsetof(cb.fildes), unsafe.Offsetof(cb.buf), unsafe.Offsetof(cb.nbytes), unsafe.Offsetof(cb.offset))
	}
	if unsafe.Sizeof(ev) != 32 || unsafe.Offsetof(ev.res) != 16 {
		t.Errorf("struct io_event: size %d, res at %d; want 32, 16", unsafe.Sizeof(ev), unsafe.Offsetof(ev.res))
	}
	var r aioRing
	if unsafe.Sizeof(r) != 32 || unsafe.Offsetof(r.head) != 8 || unsafe.Offsetof(r.tail) != 12 || unsafe.Offsetof(r.magic) != 16 || unsafe.Offsetof(r.headerLen) != 28 {
		t.Errorf("struct aio_ring: size %d, head at %d, tail at %d, magic at %d, header_length at %d; want 32, 8 12 16 28",
			unsafe.Sizeof(r), unsafe.Offsetof(r.head), unsafe.Offsetof(r.tail), unsafe.Offsetof(r.magic), unsafe.Offsetof(r.headerLen))
	}
}

// TestAIOStackBuffer reads and writes through the AIO path from buffers
// declared on the caller's stack while the garbage collector runs without
// pause (it shrinks the stacks of waiting goroutines, moving them) and
// other goroutines grow their stacks: the kernel must see the buffer where
// it stays. Before buffers were pinned, such a buffer could stay on the
// stack, and a completion landed in memory the stack had left.
func TestAIOStackBuffer(t *testing.T) {
	const bs = 4096
	path := filepath.Join(t.TempDir(), "aio.img")
	if err := CreateSparse(path, 64*bs); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, FileOptions{Direct: DirectAuto})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !f.Direct() || f.aio == nil {
		t.Skipf("%s: no O_DIRECT or no AIO here; the path is not used", path)
	}
	stop := make(chan struct{})
	var gcs sync.WaitGroup
	gcs.Add(1)
	go func() {
		defer gcs.Done()
		for {
			select {
			case <-stop:
				return
			default:
				runtime.GC()
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range 50 {
				deep(200) // a big stack, given back: shrinkable while waiting
				if msg := stackRoundTrip(f, int64(w)*4*bs, byte(w*50+r)); msg != "" {
					t.Error(msg)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	gcs.Wait()
}

// stackRoundTrip writes a block stamped with v from a stack buffer and
// reads it back into another; it returns what went wrong, or "".
func stackRoundTrip(f *File, off int64, v byte) string {
	var wa, ra [2 * 4096]byte
	wb, rb := alignedIn(wa[:]), alignedIn(ra[:])
	for i := range wb {
		wb[i] = v
	}
	if _, err := f.WriteAt(wb, off); err != nil {
		return err.Error()
	}
	if _, err := f.ReadAt(rb, off); err != nil {
		return err.Error()
	}
	for i := range rb {
		if rb[i] != v {
			got := rb[i] // a copy: the buffers must not escape here
			return fmt.Sprintf("at %d: byte %d read back %#x, wrote %#x", off, i, got, v)
		}
	}
	return ""
}

// alignedIn returns the page-aligned 4096 bytes inside b (8 KiB).
func alignedIn(b []byte) []byte {
	off := 0
	for ; !isPageAligned(b[off:]); off++ {
	}
	return b[off : off+4096]
}

//go:noinline
func deep(n int) byte {
	var pad [512]byte
	pad[n%512] = byte(n)
	if n == 0 {
		return pad[0]
	}
	return deep(n-1) + pad[n%512]
}

// TestAIOMergedWrites: goroutines that write neighbouring blocks at once,
// as a cache's writers appending to one bucket do, have their writes
// submitted as vectored runs (invariant 7), and every block reads back
// as its own writer's last round wrote it: a share of a run's result
// given to the wrong member, or an iovec naming the wrong buffer, shows
// as a wrong stamp.
func TestAIOMergedWrites(t *testing.T) {
	const (
		workers = 128
		rounds  = 40
		bs      = 4096
	)
	path := filepath.Join(t.TempDir(), "aio.img")
	if err := CreateSparse(path, workers*bs); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, FileOptions{Direct: DirectAuto})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !f.Direct() {
		t.Skipf("%s: no O_DIRECT on this file system; the AIO path is not used", path)
	}
	if f.aio == nil {
		t.Fatal("direct File without AIO (io_setup failed)")
	}
	stamp := func(b []byte, w, r int) {
		for i := 0; i < len(b); i += 8 {
			binary.LittleEndian.PutUint32(b[i:], uint32(w))
			binary.LittleEndian.PutUint32(b[i+4:], uint32(r))
		}
	}
	for r := range rounds {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := alignedBuf(bs)
				stamp(b, w, r)
				if _, err := f.WriteAt(b, int64(w)*bs); err != nil {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
	}
	got := alignedBuf(workers * bs)
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, bs)
	for w := range workers {
		stamp(want, w, rounds-1)
		if !bytes.Equal(got[w*bs:(w+1)*bs], want) {
			t.Errorf("block %d: %x..., want %x...", w, got[w*bs:w*bs+8], want[:8])
		}
	}
	f.aio.mu.Lock()
	followers := f.aio.followers
	f.aio.mu.Unlock()
	t.Logf("%d of %d writes went as followers of a vectored run", followers, workers*rounds)
	if followers == 0 {
		t.Errorf("no write of %d concurrent neighbouring writes was merged", workers*rounds)
	}
}

// TestAIOKeepsNoBuffer: once a write has returned, nothing of the AIO
// context (its slots, the submitter's iovecs) keeps the caller's buffer
// reachable. A slot that held the first byte of its last buffer kept up
// to 256 buffers alive after their connections were gone, so the server's
// memory never went back to the OS (TestHostileClientsMemory: 72 MiB
// after the load, against 16 MiB before the writes were merged).
func TestAIOKeepsNoBuffer(t *testing.T) {
	const (
		workers = 64
		bs      = 4096
	)
	path := filepath.Join(t.TempDir(), "aio.img")
	if err := CreateSparse(path, workers*bs); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, FileOptions{Direct: DirectAuto})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !f.Direct() {
		t.Skipf("%s: no O_DIRECT on this file system; the AIO path is not used", path)
	}
	if f.aio == nil {
		t.Fatal("direct File without AIO (io_setup failed)")
	}
	// Concurrent neighbouring writes, so that runs are merged too.
	gone := make([]weak.Pointer[byte], workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := alignedBuf(bs)
			gone[w] = weak.Make(&b[0])
			if _, err := f.WriteAt(b, int64(w)*bs); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	runtime.GC()
	runtime.GC()
	kept := 0
	for _, p := range gone {
		if p.Value() != nil {
			kept++
		}
	}
	if kept > 0 {
		t.Errorf("%d of %d buffers still reachable after their writes returned", kept, workers)
	}
}

// TestAIODeliverShares: a run's result is shared out in offset order: all
// of it, a short one (the member it stops in gets its part, later members
// nothing, and their callers finish synchronously), an error and a
// refusal (every member's own).
func TestAIODeliverShares(t *testing.T) {
	mk := func(n uint64) *aioReq {
		return &aioReq{cb: iocb{nbytes: n}, done: make(chan struct{}, 1)}
	}
	for _, c := range []struct {
		res  int64
		want []int64
	}{
		{4096 + 8192 + 4096, []int64{4096, 8192, 4096}},
		{4096 + 4096, []int64{4096, 4096, 0}},
		{0, []int64{0, 0, 0}},
		{-5, []int64{-5, -5, -5}},
		{aioFallback, []int64{aioFallback, aioFallback, aioFallback}},
	} {
		head, f1, f2 := mk(4096), mk(8192), mk(4096)
		head.merged = append(head.merged, f1, f2)
		if n := (&aio{}).deliver(head, c.res); n != 3 {
			t.Errorf("res %d: deliver returned %d, want 3", c.res, n)
		}
		for i, m := range []*aioReq{head, f1, f2} {
			select {
			case <-m.done:
			default:
				t.Errorf("res %d: member %d not delivered", c.res, i)
			}
			if m.res != c.want[i] {
				t.Errorf("res %d: member %d got %d, want %d", c.res, i, m.res, c.want[i])
			}
		}
		if len(head.merged) != 0 {
			t.Errorf("res %d: head still lists %d followers", c.res, len(head.merged))
		}
	}
}
