package interop

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Remote backing devices (device/nbddev) through the built binary: an
// nbdkit or qemu-nbd export as the backing device of a cache set.

// remotePeer is an NBD server process the test started as a remote
// backing device, on a unix socket.
type remotePeer struct {
	t    *testing.T
	sock string
	args []string
	cmd  *exec.Cmd
	out  *syncBuffer
	done <-chan error
}

// startRemote runs args (a server that listens on sock) and waits until
// the socket accepts connections; the cleanup kills it.
func startRemote(t *testing.T, sock string, args ...string) *remotePeer {
	t.Helper()
	p := &remotePeer{t: t, sock: sock, args: args}
	p.start()
	t.Cleanup(p.kill)
	return p
}

func (p *remotePeer) start() {
	p.t.Helper()
	os.Remove(p.sock)
	p.cmd, p.out, p.done = background(p.t, p.args[0], p.args[1:]...)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("unix", p.sock); err == nil {
			c.Close()
			return
		}
		select {
		case err := <-p.done:
			p.t.Fatalf("%s exited: %v\n%s", p.args[0], err, p.out)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s did not listen on %s", p.args[0], p.sock)
		}
	}
}

// kill sends SIGKILL to the server (our child, by pid) and waits for it.
func (p *remotePeer) kill() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Kill()
	<-p.done
	p.cmd = nil
}

func (p *remotePeer) uri(export string) string {
	return "nbd+unix:///" + export + "?socket=" + p.sock
}

// shortDir is a temporary directory with a path short enough for unix
// sockets.
func shortDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "tcr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// nbdkitMemoryArgs is an nbdkit memory export of size (e.g. "32M") with
// description desc ("" for none).
func nbdkitMemoryArgs(sock, size, desc string) []string {
	args := []string{"nbdkit", "-f", "--exit-with-parent", "-U", sock}
	if desc == "" {
		return append(args, "memory", size)
	}
	return append(args, "--filter=exportname", "memory", size, "exportdesc=fixed:"+desc)
}

// refusedRun runs the binary expecting failure with every one of want in
// its output.
func refusedRun(t *testing.T, want []string, args ...string) string {
	t.Helper()
	out, err := runErr(time.Minute, bin, args...)
	if err == nil {
		t.Fatalf("tiercache %s succeeded; want a refusal\n%s", strings.Join(args, " "), out)
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Fatalf("tiercache %s: output lacks %q:\n%s", strings.Join(args, " "), w, out)
		}
	}
	return out
}

// TestRemoteBacking: format a cache set in front of an nbdkit export,
// write through it in writeback mode, detach offline (which writes every
// dirty block back over NBD), and find the data on the remote.
func TestRemoteBacking(t *testing.T) {
	need(t, "nbdkit", "nbdcopy")
	dir := shortDir(t)
	remote := startRemote(t, filepath.Join(dir, "r.sock"), nbdkitMemoryArgs(filepath.Join(dir, "r.sock"), "32M", "marker-1")...)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	out := run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vm="+remote.uri(""), "--bucket-size", "256K")
	if !strings.Contains(out, "id nbd:nbd+unix:///?socket=") || !strings.Contains(out, "#marker-1") {
		t.Fatalf("format output does not show the remote identity:\n%s", out)
	}
	src := randomFile(t, dir, "src", 4*mib, 7)
	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", admin)
	run(t, time.Minute, "nbdcopy", src, s.uri("vm"))

	// A second remote, attached and detached while serving.
	other := startRemote(t, filepath.Join(dir, "o.sock"), nbdkitMemoryArgs(filepath.Join(dir, "o.sock"), "8M", "marker-2")...)
	tc := func(args ...string) string {
		t.Helper()
		return run(t, time.Minute, bin, append(args, "--admin", admin)...)
	}
	if out := tc("attach", "two="+other.uri("")); !strings.Contains(out, `export "two" is served now`) {
		t.Fatalf("attach:\n%s", out)
	}
	if out, err := runErr(time.Minute, bin, "attach", "again="+other.uri(""), "--admin", admin); err == nil || !strings.Contains(out, `is the backing device of volume "two"`) {
		t.Fatalf("attaching the same export twice: %v\n%s", err, out)
	}
	if out := tc("status"); !strings.Contains(out, "nbd+unix:///?socket="+other.sock) {
		t.Errorf("status does not show the remote's URI:\n%s", out)
	}
	src2 := randomFile(t, dir, "src2", 1*mib, 8)
	run(t, time.Minute, "nbdcopy", src2, s.uri("two"))
	tc("detach", "two")
	got2 := filepath.Join(dir, "got2")
	run(t, time.Minute, "nbdcopy", other.uri(""), got2)
	want2, _ := os.ReadFile(src2)
	if have2, _ := os.ReadFile(got2); !bytes.Equal(have2[:len(want2)], want2) {
		t.Fatal("the second remote does not hold what was written through the cache before its detach")
	}
	s.stop()
	run(t, 2*time.Minute, bin, "detach", "--cache", cachePath, "vm")
	got := filepath.Join(dir, "got")
	run(t, time.Minute, "nbdcopy", remote.uri(""), got)
	want, _ := os.ReadFile(src)
	have, _ := os.ReadFile(got)
	if len(have) != 32*mib || !bytes.Equal(have[:len(want)], want) {
		t.Fatalf("the remote export does not hold what was written through the cache (%d bytes read)", len(have))
	}
	if !bytes.Equal(have[len(want):], make([]byte, len(have)-len(want))) {
		t.Fatal("the remote export has data past what was written")
	}
}

// TestRemoteBackingIdentity: an export without a description is refused
// unless --trust-path; an export that comes back with another description
// (another export at the same URI) is refused by serve and reported by
// check; --force serves it.
func TestRemoteBackingIdentity(t *testing.T) {
	need(t, "nbdkit")
	dir := shortDir(t)
	sock := filepath.Join(dir, "r.sock")
	remote := startRemote(t, sock, nbdkitMemoryArgs(sock, "8M", "")...)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	refusedRun(t, []string{"no description", "--trust-path"}, "format", "--cache", cachePath, "--backing", "vm="+remote.uri(""), "--bucket-size", "256K")
	out := run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vm="+remote.uri(""), "--bucket-size", "256K", "--trust-path")
	if !strings.Contains(out, "WARNING") || !strings.Contains(out, "will NOT be caught") {
		t.Fatalf("--trust-path on an export without a description is not said loudly:\n%s", out)
	}

	remote.kill()
	remote.args = nbdkitMemoryArgs(sock, "8M", "marker-a")
	remote.start()
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vm="+remote.uri(""), "--bucket-size", "256K", "--force")
	remote.kill()
	remote.args = nbdkitMemoryArgs(sock, "8M", "marker-b")
	remote.start()
	lsock := filepath.Join(dir, "nbd.sock")
	refusedRun(t, []string{"identity mismatch", "#marker-a", "#marker-b"}, "serve", "--cache", cachePath, "--listen", "unix:"+lsock)
	refusedRun(t, []string{"identity mismatch", "#marker-b"}, "check", "--cache", cachePath)
	// Another size is refused too, even with the right description.
	remote.kill()
	remote.args = nbdkitMemoryArgs(sock, "16M", "marker-a")
	remote.start()
	refusedRun(t, []string{"vm"}, "serve", "--cache", cachePath, "--listen", "unix:"+lsock)
	refusedRun(t, []string{"16777216 bytes", "8388608"}, "check", "--cache", cachePath)

	remote.kill()
	remote.args = nbdkitMemoryArgs(sock, "8M", "marker-b")
	remote.start()
	s := startServerRaw(t, lsock, "serve", "--cache", cachePath, "--listen", "unix:"+lsock, "--force")
	if !strings.Contains(s.log.String(), "identity does not match") {
		t.Errorf("serve --force over a mismatched remote does not warn:\n%s", s.log)
	}
}
