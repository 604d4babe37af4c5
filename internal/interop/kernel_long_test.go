package interop

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestKernelLongZeroAndDiscard sends the kernel's longest requests without
// payload through loop over nbdfuse: fallocate -z of 1 GiB, blkdiscard of
// the whole device, then mkfs.ext4 (which discards and zeroes its journal)
// and fstrim. The kernel splits these only at its own limits (about 2 GiB
// for a loop device), so nbdfuse passes WRITE_ZEROES and TRIM far longer
// than the 32 MiB maximum block size; the server accepts and splits them.
// Before it did, mkfs.ext4 logged "I/O error, dev loop0 ... op
// 0x9:(WRITE_ZEROES)" and fallocate -z -l 64M failed. The test requires
// every command to succeed, the zeroed range to read as zeroes, and the
// kernel log to show no I/O error on the loop device.
func TestKernelLongZeroAndDiscard(t *testing.T) {
	needRoot(t)
	need(t, "nbdfuse", "losetup", "fallocate", "blkdiscard", "fstrim", "mkfs.ext4", "mount", "umount", "fusermount3", "dmesg")
	const size = 1280 * mib
	cs := formatSet(t, 32*mib, size, []string{"disk"}, "--bucket-size", "256K")
	s := cs.serve(t)
	loop := loopDevice(t, nbdfuseFile(t, s.uri("disk")))
	marker := kmsgMarker(t, "long-zero-discard "+loop)

	// 40 MiB of data at 8 MiB, so that the zeroing must drop cached dirty
	// blocks and reach the backing device in several pieces.
	run(t, time.Minute, "dd", "if=/dev/urandom", "of="+loop, "bs=1M", "seek=8", "count=40", "oflag=direct", "conv=fsync", "status=none")
	run(t, time.Minute, "fallocate", "-z", "-o", "0", "-l", "1G", loop)
	for _, r := range [][2]int64{{0, 64 * mib}, {1024*mib - mib, mib}} {
		if err := readsZero(loop, r[0], r[1]); err != nil {
			t.Errorf("after fallocate -z -l 1G: %v", err)
		}
	}
	run(t, time.Minute, "blkdiscard", loop)
	run(t, 2*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
	mnt := filepath.Join(t.TempDir(), "mnt")
	os.Mkdir(mnt, 0o700)
	run(t, 30*time.Second, "mount", "-t", "ext4", loop, mnt)
	mounted := true
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", "-l", mnt).Run()
		}
	})
	if err := os.WriteFile(filepath.Join(mnt, "f"), bytes.Repeat([]byte("tiercache "), 3*mib), 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, "sync")
	os.Remove(filepath.Join(mnt, "f"))
	out := run(t, time.Minute, "fstrim", "-v", mnt)
	if !strings.Contains(out, "trimmed") {
		t.Errorf("fstrim -v printed %q, want the bytes trimmed", out)
	}
	run(t, 30*time.Second, "umount", mnt)
	mounted = false

	if errs := kernelIOErrors(t, marker, loop); len(errs) > 0 {
		t.Errorf("kernel log shows I/O errors on %s:\n%s", loop, strings.Join(errs, "\n"))
	}
	if strings.Contains(s.log.String(), "nbd: backend error") {
		t.Errorf("server logged backend errors:\n%s", s.log)
	}
}

// loopDevice attaches file to a free loop device (direct I/O where the
// kernel allows it on the file) and detaches it at cleanup.
func loopDevice(t *testing.T, file string) string {
	t.Helper()
	out, err := runErr(30*time.Second, "losetup", "--find", "--show", "--direct-io=on", file)
	loop := strings.TrimSpace(out)
	if err != nil || !strings.HasPrefix(loop, "/dev/loop") {
		// Some kernels refuse direct I/O on a FUSE file: retry buffered.
		loop = strings.TrimSpace(run(t, 30*time.Second, "losetup", "--find", "--show", file))
	}
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	return loop
}

// kmsgMarker writes a unique line to the kernel log and returns it, so
// that kernelIOErrors reads only what was logged after it.
func kmsgMarker(t *testing.T, what string) string {
	t.Helper()
	m := fmt.Sprintf("tiercache-interop %s %d", what, time.Now().UnixNano())
	if err := os.WriteFile("/dev/kmsg", []byte(m+"\n"), 0); err != nil {
		t.Fatalf("writing a marker to /dev/kmsg: %v", err)
	}
	return m
}

// kernelIOErrors returns the kernel log lines after marker that report an
// I/O error on dev (a path such as /dev/loop3).
func kernelIOErrors(t *testing.T, marker, dev string) []string {
	t.Helper()
	log := run(t, 30*time.Second, "dmesg")
	i := strings.LastIndex(log, marker)
	if i < 0 {
		t.Fatalf("dmesg does not show the marker %q", marker)
	}
	re := regexp.MustCompile(`(?i)(I/O error|critical .* error).*\b` + regexp.QuoteMeta(filepath.Base(dev)) + `\b`)
	var bad []string
	for _, l := range strings.Split(log[i:], "\n") {
		if re.MatchString(l) {
			bad = append(bad, l)
		}
	}
	return bad
}

// readsZero checks that [off, off+n) of path reads as zeroes.
func readsZero(path string, off, n int64) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, mib)
	zero := make([]byte, mib)
	for at := off; at < off+n; at += mib {
		k := min(mib, off+n-at)
		if _, err := io.ReadFull(io.NewSectionReader(f, at, k), buf[:k]); err != nil {
			return fmt.Errorf("%s at %d: %w", path, at, err)
		}
		if !bytes.Equal(buf[:k], zero[:k]) {
			return fmt.Errorf("%s: the MiB at %d is not zero", path, at)
		}
	}
	return nil
}
