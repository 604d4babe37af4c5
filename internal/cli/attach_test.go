package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/nbd"
)

// makeDisk writes an "existing disk": a file of random bytes.
func makeDisk(t *testing.T, path string, size int, seed uint64) []byte {
	t.Helper()
	b := make([]byte, size)
	rng := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return b
}

func dialExport(t *testing.T, sock, name string) *nbd.Client {
	t.Helper()
	// The admin API answers before the NBD listener is up: retry a while.
	var c *nbd.Client
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err = nbd.Dial(context.Background(), "unix", sock, name, nbd.ClientOptions{})
		if err == nil || time.Now().After(deadline) || errors.Is(err, nbd.ErrUnknownExport) {
			break
		}
	}
	if err != nil {
		t.Fatalf("dial %s: %v", name, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func readAll(t *testing.T, c *nbd.Client) []byte {
	t.Helper()
	b := make([]byte, c.Size())
	for off := int64(0); off < c.Size(); off += 1 << 20 {
		if err := c.ReadAt(b[off:min(off+1<<20, c.Size())], off); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// scribble writes 4 KiB blocks of random data every 3rd block through c,
// flushes, and applies the same writes to want.
func scribble(t *testing.T, c *nbd.Client, want []byte, seed uint64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 1))
	p := make([]byte, 4096)
	for off := int64(0); off+4096 <= int64(len(want)); off += 3 * 4096 {
		for i := range p {
			p[i] = byte(rng.Uint32())
		}
		if err := c.WriteAt(p, off, false); err != nil {
			t.Fatal(err)
		}
		copy(want[off:], p)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}

func fileEquals(t *testing.T, path string, want []byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s differs from what was written through the cache (first at byte %d; %d vs %d bytes)", path, i, len(got), len(want))
	}
}

// TestAttachDetachCommands runs attach and detach against a running
// server, online and offline, with the refusals, while a client of another
// export keeps working.
func TestAttachDetachCommands(t *testing.T) {
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }
	for _, f := range []string{"cache.img", "a.img", "other-cache.img", "claimed.img"} {
		if err := os.WriteFile(p(f), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p(f), map[bool]int64{true: 64 << 20, false: 16 << 20}[f == "cache.img" || f == "other-cache.img"]); err != nil {
			t.Fatal(err)
		}
	}
	disk := makeDisk(t, p("disk.img"), 8<<20, 1)
	mustTC(t, "backing a", "format", "--cache", p("cache.img"), "--backing", "a="+p("a.img"))
	mustTC(t, "backing o", "format", "--cache", p("other-cache.img"), "--backing", "o="+p("claimed.img"))
	sock, adm := p("nbd.sock"), p("admin.sock")
	srv := startServe(t, adm, "--cache", p("cache.img"), "--listen", "unix:"+sock, "--admin", adm, "--data-dir", dir)
	t.Setenv("TIERCACHE_ADMIN", adm)

	ca := dialExport(t, sock, "a") // a client of another export: undisturbed throughout
	aWant := make([]byte, ca.Size())
	scribble(t, ca, aWant, 10)

	mustTC(t, `attached `+p("disk.img")+` (8 MiB, data) in mode writeback; export "data" is served now`, "attach", "data="+p("disk.img"))
	cd := dialExport(t, sock, "data")
	if !bytes.Equal(readAll(t, cd), disk) {
		t.Fatal("the attached disk is not served as it is")
	}
	if id, _ := backingid.Read(p("disk.img")); id.Set == "" || id.ID == "" {
		t.Fatalf("attached disk not claimed: %+v", id)
	}
	scribble(t, cd, disk, 11)
	mustTC(t, "export data (writeback)", "usage")
	mustTC(t, "writethrough  (changed)", "set", "data", "cache_mode=writethrough")

	// Wrong input: clear errors, exit 1.
	failTC(t, `an export named "data" exists already (exports: a, data)`, "attach", "data="+p("claimed.img"))
	failTC(t, `is the backing device of volume "a"`, "attach", "x="+p("a.img"))
	failTC(t, "is the backing device of volume \"data\"", "attach", "x="+p("disk.img"))
	failTC(t, "is the cache device", "attach", "x="+p("cache.img"))
	failTC(t, "no such file or directory", "attach", "x="+p("missing.img"))
	failTC(t, `--mode: cache: invalid argument: unknown cache mode "fast"`, "attach", "x="+p("claimed.img"), "--mode", "fast")
	failTC(t, "belongs to another cache set", "attach", "x="+p("claimed.img"))
	failTC(t, "want NAME=PATH", "attach", "x")
	failTC(t, "in use by another tiercache process", "attach", "--cache", p("cache.img"), "x="+p("claimed.img"))
	failTC(t, `no export named "zz" (exports: a, data)`, "detach", "zz")
	failTC(t, "detach needs the EXPORT to detach (exports: a, data)", "detach")
	failTC(t, `unknown setting "cache_mod"`, "set", "data", "cache_mod=none")

	// --force takes over a disk of another set; --json: one object each,
	// the server first.
	var att struct {
		Server serverID `json:"server"`
		Name   string   `json:"name"`
		Mode   string   `json:"mode"`
	}
	out := mustTC(t, `"name": "x"`, "attach", "x="+p("claimed.img"), "--force", "--mode", "writearound", "--json")
	if err := json.Unmarshal([]byte(out), &att); err != nil || att.Server.Admin != adm || att.Mode != "writearound" {
		t.Errorf("attach --json: %v %+v", err, att)
	}
	var det struct {
		Server   serverID `json:"server"`
		Export   string   `json:"export"`
		Finished bool     `json:"finished"`
		Message  string   `json:"message"`
	}
	out = mustTC(t, `"export": "x"`, "detach", "x", "--json")
	if err := json.Unmarshal([]byte(out), &det); err != nil || det.Server.Admin != adm || !det.Finished || !strings.Contains(det.Message, "x is detached") {
		t.Errorf("detach --json: %v %+v", err, det)
	}

	mustTC(t, "data is detached: "+p("disk.img")+" is complete and can be used alone", "detach", "data")
	fileEquals(t, p("disk.img"), disk)
	if id, _ := backingid.Read(p("disk.img")); id.Set != "" || id.ID == "" {
		t.Fatalf("detached disk still claimed (or lost its id): %+v", id)
	}
	if err := cd.ReadAt(make([]byte, 4096), 0); err == nil {
		t.Error("a connection to the detached export still serves")
	}
	failTC(t, `export "data" was detached (exports: a)`, "set", "data", "cache_mode=none")
	if !bytes.Equal(readAll(t, ca), aWant) {
		t.Fatal("export a changed under attach/detach")
	}
	scribble(t, ca, aWant, 12)

	// The same disk again, into the same set.
	mustTC(t, `export "data" is served now`, "attach", "data="+p("disk.img"))
	cd = dialExport(t, sock, "data")
	if !bytes.Equal(readAll(t, cd), disk) {
		t.Fatal("reattached disk is not served as it is")
	}
	scribble(t, cd, disk, 13)
	srv.stop(t)

	// Offline: the set keeps data across the restart; detach offline.
	failTC(t, `has no volume "zz" (volumes: a, data)`, "detach", "--cache", p("cache.img"), "zz")
	mustTC(t, "data is detached: "+p("disk.img")+" is complete", "detach", "--cache", p("cache.img"), "data")
	fileEquals(t, p("disk.img"), disk)
	if out := mustTC(t, "a: "+p("a.img"), "inspect", "superblock", "--cache", p("cache.img")); strings.Contains(out, "data") {
		t.Errorf("the superblock still lists data after the offline detach:\n%s", out)
	}
	mustTC(t, "to the cache set on "+p("cache.img"), "attach", "--cache", p("cache.img"), "data="+p("disk.img"), "--mode", "writethrough")
	failTC(t, `a volume of that name exists`, "attach", "--cache", p("cache.img"), "data="+p("claimed.img"), "--force")
	srv = startServe(t, adm, "--cache", p("cache.img"), "--listen", "unix:"+sock, "--admin", adm, "--data-dir", dir)
	mustTC(t, "export data (writethrough)", "usage")
	cd = dialExport(t, sock, "data")
	if !bytes.Equal(readAll(t, cd), disk) {
		t.Fatal("disk attached offline is not served as it is")
	}
	ca = dialExport(t, sock, "a")
	if !bytes.Equal(readAll(t, ca), aWant) {
		t.Fatal("export a lost data across the restarts")
	}
	srv.stop(t)
	mustTC(t, "no problems found", "check", "--cache", p("cache.img"))
}

// TestAttachStaleClaim: a crash between attach's claim of a file and the
// superblock write leaves the file claimed by a set that does not list it.
// Attaching it to that set again is accepted; another set refuses it
// without --force.
func TestAttachStaleClaim(t *testing.T) {
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }
	for _, f := range []string{"c1.img", "c2.img"} {
		if err := os.WriteFile(p(f), make([]byte, 32<<20), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	makeDisk(t, p("disk.img"), 1<<20, 3)
	mustTC(t, "none yet", "format", "--cache", p("c1.img"))
	mustTC(t, "none yet", "format", "--cache", p("c2.img"))
	cdev, err := openDevice(p("c1.img"), device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cache.ReadSuperblock(cdev)
	cdev.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := backingid.Claim(p("disk.img"), fmtUUID(sb.SetUUID), false); err != nil {
		t.Fatal(err)
	}
	failTC(t, "belongs to another cache set "+fmtUUID(sb.SetUUID), "attach", "--cache", p("c2.img"), "d="+p("disk.img"))
	mustTC(t, "attached", "attach", "--cache", p("c1.img"), "d="+p("disk.img"))
}
