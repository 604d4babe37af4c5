package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// memBackend is an in-memory Backend with every optional capability and
// hooks to delay or fail operations.
type memBackend struct {
	mu   sync.RWMutex
	data []byte

	flushes atomic.Int64
	trims   atomic.Int64
	zeroes  atomic.Int64
	fetches atomic.Int64

	// Hooks, called before the operation; a non-nil error fails it.
	readHook  func(off int64, n int) error
	writeHook func(off int64, n int) error
	flushErr  error
	flushHook func()
	zeroHook  func(fastOnly bool) error
}

func newMem(size int) *memBackend { return &memBackend{data: make([]byte, size)} }

// at reads one byte under the lock (the race detector cannot see the
// ordering that a reply over a socket implies).
func (m *memBackend) at(off int) byte {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.data[off]
}

func (m *memBackend) Size() int64 { return int64(len(m.data)) }

func (m *memBackend) ReadAt(p []byte, off int64) error {
	if m.readHook != nil {
		if err := m.readHook(off, len(p)); err != nil {
			return err
		}
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	copy(p, m.data[off:off+int64(len(p))])
	return nil
}

func (m *memBackend) WriteAt(p []byte, off int64, fua bool) error {
	if m.writeHook != nil {
		if err := m.writeHook(off, len(p)); err != nil {
			return err
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(m.data[off:], p)
	return nil
}

func (m *memBackend) Flush() error {
	m.flushes.Add(1)
	if m.flushHook != nil {
		m.flushHook()
	}
	return m.flushErr
}

func (m *memBackend) Trim(off, n int64, fua bool) error {
	m.trims.Add(1)
	return nil
}

func (m *memBackend) WriteZeroes(off, n int64, fua, mayTrim, fastOnly bool) error {
	if m.zeroHook != nil {
		if err := m.zeroHook(fastOnly); err != nil {
			return err
		}
	}
	m.zeroes.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.data[off : off+n])
	return nil
}

func (m *memBackend) Prefetch(off, n int64) error {
	m.fetches.Add(1)
	return nil
}

// plain hides the optional interfaces of a Backend.
type plain struct{ Backend }

// nullBackend does nothing, fast.
type nullBackend struct{ size int64 }

func (n nullBackend) Size() int64                             { return n.size }
func (nullBackend) ReadAt(p []byte, off int64) error          { return nil }
func (nullBackend) WriteAt(p []byte, off int64, _ bool) error { return nil }
func (nullBackend) Flush() error                              { return nil }

// testServer runs a Server on a unix socket until the test ends.
type testServer struct {
	*Server
	addr string
	done chan error
}

func sockPath(t testing.TB) string {
	dir, err := os.MkdirTemp("", "nbd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s.sock")
}

func startServer(t testing.TB, cfg Config, exports ...Export) *testServer {
	t.Helper()
	s := NewServer(cfg)
	for _, e := range exports {
		if err := s.AddExport(e); err != nil {
			t.Fatal(err)
		}
	}
	path := sockPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{Server: s, addr: path, done: make(chan error, 1)}
	go func() { ts.done <- s.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		if err := <-ts.done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve returned %v", err)
		}
	})
	return ts
}

func (ts *testServer) dial(t testing.TB, name string, opts ClientOptions) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, "unix", ts.addr, name, opts)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// raw is a byte-level client for handshake tests.
type raw struct {
	t  testing.TB
	nc net.Conn
	br *bufio.Reader
}

func (ts *testServer) raw(t testing.TB) *raw {
	t.Helper()
	nc, err := net.Dial("unix", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	t.Cleanup(func() { nc.Close() })
	return &raw{t: t, nc: nc, br: bufio.NewReader(nc)}
}

// greet reads the greeting and sends client flags.
func (r *raw) greet(cflags uint32) {
	r.t.Helper()
	var b [18]byte
	r.read(b[:])
	if binary.BigEndian.Uint64(b[0:]) != nbdMagic || binary.BigEndian.Uint64(b[8:]) != ihaveOpt {
		r.t.Fatalf("bad greeting % x", b)
	}
	if f := binary.BigEndian.Uint16(b[16:]); f != flagFixedNewstyle|flagNoZeroes {
		r.t.Fatalf("handshake flags %#x", f)
	}
	r.write(binary.BigEndian.AppendUint32(nil, cflags))
}

func (r *raw) read(b []byte) {
	r.t.Helper()
	if _, err := io.ReadFull(r.br, b); err != nil {
		r.t.Fatalf("read: %v", err)
	}
}

func (r *raw) write(b []byte) {
	r.t.Helper()
	if _, err := r.nc.Write(b); err != nil {
		r.t.Fatalf("write: %v", err)
	}
}

func (r *raw) opt(opt uint32, data []byte) {
	r.t.Helper()
	b := binary.BigEndian.AppendUint64(nil, ihaveOpt)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	r.write(append(b, data...))
}

// reply reads one option reply, checking it answers opt.
func (r *raw) reply(opt uint32) (typ uint32, data []byte) {
	r.t.Helper()
	typ, data, err := readOptReply(r.br, opt)
	if err != nil {
		r.t.Fatal(err)
	}
	return typ, data
}

func (r *raw) expect(opt, want uint32) []byte {
	r.t.Helper()
	typ, data := r.reply(opt)
	if typ != want {
		r.t.Fatalf("option %d: reply %#x (%q), want %#x", opt, typ, data, want)
	}
	return data
}

// expectClosed checks the server closed the connection.
func (r *raw) expectClosed() {
	r.t.Helper()
	b, err := io.ReadAll(r.br)
	if err != nil && !errors.Is(err, net.ErrClosed) && !isConnReset(err) {
		r.t.Fatalf("expected close, got %v", err)
	}
	if len(b) != 0 {
		r.t.Fatalf("expected close, got % x", b)
	}
}

func isConnReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

func infoData(name string, reqs ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(reqs)))
	for _, q := range reqs {
		b = binary.BigEndian.AppendUint16(b, q)
	}
	return b
}

func metaData(name string, queries ...string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(queries)))
	for _, q := range queries {
		b = binary.BigEndian.AppendUint32(b, uint32(len(q)))
		b = append(b, q...)
	}
	return b
}

// request sends a raw request header (and payload).
func (r *raw) request(h requestHeader, payload []byte) {
	r.t.Helper()
	var b [requestHeaderSize]byte
	encodeRequest(b[:], h)
	r.write(append(b[:], payload...))
}

// simpleReply reads a simple reply header.
func (r *raw) simpleReply() (errno uint32, handle uint64) {
	r.t.Helper()
	var b [simpleReplySize]byte
	r.read(b[:])
	if m := binary.BigEndian.Uint32(b[:]); m != simpleReplyMagic {
		r.t.Fatalf("reply magic %#x", m)
	}
	return binary.BigEndian.Uint32(b[4:]), binary.BigEndian.Uint64(b[8:])
}

// goExport negotiates GO for name (fails the test otherwise).
func (r *raw) goExport(name string) {
	r.t.Helper()
	r.opt(optGo, infoData(name))
	for {
		typ, _ := r.reply(optGo)
		if typ == repAck {
			return
		}
		if typ != repInfo {
			r.t.Fatalf("GO: reply %#x", typ)
		}
	}
}
