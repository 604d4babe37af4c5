// Package s3test starts a real S3 server for tests: versitygw with its
// posix backend, on loopback, over a temporary directory, killed when the
// test ends. No fake stands in for it: the object-store device is tested
// against the same protocol, signatures and conditional writes a real
// store serves.
//
// versitygw is found in $PATH or $(go env GOPATH)/bin (scripts/install-deps.sh
// installs it). When it is missing the test is skipped, except under
// CI=true, where it fails.
package s3test

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

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Credentials of the server's root user. They are test-only values.
const (
	AccessKey = "tiercachetest"
	SecretKey = "tiercachetestsecret"
	Region    = "us-east-1"
)

// Server is a running versitygw.
type Server struct {
	Addr string // host:port
	Dir  string // the posix backend's root: one directory per bucket

	t    testing.TB
	bin  string
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	out  *bytes.Buffer
}

// Binary returns the path of versitygw, or fails (CI=true) or skips t.
func Binary(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p
	}
	if gp, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		p := filepath.Join(strings.TrimSpace(string(gp)), "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("versitygw not found (CI=true: run scripts/install-deps.sh)")
	}
	t.Skip("versitygw not found; scripts/install-deps.sh installs it")
	return ""
}

// Start starts a server on a free loopback port and stops it when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, bin: Binary(t), Dir: t.TempDir()}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = l.Addr().String()
	l.Close()
	s.start()
	t.Cleanup(s.Kill)
	return s
}

func (s *Server) start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	cmd := exec.Command(s.bin, "--access", AccessKey, "--secret", SecretKey, "--region", Region,
		"--port", s.Addr, "--quiet", "posix", s.Dir)
	s.out = new(bytes.Buffer)
	cmd.Stdout, cmd.Stderr = s.out, s.out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("start versitygw: %v", err)
	}
	s.cmd, s.done = cmd, make(chan struct{})
	go func(done chan struct{}) { cmd.Wait(); close(done) }(s.done)
	// Ready when it accepts a connection; it binds in well under a second.
	deadline := time.Now().Add(30 * time.Second)
	for delay := time.Millisecond; ; delay = min(2*delay, 100*time.Millisecond) {
		c, err := net.DialTimeout("tcp", s.Addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-s.done:
			s.t.Fatalf("versitygw exited at start: %s", s.out.String())
		case <-time.After(delay):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("versitygw did not listen on %s: %s", s.Addr, s.out.String())
		}
	}
}

// Kill stops the server with SIGKILL (as a crash would) and waits for it.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-done
}

// Restart kills the server and starts it again on the same address and
// directory.
func (s *Server) Restart() {
	s.Kill()
	s.start()
}

// Endpoint is the server's URL.
func (s *Server) Endpoint() string { return "http://" + s.Addr }

// Env returns the AWS_* variables that point a client at the server.
func (s *Server) Env() []string {
	return []string{
		"AWS_ENDPOINT_URL=" + s.Endpoint(),
		"AWS_REGION=" + Region,
		"AWS_ACCESS_KEY_ID=" + AccessKey,
		"AWS_SECRET_ACCESS_KEY=" + SecretKey,
	}
}

// Client returns a minio-go client of the server's root user.
func (s *Server) Client() *minio.Client {
	s.t.Helper()
	c, err := minio.New(s.Addr, &minio.Options{
		Creds:        credentials.NewStaticV4(AccessKey, SecretKey, ""),
		Region:       Region,
		BucketLookup: minio.BucketLookupPath,
	})
	if err != nil {
		s.t.Fatal(err)
	}
	return c
}

// Bucket creates a bucket and returns its name.
func (s *Server) Bucket(name string) string {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client().MakeBucket(ctx, name, minio.MakeBucketOptions{Region: Region}); err != nil {
		s.t.Fatalf("make bucket %s: %v", name, err)
	}
	return name
}

// String names the server for test logs.
func (s *Server) String() string { return fmt.Sprintf("versitygw at %s over %s", s.Addr, s.Dir) }
