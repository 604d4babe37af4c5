package interop

import (
	"bytes"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device/objstore"
	"github.com/tiercache/tiercache/internal/s3test"
)

// TestObjStoreZeroesTrimDuringOutage sends write-zeroes and trims (qemu-io
// `write -z`, `discard`, some with FUA) and flushes to a served writeback
// export of an object-store image while every request to the store fails
// (s3test.Proxy cut): each succeeds and reads back (what the cache holds:
// a read of data only in the store fails while it is away); once the store is back,
// detach writes everything back, and the image alone holds the zeroes, the
// data written before and around them, and in each trimmed range zeroes or
// the old data.
//
// Regression test (issue 22): write-zeroes and trims went to the image,
// which held them in memory until a sync, so the flush (or FUA) after one
// failed with EIO while the store was away: with that routing restored,
// the 256 KiB write after the first discard failed ("nbd: backend error
// cmd=WRITE ... errno=5": its commit synced the image) and qemu-io did not
// finish within 2 minutes.
func TestObjStoreZeroesTrimDuringOutage(t *testing.T) {
	need(t, "qemu-io")
	srv := startObjStore(t)
	proxy := s3test.NewProxy(t, srv)
	t.Setenv("AWS_ENDPOINT_URL", proxy.Endpoint())
	const uri = "s3://images/zeroes"
	const size, old = 32 << 20, 16 << 20
	run(t, time.Minute, bin, "image", "create", uri, "--size", "32M")
	l, err := objstore.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	// The old data, straight into the image: 0x11 over [0, 16 MiB).
	d, err := objstore.Open(l.WithEnv(), objstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(bytes.Repeat([]byte{0x11}, old), 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	d.Close()
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 32*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	s := startServer(t, "--cache", cachePath, "--data-dir", dir)
	admin := filepath.Join(dir, "admin.sock")
	proxy.CutAfter(0)
	const k = 1 << 10
	type span struct{ off, n int64 }
	// The second is not block-aligned: its edge blocks are read, and
	// they are in the cache (the store is away).
	zeroes := []span{{1 << 20, 4 << 20}, {64*k + 512, 20000}, {12<<20 + 4*k, 8 * k}}
	trims := []span{{8 << 20, 64 * k}, {9 << 20, 3 << 20}}
	out := run(t, 2*time.Minute, "qemu-io", "-f", "raw", s.uri("vol"),
		"-c", "discard 20m 64k", // nothing dirty yet
		"-c", "write -P 0x22 0 256k",
		"-c", "flush",
		"-c", fmt.Sprintf("write -z -f %d %d", zeroes[0].off, zeroes[0].n),
		"-c", fmt.Sprintf("write -z %d %d", zeroes[1].off, zeroes[1].n),
		"-c", fmt.Sprintf("discard %d %d", trims[0].off, trims[0].n),
		"-c", "flush",
		"-c", fmt.Sprintf("discard %d %d", trims[1].off, trims[1].n),
		"-c", fmt.Sprintf("write -z -f %d %d", zeroes[2].off, zeroes[2].n),
		"-c", "write -f -P 0x33 11m 8k", // inside the large trim
		"-c", "flush",
		"-c", "read -P 0x22 0 64k",
		"-c", fmt.Sprintf("read -P 0x22 %d %d", zeroes[1].off+zeroes[1].n, 256*k-zeroes[1].off-zeroes[1].n),
		"-c", fmt.Sprintf("read -P 0 %d %d", zeroes[0].off, zeroes[0].n),
		"-c", fmt.Sprintf("read -P 0 %d %d", zeroes[1].off, zeroes[1].n),
		"-c", fmt.Sprintf("read -P 0 %d %d", zeroes[2].off, zeroes[2].n),
		"-c", "read -P 0x33 11m 8k",
	)
	if strings.Contains(out, "failed") || strings.Contains(out, "error") {
		t.Fatalf("qemu-io during the outage:\n%s\nserver log:\n%s", out, s.log)
	}
	t.Logf("during the outage: %v", proxy.Counts())
	stats := run(t, time.Minute, bin, "stats", "--admin", admin)
	for _, re := range []string{`(?m)^\s*bypass_write_bytes\s+0 B$`, `(?m)^\s*writeback_degrades\s+0$`} {
		if !regexp.MustCompile(re).MatchString(stats) {
			t.Fatalf("stats after the outage's zeroes and trims, no match for %s:\n%s", re, stats)
		}
	}
	proxy.CutAfter(-1)
	out = run(t, 5*time.Minute, bin, "detach", "--admin", admin, "vol")
	if !strings.Contains(out, "is detached") {
		t.Fatalf("detach after the outage:\n%s", out)
	}
	s.stop()
	want := make([]byte, size)
	copy(want, bytes.Repeat([]byte{0x11}, old))
	copy(want, bytes.Repeat([]byte{0x22}, 256*k))
	for _, z := range zeroes {
		clear(want[z.off : z.off+z.n])
	}
	copy(want[11<<20:], bytes.Repeat([]byte{0x33}, 8*k))
	trimmed := func(off int64) bool {
		if off >= 11<<20 && off < 11<<20+8*k {
			return false
		}
		for _, r := range append(trims, span{20 << 20, 64 * k}) {
			if off >= r.off && off < r.off+r.n {
				return true
			}
		}
		return false
	}
	d, err = objstore.Open(l.WithEnv(), objstore.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got := make([]byte, size)
	if _, err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	const bs = 4096
	zeroBlock := make([]byte, bs)
	for off := int64(0); off < size; off += bs {
		g, w := got[off:off+bs], want[off:off+bs]
		if !bytes.Equal(g, w) && !(trimmed(off) && bytes.Equal(g, zeroBlock)) {
			t.Fatalf("the image after the outage: block at %d reads %#x..., want %#x...", off, g[0], w[0])
		}
	}
}
