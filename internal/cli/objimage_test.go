package cli

import (
	"bytes"
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/device/objstore"
	"github.com/tiercache/tiercache/internal/s3test"
)

// TestObjImage drives the image commands and an object-store backing end to
// end against a real versitygw: create (and its refusal to overwrite), ls,
// info, format --backing default=s3://..., serve, writes through NBD, rm
// refused while the server owns the image, detach writing everything back,
// the image then read on its own, rm. The secret key is never printed.
func TestObjImage(t *testing.T) {
	srv := s3test.Start(t)
	srv.Bucket("images")
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	var printed bytes.Buffer
	run := func(want string, args ...string) string {
		t.Helper()
		out, errs, code := tc(t, args...)
		printed.WriteString(out + errs)
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("tiercache %s: exit %d, stdout %q, stderr %q; want %q", strings.Join(args, " "), code, out, errs, want)
		}
		return out
	}
	fail := func(want string, args ...string) {
		t.Helper()
		out, errs, code := tc(t, args...)
		printed.WriteString(out + errs)
		if code == 0 || !strings.Contains(errs, want) {
			t.Fatalf("tiercache %s: exit %d, stdout %q, stderr %q; want a failure with %q", strings.Join(args, " "), code, out, errs, want)
		}
	}
	const uri = "s3://images/vm1"
	run("created image s3://images/vm1", "image", "create", uri, "--size", "16M")
	fail("already exists", "image", "create", uri, "--size", "16M")
	fail("does not exist", "image", "create", "s3://nobucket/x", "--size", "16M")
	run("s3://images/vm1", "image", "ls", "s3://images")
	run("newest epoch: none", "image", "info", uri)

	dir := t.TempDir()
	cachePath := filepath.Join(dir, "c.img")
	if err := os.WriteFile(cachePath, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(cachePath, 64<<20); err != nil {
		t.Fatal(err)
	}
	// Wrong credentials: one clear error at create and at format, not a
	// failed writeback later.
	t.Setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
	fail("the store refused the credentials", "image", "create", "s3://images/other", "--size", "16M")
	fail("the store refused the credentials", "format", "--cache", cachePath, "--backing", "default="+uri, "--bucket-size", "256K")
	t.Setenv("AWS_SECRET_ACCESS_KEY", s3test.SecretKey)
	run("cache set", "format", "--cache", cachePath, "--backing", "default="+uri, "--bucket-size", "256K")
	sock := filepath.Join(dir, "admin.sock")
	s := startServe(t, sock, "--data-dir", dir, "--cache", cachePath)
	writePattern(t, filepath.Join(dir, "tiercache.sock"), 0, 64<<10, 0x42)
	run("wrote back", "flush", "--admin", sock, "default")
	// The store's counters: stats rows, usage lines, metrics.
	out := run("objstore_image", "stats", "--admin", sock)
	for _, want := range []string{"s3://images/vm1", "objstore_epoch", "of generation 1, stored", "objstore_live_bytes"} {
		if !strings.Contains(out, want) {
			t.Errorf("stats lacks %q:\n%s", want, out)
		}
	}
	out = run("space amplification", "usage", "--admin", sock)
	for _, want := range []string{"stored (segments)", "64 KiB", "GC write amplification"} {
		if !strings.Contains(out, want) {
			t.Errorf("usage lacks %q:\n%s", want, out)
		}
	}
	text, err := admin.NewClient(sock).Metrics(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`tiercache_objstore_live_bytes{export="default"} 65536`, `tiercache_objstore_written_bytes_total{export="default"} 65536`,
		`tiercache_objstore_fenced{export="default"} 0`, `tiercache_objstore_generation{export="default"} 1`} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	host, _ := os.Hostname()
	fail("is owned by "+host, "image", "rm", uri)
	run("is detached", "detach", "--admin", sock, "default")
	s.stop(t)

	out = run("newest epoch: ", "image", "info", uri)
	if strings.Contains(out, "none (all zero)") || !strings.Contains(out, "owner:        none") {
		t.Fatalf("image info after detach:\n%s", out)
	}
	l, _ := objstore.ParseURI(uri)
	d, err := objstore.Open(l.WithEnv(), objstore.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 128<<10)
	if _, err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if !bytes.Equal(got[:64<<10], bytes.Repeat([]byte{0x42}, 64<<10)) || !bytes.Equal(got[64<<10:], make([]byte, 64<<10)) {
		t.Fatal("the image does not hold what was written through the cache")
	}
	run("removed image", "image", "rm", uri)
	fail("no image", "image", "info", uri)
	if strings.Contains(printed.String(), s3test.SecretKey) {
		t.Fatal("a command printed the secret key")
	}
}

// TestObjImageConfig: with the store named only by the config file's [s3]
// table (no endpoint in the URI, the flags or the environment), image
// create, format and serve reach it.
func TestObjImageConfig(t *testing.T) {
	srv := s3test.Start(t)
	srv.Bucket("cfg")
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		if k == "AWS_ENDPOINT_URL" || k == "AWS_REGION" {
			continue
		}
		t.Setenv(k, v)
	}
	for _, k := range []string{"AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "TIERCACHE_CONFIG"} {
		t.Setenv(k, "")
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	dir := t.TempDir()
	cachePath := filepath.Join(dir, "c.img")
	if err := os.WriteFile(cachePath, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(cachePath, 64<<20); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "tiercache.toml")
	sock := filepath.Join(dir, "admin.sock")
	body := "data_dir = \"" + dir + "\"\ncache = \"" + cachePath + "\"\nadmin = \"" + sock + "\"\n\n[s3]\nendpoint = \"" + srv.Endpoint() + "\"\nregion = \"" + s3test.Region + "\"\ngc_rate = \"4M\"\n"
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	const uri = "s3://cfg/vm"
	mustTC(t, "created image s3://cfg/vm?endpoint=", "--config", cfg, "image", "create", uri, "--size", "8M")
	mustTC(t, "newest epoch: none", "--config", cfg, "image", "info", uri)
	mustTC(t, "cache set", "--config", cfg, "format", "--cache", cachePath, "--backing", "default="+uri, "--bucket-size", "256K")
	s := startServe(t, sock, "--config", cfg)
	writePattern(t, filepath.Join(dir, "tiercache.sock"), 0, 8<<10, 0x17)
	mustTC(t, "is detached", "--config", cfg, "detach", "default")
	s.stop(t)
	mustTC(t, "stored:       8", "--config", cfg, "image", "info", uri)
}

// TestObjImageFlags: the image command's --endpoint and --region name the
// store over the config file's [s3] table and the environment, both of
// which name a store that is not there, and an endpoint in the URI's query
// names it over all three (objimage.go's order).
func TestObjImageFlags(t *testing.T) {
	srv := s3test.Start(t)
	srv.Bucket("flg")
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	const dead1, dead2 = "http://127.0.0.1:1", "http://127.0.0.1:2"
	t.Setenv("AWS_ENDPOINT_URL", dead1)
	t.Setenv("AWS_ENDPOINT_URL_S3", dead1)
	t.Setenv("AWS_REGION", "nowhere-1")
	t.Setenv("TIERCACHE_CONFIG", "")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "tiercache.toml")
	body := "data_dir = \"" + dir + "\"\n\n[s3]\nendpoint = \"" + dead2 + "\"\nregion = \"nowhere-2\"\n"
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustTC(t, "created image s3://flg/vm?endpoint=", "--config", cfg, "image", "create", "s3://flg/vm", "--size", "8M",
		"--endpoint", srv.Endpoint(), "--region", s3test.Region)
	if !strings.Contains(out, "endpoint="+url.QueryEscape(srv.Endpoint())) || !strings.Contains(out, "region="+s3test.Region) {
		t.Fatalf("image create with --endpoint %s printed %q: the image is not on the flag's store", srv.Endpoint(), out)
	}
	mustTC(t, "newest epoch: none", "--config", cfg, "image", "info", "s3://flg/vm", "--endpoint", srv.Endpoint(), "--region", s3test.Region)

	// The flags, on the same store, are not asked where the URI says.
	d := s3Defaults{endpoint: dead2, region: "nowhere-2"}
	l, err := d.location("s3://flg/vm?endpoint=" + srv.Endpoint() + "&region=" + s3test.Region)
	if err != nil {
		t.Fatal(err)
	}
	if l.Endpoint != srv.Endpoint() || l.Region != s3test.Region {
		t.Fatalf("location of a URI naming its store, with flags naming another: %+v, want the URI's endpoint and region", l)
	}
	if l, err = d.location("s3://flg/vm"); err != nil || l.Endpoint != dead2 || l.Region != "nowhere-2" || !l.PathStyle {
		t.Fatalf("location of a bare URI with flags: %+v, %v; want the flags' endpoint and region, path-style", l, err)
	}
}
