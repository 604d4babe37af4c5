package nbd

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"
)

// fuzzConn is a net.Conn that reads a fixed client byte stream and discards
// everything written. Reaching the end of the stream is EOF, so a server
// connection over it must always terminate.
type fuzzConn struct{ r *bytes.Reader }

type fakeAddr struct{}

func (fakeAddr) Network() string { return "fuzz" }
func (fakeAddr) String() string  { return "fuzz" }

func (f *fuzzConn) Read(p []byte) (int, error)       { return f.r.Read(p) }
func (f *fuzzConn) Write(p []byte) (int, error)      { return len(p), nil }
func (f *fuzzConn) Close() error                     { return nil }
func (f *fuzzConn) LocalAddr() net.Addr              { return fakeAddr{} }
func (f *fuzzConn) RemoteAddr() net.Addr             { return fakeAddr{} }
func (f *fuzzConn) SetDeadline(time.Time) error      { return nil }
func (f *fuzzConn) SetReadDeadline(time.Time) error  { return nil }
func (f *fuzzConn) SetWriteDeadline(time.Time) error { return nil }

var _ net.Conn = (*fuzzConn)(nil)

func fuzzServer(t testing.TB) *Server {
	s := NewServer(Config{MaxOptionLength: 4096, MaxInFlightBytes: 1 << 20})
	for _, e := range []Export{
		{Name: "d", Description: "fuzz", Backend: newMem(1 << 20), MaxBlockSize: 256 << 10},
		{Name: "ro", Backend: plain{newMem(64 << 10)}, ReadOnly: true, MinBlockSize: 512},
	} {
		if err := s.AddExport(e); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// runConn serves one connection over input and fails if it does not end.
func runConn(t *testing.T, s *Server, input []byte) {
	c := newConn(s, &fuzzConn{r: bytes.NewReader(input)})
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.serve()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("connection did not terminate on input %q", input)
	}
}

func optBytes(opt uint32, data []byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, ihaveOpt)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

func reqBytes(typ, flags uint16, handle, off uint64, n uint32, payload []byte) []byte {
	var b [requestHeaderSize]byte
	encodeRequest(b[:], requestHeader{Flags: flags, Type: typ, Handle: handle, Offset: off, Length: n})
	return append(b[:], payload...)
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

var cflags = binary.BigEndian.AppendUint32(nil, flagCFixedNewstyle|flagCNoZeroes)

func FuzzHandshake(f *testing.F) {
	f.Add(cat(cflags, optBytes(optList, nil), optBytes(optAbort, nil)))
	f.Add(cat(cflags, optBytes(optInfo, infoData("d", infoName, infoDescription, infoBlockSize)), optBytes(optGo, infoData("ro"))))
	f.Add(cat(cflags, optBytes(optStructuredReply, nil), optBytes(optListMetaContext, metaData("d", "base:")),
		optBytes(optSetMetaContext, metaData("d", "base:allocation")), optBytes(optGo, infoData("d"))))
	f.Add(cat(cflags, optBytes(optStartTLS, nil), optBytes(99, []byte("xyz")), optBytes(optExportName, []byte("d"))))
	f.Add(cat(binary.BigEndian.AppendUint32(nil, flagCFixedNewstyle), optBytes(optExportName, []byte("d")), reqBytes(cmdFlush, 0, 1, 0, 0, nil)))
	f.Add(cat(cflags, optBytes(optInfo, []byte{0, 0, 0, 9, 'd'})))
	f.Add([]byte{0, 0, 0, 1})
	s := fuzzServer(f)
	f.Fuzz(func(t *testing.T, input []byte) {
		runConn(t, s, input)
	})
}

func FuzzTransmission(f *testing.F) {
	f.Add(byte(0), reqBytes(cmdRead, 0, 1, 0, 4096, nil))
	f.Add(byte(1), cat(reqBytes(cmdWrite, CmdFlagFUA, 1, 512, 8, []byte("abcdefgh")), reqBytes(cmdRead, CmdFlagDF, 2, 512, 8, nil),
		reqBytes(cmdFlush, 0, 3, 0, 0, nil), reqBytes(cmdDisc, 0, 4, 0, 0, nil)))
	f.Add(byte(2), cat(reqBytes(cmdTrim, 0, 1, 0, 4096, nil), reqBytes(cmdWriteZeroes, CmdFlagNoHole|CmdFlagFastZero, 2, 0, 1<<20, nil),
		reqBytes(cmdCache, 0, 3, 0, 4096, nil), reqBytes(cmdBlockStatus, CmdFlagReqOne, 4, 0, 4096, nil)))
	f.Add(byte(3), cat(reqBytes(cmdWrite, 0, 1, 0, 4096, make([]byte, 4096)), reqBytes(77, 0xffff, 2, 1<<63, 1<<31, nil)))
	f.Add(byte(0), reqBytes(cmdWrite, 0, 1, 0, 1<<30, nil))
	f.Add(byte(1), []byte("garbage that is not a request header"))
	s := fuzzServer(f)
	f.Fuzz(func(t *testing.T, mode byte, stream []byte) {
		// Round trip of the request header codec.
		if len(stream) >= requestHeaderSize {
			if h, ok := decodeRequest(stream); ok {
				var b [requestHeaderSize]byte
				encodeRequest(b[:], h)
				if !bytes.Equal(b[:], stream[:requestHeaderSize]) {
					t.Fatalf("header round trip: % x != % x", b, stream[:requestHeaderSize])
				}
			}
		}
		// A valid handshake chosen by mode, then the fuzzed requests.
		var hs []byte
		if mode&1 != 0 {
			hs = cat(hs, optBytes(optStructuredReply, nil))
			if mode&4 != 0 {
				hs = cat(hs, optBytes(optSetMetaContext, metaData("d", "base:allocation")))
			}
		}
		name := "d"
		if mode&2 != 0 {
			name = "ro"
		}
		hs = cat(cflags, hs, optBytes(optGo, infoData(name)))
		runConn(t, s, cat(hs, stream))
	})
}

// TestFuzzConnDrains checks the fuzz harness itself: a valid session over a
// fuzzConn runs to completion and writes data.
func TestFuzzConnDrains(t *testing.T) {
	s := fuzzServer(t)
	in := cat(cflags, optBytes(optGo, infoData("d")),
		reqBytes(cmdWrite, 0, 1, 0, 5, []byte("hello")), reqBytes(cmdDisc, 0, 2, 0, 0, nil))
	runConn(t, s, in)
	got := make([]byte, 5)
	x := s.lookup("d")
	if err := x.Backend.ReadAt(got, 0); err != nil || string(got) != "hello" {
		t.Fatalf("got %q, %v", got, err)
	}
	_ = io.EOF
}
