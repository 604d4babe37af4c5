package interop

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/tiercache/tiercache/device/objstore"
	"github.com/tiercache/tiercache/nbd"
)

// TestMeasureObjStoreColdRead measures cold 1 MiB sequential reads of an
// object-store image through a fresh cache set (every read a miss: the
// server resolves it through the map and GETs a range of a segment, and
// promotes it) against a plain loop of 1 MiB ranged GETs of the same
// segment objects with minio-go, side by side in interleaved rounds
// against one local versitygw; medians, with /proc/loadavg. It asserts
// nothing and runs only with TIERCACHE_MEASURE=1 (make bench-objstore).
func TestMeasureObjStoreColdRead(t *testing.T) {
	if os.Getenv("TIERCACHE_MEASURE") != "1" {
		t.Skip("a measurement: TIERCACHE_MEASURE=1 (make bench-objstore)")
	}
	const data = 64 << 20
	const chunk = 1 << 20
	rounds := 5
	srv := startObjStore(t)
	const uri = "s3://images/cold"
	run(t, time.Minute, bin, "image", "create", uri, "--size", "128M")
	l, err := objstore.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	d, err := objstore.Open(l.WithEnv(), objstore.Options{GCThreshold: -1})
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, chunk)
	for off := int64(0); off < data; off += chunk {
		for i := range p {
			p[i] = byte(off>>20) ^ byte(i)
		}
		if _, err := d.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		if (off+chunk)%(8<<20) == 0 {
			if err := d.Sync(); err != nil {
				t.Fatal(err)
			}
		}
	}
	d.Close()
	c := srv.Client()
	ctx := context.Background()
	var segs []minio.ObjectInfo
	for o := range c.ListObjects(ctx, "images", minio.ListObjectsOptions{Prefix: "cold/seg/", Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		segs = append(segs, o)
	}

	getLoop := func() time.Duration {
		start := time.Now()
		n := int64(0)
		for _, o := range segs {
			for off := int64(0); off < o.Size; off += chunk {
				var g minio.GetObjectOptions
				g.SetRange(off, min(off+chunk, o.Size)-1)
				r, err := c.GetObject(ctx, "images", o.Key, g)
				if err != nil {
					t.Fatal(err)
				}
				m, err := io.Copy(io.Discard, r)
				r.Close()
				if err != nil {
					t.Fatal(err)
				}
				n += m
			}
		}
		if n < data {
			t.Fatalf("the GET loop read %d bytes, want at least %d", n, data)
		}
		return time.Since(start)
	}
	throughCache := func(round int) time.Duration {
		dir := shortDir(t)
		cachePath := sparseFile(t, dir, "cache.img", 128*mib)
		run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--bucket-size", "1M")
		s := startServer(t, "--cache", cachePath, "--data-dir", dir)
		cl, err := nbd.Dial(ctx, "unix", s.sock, "vol", nbd.ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, chunk)
		start := time.Now()
		for off := int64(0); off < data; off += chunk {
			if err := cl.ReadAt(buf, off); err != nil {
				t.Fatal(err)
			}
			if buf[0] != byte(off>>20) || buf[chunk-1] != byte(off>>20)^0xff {
				t.Fatalf("round %d: the block at %d reads back wrong", round, off)
			}
		}
		el := time.Since(start)
		cl.Close()
		s.stop()
		os.RemoveAll(filepath.Join(dir, "cache.img"))
		return el
	}
	load := func() string {
		b, _ := os.ReadFile("/proc/loadavg")
		return strings.TrimSpace(string(b))
	}
	t.Logf("loadavg before: %s; %d MiB in %d segments, %d rounds", load(), data>>20, len(segs), rounds)
	var ga, ca []float64
	mibs := func(d time.Duration) float64 { return float64(data) / (1 << 20) / d.Seconds() }
	for r := range rounds {
		var g, cc time.Duration
		if r%2 == 0 {
			g = getLoop()
			cc = throughCache(r)
		} else {
			cc = throughCache(r)
			g = getLoop()
		}
		ga, ca = append(ga, mibs(g)), append(ca, mibs(cc))
		t.Logf("round %d: ranged-GET loop %.1f MiB/s, cold reads through the cache %.1f MiB/s (%.2fx)", r, mibs(g), mibs(cc), mibs(cc)/mibs(g))
	}
	med := func(v []float64) float64 { s := slices.Clone(v); slices.Sort(s); return s[len(s)/2] }
	t.Logf("medians: ranged-GET loop %.1f MiB/s, through the cache %.1f MiB/s: %.2fx (target >= 0.8x); loadavg after: %s",
		med(ga), med(ca), med(ca)/med(ga), load())
	fmt.Fprintf(os.Stderr, "cold 1 MiB reads: %.2fx of the ranged-GET loop (median of %d)\n", med(ca)/med(ga), rounds)
}
