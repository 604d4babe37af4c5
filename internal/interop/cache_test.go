package interop

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// cacheSet is a formatted cache set on files in a test directory.
type cacheSet struct {
	dir, cache string
	backings   map[string]string
}

// formatSet formats a cache of cacheSize in front of the named backing files
// (created sparse, of backingSize) with extra format flags.
func formatSet(t *testing.T, cacheSize, backingSize int64, names []string, flags ...string) *cacheSet {
	t.Helper()
	dir := t.TempDir()
	cs := &cacheSet{dir: dir, cache: sparseFile(t, dir, "cache.img", cacheSize), backings: map[string]string{}}
	args := []string{"format", "--cache", cs.cache}
	for _, n := range names {
		p := sparseFile(t, dir, n+".img", backingSize)
		cs.backings[n] = p
		args = append(args, "--backing", n+"="+p)
	}
	args = append(args, flags...)
	out := run(t, time.Minute, bin, args...)
	if !strings.Contains(out, "cache set") {
		t.Fatalf("format printed no summary:\n%s", out)
	}
	return cs
}

func (cs *cacheSet) serve(t *testing.T, extra ...string) *server {
	t.Helper()
	return startServer(t, append([]string{"--cache", cs.cache}, extra...)...)
}

// TestCacheFioVerifyModes runs fio verify through a cache set in every mode,
// with a working set three times the cache, so eviction and writeback run
// while fio checks every block it wrote.
func TestCacheFioVerifyModes(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	need(t, "fio")
	for _, mode := range []string{"writeback", "writethrough", "writearound", "none"} {
		t.Run(mode, func(t *testing.T) {
			cs := formatSet(t, 32*mib, 256*mib, []string{"vol"}, "--mode", mode, "--bucket-size", "256K")
			s := cs.serve(t)
			fioVerify(t, s.uri("vol"), 2, "48m", "--do_verify=1")
			s.stop()
			// After a clean restart the data is still all there.
			s2 := cs.serve(t)
			fioVerify(t, s2.uri("vol"), 2, "48m", "--verify_only=1")
		})
	}
}

// TestCacheTwoExports serves two backing devices from one cache set and
// checks that they are independent.
func TestCacheTwoExports(t *testing.T) {
	need(t, "nbdinfo", "qemu-io")
	cs := formatSet(t, 16*mib, 64*mib, []string{"a", "b"}, "--bucket-size", "256K")
	s := cs.serve(t)
	out := run(t, 30*time.Second, "nbdinfo", "--list", s.uri(""))
	if !strings.Contains(out, "export=\"a\"") && !strings.Contains(out, "a\n") {
		t.Logf("nbdinfo --list:\n%s", out)
	}
	for _, n := range []string{"a", "b"} {
		if !strings.Contains(out, n) {
			t.Fatalf("export %q not listed:\n%s", n, out)
		}
	}
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("a"), "-c", "write -P 0xaa 0 1m", "-c", "flush")
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("b"), "-c", "write -P 0xbb 0 1m", "-c", "flush")
	out = run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("a"), "-c", "read -P 0xaa 0 1m")
	out += run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("b"), "-c", "read -P 0xbb 0 1m")
	if strings.Contains(out, "failed") {
		t.Fatalf("exports are not independent:\n%s", out)
	}
}

// TestCacheKillAfterFlush kills the server with SIGKILL after a flushed
// write and checks the restarted server returns it (invariant 2 through a
// real client).
func TestCacheKillAfterFlush(t *testing.T) {
	need(t, "qemu-io")
	cs := formatSet(t, 16*mib, 64*mib, []string{"vol"}, "--bucket-size", "256K")
	for round := 0; round < 3; round++ {
		s := cs.serve(t)
		if round > 0 {
			out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", fmt.Sprintf("read -P 0x%02x %dm 1m", 0x40+round-1, round-1))
			if strings.Contains(out, "failed") {
				t.Fatalf("round %d: flushed write lost after SIGKILL:\n%s\nserver log:\n%s", round, out, s.log)
			}
		}
		run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"),
			"-c", fmt.Sprintf("write -P 0x%02x %dm 1m", 0x40+round, round), "-c", "flush")
		s.cmd.Process.Signal(syscall.SIGKILL)
		<-s.done
		s.waited = nil // killed on purpose
	}
}

// TestCacheRefusals checks the errors users meet when they get things wrong.
func TestCacheRefusals(t *testing.T) {
	cs := formatSet(t, 16*mib, 64*mib, []string{"vol"}, "--bucket-size", "256K")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"reformat", []string{"format", "--cache", cs.cache, "--backing", "vol=" + cs.backings["vol"]}, "already belongs to cache set"},
		{"reformat-other-backing", []string{"format", "--cache", cs.cache, "--backing", "x=" + sparseFile(t, cs.dir, "x.img", mib)}, "already holds cache set"},
		{"plain-export-of-backing", []string{"serve", "--export", "raw=" + cs.backings["vol"]}, "backing device of cache set"},
		{"unknown-backing-name", []string{"serve", "--cache", cs.cache, "--backing", "nosuch=/dev/null"}, "no backing device of that name"},
		{"bad-mode", []string{"format", "--cache", sparseFile(t, cs.dir, "c2.img", 16*mib), "--backing", "y=" + sparseFile(t, cs.dir, "y.img", mib), "--mode", "fast"}, "unknown cache mode"},
		{"bad-bucket", []string{"format", "--cache", sparseFile(t, cs.dir, "c3.img", 16*mib), "--backing", "z=" + sparseFile(t, cs.dir, "z.img", mib), "--bucket-size", "1000"}, "bucket size"},
		{"not-a-cache", []string{"serve", "--cache", sparseFile(t, cs.dir, "empty.img", 16*mib)}, "not a tiercache cache device"},
		// format with no --backing makes an empty set (devices are attached
		// later), but a --backing without its path is an error.
		{"backing-without-path", []string{"format", "--cache", sparseFile(t, cs.dir, "c4.img", 16*mib), "--backing", "w"}, "want NAME=PATH"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, err := runErr(30*time.Second, bin, append(c.args, "--data-dir", cs.dir)...)
			if err == nil {
				t.Fatalf("succeeded, want an error mentioning %q:\n%s", c.want, out)
			}
			if !strings.Contains(out, c.want) {
				t.Fatalf("error does not mention %q:\n%s", c.want, out)
			}
		})
	}

	// A backing device whose size changed is refused (invariant 6).
	if err := os.Truncate(cs.backings["vol"], 65*mib); err != nil {
		t.Fatal(err)
	}
	out, err := runErr(30*time.Second, bin, "serve", "--cache", cs.cache, "--listen", "unix:"+filepath.Join(cs.dir, "s.sock"))
	if err == nil || !strings.Contains(out, "size") {
		t.Fatalf("resized backing device not refused (err %v):\n%s", err, out)
	}
}
