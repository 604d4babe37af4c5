// Package nbddev is a device.Device on an NBD export: any qemu-nbd, nbdkit,
// nbd-server, rbd-nbd or tiercache export can be a backing device.
//
// Mapping. ReadAt and WriteAt are NBD READ and WRITE, split to the
// server's maximum block size by the client, and widened to its minimum
// block size by read-modify-write when a request is not aligned to it. Sync
// is FLUSH (nothing when the server does not advertise SEND_FLUSH: it then
// has no write cache to flush). Discard is TRIM when the server advertises
// SEND_TRIM and nothing otherwise (the contract leaves a discarded range
// unspecified). WriteZeroes is WRITE_ZEROES when advertised, else zero
// buffers. Structured replies are used when the server offers them. When
// the server advertises CAN_MULTI_CONN, Target.Conns connections (default
// DefaultConns) share the requests: one that continues an ascending stream
// goes on the stream's connection, so the server receives the stream in
// order, and others take the connections in turn (streams.go). A FLUSH on
// any of them covers the writes completed on all of them, as the protocol
// promises.
//
// Outages. A connection that fails is not an error of the device: the
// requests on it are re-sent once the device has reconnected, which it
// does in the background with backoff (100 ms doubling to 5 s). A server
// that stops answering is a failed connection too: a request (or a
// replayed write) without a reply after Options.RequestTimeout ends its
// generation, closing its sockets at once, and is re-sent on the next. A
// request waits for the link while it has been down for less than
// Options.OutageTimeout, and is re-sent while it has been failing for less
// than that (a server that accepts connections and then hangs every
// request); past it, requests fail with an *device.IOError wrapping
// syscall.EIO and ErrLinkDown, and while the outage is older, at once,
// until the link is back. An error reply from the server (EIO, ENOSPC,
// ...) is the server's answer and is returned, not retried.
//
// Durability across reconnects. The server may have lost writes it
// acknowledged but no FLUSH covered when its connection ended (it may have
// restarted). Each connection set is a generation. The device keeps a copy
// of every completed write (and the range of every write-zeroes) until a
// FLUSH covers it, up to Options.ReplayBytes, and writes them again on a
// new generation before any request is served there, so a Sync after a
// reconnect covers them. When more than ReplayBytes are unflushed, the
// copies are dropped; if the generation then ends before a FLUSH, the next
// Sync fails with ErrNotDurable (wrapping syscall.EIO), once: the caller
// must write the data again (writeback keeps such blocks dirty and
// retries), and the Sync after that covers only what was written since.
//
// Identity. Every reconnection must find the same export: the same size
// and the same description (the marker an identity records, see
// internal/backingid). An export that comes back different is refused
// loudly (logged at error level, requests fail with ErrRefused) and the
// device keeps trying, in case the right one comes back.
package nbddev

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/nbd"
	"golang.org/x/sys/unix"
)

const (
	// DefaultConns is the number of connections opened to a server that
	// advertises CAN_MULTI_CONN, unless the URI says otherwise.
	DefaultConns = 4
	// MaxConns bounds x-multi-conn.
	MaxConns = 64
	// DefaultOutageTimeout is how long requests wait for a lost link to
	// come back before failing with EIO.
	DefaultOutageTimeout = 30 * time.Second
	// DefaultDialTimeout bounds one connection attempt and its handshake.
	DefaultDialTimeout = 10 * time.Second
	// DefaultReplayBytes bounds the copies of unflushed writes kept to
	// replay after a reconnect.
	DefaultReplayBytes = 64 << 20
	// DefaultRequestTimeout is how long a request waits for its reply
	// before the connection is deemed hung and replaced. It is well above
	// what a FLUSH of a large server-side cache to a slow disk takes.
	DefaultRequestTimeout = 60 * time.Second

	reconnectMin = 100 * time.Millisecond
	reconnectMax = 5 * time.Second
	// tcpUserTimeout makes the kernel fail a TCP connection whose sent
	// data stays unacknowledged this long (a host that vanished without a
	// reset), so that the outage is noticed instead of waited out.
	tcpUserTimeout = 15 * time.Second
	// maxMinBlock is the largest minimum block size accepted.
	maxMinBlock = 64 << 10
)

var (
	// ErrLinkDown is wrapped by the errors of requests that failed because
	// the server has been unreachable for longer than the outage timeout.
	ErrLinkDown = errors.New("nbddev: remote unreachable")
	// ErrNotDurable is wrapped by a Sync error when writes completed on a
	// connection that ended before a FLUSH covered them: the server may
	// have lost them, and they must be written again.
	ErrNotDurable = errors.New("nbddev: the connection ended before a flush covered earlier writes; they may be lost and must be written again")
	// ErrRefused is wrapped by request errors while the server that
	// answers is not the export the device was opened on.
	ErrRefused = errors.New("nbddev: remote export changed")
	// ErrClientCertificate is wrapped by the error of Open when a TLS
	// server dropped the connection just after the TLS handshake and no
	// client certificate was given: the server almost certainly requires
	// one (nbdkit --tls-verify-peer, qemu-nbd's verify-peer=on).
	ErrClientCertificate = errors.New("nbddev: the TLS server closed the connection after the handshake; it requires a client certificate and none was given")
	// ErrRequestTimeout is why a generation ended when a request got no
	// reply within Options.RequestTimeout (it is in Stats.LastError and
	// in the errors of requests that then outlive the outage timeout).
	ErrRequestTimeout = errors.New("nbddev: no reply within the request timeout; the connection was closed as hung")
)

// Options configures Open.
type Options struct {
	// ReadOnly refuses writes, discards and write-zeroes (ErrReadOnly).
	ReadOnly bool
	// OutageTimeout is how long a request waits for a lost link; 0 means
	// DefaultOutageTimeout.
	OutageTimeout time.Duration
	// DialTimeout bounds each connection attempt; 0 means
	// DefaultDialTimeout.
	DialTimeout time.Duration
	// ReplayBytes bounds the copies of unflushed writes kept to write
	// again after a reconnect; 0 means DefaultReplayBytes, negative keeps
	// none (a reconnect after unflushed writes then always fails the next
	// Sync with ErrNotDurable).
	ReplayBytes int64
	// RequestTimeout is how long a request, or a write replayed after a
	// reconnect, waits for its reply before its connection is closed as
	// hung and the request re-sent on a new one; 0 means
	// DefaultRequestTimeout, negative waits forever. It bounds when a hang
	// is noticed; OutageTimeout then bounds how long requests wait for
	// the link to come back.
	RequestTimeout time.Duration
	// Log receives link state changes; nil discards them.
	Log *slog.Logger
}

// unflushed is a completed write no FLUSH has covered yet.
type unflushed struct {
	off int64
	p   []byte // a copy of the data; nil for write-zeroes
	n   int64  // length
}

// Device is a device.Device on an NBD export. Safe for concurrent use.
type Device struct {
	t    Target
	name string // t.String(), for errors and logs
	opts Options
	log  *slog.Logger
	co   nbd.ClientOptions

	// Fixed by the first connection; every reconnection must match.
	size     int64
	flags    uint16
	desc     string
	minBlock int64

	rr  atomic.Uint64 // round-robin over connections (Sync)
	ch  chooser       // the connection of each read and write (streams.go)
	rmw sync.RWMutex  // held for writing by unaligned read-modify-writes

	done chan struct{} // closed by Close: stops the reconnect loop

	mu struct {
		sync.Mutex               // guards the fields below
		gen        uint64        // current connection generation
		conns      []*nbd.Client // of gen; nil while the link is down
		ncs        []net.Conn    // the sockets of conns, to abort a hung generation
		up         chan struct{} // closed when the link comes back
		upSince    time.Time     // when gen came up
		downSince  time.Time
		downErr    error // why the link went down, or why reconnecting fails
		refused    bool  // downErr is a refusal (a different export)
		// pend holds the writes completed and not covered by a FLUSH, in
		// completion order, to replay on the next generation; pendBytes is
		// what they hold. overflow: some such writes are not in pend
		// (more than ReplayBytes); ovfCount counts overflows.
		pend      []unflushed
		pendBytes int64
		overflow  bool
		ovfCount  uint64
		lost      bool // unflushed writes of an ended generation could not be replayed
		closed    bool
		stats     Stats
	}
}

// Stats describes the link, for status and metrics.
type Stats struct {
	Up             bool          // connected
	Failing        bool          // down for longer than the outage timeout: requests fail at once
	Since          time.Time     // when the link came up (Up) or went down
	Conns          int           // connections in the current generation
	Reconnects     uint64        // successful reconnections
	Outages        uint64        // times the link went down
	DownFor        time.Duration // length of the current outage (0 when up)
	DownTotal      time.Duration // time spent disconnected, current outage included
	NotDurable     uint64        // Syncs failed with ErrNotDurable
	Timeouts       uint64        // generations ended by a request without a reply in RequestTimeout
	ReplayedWrites uint64        // unflushed writes written again after reconnects
	ReplayedBytes  uint64        // the bytes of those (write-zeroes count their length)
	LastError      string        // why the link last went down or failed to come back
	Refused        bool          // the server now answering is not this export
	MultiConn      bool          // the server advertises CAN_MULTI_CONN
	FlushAdvised   bool          // the server advertises SEND_FLUSH
	Description    string        // the export's description (the identity marker)
	MinBlockSize   int64
	ReadOnlyByPeer bool // the server exports it read-only
}

var (
	_ device.Device    = (*Device)(nil)
	_ device.Discarder = (*Device)(nil)
	_ device.Zeroer    = (*Device)(nil)
)

// Open connects to the export named by uri (see ParseURI). The first
// connection must succeed: a remote that cannot be reached when the
// device is opened is an error, not an outage.
func Open(ctx context.Context, uri string, opts Options) (*Device, error) {
	t, err := ParseURI(uri)
	if err != nil {
		return nil, err
	}
	return OpenTarget(ctx, t, opts)
}

// OpenTarget is Open with a parsed URI.
func OpenTarget(ctx context.Context, t Target, opts Options) (*Device, error) {
	if opts.OutageTimeout <= 0 {
		opts.OutageTimeout = DefaultOutageTimeout
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = DefaultDialTimeout
	}
	if opts.ReplayBytes == 0 {
		opts.ReplayBytes = DefaultReplayBytes
	}
	if opts.RequestTimeout == 0 {
		opts.RequestTimeout = DefaultRequestTimeout
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tc, err := t.tlsConfig()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", t, err)
	}
	d := &Device{t: t, name: t.String(), opts: opts, log: log.With("remote", t.String()), done: make(chan struct{})}
	d.co = nbd.ClientOptions{StructuredReplies: true, TLSConfig: tc}
	conns, ncs, err := d.dial(ctx)
	if err != nil {
		if noClientCert(tc, err) {
			return nil, fmt.Errorf("%s: %w (the connection failed with: %v); %s", t, ErrClientCertificate, err, t.clientCertHint())
		}
		return nil, fmt.Errorf("%s: %w", t, err)
	}
	c := conns[0]
	d.size, d.flags, d.desc = c.Size(), c.Flags(), c.Description()
	minB, _, _ := c.BlockSizes()
	d.minBlock = max(int64(minB), 1)
	if d.minBlock > maxMinBlock || d.minBlock&(d.minBlock-1) != 0 {
		closeAll(conns)
		return nil, fmt.Errorf("%s: minimum block size %d is not a power of two up to %d", t, d.minBlock, maxMinBlock)
	}
	if opts.ReadOnly {
		d.flags |= nbd.FlagReadOnly
	}
	d.mu.gen = 1
	d.mu.conns, d.mu.ncs = conns, ncs
	d.mu.upSince = time.Now()
	d.mu.up = make(chan struct{})
	close(d.mu.up)
	return d, nil
}

// noClientCert reports whether err, from connecting with TLS configuration
// tc, is what a server requiring a client certificate does to a client
// without one: TLS 1.3 completes the client's side of the handshake before
// the server checks the client, so the server's refusal reaches the client
// as a connection reset or closed under the next NBD option (or, from
// servers that send it, the alert "certificate required").
func noClientCert(tc *tls.Config, err error) bool {
	if tc == nil || len(tc.Certificates) > 0 {
		return false
	}
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		strings.Contains(err.Error(), "certificate required")
}

// dial opens the connections of one generation (one, and more when the
// server advertises CAN_MULTI_CONN) and returns them with their sockets.
func (d *Device) dial(ctx context.Context) ([]*nbd.Client, []net.Conn, error) {
	var ncs []net.Conn
	one := func() (*nbd.Client, error) {
		ctx, cancel := context.WithTimeout(ctx, d.opts.DialTimeout)
		defer cancel()
		nd := net.Dialer{KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 5 * time.Second, Count: 3}}
		nc, err := nd.DialContext(ctx, d.t.Network, d.t.Addr)
		if err != nil {
			return nil, err
		}
		if tc, ok := nc.(*net.TCPConn); ok {
			if rc, err := tc.SyscallConn(); err == nil {
				rc.Control(func(fd uintptr) {
					unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(tcpUserTimeout/time.Millisecond))
				})
			}
		}
		c, err := nbd.NewClient(ctx, nc, d.t.Export, d.co)
		if err != nil {
			nc.Close()
			return nil, err
		}
		ncs = append(ncs, nc)
		return c, nil
	}
	first, err := one()
	if err != nil {
		return nil, nil, err
	}
	conns := []*nbd.Client{first}
	if first.Flags()&nbd.FlagCanMultiConn != 0 {
		n := d.t.Conns
		if n == 0 {
			n = DefaultConns
		}
		for len(conns) < n {
			c, err := one()
			if err != nil {
				closeAll(conns)
				return nil, nil, err
			}
			conns = append(conns, c)
		}
	}
	return conns, ncs, nil
}

func closeAll(conns []*nbd.Client) {
	for _, c := range conns {
		c.Close()
	}
}

// Target returns the parsed URI the device was opened with.
func (d *Device) Target() Target { return d.t }

// Description returns the export's description as the server sent it when
// the device was opened ("" if none): the marker its identity records.
func (d *Device) Description() string { return d.desc }

// Size returns the export size.
func (d *Device) Size() int64 { return d.size }

// Stats returns the link's state and counters.
func (d *Device) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.mu.stats
	s.Up = d.mu.conns != nil
	s.Conns = len(d.mu.conns)
	s.Since = d.mu.upSince
	if !s.Up && !d.mu.closed {
		s.Since = d.mu.downSince
		s.DownFor = time.Since(d.mu.downSince)
		s.DownTotal += s.DownFor
		s.Failing = s.DownFor >= d.opts.OutageTimeout
	}
	if d.mu.downErr != nil {
		s.LastError = d.mu.downErr.Error()
	}
	s.Refused = d.mu.refused
	s.MultiConn = d.flags&nbd.FlagCanMultiConn != 0
	s.FlushAdvised = d.flags&nbd.FlagSendFlush != 0
	s.Description = d.desc
	s.MinBlockSize = d.minBlock
	s.ReadOnlyByPeer = d.flags&nbd.FlagReadOnly != 0 && !d.opts.ReadOnly
	return s
}

// conn returns the connection of the current generation for a request of
// [off, end) (streams.go), its generation, and the function that ends the
// request there, waiting for the link while its outage is younger than the
// outage timeout.
func (d *Device) conn(off, end int64) (*nbd.Client, uint64, func(), error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, _, err := d.connLocked(); err != nil {
		return nil, 0, nil, err
	}
	cs, gen := d.mu.conns, d.mu.gen
	k := d.ch.pick(gen, off, end, len(cs))
	return cs[k], gen, func() { d.ch.done(gen, k) }, nil
}

// REQUIRES: d.mu (released while waiting)
func (d *Device) connLocked() (*nbd.Client, uint64, error) {
	for {
		if d.mu.closed {
			return nil, 0, device.ErrClosed
		}
		if cs := d.mu.conns; cs != nil {
			return cs[d.rr.Add(1)%uint64(len(cs))], d.mu.gen, nil
		}
		if d.mu.refused {
			return nil, 0, fmt.Errorf("%w: %w: %w", syscall.EIO, ErrRefused, d.mu.downErr)
		}
		wait := d.opts.OutageTimeout - time.Since(d.mu.downSince)
		if wait <= 0 {
			return nil, 0, fmt.Errorf("%w: %w for %s: %w", syscall.EIO, ErrLinkDown,
				time.Since(d.mu.downSince).Round(time.Millisecond), d.mu.downErr)
		}
		up := d.mu.up
		d.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-up:
		case <-t.C:
		case <-d.done:
		}
		t.Stop()
		d.mu.Lock()
	}
}

// linkFailed ends generation gen after err on one of its connections, and
// starts reconnecting. Calls for a generation already ended do nothing.
// With abort (a hung server) the sockets are closed at once, which fails
// the requests in flight; otherwise the connections are closed with
// NBD_CMD_DISC, letting the server finish them.
func (d *Device) linkFailed(gen uint64, err error, abort bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if gen != d.mu.gen || d.mu.conns == nil || d.mu.closed {
		return
	}
	old := d.mu.conns
	if abort {
		d.mu.stats.Timeouts++
		for _, nc := range d.mu.ncs {
			nc.Close()
		}
	}
	d.mu.conns, d.mu.ncs = nil, nil
	d.mu.gen++
	if d.mu.overflow {
		d.mu.lost = true
		d.mu.overflow = false
	}
	d.mu.downSince = time.Now()
	d.mu.downErr = err
	d.mu.up = make(chan struct{})
	d.mu.stats.Outages++
	d.log.Warn("nbd backing: link down; requests wait for it to come back, then fail with EIO",
		"err", err, "outage_timeout", d.opts.OutageTimeout)
	go closeAll(old)
	go d.reconnect(d.mu.gen)
}

// reconnect dials until it has a new generation of connections to the
// same export, or the device is closed.
func (d *Device) reconnect(gen uint64) {
	wait := reconnectMin
	failing := ""
	for attempt := 1; ; attempt++ {
		t := time.NewTimer(wait)
		select {
		case <-d.done:
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, reconnectMax)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			select {
			case <-d.done:
				cancel()
			case <-ctx.Done():
			}
		}()
		conns, ncs, err := d.dial(ctx)
		cancel()
		refused := false
		if err == nil {
			if err = d.same(conns[0]); err != nil {
				refused = true
				closeAll(conns)
			}
		}
		d.mu.Lock()
		if d.mu.closed || d.mu.gen != gen {
			d.mu.Unlock()
			if err == nil {
				closeAll(conns)
			}
			return
		}
		if err != nil {
			d.mu.downErr = err
			d.mu.refused = refused
			d.mu.Unlock()
			if msg := err.Error(); msg != failing {
				failing = msg
				if refused {
					d.log.Error("nbd backing: REFUSED the export now served at this address: it is not the one this cache set was attached to; requests fail with EIO until the right export is back",
						"err", err, "attempt", attempt)
				} else {
					d.log.Warn("nbd backing: reconnect failing; retrying with backoff", "err", err, "attempt", attempt, "retry_in", wait)
				}
			}
			continue
		}
		d.mu.Unlock()
		if err := d.replay(conns[0], ncs[0], gen); err != nil {
			closeAll(conns)
			d.mu.Lock()
			d.mu.downErr = err
			d.mu.Unlock()
			d.log.Warn("nbd backing: replaying unflushed writes on the new connection failed; retrying with backoff", "err", err, "attempt", attempt)
			continue
		}
		d.mu.Lock()
		if d.mu.closed || d.mu.gen != gen {
			d.mu.Unlock()
			closeAll(conns)
			return
		}
		down := time.Since(d.mu.downSince)
		d.mu.conns, d.mu.ncs = conns, ncs
		d.mu.upSince = time.Now()
		d.mu.refused = false
		d.mu.stats.Reconnects++
		d.mu.stats.DownTotal += down
		close(d.mu.up)
		d.mu.Unlock()
		d.log.Info("nbd backing: link up again", "down_for", down.Round(time.Millisecond), "attempts", attempt, "conns", len(conns))
		return
	}
}

// replay writes the unflushed writes again on c, a connection of the
// generation gen that is not yet serving requests (nc is its socket,
// closed if a write gets no reply in the request timeout). Writes that
// complete late on the ended generation are added to d.mu.pend meanwhile;
// replay returns once it has written all of them, with d.mu unlocked.
func (d *Device) replay(c *nbd.Client, nc net.Conn, gen uint64) error {
	done, n := 0, 0
	var bytes int64
	for {
		d.mu.Lock()
		if d.mu.gen != gen || d.mu.closed {
			d.mu.Unlock()
			return nil // the caller sees it and gives up
		}
		if d.mu.overflow {
			// Overflowed meanwhile: what was dropped cannot be replayed.
			d.mu.lost, d.mu.overflow = true, false
		}
		if done > len(d.mu.pend) {
			done = len(d.mu.pend)
		}
		batch := d.mu.pend[done:]
		d.mu.Unlock()
		if len(batch) == 0 {
			if n > 0 {
				d.mu.Lock()
				d.mu.stats.ReplayedWrites += uint64(n)
				d.mu.stats.ReplayedBytes += uint64(bytes)
				d.mu.Unlock()
				d.log.Info("nbd backing: wrote unflushed writes again on the new connection", "writes", n, "bytes", bytes)
			}
			return nil
		}
		for _, u := range batch {
			var err error
			var t *time.Timer
			if d.opts.RequestTimeout > 0 {
				t = time.AfterFunc(d.opts.RequestTimeout, func() {
					nc.Close()
					d.mu.Lock()
					d.mu.stats.Timeouts++
					d.mu.Unlock()
				})
			}
			switch {
			case u.p != nil:
				err = c.WriteAt(u.p, u.off, false)
			case d.flags&nbd.FlagSendWriteZeroes != 0:
				err = c.WriteZeroes(u.off, u.n, false, true, false)
			default:
				z := make([]byte, min(u.n, 1<<20))
				for o := u.off; o < u.off+u.n && err == nil; o += int64(len(z)) {
					err = c.WriteAt(z[:min(int64(len(z)), u.off+u.n-o)], o, false)
				}
			}
			if t != nil && !t.Stop() {
				err = fmt.Errorf("%w (%s)", ErrRequestTimeout, d.opts.RequestTimeout)
			}
			if err != nil {
				return fmt.Errorf("replaying a write at offset %d length %d: %w", u.off, u.n, err)
			}
			bytes += u.n
		}
		done += len(batch)
		n += len(batch)
	}
}

// same checks that a new connection reaches the export the device was
// opened on.
func (d *Device) same(c *nbd.Client) error {
	if c.Size() != d.size {
		return fmt.Errorf("%w: export size is now %d bytes, was %d", ErrRefused, c.Size(), d.size)
	}
	if c.Description() != d.desc {
		return fmt.Errorf("%w: export description is now %q, was %q", ErrRefused, c.Description(), d.desc)
	}
	if c.Flags()&nbd.FlagReadOnly != 0 && d.flags&nbd.FlagReadOnly == 0 {
		return fmt.Errorf("%w: export is now read-only", ErrRefused)
	}
	return nil
}

// isReply reports whether err is the server's answer to a request (as
// opposed to a connection that failed). ESHUTDOWN is the server going away
// and counts as a connection failure.
func isReply(err error) bool {
	var ne *nbd.Error
	return errors.As(err, &ne) && ne.Errno != nbd.ESHUTDOWN
}

// do runs f on a connection, re-running it on the next generation when the
// connection fails or f gets no reply within the request timeout, and
// returns the generation it succeeded on.
func (d *Device) do(off, end int64, f func(c *nbd.Client) error) (uint64, error) {
	var failing time.Time
	for {
		c, gen, done, err := d.conn(off, end)
		if err != nil {
			return 0, err
		}
		err = d.timed(gen, func() error { return f(c) })
		done()
		if err == nil || isReply(err) {
			return gen, err
		}
		d.linkFailed(gen, err, false)
		if err := d.givingUp(&failing, err); err != nil {
			return 0, err
		}
	}
}

// givingUp is called after each failed attempt of a request: it returns
// the request's error once it has been failing for longer than the outage
// timeout (*failing is when it first failed), nil to try again.
func (d *Device) givingUp(failing *time.Time, err error) error {
	if failing.IsZero() {
		*failing = time.Now()
		return nil
	}
	if f := time.Since(*failing); f >= d.opts.OutageTimeout {
		return fmt.Errorf("%w: %w: the request failed on every connection for %s: %w", syscall.EIO, ErrLinkDown, f.Round(time.Millisecond), err)
	}
	return nil
}

// timed runs f, a request on a connection of generation gen, and ends the
// generation (aborting its sockets, which fails f) if f takes longer than
// the request timeout. A reply that beats the abort is kept: the request
// was served.
func (d *Device) timed(gen uint64, f func() error) error {
	if d.opts.RequestTimeout < 0 {
		return f()
	}
	t := time.AfterFunc(d.opts.RequestTimeout, func() {
		d.linkFailed(gen, fmt.Errorf("%w (%s)", ErrRequestTimeout, d.opts.RequestTimeout), true)
	})
	err := f()
	if !t.Stop() && err != nil {
		err = fmt.Errorf("%w (%s): %w", ErrRequestTimeout, d.opts.RequestTimeout, err)
	}
	return err
}

func (d *Device) ioErr(op string, off, n int64, err error) error {
	if errors.Is(err, device.ErrClosed) || errors.Is(err, device.ErrReadOnly) || errors.Is(err, device.ErrOutOfRange) {
		return err
	}
	return &device.IOError{Op: op, Path: d.name, Off: off, Len: n, Err: err}
}

func (d *Device) closed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.closed
}

// ReadAt reads len(p) bytes at off.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	if d.closed() {
		return 0, device.ErrClosed
	}
	if err := device.CheckRange(off, int64(len(p)), d.size); err != nil {
		return 0, device.RangeError("read", off, int64(len(p)), d.size)
	}
	if len(p) == 0 {
		return 0, nil
	}
	var err error
	if lo, hi := d.widen(off, int64(len(p))); lo != off || hi != off+int64(len(p)) {
		b := make([]byte, hi-lo)
		_, err = d.do(lo, hi, func(c *nbd.Client) error { return c.ReadAt(b, lo) })
		copy(p, b[off-lo:])
	} else {
		_, err = d.do(off, off+int64(len(p)), func(c *nbd.Client) error { return c.ReadAt(p, off) })
	}
	if err != nil {
		return 0, d.ioErr("read", off, int64(len(p)), err)
	}
	return len(p), nil
}

// widen returns [off, off+n) widened to the minimum block size.
func (d *Device) widen(off, n int64) (lo, hi int64) {
	m := d.minBlock
	return off &^ (m - 1), (off + n + m - 1) &^ (m - 1)
}

// WriteAt writes p at off.
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := d.writable(); err != nil {
		return 0, err
	}
	if err := device.CheckRange(off, int64(len(p)), d.size); err != nil {
		return 0, device.RangeError("write", off, int64(len(p)), d.size)
	}
	if len(p) == 0 {
		return 0, nil
	}
	var gen uint64
	var err error
	if lo, hi := d.widen(off, int64(len(p))); lo != off || hi != off+int64(len(p)) {
		// Read-modify-write of the blocks the request touches. No other
		// write may run meanwhile: it could land in the same blocks and be
		// overwritten with the old bytes read here.
		d.rmw.Lock()
		b := make([]byte, hi-lo)
		gen, err = d.do(lo, hi, func(c *nbd.Client) error {
			if err := c.ReadAt(b, lo); err != nil {
				return err
			}
			copy(b[off-lo:], p)
			return c.WriteAt(b, lo, false)
		})
		if err == nil {
			d.wrote(gen, lo, b, int64(len(b)))
		}
		d.rmw.Unlock()
	} else {
		d.rmw.RLock()
		gen, err = d.do(off, off+int64(len(p)), func(c *nbd.Client) error { return c.WriteAt(p, off, false) })
		if err == nil {
			d.wrote(gen, off, p, int64(len(p)))
		}
		d.rmw.RUnlock()
	}
	if err != nil {
		return 0, d.ioErr("write", off, int64(len(p)), err)
	}
	return len(p), nil
}

// wrote records a write of n bytes at off completed on generation gen: p
// is its data (copied), nil for write-zeroes.
func (d *Device) wrote(gen uint64, off int64, p []byte, n int64) {
	if d.flags&nbd.FlagSendFlush == 0 {
		return // the server has no write cache: acknowledged is durable
	}
	size := int64(len(p)) + 64
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case gen != d.mu.gen && d.mu.conns != nil:
		// Its generation ended and the next one already replayed what it
		// had: this write may be lost.
		d.mu.lost = true
	case d.mu.overflow:
	case d.mu.pendBytes+size > d.opts.ReplayBytes:
		d.mu.overflow = true
		d.mu.ovfCount++
		d.mu.pend, d.mu.pendBytes = nil, 0
	default:
		u := unflushed{off: off, n: n}
		if p != nil {
			u.p = append([]byte(nil), p...)
		}
		d.mu.pend = append(d.mu.pend, u)
		d.mu.pendBytes += size
	}
}

func (d *Device) writable() error {
	if d.closed() {
		return device.ErrClosed
	}
	if d.flags&nbd.FlagReadOnly != 0 {
		return device.ErrReadOnly
	}
	return nil
}

// Sync sends FLUSH. It fails with ErrNotDurable when an earlier write
// completed on a connection that ended before a flush covered it and could
// not be replayed.
func (d *Device) Sync() error {
	if d.closed() {
		return device.ErrClosed
	}
	if d.flags&nbd.FlagSendFlush == 0 {
		return nil
	}
	var failing time.Time
	for {
		d.mu.Lock()
		c, gen, err := d.connLocked()
		if err != nil {
			d.mu.Unlock()
			return d.ioErr("sync", 0, 0, err)
		}
		if d.mu.lost {
			d.mu.lost = false
			d.mu.stats.NotDurable++
			d.mu.Unlock()
			d.log.Warn("nbd backing: flush refused: writes completed on a connection that ended before a flush covered them, more than could be kept to replay; the server may have lost them")
			return d.ioErr("sync", 0, 0, fmt.Errorf("%w: %w", syscall.EIO, ErrNotDurable))
		}
		// Every write in pend now completed before the FLUSH is sent.
		n, ovf := len(d.mu.pend), d.mu.ovfCount
		d.mu.Unlock()
		err = d.timed(gen, c.Flush)
		if err == nil {
			d.mu.Lock()
			if d.mu.ovfCount == ovf {
				// The FLUSH covers the first n (the list was not reset by
				// an overflow meanwhile) and, if the list had overflowed
				// before it started, the writes dropped then.
				n = min(n, len(d.mu.pend))
				for _, u := range d.mu.pend[:n] {
					d.mu.pendBytes -= int64(len(u.p)) + 64
				}
				d.mu.pend = append([]unflushed(nil), d.mu.pend[n:]...)
				d.mu.overflow = false
			}
			d.mu.Unlock()
			return nil
		}
		if isReply(err) {
			return d.ioErr("sync", 0, 0, err)
		}
		// The connection failed: the writes are replayed on the next
		// one, and a flush there covers them.
		d.linkFailed(gen, err, false)
		if err := d.givingUp(&failing, err); err != nil {
			return d.ioErr("sync", 0, 0, err)
		}
	}
}

// Discard sends TRIM for the whole minimum-size blocks of the range when
// the server supports it; otherwise it does nothing, which the Discarder
// contract allows.
func (d *Device) Discard(off, length int64) error {
	if err := d.writable(); err != nil {
		return err
	}
	if err := device.CheckRange(off, length, d.size); err != nil {
		return device.RangeError("discard", off, length, d.size)
	}
	if d.flags&nbd.FlagSendTrim == 0 || length == 0 {
		return nil
	}
	// Only the whole minimum-size blocks inside the range are trimmed:
	// the contract allows the edges to keep their data.
	m := d.minBlock
	lo, hi := (off+m-1)&^(m-1), (off+length)&^(m-1)
	if hi <= lo {
		return nil
	}
	d.rmw.RLock()
	gen, err := d.do(lo, hi, func(c *nbd.Client) error { return c.Trim(lo, hi-lo, false) })
	d.rmw.RUnlock()
	if err != nil {
		return d.ioErr("discard", lo, hi-lo, err)
	}
	// Not kept for replay: a discarded range may keep its old data.
	_ = gen
	return nil
}

// WriteZeroes sends WRITE_ZEROES when the server supports it (unaligned
// edges as zero writes), else writes zero buffers.
func (d *Device) WriteZeroes(off, length int64) error {
	if err := d.writable(); err != nil {
		return err
	}
	if err := device.CheckRange(off, length, d.size); err != nil {
		return device.RangeError("write-zeroes", off, length, d.size)
	}
	if length == 0 {
		return nil
	}
	m := d.minBlock
	lo, hi := (off+m-1)&^(m-1), (off+length)&^(m-1)
	if d.flags&nbd.FlagSendWriteZeroes == 0 || hi <= lo {
		return d.zeroBuffers(off, length)
	}
	if lo > off {
		if err := d.zeroBuffers(off, lo-off); err != nil {
			return err
		}
	}
	d.rmw.RLock()
	gen, err := d.do(lo, hi, func(c *nbd.Client) error { return c.WriteZeroes(lo, hi-lo, false, true, false) })
	if err == nil {
		d.wrote(gen, lo, nil, hi-lo)
	}
	d.rmw.RUnlock()
	if err != nil {
		return d.ioErr("write-zeroes", lo, hi-lo, err)
	}
	if hi < off+length {
		return d.zeroBuffers(hi, off+length-hi)
	}
	return nil
}

func (d *Device) zeroBuffers(off, length int64) error {
	z := make([]byte, min(length, 1<<20))
	for length > 0 {
		n := min(length, int64(len(z)))
		if _, err := d.WriteAt(z[:n], off); err != nil {
			return err
		}
		off, length = off+n, length-n
	}
	return nil
}

// Close closes the connections and stops reconnecting. It does not flush.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return nil
	}
	d.mu.closed = true
	conns := d.mu.conns
	d.mu.conns, d.mu.ncs = nil, nil
	close(d.done)
	d.mu.Unlock()
	closeAll(conns)
	return nil
}
