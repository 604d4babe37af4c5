package objstore

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
	"github.com/tiercache/tiercache/device/objstore/layout"
	"github.com/tiercache/tiercache/internal/s3test"
)

var imageCounter atomic.Int64

// testEnv starts versitygw with one bucket and points the AWS variables at
// it for the test.
func testEnv(t *testing.T) (*s3test.Server, Location) {
	t.Helper()
	srv := s3test.Start(t)
	srv.Bucket("images")
	t.Setenv("AWS_ACCESS_KEY_ID", s3test.AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", s3test.SecretKey)
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	return srv, Location{Bucket: "images", Endpoint: srv.Endpoint(), Region: s3test.Region, PathStyle: true}
}

func newImage(t *testing.T, base Location, size int64, bs int) Location {
	t.Helper()
	l := base
	l.Prefix = fmt.Sprintf("img%d", imageCounter.Add(1))
	if _, err := Create(l, size, bs); err != nil {
		t.Fatalf("Create %s: %v", l, err)
	}
	return l
}

func mustOpen(t *testing.T, l Location, o Options) *Device {
	t.Helper()
	d, err := Open(l, o)
	if err != nil {
		t.Fatalf("Open %s: %v", l, err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// TestConformance runs the device contract against images on a real
// versitygw, with a small segment size so that large writes also take the
// multi-part path.
func TestConformance(t *testing.T) {
	_, base := testEnv(t)
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		l := newImage(t, base, size, 512)
		return mustOpen(t, l, Options{SegmentBytes: 1 << 20, CheckpointEvery: 3})
	})
}

// TestReopen checks that what a Sync stored is what a fresh opener reads,
// through checkpoints and segments, and that unsynced writes are not.
func TestReopen(t *testing.T) {
	_, base := testEnv(t)
	const size = 4 << 20
	l := newImage(t, base, size, 4096)
	want := make([]byte, size)
	d := mustOpen(t, l, Options{SegmentBytes: 64 << 10, CheckpointEvery: 4})
	for i := range 40 {
		p := make([]byte, 4096*(1+i%5))
		devicetest.Fill(p, uint64(i))
		off := int64((i * 7919 * 4096) % (size - len(p)))
		off -= off % 4096
		if i%9 == 8 {
			if err := d.WriteZeroes(off, int64(len(p))); err != nil {
				t.Fatal(err)
			}
			clear(want[off : off+int64(len(p))])
		} else {
			if _, err := d.WriteAt(p, off); err != nil {
				t.Fatal(err)
			}
			copy(want[off:], p)
		}
		if i%3 == 2 {
			if err := d.Sync(); err != nil {
				t.Fatalf("Sync %d: %v", i, err)
			}
		}
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	st := d.Stats()
	if st.Checkpoints == 0 || st.SegmentsPut == 0 {
		t.Fatalf("stats %+v: want segments and checkpoints", st)
	}
	// Written after the last Sync: must not survive.
	junk := make([]byte, 8192)
	devicetest.Fill(junk, 999)
	d.WriteAt(junk, 0)
	d.Close()

	for round := range 2 {
		d2 := mustOpen(t, l, Options{})
		got := make([]byte, size)
		if _, err := d2.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("round %d: reopened image differs from what was synced", round)
		}
		d2.Close()
	}
	in, err := Stat(l)
	if err != nil {
		t.Fatal(err)
	}
	if in.Lease != nil || in.Seq == 0 || in.Checkpoints != 1 {
		t.Fatalf("info %+v: want no lease, a newest segment, one checkpoint", in)
	}
}

// TestFreshReadsNoRequest: never-written blocks read as zeroes without a
// request to the store.
func TestFreshReadsNoRequest(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 1<<20, 4096)
	d := mustOpen(t, l, Options{})
	p := make([]byte, 1<<20)
	if _, err := d.ReadAt(p, 0); err != nil {
		t.Fatal(err)
	}
	if st := d.Stats(); st.Gets != 0 {
		t.Fatalf("%d GETs for never-written blocks", st.Gets)
	}
}

// TestLease: a second writer is refused naming the holder; a reader is
// not; after the holder closes, the second writer gets in; a forced
// takeover fences the old owner.
func TestLease(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 1<<20, 4096)
	a := mustOpen(t, l, Options{})
	_, err := Open(l, Options{})
	var owned *OwnedError
	if !errors.As(err, &owned) || !errors.Is(err, ErrOwned) {
		t.Fatalf("second Open: %v; want an OwnedError", err)
	}
	host, _ := os.Hostname()
	if owned.Lease.Host != host || owned.Lease.PID != os.Getpid() {
		t.Fatalf("refusal names %s pid %d, want %s pid %d", owned.Lease.Host, owned.Lease.PID, host, os.Getpid())
	}
	if err := Remove(l, false); !errors.Is(err, ErrOwned) {
		t.Fatalf("Remove while owned: %v", err)
	}
	ro := mustOpen(t, l, Options{ReadOnly: true})
	ro.Close()

	p := make([]byte, 4096)
	devicetest.Fill(p, 1)
	a.WriteAt(p, 0)
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	b := mustOpen(t, l, Options{Force: true})
	// a is fenced: its next Sync fails, and what it wrote never counts.
	devicetest.Fill(p, 2)
	a.WriteAt(p, 4096)
	if err := a.Sync(); !errors.Is(err, ErrFenced) {
		t.Fatalf("Sync of the fenced owner: %v; want ErrFenced", err)
	}
	if _, err := a.WriteAt(p, 0); !errors.Is(err, ErrFenced) {
		t.Fatalf("write of the fenced owner: %v; want ErrFenced", err)
	}
	a.Close()
	// a's last segment was stored before its Sync saw the fence: an
	// orphan, which b's garbage collection deletes.
	if _, err := b.GC(0.5, 1<<20); err != nil {
		t.Fatal(err)
	}
	objs, err := b.s.list("seg/")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if strings.HasSuffix(o.Name, fmt.Sprintf("-%08x", a.Generation())) && !strings.HasPrefix(o.Name, "seg/0000000000000001-") {
			t.Errorf("after GC the bucket still holds %s of the fenced owner", o.Name)
		}
	}
	got := make([]byte, 8192)
	b.ReadAt(got, 0)
	devicetest.Fill(p, 1)
	if !bytes.Equal(got[:4096], p) || !bytes.Equal(got[4096:], make([]byte, 4096)) {
		t.Fatal("new owner does not see exactly the old owner's synced state")
	}
	b.Close()
	if err := Remove(l, false); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if _, err := Stat(l); !errors.Is(err, ErrNoImage) {
		t.Fatalf("Stat after Remove: %v", err)
	}
}

// TestOutage: while the store answers 503 to everything, a Sync fails
// (not fenced: retryable), writes and reads of unstored data go on, and a
// read of stored data fails rather than returning zeroes; once the store
// is back, the next Sync stores everything and a fresh opener sees it.
func TestOutage(t *testing.T) {
	srv, direct := testEnv(t)
	proxy := s3test.NewProxy(t, srv)
	l := newImage(t, direct, 1<<20, 4096)
	l.Endpoint = proxy.Endpoint()
	d := mustOpen(t, l, Options{Tries: 1})
	a, b := make([]byte, 8192), make([]byte, 8192)
	devicetest.Fill(a, 1)
	devicetest.Fill(b, 2)
	d.WriteAt(a, 0)
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	proxy.CutAfter(0)
	if _, err := d.WriteAt(b, 65536); err != nil {
		t.Fatalf("write during the outage: %v", err)
	}
	if err := d.Sync(); err == nil || errors.Is(err, ErrFenced) {
		t.Fatalf("Sync during the outage: %v; want a retryable error", err)
	}
	got := make([]byte, 8192)
	if _, err := d.ReadAt(got, 65536); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("read of unstored data during the outage: %v", err)
	}
	if _, err := d.ReadAt(got, 0); err == nil {
		t.Fatal("read of stored data during the outage succeeded")
	}
	proxy.CutAfter(-1)
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync after the outage: %v", err)
	}
	d.Close()
	l.Endpoint = direct.Endpoint
	r := mustOpen(t, l, Options{ReadOnly: true})
	all := make([]byte, 65536+8192)
	r.ReadAt(all, 0)
	if !bytes.Equal(all[:8192], a) || !bytes.Equal(all[65536:], b) {
		t.Fatal("after the outage the image lacks what was written")
	}
}

// TestOpenRace: eight openers race for one image; exactly one gets it, the
// others are refused naming an owner.
func TestOpenRace(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 1<<20, 4096)
	const n = 8
	devs := make(chan *Device, n)
	errs := make(chan error, n)
	for range n {
		go func() {
			d, err := Open(l, Options{})
			if err != nil {
				errs <- err
				return
			}
			devs <- d
		}()
	}
	won := 0
	for range n {
		select {
		case d := <-devs:
			won++
			defer d.Close()
		case err := <-errs:
			if !errors.Is(err, ErrOwned) {
				t.Errorf("a losing opener: %v; want ErrOwned", err)
			}
		}
	}
	if won != 1 {
		t.Fatalf("%d openers got the image, want 1", won)
	}
}

// TestLeaseOfDeadProcess: a live lease naming a process of this host that
// has exited (a server killed and restarted) is taken without --force; one
// naming a live process is not.
func TestLeaseOfDeadProcess(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 1<<20, 4096)
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	s, err := newStore(l, 0)
	if err != nil {
		t.Fatal(err)
	}
	put := func(pid int) {
		p, _ := layout.EncodeLease(&layout.Lease{Host: host, PID: pid, Gen: 1, Renewed: time.Now().UTC(), TTL: time.Hour})
		if _, err := s.put(layout.LeaseName, p, putAny, ""); err != nil {
			t.Fatal(err)
		}
	}
	put(os.Getppid())
	if _, err := Open(l, Options{}); !errors.Is(err, ErrOwned) {
		t.Fatalf("Open over a live process's lease: %v; want ErrOwned", err)
	}
	put(cmd.Process.Pid)
	d := mustOpen(t, l, Options{})
	d.Close()
}

// TestReadahead reads an image sequentially (readahead fetching the next
// ranges of each segment), overwrites part of it, syncs, and reads it
// again: every read returns the newest data, and readahead saved GETs.
func TestReadahead(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 32<<20, 4096)
	d := mustOpen(t, l, Options{GCThreshold: -1})
	const chunk = 256 << 10
	want := make([]byte, 16<<20)
	for i := range want {
		want[i] = byte(i/4096) ^ byte(i)
	}
	if _, err := d.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	check := func(what string) int64 {
		t.Helper()
		g0 := d.Stats().Gets
		got := make([]byte, chunk)
		for off := 0; off < len(want); off += chunk {
			if _, err := d.ReadAt(got, int64(off)); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want[off:off+chunk]) {
				t.Fatalf("%s: the read at %d returns other data", what, off)
			}
		}
		return d.Stats().Gets - g0
	}
	if gets := check("first pass"); gets >= int64(len(want)/chunk) {
		t.Errorf("first pass: %d GETs for %d sequential reads: readahead saved none", gets, len(want)/chunk)
	}
	for off := 3 << 20; off < 5<<20; off++ {
		want[off] ^= 0x5a
	}
	if _, err := d.WriteAt(want[3<<20:5<<20], 3<<20); err != nil {
		t.Fatal(err)
	}
	check("before the Sync")
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	check("after the Sync")
}

// TestReadaheadAcrossSegments reads an image written as four segments of
// 4 MiB sequentially in 256 KiB reads: nearing the end of a segment,
// readahead fetches the start of the next, so each later segment costs
// one GET (3 for the first: its first two reads wait for their own). The
// reads return the data written.
//
// Regression test (issue 22): readahead stopped at each segment's end,
// and the first two reads of every segment waited for a GET each: 12
// GETs here, and cold 1 MiB reads through a cache were 0.77x of a
// ranged-GET loop (make bench-objstore, 2026-12-07).
func TestReadaheadAcrossSegments(t *testing.T) {
	_, base := testEnv(t)
	l := newImage(t, base, 32<<20, 4096)
	d := mustOpen(t, l, Options{GCThreshold: -1})
	const seg, chunk = 4 << 20, 256 << 10
	want := make([]byte, 4*seg)
	for i := range want {
		want[i] = byte(i/4096) ^ byte(i)
	}
	for off := 0; off < len(want); off += seg {
		if _, err := d.WriteAt(want[off:off+seg], int64(off)); err != nil {
			t.Fatal(err)
		}
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	if n := d.Stats().SegmentsPut; n != 4 {
		t.Fatalf("%d segments, want 4", n)
	}
	g0 := d.Stats().Gets
	got := make([]byte, chunk)
	for off := 0; off < len(want); off += chunk {
		if _, err := d.ReadAt(got, int64(off)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[off:off+chunk]) {
			t.Fatalf("the read at %d returns other data", off)
		}
	}
	if gets := d.Stats().Gets - g0; gets > 6 {
		t.Fatalf("%d GETs for 4 segments read sequentially, want at most 6 (3 + 1 a later segment)", gets)
	} else {
		t.Logf("%d GETs", gets)
	}
}

// TestCreateWithoutConditionalWrites: on a store that does not honour
// If-None-Match (s3test.Proxy answers its 412s 200), Create refuses with
// ErrNoConditionalWrites and leaves no image behind; the same store with
// its conditions honoured creates it.
func TestCreateWithoutConditionalWrites(t *testing.T) {
	srv, direct := testEnv(t)
	proxy := s3test.NewProxy(t, srv)
	proxy.SetFaults(func(*http.Request) s3test.Fault { return s3test.IgnoreConditions })
	l := direct
	l.Endpoint, l.Prefix = proxy.Endpoint(), "nocond"
	if _, err := Create(l, 1<<20, 4096); !errors.Is(err, ErrNoConditionalWrites) {
		t.Fatalf("Create on a store without conditional writes: %v, want ErrNoConditionalWrites", err)
	}
	if _, err := Open(l, Options{ReadOnly: true}); err == nil {
		t.Fatal("an image was left behind by the refused Create")
	}
	proxy.SetFaults(nil)
	if _, err := Create(l, 1<<20, 4096); err != nil {
		t.Fatalf("Create with the store's conditions honoured: %v", err)
	}
}
