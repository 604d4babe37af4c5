package interop

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// smallFS mounts a tmpfs of size bytes under dir and returns its path; it
// is unmounted at cleanup.
func smallFS(t *testing.T, dir string, size int64) string {
	t.Helper()
	needRoot(t)
	mnt := filepath.Join(dir, "small")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, "mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d", size), "tmpfs", mnt)
	t.Cleanup(func() { exec.Command("umount", "-l", mnt).Run() })
	return mnt
}

// fillFS writes zeroes to a new file in dir until its file system is full.
func fillFS(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "fill")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
	}
	// The last partial write may have left a few bytes: top up 4 KiB-wise.
	for _, n := range []int{4096, 512, 1} {
		for {
			if _, err := f.Write(buf[:n]); err != nil {
				break
			}
		}
	}
	return p
}

// punchBuckets deallocates the bucket area of the cache file at path
// (everything after the metadata), as a file system that reallocates on
// overwrite (copy-on-write, thin provisioning) or a sparse copy leaves it.
func punchBuckets(t *testing.T, path string) {
	t.Helper()
	out := run(t, time.Minute, bin, "inspect", "superblock", "--cache", path)
	m := regexp.MustCompile(`buckets +\d+ x .* at offset (\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("inspect superblock: no bucket offset:\n%s", out)
	}
	off, _ := strconv.ParseInt(m[1], 10, 64)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, fi.Size()-off); err != nil {
		t.Fatal(err)
	}
}

// TestTrustCacheENOSPC: the file system under a cache file fills up. On
// main ENOSPC on cache writes counted as cache device errors, the set
// failed over to passthrough, reads returned errno 28 (the docs promise
// EIO), and after a restart with free space the unflushed blocks read back
// as old data while check exited 0. Now a cache data write that fails with
// ENOSPC goes around the cache as when the cache is full: every write and
// read succeeds with the right data, the set does not fail over, the stats
// count the ENOSPC errors, and after a SIGKILL and a restart with free
// space every flushed write is there and check --cache exits 0.
//
// The cache file is formatted (allocated) on a 24 MiB tmpfs, its bucket
// area deallocated again (what a copy-on-write file system or a sparse copy
// leaves) and the file system filled; the backing file is elsewhere.
func TestTrustCacheENOSPC(t *testing.T) {
	need(t, "qemu-io")
	dir := t.TempDir()
	mnt := smallFS(t, dir, 24*mib)
	cache := sparseFile(t, mnt, "cache.img", 16*mib)
	vol := randomFile(t, dir, "vol.img", 32*mib, 5)
	run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "vol="+vol, "--bucket-size", "256K")
	punchBuckets(t, cache)

	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cache, "--listen", "unix:"+sock, "--admin", admin, "--data-dir", dir)
	run(t, time.Minute, bin, "set", "vol", "writeback_rate_max=4K", "--admin", admin)
	qemu := func(what string, cmds ...string) {
		t.Helper()
		out, err := runErr(2*time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("vol")}, cmds...)...)
		if err != nil || strings.Contains(out, "failed") || strings.Contains(out, "space") || strings.Contains(out, "error") {
			t.Fatalf("%s: %v\n%s\nserver log:\n%s", what, err, out, s.log)
		}
	}
	// Dirty data in the cache while its file system has room: 1 MiB at
	// 0, 3, 6 and 9 MiB, flushed.
	var cmds, reads []string
	for i := range 8 {
		w := []string{"-c", fmt.Sprintf("write -P 0x%x %dm 1m", 0x41+i, 3*i), "-c", "flush"}
		if i < 4 {
			cmds = append(cmds, w...)
		}
		reads = append(reads, "-c", fmt.Sprintf("read -P 0x%x %dm 1m", 0x41+i, 3*i))
	}
	qemu("writes while the file system has room", cmds...)
	// The file system fills up. Writes of 1 MiB at 12 .. 21 MiB, and
	// overwrites of two dirty ranges, each flushed, then everything read
	// back, and reads of untouched ranges (promotions, which ENOSPC drops).
	fill := fillFS(t, mnt)
	cmds = nil
	for i := 4; i < 8; i++ {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P 0x%x %dm 1m", 0x41+i, 3*i), "-c", "flush")
	}
	cmds = append(cmds, "-c", "write -P 0x61 3m 256k", "-c", "flush", "-c", "write -P 0x62 6m 1m", "-c", "flush")
	qemu("writes on a cache whose file system is full", cmds...)
	reads[3] = "read -P 0x61 3m 256k"
	reads = append(reads, "-c", "read -P 0x42 3328k 768k")
	reads[5] = "read -P 0x62 6m 1m"
	qemu("reads on a cache whose file system is full", append(reads, "-c", "read 25m 4m")...)
	stats := run(t, time.Minute, bin, "stats", "--admin", admin)
	m := regexp.MustCompile(`cache_no_space_errors +(\d+)`).FindStringSubmatch(stats)
	if m == nil || m[1] == "0" {
		t.Errorf("stats do not count the ENOSPC errors:\n%s", stats)
	}
	d := regexp.MustCompile(`dirty_blocks +(\d+)`).FindStringSubmatch(stats)
	if d == nil || d[1] == "0" {
		t.Errorf("no dirty data in the cache: the test does not cover a full file system under dirty data:\n%s", stats)
	}
	t.Logf("cache_no_space_errors %s, dirty_blocks %s", m[1], d[1])
	// cache_device_errors is shown when it is not 0.
	if m := regexp.MustCompile(`cache_(device_)?errors +(\d+)`).FindStringSubmatch(stats); m != nil && m[2] != "0" {
		t.Errorf("ENOSPC counted as cache device errors:\n%s", stats)
	}
	if strings.Contains(s.log.String(), "CACHE DEVICE FAILED") || !strings.Contains(s.log.String(), "ENOSPC") {
		t.Errorf("the server log should say ENOSPC once and not fail the set over:\n%s", s.log)
	}
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil // killed on purpose

	if err := os.Remove(fill); err != nil {
		t.Fatal(err)
	}
	s = startServer(t, "--cache", cache, "--data-dir", dir)
	qemu("reads after a restart with free space", reads...)
	s.stop()
	if out, err := runErr(time.Minute, bin, "check", "--cache", cache); err != nil || !strings.Contains(out, "no problems found") {
		t.Fatalf("check --cache after the restart: %v\n%s", err, out)
	}
}

// TestTrustFormatCacheTooBig: format of a sparse cache file larger than the
// free space of its file system refuses before writing anything, with a
// message that says how much is needed, how much is free and how to go on:
// the cache file keeps no blocks and holds no cache set, and neither file
// has an attribute written (on main the identity attributes of both were
// written before the refusal); with the file made smaller, the same format
// succeeds and allocates all of it.
func TestTrustFormatCacheTooBig(t *testing.T) {
	dir := t.TempDir()
	mnt := smallFS(t, dir, 32*mib)
	cache := sparseFile(t, mnt, "cache.img", 64*mib)
	vol := randomFile(t, dir, "vol.img", 8*mib, 7)
	var before unix.Statfs_t
	if err := unix.Statfs(mnt, &before); err != nil {
		t.Fatal(err)
	}

	out, err := runErr(time.Minute, bin, "format", "--cache", cache, "--backing", "vol="+vol, "--bucket-size", "256K")
	if err == nil {
		t.Fatalf("format of a 64 MiB sparse cache file on a 32 MiB file system succeeded:\n%s", out)
	}
	for _, want := range []string{cache, "64 MiB", "not allocated", "free", "truncate -s"} {
		if !strings.Contains(out, want) {
			t.Errorf("format's refusal does not say %q:\n%s", want, out)
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(cache, &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks != 0 || st.Size != 64*mib {
		t.Errorf("the refused cache file has %d blocks allocated and size %d, want 0 and %d", st.Blocks, st.Size, 64*mib)
	}
	var after unix.Statfs_t
	if err := unix.Statfs(mnt, &after); err != nil {
		t.Fatal(err)
	}
	if after.Bfree != before.Bfree {
		t.Errorf("the refused format left %d blocks of the file system in use", int64(before.Bfree)-int64(after.Bfree))
	}
	if out, err := runErr(time.Minute, bin, "inspect", "superblock", "--cache", cache); err == nil {
		t.Errorf("inspect found a superblock on the refused cache file:\n%s", out)
	}
	for _, p := range []string{cache, vol} {
		if n, err := unix.Listxattr(p, make([]byte, 1024)); err != nil || n != 0 {
			t.Errorf("the refused format wrote attributes on %s (%d bytes of names, %v)", p, n, err)
		}
	}

	if err := os.Truncate(cache, 16*mib); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "vol="+vol, "--bucket-size", "256K")
	if err := unix.Stat(cache, &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 < 16*mib {
		t.Errorf("the formatted cache file has %d bytes allocated, want all %d", st.Blocks*512, 16*mib)
	}
}
