package nbd

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// The option phase (fixed newstyle only). It runs on the connection's own
// goroutine, reading through c.br and writing directly to c.nc. Nothing is
// read ahead of an option's data, so after an NBD_OPT_STARTTLS reply the
// buffer is empty and c.nc/c.br are swapped for a tls.Conn (upgradeTLS).

var (
	errAbort    = errors.New("client sent NBD_OPT_ABORT")
	errShutdown = errors.New("server shutting down")
)

// absurdOptionLength: an option longer than this is not discarded but
// closes the connection.
const absurdOptionLength = 16 << 20

// handshake negotiates an export. On success the connection is in the
// transmission phase with c.x, c.size and c.flags set.
func (c *conn) handshake() error {
	if t := c.s.cfg.HandshakeTimeout; t > 0 {
		c.raw.SetDeadline(time.Now().Add(t))
	}
	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:], nbdMagic)
	binary.BigEndian.PutUint64(hello[8:], ihaveOpt)
	binary.BigEndian.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.nc.Write(hello[:]); err != nil {
		return err
	}
	var cf [4]byte
	if _, err := io.ReadFull(c.br, cf[:]); err != nil {
		return err
	}
	cflags := binary.BigEndian.Uint32(cf[:])
	if cflags&^(flagCFixedNewstyle|flagCNoZeroes) != 0 {
		return fmt.Errorf("unknown client flags %#x", cflags)
	}
	if cflags&flagCFixedNewstyle == 0 {
		return errors.New("client does not support fixed newstyle negotiation")
	}
	c.noZeroes = cflags&flagCNoZeroes != 0

	for {
		var oh [16]byte
		if _, err := io.ReadFull(c.br, oh[:]); err != nil {
			return err
		}
		if m := binary.BigEndian.Uint64(oh[0:]); m != ihaveOpt {
			return fmt.Errorf("bad option magic %#x", m)
		}
		opt := binary.BigEndian.Uint32(oh[8:])
		length := binary.BigEndian.Uint32(oh[12:])
		if length > c.s.cfg.MaxOptionLength {
			if opt == optExportName || length > absurdOptionLength {
				return fmt.Errorf("option %d: length %d too large", opt, length)
			}
			if _, err := io.CopyN(io.Discard, c.br, int64(length)); err != nil {
				return err
			}
			if err := c.optReply(opt, repErrTooBig, []byte("option data too long")); err != nil {
				return err
			}
			continue
		}
		if cap(c.optBuf) < int(length) {
			c.optBuf = make([]byte, length)
		}
		data := c.optBuf[:length]
		if _, err := io.ReadFull(c.br, data); err != nil {
			return err
		}
		if c.s.cfg.RequireTLS && !c.tlsOn && opt != optStartTLS && opt != optAbort {
			if opt == optExportName {
				return errors.New("NBD_OPT_EXPORT_NAME before TLS")
			}
			if err := c.optReply(opt, repErrTLSReqd, []byte("TLS required")); err != nil {
				return err
			}
			continue
		}
		if c.shuttingDown() && opt != optAbort && opt != optExportName {
			if err := c.optReply(opt, repErrShutdown, []byte("server shutting down")); err != nil {
				return err
			}
			continue
		}
		done, err := c.option(opt, data)
		if err != nil || done {
			return err
		}
	}
}

// option handles one option; done reports entry into transmission.
func (c *conn) option(opt uint32, data []byte) (done bool, err error) {
	switch opt {
	case optExportName:
		x := c.s.lookup(string(data))
		if x == nil {
			return false, fmt.Errorf("NBD_OPT_EXPORT_NAME: unknown export %q", data)
		}
		if !c.slot && !c.s.takeSlot() {
			c.log.Warn("nbd: refused a client: "+c.s.refusalFull(), "max_connections", c.s.cfg.MaxConnections)
			return false, errors.New("NBD_OPT_EXPORT_NAME: " + c.s.refusalFull())
		}
		c.slot = true
		c.choose(x, string(data))
		reply := make([]byte, 10, 10+124)
		binary.BigEndian.PutUint64(reply[0:], c.size)
		binary.BigEndian.PutUint16(reply[8:], c.flags)
		if !c.noZeroes {
			reply = reply[:10+124]
		}
		if err := c.enterTransmission(); err != nil {
			return false, err
		}
		_, err := c.nc.Write(reply)
		return err == nil, err

	case optAbort:
		c.optReply(opt, repAck, nil) // the client may already be gone
		return false, errAbort

	case optList:
		if len(data) != 0 {
			return false, c.optReply(opt, repErrInvalid, []byte("NBD_OPT_LIST takes no data"))
		}
		for _, x := range c.s.exportList() {
			p := make([]byte, 4, 4+len(x.Name)+len(x.Description))
			binary.BigEndian.PutUint32(p, uint32(len(x.Name)))
			p = append(p, x.Name...)
			p = append(p, x.Description...)
			if err := c.optReply(opt, repServer, p); err != nil {
				return false, err
			}
		}
		return false, c.optReply(opt, repAck, nil)

	case optStartTLS:
		switch {
		case len(data) != 0:
			return false, c.optReply(opt, repErrInvalid, []byte("NBD_OPT_STARTTLS takes no data"))
		case c.s.cfg.TLSConfig == nil:
			return false, c.optReply(opt, repErrPolicy, []byte("TLS is not configured"))
		case c.tlsOn:
			return false, c.optReply(opt, repErrInvalid, []byte("TLS already negotiated"))
		}
		if err := c.optReply(opt, repAck, nil); err != nil {
			return false, err
		}
		return false, c.upgradeTLS()

	case optInfo, optGo:
		return c.optInfoGo(opt, data)

	case optStructuredReply:
		if len(data) != 0 {
			return false, c.optReply(opt, repErrInvalid, []byte("NBD_OPT_STRUCTURED_REPLY takes no data"))
		}
		c.structured = true
		return false, c.optReply(opt, repAck, nil)

	case optListMetaContext, optSetMetaContext:
		return false, c.optMetaContext(opt, data)
	}
	return false, c.optReply(opt, repErrUnsup, nil)
}

// optReply sends one option reply.
func (c *conn) optReply(opt, typ uint32, payload []byte) error {
	b := make([]byte, 20, 20+len(payload))
	binary.BigEndian.PutUint64(b[0:], optReplyMagic)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(payload)))
	_, err := c.nc.Write(append(b, payload...))
	return err
}

func (c *conn) optInfoGo(opt uint32, data []byte) (bool, error) {
	if len(data) < 6 {
		return false, c.optReply(opt, repErrInvalid, []byte("option data too short"))
	}
	nameLen := binary.BigEndian.Uint32(data)
	if uint64(nameLen) > uint64(len(data)-6) {
		return false, c.optReply(opt, repErrInvalid, []byte("export name length exceeds option data"))
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	n := int(binary.BigEndian.Uint16(rest))
	if len(rest) != 2+2*n {
		return false, c.optReply(opt, repErrInvalid, []byte("information request count does not match option length"))
	}
	if !validString(name) {
		return false, c.optReply(opt, repErrInvalid, []byte("export name is not a valid string"))
	}
	x := c.s.lookup(name)
	if x == nil {
		return false, c.optReply(opt, repErrUnknown, []byte("unknown export"))
	}
	// Refused before any information is sent; a slot taken here is given
	// back when the connection ends, whatever fails from now on.
	if opt == optGo && !c.slot {
		if !c.s.takeSlot() {
			c.log.Warn("nbd: refused a client: "+c.s.refusalFull(), "max_connections", c.s.cfg.MaxConnections)
			return false, c.optReply(opt, repErrPolicy, []byte(c.s.refusalFull()))
		}
		c.slot = true
	}
	flags := c.transmissionFlags(x)
	var p [14]byte
	binary.BigEndian.PutUint16(p[0:], infoExport)
	binary.BigEndian.PutUint64(p[2:], uint64(x.Backend.Size()))
	binary.BigEndian.PutUint16(p[10:], flags)
	if err := c.optReply(opt, repInfo, p[:12]); err != nil {
		return false, err
	}
	for i := range n {
		switch binary.BigEndian.Uint16(rest[2+2*i:]) {
		case infoName:
			if err := c.optReply(opt, repInfo, append([]byte{0, byte(infoName)}, x.Name...)); err != nil {
				return false, err
			}
		case infoDescription:
			if x.Description == "" {
				continue
			}
			if err := c.optReply(opt, repInfo, append([]byte{0, byte(infoDescription)}, x.Description...)); err != nil {
				return false, err
			}
		}
		// Unknown requests are ignored; NBD_INFO_BLOCK_SIZE is always sent.
	}
	binary.BigEndian.PutUint16(p[0:], infoBlockSize)
	binary.BigEndian.PutUint32(p[2:], x.MinBlockSize)
	binary.BigEndian.PutUint32(p[6:], x.PreferredBlockSize)
	binary.BigEndian.PutUint32(p[10:], x.MaxBlockSize)
	if err := c.optReply(opt, repInfo, p[:14]); err != nil {
		return false, err
	}
	if opt == optInfo {
		return false, c.optReply(opt, repAck, nil)
	}
	c.choose(x, name)
	if err := c.enterTransmission(); err != nil {
		return false, err
	}
	return true, c.optReply(opt, repAck, nil)
}

// optMetaContext handles NBD_OPT_LIST_META_CONTEXT and
// NBD_OPT_SET_META_CONTEXT. The only context is base:allocation.
func (c *conn) optMetaContext(opt uint32, data []byte) error {
	if opt == optSetMetaContext {
		c.metaSelected = false // replaced even when the option fails
		c.metaExport = ""
	}
	if !c.structured {
		return c.optReply(opt, repErrInvalid, []byte("structured replies not negotiated"))
	}
	invalid := func(msg string) error { return c.optReply(opt, repErrInvalid, []byte(msg)) }
	if len(data) < 8 {
		return invalid("option data too short")
	}
	nameLen := binary.BigEndian.Uint32(data)
	if uint64(nameLen) > uint64(len(data)-8) {
		return invalid("export name length exceeds option data")
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	nq := binary.BigEndian.Uint32(rest)
	rest = rest[4:]
	match := false
	for range nq {
		if len(rest) < 4 {
			return invalid("query count exceeds option data")
		}
		ql := binary.BigEndian.Uint32(rest)
		if uint64(ql) > uint64(len(rest)-4) {
			return invalid("query length exceeds option data")
		}
		q := string(rest[4 : 4+ql])
		rest = rest[4+ql:]
		if !validString(q) {
			return invalid("query is not a valid string")
		}
		ns, leaf, ok := strings.Cut(q, ":")
		if !ok || ns == "" {
			return invalid("query lacks a namespace")
		}
		if ns == "base" && (leaf == "allocation" || (leaf == "" && opt == optListMetaContext)) {
			match = true
		}
	}
	if len(rest) != 0 {
		return invalid("trailing option data")
	}
	if !validString(name) {
		return invalid("export name is not a valid string")
	}
	if c.s.lookup(name) == nil {
		return c.optReply(opt, repErrUnknown, []byte("unknown export"))
	}
	if nq == 0 && opt == optListMetaContext {
		match = true
	}
	if match {
		id := uint32(0) // reserved in LIST replies
		if opt == optSetMetaContext {
			id = baseAllocationID
		}
		p := binary.BigEndian.AppendUint32(nil, id)
		if err := c.optReply(opt, repMetaContext, append(p, metaContextBaseAlloc...)); err != nil {
			return err
		}
	}
	if opt == optSetMetaContext {
		c.metaSelected = match
		c.metaExport = name
	}
	return c.optReply(opt, repAck, nil)
}

// transmissionFlags are the flags advertised for x on this connection:
// exactly what the export and the negotiated options support.
func (c *conn) transmissionFlags(x *export) uint16 {
	f := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagCanMultiConn
	if x.ReadOnly {
		f |= FlagReadOnly
	} else {
		if x.trimmer != nil {
			f |= FlagSendTrim
		}
		if x.zeroWriter != nil {
			f |= FlagSendWriteZeroes | FlagSendFastZero
		}
	}
	if x.prefetcher != nil {
		f |= FlagSendCache
	}
	if c.structured {
		f |= FlagSendDF
	}
	return f
}

// choose fixes the export for the transmission phase. The size is taken
// once: requests are checked against the size the client was told.
func (c *conn) choose(x *export, name string) {
	c.x = x
	c.size = uint64(x.Backend.Size())
	c.flags = c.transmissionFlags(x)
	c.blockStatus = c.metaSelected && c.metaExport == name
}

// enterTransmission switches phase, clearing the handshake deadline under
// c.mu so that a concurrent beginShutdown's read deadline is never lost.
func (c *conn) enterTransmission() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.shutdown {
		return errShutdown
	}
	c.mu.transmission = true
	c.raw.SetDeadline(time.Time{})
	return nil
}

// upgradeTLS runs the TLS handshake after an NBD_OPT_STARTTLS ACK and
// continues the session over it. Negotiation state from before is dropped,
// as the spec requires.
func (c *conn) upgradeTLS() error {
	if c.br.Buffered() != 0 {
		return errors.New("client sent data before the TLS handshake")
	}
	tc := tls.Server(c.raw, c.s.cfg.TLSConfig)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("TLS handshake: %w", err)
	}
	c.nc = tc
	c.br.Reset(tc)
	c.bw = bufio.NewWriterSize(tc, 64<<10)
	c.tlsOn = true
	c.structured, c.metaSelected, c.metaExport = false, false, ""
	return nil
}
