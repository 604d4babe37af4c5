package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// serverConn is a net.Conn playing a scripted server: it yields hs, then
// waits until release is called, then yields replies, then EOF. Writes are
// discarded.
type serverConn struct {
	fuzzConn
	hs       *bytes.Reader
	released chan struct{}
	once     sync.Once
	closed   chan struct{}
	cmu      sync.Once
}

func newServerConn(hs, replies []byte) *serverConn {
	return &serverConn{
		fuzzConn: fuzzConn{r: bytes.NewReader(replies)},
		hs:       bytes.NewReader(hs),
		released: make(chan struct{}),
		closed:   make(chan struct{}),
	}
}

func (s *serverConn) release() { s.once.Do(func() { close(s.released) }) }

func (s *serverConn) Read(p []byte) (int, error) {
	if s.hs.Len() > 0 {
		return s.hs.Read(p)
	}
	select {
	case <-s.released:
	case <-s.closed:
		return 0, net.ErrClosed
	}
	return s.fuzzConn.Read(p)
}

func (s *serverConn) Close() error {
	s.cmu.Do(func() { close(s.closed) })
	return nil
}

func greeting() []byte {
	b := binary.BigEndian.AppendUint64(nil, nbdMagic)
	b = binary.BigEndian.AppendUint64(b, ihaveOpt)
	return binary.BigEndian.AppendUint16(b, flagFixedNewstyle|flagNoZeroes)
}

func optRep(opt, typ uint32, data []byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, optReplyMagic)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, typ)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

// serverHandshake is a valid server side of Dial's handshake.
func serverHandshake(structured bool) []byte {
	info := binary.BigEndian.AppendUint16(nil, infoExport)
	info = binary.BigEndian.AppendUint64(info, 1<<20)
	info = binary.BigEndian.AppendUint16(info, FlagHasFlags|FlagSendFlush|FlagSendTrim)
	b := greeting()
	if structured {
		b = cat(b, optRep(optStructuredReply, repAck, nil),
			optRep(optSetMetaContext, repMetaContext, append(binary.BigEndian.AppendUint32(nil, 7), metaContextBaseAlloc...)),
			optRep(optSetMetaContext, repAck, nil))
	}
	return cat(b, optRep(optGo, repInfo, info), optRep(optGo, repAck, nil))
}

func simpleRep(errno uint32, handle uint64, data []byte) []byte {
	var b [simpleReplySize]byte
	putSimpleReply(b[:], errno, handle)
	return append(b[:], data...)
}

func chunk(flags, typ uint16, handle uint64, payload []byte) []byte {
	var b [structuredReplyHdrLen]byte
	putChunkHeader(b[:], flags, typ, handle, uint32(len(payload)))
	return append(b[:], payload...)
}

func FuzzClientHandshake(f *testing.F) {
	f.Add(serverHandshake(false))
	f.Add(serverHandshake(true))
	f.Add(cat(greeting(), optRep(optGo, repErrUnsup, nil), make([]byte, 10)))
	f.Add(cat(greeting(), optRep(optGo, repErrUnknown, []byte("no such export"))))
	f.Fuzz(func(t *testing.T, data []byte) {
		sc := newServerConn(data, nil)
		sc.release() // no scripted pause: EOF right after data
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := NewClient(ctx, sc, "x", ClientOptions{BlockStatus: true})
		if err == nil {
			c.Close()
		}
	})
}

// FuzzClientReplies feeds arbitrary reply streams to a client with five
// requests in flight: every call must complete, with data or an error.
func FuzzClientReplies(f *testing.F) {
	data := bytes.Repeat([]byte{0xab}, 512)
	f.Add(false, cat(simpleRep(0, 1, data), simpleRep(0, 2, nil), simpleRep(5, 3, nil), simpleRep(0, 5, data[:256])))
	f.Add(true, cat(chunk(replyFlagDone, replyTypeOffsetData, 1, cat(make([]byte, 8), data)),
		chunk(replyFlagDone, replyTypeOffsetHole, 5, []byte{0, 0, 0, 0, 0, 0, 3, 232, 0, 0, 1, 0}),
		simpleRep(0, 2, nil), chunk(replyFlagDone, replyTypeError, 3, []byte{0, 0, 0, 5, 0, 2, 'h', 'i'}),
		chunk(replyFlagDone, replyTypeBlockStatus, 4, []byte{0, 0, 0, 7, 0, 0, 16, 0, 0, 0, 0, 3})))
	f.Add(true, chunk(replyFlagDone, replyTypeErrorOffset, 1, []byte{0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}))
	f.Fuzz(func(t *testing.T, structured bool, replies []byte) {
		sc := newServerConn(serverHandshake(structured), replies)
		c, err := NewClient(context.Background(), sc, "x", ClientOptions{BlockStatus: structured})
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		defer c.Close()
		var calls []*call
		add := func(typ uint16, off uint64, n uint32, w, r []byte) {
			cl, err := c.start(typ, 0, off, n, w, r)
			if err != nil {
				t.Fatal(err)
			}
			calls = append(calls, cl)
		}
		add(cmdRead, 0, 512, nil, make([]byte, 512))
		add(cmdWrite, 0, 4, []byte("data"), nil)
		add(cmdFlush, 0, 0, nil, nil)
		if structured {
			add(cmdBlockStatus, 0, 4096, nil, nil)
		} else {
			add(cmdTrim, 0, 4096, nil, nil)
		}
		add(cmdRead, 1000, 256, nil, make([]byte, 256))
		sc.release()
		for i, cl := range calls {
			select {
			case <-cl.done:
			case <-time.After(5 * time.Second):
				t.Fatalf("call %d never completed", i+1)
			}
		}
	})
}

var _ io.Reader = (*serverConn)(nil)

// TestClientExportNameFallback: a server without NBD_OPT_GO gets
// NBD_OPT_EXPORT_NAME.
func TestClientExportNameFallback(t *testing.T) {
	for _, noZeroes := range []bool{true, false} {
		g := greeting()
		if !noZeroes {
			g[17] &^= byte(flagNoZeroes)
		}
		reply := binary.BigEndian.AppendUint64(nil, 12345)
		reply = binary.BigEndian.AppendUint16(reply, FlagHasFlags|FlagReadOnly)
		if !noZeroes {
			reply = append(reply, make([]byte, 124)...)
		}
		sc := newServerConn(cat(g, optRep(optGo, repErrUnsup, nil), reply), simpleRep(0, 1, nil))
		c, err := NewClient(t.Context(), sc, "old", ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if c.Size() != 12345 || c.Flags() != FlagHasFlags|FlagReadOnly {
			t.Fatalf("size %d flags %#x", c.Size(), c.Flags())
		}
		cl, err := c.start(cmdFlush, 0, 0, 0, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		sc.release() // the scripted reply follows the request
		<-cl.done
		if cl.err != nil {
			t.Fatalf("noZeroes=%v: flush: %v", noZeroes, cl.err)
		}
		c.Close()
	}
}

func TestDialContext(t *testing.T) {
	// A server that never answers: Dial gives up when ctx ends.
	path := sockPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err == nil {
			defer c.Close()
			io.Copy(io.Discard, c)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = Dial(ctx, "unix", path, "x", ClientOptions{})
	if err == nil || time.Since(start) > 5*time.Second {
		t.Fatalf("Dial: %v after %v", err, time.Since(start))
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Dial error %v does not wrap the context's", err)
	}
}
