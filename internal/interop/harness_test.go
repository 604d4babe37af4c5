// Package interop proves tiercache against NBD clients nobody here wrote:
// nbdinfo, qemu-io, qemu-img, nbdcopy, fio's nbd engine and the kernel block
// path (nbdfuse + losetup + mkfs.ext4 + mount). Each test starts the real
// tiercache binary, built with the race detector, and talks to it only
// through those tools.
//
// A missing tool fails the test when CI is set (make test installs them);
// outside CI it skips with the install hint.
package interop

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// bin is the tiercache binary under test, built once in TestMain.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tiercache-interop-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	bin = filepath.Join(dir, "tiercache")
	args := []string{"build", "-o", bin}
	if os.Getenv("TIERCACHE_INTEROP_NORACE") == "" {
		args = append(args, "-race")
	}
	args = append(args, "github.com/tiercache/tiercache/cmd/tiercache")
	cmd := exec.Command("go", args...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building tiercache:", err)
		os.Exit(2)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// need fails (in CI) or skips the test unless every tool is on PATH.
func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is required in CI (scripts/install-deps.sh installs it): %v", tool, err)
			}
			t.Skipf("%s not installed; run scripts/install-deps.sh", tool)
		}
	}
}

// needRoot fails in CI and skips elsewhere unless running as root.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("the kernel block path test needs root in CI")
		}
		t.Skip("needs root")
	}
}

// server is a running tiercache serve process.
type server struct {
	t      *testing.T
	cmd    *exec.Cmd
	sock   string
	log    *syncBuffer
	done   chan struct{}
	waited error
}

// syncBuffer is a bytes.Buffer safe for the process's writer goroutine and
// the test reading it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startServer runs `tiercache serve ARGS --listen unix:SOCK` and waits until
// the socket accepts connections. At cleanup it sends SIGTERM and requires a
// clean exit (status 0), so every test also checks graceful shutdown.
func startServer(t *testing.T, args ...string) *server {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	args = append([]string{"serve", "--listen", "unix:" + sock}, args...)
	return startServerRaw(t, sock, args...)
}

func startServerRaw(t *testing.T, sock string, args ...string) *server {
	t.Helper()
	return startServerBin(t, bin, sock, args...)
}

// startServerBin is startServerRaw with another tiercache binary.
func startServerBin(t *testing.T, bin, sock string, args ...string) *server {
	t.Helper()
	s := &server{t: t, sock: sock, log: &syncBuffer{}, done: make(chan struct{})}
	s.cmd = exec.Command(bin, args...)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	s.cmd.Env = append(os.Environ(), "GORACE=halt_on_error=1")
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start tiercache: %v", err)
	}
	go func() { s.waited = s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() { s.stop() })
	deadline := time.Now().Add(20 * time.Second)
	for {
		// Ready once its log says "serving": the socket accepts (into its
		// backlog) before the cache set is open and SIGTERM is handled.
		if strings.Contains(s.log.String(), "msg=serving") {
			c, err := net.Dial("unix", sock)
			if err == nil {
				c.Close()
				return s
			}
		}
		select {
		case <-s.done:
			t.Fatalf("tiercache exited before listening: %v\n%s", s.waited, s.log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("tiercache did not listen on %s within 20s\n%s", sock, s.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop sends SIGTERM and requires exit status 0 within 30 s.
func (s *server) stop() {
	t := s.t
	t.Helper()
	select {
	case <-s.done:
	default:
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(30 * time.Second):
			s.cmd.Process.Kill()
			<-s.done
			t.Errorf("tiercache did not stop within 30s of SIGTERM\n%s", s.log)
			return
		}
	}
	if s.waited != nil {
		t.Errorf("tiercache exited with %v\n%s", s.waited, s.log)
	}
	if strings.Contains(s.log.String(), "WARNING: DATA RACE") || strings.Contains(s.log.String(), "panic:") {
		t.Errorf("tiercache log shows a race or panic:\n%s", s.log)
	}
}

// background starts a command with its combined output in a buffer and
// returns it, the buffer and the channel that receives Wait's result.
func background(t *testing.T, name string, args ...string) (*exec.Cmd, *syncBuffer, <-chan error) {
	t.Helper()
	cmd := exec.Command(name, args...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return cmd, out, done
}

// uri is the NBD URI of export name on this server.
func (s *server) uri(name string) string {
	return fmt.Sprintf("nbd+unix:///%s?socket=%s", name, s.sock)
}

// run runs a command with a timeout and fails the test on error, returning
// its combined output.
func run(t *testing.T, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	out, err := runErr(timeout, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func runErr(timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("timed out after %v: %w", timeout, err)
	}
	return string(out), err
}

// sparseFile creates a sparse file of size bytes and returns its path.
func sparseFile(t *testing.T, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return p
}

// randomFile creates a file of size bytes of deterministic pseudo-random data.
func randomFile(t *testing.T, dir, name string, size int64, seed uint64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	buf := make([]byte, size)
	x := seed*0x9E3779B97F4A7C15 + 1
	for i := 0; i+8 <= len(buf); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		for j := 0; j < 8; j++ {
			buf[i+j] = byte(x >> (8 * j))
		}
	}
	if err := os.WriteFile(p, buf, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
