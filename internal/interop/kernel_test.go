package interop

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestKernelExt4 drives the kernel's block layer through tiercache: nbdfuse
// exposes the export as a file, losetup makes it a block device, and ext4 is
// made, mounted, filled, unmounted, remounted and read back. Every step is
// undone in cleanup even when the test fails half way.
func TestKernelExt4(t *testing.T) {
	needRoot(t)
	need(t, "nbdfuse", "losetup", "mkfs.ext4", "mount", "umount", "fusermount3")
	t.Run("plain", func(t *testing.T) {
		img := sparseFile(t, t.TempDir(), "disk.img", 256*mib)
		kernelExt4(t, startServer(t, "--export", "disk="+img), "disk")
	})
	t.Run("cache", func(t *testing.T) {
		// A writeback cache smaller than the data written.
		cs := formatSet(t, 16*mib, 256*mib, []string{"disk"}, "--bucket-size", "256K")
		kernelExt4(t, cs.serve(t), "disk")
	})
}

func kernelExt4(t *testing.T, s *server, export string) {
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o700)
	diskFile := nbdfuseFile(t, s.uri(export))
	if fi, err := os.Stat(diskFile); err != nil || fi.Size() != 256*mib {
		t.Fatalf("nbdfuse file: %v size %v", err, fi)
	}

	loop := loopDevice(t, diskFile)

	run(t, 2*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
	mount := func() {
		run(t, 30*time.Second, "mount", "-t", "ext4", loop, mnt)
	}
	umount := func() {
		run(t, 30*time.Second, "umount", mnt)
	}
	mount()
	mounted := true
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", "-l", mnt).Run()
		}
	})

	// Files of several sizes, with their hashes.
	want := map[string][32]byte{}
	for i, size := range []int{0, 1, 4095, 4096, 65537, 3 * mib, 17 * mib} {
		name := fmt.Sprintf("f%d", i)
		data := bytes.Repeat([]byte(fmt.Sprintf("tiercache %d ", i)), size/12+1)[:size]
		if err := os.WriteFile(filepath.Join(mnt, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
		want[name] = sha256.Sum256(data)
	}
	run(t, time.Minute, "sync")
	umount()
	mounted = false
	// fsck must find a clean file system.
	run(t, 2*time.Minute, "fsck.ext4", "-n", "-f", loop)
	mount()
	mounted = true
	for name, h := range want {
		data, err := os.ReadFile(filepath.Join(mnt, name))
		if err != nil {
			t.Fatal(err)
		}
		if sha256.Sum256(data) != h {
			t.Errorf("%s: content differs after remount", name)
		}
	}
	umount()
	mounted = false
}

// nbdfuseFile mounts nbdfuse with args (an NBD URI, or "[ CMD ARGS ]" to
// run a server) on a FUSE directory in a temporary directory, waits until
// it is ready and returns the file that exposes the export; cleanup
// unmounts it.
func nbdfuseFile(t *testing.T, args ...string) string {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Fatalf("/dev/fuse missing: %v", err)
	}
	dir := t.TempDir()
	fuseDir := filepath.Join(dir, "fuse")
	os.Mkdir(fuseDir, 0o700)
	pidfile := filepath.Join(dir, "nbdfuse.pid")
	file := filepath.Join(fuseDir, "disk")
	fuse, fuseLog, fuseDone := background(t, "nbdfuse", append([]string{"-P", pidfile, file}, args...)...)
	t.Cleanup(func() {
		exec.Command("fusermount3", "-u", fuseDir).Run()
		select {
		case <-fuseDone:
		case <-time.After(10 * time.Second):
			fuse.Process.Kill()
			<-fuseDone
		}
	})
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(pidfile); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("nbdfuse not ready within 20s:\n%s", fuseLog)
		}
	}
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("nbdfuse file: %v\n%s", err, fuseLog)
	}
	return file
}

func waitFor(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
