package nbddev

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
)

// peer is an NBD server process the test started (qemu-nbd or nbdkit).
type peer struct {
	t    *testing.T
	sock string // unix socket, or "" for TCP
	tcp  string // the TCP address it listens on, with sock ""
	args []string
	cmd  *exec.Cmd
	done chan struct{}
	errb bytes.Buffer
}

func needTool(t *testing.T, name string) {
	t.Helper()
	if testing.Short() {
		t.Skip("tests against real NBD servers skipped with -short")
	}
	if _, err := exec.LookPath(name); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not installed, and CI must run every test (scripts/install-deps.sh installs it)", name)
		}
		t.Skipf("%s not installed (scripts/install-deps.sh installs it)", name)
	}
}

// startPeer runs args (a server listening on sock) and waits for the
// socket to accept connections.
func startPeer(t *testing.T, sock string, args ...string) *peer {
	t.Helper()
	p := &peer{t: t, sock: sock, args: args}
	p.start()
	t.Cleanup(p.kill)
	return p
}

func (p *peer) start() {
	p.t.Helper()
	os.Remove(p.sock)
	p.errb.Reset()
	p.cmd = exec.Command(p.args[0], p.args[1:]...)
	p.cmd.Stderr = &p.errb
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	p.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { cmd.Wait(); close(done) }(p.cmd, p.done)
	network, addr := "unix", p.sock
	if p.sock == "" {
		network, addr = "tcp", p.tcp
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial(network, addr); err == nil {
			c.Close()
			return
		}
		select {
		case <-p.done:
			p.t.Fatalf("%s exited: %s", p.args[0], p.errb.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s did not listen on %s", p.args[0], p.sock)
		}
	}
}

// kill ends the server with SIGKILL (our own child, by pid) and waits.
func (p *peer) kill() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Kill()
	<-p.done
	p.cmd = nil
}

func (p *peer) uri(export string) string {
	if p.sock == "" {
		return "nbd://" + p.tcp + "/" + export
	}
	return "nbd+unix:///" + export + "?socket=" + p.sock
}

func sockIn(t *testing.T, name string) string {
	// Unix socket paths are short; t.TempDir can exceed the limit.
	dir, err := os.MkdirTemp("", "nbddev")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, name)
}

func openT(t *testing.T, uri string, opts Options) *Device {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := Open(ctx, uri, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// nbdkitMemory serves nbdkit's memory plugin; flags go before the plugin
// name (--filter=..., -r), params after it (the filters' key=value).
func nbdkitMemory(t *testing.T, size int64, flags []string, params ...string) *peer {
	sock := sockIn(t, "kit.sock")
	args := []string{"nbdkit", "-f", "--exit-with-parent", "-U", sock}
	args = append(args, flags...)
	args = append(args, "memory", strconv.FormatInt(size, 10))
	return startPeer(t, sock, append(args, params...)...)
}

func qemuNBD(t *testing.T, size int64, extra ...string) (*peer, string) {
	sock := sockIn(t, "q.sock")
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"qemu-nbd", "-f", "raw", "-k", sock, "-x", "e", "-t", "-e", "8"}, extra...)
	return startPeer(t, sock, append(args, img)...), img
}

func TestConformanceNbdkit(t *testing.T) {
	needTool(t, "nbdkit")
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		return openT(t, nbdkitMemory(t, size, nil).uri(""), Options{})
	})
}

func TestConformanceQemuNBD(t *testing.T) {
	needTool(t, "qemu-nbd")
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		p, _ := qemuNBD(t, size)
		return openT(t, p.uri("e"), Options{})
	})
}

// TestConformanceMinBlock runs the suite against a server with a 4 KiB
// minimum block size (nbdkit's blocksize-policy filter, which refuses
// unaligned requests with EINVAL), so every unaligned request goes through
// read-modify-write.
func TestConformanceMinBlock(t *testing.T) {
	needTool(t, "nbdkit")
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		p := nbdkitMemory(t, size, []string{"--filter=blocksize-policy"}, "blocksize-minimum=4096",
			"blocksize-preferred=4096", "blocksize-maximum=65536", "blocksize-error-policy=error")
		d := openT(t, p.uri(""), Options{})
		if d.Stats().MinBlockSize != 4096 {
			t.Fatalf("minimum block size %d, want 4096", d.Stats().MinBlockSize)
		}
		return d
	})
}

// TestConformanceNoZero: a server not advertising WRITE_ZEROES (nbdkit's
// nozero filter) gets zero buffers for WriteZeroes.
func TestConformanceNoZero(t *testing.T) {
	needTool(t, "nbdkit")
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		p := nbdkitMemory(t, size, []string{"--filter=nozero"})
		d := openT(t, p.uri(""), Options{})
		return d
	})
}

func TestConformanceTLS(t *testing.T) {
	needTool(t, "nbdkit")
	dir := writeCerts(t)
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		sock := sockIn(t, "tls.sock")
		p := startPeer(t, sock, "nbdkit", "-f", "--exit-with-parent", "-U", sock,
			"--tls=require", "--tls-certificates="+dir, "memory", strconv.FormatInt(size, 10))
		return openT(t, "nbds+unix:///?socket="+p.sock+"&tls-certificates="+dir+"&tls-hostname=localhost", Options{})
	})
}

// TestTLSRequired: nbds refuses a server without TLS, and a plain client
// is refused by a TLS-only server.
func TestTLSRequired(t *testing.T) {
	needTool(t, "nbdkit")
	dir := writeCerts(t)
	plain := nbdkitMemory(t, 1<<20, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if d, err := Open(ctx, "nbds+unix:///?socket="+plain.sock+"&tls-certificates="+dir, Options{}); err == nil {
		d.Close()
		t.Fatal("nbds connected to a server without TLS")
	}
	sock := sockIn(t, "tls.sock")
	startPeer(t, sock, "nbdkit", "-f", "--exit-with-parent", "-U", sock,
		"--tls=require", "--tls-certificates="+dir, "memory", "1M")
	if d, err := Open(ctx, "nbd+unix:///?socket="+sock, Options{}); err == nil {
		d.Close()
		t.Fatal("plain nbd:// served by a TLS-only server")
	}
	// A CA that did not sign the server's certificate is refused.
	other := writeCerts(t)
	if d, err := Open(ctx, "nbds+unix:///?socket="+sock+"&tls-certificates="+other+"&tls-hostname=localhost", Options{}); err == nil {
		d.Close()
		t.Fatal("TLS connected with the wrong CA")
	}
}

// TestTCP: nbd:// over loopback TCP.
func TestTCP(t *testing.T) {
	needTool(t, "nbdkit")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command("nbdkit", "-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", strconv.Itoa(port), "memory", "1M")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	uri := fmt.Sprintf("nbd://127.0.0.1:%d/", port)
	var d *Device
	for deadline := time.Now().Add(10 * time.Second); ; {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		d, err = Open(ctx, uri, Options{})
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer d.Close()
	p := make([]byte, 8192)
	devicetest.Fill(p, 1)
	if _, err := d.WriteAt(p, 4096); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(p))
	if _, err := d.ReadAt(got, 4096); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("read back over TCP: %v", err)
	}
}

// TestMultiConn: nbdkit memory advertises CAN_MULTI_CONN, so the device
// opens the URI's number of connections; x-multi-conn=1 opens one.
func TestMultiConn(t *testing.T) {
	needTool(t, "nbdkit")
	p := nbdkitMemory(t, 1<<20, nil)
	if s := openT(t, p.uri(""), Options{}).Stats(); !s.MultiConn || s.Conns != DefaultConns {
		t.Errorf("default: %+v", s)
	}
	if s := openT(t, p.uri("")+"&x-multi-conn=3", Options{}).Stats(); s.Conns != 3 {
		t.Errorf("x-multi-conn=3: %d connections", s.Conns)
	}
	// Without CAN_MULTI_CONN (nbdkit's multi-conn filter takes it away),
	// one connection.
	q := nbdkitMemory(t, 1<<20, []string{"--filter=multi-conn"}, "multi-conn-mode=disable")
	if s := openT(t, q.uri(""), Options{}).Stats(); s.MultiConn || s.Conns != 1 {
		t.Errorf("server without multi-conn: %+v", s)
	}
}

func TestReadOnly(t *testing.T) {
	needTool(t, "nbdkit")
	p := nbdkitMemory(t, 1<<20, nil)
	d := openT(t, p.uri(""), Options{ReadOnly: true})
	if _, err := d.WriteAt(make([]byte, 512), 0); !errors.Is(err, device.ErrReadOnly) {
		t.Errorf("write on a read-only device: %v", err)
	}
	r := nbdkitMemory(t, 1<<20, []string{"-r"})
	d = openT(t, r.uri(""), Options{})
	if _, err := d.WriteAt(make([]byte, 512), 0); !errors.Is(err, device.ErrReadOnly) {
		t.Errorf("write to a read-only export: %v", err)
	}
}

// TestServerRestartNoReplay kills qemu-nbd (SIGKILL) and restarts it on
// the same image, with no copies of unflushed writes kept (ReplayBytes
// -1): requests issued while it is away wait and then succeed, data
// flushed before the kill is there, and the Sync after the restart fails
// with ErrNotDurable because writes acknowledged before the kill were not
// flushed; once rewritten, Sync succeeds.
func TestServerRestartNoReplay(t *testing.T) {
	needTool(t, "qemu-nbd")
	p, _ := qemuNBD(t, 4<<20)
	d := openT(t, p.uri("e"), Options{OutageTimeout: time.Minute, ReplayBytes: -1})
	a := make([]byte, 65536)
	devicetest.Fill(a, 1)
	if _, err := d.WriteAt(a, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 65536)
	devicetest.Fill(b, 2)
	if _, err := d.WriteAt(b, 1<<20); err != nil {
		t.Fatal(err)
	}
	p.kill()
	// A read issued while the server is down waits for it.
	res := make(chan error, 1)
	got := make([]byte, len(a))
	go func() { _, err := d.ReadAt(got, 0); res <- err }()
	time.Sleep(300 * time.Millisecond)
	p.start()
	if err := <-res; err != nil || !bytes.Equal(got, a) {
		t.Fatalf("read across the restart: %v", err)
	}
	if err := d.Sync(); !errors.Is(err, ErrNotDurable) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("Sync after a restart with unflushed writes: %v; want ErrNotDurable", err)
	}
	if _, err := d.WriteAt(b, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync after rewriting: %v", err)
	}
	if s := d.Stats(); !s.Up || s.Reconnects != 1 || s.Outages != 1 || s.NotDurable != 1 {
		t.Errorf("stats %+v", s)
	}
}

// TestRestartWithoutWrites: a restart with nothing unflushed leaves Sync
// working.
func TestRestartWithoutWrites(t *testing.T) {
	needTool(t, "nbdkit")
	p := nbdkitMemory(t, 1<<20, nil)
	d := openT(t, p.uri(""), Options{})
	if _, err := d.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	p.kill()
	p.start()
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync after a restart with everything flushed: %v", err)
	}
}

// TestOutageTimeout: with the server gone for longer than the outage
// timeout, requests fail with EIO (ErrLinkDown); when it is back they work.
func TestOutageTimeout(t *testing.T) {
	needTool(t, "nbdkit")
	p := nbdkitMemory(t, 1<<20, nil)
	d := openT(t, p.uri(""), Options{OutageTimeout: 200 * time.Millisecond})
	p.kill()
	buf := make([]byte, 4096)
	_, err := d.ReadAt(buf, 0)
	if !errors.Is(err, ErrLinkDown) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("read with the server gone: %v; want EIO, ErrLinkDown", err)
	}
	var ioe *device.IOError
	if !errors.As(err, &ioe) {
		t.Fatalf("read error %T is not a *device.IOError", err)
	}
	if s := d.Stats(); s.Up || s.DownFor == 0 || s.LastError == "" {
		t.Errorf("stats while down: %+v", s)
	}
	p.start()
	for {
		if _, err := d.ReadAt(buf, 0); err == nil {
			break
		} else if !errors.Is(err, ErrLinkDown) {
			t.Fatalf("read after the restart: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRefusedDifferentExport: a server that comes back with another size
// or description is refused, and requests fail with ErrRefused.
func TestRefusedDifferentExport(t *testing.T) {
	needTool(t, "nbdkit")
	sock := sockIn(t, "kit.sock")
	p := startPeer(t, sock, "nbdkit", "-f", "--exit-with-parent", "-U", sock,
		"--filter=exportname", "memory", "1M", "exportdesc=fixed:marker-a")
	d := openT(t, p.uri(""), Options{OutageTimeout: 10 * time.Second})
	if d.Description() != "marker-a" {
		t.Fatalf("description %q", d.Description())
	}
	p.kill()
	p.args = []string{"nbdkit", "-f", "--exit-with-parent", "-U", sock,
		"--filter=exportname", "memory", "1M", "exportdesc=fixed:marker-b"}
	p.start()
	_, err := d.ReadAt(make([]byte, 512), 0)
	if !errors.Is(err, ErrRefused) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("read from a different export: %v; want ErrRefused", err)
	}
	if s := d.Stats(); !s.Refused || s.Up {
		t.Errorf("stats %+v", s)
	}
}

// writeCerts writes a CA and a server certificate for "localhost" in the
// layout nbdkit and libnbd read (ca-cert.pem, server-cert.pem,
// server-key.pem) and returns the directory.
func writeCerts(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	srv := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	for name, b := range map[string]*pem.Block{
		"ca-cert.pem":     {Type: "CERTIFICATE", Bytes: caDER},
		"server-cert.pem": {Type: "CERTIFICATE", Bytes: srvDER},
		"server-key.pem":  {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// kitLosingUnflushed is nbdkit over a file with its cache filter in
// writeback mode: a SIGKILL loses every write it acknowledged that no
// FLUSH covered.
func kitLosingUnflushed(t *testing.T, size int64) *peer {
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	sock := sockIn(t, "kit.sock")
	return startPeer(t, sock, "nbdkit", "-f", "--exit-with-parent", "-U", sock, "--filter=cache", "file", img, "cache=writeback")
}

// TestReplayAfterRestart: writes acknowledged and not flushed when the
// server is killed (and lost by it) are written again on the new
// connection, so the Sync after the restart succeeds and reads return
// them.
func TestReplayAfterRestart(t *testing.T) {
	needTool(t, "nbdkit")
	p := kitLosingUnflushed(t, 4<<20)
	d := openT(t, p.uri(""), Options{})
	a := make([]byte, 65536)
	devicetest.Fill(a, 1)
	if _, err := d.WriteAt(a, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 65536+100)
	devicetest.Fill(b, 2)
	if _, err := d.WriteAt(b, 1<<20+7); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteZeroes(12288, 8192); err != nil {
		t.Fatal(err)
	}
	clear(a[12288 : 12288+8192])
	p.kill()
	p.start()
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync after a restart: %v", err)
	}
	got := make([]byte, len(b))
	if _, err := d.ReadAt(got, 1<<20+7); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("unflushed write after the restart: %v, equal %v", err, bytes.Equal(got, b))
	}
	if _, err := d.ReadAt(got[:len(a)], 0); err != nil || !bytes.Equal(got[:len(a)], a) {
		t.Fatalf("flushed data and unflushed zeroes after the restart: %v", err)
	}
	// Covered by that Sync: another restart loses nothing.
	p.kill()
	p.start()
	if _, err := d.ReadAt(got, 1<<20+7); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("after a second restart: %v", err)
	}
	if s := d.Stats(); s.NotDurable != 0 || s.Reconnects != 2 {
		t.Errorf("stats %+v", s)
	}
}

// TestReplayOverflow: with more unflushed data than ReplayBytes, a restart
// makes the next Sync fail with ErrNotDurable, once.
func TestReplayOverflow(t *testing.T) {
	needTool(t, "nbdkit")
	p := kitLosingUnflushed(t, 4<<20)
	d := openT(t, p.uri(""), Options{ReplayBytes: 100 << 10})
	b := make([]byte, 65536)
	for i := int64(0); i < 3; i++ {
		devicetest.Fill(b, uint64(i))
		if _, err := d.WriteAt(b, i*65536); err != nil {
			t.Fatal(err)
		}
	}
	p.kill()
	p.start()
	if err := d.Sync(); !errors.Is(err, ErrNotDurable) {
		t.Fatalf("Sync after a restart with more unflushed than ReplayBytes: %v; want ErrNotDurable", err)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("second Sync: %v", err)
	}
}

// freePort returns a loopback TCP port nothing listens on now.
func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// pausable is nbdkit over a file that loses unflushed writes when killed
// (kitLosingUnflushed), behind the pause filter: pause makes it a server
// that keeps its connections and answers no request (new connections
// still complete the handshake), resume lets it answer again.
type pausable struct {
	*peer
	ctl string
}

func kitPausable(t *testing.T, network string, size int64) *pausable {
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	ctl := sockIn(t, "ctl.sock")
	args := []string{"nbdkit", "-f", "--exit-with-parent"}
	p := &peer{t: t}
	if network == "unix" {
		p.sock = sockIn(t, "kit.sock")
		args = append(args, "-U", p.sock)
	} else {
		p.tcp = freePort(t)
		host, port, _ := net.SplitHostPort(p.tcp)
		args = append(args, "-i", host, "-p", port)
	}
	p.args = append(args, "--filter=pause", "--filter=cache", "file", img, "cache=writeback", "pause-control="+ctl)
	p.start()
	t.Cleanup(p.kill)
	return &pausable{peer: p, ctl: ctl}
}

// send sends a pause-control command and waits for its echo ('p' is
// echoed once the requests received before it are done).
func (p *pausable) send(cmd byte) {
	p.t.Helper()
	c, err := net.Dial("unix", p.ctl)
	if err != nil {
		p.t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{cmd}); err != nil {
		p.t.Fatal(err)
	}
	var b [1]byte
	if _, err := c.Read(b[:]); err != nil || b[0] != cmd-'a'+'A' {
		p.t.Fatalf("pause control %q: reply %q, %v", cmd, b[:], err)
	}
}

// waitStats waits until cond holds for d's stats.
func waitStats(t *testing.T, d *Device, what string, cond func(Stats) bool) Stats {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		s := d.Stats()
		if cond(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("stats never showed %s: %+v", what, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestHungServer: a server that keeps the connection and stops answering
// (nbdkit's pause filter), over a unix socket and TCP. A write issued
// while it hangs gets no reply; after the request timeout its connection
// is closed as hung and the write is sent again on a new one, where it
// completes once the server answers again. It hangs a second time and is
// killed while hung and restarted: it has lost the writes acknowledged
// that no flush covered, and the device writes them again. Nothing
// acknowledged is lost: the flushed write, the unflushed ones and the
// ones sent during the hangs all read back, and survive another restart
// once a Sync covered them.
func TestHungServer(t *testing.T) {
	needTool(t, "nbdkit")
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			p := kitPausable(t, network, 4<<20)
			d := openT(t, p.uri(""), Options{RequestTimeout: 300 * time.Millisecond, OutageTimeout: time.Minute})
			blocks := make([][]byte, 4)
			for i := range blocks {
				blocks[i] = make([]byte, 65536)
				devicetest.Fill(blocks[i], uint64(i+1))
			}
			if _, err := d.WriteAt(blocks[0], 0); err != nil {
				t.Fatal(err)
			}
			if err := d.Sync(); err != nil {
				t.Fatal(err)
			}
			if _, err := d.WriteAt(blocks[1], 1<<20); err != nil {
				t.Fatal(err)
			}
			// A hang that ends: the write completes on a new connection.
			p.send('p')
			res := make(chan error, 1)
			go func() { _, err := d.WriteAt(blocks[2], 2<<20); res <- err }()
			s := waitStats(t, d, "a request timeout", func(s Stats) bool { return s.Timeouts >= 1 })
			if !strings.Contains(s.LastError, ErrRequestTimeout.Error()) {
				t.Errorf("LastError %q does not name the request timeout", s.LastError)
			}
			select {
			case err := <-res:
				t.Fatalf("write completed while the server hangs: %v", err)
			default:
			}
			p.send('r')
			if err := <-res; err != nil {
				t.Fatalf("write sent while the server hung, once it answers: %v", err)
			}
			// A hang that ends in a restart.
			p.send('p')
			go func() { _, err := d.WriteAt(blocks[3], 3<<20); res <- err }()
			waitStats(t, d, "a second request timeout", func(s Stats) bool { return s.Timeouts >= 2 })
			p.kill()
			p.start()
			if err := <-res; err != nil {
				t.Fatalf("write sent while the server hung, after its restart: %v", err)
			}
			if err := d.Sync(); err != nil {
				t.Fatalf("Sync after the restart: %v", err)
			}
			check := func(when string) {
				t.Helper()
				got := make([]byte, 65536)
				for i, b := range blocks {
					if _, err := d.ReadAt(got, int64(i)<<20); err != nil || !bytes.Equal(got, b) {
						t.Fatalf("%s: block %d: %v, equal %v", when, i, err, bytes.Equal(got, b))
					}
				}
			}
			check("after the restart")
			p.kill()
			p.start()
			check("after a second restart")
			if s := d.Stats(); s.NotDurable != 0 || s.ReplayedWrites == 0 || s.ReplayedBytes < 65536 || !s.Up {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

// TestHungServerFails: a server that completes every handshake and
// answers no request fails requests with EIO once they have been failing
// for the outage timeout, instead of waiting forever; once it answers
// again, requests succeed.
func TestHungServerFails(t *testing.T) {
	needTool(t, "nbdkit")
	p := kitPausable(t, "unix", 1<<20)
	d := openT(t, p.uri(""), Options{RequestTimeout: 200 * time.Millisecond, OutageTimeout: time.Second})
	p.send('p')
	buf := make([]byte, 4096)
	_, err := d.ReadAt(buf, 0)
	if !errors.Is(err, syscall.EIO) || !errors.Is(err, ErrLinkDown) || !errors.Is(err, ErrRequestTimeout) {
		t.Fatalf("read from a hung server: %v; want EIO, ErrLinkDown, ErrRequestTimeout", err)
	}
	p.send('r')
	if _, err := d.ReadAt(buf, 0); err != nil {
		t.Fatalf("read once the server answers again: %v", err)
	}
}

// TestHungHandshake: a peer that accepts connections and never speaks
// (a tiny listener here) fails Open within the dial timeout.
func TestHungHandshake(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = Open(ctx, "nbd://"+l.Addr().String()+"/", Options{DialTimeout: 200 * time.Millisecond})
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Open of a peer that never speaks: %v; want a deadline error", err)
	}
	held = append(held, <-accepted)
}

// TestTLSClientCertificateMissing: a server that requires a client
// certificate (nbdkit --tls-verify-peer), reached with tls-certificates
// holding only the CA, is refused with ErrClientCertificate, whose message
// names the files to add, instead of the broken pipe the TLS layer
// reports once the server has dropped the connection.
func TestTLSClientCertificateMissing(t *testing.T) {
	needTool(t, "nbdkit")
	dir := writeCerts(t)
	sock := sockIn(t, "tls.sock")
	startPeer(t, sock, "nbdkit", "-f", "--exit-with-parent", "-U", sock,
		"--tls=require", "--tls-verify-peer", "--tls-certificates="+dir, "memory", "1M")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := Open(ctx, "nbds+unix:///?socket="+sock+"&tls-certificates="+dir+"&tls-hostname=localhost", Options{})
	if err == nil {
		d.Close()
		t.Fatal("connected to a server that requires a client certificate without one")
	}
	t.Logf("error: %v", err)
	if !errors.Is(err, ErrClientCertificate) {
		t.Fatalf("error %v does not wrap ErrClientCertificate", err)
	}
	if !strings.Contains(err.Error(), filepath.Join(dir, "client-cert.pem")) {
		t.Fatalf("error %q does not say which file to add", err)
	}
}
