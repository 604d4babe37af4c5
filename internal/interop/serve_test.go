package interop

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestServeDefault runs `tiercache serve` with no arguments but a data
// directory, the README's quick start.
func TestServeDefault(t *testing.T) {
	need(t, "nbdinfo", "qemu-io")
	dir := t.TempDir()
	sock := filepath.Join(dir, "tiercache.sock")
	s := startServerRaw(t, sock, "serve", "--data-dir", dir)
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o600 {
		t.Errorf("socket mode %o, want 600", perm)
	}
	out := run(t, 30*time.Second, "nbdinfo", "--list", s.uri(""))
	if !strings.Contains(out, "default") {
		t.Fatalf("nbdinfo --list: no export named default:\n%s", out)
	}
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("default"), "-c", "write -P 0x5a 1m 64k", "-c", "flush")
	s.stop()

	// The data survives a restart of the embedded default.
	s2 := startServerRaw(t, sock, "serve", "--data-dir", dir)
	out = run(t, time.Minute, "qemu-io", "-f", "raw", s2.uri("default"), "-c", "read -P 0x5a 1m 64k")
	if strings.Contains(out, "failed") {
		t.Fatalf("data lost across restart:\n%s", out)
	}
}

// TestShutdownFlushes writes without a flush, sends SIGTERM, and checks that
// the server flushed and the data is in the file.
func TestShutdownFlushes(t *testing.T) {
	need(t, "qemu-io")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 8*mib)
	s := startServer(t, "--export", "disk="+img)
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("disk"), "-c", "write -P 0x77 4k 12k")
	s.stop()
	if !strings.Contains(s.log.String(), "stopped cleanly") {
		t.Errorf("no clean-stop message in log:\n%s", s.log)
	}
	data, _ := os.ReadFile(img)
	if !bytes.Equal(data[4096:16384], bytes.Repeat([]byte{0x77}, 12288)) {
		t.Fatal("write not in the file after shutdown")
	}
}

// TestBadClientIsolated sends garbage on one connection while qemu-io works
// on another: only the bad connection is closed.
func TestBadClientIsolated(t *testing.T) {
	need(t, "qemu-io")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 8*mib)
	s := startServer(t, "--export", "disk="+img)

	bad, err := net.Dial("unix", s.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	hello := make([]byte, 18)
	bad.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := readFull(bad, hello); err != nil {
		t.Fatalf("reading server greeting: %v", err)
	}
	bad.Write([]byte{0, 0, 0, 3}) // client flags: FIXED_NEWSTYLE|NO_ZEROES
	bad.Write(bytes.Repeat([]byte("garbage!"), 64))
	// The server must close this connection.
	buf := make([]byte, 4096)
	for {
		if _, err := bad.Read(buf); err != nil {
			break
		}
	}
	out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("disk"), "-c", "write -P 0x21 0 4k", "-c", "read -P 0x21 0 4k")
	if strings.Contains(out, "failed") {
		t.Fatalf("good client affected by bad one:\n%s", out)
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// TestServeBadArgs checks that wrong invocations fail with a clear message.
func TestServeBadArgs(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--listen", "udp:1.2.3.4:5"}, "unknown network"},
		{[]string{"serve", "--listen", "tcp:localhost:99999"}, "bad port"},
		{[]string{"serve", "--export", "noequals"}, "NAME=PATH"},
		{[]string{"serve", "--export", "x=" + filepath.Join(dir, "missing.img")}, "missing.img"},
		{[]string{"serve", "--direct", "sometimes", "--export", "x=/dev/null"}, "--direct"},
		{[]string{"serve", "--log-format", "xml"}, "--log-format"},
		{[]string{"frobnicate"}, "unknown command"},
	}
	for _, c := range cases {
		out, err := runErr(30*time.Second, bin, append(c.args, "--data-dir", dir)...)
		if err == nil {
			t.Errorf("%v: succeeded, want failure", c.args)
			continue
		}
		if !strings.Contains(out, c.want) {
			t.Errorf("%v: output %q does not mention %q", c.args, out, c.want)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
