package objstore

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/device/devicetest"
	"github.com/tiercache/tiercache/device/objstore/layout"
	"github.com/tiercache/tiercache/internal/s3test"
)

// betweenReads runs act (straight to the store) once, just before the
// first request through the proxy that follows the first request for the
// object name: a writer's update lands between two requests of a reader
// of that object, wherever the reader's requests are.
func betweenReads(p *s3test.Proxy, l Location, name string, act func()) {
	key := "/" + l.Bucket + "/" + l.key(name)
	seen, done := false, false
	p.SetFaults(func(r *http.Request) s3test.Fault {
		switch {
		case done:
		case seen:
			done = true
			act()
		case (r.Method == http.MethodGet || r.Method == http.MethodHead) && strings.HasSuffix(r.URL.Path, key):
			seen = true
		}
		return s3test.Pass
	})
}

// TestReadDuringUpdate: a reader of the head or the lease meets a writer
// updating it between its requests. A read-only Open (what format and
// check do) must open the image; a writer's Open must be refused with an
// OwnedError naming the holder.
//
// Both failed with "get .../head: objstore: precondition failed" (and
// .../lease) while an object was read as a HEAD then a GET, which
// minio-go sends with If-Match of the HEAD's ETag: a head or lease
// replaced between the two answered 412 (TestObjStoreServeRace, 2 runs of
// 20 of `go test -count=20 -run TestObjStoreServeRace ./internal/interop/`,
// a format reading the head while the other contender's serve fenced it).
func TestReadDuringUpdate(t *testing.T) {
	srv, direct := testEnv(t)
	proxy := s3test.NewProxy(t, srv)
	t.Run("format", func(t *testing.T) {
		l := newImage(t, direct, 1<<20, 4096)
		// A segment to recover: the reader's second request.
		want := make([]byte, 4096)
		devicetest.Fill(want, 1)
		first := mustOpen(t, l, Options{})
		if _, err := first.WriteAt(want, 0); err != nil {
			t.Fatal(err)
		}
		if err := first.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := first.Close(); err != nil {
			t.Fatal(err)
		}
		var w *Device
		var werr error
		betweenReads(proxy, l, layout.HeadName, func() { w, werr = Open(l, Options{}) })
		pl := l
		pl.Endpoint = proxy.Endpoint()
		ro, err := Open(pl, Options{ReadOnly: true})
		proxy.SetFaults(nil)
		if werr != nil {
			t.Fatalf("the writer's Open: %v", werr)
		}
		if w == nil {
			t.Fatal("the writer never opened: the reader made one request")
		}
		defer w.Close()
		if err != nil {
			t.Fatalf("a read-only Open while a writer opens: %v", err)
		}
		defer ro.Close()
		got := make([]byte, 4096)
		if _, err := ro.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("the reader reads %v (equal %v)", err, bytes.Equal(got, want))
		}
	})
	t.Run("serve", func(t *testing.T) {
		l := newImage(t, direct, 1<<20, 4096)
		w := mustOpen(t, l, Options{})
		var rerr error
		betweenReads(proxy, l, layout.LeaseName, func() { rerr = w.ls.renew(w.gen) })
		pl := l
		pl.Endpoint = proxy.Endpoint()
		d, err := Open(pl, Options{})
		proxy.SetFaults(nil)
		if rerr != nil {
			t.Fatalf("the holder's renewal: %v", rerr)
		}
		if err == nil {
			d.Close()
			t.Fatal("a second writer opened a held image")
		}
		var owned *OwnedError
		if !errors.As(err, &owned) || owned.Lease.Nonce != w.ls.l.Nonce {
			t.Fatalf("a second writer while the holder renews: %v; want an OwnedError naming the holder", err)
		}
	})
}
