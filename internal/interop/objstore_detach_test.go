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

// TestObjStoreDetachDuringOutage detaches an object-store volume through
// the binary while every request to the store fails (s3test.Proxy cut)
// and 1 MiB is dirty: detach is refused with the store's error, removes
// nothing and keeps the dirty data in the cache; once the store is back a
// second detach writes the 1 MiB to the image. (First run, 07:42 on main
// 0e53348: refused 8.5 s after the request, exit 1; the second detach
// wrote back 1 MiB.)
func TestObjStoreDetachDuringOutage(t *testing.T) {
	t.Parallel()
	srv := s3test.Start(t)
	srv.Bucket("images")
	proxy := s3test.NewProxy(t, srv)
	env := []string{"AWS_ACCESS_KEY_ID=" + s3test.AccessKey, "AWS_SECRET_ACCESS_KEY=" + s3test.SecretKey,
		"AWS_SESSION_TOKEN=", "AWS_SHARED_CREDENTIALS_FILE=" + os.DevNull, "AWS_ENDPOINT_URL=", "AWS_ENDPOINT_URL_S3="}
	uri := fmt.Sprintf("s3://images/detach?endpoint=%s&region=%s&path-style=1", proxy.Endpoint(), s3test.Region)
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
	// Detach during the outage: refused within a bounded time (the
	// writeback drain gives up), the volume kept with its dirty data.
	out, err := runErr(2*time.Minute, bin, "detach", "--admin", admin, "vol")
	if err == nil || strings.Contains(err.Error(), "timed out") {
		t.Fatalf("detach during the outage: %v, want a refusal:\n%s", err, out)
	}
	for _, want := range []string{"fault injected by the test proxy", "nothing was removed", "dirty data kept in the cache", "run detach again once the backing device answers"} {
		if !strings.Contains(out, want) {
			t.Fatalf("detach during the outage: refusal without %q:\n%s", want, out)
		}
	}
	if show := run(t, time.Minute, bin, "list", "--admin", admin); !listed(show, "vol", "none", "1 MiB") {
		t.Fatalf("after a refused detach, vol is not served in mode none with 1 MiB dirty:\n%s", show)
	} else {
		t.Logf("list after the refused detach:\n%s", show)
	}
	// The store back, detach writes the 1 MiB kept to the image.
	proxy.CutAfter(-1)
	out = run(t, 2*time.Minute, bin, "detach", "--admin", admin, "vol")
	if !strings.Contains(out, "wrote back 1 MiB") || !strings.Contains(out, "is detached") {
		t.Fatalf("detach after the outage:\n%s", out)
	}
	if err := ks.stop(); err != nil {
		t.Fatal(err)
	}
	if info := runEnv(t, env, time.Minute, bin, "image", "info", uri); !strings.Contains(info, "newest epoch: ") || strings.Contains(info, "newest epoch: 0 ") {
		t.Fatalf("image info after detach:\n%s", info)
	}
}

// listed reports whether the output of 'tiercache list' has a row for
// export in mode with dirty as its DIRTY column.
func listed(out, export, mode, dirty string) bool {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 8 && f[0] == export && f[1] == mode && f[6]+" "+f[7] == dirty {
			return true
		}
	}
	return false
}
