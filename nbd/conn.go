package nbd

// Invariants of a connection in the transmission phase:
//
//  1. Only the reader goroutine (serve/transmit) reads from c.br and sends
//     on c.work; it alone closes c.work, after which it waits for workers
//     (c.wg, which also counts READs started with the backend's
//     StartReadAt until their reply is queued, a flushReplies due for
//     them, and a writer goroutine writeRest started for them).
//  2. Replies are queued on c.wq and written by one goroutine at a time
//     (the worker, or the flushReplies, that found the writer idle), whole
//     replies in one writev, so replies never interleave and a burst of
//     replies costs one syscall. A completion of StartReadAt (on the
//     backend's goroutine, which must not block) queues its reply; one
//     flushReplies after the backend's batch of completions tries a
//     non-blocking writev of them all, and what the socket does not take
//     goes to a new writer goroutine. A READ the reader served itself
//     (readNow) is replied to the same way, by the reader.
//  3. A success reply is written only after the backend call returned nil;
//     a READ's data is complete before its header is sent.
//  4. Every request dispatched to a worker, and every error reply sent by
//     the reader, holds r.charge (>= minCharge) bytes of c.sem, released
//     with its buffers by the writer after the reply was written or failed
//     to be. c.running counts the same requests.
//  5. serve closes the connection only after every worker has exited. A
//     failed reply write or a forced Shutdown closes it earlier; that only
//     makes the reader and later writes fail.
//  6. The reader plugs the backend (Plugger) only to start a READ with
//     another request already in its buffer, and unplugs before anything
//     that may wait (reading the socket, the budget, a worker, a payload,
//     writing a reply, the end of the connection): the reads it holds back
//     are started, and nothing they need waits on the reader.

import (
	"bufio"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

type conn struct {
	s    *Server
	done chan struct{} // closed when serve returned (Server.CloseExport waits)
	raw  net.Conn      // the accepted connection; never replaced
	nc   net.Conn      // what we speak NBD over (raw, or later a tls.Conn)
	br   *bufio.Reader
	log  *slog.Logger

	mu struct {
		sync.Mutex        // guards the fields below and deadline changes
		transmission bool // the option phase is over
		shutdown     bool // Shutdown was called
	}

	// Negotiated during the handshake; read-only afterwards.
	tlsOn        bool          // c.nc is a *tls.Conn
	bw           *bufio.Writer // with TLS: coalesces a batch into few records
	noZeroes     bool
	structured   bool
	metaSelected bool   // base:allocation selected by SET_META_CONTEXT...
	metaExport   string // ...for this export name
	optBuf       []byte
	x            *export
	size         uint64
	flags        uint16
	blockStatus  bool
	slot         bool // holds a MaxConnections slot (Server.takeSlot)

	// Transmission phase.
	sem      *byteSem
	work     chan *request
	nworkers int            // reader-owned
	wg       sync.WaitGroup // running workers
	hdr      [requestHeaderSize]byte
	running  atomic.Int64  // requests dispatched and not yet replied to
	lastTurn chan struct{} // reader-owned: the last dispatched write's turn
	plugged  bool          // reader-owned: it holds c.x.plugger's plug (invariant 6)
	draining atomic.Bool   // Shutdown began: refuse what is already buffered
	// replyDead is set with werr: no reply can reach the client any more,
	// so the reader stops instead of executing what the client left
	// buffered (a client that vanished with thousands of pipelined
	// requests would otherwise hold budget until all of them had run).
	replyDead atomic.Bool

	wmu     sync.Mutex // guards the fields below
	wq      []*request // replies waiting for the writer
	wspare  []*request // the other queue buffer, swapped with wq
	writing bool       // a goroutine is writing; it will drain wq
	// flushLater: a flushReplies is due after the backend's current batch
	// of completions (queueReplyLater); it will drain wq.
	flushLater bool
	werr       error       // first write error; later replies are dropped
	iov        [][]byte    // owned by the goroutine with writing set
	wbufs      net.Buffers // likewise; a field so that WriteTo does not allocate
	// rc is the raw socket for non-blocking writes (tryWrite); nil with
	// TLS or a net.Conn without a descriptor. Set before transmission.
	rc syscall.RawConn
}

// request is one command being executed by a worker. Requests are pooled.
type request struct {
	h      requestHeader
	buf    *[]byte // payload (WRITE) or reply data (READ); nil otherwise
	charge int64   // bytes held in c.sem
	hdr    [32]byte
	bufArr [2][]byte
	bufs   net.Buffers
	// turn is closed when this write starts in the backend; prev is the
	// turn of the write dispatched before it on the connection (nil for
	// the first). See handle.
	turn, prev chan struct{}
}

// minCharge is the least a request counts against Config.MaxInFlightBytes.
const minCharge = 1024

var requestPool = sync.Pool{New: func() any { return new(request) }}

func newConn(s *Server, nc net.Conn) *conn {
	c := &conn{
		s:    s,
		done: make(chan struct{}),
		raw:  nc,
		nc:   nc,
		br:   bufio.NewReaderSize(nc, 64<<10),
		log:  s.log.With("remote", nc.RemoteAddr().String()),
		sem:  s.budget.newSem(s.cfg.MaxInFlightBytes, s.reserve),
	}
	return c
}

func (c *conn) shuttingDown() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mu.shutdown
}

// beginShutdown is called by Server.Shutdown: a connection still in the
// handshake is closed; one in transmission stops reading new requests and
// drains.
func (c *conn) beginShutdown() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.mu.shutdown = true
	if !c.mu.transmission {
		c.raw.Close()
		return
	}
	c.draining.Store(true)
	c.raw.SetReadDeadline(time.Now())
	c.sem.abort()
}

// servedExport returns the export of a connection that reached the
// transmission phase, else nil.
func (c *conn) servedExport() *export {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.mu.transmission {
		return nil
	}
	return c.x // written before transmission was set under c.mu
}

// serve runs the connection to its end.
func (c *conn) serve() {
	defer func() {
		if c.tlsOn {
			c.nc.Close() // sends close_notify, then closes c.raw
		}
		c.raw.Close()
	}()
	if err := c.handshake(); err != nil {
		if !errors.Is(err, errAbort) && !errors.Is(err, io.EOF) {
			c.log.Debug("nbd: handshake failed", "err", err)
		}
		return
	}
	c.log = c.log.With("export", c.x.Name)
	c.log.Debug("nbd: transmission", "size", c.size, "flags", c.flags, "structured", c.structured)
	c.transmit()
}

// transmit is the reader loop of the transmission phase.
func (c *conn) transmit() {
	c.work = make(chan *request)
	if sc, ok := c.nc.(syscall.Conn); ok && c.bw == nil {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
		}
	}
	disc := false
	for {
		if c.draining.Load() && c.br.Buffered() < requestHeaderSize {
			break // nothing more can arrive: the read deadline has passed
		}
		if c.replyDead.Load() {
			break // the client is gone: its buffered requests have no one to answer
		}
		if c.br.Buffered() < requestHeaderSize {
			c.unplug() // the next header may have to be waited for
		}
		if _, err := io.ReadFull(c.br, c.hdr[:]); err != nil {
			if !c.quietReadErr(err) {
				c.log.Debug("nbd: read request", "err", err)
			}
			break
		}
		h, ok := decodeRequest(c.hdr[:])
		if !ok {
			c.log.Warn("nbd: bad request magic, closing connection")
			break
		}
		if h.Type == cmdDisc {
			disc = true
			break
		}
		if c.draining.Load() {
			c.unplug()
			if !c.refuse(h) {
				break
			}
			continue
		}
		if !c.dispatch(h) {
			break
		}
	}
	c.unplug()
	close(c.work)
	c.wg.Wait()
	if disc {
		if err := c.x.Backend.Flush(); err != nil {
			c.log.Error("nbd: backend error", "cmd", "FLUSH (disconnect)", "err", err)
		}
	}
}

func (c *conn) quietReadErr(err error) bool {
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return true
	}
	return errors.Is(err, os.ErrDeadlineExceeded) && c.shuttingDown()
}

// dispatch validates a request, reads its payload and hands it to a worker.
// It returns false when the connection must be closed.
func (c *conn) dispatch(h requestHeader) bool {
	errno, msg := c.validate(h)
	async := errno == 0 && h.Type == cmdRead && h.Length > 0 && c.x.asyncReader != nil
	if !async {
		c.unplug() // what follows may wait (invariant 6)
	}
	if h.Type == cmdWrite && errno != 0 {
		if h.Length > hardMaxPayload {
			c.log.Warn("nbd: write payload too large, closing connection", "length", h.Length)
			return false
		}
		if _, err := io.CopyN(io.Discard, c.br, int64(h.Length)); err != nil {
			return false
		}
	}
	if errno != 0 {
		c.log.Debug("nbd: invalid request", "cmd", cmdName(h.Type), "flags", h.Flags, "offset", h.Offset, "length", h.Length, "errno", errno, "why", msg)
		// Error replies hold budget too: a client sending only invalid
		// requests, and reading no replies, must be bounded as well.
		if !c.sem.acquire(minCharge) {
			return false
		}
		r := requestPool.Get().(*request)
		r.h = h
		r.charge = minCharge
		c.running.Add(1)
		c.sendError(r, errno, msg)
		return c.writeOK()
	}

	// Every request costs at least minCharge, so that requests without
	// payload (whose replies may queue behind a client that does not read)
	// are bounded too.
	charge := int64(minCharge)
	if h.Type == cmdRead || h.Type == cmdWrite {
		charge = max(charge, int64(h.Length))
	}
	if !c.sem.tryAcquire(charge) {
		c.unplug()
		if !c.sem.acquire(charge) {
			return c.refuse(h) // shutting down
		}
	}
	r := requestPool.Get().(*request)
	r.h = h
	r.charge = charge
	if (h.Type == cmdRead || h.Type == cmdWrite) && h.Length > 0 {
		r.buf = getBuf(int(h.Length))
		if h.Type == cmdWrite {
			if _, err := io.ReadFull(c.br, *r.buf); err != nil {
				c.finish(r)
				return false
			}
		}
	}
	if h.Type == cmdWrite {
		r.prev, r.turn = c.lastTurn, make(chan struct{})
		c.lastTurn = r.turn
	}
	c.running.Add(1)
	if async && c.x.hitReader != nil && c.br.Buffered() == 0 && c.running.Load() == 1 {
		// Alone: the client waits for this reply (HitReader).
		c.unplug()
		if c.readNow(r) {
			return true
		}
	}
	if async {
		// A read the backend serves without a goroutine (a cache hit)
		// costs no hand-off to a worker and back. With more requests
		// buffered, the backend holds its device read back until the
		// reader has started theirs too (or must wait): one device
		// submission for the lot.
		if !c.plugged && c.x.plugger != nil && c.br.Buffered() >= requestHeaderSize {
			c.x.plugger.Plug()
			c.plugged = true
		}
		c.wg.Add(1)
		if c.x.asyncReader.StartReadAt(*r.buf, int64(h.Offset), func(err error, later func(func())) { c.readDone(r, err, later) }) {
			return true
		}
		c.wg.Done()
		c.unplug() // the read goes to a worker, whom the reader may wait for
	}
	select {
	case c.work <- r:
	default:
		if c.nworkers < c.s.cfg.MaxWorkers {
			c.nworkers++
			c.wg.Add(1)
			go c.worker(r)
		} else {
			c.work <- r
		}
	}
	return true
}

// refuse answers a request received after Shutdown began with ESHUTDOWN,
// as the spec recommends, if its payload is already buffered. These
// replies hold no budget: they are bounded by the read buffer.
func (c *conn) refuse(h requestHeader) bool {
	if h.Type == cmdWrite {
		if int(h.Length) > c.br.Buffered() {
			return false
		}
		c.br.Discard(int(h.Length))
	}
	r := requestPool.Get().(*request)
	r.h = h
	c.running.Add(1)
	c.sendError(r, ESHUTDOWN, "server shutting down")
	return c.writeOK()
}

// unplug ends the reader's plug, if it holds one (invariant 6).
func (c *conn) unplug() {
	if c.plugged {
		c.plugged = false
		c.x.plugger.Unplug()
	}
}

func (c *conn) writeOK() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.werr == nil
}

// validate checks a request against the spec and the export's
// constraints. It returns the errno to reply with, or 0.
func (c *conn) validate(h requestHeader) (uint32, string) {
	x := c.x
	allowed := CmdFlagFUA // FUA is valid on every command
	// Only requests with a payload (READ's reply, WRITE's data) are bound
	// by the maximum block size; TRIM, WRITE_ZEROES, CACHE and
	// BLOCK_STATUS may cover any range the 32-bit length allows (the
	// spec's maximum payload size) and are split in handle.
	supported, writes, lenLimited := true, false, false
	rangeErr := EINVAL
	switch h.Type {
	case cmdRead:
		if c.structured {
			allowed |= CmdFlagDF
		}
		lenLimited = true
	case cmdWrite:
		writes, lenLimited, rangeErr = true, true, ENOSPC
	case cmdFlush:
		if h.Flags&^allowed != 0 {
			return EINVAL, "unsupported command flags"
		}
		if h.Offset != 0 || h.Length != 0 {
			return EINVAL, "FLUSH offset and length must be zero"
		}
		return 0, ""
	case cmdTrim:
		supported, writes = x.trimmer != nil, true
	case cmdCache:
		supported = x.prefetcher != nil
	case cmdWriteZeroes:
		allowed |= CmdFlagNoHole | CmdFlagFastZero
		supported, writes, rangeErr = x.zeroWriter != nil, true, ENOSPC
	case cmdBlockStatus:
		allowed |= CmdFlagReqOne
		supported = c.blockStatus
	default:
		return EINVAL, "unknown command"
	}
	switch {
	case writes && x.ReadOnly:
		return EPERM, "export is read-only"
	case !supported:
		return EINVAL, "command not supported by this export"
	case h.Flags&^allowed != 0:
		return EINVAL, "unsupported command flags"
	case lenLimited && h.Length > x.MaxBlockSize:
		return EINVAL, "length exceeds maximum block size"
	case (h.Offset|uint64(h.Length))&uint64(x.MinBlockSize-1) != 0:
		return EINVAL, "request not aligned to minimum block size"
	case h.Offset > c.size || uint64(h.Length) > c.size-h.Offset:
		return rangeErr, "request beyond end of export"
	case h.Type == cmdBlockStatus && h.Length == 0:
		return EINVAL, "zero-length block status"
	}
	return 0, ""
}

func (c *conn) worker(r *request) {
	defer c.wg.Done()
	c.handle(r)
	for r := range c.work {
		c.handle(r)
	}
}

// readDone replies to a READ started with StartReadAt, on the goroutine
// that completed it.
func (c *conn) readDone(r *request, err error, later func(func())) {
	defer c.wg.Done()
	c.prepReadReply(r, err)
	c.queueReplyLater(r, later)
}

// readNow serves a READ with the backend's ReadHitAt on the reader's
// goroutine and reports whether it did; it replies as a StartReadAt
// completion does, with one non-blocking writev (flushReplies).
func (c *conn) readNow(r *request) bool {
	ok, err := c.x.hitReader.ReadHitAt(*r.buf, int64(r.h.Offset))
	if !ok {
		return false
	}
	c.prepReadReply(r, err)
	if c.queueReplyFlush(r) {
		c.flushReplies()
	}
	return true
}

// prepReadReply sets r.bufs to READ's reply for the backend's outcome err,
// logging an error.
func (c *conn) prepReadReply(r *request, err error) {
	if err != nil {
		h := &r.h
		errno := errnoFor(err)
		c.log.Error("nbd: backend error", "cmd", cmdName(h.Type), "offset", h.Offset, "length", h.Length, "errno", errno, "err", err)
		c.prepError(r, errno, errnoString(errno))
		return
	}
	c.prepRead(r)
}

// handle executes one request and replies.
func (c *conn) handle(r *request) {
	x := c.x
	h := &r.h
	off, n := int64(h.Offset), int64(h.Length)
	fua := h.Flags&CmdFlagFUA != 0
	var err error
	switch h.Type {
	case cmdRead:
		if n > 0 {
			err = x.Backend.ReadAt(*r.buf, off)
		}
		if err == nil {
			c.sendRead(r)
			return
		}
	case cmdWrite:
		// Writes start in the backend in the order they arrived: the
		// workers that take them run in no fixed order, and a disk
		// behind the backend turns a write that arrives after the head
		// has passed its place into a seek back (a client's sorted
		// sweep, writeback's, reached an HDD model with 60 % of its
		// writes behind an earlier one without this).
		if r.prev != nil {
			<-r.prev
		}
		close(r.turn)
		r.prev, r.turn = nil, nil
		if n > 0 {
			err = x.Backend.WriteAt(*r.buf, off, fua)
		} else if fua {
			err = x.Backend.Flush()
		}
	case cmdFlush:
		err = x.Backend.Flush()
	case cmdTrim:
		err = c.split(off, n, func(off, n int64) error { return x.trimmer.Trim(off, n, fua) })
		if errors.Is(err, errors.ErrUnsupported) {
			err = nil // TRIM is a hint; ignoring it is allowed
		}
	case cmdWriteZeroes:
		err = c.split(off, n, func(off, n int64) error { return c.writeZeroes(off, n, fua, h.Flags) })
	case cmdCache:
		err = c.split(off, n, x.prefetcher.Prefetch)
	case cmdBlockStatus:
		c.sendBlockStatus(r)
		return
	}
	if err != nil {
		errno := errnoFor(err)
		if !(errno == ENOTSUP && h.Type == cmdWriteZeroes) {
			c.log.Error("nbd: backend error", "cmd", cmdName(h.Type), "offset", h.Offset, "length", h.Length, "errno", errno, "err", err)
		}
		c.sendError(r, errno, errnoString(errno))
		return
	}
	putSimpleReply(r.hdr[:], 0, h.Handle)
	r.bufArr[0] = r.hdr[:simpleReplySize]
	r.bufs = r.bufArr[:1]
	c.queueReply(r)
}

// split runs fn over [off, off+n) in pieces of at most the export's
// maximum block size, cut at multiples of it (so pieces stay as aligned as
// the request): a long TRIM, WRITE_ZEROES or CACHE holds the backend (its
// locks, its allocations) no longer per call than the longest WRITE does. It stops at the first error; with FUA
// each piece is durable before the next starts.
func (c *conn) split(off, n int64, fn func(off, n int64) error) error {
	step := int64(c.x.MaxBlockSize)
	for n > 0 {
		k := min(n, (off/step+1)*step-off)
		if err := fn(off, k); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}

// zeroBuf backs the WRITE_ZEROES fallback. Backends never modify the
// buffer passed to WriteAt.
var zeroBuf = make([]byte, 1<<20)

func (c *conn) writeZeroes(off, n int64, fua bool, flags uint16) error {
	fast := flags&CmdFlagFastZero != 0
	err := c.x.zeroWriter.WriteZeroes(off, n, fua, flags&CmdFlagNoHole == 0, fast)
	if err == nil || fast || !errors.Is(err, errors.ErrUnsupported) {
		return err
	}
	// Without FAST_ZERO the server must not fail with ENOTSUP: write the
	// zeroes.
	for n > 0 {
		k := min(n, int64(len(zeroBuf)))
		if err := c.x.Backend.WriteAt(zeroBuf[:k], off, fua); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}

// finish releases a request's resources.
func (c *conn) finish(r *request) {
	c.sem.release(r.charge)
	putBuf(r.buf)
	*r = request{}
	requestPool.Put(r)
}

func (c *conn) sendRead(r *request) {
	c.prepRead(r)
	c.queueReply(r)
}

// prepRead sets r.bufs to READ's success reply.
func (c *conn) prepRead(r *request) {
	h := &r.h
	if !c.structured {
		putSimpleReply(r.hdr[:], 0, h.Handle)
		r.bufArr[0] = r.hdr[:simpleReplySize]
	} else if h.Length == 0 {
		putChunkHeader(r.hdr[:], replyFlagDone, replyTypeNone, h.Handle, 0)
		r.bufArr[0] = r.hdr[:structuredReplyHdrLen]
	} else {
		putChunkHeader(r.hdr[:], replyFlagDone, replyTypeOffsetData, h.Handle, 8+h.Length)
		putUint64(r.hdr[structuredReplyHdrLen:], h.Offset)
		r.bufArr[0] = r.hdr[:structuredReplyHdrLen+8]
	}
	r.bufs = r.bufArr[:1]
	if h.Length > 0 {
		r.bufArr[1] = *r.buf
		r.bufs = r.bufArr[:2]
	}
}

// sendBlockStatus reports the whole range as allocated data: one extent
// with status 0 (base:allocation).
func (c *conn) sendBlockStatus(r *request) {
	h := &r.h
	putChunkHeader(r.hdr[:], replyFlagDone, replyTypeBlockStatus, h.Handle, 12)
	putUint32(r.hdr[20:], baseAllocationID)
	putUint32(r.hdr[24:], h.Length)
	putUint32(r.hdr[28:], 0)
	r.bufArr[0] = r.hdr[:32]
	r.bufs = r.bufArr[:1]
	c.queueReply(r)
}

// sendError replies to r with an error: a structured NBD_REPLY_TYPE_ERROR
// chunk carrying msg when structured replies were negotiated, else a simple
// reply (with no payload, also for READ).
func (c *conn) sendError(r *request, errno uint32, msg string) {
	c.prepError(r, errno, msg)
	c.queueReply(r)
}

// prepError sets r.bufs to an error reply (sendError).
func (c *conn) prepError(r *request, errno uint32, msg string) {
	h := &r.h
	if c.structured {
		msg = msg[:min(len(msg), maxStringLen)]
		putChunkHeader(r.hdr[:], replyFlagDone, replyTypeError, h.Handle, uint32(6+len(msg)))
		putUint32(r.hdr[20:], errno)
		r.hdr[24], r.hdr[25] = byte(len(msg)>>8), byte(len(msg))
		r.bufArr[0] = r.hdr[:structuredReplyHdrLen+6]
		r.bufArr[1] = []byte(msg)
		r.bufs = r.bufArr[:2]
	} else {
		putSimpleReply(r.hdr[:], errno, h.Handle)
		r.bufArr[0] = r.hdr[:simpleReplySize]
		r.bufs = r.bufArr[:1]
	}
}

// queueReply hands r, with r.bufs ready, to the writer, which finishes r
// once it is written. If no goroutine is writing, the caller becomes the
// writer and sends everything queued, in as few writev calls as possible,
// until the queue is empty. If other requests are still executing, the new
// writer first yields once so that their replies can join the batch (at
// depth most replies then share a writev); with a single request in flight
// the reply goes out at once.
func (c *conn) queueReply(r *request) {
	c.running.Add(-1)
	c.wmu.Lock()
	c.wq = append(c.wq, r)
	if c.writing {
		c.wmu.Unlock()
		return
	}
	c.writing = true
	if c.running.Load() > 0 {
		// Other requests are executing and will reply soon: give them a
		// chance to join this batch.
		c.wmu.Unlock()
		runtime.Gosched()
		c.wmu.Lock()
	}
	c.drainLocked()
}

// drainLocked writes everything queued until the queue is empty, then
// clears c.writing. REQUIRES: c.wmu, c.writing set by the caller; it
// returns with c.wmu released.
func (c *conn) drainLocked() {
	for len(c.wq) > 0 {
		batch := c.wq
		c.wq = c.wspare[:0]
		err := c.werr
		c.wmu.Unlock()
		if err == nil {
			c.iov = c.iov[:0]
			for _, r := range batch {
				c.iov = append(c.iov, r.bufs...)
			}
			if c.bw != nil {
				err = writeAllBuffered(c.bw, c.iov)
			} else {
				c.wbufs = c.iov
				_, err = c.wbufs.WriteTo(c.nc)
			}
			clear(c.iov[:cap(c.iov)])
		}
		c.wmu.Lock()
		c.wroteLocked(batch, err)
	}
	c.writing = false
	c.wmu.Unlock()
}

// wroteLocked finishes the requests of a batch written with outcome err,
// and records a write error.
// REQUIRES: c.wmu, c.writing
func (c *conn) wroteLocked(batch []*request, err error) {
	for i, r := range batch {
		c.finish(r)
		batch[i] = nil
	}
	if err != nil && c.werr == nil {
		c.werr = err
		c.replyDead.Store(true)
		c.raw.Close() // stops the reader too
		if !errors.Is(err, net.ErrClosed) {
			c.log.Debug("nbd: write reply", "err", err)
		}
	}
	c.wspare = batch[:0]
}

// queueReplyLater is queueReply for a StartReadAt completion, which runs
// on the backend's goroutine and must not block: it queues r and, unless
// a writer or an earlier completion's flush will take it, has later run
// flushReplies once the backend's batch of completions is delivered, so
// that the replies of one batch leave in one writev.
func (c *conn) queueReplyLater(r *request, later func(func())) {
	if c.queueReplyFlush(r) {
		later(c.flushReplies)
	}
}

// queueReplyFlush queues r, with r.bufs ready, for the writer and reports
// whether the caller must run flushReplies for it: no goroutine is
// writing, and no earlier flushReplies is due (c.flushLater, now set).
func (c *conn) queueReplyFlush(r *request) bool {
	c.running.Add(-1)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wq = append(c.wq, r)
	if c.writing || c.flushLater {
		return false
	}
	c.flushLater = true
	c.wg.Add(1)
	return true
}

// flushReplies writes what is queued, as the writer, if no goroutine is
// writing (queueReplyLater): it writes only what the socket takes at
// once (tryWrite), and hands the rest and the writer's role to a new
// goroutine (writeRest).
func (c *conn) flushReplies() {
	defer c.wg.Done()
	c.wmu.Lock()
	c.flushLater = false
	if c.writing {
		c.wmu.Unlock()
		return
	}
	c.writing = true
	for len(c.wq) > 0 {
		batch := c.wq
		c.wq = c.wspare[:0]
		err := c.werr
		c.wmu.Unlock()
		if err == nil {
			c.iov = c.iov[:0]
			total := 0
			for _, r := range batch {
				c.iov = append(c.iov, r.bufs...)
				for _, b := range r.bufs {
					total += len(b)
				}
			}
			var n int
			n, err = c.tryWrite(c.iov)
			if err == nil && n < total {
				c.wg.Add(1)
				go c.writeRest(batch, n)
				return
			}
			clear(c.iov[:cap(c.iov)])
		}
		c.wmu.Lock()
		c.wroteLocked(batch, err)
	}
	c.writing = false
	c.wmu.Unlock()
}

// writeRest writes what tryWrite left of batch (c.iov, of which n bytes
// are written), blocking, then goes on as the writer (drainLocked).
func (c *conn) writeRest(batch []*request, n int) {
	defer c.wg.Done()
	c.wbufs = skipBytes(c.iov, n)
	_, err := c.wbufs.WriteTo(c.nc)
	clear(c.iov[:cap(c.iov)])
	c.wmu.Lock()
	c.wroteLocked(batch, err)
	c.drainLocked()
}

// skipBytes drops the first n bytes of bufs (in place).
func skipBytes(bufs [][]byte, n int) [][]byte {
	for len(bufs) > 0 && n >= len(bufs[0]) {
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	if len(bufs) > 0 {
		bufs[0] = bufs[0][n:]
	}
	return bufs
}

// writeAllBuffered writes bufs through bw and flushes: over TLS,
// net.Buffers would make one record per buffer.
func writeAllBuffered(bw *bufio.Writer, bufs [][]byte) error {
	for _, b := range bufs {
		if _, err := bw.Write(b); err != nil {
			return err
		}
	}
	return bw.Flush()
}

func putUint32(b []byte, v uint32) {
	_ = b[3]
	b[0], b[1], b[2], b[3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}

func putUint64(b []byte, v uint64) {
	putUint32(b, uint32(v>>32))
	putUint32(b[4:], uint32(v))
}
