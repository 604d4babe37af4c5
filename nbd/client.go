package nbd

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// ErrUnknownExport is returned (wrapped) by Dial when the server does not
// have the export.
var ErrUnknownExport = errors.New("nbd: unknown export")

// ClientOptions configures Dial.
type ClientOptions struct {
	// StructuredReplies asks for NBD_OPT_STRUCTURED_REPLY.
	StructuredReplies bool
	// BlockStatus selects the base:allocation meta context (implies
	// StructuredReplies), enabling Client.BlockStatus.
	BlockStatus bool
	// TLSConfig makes the client start with NBD_OPT_STARTTLS and fail if
	// the server refuses TLS.
	TLSConfig *tls.Config
}

// Client is an NBD client connection to one export. Its methods are safe
// for concurrent use and pipelined: many requests can be in flight, and
// replies are matched by handle. Client implements Backend, Trimmer,
// ZeroWriter and Prefetcher, so a remote export can back a local one.
type Client struct {
	nc net.Conn
	br *bufio.Reader // reader goroutine only after Dial

	size        uint64
	flags       uint16
	minBlock    uint32
	prefBlock   uint32
	maxBlock    uint32
	structured  bool
	blockStatus bool
	metaID      uint32
	name        string
	description string

	wmu     sync.Mutex    // guards the fields below
	wq      []*call       // requests waiting to be written
	wspare  []*call       // the other queue buffer, swapped with wq
	writing bool          // a goroutine is writing; it will drain wq
	wdead   bool          // the reader has exited: nothing more is written
	wcond   sync.Cond     // signalled when writing becomes false
	iov     [][]byte      // owned by the goroutine with writing set
	wbufs   net.Buffers   // likewise; a field so that WriteTo does not allocate
	bw      *bufio.Writer // with TLS: one record per batch, not per buffer

	mu struct {
		sync.Mutex // guards the fields below
		pending    map[uint64]*call
		next       uint64
		err        error // terminal error; set once
	}
	readerDone chan struct{}
	inflight   atomic.Int64 // calls sent and not yet completed by a reply
	rscratch   [16]byte     // reader goroutine only
	closeOnce  sync.Once
}

// call is one request in flight.
type call struct {
	h      requestHeader
	p      []byte // READ destination
	got    uint64 // structured READ bytes received
	err    error
	extent [2]uint32 // BLOCK_STATUS first extent (length, flags)
	done   chan struct{}
	hdr    [requestHeaderSize]byte
	bufArr [2][]byte
	bufs   net.Buffers
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// Size returns the export size in bytes.
func (c *Client) Size() int64 { return int64(c.size) }

// Flags returns the transmission flags (FlagReadOnly, FlagSendTrim, ...).
func (c *Client) Flags() uint16 { return c.flags }

// BlockSizes returns the server's minimum, preferred and maximum block
// sizes (defaults 1, 4096, 32 MiB when the server sent none).
func (c *Client) BlockSizes() (min, preferred, max uint32) {
	return c.minBlock, c.prefBlock, c.maxBlock
}

// StructuredReplies reports whether structured replies were negotiated.
func (c *Client) StructuredReplies() bool { return c.structured }

// ExportName returns the export's canonical name (as sent by the server,
// else as requested) and Description its description, if any.
func (c *Client) ExportName() string  { return c.name }
func (c *Client) Description() string { return c.description }

// Dial connects to an NBD server and negotiates exportName with fixed
// newstyle and NBD_OPT_GO (falling back to NBD_OPT_EXPORT_NAME). ctx bounds
// the connection and handshake only.
func Dial(ctx context.Context, network, addr, exportName string, opts ClientOptions) (*Client, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	c, err := NewClient(ctx, nc, exportName, opts)
	if err != nil {
		nc.Close()
		return nil, err
	}
	return c, nil
}

// NewClient negotiates over an established connection (for instance one
// end of net.Pipe). On error the caller closes nc.
func NewClient(ctx context.Context, nc net.Conn, exportName string, opts ClientOptions) (*Client, error) {
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	c := &Client{nc: nc, br: bufio.NewReaderSize(nc, 64<<10), readerDone: make(chan struct{})}
	c.mu.pending = make(map[uint64]*call)
	c.wcond.L = &c.wmu
	stop := watchCtx(ctx, nc)
	err := c.handshake(exportName, opts)
	if !stop() && err == nil {
		// ctx ended at the last moment; its deadline poisoning may still
		// land, so the connection is unusable.
		err = errors.New("nbd: handshake interrupted")
	}
	if err != nil {
		if cerr := context.Cause(ctx); cerr != nil {
			err = fmt.Errorf("%w (%w)", err, cerr)
		} else if _, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("%w (%w)", err, context.DeadlineExceeded)
		}
		return nil, err
	}
	nc.SetDeadline(time.Time{})
	go c.readLoop()
	return c, nil
}

// watchCtx makes blocking I/O on nc fail when ctx ends; stop reports
// whether ctx had not ended.
func watchCtx(ctx context.Context, nc net.Conn) (stop func() bool) {
	if d, ok := ctx.Deadline(); ok {
		nc.SetDeadline(d)
	}
	return context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
}

// clientHello performs the initial exchange, returning whether the server
// offered NO_ZEROES.
func clientHello(nc net.Conn, br *bufio.Reader) (noZeroes bool, err error) {
	var b [18]byte
	if _, err := io.ReadFull(br, b[:]); err != nil {
		return false, fmt.Errorf("nbd: read greeting: %w", err)
	}
	if binary.BigEndian.Uint64(b[0:]) != nbdMagic || binary.BigEndian.Uint64(b[8:]) != ihaveOpt {
		return false, errors.New("nbd: not a newstyle NBD server")
	}
	hf := binary.BigEndian.Uint16(b[16:])
	if hf&flagFixedNewstyle == 0 {
		return false, errors.New("nbd: server does not support fixed newstyle negotiation")
	}
	cf := flagCFixedNewstyle
	if hf&flagNoZeroes != 0 {
		cf |= flagCNoZeroes
	}
	if _, err := nc.Write(binary.BigEndian.AppendUint32(nil, cf)); err != nil {
		return false, err
	}
	return cf&flagCNoZeroes != 0, nil
}

func sendOption(nc net.Conn, opt uint32, data []byte) error {
	b := make([]byte, 16, 16+len(data))
	binary.BigEndian.PutUint64(b, ihaveOpt)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
	_, err := nc.Write(append(b, data...))
	return err
}

// readOptReply reads one option reply for opt.
func readOptReply(br *bufio.Reader, opt uint32) (typ uint32, data []byte, err error) {
	var b [20]byte
	if _, err := io.ReadFull(br, b[:]); err != nil {
		return 0, nil, fmt.Errorf("nbd: read option reply: %w", err)
	}
	if binary.BigEndian.Uint64(b[0:]) != optReplyMagic {
		return 0, nil, errors.New("nbd: bad option reply magic")
	}
	if o := binary.BigEndian.Uint32(b[8:]); o != opt {
		return 0, nil, fmt.Errorf("nbd: option reply for %d, want %d", o, opt)
	}
	typ = binary.BigEndian.Uint32(b[12:])
	n := binary.BigEndian.Uint32(b[16:])
	if n > 1<<20 {
		return 0, nil, fmt.Errorf("nbd: option reply length %d too large", n)
	}
	data = make([]byte, n)
	if _, err := io.ReadFull(br, data); err != nil {
		return 0, nil, fmt.Errorf("nbd: read option reply: %w", err)
	}
	return typ, data, nil
}

func optError(opt, typ uint32, data []byte) error {
	var err error
	switch typ {
	case repErrUnknown:
		err = ErrUnknownExport
	case repErrUnsup:
		err = errors.ErrUnsupported
	default:
		err = fmt.Errorf("nbd: option %d failed with reply %#x", opt, typ)
	}
	if len(data) > 0 {
		return fmt.Errorf("%w: %s", err, data)
	}
	return err
}

func (c *Client) handshake(name string, opts ClientOptions) error {
	noZeroes, err := clientHello(c.nc, c.br)
	if err != nil {
		return err
	}
	if opts.TLSConfig != nil {
		if err := sendOption(c.nc, optStartTLS, nil); err != nil {
			return err
		}
		typ, data, err := readOptReply(c.br, optStartTLS)
		if err != nil {
			return err
		}
		if typ != repAck {
			return fmt.Errorf("nbd: server refused TLS: %w", optError(optStartTLS, typ, data))
		}
		if c.br.Buffered() != 0 {
			return errors.New("nbd: server sent data before the TLS handshake")
		}
		tc := tls.Client(c.nc, opts.TLSConfig)
		if err := tc.Handshake(); err != nil {
			return fmt.Errorf("nbd: TLS handshake: %w", err)
		}
		c.nc = tc
		c.br.Reset(tc)
		c.bw = bufio.NewWriterSize(tc, 64<<10)
	}
	if opts.StructuredReplies || opts.BlockStatus {
		if err := sendOption(c.nc, optStructuredReply, nil); err != nil {
			return err
		}
		typ, data, err := readOptReply(c.br, optStructuredReply)
		switch {
		case err != nil:
			return err
		case typ == repAck:
			c.structured = true
		case typ&repFlagError == 0:
			return fmt.Errorf("nbd: unexpected reply %d to NBD_OPT_STRUCTURED_REPLY", typ)
		default:
			_ = data // not supported: carry on with simple replies
		}
	}
	if opts.BlockStatus && c.structured {
		q := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
		q = append(q, name...)
		q = binary.BigEndian.AppendUint32(q, 1)
		q = binary.BigEndian.AppendUint32(q, uint32(len(metaContextBaseAlloc)))
		q = append(q, metaContextBaseAlloc...)
		if err := sendOption(c.nc, optSetMetaContext, q); err != nil {
			return err
		}
		for {
			typ, data, err := readOptReply(c.br, optSetMetaContext)
			if err != nil {
				return err
			}
			if typ == repMetaContext && len(data) >= 4 && string(data[4:]) == metaContextBaseAlloc {
				c.metaID = binary.BigEndian.Uint32(data)
				c.blockStatus = true
				continue
			}
			if typ == repAck || typ&repFlagError != 0 {
				break
			}
		}
	}

	c.name = name
	c.minBlock, c.prefBlock, c.maxBlock = 1, 4096, defaultMaxBlockSize
	q := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	q = append(q, name...)
	q = binary.BigEndian.AppendUint16(q, 3)
	q = binary.BigEndian.AppendUint16(q, infoBlockSize)
	q = binary.BigEndian.AppendUint16(q, infoName)
	q = binary.BigEndian.AppendUint16(q, infoDescription)
	if err := sendOption(c.nc, optGo, q); err != nil {
		return err
	}
	gotExport := false
	for {
		typ, data, err := readOptReply(c.br, optGo)
		if err != nil {
			return err
		}
		switch {
		case typ == repInfo:
			if len(data) < 2 {
				return errors.New("nbd: short NBD_REP_INFO")
			}
			switch binary.BigEndian.Uint16(data) {
			case infoExport:
				if len(data) != 12 {
					return errors.New("nbd: bad NBD_INFO_EXPORT")
				}
				c.size = binary.BigEndian.Uint64(data[2:])
				c.flags = binary.BigEndian.Uint16(data[10:])
				gotExport = true
			case infoName:
				c.name = string(data[2:])
			case infoDescription:
				c.description = string(data[2:])
			case infoBlockSize:
				if len(data) != 14 {
					return errors.New("nbd: bad NBD_INFO_BLOCK_SIZE")
				}
				c.minBlock = binary.BigEndian.Uint32(data[2:])
				c.prefBlock = binary.BigEndian.Uint32(data[6:])
				c.maxBlock = binary.BigEndian.Uint32(data[10:])
			}
		case typ == repAck:
			if !gotExport {
				return errors.New("nbd: NBD_OPT_GO succeeded without NBD_INFO_EXPORT")
			}
			return nil
		case typ == repErrUnsup:
			return c.exportName(name, noZeroes)
		case typ&repFlagError != 0:
			return fmt.Errorf("nbd: export %q: %w", name, optError(optGo, typ, data))
		default:
			return fmt.Errorf("nbd: unexpected reply %d to NBD_OPT_GO", typ)
		}
	}
}

// exportName is the fallback for servers without NBD_OPT_GO.
func (c *Client) exportName(name string, noZeroes bool) error {
	if err := sendOption(c.nc, optExportName, []byte(name)); err != nil {
		return err
	}
	n := 10 + 124
	if noZeroes {
		n = 10
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c.br, b); err != nil {
		return fmt.Errorf("nbd: export %q: %w", name, err)
	}
	c.size = binary.BigEndian.Uint64(b)
	c.flags = binary.BigEndian.Uint16(b[8:])
	return nil
}

// List returns the names of the exports a server offers (NBD_OPT_LIST).
func List(ctx context.Context, network, addr string) ([]string, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	stop := watchCtx(ctx, nc)
	defer stop()
	br := bufio.NewReader(nc)
	if _, err := clientHello(nc, br); err != nil {
		return nil, err
	}
	if err := sendOption(nc, optList, nil); err != nil {
		return nil, err
	}
	var names []string
	for {
		typ, data, err := readOptReply(br, optList)
		if err != nil {
			return nil, err
		}
		if typ == repAck {
			break
		}
		if typ != repServer {
			return nil, optError(optList, typ, data)
		}
		if len(data) < 4 || uint64(binary.BigEndian.Uint32(data)) > uint64(len(data)-4) {
			return nil, errors.New("nbd: bad NBD_REP_SERVER")
		}
		names = append(names, string(data[4:4+binary.BigEndian.Uint32(data)]))
	}
	if err := sendOption(nc, optAbort, nil); err == nil {
		readOptReply(br, optAbort) // best effort
	}
	return names, nil
}

// ReadAt reads len(p) bytes at off. Requests longer than the maximum block
// size are split.
func (c *Client) ReadAt(p []byte, off int64) error {
	return c.split(p, off, func(q []byte, o int64) error {
		return c.do(cmdRead, 0, uint64(o), uint32(len(q)), nil, q)
	})
}

// WriteAt writes p at off; with fua the write is durable when it returns.
func (c *Client) WriteAt(p []byte, off int64, fua bool) error {
	var f uint16
	if fua {
		f = CmdFlagFUA
	}
	return c.split(p, off, func(q []byte, o int64) error {
		return c.do(cmdWrite, f, uint64(o), uint32(len(q)), q, nil)
	})
}

func (c *Client) split(p []byte, off int64, f func([]byte, int64) error) error {
	if off < 0 {
		return &Error{Errno: EINVAL, Op: "client", Message: "negative offset"}
	}
	max := int(c.maxBlock)
	if max <= 0 || max > defaultMaxBlockSize {
		max = defaultMaxBlockSize
	}
	for len(p) > max {
		if err := f(p[:max], off); err != nil {
			return err
		}
		p, off = p[max:], off+int64(max)
	}
	return f(p, off)
}

// Flush sends NBD_CMD_FLUSH.
func (c *Client) Flush() error { return c.do(cmdFlush, 0, 0, 0, nil, nil) }

// Trim sends NBD_CMD_TRIM.
func (c *Client) Trim(off, length int64, fua bool) error {
	var f uint16
	if fua {
		f = CmdFlagFUA
	}
	return c.ranged(cmdTrim, f, off, length)
}

// WriteZeroes sends NBD_CMD_WRITE_ZEROES; mayTrim false sets NO_HOLE,
// fastOnly sets FAST_ZERO (the error then matches errors.ErrUnsupported
// when the server cannot zero fast).
func (c *Client) WriteZeroes(off, length int64, fua, mayTrim, fastOnly bool) error {
	var f uint16
	if fua {
		f |= CmdFlagFUA
	}
	if !mayTrim {
		f |= CmdFlagNoHole
	}
	if fastOnly {
		f |= CmdFlagFastZero
	}
	return c.ranged(cmdWriteZeroes, f, off, length)
}

// Cache sends NBD_CMD_CACHE; Prefetch is the same, for the Prefetcher
// interface.
func (c *Client) Cache(off, length int64) error    { return c.ranged(cmdCache, 0, off, length) }
func (c *Client) Prefetch(off, length int64) error { return c.Cache(off, length) }

// BlockStatus queries base:allocation at off (Dial with BlockStatus). It
// returns the first extent's length and flags.
func (c *Client) BlockStatus(off, length int64) (extLen, flags uint32, err error) {
	if !c.blockStatus {
		return 0, 0, errors.ErrUnsupported
	}
	cl, err := c.start(cmdBlockStatus, CmdFlagReqOne, uint64(off), uint32(length), nil, nil)
	if err != nil {
		return 0, 0, err
	}
	<-cl.done
	err, extLen, flags = cl.err, cl.extent[0], cl.extent[1]
	c.release(cl)
	return extLen, flags, err
}

// ranged issues a command with no payload, splitting lengths above 4 GiB.
func (c *Client) ranged(typ, flags uint16, off, length int64) error {
	if off < 0 || length < 0 {
		return &Error{Errno: EINVAL, Op: cmdName(typ), Message: "negative offset or length"}
	}
	const chunk = 1 << 30
	for length > chunk {
		if err := c.do(typ, flags, uint64(off), chunk, nil, nil); err != nil {
			return err
		}
		off, length = off+chunk, length-chunk
	}
	return c.do(typ, flags, uint64(off), uint32(length), nil, nil)
}

// do sends one request and waits for its reply. wdata is a WRITE payload
// (len must equal length for a valid request); rdata receives READ data.
func (c *Client) do(typ, flags uint16, off uint64, length uint32, wdata, rdata []byte) error {
	cl, err := c.start(typ, flags, off, length, wdata, rdata)
	if err != nil {
		return err
	}
	<-cl.done
	err = cl.err
	c.release(cl)
	return err
}

func (c *Client) release(cl *call) {
	cl.p, cl.err, cl.got, cl.extent = nil, nil, 0, [2]uint32{}
	cl.bufArr = [2][]byte{}
	callPool.Put(cl)
}

// start registers and sends a request; the reply completes cl.done.
func (c *Client) start(typ, flags uint16, off uint64, length uint32, wdata, rdata []byte) (*call, error) {
	cl := callPool.Get().(*call)
	cl.p = rdata
	c.mu.Lock()
	if c.mu.err != nil {
		err := c.mu.err
		c.mu.Unlock()
		callPool.Put(cl)
		return nil, err
	}
	c.mu.next++
	cl.h = requestHeader{Flags: flags, Type: typ, Handle: c.mu.next, Offset: off, Length: length}
	c.mu.pending[cl.h.Handle] = cl
	c.mu.Unlock()
	c.inflight.Add(1)

	encodeRequest(cl.hdr[:], cl.h)
	cl.bufArr[0] = cl.hdr[:]
	cl.bufs = cl.bufArr[:1]
	if len(wdata) > 0 {
		cl.bufArr[1] = wdata
		cl.bufs = cl.bufArr[:2]
	}
	c.send(cl)
	return cl, nil
}

// send queues cl's request for writing. As on the server, the goroutine
// that finds the writer idle writes everything queued, so concurrent
// requests share writev calls. cl's buffers stay untouched until its reply
// (or failure) completes it, which cannot happen before it is written.
func (c *Client) send(cl *call) {
	c.wmu.Lock()
	if c.wdead {
		// The reader has failed (or is failing) every pending call,
		// including this one.
		c.wmu.Unlock()
		return
	}
	c.wq = append(c.wq, cl)
	if c.writing {
		c.wmu.Unlock()
		return
	}
	c.writing = true
	if c.inflight.Load() > int64(len(c.wq)) {
		// Callers woken by the same burst of replies are likely about to
		// send too: let them join this batch.
		c.wmu.Unlock()
		runtime.Gosched()
		c.wmu.Lock()
	}
	for len(c.wq) > 0 {
		batch := c.wq
		c.wq = c.wspare[:0]
		c.wmu.Unlock()
		c.iov = c.iov[:0]
		for _, cl := range batch {
			c.iov = append(c.iov, cl.bufs...)
		}
		clear(batch)
		var err error
		if c.bw != nil {
			err = writeAllBuffered(c.bw, c.iov)
		} else {
			c.wbufs = c.iov
			_, err = c.wbufs.WriteTo(c.nc)
		}
		clear(c.iov[:cap(c.iov)])
		if err != nil {
			// The reader fails every pending call, including these.
			c.fail(fmt.Errorf("nbd: send request: %w", err))
		}
		c.wmu.Lock()
		c.wspare = batch[:0]
	}
	c.writing = false
	c.wcond.Broadcast()
	c.wmu.Unlock()
}

// fail makes the client unusable with err and closes the connection.
func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.mu.err == nil {
		c.mu.err = err
	}
	c.mu.Unlock()
	c.nc.Close()
}

// Close sends NBD_CMD_DISC, waits (up to 5 s) for the server to finish the
// requests in flight and close, and closes the connection.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		alive := c.mu.err == nil
		if alive {
			c.mu.err = ErrClosed
		}
		c.mu.Unlock()
		if alive {
			disc := &call{}
			encodeRequest(disc.hdr[:], requestHeader{Type: cmdDisc})
			disc.bufs = net.Buffers{disc.hdr[:]}
			c.send(disc)
			select {
			case <-c.readerDone:
			case <-time.After(5 * time.Second):
			}
		}
		c.nc.Close()
		<-c.readerDone
	})
	return nil
}

// readLoop reads replies and completes calls until the connection ends.
func (c *Client) readLoop() {
	defer close(c.readerDone)
	err := c.readReplies()
	c.mu.Lock()
	if c.mu.err == nil {
		c.mu.err = fmt.Errorf("nbd: connection lost: %w", err)
	}
	ferr := c.mu.err
	pending := c.mu.pending
	c.mu.pending = make(map[uint64]*call)
	c.mu.Unlock()
	c.nc.Close()
	// Let a writer still sending (to the closed connection) finish before
	// completing calls, whose buffers their owners may then reuse.
	c.wmu.Lock()
	c.wdead = true
	for c.writing {
		c.wcond.Wait()
	}
	c.wmu.Unlock()
	c.inflight.Add(-int64(len(pending)))
	for _, cl := range pending {
		cl.err = ferr
		cl.done <- struct{}{}
	}
}

// lookup finds the call a reply is for. The call stays pending until
// complete, so that if the reply turns out to be broken, readLoop fails it.
func (c *Client) lookup(handle uint64) (*call, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl, ok := c.mu.pending[handle]
	if !ok {
		return nil, fmt.Errorf("nbd: reply for unknown handle %d", handle)
	}
	return cl, nil
}

func (c *Client) complete(cl *call) {
	c.mu.Lock()
	delete(c.mu.pending, cl.h.Handle)
	c.mu.Unlock()
	c.inflight.Add(-1)
	cl.done <- struct{}{}
}

func (c *Client) readReplies() error {
	var b [structuredReplyHdrLen]byte
	for {
		if _, err := io.ReadFull(c.br, b[:4]); err != nil {
			return err
		}
		switch binary.BigEndian.Uint32(b[:4]) {
		case simpleReplyMagic:
			if _, err := io.ReadFull(c.br, b[4:simpleReplySize]); err != nil {
				return err
			}
			errno := binary.BigEndian.Uint32(b[4:])
			cl, err := c.lookup(binary.BigEndian.Uint64(b[8:]))
			if err != nil {
				return err
			}
			var cerr error
			if errno != 0 {
				cerr = &Error{Errno: errno, Op: cmdName(cl.h.Type), Offset: cl.h.Offset, Length: cl.h.Length}
			} else if cl.h.Type == cmdRead {
				if c.structured {
					return errors.New("nbd: simple reply to READ with structured replies")
				}
				if uint64(len(cl.p)) < uint64(cl.h.Length) {
					return errors.New("nbd: READ buffer shorter than request")
				}
				if _, err := io.ReadFull(c.br, cl.p[:cl.h.Length]); err != nil {
					return err
				}
			}
			cl.err = cerr
			c.complete(cl)

		case structuredReplyMagic:
			if !c.structured {
				return errors.New("nbd: unexpected structured reply")
			}
			if _, err := io.ReadFull(c.br, b[4:structuredReplyHdrLen]); err != nil {
				return err
			}
			flags := binary.BigEndian.Uint16(b[4:])
			done := flags&replyFlagDone != 0
			cl, err := c.lookup(binary.BigEndian.Uint64(b[8:]))
			if err != nil {
				return err
			}
			if err := c.readChunk(cl, binary.BigEndian.Uint16(b[6:]), binary.BigEndian.Uint32(b[16:])); err != nil {
				return err
			}
			if done {
				if cl.err == nil && cl.h.Type == cmdRead && cl.got != uint64(cl.h.Length) {
					return fmt.Errorf("nbd: READ reply covered %d of %d bytes", cl.got, cl.h.Length)
				}
				c.complete(cl)
			}
		default:
			return errors.New("nbd: bad reply magic")
		}
	}
}

// readChunk consumes one structured chunk's payload for cl.
func (c *Client) readChunk(cl *call, typ uint16, n uint32) error {
	b := c.rscratch[:]
	switch typ {
	case replyTypeNone:
		if n != 0 {
			return errors.New("nbd: NBD_REPLY_TYPE_NONE with payload")
		}
		return nil
	case replyTypeOffsetData, replyTypeOffsetHole:
		if cl.h.Type != cmdRead || (typ == replyTypeOffsetData && n < 9) || (typ == replyTypeOffsetHole && n != 12) {
			return errors.New("nbd: bad content chunk")
		}
		if _, err := io.ReadFull(c.br, b[:8]); err != nil {
			return err
		}
		o := binary.BigEndian.Uint64(b)
		dlen := uint64(n - 8)
		if typ == replyTypeOffsetHole {
			if _, err := io.ReadFull(c.br, b[8:12]); err != nil {
				return err
			}
			dlen = uint64(binary.BigEndian.Uint32(b[8:]))
		}
		if o < cl.h.Offset || o-cl.h.Offset > uint64(cl.h.Length) || dlen > uint64(cl.h.Length)-(o-cl.h.Offset) {
			return errors.New("nbd: content chunk outside the request")
		}
		dst := cl.p[o-cl.h.Offset : o-cl.h.Offset+dlen]
		if typ == replyTypeOffsetHole {
			clear(dst)
		} else if _, err := io.ReadFull(c.br, dst); err != nil {
			return err
		}
		cl.got += dlen
		return nil
	case replyTypeBlockStatus:
		if cl.h.Type != cmdBlockStatus || n < 12 || (n-4)%8 != 0 {
			return errors.New("nbd: bad block status chunk")
		}
		if _, err := io.ReadFull(c.br, b[:12]); err != nil {
			return err
		}
		cl.extent = [2]uint32{binary.BigEndian.Uint32(b[4:]), binary.BigEndian.Uint32(b[8:])}
		_, err := io.CopyN(io.Discard, c.br, int64(n-12))
		return err
	}
	if typ&replyTypeErrorBit == 0 {
		return fmt.Errorf("nbd: unknown reply chunk type %d", typ)
	}
	if n < 6 || n > 6+maxStringLen+8 {
		return fmt.Errorf("nbd: error chunk length %d", n)
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(c.br, p); err != nil {
		return err
	}
	ml := uint32(binary.BigEndian.Uint16(p[4:]))
	if ml > n-6 {
		return errors.New("nbd: error message longer than chunk")
	}
	e := &Error{Errno: binary.BigEndian.Uint32(p), Op: cmdName(cl.h.Type), Offset: cl.h.Offset, Length: cl.h.Length, Message: string(p[6 : 6+ml])}
	if typ == replyTypeErrorOffset && n-6-ml >= 8 {
		e.Offset = binary.BigEndian.Uint64(p[6+ml:])
	}
	if cl.err == nil {
		cl.err = e
	}
	return nil
}

var (
	_ Backend    = (*Client)(nil)
	_ Trimmer    = (*Client)(nil)
	_ ZeroWriter = (*Client)(nil)
	_ Prefetcher = (*Client)(nil)
)
