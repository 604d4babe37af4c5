package interop

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Trust boundaries (issue 13 findings 2, 3, 8 and parts of 6 and 9): which
// disk is which, who may open a device, and what a damaged journal says.
// Each refusal is checked for what it says: what was expected, what was
// found, and how to proceed.

// dirtySet formats a writeback set with one volume "vol" over a file of
// random data, serves it with writeback held back, writes 1 MiB of 0x5a at
// offset 0 through qemu-io (flushed: dirty in the cache, not on the disk)
// and SIGKILLs the server.
func dirtySet(t *testing.T) (cs *cacheSet, admin string) {
	t.Helper()
	need(t, "qemu-io")
	dir := t.TempDir()
	cs = &cacheSet{dir: dir, cache: sparseFile(t, dir, "cache.img", 16*mib), backings: map[string]string{}}
	cs.backings["vol"] = randomFile(t, dir, "vol.img", 32*mib, 7)
	run(t, time.Minute, bin, "format", "--cache", cs.cache, "--backing", "vol="+cs.backings["vol"], "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	admin = filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cs.cache, "--listen", "unix:"+sock, "--admin", admin, "--data-dir", dir)
	run(t, time.Minute, bin, "set", "vol", "writeback_rate_max=4K", "--admin", admin)
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "write -P 0x5a 0 1m", "-c", "flush")
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil // killed on purpose
	return cs, admin
}

// refused runs the binary and requires a non-zero exit whose output
// contains every one of want.
func refused(t *testing.T, want []string, args ...string) string {
	t.Helper()
	out, err := runErr(20*time.Second, bin, args...)
	if err == nil {
		t.Errorf("tiercache %s: exit 0, want a refusal\n%s", strings.Join(args, " "), out)
		return out
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("tiercache %s: %v; output lacks %q:\n%s", strings.Join(args, " "), err, w, out)
		}
	}
	return out
}

func copyPlain(t *testing.T, from, to string) {
	t.Helper()
	// cp without --preserve: data only, no extended attributes.
	run(t, time.Minute, "cp", "--sparse=always", from, to)
}

// TestTrustBackingIdentity: a backing device whose identity does not match
// the one recorded, or that has none, is refused unless --force, and the
// refusal says what was expected, what was found and how to proceed. On
// main a plain copy of the backing file (cp, no xattrs) and an unrelated
// file were served as the set's disk (the check was skipped when either
// side had no identity), and an offline detach of a copy of the cache file
// wrote the copy's dirty data into the original set's disk.
func TestTrustBackingIdentity(t *testing.T) {
	cs, _ := dirtySet(t)
	vol := cs.backings["vol"]
	before, err := os.ReadFile(vol)
	if err != nil {
		t.Fatal(err)
	}
	cp := filepath.Join(cs.dir, "copy.img")
	copyPlain(t, vol, cp)
	other := sparseFile(t, cs.dir, "other.img", 32*mib)
	for _, p := range []string{cp, other} {
		refused(t, []string{"identity mismatch", "expected ", "found none", "--backing vol=PATH", "--force"},
			"serve", "--cache", cs.cache, "--backing", "vol="+p, "--listen", "unix:"+filepath.Join(cs.dir, "x.sock"))
	}

	// A copy of the cache device: the same set, but not the device it was
	// formatted on. Detaching through it would write its dirty data into
	// vol.img (which the original set caches).
	cacheCopy := filepath.Join(cs.dir, "cache-copy.img")
	copyPlain(t, cs.cache, cacheCopy)
	refused(t, []string{"cache device", "identity mismatch", "not the device cache set", "--force"},
		"detach", "--cache", cacheCopy, "vol")
	after, err := os.ReadFile(vol)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("an offline detach through a copy of the cache device wrote into the original set's disk")
	}

	// The original set still opens, with its dirty data.
	s := cs.serve(t, "--data-dir", cs.dir)
	out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "read -P 0x5a 0 1m")
	if strings.Contains(out, "failed") {
		t.Fatalf("the set lost its dirty data:\n%s", out)
	}
}

// TestTrustCopiesWithAttributes: copies that carry the disk's identity
// attribute are not the disk. On main a backing file's identity was its
// user.tiercache.id attribute alone, which cp -a and a tar --xattrs
// restore copy: a copy of the backing file made with cp -a, and a backup
// restored in the original's place, were served as the set's disk, and an
// offline detach through a cp -a copy of the cache file wrote the copy's
// dirty data into the original set's disk. A file is identified by the
// attribute, its inode number and its birth time now.
func TestTrustCopiesWithAttributes(t *testing.T) {
	need(t, "tar")
	cs, _ := dirtySet(t)
	vol := cs.backings["vol"]
	before, err := os.ReadFile(vol)
	if err != nil {
		t.Fatal(err)
	}
	copied := "a copy made with its extended attributes"
	x := "unix:" + filepath.Join(cs.dir, "x.sock")

	cpa := filepath.Join(cs.dir, "copy-a.img")
	run(t, time.Minute, "cp", "-a", vol, cpa)
	refused(t, []string{`backing "vol"`, "identity mismatch", "expected ", copied, "--backing vol=PATH", "--force"},
		"serve", "--cache", cs.cache, "--backing", "vol="+cpa, "--listen", x)

	// A backup restored in the disk's place: same path, same attributes,
	// another inode born later.
	run(t, time.Minute, "tar", "--xattrs", "--xattrs-include=user.*", "-C", cs.dir, "-cf", filepath.Join(cs.dir, "backup.tar"), filepath.Base(vol))
	orig := vol + ".orig"
	if err := os.Rename(vol, orig); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, "tar", "--xattrs", "--xattrs-include=user.*", "-C", cs.dir, "-xf", filepath.Join(cs.dir, "backup.tar"))
	refused(t, []string{`backing "vol"`, "identity mismatch", copied, "--force"},
		"serve", "--cache", cs.cache, "--listen", x)
	refused(t, []string{`backing device "vol"`, "identity mismatch", copied},
		"check", "--cache", cs.cache)
	if err := os.Rename(orig, vol); err != nil {
		t.Fatal(err)
	}

	// A cp -a copy of the cache file: detaching through it would write its
	// dirty data into vol.img, which the original set caches.
	cacheCopy := filepath.Join(cs.dir, "cache-copy.img")
	run(t, time.Minute, "cp", "-a", cs.cache, cacheCopy)
	refused(t, []string{"cache device", "identity mismatch", copied, "not the device cache set", "--force"},
		"detach", "--cache", cacheCopy, "vol")
	refused(t, []string{"cache device", "identity mismatch", copied},
		"serve", "--cache", cacheCopy, "--listen", x)
	after, err := os.ReadFile(vol)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("an offline detach through a cp -a copy of the cache device wrote into the original set's disk")
	}

	// The original set still opens, with its dirty data.
	s := cs.serve(t, "--data-dir", cs.dir)
	out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "read -P 0x5a 0 1m")
	if strings.Contains(out, "failed") {
		t.Fatalf("the set lost its dirty data:\n%s", out)
	}
}

// TestTrustLoopSwap: two loop devices attached in swapped order after a
// format. Loop devices have no serial: on main format printed "id none"
// and serve gave each disk the other's cached data. They are identified by
// their backing files now.
func TestTrustLoopSwap(t *testing.T) {
	needRoot(t)
	need(t, "losetup")
	dir := t.TempDir()
	fa := randomFile(t, dir, "a.img", 8*mib, 1)
	fb := randomFile(t, dir, "b.img", 8*mib, 2)
	attach := func(f string) string {
		dev := strings.TrimSpace(run(t, time.Minute, "losetup", "-f", "--show", f))
		t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
		return dev
	}
	la, lb := attach(fa), attach(fb)
	cache := sparseFile(t, dir, "cache.img", 16*mib)
	out := run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "a="+la, "--backing", "b="+lb, "--bucket-size", "256K")
	if strings.Contains(out, "id none") || !strings.Contains(out, "id loop:") {
		t.Fatalf("format did not identify the loop devices by their backing files:\n%s", out)
	}
	run(t, time.Minute, "losetup", "-d", la)
	run(t, time.Minute, "losetup", "-d", lb)
	run(t, time.Minute, "losetup", la, fb)
	run(t, time.Minute, "losetup", lb, fa)
	refused(t, []string{`backing "a"`, "identity mismatch", "expected loop:", "found loop:", "--force"},
		"serve", "--cache", cache, "--listen", "unix:"+filepath.Join(dir, "x.sock"))

	// A loop device over a cp -a copy of a's file (which carries its
	// identity attribute) is not a either.
	run(t, time.Minute, "losetup", "-d", la)
	run(t, time.Minute, "losetup", "-d", lb)
	ca := filepath.Join(dir, "a-copy.img")
	run(t, time.Minute, "cp", "-a", fa, ca)
	run(t, time.Minute, "losetup", la, ca)
	run(t, time.Minute, "losetup", lb, fb)
	refused(t, []string{`backing "a"`, "identity mismatch", "a copy made with its extended attributes", "--force"},
		"serve", "--cache", cache, "--listen", "unix:"+filepath.Join(dir, "x.sock"))
}

// TestTrustLocks: every command that opens a cache device, or a backing
// device of a set, takes the same lock, and --force does not override it.
// On main `format --force` reformatted the cache device under a running
// server, `serve --export x=CACHE_DEVICE` and `serve --export --force` of a
// served backing device were accepted, and check --cache and inspect ran on
// the live device without a word.
func TestTrustLocks(t *testing.T) {
	need(t, "qemu-io")
	cs := formatSet(t, 16*mib, 32*mib, []string{"vol"}, "--bucket-size", "256K")
	s := cs.serve(t, "--data-dir", cs.dir)
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "write -P 0x3c 0 256k", "-c", "flush")
	head := func() []byte {
		f, err := os.Open(cs.cache)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b := make([]byte, 128<<10)
		if _, err := io.ReadFull(f, b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	sb := head()
	x := "unix:" + filepath.Join(cs.dir, "x.sock")
	refused(t, []string{"cache device", "is in use by", "--force does not override"}, "format", "--force", "--cache", cs.cache, "--backing", "vol="+cs.backings["vol"])
	refused(t, []string{"is in use by"}, "serve", "--export", "x="+cs.cache, "--listen", x)
	refused(t, []string{"is in use by"}, "serve", "--force", "--export", "raw="+cs.backings["vol"], "--listen", x)
	refused(t, []string{"is in use by", "tiercache check"}, "check", "--cache", cs.cache)
	out, err := runErr(time.Minute, bin, "inspect", "superblock", "--cache", cs.cache)
	if err != nil || !strings.Contains(out, "MOVING TARGET") {
		t.Errorf("inspect of a served device: %v, want a warning that it reads a moving target:\n%s", err, out)
	}
	if !bytes.Equal(sb[:4096], head()[:4096]) || !bytes.Equal(sb[64<<10:68<<10], head()[64<<10:68<<10]) {
		t.Fatal("a refused command wrote the cache device's superblock")
	}
	// The server kept its set: the flushed write is there after a crash.
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil
	s2 := cs.serve(t, "--data-dir", cs.dir)
	if out := run(t, time.Minute, "qemu-io", "-f", "raw", s2.uri("vol"), "-c", "read -P 0x3c 0 256k"); strings.Contains(out, "failed") {
		t.Fatalf("flushed write lost:\n%s", out)
	}
	s2.stop()

	// A cache device that is not served is still not a plain disk.
	refused(t, []string{"is the cache device of cache set", "--cache " + cs.cache, "--force"}, "serve", "--export", "x="+cs.cache, "--listen", x)
}

// journalSpan returns the journal blocks that `inspect journal` replays
// (start, end: the block after the last).
func journalSpan(t *testing.T, cache string) (start, end int64) {
	t.Helper()
	out := run(t, time.Minute, bin, "inspect", "journal", "--cache", cache)
	m := regexp.MustCompile(`journal blocks (\d+)\.\.(\d+) \((\d+) blocks\)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("inspect journal:\n%s", out)
	}
	start, _ = strconv.ParseInt(m[1], 10, 64)
	end, _ = strconv.ParseInt(m[2], 10, 64)
	if n, _ := strconv.Atoi(m[3]); n == 0 {
		t.Fatalf("no journal block to damage:\n%s", out)
	}
	return start, end
}

const journalOff = 128 << 10 // after the two 64 KiB superblock copies

func overwrite(t *testing.T, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestTrustJournalTailDamage: random bytes over, or zeros on, the last
// journal block, or random bytes over the whole journal, after a FLUSH was
// answered. On main they read as the torn tail of an unfinished commit:
// serve started and returned the flushed 4 KiB with its old contents, and
// check --cache exited 0. Now check exits 1 naming the lost blocks, serve
// refuses and says how to proceed, and serve --force recovers the rest,
// saying so in its log.
func TestTrustJournalTailDamage(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	need(t, "qemu-io")
	for _, kind := range []string{"random-last", "zeros-last", "random-all"} {
		t.Run(kind, func(t *testing.T) {
			cs := formatSet(t, 16*mib, 32*mib, []string{"vol"}, "--bucket-size", "256K")
			s := cs.serve(t, "--data-dir", cs.dir)
			run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "write -P 0x77 8k 4k", "-c", "flush")
			s.cmd.Process.Signal(syscall.SIGKILL)
			<-s.done
			s.waited = nil
			start, end := journalSpan(t, cs.cache)
			from := end - 1
			if kind == "random-all" {
				from = start
			}
			b := make([]byte, (end-from)*4096)
			if kind != "zeros-last" {
				rng := rand.New(rand.NewPCG(uint64(end), 3))
				for i := range b {
					b[i] = byte(rng.Uint32())
				}
			}
			overwrite(t, cs.cache, journalOff+from*4096, b)
			out := refused(t, []string{"acknowledged journal blocks lost", "--force"}, "check", "--cache", cs.cache)
			t.Logf("check --cache:\n%s", out)
			refused(t, []string{"acknowledged journal blocks lost", "serve with --force"},
				"serve", "--cache", cs.cache, "--listen", "unix:"+filepath.Join(cs.dir, "x.sock"))
			s2 := cs.serve(t, "--force", "--data-dir", cs.dir)
			if !strings.Contains(s2.log.String(), "recovering without acknowledged metadata") {
				t.Errorf("serve --force did not log the loss:\n%s", s2.log)
			}
			// What is left is served: the lost write reads as before it.
			if out := run(t, time.Minute, "qemu-io", "-f", "raw", s2.uri("vol"), "-c", "read -P 0 8k 4k"); strings.Contains(out, "failed") {
				t.Errorf("after serve --force the lost block does not read as before the write:\n%s", out)
			}
		})
	}
}

// TestTrustCheckBackingSize: check --cache on a set whose backing device was
// grown exits 1 and says how to recover (on main it exited 0, and serve
// refused without saying how to recover).
func TestTrustCheckBackingSize(t *testing.T) {
	cs := formatSet(t, 16*mib, 32*mib, []string{"vol"}, "--bucket-size", "256K")
	if err := os.Truncate(cs.backings["vol"], 33*mib); err != nil {
		t.Fatal(err)
	}
	refused(t, []string{"truncated or grown", "truncate -s 33554432", "detach vol"}, "check", "--cache", cs.cache)
	refused(t, []string{"size mismatch", "restore the device to that size"}, "serve", "--cache", cs.cache, "--force", "--listen", "unix:"+filepath.Join(cs.dir, "x.sock"))
}

// TestTrustSuperblockCopyOffset: an error about superblock copy 1 names its
// offset (65536); on main a layout error in copy 1 said "superblock at
// offset 65536: ... superblock on cache at offset 0".
func TestTrustSuperblockCopyOffset(t *testing.T) {
	cs := formatSet(t, 16*mib, 32*mib, []string{"vol"}, "--bucket-size", "256K")
	f, err := os.OpenFile(cs.cache, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 4096)
	if _, err := f.ReadAt(b, 64<<10); err != nil {
		t.Fatal(err)
	}
	// A well-formed copy with an impossible bucket count: header (24
	// bytes), then seq, set UUID, block size, bucket size, bucket count.
	plen := int(binary.LittleEndian.Uint32(b[12:]))
	binary.LittleEndian.PutUint64(b[24+8+16+4+8:], 1<<40)
	binary.LittleEndian.PutUint32(b[16:], 0)
	binary.LittleEndian.PutUint32(b[16:], crc32.Checksum(b[:24+plen], crc32.MakeTable(crc32.Castagnoli)))
	if _, err := f.WriteAt(b, 64<<10); err != nil {
		t.Fatal(err)
	}
	out := run(t, time.Minute, bin, "inspect", "superblock", "--cache", cs.cache)
	line := ""
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "copy 1") {
			line = l
		}
	}
	if !strings.Contains(line, "INVALID") || !strings.Contains(line, "at offset 65536") || strings.Contains(line, "offset 0 ") {
		t.Fatalf("copy 1 line %q does not name offset 65536:\n%s", line, out)
	}
}

// TestTrustCheckpointFallbackWarns: with the newest checkpoint's header
// zeroed, recovery falls back to the older one; on main silently, now
// check --cache and serve warn.
func TestTrustCheckpointFallbackWarns(t *testing.T) {
	need(t, "qemu-io")
	cs := formatSet(t, 16*mib, 32*mib, []string{"vol"}, "--bucket-size", "256K")
	s := cs.serve(t, "--data-dir", cs.dir)
	run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "write -P 0x21 0 64k", "-c", "flush")
	s.stop()
	out := run(t, time.Minute, bin, "inspect", "superblock", "--cache", cs.cache)
	m := regexp.MustCompile(`at offsets (\d+), (\d+)`).FindStringSubmatch(out)
	gens := regexp.MustCompile(`slot (\d)\s+generation (\d+)`).FindAllStringSubmatch(out, -1)
	if m == nil || len(gens) != 2 {
		t.Fatalf("inspect superblock:\n%s", out)
	}
	newest := 0
	g0, _ := strconv.Atoi(gens[0][2])
	if g1, _ := strconv.Atoi(gens[1][2]); g1 > g0 {
		newest = 1
	}
	off, _ := strconv.ParseInt(m[1+newest], 10, 64)
	overwrite(t, cs.cache, off, make([]byte, 4096))
	out = run(t, time.Minute, bin, "check", "--cache", cs.cache)
	if !strings.Contains(out, "WARNING:") || !strings.Contains(out, "is zeroed") {
		t.Fatalf("check --cache did not warn of the checkpoint fallback:\n%s", out)
	}
	s2 := cs.serve(t, "--data-dir", cs.dir)
	if out := run(t, time.Minute, "qemu-io", "-f", "raw", s2.uri("vol"), "-c", "read -P 0x21 0 64k"); strings.Contains(out, "failed") {
		t.Fatalf("data lost after the fallback:\n%s", out)
	}
	s2.stop()
	if !strings.Contains(s2.log.String(), "recovering from an older checkpoint") {
		t.Fatalf("serve did not warn of the checkpoint fallback:\n%s", s2.log)
	}
}

// TestTrustUnidentifiedDevice: a device that nothing identifies (here a
// file on ramfs, which keeps no user xattrs, and a loop device over it) is
// refused by format unless --trust-path, which identifies it by its path
// and says loudly that a different disk at that path is not caught. On
// main format printed "id none" and went on, and serve then took any disk
// at any path for it; now serve refuses another path.
func TestTrustUnidentifiedDevice(t *testing.T) {
	needRoot(t)
	need(t, "losetup")
	dir := t.TempDir()
	rf := filepath.Join(dir, "ramfs")
	if err := os.Mkdir(rf, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, "mount", "-t", "ramfs", "ramfs", rf)
	t.Cleanup(func() { exec.Command("umount", "-l", rf).Run() })
	file := randomFile(t, rf, "vol.img", 8*mib, 3)
	other := randomFile(t, rf, "other.img", 8*mib, 4)
	loop := strings.TrimSpace(run(t, time.Minute, "losetup", "-f", "--show", randomFile(t, rf, "loop.img", 8*mib, 5)))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	for _, dev := range []string{file, loop} {
		cache := sparseFile(t, dir, "cache.img", 16*mib)
		refused(t, []string{`backing "vol"`, "nothing identifies this device", "--trust-path"},
			"format", "--cache", cache, "--backing", "vol="+dev, "--bucket-size", "256K")
		out := run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "vol="+dev, "--bucket-size", "256K", "--trust-path")
		if !strings.Contains(out, "WARNING") || !strings.Contains(out, "will NOT be caught") || !strings.Contains(out, "id path:"+dev) {
			t.Errorf("format --trust-path of %s did not say loudly that it identifies the device by its path:\n%s", dev, out)
		}
		if dev == file {
			refused(t, []string{`backing "vol"`, "identity mismatch", "expected path:" + dev, "found path:" + other},
				"serve", "--cache", cache, "--backing", "vol="+other, "--listen", "unix:"+filepath.Join(dir, "x.sock"))
		}
		if err := os.Remove(cache); err != nil {
			t.Fatal(err)
		}
	}
}
