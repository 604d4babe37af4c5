package interop

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tiercache/tiercache/nbd"
)

// TestRemoteOutageCacheFull: the remote (qemu-nbd) is killed under a cache
// set in writeback mode and stays away for longer than the cache can
// absorb. Writes are absorbed until the cache is full; then a write fails
// with EIO within --remote-timeout and a bound (it never hangs, and never
// reports success for data it did not keep), and so do the ones after it.
// Every write acknowledged before reads back, during the outage and after
// the remote returns; detach then writes them all to the remote, which
// holds every acknowledged write.
func TestRemoteOutageCacheFull(t *testing.T) {
	need(t, "qemu-nbd")
	dir := shortDir(t)
	const size = 64 * mib
	img := sparseFile(t, dir, "remote.img", size)
	rsock := filepath.Join(dir, "r.sock")
	remote := startRemote(t, rsock, "qemu-nbd", "-f", "raw", "-k", rsock, "-t", "-e", "8", "-D", "marker-full", img)
	cachePath := sparseFile(t, dir, "cache.img", 8*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vm="+remote.uri(""), "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	admin := filepath.Join(dir, "admin.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", admin, "--remote-timeout", "1s")
	c, err := nbd.Dial(context.Background(), "unix", sock, "vm", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	remote.kill()
	want := make([]byte, size) // what the client was told is written
	// Scattered 64 KiB writes (not a sequential stream, which would
	// bypass the cache), each flushed, far more than the 8 MiB cache.
	const chunk = 64 << 10
	acked, failed := 0, 0
	var slowestFail time.Duration
	p := make([]byte, chunk)
	for i := int64(0); i < size/chunk && failed < 3; i++ {
		off := (i * 37 % (size / chunk)) * chunk
		fillSeed(p, uint64(i)+1)
		start := time.Now()
		err := c.WriteAt(p, off, false)
		if err == nil {
			err = c.Flush()
		}
		took := time.Since(start)
		var ne *nbd.Error
		switch {
		case err == nil:
			copy(want[off:], p)
			acked++
		case errors.As(err, &ne) && ne.Errno == nbd.EIO:
			failed++
			slowestFail = max(slowestFail, took)
			// The range may hold the old or the new data now: not
			// checked below.
			copy(want[off:], make([]byte, chunk))
			fillSeed(want[off:off+chunk], 0)
		default:
			t.Fatalf("write %d at %d with the remote down and the cache full: %v; want EIO", i, off, err)
		}
		if took > 20*time.Second {
			t.Fatalf("write %d at %d took %v with the remote down (--remote-timeout 1s)", i, off, took)
		}
	}
	if failed == 0 {
		t.Fatalf("all %d writes of %d MiB were acknowledged by an 8 MiB cache with the remote down", acked, acked*chunk/mib)
	}
	if acked*chunk < 2*mib {
		t.Fatalf("only %d writes absorbed before the first failure; the cache should hold MiBs", acked)
	}
	t.Logf("%d writes of 64 KiB absorbed with the remote down, then EIO (the slowest failure in %v)", acked, slowestFail.Round(time.Millisecond))
	poisoned := func(off int64) bool {
		q := make([]byte, chunk)
		fillSeed(q, 0)
		return bytes.Equal(want[off:off+chunk], q)
	}
	check := func(when string, read func(q []byte, off int64) error) {
		t.Helper()
		q := make([]byte, chunk)
		for off := int64(0); off < size; off += chunk {
			if poisoned(off) || bytes.Equal(want[off:off+chunk], make([]byte, chunk)) {
				continue
			}
			if err := read(q, off); err != nil {
				t.Fatalf("%s: reading acknowledged data at %d: %v", when, off, err)
			}
			if !bytes.Equal(q, want[off:off+chunk]) {
				t.Fatalf("%s: acknowledged data at %d reads back different", when, off)
			}
		}
	}
	check("remote down", func(q []byte, off int64) error { return c.ReadAt(q, off) })

	remote.start()
	for deadline := time.Now().Add(30 * time.Second); ; {
		if err := c.WriteAt(p, 0, false); err == nil {
			copy(want, p)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("writes still fail 30 s after the remote came back\n%s", s.log)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	check("remote back", func(q []byte, off int64) error { return c.ReadAt(q, off) })
	c.Close()
	run(t, 2*time.Minute, bin, "detach", "vm", "--admin", admin)
	s.stop()
	remote.kill()
	have, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	check("on the remote after detach", func(q []byte, off int64) error { copy(q, have[off:]); return nil })
}
