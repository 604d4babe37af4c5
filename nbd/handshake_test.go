package nbd

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"testing"
	"time"
)

func handshakeServer(t *testing.T, cfg Config) *testServer {
	return startServer(t, cfg,
		Export{Name: "disk", Description: "the disk", Backend: newMem(1 << 20), MinBlockSize: 512},
		Export{Name: "ro", Backend: plain{newMem(64 << 10)}, ReadOnly: true},
	)
}

func TestHandshakeRefusesBadClientFlags(t *testing.T) {
	ts := handshakeServer(t, Config{})
	for _, tc := range []struct {
		name   string
		cflags uint32
	}{
		{"no fixed newstyle", 0},
		{"no zeroes only", flagCNoZeroes},
		{"unknown flag", flagCFixedNewstyle | 1<<7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := ts.raw(t)
			r.greet(tc.cflags)
			r.expectClosed()
		})
	}
}

func TestHandshakeBadOptionMagic(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.write(bytes.Repeat([]byte{0x42}, 16))
	r.expectClosed()
}

func TestHandshakeUnknownOptionKeepsStreamInSync(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	for _, opt := range []uint32{99, optPeekExport, optExtendedHeaders, 0} {
		r.opt(opt, []byte("some ignored payload"))
		r.expect(opt, repErrUnsup)
	}
	r.opt(optList, nil)
	r.expect(optList, repServer)
}

func TestHandshakeOversizedOption(t *testing.T) {
	ts := handshakeServer(t, Config{MaxOptionLength: 1024})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optInfo, make([]byte, 5000))
	r.expect(optInfo, repErrTooBig)
	r.opt(optStructuredReply, nil) // still in sync
	r.expect(optStructuredReply, repAck)

	// Absurd lengths close the connection without reading the data.
	b := binary.BigEndian.AppendUint64(nil, ihaveOpt)
	b = binary.BigEndian.AppendUint32(b, optInfo)
	b = binary.BigEndian.AppendUint32(b, 1<<31)
	r.write(b)
	r.expectClosed()
}

func TestHandshakeOversizedExportNameCloses(t *testing.T) {
	ts := handshakeServer(t, Config{MaxOptionLength: 16})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	b := binary.BigEndian.AppendUint64(nil, ihaveOpt)
	b = binary.BigEndian.AppendUint32(b, optExportName)
	b = binary.BigEndian.AppendUint32(b, 100)
	r.write(append(b, make([]byte, 100)...))
	r.expectClosed()
}

func TestHandshakeMalformedInfo(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	bad := map[string][]byte{
		"short":             {0, 0, 0},
		"name too long":     append(binary.BigEndian.AppendUint32(nil, 100), "disk\x00\x00"...),
		"count too large":   append(infoData("disk")[:8], 0, 5, 0, 1),
		"trailing byte":     append(infoData("disk", infoName), 7),
		"nul in name":       infoData("di\x00sk"),
		"invalid utf8 name": infoData("\xff\xfe"),
	}
	for name, data := range bad {
		for _, opt := range []uint32{optInfo, optGo} {
			r.opt(opt, data)
			if typ, _ := r.reply(opt); typ != repErrInvalid {
				t.Errorf("%s: opt %d: reply %#x, want NBD_REP_ERR_INVALID", name, opt, typ)
			}
		}
	}
	r.opt(optInfo, infoData("nope"))
	r.expect(optInfo, repErrUnknown)
	r.opt(optGo, infoData("nope"))
	r.expect(optGo, repErrUnknown)
	r.goExport("disk") // still usable
}

func TestHandshakeInfo(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.opt(optInfo, infoData("disk", infoName, 77, infoDescription, infoBlockSize))
	got := map[uint16][]byte{}
	for {
		typ, data := r.reply(optInfo)
		if typ == repAck {
			break
		}
		if typ != repInfo {
			t.Fatalf("reply %#x", typ)
		}
		it := binary.BigEndian.Uint16(data)
		if _, dup := got[it]; dup {
			t.Fatalf("info %d sent twice", it)
		}
		got[it] = data[2:]
	}
	if e := got[infoExport]; len(e) != 10 || binary.BigEndian.Uint64(e) != 1<<20 {
		t.Fatalf("NBD_INFO_EXPORT = % x", e)
	}
	flags := binary.BigEndian.Uint16(got[infoExport][8:])
	want := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagCanMultiConn | FlagSendTrim | FlagSendWriteZeroes | FlagSendFastZero | FlagSendCache
	if flags != want {
		t.Errorf("flags %#x, want %#x", flags, want)
	}
	if string(got[infoName]) != "disk" || string(got[infoDescription]) != "the disk" {
		t.Errorf("name %q description %q", got[infoName], got[infoDescription])
	}
	bs := got[infoBlockSize]
	if len(bs) != 12 || binary.BigEndian.Uint32(bs) != 512 || binary.BigEndian.Uint32(bs[4:]) != 4096 || binary.BigEndian.Uint32(bs[8:]) != 32<<20 {
		t.Errorf("block size % x", bs)
	}
	if len(got) != 4 {
		t.Errorf("got info types %v", got)
	}

	// With structured replies, SEND_DF is added; read-only export flags.
	r.opt(optStructuredReply, nil)
	r.expect(optStructuredReply, repAck)
	r.opt(optInfo, infoData("ro"))
	data := r.expect(optInfo, repInfo)
	if f := binary.BigEndian.Uint16(data[10:]); f != FlagHasFlags|FlagReadOnly|FlagSendFlush|FlagSendFUA|FlagCanMultiConn|FlagSendDF {
		t.Errorf("ro flags %#x", f)
	}
}

func TestHandshakeList(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optList, nil)
	var names []string
	for {
		typ, data := r.reply(optList)
		if typ == repAck {
			break
		}
		if typ != repServer {
			t.Fatalf("reply %#x", typ)
		}
		n := binary.BigEndian.Uint32(data)
		names = append(names, string(data[4:4+n])+"|"+string(data[4+n:]))
	}
	if !slices.Equal(names, []string{"disk|the disk", "ro|"}) {
		t.Errorf("LIST = %q", names)
	}
	r.opt(optList, []byte{1})
	r.expect(optList, repErrInvalid)

	got, err := List(t.Context(), "unix", ts.addr)
	if err != nil || !slices.Equal(got, []string{"disk", "ro"}) {
		t.Errorf("List = %q, %v", got, err)
	}
}

func TestHandshakeAbort(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optAbort, nil)
	r.expect(optAbort, repAck)
	r.expectClosed()
}

func TestHandshakeStartTLSAndStructured(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optStartTLS, nil)
	r.expect(optStartTLS, repErrPolicy)
	r.opt(optStartTLS, []byte{1})
	r.expect(optStartTLS, repErrInvalid)
	r.opt(optStructuredReply, []byte{1})
	r.expect(optStructuredReply, repErrInvalid)
	r.opt(optStructuredReply, nil)
	r.expect(optStructuredReply, repAck)
}

func TestHandshakeExportName(t *testing.T) {
	ts := handshakeServer(t, Config{})
	for _, noZeroes := range []bool{false, true} {
		r := ts.raw(t)
		cf := flagCFixedNewstyle
		n := 10 + 124
		if noZeroes {
			cf |= flagCNoZeroes
			n = 10
		}
		r.greet(cf)
		r.opt(optExportName, []byte("disk"))
		b := make([]byte, n)
		r.read(b)
		if binary.BigEndian.Uint64(b) != 1<<20 || binary.BigEndian.Uint16(b[8:])&FlagHasFlags == 0 {
			t.Fatalf("export reply % x", b[:10])
		}
		if !bytes.Equal(b[10:], make([]byte, n-10)) {
			t.Fatal("padding not zero")
		}
		// Now in transmission: a FLUSH gets a simple reply, proving the
		// server sent exactly n bytes.
		r.request(requestHeader{Type: cmdFlush, Handle: 7}, nil)
		if errno, h := r.simpleReply(); errno != 0 || h != 7 {
			t.Fatalf("flush reply errno %d handle %d", errno, h)
		}
	}
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optExportName, []byte("nope"))
	r.expectClosed()
}

func TestHandshakeDefaultExport(t *testing.T) {
	ts := startServer(t, Config{DefaultExport: "d"}, Export{Name: "d", Backend: newMem(4096)})
	c := ts.dial(t, "", ClientOptions{})
	if c.Size() != 4096 || c.ExportName() != "d" {
		t.Fatalf("size %d name %q", c.Size(), c.ExportName())
	}
	if _, err := Dial(t.Context(), "unix", ts.addr, "x", ClientOptions{}); !errors.Is(err, ErrUnknownExport) {
		t.Fatalf("Dial of unknown export: %v", err)
	}
}

func TestHandshakeMetaContext(t *testing.T) {
	ts := handshakeServer(t, Config{})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optSetMetaContext, metaData("disk", "base:allocation"))
	r.expect(optSetMetaContext, repErrInvalid) // structured replies first
	r.opt(optStructuredReply, nil)
	r.expect(optStructuredReply, repAck)

	r.opt(optListMetaContext, metaData("disk"))
	if d := r.expect(optListMetaContext, repMetaContext); string(d[4:]) != "base:allocation" {
		t.Fatalf("list: %q", d)
	}
	r.expect(optListMetaContext, repAck)
	r.opt(optListMetaContext, metaData("disk", "qemu:dirty-bitmap:x", "base:"))
	r.expect(optListMetaContext, repMetaContext)
	r.expect(optListMetaContext, repAck)
	r.opt(optListMetaContext, metaData("disk", "nocolon"))
	r.expect(optListMetaContext, repErrInvalid)
	r.opt(optListMetaContext, append(metaData("disk", "base:"), 0))
	r.expect(optListMetaContext, repErrInvalid)
	r.opt(optListMetaContext, metaData("nope"))
	r.expect(optListMetaContext, repErrUnknown)

	r.opt(optSetMetaContext, metaData("disk", "base:", "x-foo:bar"))
	r.expect(optSetMetaContext, repAck) // nothing selected
	r.opt(optSetMetaContext, metaData("disk", "base:allocation"))
	d := r.expect(optSetMetaContext, repMetaContext)
	if binary.BigEndian.Uint32(d) != baseAllocationID || string(d[4:]) != "base:allocation" {
		t.Fatalf("set: % x", d)
	}
	r.expect(optSetMetaContext, repAck)
	r.goExport("disk")

	r.request(requestHeader{Type: cmdBlockStatus, Flags: CmdFlagReqOne, Handle: 1, Offset: 4096, Length: 8192}, nil)
	var b [32]byte
	r.read(b[:])
	if binary.BigEndian.Uint32(b[:]) != structuredReplyMagic || binary.BigEndian.Uint16(b[4:]) != replyFlagDone ||
		binary.BigEndian.Uint16(b[6:]) != replyTypeBlockStatus || binary.BigEndian.Uint32(b[16:]) != 12 ||
		binary.BigEndian.Uint32(b[20:]) != baseAllocationID || binary.BigEndian.Uint32(b[24:]) != 8192 || binary.BigEndian.Uint32(b[28:]) != 0 {
		t.Fatalf("block status reply % x", b)
	}
}

func TestHandshakeTimeout(t *testing.T) {
	ts := handshakeServer(t, Config{HandshakeTimeout: 50 * time.Millisecond})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optList, nil) // options do not extend the deadline
	r.expect(optList, repServer)
	r.expect(optList, repServer)
	r.expect(optList, repAck)
	r.expectClosed() // after 50 ms of no GO

	// Once in transmission, the deadline no longer applies.
	c := ts.dial(t, "disk", ClientOptions{})
	time.Sleep(100 * time.Millisecond)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}
