package interop

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestKernelSequentialBypass writes a 512 MiB file with dd on ext4 on loop
// over nbdfuse over tiercache (writeback, default settings) and requires
// the stream to bypass the cache once past the cache's room for streams,
// as sequential_cutoff promises: first on a clean cache, then while the
// cache holds dirty data from 4 KiB random overwrites with an fsync every
// 32 (background writeback held with writeback_rate_max=1 so that the
// data stays dirty through the dd). The
// kernel path is what makes this hard: the page cache's writeback sends the
// file as many requests in flight, which nbdfuse's threads deliver out of
// order, interleaved with ext4's journal writes (issue 14: through this path
// on a cache holding dirty data, 0 B were bypassed).
func TestKernelSequentialBypass(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	needRoot(t)
	need(t, "nbdfuse", "losetup", "mkfs.ext4", "mount", "umount", "fusermount3", "dd", "fio")
	const fileSize = 512 * mib
	dir := t.TempDir()
	cachePath := sparseFile(t, dir, "cache.img", 128*mib)
	disk := sparseFile(t, dir, "disk.img", 1024*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--data-dir", dir)
	tc := func(args ...string) string {
		t.Helper()
		return run(t, time.Minute, bin, append(args, "--admin", admin)...)
	}
	type volStats struct {
		DirtyBlocks           int64  `json:"dirty_blocks"`
		WriteBytes            uint64 `json:"write_bytes"`
		BypassSequentialBytes uint64 `json:"bypass_sequential_bytes"`
	}
	stats := func() volStats {
		t.Helper()
		var st struct {
			Exports []struct {
				Volume volStats `json:"volume"`
			}
		}
		if err := json.Unmarshal([]byte(tc("stats", "--json")), &st); err != nil || len(st.Exports) != 1 {
			t.Fatalf("stats --json: %v, %d exports", err, len(st.Exports))
		}
		return st.Exports[0].Volume
	}

	diskFile := nbdfuseFile(t, s.uri("disk"))
	out, err := runErr(30*time.Second, "losetup", "--find", "--show", "--direct-io=on", diskFile)
	loop := strings.TrimSpace(out)
	if err != nil || !strings.HasPrefix(loop, "/dev/loop") {
		t.Fatalf("losetup --direct-io=on on the nbdfuse file: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	run(t, 2*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o700)
	run(t, 30*time.Second, "mount", "-t", "ext4", "-o", "noatime", loop, mnt)
	t.Cleanup(func() { exec.Command("umount", "-l", mnt).Run() })

	// dd writes the file through the page cache; conv=fsync makes it reach
	// tiercache before dd exits. A stream that is not bypassed fills the
	// cache and waits for writeback: the timeout turns that into a failure
	// rather than a hung test.
	ddFile := func(t *testing.T, name string) {
		t.Helper()
		before := stats()
		if _, err := runErr(2*time.Minute, "dd", "if=/dev/zero", "of="+filepath.Join(mnt, name), "bs=1M", "count=512", "conv=fsync", "status=none"); err != nil {
			t.Fatalf("dd %s: %v\nstats: %+v\nserver log:\n%s", name, err, stats(), s.log)
		}
		after := stats()
		written := after.WriteBytes - before.WriteBytes
		bypassed := after.BypassSequentialBytes - before.BypassSequentialBytes
		t.Logf("%s: %d MiB written to the export, %d MiB bypassed as sequential; %d dirty blocks before, %d after", name, written>>20, bypassed>>20, before.DirtyBlocks, after.DirtyBlocks)
		// The start of the file goes to the cache while the cache has
		// room for streams: all its streams together take less than the
		// room (at most the writeback target, 10 % of this 128 MiB
		// cache, and never more than 90 MiB, the throttle point), one
		// stream about half of it; each stream's first sequential_cutoff
		// (4 MiB) goes to the cache when it has less. ext4 adds its
		// metadata.
		const want = fileSize - 96*mib
		if bypassed < want {
			t.Errorf("%s: %d MiB of the %d MiB file bypassed as sequential (want at least %d MiB); %d MiB written to the export; %d dirty blocks before the dd",
				name, bypassed>>20, fileSize>>20, want>>20, written>>20, before.DirtyBlocks)
		}
	}
	// Clean: what mkfs and the mount wrote is written back first (ext4's
	// journal still writes beside the file during the dd).
	tc("flush", "disk")
	t.Run("clean", func(t *testing.T) { ddFile(t, "clean") })
	if err := os.Remove(filepath.Join(mnt, "clean")); err != nil { // room for the next file
		t.Fatal(err)
	}

	// Dirty data that stays: 4 KiB random overwrites of an 8 MiB file,
	// O_DIRECT, an fsync every 32 writes (small flush epochs), with
	// background writeback held.
	tc("set", "disk", "writeback_rate_max=1")
	run(t, 2*time.Minute, "fio", "--name=history", "--filename="+filepath.Join(mnt, "history"), "--ioengine=psync", "--direct=1",
		"--rw=randwrite", "--bs=4k", "--size=8m", "--io_size=8m", "--fsync=32", "--randseed=14")
	t.Run("dirty", func(t *testing.T) {
		if st := stats(); st.DirtyBlocks < 1024 {
			t.Fatalf("the cache holds %d dirty blocks after 8 MiB of fsync'd 4 KiB overwrites with writeback held, want at least 1024", st.DirtyBlocks)
		}
		ddFile(t, "dirty")
	})
}
