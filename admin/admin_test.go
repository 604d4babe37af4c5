package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/plain"
	"github.com/tiercache/tiercache/nbd"
)

// TestMetricsTableComplete fails when a numeric field of the engine's stats
// has no line in volumeMetrics/setMetrics (metrics.go): add one there.
func TestMetricsTableComplete(t *testing.T) {
	for _, tc := range []struct {
		typ   reflect.Type
		table map[string]metricDef
		where string
	}{
		{reflect.TypeFor[cache.VolumeStats](), volumeMetrics, "volumeMetrics"},
		{reflect.TypeFor[cache.SetStats](), setMetrics, "setMetrics"},
		{reflect.TypeFor[ObjectStore](), objectStoreMetrics, "objectStoreMetrics"},
	} {
		names := map[string]bool{}
		for i := 0; i < tc.typ.NumField(); i++ {
			f := tc.typ.Field(i)
			names[f.Name] = true
			if _, ok := numeric(reflect.Zero(f.Type)); !ok {
				continue
			}
			d, ok := tc.table[f.Name]
			if !ok {
				t.Errorf("%s.%s has no metric: add a line to %s in admin/metrics.go", tc.typ.Name(), f.Name, tc.where)
				continue
			}
			if d.name == "" && d.skip == "" {
				t.Errorf("%s: %s has neither a metric name nor a reason to skip it", tc.where, f.Name)
			}
			if d.name != "" && !strings.HasPrefix(d.name, "tiercache_") {
				t.Errorf("%s: %s: metric %q lacks the tiercache_ prefix", tc.where, f.Name, d.name)
			}
			if d.kind == counter && d.name != "" && !strings.HasSuffix(d.name, "_total") {
				t.Errorf("%s: counter %q should end in _total", tc.where, d.name)
			}
		}
		for k := range tc.table {
			if !names[k] {
				t.Errorf("%s: %s is not a field of %s any more", tc.where, k, tc.typ.Name())
			}
		}
	}
}

type fakeNBD struct{ removed, added []string }

func (f *fakeNBD) CloseExport(_ context.Context, name string) (int, error) {
	f.removed = append(f.removed, name)
	return 0, nil
}
func (f *fakeNBD) AddExport(e nbd.Export) error { f.added = append(f.added, e.Name); return nil }

// newTestServer serves a set with volumes "a" and "b" on memory devices
// plus a plain export "p", over a unix socket.
// serveHTTP serves srv's API on a unix socket in a temporary directory
// and returns a client of it and the function that stops serving.
func serveHTTP(t *testing.T, srv *Server) (*Client, func()) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: srv.Handler(), ConnContext: ConnContext}
	go hs.Serve(l)
	return NewClient(sock), func() { hs.Close() }
}

func newTestServer(t *testing.T) (*Client, *cache.Set, *fakeNBD, *[]string) {
	t.Helper()
	cdev := device.NewMem(64 << 20)
	a, b, p := device.NewMem(16<<20), device.NewMem(8<<20), device.NewMem(1<<20)
	specs := []cache.BackingSpec{{Name: "a", Dev: a}, {Name: "b", Dev: b}}
	if _, err := cache.Format(cdev, specs, cache.FormatOptions{BucketSize: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	set, err := cache.Open(cdev, specs, cache.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := NewMetrics()
	var exports []Export
	for _, v := range set.Volumes() {
		exports = append(exports, Export{Export: nbd.Export{Name: v.Name(), Backend: m.Wrap(v.Name(), v)}, Path: "/dev/mem-" + v.Name()})
	}
	exports = append(exports, Export{Export: nbd.Export{Name: "p", Backend: m.Wrap("p", plain.New(p))}, Path: "/dev/mem-p"})
	fn := &fakeNBD{}
	var released []string
	srv := New(Config{Version: "test", Set: set, CachePath: "/dev/mem-cache", Exports: exports, NBD: fn, Metrics: m,
		Release: func(path string) error { released = append(released, path); return nil },
		Attach: func(req AttachRequest) (*cache.Volume, string, error) {
			mode, err := cache.ParseMode(req.Mode)
			if err != nil {
				return nil, "", err
			}
			v, err := set.Attach(cache.BackingSpec{Name: req.Name, Dev: device.NewMem(4 << 20), Path: req.Path}, cache.AttachOptions{Mode: mode})
			return v, req.Path, err
		}})
	c, stopHTTP := serveHTTP(t, srv)
	t.Cleanup(func() {
		stopHTTP()
		srv.Close()
		if err := set.Check(); err != nil {
			t.Error(err)
		}
		set.Close()
	})
	// Some I/O through the instrumented backends.
	for i := 0; i < 8; i++ {
		if err := exports[0].Backend.WriteAt(bytes.Repeat([]byte{byte(i)}, 8192), int64(i)*65536, false); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 8192)
	if err := exports[0].Backend.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if err := exports[2].Backend.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	registries.Store(c, m.reg)
	backends.Store(c, exports)
	return c, set, fn, &released
}

// latencyCount is the count of the summary of op and tier in ls.
func latencyCount(ls []LatencySummary, op, tier string) uint64 {
	for _, l := range ls {
		if l.Op == op && l.Tier == tier {
			return l.Count
		}
	}
	return 0
}

// backends maps a test client to its server's exports.
var backends sync.Map

func srvExport(c *Client, name string) nbd.Backend {
	es, _ := backends.Load(c)
	for _, e := range es.([]Export) {
		if e.Name == name {
			return e.Backend
		}
	}
	return nil
}

func TestAPI(t *testing.T) {
	c, _, fn, released := newTestServer(t)
	ctx := context.Background()
	st, err := c.Status(ctx)
	if err != nil || st.Version != "test" || st.Set == nil || len(st.Exports) != 3 || st.Exports[2].Mode != "plain" {
		t.Fatalf("status %+v err %v", st, err)
	}
	u, err := c.Usage(ctx)
	if err != nil || u.Cache == nil || u.Exports[0].Dirty != 8*8192 || u.Exports[0].PendingWriteback != u.Exports[0].Dirty {
		t.Fatalf("usage %+v err %v", u, err)
	}
	s, raw, err := c.Stats(ctx)
	if err != nil || s.Exports[0].Volume == nil || s.Exports[0].Volume.WriteOps != 8 || s.Exports[0].HitRatio != 1 ||
		s.Exports[1].HitRatio != 0 || s.Exports[2].Volume != nil || len(s.Exports[0].Latency) == 0 {
		t.Fatalf("stats %+v err %v", s, err)
	}
	// Writes split by tier, as reads are: the 8 writeback writes went to
	// the cache alone.
	if n := latencyCount(s.Exports[0].Latency, "write", "cache"); n != 8 {
		t.Errorf("write latency, tier cache: %d writes, want 8 (%+v)", n, s.Exports[0].Latency)
	}
	if n := latencyCount(s.Exports[0].Latency, "write", "backing"); n != 0 {
		t.Errorf("write latency, tier backing: %d writes, want 0", n)
	}
	// One duration per request, in the total and in its tier.
	for _, op := range []string{"read", "write"} {
		var total, tiers uint64
		for _, l := range s.Exports[0].Latency {
			if l.Op != op {
				continue
			}
			if l.Tier == "" {
				total = l.SumNanos
			} else {
				tiers += l.SumNanos
			}
		}
		if total == 0 || tiers != total {
			t.Errorf("%s latency: %d ns in all, %d ns in the tiers; want the same", op, total, tiers)
		}
	}
	// Epoch order (the default): the backing device alone is consistent.
	if e := st.Exports[0]; e.WritebackOrder != "epoch" || !e.BackingConsistent || e.InconsistentSince != nil {
		t.Errorf("status of a: %+v, want epoch order, backing consistent", e.Consistency)
	}
	if e := u.Exports[0]; e.WritebackOrder != "epoch" || !e.BackingConsistent {
		t.Errorf("usage of a: %+v, want epoch order, backing consistent", e.Consistency)
	}
	if _, err := c.SetSettings(ctx, "b", map[string]string{"writeback_order": "lba"}); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Status(ctx); err != nil || st.Exports[1].WritebackOrder != "lba" || st.Exports[1].BackingConsistent || st.Exports[2].WritebackOrder != "" {
		t.Errorf("status after b's switch to lba order: %+v err %v; want b lba, not consistent, p without an order", st.Exports, err)
	}
	// The API is snake_case throughout: engine counters under derived
	// names, the mode by name.
	for _, want := range []string{`"write_ops": 8`, `"mode": "writeback"`, `"bypass_write_bytes": 0`, `"writeback_target_rate": `, `"p99_us": `} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("stats JSON lacks %s: %s", want, raw)
		}
	}
	for _, path := range []string{"/v1/status", "/v1/usage", "/v1/stats"} {
		var m json.RawMessage
		if err := c.getJSON(ctx, "GET", path, nil, &m); err != nil {
			t.Fatal(err)
		}
		if k := regexp.MustCompile(`"[^"]*[A-Z][^"]*":`).FindString(string(m)); k != "" {
			t.Errorf("%s: key %s is not snake_case:\n%s", path, k, m)
		}
	}

	// Flush with progress. Background writeback runs at full speed once
	// the client has been idle for 200 ms, which the checks above may
	// take on a loaded machine: the flush writes back what is still dirty
	// when it starts (its Total), all of it, and the background and the
	// flush together wrote back all 8 x 8 KiB (the writeback bytes metric
	// below).
	fp, err := c.Flush(ctx, "a", nil)
	if err != nil || !fp.Finished || fp.DirtyBytes != 0 || fp.Done != fp.Total || fp.Done > 8*8192 || fp.Done%4096 != 0 {
		t.Fatalf("flush: %+v err %v; want finished, nothing dirty, Done = Total <= %d in whole blocks", fp, err, 8*8192)
	}
	if _, err := c.Flush(ctx, "p", nil); err != nil {
		t.Fatalf("flush of a plain export: %v", err)
	}
	if _, err := c.Flush(ctx, "nope", nil); err == nil || !strings.Contains(err.Error(), `no export named "nope"`) {
		t.Errorf("flush of unknown export: %v", err)
	}

	// Settings.
	m, err := c.Settings(ctx, "a")
	if err != nil || m["cache_mode"] != "writeback" || len(m) != len(cache.SettingKeys) {
		t.Fatalf("settings %v err %v", m, err)
	}
	if m, err = c.SetSettings(ctx, "a", map[string]string{"cache_mode": "writethrough"}); err != nil || m["cache_mode"] != "writethrough" {
		t.Fatalf("set cache_mode: %v %v", m, err)
	}
	// A writethrough write waits for the backing device: tier backing.
	if err := srvExport(c, "a").WriteAt(make([]byte, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	if s, _, err := c.Stats(ctx); err != nil || latencyCount(s.Exports[0].Latency, "write", "backing") != 1 || latencyCount(s.Exports[0].Latency, "write", "cache") != 8 {
		t.Errorf("after a writethrough write: latency %+v err %v; want 8 cache and 1 backing write", s.Exports[0].Latency, err)
	}
	for _, tc := range []struct {
		export string
		kv     map[string]string
		status int
		key    string
		msg    string
	}{
		{"a", map[string]string{"cache_mod": "none"}, 400, "cache_mod", "unknown setting"},
		{"a", map[string]string{"cache_mode": "fast"}, 400, "cache_mode", "unknown cache mode"},
		{"a", map[string]string{"writeback_percent": "150"}, 400, "writeback_percent", "0..100"},
		{"a", map[string]string{}, 400, "", "no settings"},
		{"zz", map[string]string{"cache_mode": "none"}, 404, "", `no export named "zz"`},
		{"p", map[string]string{"cache_mode": "none"}, 409, "", "plain export"},
	} {
		_, err := c.SetSettings(ctx, tc.export, tc.kv)
		var ae *APIError
		if !errors.As(err, &ae) || ae.Status != tc.status || ae.Key != tc.key || !strings.Contains(ae.Msg, tc.msg) {
			t.Errorf("set %s %v: got %v (%+v), want %d key %q containing %q", tc.export, tc.kv, err, ae, tc.status, tc.key, tc.msg)
		}
	}

	// Metrics: the registry gathers without error (no duplicate or
	// inconsistent metric), and the text has what we expect.
	if _, err := srvMetrics(c).Gather(); err != nil {
		t.Errorf("gathering metrics: %v", err)
	}
	text, err := c.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`tiercache_write_requests_total{export="a"} 9`,
		`tiercache_writeback_bytes_total{export="a"} 65536`,
		`tiercache_dirty_bytes{export="a"} 0`,
		`tiercache_request_duration_seconds_count{export="a",op="write"} 9`,
		`tiercache_request_duration_seconds_bucket{export="p",op="read",le="+Inf"} 1`,
		`tiercache_read_hit_ratio{export="a"} 1`,
		`tiercache_export_info{export="a",mode="writethrough"} 1`,
		`tiercache_set_buckets `,
		`tiercache_read_duration_seconds_count{export="a",tier="cache"} 1`,
		`tiercache_read_duration_seconds_count{export="b",tier="backing"} 0`,
		`tiercache_write_duration_seconds_count{export="a",tier="cache"} 8`,
		`tiercache_write_duration_seconds_count{export="a",tier="backing"} 1`,
		`tiercache_backing_consistent{export="a"} 1`,
		`tiercache_backing_consistent{export="b"} 0`,
		`tiercache_backing_inconsistent_since_seconds{export="a"} 0`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// Check.
	cp, err := c.Check(ctx, nil)
	if err != nil || len(cp.Problems) != 0 || !strings.Contains(cp.Message, "verified") {
		t.Fatalf("check: %+v err %v", cp, err)
	}

	// Detach.
	if _, err := c.Detach(ctx, "p", nil); err == nil || !strings.Contains(err.Error(), "plain export") {
		t.Errorf("detach of plain export: %v", err)
	}
	dp, err := c.Detach(ctx, "b", nil)
	if err != nil || !strings.Contains(dp.Message, "can be used alone") {
		t.Fatalf("detach: %+v err %v", dp, err)
	}
	if len(fn.removed) != 1 || fn.removed[0] != "b" || len(*released) != 1 || (*released)[0] != "/dev/mem-b" {
		t.Errorf("detach removed %v released %v", fn.removed, *released)
	}
	if _, err := c.Settings(ctx, "b"); err == nil || !strings.Contains(err.Error(), "detached") {
		t.Errorf("settings of a detached export: %v", err)
	}
	if _, err := c.Detach(ctx, "b", nil); err == nil || !strings.Contains(err.Error(), "detached") {
		t.Errorf("second detach: %v", err)
	}
	if text, err := c.Metrics(ctx); err != nil || strings.Contains(text, `export="b"`) {
		t.Errorf("metrics still report the detached export b (err %v)", err)
	}

	// Attach: b again (a new device here), then wrong input.
	ei, err := c.Attach(ctx, AttachRequest{Name: "b", Path: "/dev/mem-b2", Mode: "writethrough"})
	if err != nil || ei.Name != "b" || ei.Mode != "writethrough" || !ei.Cached || ei.Size != 4<<20 {
		t.Fatalf("attach: %+v err %v", ei, err)
	}
	if len(fn.added) != 1 || fn.added[0] != "b" {
		t.Errorf("attach added exports %v", fn.added)
	}
	if st, err := c.Status(ctx); err != nil || len(st.Exports) != 3 {
		t.Errorf("status after attach: %+v %v", st, err)
	}
	for _, tc := range []struct {
		req    AttachRequest
		status int
		msg    string
	}{
		{AttachRequest{Name: "a", Path: "/x"}, 409, `an export named "a" exists`},
		{AttachRequest{Name: "p", Path: "/x"}, 409, `an export named "p" exists`},
		{AttachRequest{Name: "", Path: "/x"}, 400, "needs a name and a path"},
		{AttachRequest{Name: "y", Path: "/x", Mode: "fast"}, 400, "unknown cache mode"},
	} {
		_, err := c.Attach(ctx, tc.req)
		var ae *APIError
		if !errors.As(err, &ae) || ae.Status != tc.status || !strings.Contains(ae.Msg, tc.msg) {
			t.Errorf("attach %+v: got %v, want %d containing %q", tc.req, err, tc.status, tc.msg)
		}
	}
}

// registries maps a test client to its server's registry.
var registries sync.Map

func srvMetrics(c *Client) *prometheus.Registry {
	r, _ := registries.Load(c)
	return r.(*prometheus.Registry)
}

func TestClientNoServer(t *testing.T) {
	c := NewClient(filepath.Join(t.TempDir(), "none.sock"))
	_, err := c.Status(context.Background())
	if !errors.Is(err, ErrNoServer) {
		t.Fatalf("got %v, want ErrNoServer", err)
	}
}
