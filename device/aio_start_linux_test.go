package device

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

// openDirectAIO opens a direct File with AIO over a new file of size bytes
// stamped with stamp, or skips where the file system has no O_DIRECT.
func openDirectAIO(t *testing.T, size int) (*File, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "start.img")
	data := make([]byte, size)
	for i := range data {
		data[i] = stamp(i)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
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
	return f, path
}

func stamp(i int) byte { return byte(i/4096*7 + i%251) }

func checkStamp(p []byte, off int64) bool {
	for i, b := range p {
		if b != stamp(int(off)+i) {
			return false
		}
	}
	return true
}

// TestStartReadAt starts more reads than the File has AIO slots, from one
// goroutine without waiting: those StartReadAt refuses (every slot taken)
// report false and are done with ReadAt, the others complete through done
// exactly once with the right bytes. What each done leaves to later runs
// once, after it, and after the other completions of its batch: some run
// after two or more dones in a row (hundreds of reads complete in passes
// of up to 64). Requests the direct path does not take (unaligned, empty,
// out of range) are refused without calling done.
func TestStartReadAt(t *testing.T) {
	const bs, n = 4096, 2 * aioDepth
	f, _ := openDirectAIO(t, n*bs)
	defer f.Close()
	var wg sync.WaitGroup
	var calls, laters [n]atomic.Int32
	var bad atomic.Int32
	// On the reaper only: dones since the last later function ran, and
	// the most a later function saw.
	var run, maxRun int
	started := 0
	for i := range n {
		p := alignedBuf(bs)
		off := int64((i * 37 % n) * bs)
		wg.Add(1)
		ok := f.StartReadAt(p, off, func(got int, err error, later func(func())) {
			calls[i].Add(1)
			run++
			if got != bs || err != nil || !checkStamp(p, off) {
				bad.Add(1)
			}
			later(func() {
				defer wg.Done()
				if laters[i].Add(1) != 1 || calls[i].Load() != 1 {
					bad.Add(1)
				}
				maxRun = max(maxRun, run)
				run = 0
			})
		})
		if ok {
			started++
			continue
		}
		wg.Done()
		if _, err := f.ReadAt(p, off); err != nil || !checkStamp(p, off) {
			t.Fatalf("ReadAt after a refused start: %v", err)
		}
	}
	wg.Wait()
	if started == 0 {
		t.Fatal("no read started")
	}
	for i := range calls {
		if c := calls[i].Load(); c > 1 {
			t.Fatalf("read %d: done called %d times", i, c)
		}
	}
	if bad.Load() != 0 {
		t.Fatalf("%d reads completed with wrong data or an error, or their later function ran twice or before done", bad.Load())
	}
	if maxRun < 2 {
		t.Errorf("every later function ran right after one done: no batch of completions shared one")
	}
	never := func(int, error, func(func())) { t.Error("done called for a refused start") }
	for _, c := range []struct {
		name string
		p    []byte
		off  int64
	}{
		{"unaligned offset", alignedBuf(bs), 512},
		{"unaligned length", alignedBuf(bs)[:bs-512], 0},
		{"unaligned buffer", alignedBuf(2 * bs)[1 : bs+1], 0},
		{"empty", nil, 0},
		{"past the end", alignedBuf(bs), n * bs},
	} {
		if f.StartReadAt(c.p, c.off, never) {
			t.Errorf("%s: started", c.name)
		}
	}
}

// TestStartReadAtShort reads across the end of a file truncated under the
// open File: the kernel's short completion is finished with pread, which
// reports io.EOF and the bytes that were there, as ReadAt does.
func TestStartReadAtShort(t *testing.T) {
	const bs = 4096
	f, path := openDirectAIO(t, 4*bs)
	defer f.Close()
	if err := os.Truncate(path, 2*bs+bs/2); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{2 * bs, 3 * bs} {
		p := alignedBuf(bs)
		res := make(chan error, 1)
		var got int
		if !f.StartReadAt(p, off, func(n int, err error, _ func(func())) { got = n; res <- err }) {
			t.Fatal("not started")
		}
		err := <-res
		wantN, wantErr := f.ReadAt(alignedBuf(bs), off)
		if !errors.Is(err, io.EOF) || got != wantN || !errors.Is(wantErr, io.EOF) {
			t.Fatalf("off %d: StartReadAt %d, %v; ReadAt %d, %v", off, got, err, wantN, wantErr)
		}
		if !checkStamp(p[:got], off) {
			t.Fatalf("off %d: wrong bytes before the end", off)
		}
	}
}

// TestStartReadAtErrors covers the results other than a whole read: a
// kernel error is an *IOError wrapping the errno; a request io_submit
// refuses (here: a bad descriptor) is finished with pread, whose error
// done reports.
func TestStartReadAtErrors(t *testing.T) {
	const bs = 4096
	f, _ := openDirectAIO(t, 4*bs)
	defer f.Close()
	p := alignedBuf(bs)
	f.mu.RLock() // what StartReadAt holds for finishRead to release
	var err error
	f.finishRead(f.fd, p, 0, -int64(syscall.EIO), func(func()) {}, func(_ int, e error, _ func(func())) { err = e })
	var ioe *IOError
	if !errors.As(err, &ioe) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("kernel error: %v", err)
	}
	res := make(chan error, 1)
	f.mu.RLock()
	if !f.aio.start(iocbCmdPread, -1, p, 0, func(r int64, later func(func())) {
		f.finishRead(-1, p, 0, r, later, func(_ int, e error, later func(func())) { later(func() { res <- e }) })
	}) {
		t.Fatal("not started")
	}
	if err := <-res; !errors.Is(err, syscall.EBADF) {
		t.Fatalf("refused request: %v", err)
	}
	// The File still works, and Close is not held up by either.
	if _, err := f.ReadAt(p, bs); err != nil || !checkStamp(p, bs) {
		t.Fatal(err)
	}
}

// TestStartReadAtClose closes the File with reads in flight: Close waits
// for every started read's done, and after it StartReadAt refuses.
func TestStartReadAtClose(t *testing.T) {
	const bs, n = 4096, aioDepth / 2
	f, _ := openDirectAIO(t, n*bs)
	var completed atomic.Int32
	started := int32(0)
	for i := range n {
		p := alignedBuf(bs)
		if f.StartReadAt(p, int64(i*bs), func(got int, err error, _ func(func())) {
			if got != bs || err != nil {
				t.Errorf("read %d: %d, %v", i, got, err)
			}
			completed.Add(1)
		}) {
			started++
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if c := completed.Load(); c != started {
		t.Fatalf("Close returned with %d of %d started reads done", c, started)
	}
	if f.StartReadAt(alignedBuf(bs), 0, func(int, error, func(func())) { t.Error("done after Close") }) {
		t.Fatal("started on a closed File")
	}
}

// TestPlug: reads StartReadAt starts under a Plug are queued, not
// submitted, until the last Unplug (nested plugs hold them until the outer
// one ends); they then complete with the right bytes. A plug holds at most
// aioPlugMax-1 reads: the next one submits them all. A synchronous read
// under a plug goes to the kernel at once, with the reads held.
func TestPlug(t *testing.T) {
	const bs = 4096
	f, _ := openDirectAIO(t, 2*aioPlugMax*bs)
	defer f.Close()
	a := f.aio
	pending := func() int {
		a.mu.Lock()
		defer a.mu.Unlock()
		return len(a.pending)
	}
	var wg sync.WaitGroup
	var bad atomic.Int32
	start := func(i int) {
		t.Helper()
		p := alignedBuf(bs)
		off := int64(i * bs)
		wg.Add(1)
		if !f.StartReadAt(p, off, func(got int, err error, _ func(func())) {
			if got != bs || err != nil || !checkStamp(p, off) {
				bad.Add(1)
			}
			wg.Done()
		}) {
			t.Fatalf("read %d not started", i)
		}
	}
	f.Plug()
	f.Plug()
	for i := range 4 {
		start(i)
	}
	if n := pending(); n != 4 {
		t.Fatalf("plugged: %d reads pending, want the 4 started", n)
	}
	f.Unplug()
	if n := pending(); n != 4 {
		t.Fatalf("inner Unplug: %d reads pending, want 4 (the outer plug holds them)", n)
	}
	f.Unplug()
	wg.Wait()
	if n := pending(); n != 0 {
		t.Fatalf("after the last Unplug: %d reads pending", n)
	}

	f.Plug()
	for i := range aioPlugMax - 1 {
		start(i)
	}
	if n := pending(); n != aioPlugMax-1 {
		t.Fatalf("%d reads pending, want %d", n, aioPlugMax-1)
	}
	start(aioPlugMax)
	if n := pending(); n != 0 {
		t.Fatalf("the %dth read held: %d pending, want all submitted", aioPlugMax, n)
	}
	start(aioPlugMax + 1)
	p := alignedBuf(bs)
	if _, err := f.ReadAt(p, 3*bs); err != nil || !checkStamp(p, 3*bs) {
		t.Fatalf("synchronous read under a plug: %v", err)
	}
	if n := pending(); n != 0 {
		t.Fatalf("after a synchronous read: %d pending, want the held read submitted with it", n)
	}
	f.Unplug()
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d reads completed wrong", bad.Load())
	}
}

// TestReadIdlePread: a direct ReadAt on a File with nothing else in
// flight is one pread (invariant 9), not an AIO request; one that finds a
// plug holding a read back goes through AIO and submits it too. Both read
// the right bytes.
func TestReadIdlePread(t *testing.T) {
	const bs = 4096
	f, _ := openDirectAIO(t, 8*bs)
	defer f.Close()
	a := f.aio
	counts := func() (preads uint64, pending int) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.preads, len(a.pending)
	}
	p := alignedBuf(2 * bs)
	if n, err := f.ReadAt(p, bs); n != len(p) || err != nil || !checkStamp(p, bs) {
		t.Fatalf("idle read: %d, %v or wrong data", n, err)
	}
	if preads, _ := counts(); preads != 1 {
		t.Fatalf("idle read: %d preads, want 1", preads)
	}

	f.Plug()
	q := alignedBuf(bs)
	done := make(chan error, 1)
	if !f.StartReadAt(q, 5*bs, func(n int, err error, _ func(func())) {
		if err == nil && (n != bs || !checkStamp(q, 5*bs)) {
			err = errors.New("wrong data")
		}
		done <- err
	}) {
		t.Fatal("read not started")
	}
	if n, err := f.ReadAt(p, 2*bs); n != len(p) || err != nil || !checkStamp(p, 2*bs) {
		t.Fatalf("read under a plug: %d, %v or wrong data", n, err)
	}
	if preads, pending := counts(); preads != 1 || pending != 0 {
		t.Fatalf("read under a plug: %d preads (want 1), %d pending (want 0)", preads, pending)
	}
	if err := <-done; err != nil {
		t.Fatalf("held read: %v", err)
	}
	f.Unplug()
}
