package interop

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMirrorMemberFailsThroughBinary serves a mirrored cache set (format
// --cache A --cache-mirror B) whose member A or B is a faultyDisk, pulls
// it (every read and write returns EIO from the kernel) after dirty data
// was flushed, and checks through an NBD client what docs/OPERATIONS.md
// promises: nothing is lost, the set keeps serving in writeback on the
// survivor without a failover, and `status` says DEGRADED. After SIGKILL
// the server restarts on both devices (the pulled one back, and stale: its
// label is older, so it is not used) and then on the survivor alone, with
// every flushed block intact (stamped blocks, three-state oracle).
func TestMirrorMemberFailsThroughBinary(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	for _, lost := range []string{"A", "B"} {
		t.Run("lost="+lost, func(t *testing.T) { mirrorMemberFails(t, lost) })
	}
}

func mirrorMemberFails(t *testing.T, lost string) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	disk := newFaultyDisk(t, 16*mib, false)
	dir := t.TempDir()
	back := sparseFile(t, dir, "back.img", 64*mib)
	a, b := disk.path, sparseFile(t, dir, "b.img", 12*mib)
	if lost == "B" {
		a, b = sparseFile(t, dir, "a.img", 48*mib), disk.path
	}
	out := run(t, time.Minute, bin, "format", "--cache", a, "--cache-mirror", b, "--backing", "a="+back, "--bucket-size", "256K")
	if !strings.Contains(out, "mirror device") {
		t.Fatalf("format output names no mirror device:\n%s", out)
	}
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	must, _ := checkers(t, &s)
	c := newStampedClient(t, s.sock, "a", 0, 4096, seed)
	must("write", c.write(0, 64, false))
	must("flush", c.flush())
	must("write", c.write(100, 32, false))
	must("flush", c.flush())
	if st := run(t, time.Minute, bin, "status", "--data-dir", dd); !strings.Contains(st, "mirror device") || strings.Contains(st, "DEGRADED") {
		t.Fatalf("status before the failure:\n%s", st)
	}

	disk.set(t, disk.readT, true)
	disk.set(t, disk.writeT, true)
	must("read after pulling "+lost, c.read(0, 64, false))
	must("read dirty blocks after pulling "+lost, c.read(100, 32, false))
	must("write after pulling "+lost, c.write(200, 32, false))
	must("flush after pulling "+lost, c.flush())
	must("read after pulling "+lost, c.read(200, 32, false))
	st := run(t, time.Minute, bin, "status", "--data-dir", dd)
	t.Logf("status with %s pulled:\n%s", lost, st)
	if !strings.Contains(st, "DEGRADED: member "+lost) {
		t.Fatalf("status does not say DEGRADED with member %s failed:\n%s", lost, st)
	}
	if log := s.log.String(); strings.Contains(log, "CACHE DEVICE FAILED") || !strings.Contains(log, "MIRROR MEMBER FAILED") {
		t.Fatalf("want a member failure and no failover:\n%s", log)
	}

	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil
	disk.set(t, disk.readT, false)
	disk.set(t, disk.writeT, false)
	check := func(how string) {
		t.Helper()
		r := newStampedClient(t, s.sock, "a", 0, 4096, seed)
		r.o = c.o
		for i := int64(0); i < 4096; i += 64 {
			must(how, r.read(i, 64, true))
		}
	}
	s = startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	check("after SIGKILL, restarted on both devices")
	if st := run(t, time.Minute, bin, "status", "--data-dir", dd); !strings.Contains(st, "DEGRADED: member "+lost) {
		t.Fatalf("status after the restart on both: the stale member %s is used:\n%s", lost, st)
	}
	s.stop()
	survivor := a
	if lost == "A" {
		survivor = b
	}
	s = startServer(t, "--cache", survivor, "--data-dir", dd)
	check("restarted on the survivor alone")
}
