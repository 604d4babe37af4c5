package interop

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWritebackBackoffThroughBinary: background writeback against a backing
// device whose writes fail (real EIO from the kernel, faultyDisk) retries
// with exponential backoff: one WARN line when it starts failing (and a
// summary a minute), not one per attempt (on main: about 27 a second), the
// failure counter and the failing gauge in the stats, and once the device
// works again writeback catches up, says "recovered" once, and every dirty
// block is written back.
func TestWritebackBackoffThroughBinary(t *testing.T) {
	need(t, "qemu-io")
	disk := newFaultyDisk(t, 64*mib, false)
	dir := t.TempDir()
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "a="+disk.path, "--bucket-size", "256K", "--trust-path")
	sock := filepath.Join(dir, "nbd.sock")
	adminSock := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", adminSock, "--data-dir", dir)
	adminClient(t, adminSock)
	type volStats struct {
		DirtyBlocks       int64 `json:"dirty_blocks"`
		WritebackFailures int64 `json:"writeback_failures"`
		WritebackFailing  bool  `json:"writeback_failing"`
	}
	stats := func() volStats {
		t.Helper()
		var st struct {
			Exports []struct {
				Name   string
				Volume volStats
			}
		}
		out := run(t, time.Minute, bin, "stats", "--json", "--admin", adminSock)
		if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Exports) != 1 {
			t.Fatalf("stats --json: %v\n%s", err, out)
		}
		return st.Exports[0].Volume
	}

	disk.set(t, disk.writeT, true)
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("a"), "-c", "write -P 0x6b 0 2m", "-c", "flush")
	time.Sleep(5 * time.Second) // writeback fails throughout
	warns := 0
	for _, l := range strings.Split(s.log.String(), "\n") {
		if strings.Contains(l, "WARN") && strings.Contains(l, "writeback") {
			warns++
		}
	}
	st := stats()
	t.Logf("after 5 s of failing writes: %d WARN lines about writeback, stats %+v", warns, st)
	if warns < 1 || warns > 3 {
		t.Errorf("%d WARN lines about writeback in 5 s of failures, want 1 (one per state change):\n%s", warns, s.log)
	}
	if st.WritebackFailures < 2 || !st.WritebackFailing || st.DirtyBlocks == 0 {
		t.Errorf("stats while writeback fails: %+v, want failures counted, failing set, dirty data kept", st)
	}

	disk.set(t, disk.writeT, false)
	deadline := time.Now().Add(time.Minute)
	for st = stats(); st.WritebackFailing || st.DirtyBlocks != 0; st = stats() {
		if time.Now().After(deadline) {
			t.Fatalf("writeback did not recover within a minute of the device working again: %+v\n%s", st, s.log)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n := strings.Count(s.log.String(), "writeback to the backing device recovered"); n != 1 {
		t.Errorf("%d 'recovered' lines, want 1:\n%s", n, s.log)
	}
	out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("a"), "-c", "read -P 0x6b 0 2m")
	if strings.Contains(out, "failed") {
		t.Fatalf("data lost:\n%s", out)
	}
}
