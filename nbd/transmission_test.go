package nbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func wantErrno(t *testing.T, what string, err error, errno uint32) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) || e.Errno != errno {
		t.Errorf("%s: got %v, want %s", what, err, errnoString(errno))
	}
}

func bothModes(t *testing.T, f func(t *testing.T, opts ClientOptions)) {
	t.Run("simple", func(t *testing.T) { f(t, ClientOptions{}) })
	t.Run("structured", func(t *testing.T) { f(t, ClientOptions{StructuredReplies: true}) })
}

func TestReadWriteRoundTrip(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		mem := newMem(8 << 20)
		ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
		c := ts.dial(t, "d", opts)
		if c.StructuredReplies() != opts.StructuredReplies {
			t.Fatalf("structured = %v", c.StructuredReplies())
		}
		rng := rand.New(rand.NewPCG(1, 2))
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 64<<10)
				got := make([]byte, 64<<10)
				for i := range 20 {
					n := 1 + (g*977+i*131)%len(buf)
					off := int64(g)*(1<<20) + int64(i*4096)
					for j := range n {
						buf[j] = byte(g + i + j)
					}
					if err := c.WriteAt(buf[:n], off, i%3 == 0); err != nil {
						t.Error(err)
						return
					}
					if err := c.ReadAt(got[:n], off); err != nil {
						t.Error(err)
						return
					}
					if !bytes.Equal(got[:n], buf[:n]) {
						t.Errorf("g%d i%d: data mismatch", g, i)
					}
				}
			}()
		}
		wg.Wait()
		// Large transfer (split by the client at the max block size is
		// not needed: 4 MiB < 32 MiB) and a zero-length read.
		big := make([]byte, 4<<20)
		for i := range big {
			big[i] = byte(rng.Uint32())
		}
		if err := c.WriteAt(big, 4<<20, false); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(big))
		if err := c.ReadAt(got, 4<<20); err != nil || !bytes.Equal(got, big) {
			t.Fatalf("big read: %v", err)
		}
		if err := c.ReadAt(nil, 0); err != nil {
			t.Fatalf("zero-length read: %v", err)
		}
		if err := c.Flush(); err != nil || mem.flushes.Load() == 0 {
			t.Fatalf("flush: %v", err)
		}
		if err := c.Trim(0, 4096, true); err != nil || mem.trims.Load() != 1 {
			t.Fatalf("trim: %v", err)
		}
		if err := c.Cache(0, 4096); err != nil || mem.fetches.Load() != 1 {
			t.Fatalf("cache: %v", err)
		}
		if err := c.WriteZeroes(4<<20, 4096, false, false, false); err != nil {
			t.Fatal(err)
		}
		if err := c.ReadAt(got[:4096], 4<<20); err != nil || !bytes.Equal(got[:4096], make([]byte, 4096)) {
			t.Fatalf("zeroes not read back: %v", err)
		}
	})
}

func TestFlagsFollowCapabilities(t *testing.T) {
	ts := startServer(t, Config{},
		Export{Name: "full", Backend: newMem(1 << 20)},
		Export{Name: "plain", Backend: plain{newMem(1 << 20)}},
		Export{Name: "ro", Backend: newMem(1 << 20), ReadOnly: true},
	)
	base := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagCanMultiConn
	for _, tc := range []struct {
		name string
		opts ClientOptions
		want uint16
	}{
		{"full", ClientOptions{}, base | FlagSendTrim | FlagSendWriteZeroes | FlagSendFastZero | FlagSendCache},
		{"full", ClientOptions{StructuredReplies: true}, base | FlagSendTrim | FlagSendWriteZeroes | FlagSendFastZero | FlagSendCache | FlagSendDF},
		{"plain", ClientOptions{}, base},
		{"ro", ClientOptions{}, base | FlagReadOnly | FlagSendCache},
	} {
		c := ts.dial(t, tc.name, tc.opts)
		if c.Flags() != tc.want {
			t.Errorf("%s %+v: flags %#x, want %#x", tc.name, tc.opts, c.Flags(), tc.want)
		}
	}
}

// TestRequestErrors checks every validation error, and that the connection
// keeps working after each.
func TestRequestErrors(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		const size = 1 << 20
		ts := startServer(t, Config{},
			Export{Name: "d", Backend: newMem(size), MinBlockSize: 512, MaxBlockSize: 256 << 10},
			Export{Name: "ro", Backend: newMem(size), ReadOnly: true},
			Export{Name: "plain", Backend: plain{newMem(size)}},
		)
		c := ts.dial(t, "d", opts)
		ro := ts.dial(t, "ro", opts)
		pl := ts.dial(t, "plain", opts)
		buf := make([]byte, 512<<10)
		for _, tc := range []struct {
			what  string
			c     *Client
			typ   uint16
			flags uint16
			off   uint64
			n     uint32
			errno uint32
		}{
			{"read past end", c, cmdRead, 0, size - 512, 1024, EINVAL},
			{"read offset past end", c, cmdRead, 0, size + 512, 512, EINVAL},
			{"read offset overflow", c, cmdRead, 0, 1<<64 - 512, 1024, EINVAL},
			{"write past end", c, cmdWrite, 0, size - 512, 1024, ENOSPC},
			{"zeroes past end", c, cmdWriteZeroes, 0, size, 512, ENOSPC},
			{"trim past end", c, cmdTrim, 0, size, 512, EINVAL},
			{"cache past end", c, cmdCache, 0, size, 512, EINVAL},
			{"misaligned read offset", c, cmdRead, 0, 100, 512, EINVAL},
			{"misaligned read length", c, cmdRead, 0, 0, 100, EINVAL},
			{"misaligned write", c, cmdWrite, 0, 512, 513, EINVAL},
			{"misaligned trim", c, cmdTrim, 0, 1, 512, EINVAL},
			{"read over max block", c, cmdRead, 0, 0, 512 << 10, EINVAL},
			{"write over max block", c, cmdWrite, 0, 0, 512 << 10, EINVAL},
			{"unknown command", c, 42, 0, 0, 0, EINVAL},
			{"unknown flag", c, cmdRead, 1 << 9, 0, 512, EINVAL},
			{"NO_HOLE on write", c, cmdWrite, CmdFlagNoHole, 0, 512, EINVAL},
			{"REQ_ONE on read", c, cmdRead, CmdFlagReqOne, 0, 512, EINVAL},
			{"block status not negotiated", c, cmdBlockStatus, 0, 0, 512, EINVAL},
			{"flush with offset", c, cmdFlush, 0, 512, 0, EINVAL},
			{"flush with length", c, cmdFlush, 0, 0, 512, EINVAL},
			{"write on read-only", ro, cmdWrite, 0, 0, 512, EPERM},
			{"trim on read-only", ro, cmdTrim, 0, 0, 512, EPERM},
			{"zeroes on read-only", ro, cmdWriteZeroes, 0, 0, 512, EPERM},
			{"trim unsupported", pl, cmdTrim, 0, 0, 512, EINVAL},
			{"zeroes unsupported", pl, cmdWriteZeroes, 0, 0, 512, EINVAL},
			{"cache unsupported", pl, cmdCache, 0, 0, 512, EINVAL},
		} {
			var w, r []byte
			if tc.typ == cmdWrite {
				w = buf[:tc.n]
			}
			if tc.typ == cmdRead {
				r = buf[:tc.n]
			}
			wantErrno(t, tc.what, tc.c.do(tc.typ, tc.flags, tc.off, tc.n, w, r), tc.errno)
		}
		// DF is only valid with structured replies; FAST_ZERO over the max
		// block size is allowed.
		err := c.do(cmdRead, CmdFlagDF, 0, 512, nil, buf[:512])
		if opts.StructuredReplies {
			if err != nil {
				t.Errorf("DF read: %v", err)
			}
		} else {
			wantErrno(t, "DF without structured replies", err, EINVAL)
		}
		if err := c.WriteZeroes(0, size, false, true, true); err != nil {
			t.Errorf("fast zero of whole export: %v", err)
		}
		for _, cl := range []*Client{c, ro, pl} {
			if err := cl.ReadAt(buf[:512], 0); err != nil {
				t.Errorf("connection broken after errors: %v", err)
			}
		}
	})
}

// TestLongRequestsWithoutPayload: TRIM, WRITE_ZEROES and CACHE longer than
// the maximum block size are accepted (the spec bounds payloads only; the
// kernel sends WRITE_ZEROES of hundreds of MiB through nbdfuse during
// mkfs.ext4, and refusing them surfaced as I/O errors in dmesg) and reach
// the backend in pieces of at most the maximum block size, cut at its
// multiples.
func TestLongRequestsWithoutPayload(t *testing.T) {
	const size, maxBlock = 1 << 20, 256 << 10
	mem := newMem(size)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem, MaxBlockSize: maxBlock})
	c := ts.dial(t, "d", ClientOptions{StructuredReplies: true, BlockStatus: true})
	data := bytes.Repeat([]byte{0xa5}, maxBlock)
	for i := 0; i < size; i += maxBlock {
		if err := c.WriteAt(data[:maxBlock], int64(i), false); err != nil {
			t.Fatal(err)
		}
	}
	// From 12 KiB to the end: pieces [12K,256K) [256K,512K) [512K,768K) [768K,1M).
	const off = 12 << 10
	if err := c.do(cmdWriteZeroes, CmdFlagFUA, off, size-off, nil, nil); err != nil {
		t.Fatalf("WRITE_ZEROES of %d bytes (max block %d): %v", size-off, maxBlock, err)
	}
	if err := c.do(cmdTrim, 0, off, size-off, nil, nil); err != nil {
		t.Fatalf("TRIM of %d bytes: %v", size-off, err)
	}
	if err := c.do(cmdCache, 0, 0, size, nil, nil); err != nil {
		t.Fatalf("CACHE of %d bytes: %v", size, err)
	}
	if n, _, err := c.BlockStatus(0, size); err != nil || n != size {
		t.Fatalf("BLOCK_STATUS of %d bytes = %d, %v", size, n, err)
	}
	if z, tr, f := mem.zeroes.Load(), mem.trims.Load(), mem.fetches.Load(); z != 4 || tr != 4 || f != 4 {
		t.Errorf("backend calls: %d zeroes, %d trims, %d prefetches; want 4 of each", z, tr, f)
	}
	got := make([]byte, size)
	if err := c.ReadAt(got[:maxBlock], 0); err != nil {
		t.Fatal(err)
	}
	for i := maxBlock; i < size; i += maxBlock {
		if err := c.ReadAt(got[i:i+maxBlock], int64(i)); err != nil {
			t.Fatal(err)
		}
	}
	want := append(bytes.Repeat([]byte{0xa5}, off), make([]byte, size-off)...)
	if !bytes.Equal(got, want) {
		t.Error("after WRITE_ZEROES from 12 KiB: the export does not read as the first 12 KiB of data and zeroes after")
	}
	// Payloads stay bound: a READ over the maximum block size is refused.
	wantErrno(t, "read over max block", c.do(cmdRead, 0, 0, 2*maxBlock, nil, got[:2*maxBlock]), EINVAL)
}

func TestHugeWriteClosesConnection(t *testing.T) {
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(1 << 20)})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	r.request(requestHeader{Type: cmdWrite, Handle: 1, Length: hardMaxPayload + 1}, nil)
	r.expectClosed()
}

func TestUnknownCommandRaw(t *testing.T) {
	// A write whose payload is discarded, then an unknown command: both
	// answered with errors, stream stays in sync.
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(1 << 20), ReadOnly: true})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	r.request(requestHeader{Type: cmdWrite, Handle: 1, Length: 4096}, make([]byte, 4096))
	if errno, h := r.simpleReply(); errno != EPERM || h != 1 {
		t.Fatalf("errno %d handle %d", errno, h)
	}
	r.request(requestHeader{Type: 200, Handle: 2}, nil)
	if errno, h := r.simpleReply(); errno != EINVAL || h != 2 {
		t.Fatalf("errno %d handle %d", errno, h)
	}
	r.request(requestHeader{Type: cmdDisc}, nil)
	r.expectClosed()
}

func TestErrnoMapping(t *testing.T) {
	for _, tc := range []struct {
		err   error
		errno uint32
	}{
		{errors.ErrUnsupported, ENOTSUP},
		{fmt.Errorf("wrapped: %w", syscall.EOPNOTSUPP), ENOTSUP},
		{syscall.ENOSPC, ENOSPC},
		{syscall.EDQUOT, ENOSPC},
		{syscall.EFBIG, ENOSPC},
		{syscall.EPERM, EPERM},
		{&net.OpError{Err: syscall.EROFS}, EPERM},
		{syscall.EINVAL, EINVAL},
		{syscall.ENOMEM, ENOMEM},
		{syscall.EIO, EIO},
		{errors.New("checksum mismatch"), EIO},
		{fmt.Errorf("remote: %w", &Error{Errno: ENOSPC}), ENOSPC},
	} {
		if got := errnoFor(tc.err); got != tc.errno {
			t.Errorf("errnoFor(%v) = %d, want %d", tc.err, got, tc.errno)
		}
	}
	e := &Error{Errno: ENOSPC}
	if !errors.Is(e, syscall.ENOSPC) || errors.Is(e, syscall.EIO) || !errors.Is(&Error{Errno: ENOTSUP}, errors.ErrUnsupported) {
		t.Error("Error.Is")
	}
}

func TestBackendErrors(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		mem := newMem(1 << 20)
		mem.readHook = func(off int64, n int) error {
			if off == 0 {
				return fmt.Errorf("disk on fire: %w", syscall.EIO)
			}
			return nil
		}
		mem.writeHook = func(off int64, n int) error {
			if off == 0 {
				return syscall.ENOSPC
			}
			return nil
		}
		mem.flushErr = syscall.EROFS
		mem.zeroHook = func(fast bool) error {
			return errors.ErrUnsupported
		}
		ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
		c := ts.dial(t, "d", opts)
		buf := make([]byte, 4096)
		wantErrno(t, "read", c.ReadAt(buf, 0), EIO)
		wantErrno(t, "write", c.WriteAt(buf, 0, false), ENOSPC)
		wantErrno(t, "flush", c.Flush(), EPERM)
		wantErrno(t, "fast zero", c.WriteZeroes(4096, 4096, false, true, true), ENOTSUP)
		if err := c.ReadAt(buf, 4096); err != nil {
			t.Fatal(err)
		}
		// Without FAST_ZERO the server falls back to writing zeroes.
		if err := c.WriteAt(bytes.Repeat([]byte{1}, 8192), 4096, false); err != nil {
			t.Fatal(err)
		}
		if err := c.WriteZeroes(4096, 8192, false, true, false); err != nil {
			t.Fatalf("zero fallback: %v", err)
		}
		got := make([]byte, 8192)
		if err := c.ReadAt(got, 4096); err != nil || !bytes.Equal(got, make([]byte, 8192)) {
			t.Fatalf("zero fallback not zero: %v", err)
		}
		var e *Error
		if err := c.ReadAt(buf, 0); errors.As(err, &e) && opts.StructuredReplies && e.Message == "" {
			t.Error("structured error without message")
		}
	})
}

// gate blocks backend calls at chosen offsets until released.
type gate struct {
	mu      sync.Mutex
	blocked map[int64]chan struct{}
	entered atomic.Int64
}

func newGate(offs ...int64) *gate {
	g := &gate{blocked: map[int64]chan struct{}{}}
	for _, o := range offs {
		g.blocked[o] = make(chan struct{})
	}
	return g
}

func (g *gate) hook(off int64, n int) error {
	g.entered.Add(1)
	g.mu.Lock()
	ch := g.blocked[off]
	g.mu.Unlock()
	if ch != nil {
		<-ch
	}
	return nil
}

func (g *gate) release(off int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	close(g.blocked[off])
	delete(g.blocked, off)
}

func TestOutOfOrderReplies(t *testing.T) {
	bothModes(t, func(t *testing.T, opts ClientOptions) {
		mem := newMem(1 << 20)
		g := newGate(0)
		mem.readHook = g.hook
		ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
		c := ts.dial(t, "d", opts)
		slow := make(chan error, 1)
		go func() { slow <- c.ReadAt(make([]byte, 4096), 0) }()
		for g.entered.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		for i := range 10 {
			if err := c.ReadAt(make([]byte, 4096), int64(i+1)*4096); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case err := <-slow:
			t.Fatalf("blocked read completed early: %v", err)
		default:
		}
		g.release(0)
		if err := <-slow; err != nil {
			t.Fatal(err)
		}
	})
}

func TestInFlightBytesBound(t *testing.T) {
	mem := newMem(1 << 20)
	var blockAll = make(chan struct{})
	var entered atomic.Int64
	mem.writeHook = func(off int64, n int) error {
		entered.Add(1)
		<-blockAll
		return nil
	}
	ts := startServer(t, Config{MaxInFlightBytes: 64 << 10}, Export{Name: "d", Backend: mem})
	c := ts.dial(t, "d", ClientOptions{})
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.WriteAt(make([]byte, 32<<10), int64(i)*(32<<10), false); err != nil {
				t.Error(err)
			}
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for entered.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if n := entered.Load(); n != 2 {
		t.Errorf("%d writes reached the backend with a 64 KiB budget, want 2", n)
	}
	// The reader is blocked on the budget: a flush sent now is not seen.
	flushed := make(chan error, 1)
	go func() { flushed <- c.Flush() }()
	time.Sleep(20 * time.Millisecond)
	if got := mem.flushes.Load(); got != 0 {
		t.Errorf("reader kept reading past the budget (%d flushes)", got)
	}
	close(blockAll)
	wg.Wait()
	if err := <-flushed; err != nil {
		t.Fatal(err)
	}
	if n := entered.Load(); n != 10 {
		t.Errorf("entered %d", n)
	}
}

// TestRequestCountBound: requests without payload count too, so a client
// flooding FLUSHes cannot queue unbounded work.
func TestRequestCountBound(t *testing.T) {
	mem := newMem(1 << 20)
	block := make(chan struct{})
	mem.flushHook = func() { <-block }
	ts := startServer(t, Config{MaxInFlightBytes: 8 * minCharge}, Export{Name: "d", Backend: mem})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	for i := range 20 {
		r.request(requestHeader{Type: cmdFlush, Handle: uint64(i)}, nil)
	}
	deadline := time.Now().Add(5 * time.Second)
	for mem.flushes.Load() < 8 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(30 * time.Millisecond)
	if n := mem.flushes.Load(); n != 8 {
		t.Errorf("%d flushes in flight with a budget of 8 requests", n)
	}
	close(block)
	for range 20 {
		if errno, _ := r.simpleReply(); errno != 0 {
			t.Fatalf("errno %d", errno)
		}
	}
}

func TestShutdownDrainsAndFlushes(t *testing.T) {
	mem := newMem(1 << 20)
	copy(mem.data[8192:], "hello")
	g := newGate(8192)
	mem.readHook = g.hook
	s := NewServer(Config{})
	if err := s.AddExport(Export{Name: "d", Backend: mem}); err != nil {
		t.Fatal(err)
	}
	path := sockPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	c, err := Dial(t.Context(), "unix", path, "d", ClientOptions{StructuredReplies: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// A second connection still negotiating is closed by Shutdown.
	pending, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer pending.Close()

	got := make([]byte, 5)
	readDone := make(chan error, 1)
	go func() { readDone <- c.ReadAt(got, 8192) }()
	for g.entered.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(context.Background()) }()
	time.Sleep(30 * time.Millisecond)
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned with a request in flight: %v", err)
	default:
	}
	if mem.flushes.Load() != 0 {
		t.Fatal("flushed before in-flight request finished")
	}
	g.release(8192)
	if err := <-readDone; err != nil || string(got) != "hello" {
		t.Fatalf("in-flight read: %q, %v", got, err)
	}
	if err := <-shut; err != nil {
		t.Fatal(err)
	}
	if mem.flushes.Load() != 1 {
		t.Fatalf("flushes = %d", mem.flushes.Load())
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
	if err := c.ReadAt(got, 0); err == nil {
		t.Fatal("read after shutdown succeeded")
	}
	if err := s.Serve(l); !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve after Shutdown: %v", err)
	}
}

func TestShutdownContextExpires(t *testing.T) {
	mem := newMem(1 << 20)
	g := newGate(0)
	mem.readHook = g.hook
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
	c := ts.dial(t, "d", ClientOptions{})
	readDone := make(chan error, 1)
	go func() { readDone <- c.ReadAt(make([]byte, 512), 0) }()
	for g.entered.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := ts.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := <-readDone; err == nil {
		t.Fatal("read on force-closed connection succeeded")
	}
	g.release(0)
}

func TestDiscFlushes(t *testing.T) {
	mem := newMem(1 << 20)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
	c := ts.dial(t, "d", ClientOptions{})
	if err := c.WriteAt([]byte("x"), 0, false); err != nil {
		t.Fatal(err)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for mem.flushes.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if mem.flushes.Load() != 1 {
		t.Fatal("DISC did not flush")
	}
	if err := c.ReadAt(make([]byte, 1), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("read after Close: %v", err)
	}
}

func TestConnectionIsolation(t *testing.T) {
	mem := newMem(1 << 20)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
	good := ts.dial(t, "d", ClientOptions{})
	buf := make([]byte, 4096)

	// Garbage in the handshake, a bad request magic, a client vanishing
	// with requests in flight: none affects the good connection.
	r1 := ts.raw(t)
	r1.read(make([]byte, 18))
	r1.write(bytes.Repeat([]byte{0xff}, 100))
	r1.expectClosed()

	r2 := ts.raw(t)
	r2.greet(flagCFixedNewstyle | flagCNoZeroes)
	r2.goExport("d")
	r2.write(bytes.Repeat([]byte{0xee}, requestHeaderSize))
	r2.expectClosed()

	r3 := ts.raw(t)
	r3.greet(flagCFixedNewstyle | flagCNoZeroes)
	r3.goExport("d")
	for i := range 50 {
		r3.request(requestHeader{Type: cmdRead, Handle: uint64(i), Offset: uint64(i) * 4096, Length: 4096}, nil)
	}
	r3.request(requestHeader{Type: cmdWrite, Handle: 99, Length: 4096}, make([]byte, 100)) // truncated
	r3.nc.Close()

	for range 10 {
		if err := good.ReadAt(buf, 0); err != nil {
			t.Fatal(err)
		}
	}
}

func TestMultipleListenersAndMaxConnections(t *testing.T) {
	s := NewServer(Config{MaxConnections: 2})
	if err := s.AddExport(Export{Name: "d", Backend: newMem(4096)}); err != nil {
		t.Fatal(err)
	}
	var paths []string
	served := make(chan error, 2)
	for range 2 {
		p := sockPath(t)
		l, err := net.Listen("unix", p)
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
		go func() { served <- s.Serve(l) }()
	}
	var clients []*Client
	for _, p := range paths {
		c, err := Dial(t.Context(), "unix", p, "d", ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	if _, err := Dial(t.Context(), "unix", paths[0], "d", ClientOptions{}); err == nil {
		t.Error("third connection accepted with MaxConnections 2")
	}
	for _, c := range clients {
		if err := c.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-served; !errors.Is(err, ErrServerClosed) {
			t.Fatal(err)
		}
	}
	for _, c := range clients {
		c.Close()
	}
}

func TestAddRemoveExport(t *testing.T) {
	s := NewServer(Config{})
	bad := []Export{
		{Name: "nil"},
		{Name: "x\x00", Backend: newMem(4096)},
		{Name: "min", Backend: newMem(4096), MinBlockSize: 3},
		{Name: "min2", Backend: newMem(4096), MinBlockSize: 128 << 10},
		{Name: "pref", Backend: newMem(4096), PreferredBlockSize: 256},
		{Name: "max", Backend: newMem(4096), MinBlockSize: 4096, MaxBlockSize: 4096*3 + 1},
		{Name: "huge", Backend: newMem(4096), MaxBlockSize: 128 << 20},
		{Name: "size", Backend: newMem(1000), MinBlockSize: 512},
	}
	for _, e := range bad {
		if err := s.AddExport(e); err == nil {
			t.Errorf("AddExport(%q) succeeded", e.Name)
		}
	}
	if err := s.AddExport(Export{Name: "a", Backend: newMem(4096)}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddExport(Export{Name: "a", Backend: newMem(4096)}); err == nil {
		t.Error("duplicate export accepted")
	}
	if err := s.RemoveExport("a"); err != nil {
		t.Fatal(err)
	}
	if err := s.RemoveExport("a"); err == nil {
		t.Error("double remove succeeded")
	}
}

func TestBlockStatusClient(t *testing.T) {
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(1 << 20)})
	c := ts.dial(t, "d", ClientOptions{BlockStatus: true})
	n, flags, err := c.BlockStatus(4096, 65536)
	if err != nil || n != 65536 || flags != 0 {
		t.Fatalf("BlockStatus = %d, %d, %v", n, flags, err)
	}
	wantErrno(t, "block status past end", c.do(cmdBlockStatus, 0, 1<<20, 512, nil, nil), EINVAL)
	plain := ts.dial(t, "d", ClientOptions{})
	if _, _, err := plain.BlockStatus(0, 512); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("BlockStatus without negotiation: %v", err)
	}
}

func TestClientSplitsLargeRequests(t *testing.T) {
	mem := newMem(4 << 20)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem, MaxBlockSize: 64 << 10})
	c := ts.dial(t, "d", ClientOptions{StructuredReplies: true})
	data := make([]byte, 1<<20+4096)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := c.WriteAt(data, 4096, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("split read: %v", err)
	}
}

// TestClientSurvivesServerDeath: requests in flight when the connection
// dies all fail cleanly (and the race detector sees no buffer reuse while a
// writer still holds it).
func TestClientSurvivesServerDeath(t *testing.T) {
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(1 << 20)})
	c := ts.dial(t, "d", ClientOptions{StructuredReplies: true})
	var wg sync.WaitGroup
	var failed atomic.Int64
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4096)
			for i := 0; ; i++ {
				var err error
				if i%2 == 0 {
					err = c.WriteAt(buf, int64(g)*4096, false)
				} else {
					err = c.ReadAt(buf, int64(g)*4096)
				}
				if err != nil {
					failed.Add(1)
					return
				}
			}
		}()
	}
	time.Sleep(20 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	ts.Shutdown(ctx) // force-close everything
	wg.Wait()
	if failed.Load() != 16 {
		t.Fatalf("%d goroutines saw the failure", failed.Load())
	}
}

// flakyListener fails its first Accept calls with a non-timeout error.
type flakyListener struct {
	net.Listener
	fails atomic.Int64
}

func (l *flakyListener) Accept() (net.Conn, error) {
	if l.fails.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Err: syscall.EMFILE}
	}
	return l.Listener.Accept()
}

func TestServeSurvivesAcceptErrors(t *testing.T) {
	s := NewServer(Config{})
	if err := s.AddExport(Export{Name: "d", Backend: newMem(4096)}); err != nil {
		t.Fatal(err)
	}
	path := sockPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	fl := &flakyListener{Listener: l}
	fl.fails.Store(3)
	served := make(chan error, 1)
	go func() { served <- s.Serve(fl) }()
	c, err := Dial(t.Context(), "unix", path, "d", ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if err := s.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Fatal(err)
	}
}

// TestManyConnections: many clients at once, each on its own region, with
// multi-conn flush semantics (a flush on one connection after writes
// completed on others).
func TestManyConnections(t *testing.T) {
	mem := newMem(4 << 20)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
	const n = 32
	clients := make([]*Client, n)
	for i := range clients {
		clients[i] = ts.dial(t, "d", ClientOptions{StructuredReplies: i%2 == 0})
	}
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := bytes.Repeat([]byte{byte(i)}, 64<<10)
			off := int64(i) * (128 << 10)
			for j := range 4 {
				if err := c.WriteAt(buf, off+int64(j%2)*(64<<10), false); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	flushes := mem.flushes.Load()
	if err := clients[0].Flush(); err != nil || mem.flushes.Load() != flushes+1 {
		t.Fatalf("flush: %v", err)
	}
	got := make([]byte, 128<<10)
	for i, c := range clients {
		if err := c.ReadAt(got, int64((i+1)%n)*(128<<10)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, bytes.Repeat([]byte{byte((i + 1) % n)}, len(got))) {
			t.Fatalf("client %d sees wrong data for region %d", i, (i+1)%n)
		}
	}
}

func TestShutdownFlushesRemovedExportInUse(t *testing.T) {
	mem := newMem(4096)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: mem})
	c := ts.dial(t, "d", ClientOptions{})
	if err := ts.RemoveExport("d"); err != nil {
		t.Fatal(err)
	}
	if err := c.WriteAt([]byte("x"), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := ts.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if mem.flushes.Load() != 1 {
		t.Fatalf("flushes = %d", mem.flushes.Load())
	}
}

// TestClientAsBackend chains two servers: the front exports a Client of
// the back one, as a remote backing device would. Errors keep their errno
// across the hop.
func TestClientAsBackend(t *testing.T) {
	mem := newMem(1 << 20)
	back := startServer(t, Config{}, Export{Name: "b", Backend: mem, MinBlockSize: 512})
	remote := back.dial(t, "b", ClientOptions{StructuredReplies: true})
	front := startServer(t, Config{}, Export{Name: "f", Backend: remote})
	c := front.dial(t, "f", ClientOptions{})
	if c.Flags()&(FlagSendTrim|FlagSendWriteZeroes|FlagSendCache) != FlagSendTrim|FlagSendWriteZeroes|FlagSendCache {
		t.Fatalf("front flags %#x", c.Flags())
	}
	if err := c.WriteAt(bytes.Repeat([]byte{7}, 4096), 8192, true); err != nil {
		t.Fatal(err)
	}
	if mem.at(8192) != 7 || mem.at(8192+4095) != 7 {
		t.Fatal("write did not reach the back end")
	}
	if err := c.WriteZeroes(8192, 512, false, true, false); err != nil || mem.at(8192) != 0 {
		t.Fatalf("zeroes: %v", err)
	}
	if err := c.Flush(); err != nil || mem.flushes.Load() == 0 {
		t.Fatalf("flush: %v", err)
	}
	// Misaligned for the back end (min 512), fine for the front (min 1):
	// the back end's EINVAL comes through.
	wantErrno(t, "misaligned via front", c.ReadAt(make([]byte, 100), 0), EINVAL)
}

// TestShutdownRefusesQueuedRequests: requests that arrived but were not
// started when Shutdown began get ESHUTDOWN; the one in flight completes.
func TestShutdownRefusesQueuedRequests(t *testing.T) {
	mem := newMem(1 << 20)
	g := newGate(0)
	mem.readHook = g.hook
	ts := startServer(t, Config{MaxInFlightBytes: 4096}, Export{Name: "d", Backend: mem})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	// A blocks in the backend holding the whole budget; B waits for
	// budget; C and a WRITE sit in the read buffer.
	var b []byte
	for _, h := range []requestHeader{
		{Type: cmdRead, Handle: 1, Length: 4096},
		{Type: cmdRead, Handle: 2, Offset: 4096, Length: 4096},
		{Type: cmdFlush, Handle: 3},
		{Type: cmdWrite, Handle: 4, Length: 512},
	} {
		var hb [requestHeaderSize]byte
		encodeRequest(hb[:], h)
		b = append(b, hb[:]...)
		if h.Type == cmdWrite {
			b = append(b, make([]byte, 512)...)
		}
	}
	r.write(b)
	for g.entered.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // let the reader block on B's budget
	shut := make(chan error, 1)
	go func() { shut <- ts.Shutdown(context.Background()) }()
	got := map[uint64]uint32{}
	for range 3 {
		errno, h := r.simpleReply()
		got[h] = errno
	}
	if got[2] != ESHUTDOWN || got[3] != ESHUTDOWN || got[4] != ESHUTDOWN {
		t.Fatalf("replies %v, want ESHUTDOWN for 2, 3, 4", got)
	}
	g.release(0)
	if errno, h := r.simpleReply(); errno != 0 || h != 1 {
		t.Fatalf("in-flight read: errno %d handle %d", errno, h)
	}
	r.read(make([]byte, 4096))
	if err := <-shut; err != nil {
		t.Fatal(err)
	}
	r.expectClosed()
}

// TestCloseExportLive: an export added while serving is reachable at once;
// CloseExport ends only the connections of its export (after their requests
// in flight), refuses new ones, and leaves the others serving.
func TestCloseExportLive(t *testing.T) {
	ts := startServer(t, Config{}, Export{Name: "keep", Backend: newMem(1 << 20)})
	keep := ts.dial(t, "keep", ClientOptions{})
	if err := keep.WriteAt(bytes.Repeat([]byte{7}, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := ts.AddExport(Export{Name: "new", Backend: newMem(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	c1 := ts.dial(t, "new", ClientOptions{})
	c2 := ts.dial(t, "new", ClientOptions{})
	if err := c1.WriteAt(bytes.Repeat([]byte{1}, 4096), 0, true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := ts.CloseExport(ctx, "new")
	if err != nil || n != 2 {
		t.Fatalf("CloseExport = %d, %v; want 2 connections", n, err)
	}
	if err := c1.ReadAt(make([]byte, 4096), 0); err == nil {
		t.Error("a closed export's connection still serves")
	}
	if _, err := Dial(ctx, "unix", ts.addr, "new", ClientOptions{}); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("dial of a closed export: %v", err)
	}
	got := make([]byte, 4096)
	if err := keep.ReadAt(got, 0); err != nil || got[0] != 7 {
		t.Fatalf("the other export's connection: %v, byte %d", err, got[0])
	}
	if n, err := ts.CloseExport(ctx, "none"); n != 0 || err != nil {
		t.Errorf("CloseExport of an unknown export = %d, %v", n, err)
	}
	_ = c2
}

// TestOnServing: Config.OnServing hears the number of connections serving
// an export each time it changes: 1, 2 as clients connect (past the
// handshake), then 1, 0 as they close; a client refused at NBD_OPT_GO
// (MaxConnections) changes nothing.
func TestOnServing(t *testing.T) {
	var mu sync.Mutex
	var got []int
	ts := startServer(t, Config{MaxConnections: 2, OnServing: func(n int) {
		mu.Lock()
		got = append(got, n)
		mu.Unlock()
	}}, Export{Name: "d", Backend: newMem(4096)})
	seen := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return append([]int(nil), got...)
	}
	var clients []*Client
	for range 2 {
		c, err := Dial(t.Context(), "unix", ts.addr, "d", ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	if _, err := Dial(t.Context(), "unix", ts.addr, "d", ClientOptions{}); err == nil {
		t.Fatal("third connection accepted with MaxConnections 2")
	}
	if s := seen(); !slices.Equal(s, []int{1, 2}) {
		t.Fatalf("OnServing heard %v while two clients serve, want [1 2]", s)
	}
	for _, c := range clients {
		c.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(seen()) < 4 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s := seen(); !slices.Equal(s, []int{1, 2, 1, 0}) {
		t.Fatalf("OnServing heard %v, want [1 2 1 0]", s)
	}
}
