package interop

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/nbd"
)

// TestAttachDetachLive: the race-built binary attaches an existing disk to
// a running server, qemu-io writes to it in writeback mode with writeback
// held back (so dirty data is in the cache when detach starts), and after
// detach the bare backing file is byte-identical to what the export served
// (nbdcopy) and to the original with the writes applied. A client of
// another export stays connected and working throughout; wrong input gets
// clear errors and exit status 1.
func TestAttachDetachLive(t *testing.T) {
	need(t, "qemu-io", "nbdcopy")
	dir := t.TempDir()
	disk := randomFile(t, dir, "disk.img", 32<<20, 11)
	want, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	other := sparseFile(t, dir, "other.img", 16<<20)
	cachePath := sparseFile(t, dir, "cache.img", 64<<20)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "other="+other, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", admin, "--data-dir", dir)
	tc := func(args ...string) string {
		t.Helper()
		return run(t, time.Minute, bin, append(args, "--admin", admin)...)
	}
	tcFail := func(want string, args ...string) {
		t.Helper()
		out, err := runErr(time.Minute, bin, append(args, "--admin", admin)...)
		if err == nil || !strings.Contains(out, want) {
			t.Errorf("tiercache %s: err %v, output %q; want an error containing %q", strings.Join(args, " "), err, out, want)
		}
	}

	// A client of the other export, connected across attach and detach.
	ctx := context.Background()
	oc, err := nbd.Dial(ctx, "unix", sock, "other", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close()
	if err := oc.WriteAt(bytes.Repeat([]byte{0x11}, 8192), 4096, true); err != nil {
		t.Fatal(err)
	}

	if out := tc("attach", "disk="+disk); !strings.Contains(out, `export "disk" is served now`) {
		t.Fatalf("attach:\n%s", out)
	}
	tcFail(`an export named "disk" exists already`, "attach", "disk="+other)
	tcFail(`is the backing device of volume "other"`, "attach", "x="+other)
	tcFail("is the cache device", "attach", "x="+cachePath)
	tcFail("no such file or directory", "attach", "x="+filepath.Join(dir, "none.img"))
	tcFail(`no export named "nope"`, "detach", "nope")
	tc("set", "disk", "writeback_rate_max=4K") // one block a second: dirty data stays for detach

	var cmds []string
	for i := 0; i < 64; i++ {
		off := int64(i)*(512<<10) + 4096
		cmds = append(cmds, "-c", "write -P 0x5c "+itoa(off)+" 8k")
		copy(want[off:off+8192], bytes.Repeat([]byte{0x5c}, 8192))
	}
	cmds = append(cmds, "-c", "flush")
	run(t, time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("disk")}, cmds...)...)

	var st struct {
		Exports []struct {
			Name   string
			Volume struct {
				DirtyBlocks int64 `json:"dirty_blocks"`
			}
		}
	}
	if err := json.Unmarshal([]byte(tc("stats", "--json")), &st); err != nil {
		t.Fatal(err)
	}
	dirty := int64(-1)
	for _, e := range st.Exports {
		if e.Name == "disk" {
			dirty = e.Volume.DirtyBlocks
		}
	}
	if dirty <= 0 {
		t.Fatalf("no dirty data before detach (%d blocks): the test would prove nothing", dirty)
	}
	served := filepath.Join(dir, "served.img")
	run(t, time.Minute, "nbdcopy", s.uri("disk"), served)
	out := tc("detach", "disk")
	if !strings.Contains(out, "disk is detached: "+disk+" is complete") {
		t.Fatalf("detach:\n%s", out)
	}
	t.Logf("detach with %d dirty blocks:\n%s", dirty, out)
	got, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	sv, err := os.ReadFile(served)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sv, want) {
		t.Fatal("the export did not serve the disk with the writes applied")
	}
	if !bytes.Equal(got, want) {
		t.Fatal("after detach the bare backing file differs from what the export served")
	}
	if _, err := runErr(time.Minute, "nbdcopy", s.uri("disk"), filepath.Join(dir, "x.img")); err == nil {
		t.Error("the detached export is still served")
	}
	p := make([]byte, 8192)
	if err := oc.ReadAt(p, 4096); err != nil || !bytes.Equal(p, bytes.Repeat([]byte{0x11}, 8192)) {
		t.Fatalf("the other export's client after attach and detach: %v", err)
	}
	// Attached again, to the same set, it is served as it is.
	tc("attach", "disk="+disk, "--mode", "writethrough")
	again := filepath.Join(dir, "again.img")
	run(t, time.Minute, "nbdcopy", s.uri("disk"), again)
	if a, err := os.ReadFile(again); err != nil || !bytes.Equal(a, want) {
		t.Fatalf("the reattached disk is not served as it is (err %v)", err)
	}
	s.stop()
}
