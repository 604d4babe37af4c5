package interop

import (
	"bytes"
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
	t.Parallel() // self-contained: its own files, sockets and processes
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

// punchJournal deallocates the journal area of the cache file at path, as a
// file system that reallocates on overwrite leaves it.
func punchJournal(t *testing.T, path string) {
	t.Helper()
	out := run(t, time.Minute, bin, "inspect", "superblock", "--cache", path)
	m := regexp.MustCompile(`journal +(\d+) KiB at offset (\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("inspect superblock: no journal offset:\n%s", out)
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	off, _ := strconv.ParseInt(m[2], 10, 64)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n<<10); err != nil {
		t.Fatal(err)
	}
}

// TestTrustJournalENOSPC: a journal write that fails with ENOSPC (the
// journal area of the cache file deallocated, its file system full) fails
// the set over like any failed metadata write. The client's write fails
// with EIO, never ENOSPC (errno 28), and so does every later FLUSH, on any
// connection (the write was lost with the cache); the server logs CACHE DEVICE FAILED and
// goes on in passthrough: a write after the failover reaches the backing
// device, the lost block reads back as EIO, and no request returns ENOSPC.
//
// Then the restart after the failover, with space freed: the write the
// failover lost (acknowledged, its journal record never durable) is
// recorded on the cache device, and `check --cache` (exit 1), serve's log,
// `status` and online `check` (exit 1) name the volume, the bytes and the
// range until `lost-writes --ack` through the server (offline: refused
// while served; both refuse an ID the record does not hold); the lost range reads the backing device's older
// data, the passthrough write is there, and the set serves writes and
// FLUSHes again. On main the loss was only a log line of the failed
// server: after the restart check exited 0 and nothing said it.
func TestTrustJournalENOSPC(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	need(t, "qemu-io")
	dir := t.TempDir()
	mnt := smallFS(t, dir, 24*mib)
	cache := sparseFile(t, mnt, "cache.img", 16*mib)
	vol := randomFile(t, dir, "vol.img", 32*mib, 9)
	orig, err := os.ReadFile(vol)
	if err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "vol="+vol, "--bucket-size", "256K")
	punchJournal(t, cache)
	filler := fillFS(t, mnt)

	sock := filepath.Join(dir, "nbd.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cache, "--listen", "unix:"+sock, "--data-dir", dir)
	qemu := func(cmds ...string) (string, error) {
		t.Helper()
		out, err := runErr(2*time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("vol")}, cmds...)...)
		if strings.Contains(out, "space") {
			t.Errorf("a client saw ENOSPC:\n%s\nserver log:\n%s", out, s.log)
		}
		return out, err
	}
	// The write's journal commit fails (qemu-io stops at the first failed
	// command, so the flush is sent on its own below).
	out, _ := qemu("-c", "write -P 0x41 1m 1m", "-c", "flush")
	if !strings.Contains(out, "failed: Input/output error") {
		t.Errorf("the write or FLUSH whose journal commit failed with ENOSPC did not fail with EIO:\n%s\nserver log:\n%s", out, s.log)
	}
	if !strings.Contains(s.log.String(), "CACHE DEVICE FAILED") {
		t.Fatalf("the server did not fail the set over:\n%s", s.log)
	}
	// Passthrough: a write elsewhere succeeds, and reaches the backing
	// device; the FLUSH after it fails with EIO, as every later FLUSH does
	// (the write above was lost with the cache). (qemu sends no FLUSH
	// without a write before it on the connection.)
	// qemu-io prints nothing for a failed flush: its exit status says it,
	// and the server's log the errno sent (checked below).
	out, err = qemu("-c", "write -P 0x42 8m 1m", "-c", "flush")
	if !strings.Contains(out, "wrote 1048576/1048576") || err == nil {
		t.Errorf("a write after the failover should succeed and the FLUSH after it fail: %v\n%s\nserver log:\n%s", err, out, s.log)
	}
	if out, err := qemu("-c", "read -P 0x42 8m 1m"); err != nil || strings.Contains(out, "failed") || strings.Contains(out, "error") {
		t.Errorf("a read of the write after the failover failed: %v\n%s\nserver log:\n%s", err, out, s.log)
	}
	got := make([]byte, mib)
	f, err := os.Open(vol)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(got, 8*mib); err != nil {
		t.Fatal(err)
	}
	for i, b := range got {
		if b != 0x42 {
			t.Fatalf("backing device byte %d of the passthrough write is %#x, want 0x42", 8*mib+i, b)
		}
	}
	// The block written before the failover is fenced: EIO, never the
	// backing device's older data.
	if out, _ := qemu("-c", "read 1m 1m"); !strings.Contains(out, "read failed: Input/output error") {
		t.Errorf("a read of the block lost with the cache did not fail with EIO:\n%s", out)
	}
	// The server logged that READ's errno before replying, but its log
	// reaches s.log through a goroutine copying its stderr.
	waitLog(t, s, `msg="nbd: backend error" remote=@ export=vol cmd=READ `)

	// Every request that failed, failed with EIO: the server's log names
	// the errno sent for each, WRITE, READ and FLUSH.
	failed := regexp.MustCompile(`msg="nbd: backend error" .*cmd=(\w+) .*errno=(\d+)`).FindAllStringSubmatch(s.log.String(), -1)
	cmdsSeen := map[string]bool{}
	for _, m := range failed {
		cmdsSeen[m[1]] = true
		if m[2] != "5" {
			t.Errorf("%s failed with errno %s, want 5 (EIO)", m[1], m[2])
		}
	}
	for _, c := range []string{"WRITE", "READ", "FLUSH"} {
		if !cmdsSeen[c] {
			t.Errorf("no %s failed with EIO: the test does not cover it:\n%s", c, s.log)
		}
	}

	s.cmd.Process.Signal(syscall.SIGTERM)
	<-s.done
	if s.waited == nil {
		t.Errorf("serve exited 0 after a cache failover:\n%s", s.log)
	}
	s.waited = nil // a failed-over set exits 1

	// The lost write is recorded: check --cache names it and exits 1.
	lostLine := regexp.MustCompile(`failover 1 at \S+ lost 1048576 bytes of acknowledged writes to volume "vol" .*\[1048576,\+1048576\)`)
	out, err = runErr(time.Minute, bin, "check", "--cache", cache)
	if err == nil || !lostLine.MatchString(out) || !strings.Contains(out, "lost-writes --cache") {
		t.Errorf("check --cache after the failover: want exit 1 and the lost write named (volume, bytes, range, how to acknowledge): %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "lost-writes", "--cache", cache); err != nil || !lostLine.MatchString(out) || !strings.Contains(out, "failover 1 at") {
		t.Errorf("lost-writes --cache: %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "lost-writes", "--cache", cache, "--ack", "7"); err == nil || !strings.Contains(out, "lists failover 1") {
		t.Errorf("lost-writes --cache --ack 7: want a refusal listing failover 1: %v\n%s", err, out)
	}

	// Restart with free space: the set serves again, and says what it lost.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	s = startServerRaw(t, sock, "serve", "--cache", cache, "--listen", "unix:"+sock, "--data-dir", dir)
	if !strings.Contains(s.log.String(), "ACKNOWLEDGED WRITES LOST") || !strings.Contains(s.log.String(), "lost_bytes=1048576") {
		t.Errorf("serve after the failover does not log the recorded lost writes:\n%s", s.log)
	}
	out = run(t, time.Minute, bin, "status", "--data-dir", dir)
	if !strings.Contains(out, "LOST WRITES") || !lostLine.MatchString(out) {
		t.Errorf("status does not report the lost writes:\n%s", out)
	}
	if out, err := runErr(time.Minute, bin, "check", "--data-dir", dir); err == nil || !lostLine.MatchString(out) {
		t.Errorf("online check: want exit 1 and the lost write named: %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "lost-writes", "--cache", cache, "--ack", "1"); err == nil || !strings.Contains(out, "in use") {
		t.Errorf("lost-writes --ack of a served set: want a refusal (in use): %v\n%s", err, out)
	}
	// The lost range holds the backing device's older data (the write is
	// gone, and said to be); the passthrough write is there; writes and
	// FLUSHes work again.
	dump := filepath.Join(dir, "read.bin")
	run(t, 2*time.Minute, "qemu-img", "dd", "-f", "raw", "-O", "raw", "bs=1M", "count=9", "if="+s.uri("vol"), "of="+dump)
	got, err = os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[mib:2*mib], orig[mib:2*mib]) {
		t.Errorf("the lost range does not hold the backing device's older data after the restart")
	}
	if !bytes.Equal(got[8*mib:9*mib], bytes.Repeat([]byte{0x42}, mib)) {
		t.Errorf("the passthrough write is not there after the restart")
	}
	if out, err := runErr(2*time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "write -P 0x43 2m 1m", "-c", "flush", "-c", "read -P 0x43 2m 1m"); err != nil || strings.Contains(out, "failed") {
		t.Errorf("write and FLUSH after the restart: %v\n%s\nserver log:\n%s", err, out, s.log)
	}
	// Acknowledge through the server: an ID the record does not hold is
	// refused, nothing acknowledged; the right one clears it.
	if out, err := runErr(time.Minute, bin, "lost-writes", "--data-dir", dir); err != nil || !lostLine.MatchString(out) {
		t.Errorf("lost-writes (online): %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "lost-writes", "--data-dir", dir, "--ack", "7"); err == nil || !strings.Contains(out, "lists failover(s) 1") || !strings.Contains(out, "nothing was acknowledged") {
		t.Errorf("lost-writes --ack 7 (online): want a refusal listing failover 1: %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "lost-writes", "--data-dir", dir, "--ack", "1"); err != nil || !strings.Contains(out, "failover 1 acknowledged") || !strings.Contains(out, "no lost writes recorded") {
		t.Errorf("lost-writes --ack 1 (online): %v\n%s", err, out)
	}
	if out := run(t, time.Minute, bin, "status", "--data-dir", dir); strings.Contains(out, "LOST WRITES") {
		t.Errorf("status still reports the acknowledged lost writes:\n%s", out)
	}
	s.stop()
	if out, err := runErr(time.Minute, bin, "lost-writes", "--cache", cache); err != nil || !strings.Contains(out, "no lost writes recorded") {
		t.Errorf("lost-writes --cache after the acknowledgement: %v\n%s", err, out)
	}
	if out, err := runErr(time.Minute, bin, "check", "--cache", cache); err != nil || !strings.Contains(out, "no problems found") {
		t.Errorf("check --cache after the acknowledgement: %v\n%s", err, out)
	}
}
