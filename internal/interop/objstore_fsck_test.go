package interop

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/s3test"
)

// runEnv is run with env added to the command's environment.
func runEnv(t *testing.T, env []string, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestCacheLossObjStoreExt4 loses the cache device under ext4 on an
// object-store image: files written and synced, then written back (the
// cache clean); then, while more files are written, renamed, removed and
// synced, the cache holds what the image lacks: in "paused" because
// writeback pauses, in "outage" because the link to the store is cut
// (s3test.Proxy answers 503 after 3 more PUTs), so every sync and the
// unmount's journal commits (FUA) must be absorbed by the cache. ext4 is
// unmounted, the server SIGKILLed and the cache file deleted. A fresh cache
// set over the image (the link back) must mount (the kernel replays ext4's
// journal), fsck clean (`fsck.ext4 -n -f`, exit 0) and hold the files
// written back before the cut, byte for byte.
//
// The outage variant is the regression test of ext4 going read-only during
// an outage (issue 22): "I/O error ... op WRITE flags 0x9800" (PREFLUSH|FUA)
// about every 25 s, "Aborting journal". The journal, a sequential stream,
// bypassed the cache into the image's memory, and the next FUA's commit had
// to sync the image. TestKeeperStreamAbsorbed (cache) is its unit test.
func TestCacheLossObjStoreExt4(t *testing.T) {
	t.Parallel()
	for _, outage := range []bool{false, true} {
		name := map[bool]string{false: "paused", true: "outage"}[outage]
		t.Run(name, func(t *testing.T) {
			needRoot(t)
			need(t, "nbdfuse", "losetup", "mkfs.ext4", "fsck.ext4", "mount", "umount", "fusermount3")
			t.Parallel()
			cacheLossExt4(t, outage)
		})
	}
}

func cacheLossExt4(t *testing.T, outage bool) {
	srv := s3test.Start(t)
	srv.Bucket("images")
	proxy := s3test.NewProxy(t, srv)
	env := []string{"AWS_ACCESS_KEY_ID=" + s3test.AccessKey, "AWS_SECRET_ACCESS_KEY=" + s3test.SecretKey,
		"AWS_SESSION_TOKEN=", "AWS_SHARED_CREDENTIALS_FILE=" + os.DevNull, "AWS_ENDPOINT_URL=", "AWS_ENDPOINT_URL_S3="}
	uri := fmt.Sprintf("s3://images/ext4?endpoint=%s&region=%s&path-style=1", proxy.Endpoint(), s3test.Region)
	runEnv(t, env, time.Minute, bin, "image", "create", uri, "--size", "64M")

	// serve formats a cache set over the image and serves it. The cache
	// is larger than the image: every block ext4 reads during the cut is
	// cached (an uncached one would fail to read while the store is away).
	dir := shortDir(t)
	serve := func(name string) (*killableServer, string) {
		cachePath := sparseFile(t, dir, name, 96*mib)
		runEnv(t, env, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
		ks := newKillableServer(t, "--cache", cachePath)
		ks.env = env
		if err := ks.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		return ks, cachePath
	}
	ks, cachePath := serve("cache.img")
	admin := filepath.Join(ks.args[1], "admin.sock")
	run(t, time.Minute, bin, "set", "--admin", admin, "vol", "writeback_percent=0")
	loop := loopDevice(t, nbdfuseFile(t, fmt.Sprintf("nbd+unix:///vol?socket=%s", ks.sock)))
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o700)
	mounted := false
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", "-l", mnt).Run()
		}
	})
	mount := func(dev string) { run(t, 30*time.Second, "mount", "-t", "ext4", dev, mnt); mounted = true }
	umount := func() { run(t, time.Minute, "umount", mnt); mounted = false }
	dirty := func() int64 {
		var st struct {
			Exports []struct {
				Volume struct {
					DirtyBlocks int64 `json:"dirty_blocks"`
				}
			}
		}
		out := run(t, time.Minute, bin, "stats", "--json", "--admin", admin)
		if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Exports) != 1 {
			t.Fatalf("stats --json: %v\n%s", err, out)
		}
		return st.Exports[0].Volume.DirtyBlocks
	}
	write := func(name string, size, seed int) [32]byte {
		data := bytes.Repeat([]byte(fmt.Sprintf("%s %d ", name, seed)), size/8+1)[:size]
		if err := os.WriteFile(filepath.Join(mnt, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(data)
	}

	run(t, 2*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
	mount(loop)
	kept := map[string][32]byte{}
	for i, size := range []int{1, 4096, 65537, 3 * mib} {
		name := fmt.Sprintf("kept%d", i)
		kept[name] = write(name, size, i)
	}
	run(t, time.Minute, "sync")
	waitFor(t, 2*time.Minute, func() bool { return dirty() == 0 }, "the synced files written back to the image")

	// Writeback pauses (dirty data under the target stays in the cache):
	// the image stops at the epoch after the sync above, plus whatever
	// bypasses the cache to it (sequential writes past the cutoff).
	if outage {
		proxy.CutAfter(3)
	} else {
		run(t, time.Minute, bin, "set", "--admin", admin, "vol", "writeback_percent=90")
	}
	for i := range 24 {
		name := fmt.Sprintf("late%d", i)
		write(name, (i%5+1)*100_000, i)
		if i%3 == 2 {
			os.Rename(filepath.Join(mnt, name), filepath.Join(mnt, "renamed"+name))
			os.Remove(filepath.Join(mnt, fmt.Sprintf("late%d", i-2)))
		}
		run(t, time.Minute, "sync")
	}
	umount()
	if n := dirty(); n == 0 {
		t.Fatal("nothing dirty in the cache when it is lost")
	} else {
		t.Logf("lost with the cache: %d dirty blocks", n)
	}
	if err := ks.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(cachePath); err != nil {
		t.Fatal(err)
	}

	if outage {
		t.Logf("during the outage: %v", proxy.Counts())
		proxy.CutAfter(-1)
	}
	t.Logf("image info after the loss:\n%s", runEnv(t, env, time.Minute, bin, "image", "info", uri))
	ks2, _ := serve("fresh.img")
	loop2 := loopDevice(t, nbdfuseFile(t, fmt.Sprintf("nbd+unix:///vol?socket=%s", ks2.sock)))
	mount(loop2)
	umount()
	t.Logf("fsck after the journal's replay:\n%s", run(t, 2*time.Minute, "fsck.ext4", "-n", "-f", loop2))
	mount(loop2)
	for name, h := range kept {
		data, err := os.ReadFile(filepath.Join(mnt, name))
		if err != nil || sha256.Sum256(data) != h {
			t.Errorf("%s, written back before the cut: %v (content equal %v)", name, err, err == nil && sha256.Sum256(data) == h)
		}
	}
	umount()
}
