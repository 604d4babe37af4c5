package interop

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestOperationsWalkthrough is docs/OPERATIONS.md's promise, with the real
// binary and real clients: accelerate an existing disk without reformatting
// it, write and read through the cache (qemu-io), watch hit ratio and dirty
// data (usage, stats), change the mode live (set), check it online, detach
// it, and find the disk complete and usable alone (nbdcopy of a plain
// export of it equals the original with the writes applied).
func TestOperationsWalkthrough(t *testing.T) {
	need(t, "qemu-io", "nbdcopy")
	dir := t.TempDir()
	const size = 64 << 20
	disk := randomFile(t, dir, "disk.img", size, 7) // an "existing disk" full of data
	want, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	cachePath := sparseFile(t, dir, "cache.img", 64<<20)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--data-dir", dir)
	tc := func(args ...string) string {
		t.Helper()
		return run(t, time.Minute, bin, append(args, "--admin", admin)...)
	}

	// Scattered writes (sequential streams would bypass the cache), then
	// reads of the existing data, twice: the second pass hits.
	var cmds []string
	for i := 0; i < 32; i++ {
		off := int64(i) << 20
		cmds = append(cmds, "-c", "write -P 0xab "+itoa(off)+" 4k")
		copy(want[off:off+4096], bytes.Repeat([]byte{0xab}, 4096))
	}
	cmds = append(cmds, "-c", "flush")
	for pass := 0; pass < 2; pass++ {
		for i := 0; i < 32; i++ {
			cmds = append(cmds, "-c", "read "+itoa(int64(i)<<20+512<<10)+" 64k")
		}
	}
	run(t, time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("disk")}, cmds...)...)

	var st struct {
		Exports []struct {
			HitRatio float64 `json:"hit_ratio"`
			Volume   struct {
				WriteOps     uint64 `json:"write_ops"`
				ReadHitBytes uint64 `json:"read_hit_bytes"`
				PromoteBytes uint64 `json:"promote_bytes"`
			}
		}
	}
	if err := json.Unmarshal([]byte(tc("stats", "--json")), &st); err != nil {
		t.Fatal(err)
	}
	if v := st.Exports[0]; v.Volume.WriteOps != 32 || v.Volume.PromoteBytes == 0 || v.Volume.ReadHitBytes == 0 || v.HitRatio <= 0 {
		t.Errorf("stats after writes and two read passes: %+v", st)
	}
	if out := tc("usage"); !strings.Contains(out, "export disk (writeback)") || !strings.Contains(out, "pending writeback") {
		t.Errorf("usage:\n%s", out)
	}
	if out := tc("stats"); !strings.Contains(out, "hit_ratio") {
		t.Errorf("stats:\n%s", out)
	}
	if out := tc("set", "disk", "cache_mode=writethrough"); !strings.Contains(out, "writethrough  (changed)") {
		t.Errorf("set:\n%s", out)
	}
	// A write in writethrough mode reaches the disk at once.
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("disk"), "-c", "write -P 0xcd 40M 8k", "-c", "flush")
	copy(want[40<<20:40<<20+8192], bytes.Repeat([]byte{0xcd}, 8192))
	if out := tc("check"); !strings.Contains(out, "no problems found") {
		t.Errorf("check:\n%s", out)
	}
	if out := tc("detach", "disk"); !strings.Contains(out, "can be used alone") {
		t.Errorf("detach:\n%s", out)
	}
	s.stop()

	got, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("after detach the disk does not hold the original data with every write applied")
	}
	// Usable alone: served without --force, and read back through NBD.
	alone := startServer(t, "--export", "disk="+disk, "--data-dir", dir)
	out := filepath.Join(dir, "copy.img")
	run(t, time.Minute, "nbdcopy", alone.uri("disk"), out)
	if c, err := os.ReadFile(out); err != nil || !bytes.Equal(c, want) {
		t.Fatalf("nbdcopy of the detached disk differs (err %v)", err)
	}
	// Offline check of the stopped set: clean, the disk no longer in it.
	if out := run(t, time.Minute, bin, "check", "--cache", cachePath); !strings.Contains(out, "no problems found") {
		t.Errorf("offline check:\n%s", out)
	}
	if out := run(t, time.Minute, bin, "inspect", "superblock", "--cache", cachePath); !strings.Contains(out, "backing devices        none") {
		t.Errorf("inspect superblock:\n%s", out)
	}
}

// TestOperationsErrors: wrong input and a missing server give clear errors
// and exit status 1 from the real binary.
func TestOperationsErrors(t *testing.T) {
	dir := t.TempDir()
	img := sparseFile(t, dir, "d.img", 8<<20)
	admin := filepath.Join(dir, "admin.sock")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"usage", "--admin", admin}, "no tiercache server is running at " + admin},
		{[]string{"stats", "--admin", admin}, "no tiercache server is running"},
		{[]string{"set", "d", "cache_mode=fast", "--admin", admin}, `unknown cache mode "fast"`},
		{[]string{"inspect", "superblock", "--cache", img}, "not a tiercache cache device"},
		{[]string{"check", "--cache", img}, "not a tiercache cache device"},
	} {
		out, err := runErr(time.Minute, bin, c.args...)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("tiercache %s: err %v, output %q; want an error containing %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
	startServerRaw(t, filepath.Join(dir, "s.sock"), "serve", "--export", "d="+img, "--listen", "unix:"+filepath.Join(dir, "s.sock"), "--admin", admin)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"set", "nope", "cache_mode=none"}, `no export named "nope" (exports: d)`},
		{[]string{"set", "d", "cache_mode=none"}, "plain export"},
		{[]string{"flush", "nope"}, `no export named "nope"`},
		{[]string{"detach", "d"}, "plain export"},
		{[]string{"check"}, "serves no cache set"},
		{[]string{"attach", "x=" + img}, "serves no cache set"},
		{[]string{"detach", "nope"}, `no export named "nope" (exports: d)`},
	} {
		out, err := runErr(time.Minute, bin, append(c.args, "--admin", admin)...)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("tiercache %s: err %v, output %q; want an error containing %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
