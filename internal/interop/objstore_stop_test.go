package interop

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/s3test"
)

// TestObjStoreStopDuringOutage stops (SIGTERM) a writeback server whose
// store is away (every request answered 503 by s3test.Proxy) with dirty
// data it cannot write back: it exits cleanly, the dirty data kept in the
// cache; the next start recovers it, and once the store is back detach
// writes it to the image. (One run at c88be73: exit 0 6.4 s after SIGTERM,
// 1 MiB dirty kept.)
func TestObjStoreStopDuringOutage(t *testing.T) {
	t.Parallel()
	srv := s3test.Start(t)
	srv.Bucket("images")
	proxy := s3test.NewProxy(t, srv)
	env := []string{"AWS_ACCESS_KEY_ID=" + s3test.AccessKey, "AWS_SECRET_ACCESS_KEY=" + s3test.SecretKey,
		"AWS_SESSION_TOKEN=", "AWS_SHARED_CREDENTIALS_FILE=" + os.DevNull, "AWS_ENDPOINT_URL=", "AWS_ENDPOINT_URL_S3="}
	uri := fmt.Sprintf("s3://images/stop?endpoint=%s&region=%s&path-style=1", proxy.Endpoint(), s3test.Region)
	runEnv(t, env, time.Minute, bin, "image", "create", uri, "--size", "64M")
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 32*mib)
	runEnv(t, env, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	ks := newKillableServer(t, "--cache", cachePath)
	ks.env = env
	ctx := context.Background()
	if err := ks.Start(ctx); err != nil {
		t.Fatal(err)
	}
	admin := filepath.Join(ks.args[1], "admin.sock")
	run(t, time.Minute, bin, "set", "--admin", admin, "vol", "writeback_percent=0")
	proxy.CutAfter(0)
	c, err := ks.dial("vol")(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 64<<10)
	for i := range 16 {
		p[0] = byte(i)
		if err := c.WriteAt(p, int64(i)*(1<<20), false); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitFor(t, 2*time.Minute, func() bool { return strings.Contains(ks.log.String(), "writeback to the backing device failing") }, "writeback failing")
	// ks.stop: SIGTERM, exit status 0 within the harness's 60 s.
	if err := ks.stop(); err != nil {
		t.Fatalf("stop during the outage: %v", err)
	}
	if l := ks.log.String(); !strings.Contains(l, "stopped cleanly; dirty data stays in the cache") || strings.Contains(l, "dirty_bytes=0") {
		t.Fatalf("stop during the outage did not keep the dirty data:\n%s", l)
	}
	// A start while the store is still away is refused: taking the lease
	// needs the store.
	if err := ks.Start(ctx); err == nil {
		t.Fatal("a start during the outage served")
	} else if l := ks.log.String(); !strings.Contains(l, "expected to take the image's lease") || !strings.Contains(l, "start again once the store answers") {
		t.Fatalf("start during the outage: %v, without the lease refusal:\n%s", err, l)
	}
	// The link back, the
	// next start recovers the dirty data and detach writes it to the
	// image.
	proxy.CutAfter(-1)
	if err := ks.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if m := dirtyRE.FindStringSubmatch(ks.log.String()); m == nil || m[1] == "0" {
		t.Fatalf("the restart after the outage recovered no dirty blocks:\n%s", ks.log)
	}
	if out := run(t, 5*time.Minute, bin, "detach", "--admin", admin, "vol"); !strings.Contains(out, "is detached") {
		t.Fatalf("detach after the outage:\n%s", out)
	}
	if err := ks.stop(); err != nil {
		t.Fatal(err)
	}
	if info := runEnv(t, env, time.Minute, bin, "image", "info", uri); !strings.Contains(info, "newest epoch: ") || strings.Contains(info, "newest epoch: 0 ") {
		t.Fatalf("image info after detach:\n%s", info)
	}
}
