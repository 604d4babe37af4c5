package nbd

// Interoperability with real peers: libnbd's tools and qemu-io against our
// server, and our Client against nbdkit and qemu-nbd. Each test is skipped
// when its tool is not installed (or with -short).

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func needTool(t *testing.T, name string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("interop tests skipped with -short")
	}
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not installed, and CI must run every test (scripts/install-deps.sh installs it)", name)
		}
		t.Skipf("%s not installed (scripts/install-deps.sh installs it)", name)
	}
	return p
}

func runTool(t *testing.T, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	}
	return string(out)
}

func uri(ts *testServer, export string) string {
	return "nbd+unix:///" + export + "?socket=" + ts.addr
}

func TestInteropNbdinfo(t *testing.T) {
	needTool(t, "nbdinfo")
	ts := startServer(t, Config{},
		Export{Name: "d", Description: "a disk", Backend: newMem(8 << 20), MinBlockSize: 512},
		Export{Name: "ro", Backend: plain{newMem(1 << 20)}, ReadOnly: true},
	)
	var info struct {
		Protocol   string `json:"protocol"`
		Structured bool   `json:"structured"`
		Exports    []struct {
			Name        string   `json:"export-name"`
			Description string   `json:"description"`
			Contexts    []string `json:"contexts"`
			ReadOnly    bool     `json:"is_read_only"`
			CanCache    bool     `json:"can_cache"`
			CanDF       bool     `json:"can_df"`
			CanFastZero bool     `json:"can_fast_zero"`
			CanFlush    bool     `json:"can_flush"`
			CanFUA      bool     `json:"can_fua"`
			CanMulti    bool     `json:"can_multi_conn"`
			CanTrim     bool     `json:"can_trim"`
			CanZero     bool     `json:"can_zero"`
			Min         uint32   `json:"block_size_minimum"`
			Preferred   uint32   `json:"block_size_preferred"`
			Max         uint32   `json:"block_size_maximum"`
			Size        int64    `json:"export-size"`
		} `json:"exports"`
	}
	out := runTool(t, "nbdinfo", "--json", uri(ts, "d"))
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo output %q: %v", out, err)
	}
	e := info.Exports[0]
	if info.Protocol != "newstyle-fixed" || !info.Structured || e.Name != "d" || e.Description != "a disk" ||
		e.Size != 8<<20 || e.Min != 512 || e.Preferred != 4096 || e.Max != 32<<20 || e.ReadOnly ||
		!e.CanCache || !e.CanDF || !e.CanFastZero || !e.CanFlush || !e.CanFUA || !e.CanMulti || !e.CanTrim || !e.CanZero ||
		len(e.Contexts) != 1 || e.Contexts[0] != "base:allocation" {
		t.Errorf("nbdinfo: %+v", info)
	}
	out = runTool(t, "nbdinfo", "--json", uri(ts, "ro"))
	if err := json.Unmarshal([]byte(out), &info); err != nil || !info.Exports[0].ReadOnly || info.Exports[0].CanTrim {
		t.Errorf("nbdinfo ro: %q %v", out, err)
	}
	out = runTool(t, "nbdinfo", "--list", "--json", uri(ts, ""))
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 2 {
		t.Errorf("nbdinfo --list: %q %v", out, err)
	}
	out = runTool(t, "nbdinfo", "--map", uri(ts, "d"))
	if f := strings.Fields(out); len(f) < 4 || f[0] != "0" || f[1] != "8388608" || f[2] != "0" {
		t.Errorf("nbdinfo --map: %q", out)
	}
}

func TestInteropQemuIO(t *testing.T) {
	needTool(t, "qemu-io")
	for _, min := range []uint32{1, 512} {
		ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(8 << 20), MinBlockSize: min})
		out := runTool(t, "qemu-io", "-f", "raw", uri(ts, "d"),
			"-c", "write -P 0xab 0 64k",
			"-c", "read -P 0xab 0 64k",
			"-c", "write -P 0xcd 1000 100", // unaligned: qemu does read-modify-write with min 512
			"-c", "read -P 0xcd 1000 100",
			"-c", "read -P 0xab 0 1000",
			"-c", "write -z 64k 64k",
			"-c", "read -P 0 64k 64k",
			"-c", "write -z -u 1M 1M",
			"-c", "read -P 0 1M 1M",
			"-c", "write -f -P 0x11 2M 4k", // FUA
			"-c", "aio_write -P 0x22 3M 4k", // concurrent writes (to different places:
			"-c", "aio_write -P 0x33 5M 4k", // NBD does not order overlapping ones)
			"-c", "aio_flush",
			"-c", "read -P 0x22 3M 4k",
			"-c", "read -P 0x33 5M 4k",
			"-c", "discard 4M 64k",
			"-c", "flush",
		)
		if strings.Contains(out, "fail") || strings.Contains(out, "error") || strings.Count(out, "read ") != 7 {
			t.Errorf("min %d: qemu-io:\n%s", min, out)
		}
	}
}

func TestInteropNbdcopy(t *testing.T) {
	needTool(t, "nbdcopy")
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(4 << 20)})
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	data := make([]byte, 4<<20)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < len(data); i += 8 << 10 {
		if rng.IntN(3) > 0 { // leave some zero runs: nbdcopy zeroes them
			for j := i; j < i+8<<10; j++ {
				data[j] = byte(rng.Uint32())
			}
		}
	}
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	runTool(t, "nbdcopy", src, uri(ts, "d"))
	runTool(t, "nbdcopy", uri(ts, "d"), dst)
	got, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("nbdcopy round trip differs (%v)", err)
	}
}

// startPeer runs an NBD server command that listens on sock and waits for
// the socket to appear.
func startPeer(t *testing.T, sock string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill() // our own child, by pid
		<-done
	})
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := os.Stat(sock); err == nil {
			return
		}
		select {
		case <-done:
			t.Fatalf("%s exited: %s", name, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not create %s", name, sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// exerciseClient runs every Client operation against a real server.
func exerciseClient(t *testing.T, sock, export string, opts ClientOptions) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, "unix", sock, export, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Size() != 4<<20 {
		t.Fatalf("size %d", c.Size())
	}
	data := bytes.Repeat([]byte("0123456789abcdef"), 8192)
	if err := c.WriteAt(data, 4096, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if c.Flags()&FlagSendWriteZeroes != 0 {
		if err := c.WriteZeroes(4096, 65536, false, true, false); err != nil {
			t.Fatal(err)
		}
		if err := c.ReadAt(got[:65536], 4096); err != nil || !bytes.Equal(got[:65536], make([]byte, 65536)) {
			t.Fatalf("zeroes: %v", err)
		}
	}
	if c.Flags()&FlagSendTrim != 0 {
		if err := c.Trim(1<<20, 65536, false); err != nil {
			t.Fatal(err)
		}
	}
	if c.Flags()&FlagSendCache != 0 {
		if err := c.Cache(0, 65536); err != nil {
			t.Fatal(err)
		}
	}
	if opts.BlockStatus {
		if n, _, err := c.BlockStatus(0, 65536); err != nil || n == 0 || n > 65536 {
			t.Fatalf("block status: %d %v", n, err)
		}
	}
	var e *Error
	if err := c.ReadAt(got[:4096], 4<<20); !errors.As(err, &e) || e.Errno != EINVAL {
		t.Fatalf("read past end: %v", err)
	}
	if err := c.ReadAt(got[:4096], 0); err != nil {
		t.Fatalf("connection unusable after an error: %v", err)
	}
}

func TestInteropClientNbdkit(t *testing.T) {
	nbdkit := needTool(t, "nbdkit")
	sock := filepath.Join(filepath.Dir(sockPath(t)), "kit.sock")
	startPeer(t, sock, nbdkit, "-f", "--exit-with-parent", "-U", sock, "memory", "4M")
	exerciseClient(t, sock, "", ClientOptions{})
	exerciseClient(t, sock, "", ClientOptions{StructuredReplies: true, BlockStatus: true})
	names, err := List(t.Context(), "unix", sock)
	if err != nil || len(names) != 1 {
		t.Fatalf("List: %q %v", names, err)
	}
}

func TestInteropClientQemuNbd(t *testing.T) {
	qemuNBD := needTool(t, "qemu-nbd")
	dir := filepath.Dir(sockPath(t))
	img := filepath.Join(dir, "img")
	if err := os.WriteFile(img, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "q.sock")
	startPeer(t, sock, qemuNBD, "-f", "raw", "-k", sock, "-x", "q", "-t", img)
	exerciseClient(t, sock, "q", ClientOptions{})
	exerciseClient(t, sock, "q", ClientOptions{StructuredReplies: true, BlockStatus: true})
}

func TestInteropTLS(t *testing.T) {
	needTool(t, "nbdcopy")
	scfg, _ := testTLS(t)
	ts := startServer(t, Config{TLSConfig: scfg, RequireTLS: true}, Export{Name: "d", Backend: newMem(1 << 20)})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go ts.Serve(l)
	dir := t.TempDir()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: scfg.Certificates[0].Certificate[0]})
	if err := os.WriteFile(filepath.Join(dir, "ca-cert.pem"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	data := bytes.Repeat([]byte("over tls "), (1<<20)/9+1)[:1<<20]
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	u := "nbds://" + l.Addr().String() + "/d?tls-certificates=" + dir
	runTool(t, "nbdcopy", src, u)
	runTool(t, "nbdcopy", u, dst)
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("nbdcopy over TLS round trip differs (%v)", err)
	}
	// Without TLS the server refuses to serve the export.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "nbdcopy", "nbd://"+l.Addr().String()+"/d", dst).CombinedOutput(); err == nil {
		t.Fatalf("plain nbdcopy succeeded against a TLS-only server: %s", out)
	}
}
