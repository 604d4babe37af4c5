package cli

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/nbd"
)

// syncBuf is a goroutine-safe buffer for a server's output.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Write(p) }
func (s *syncBuf) String() string              { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// runCtx runs the CLI like Main, with a context, and returns the exit code.
func runCtx(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintf(stderr, "tiercache: %v\n", err)
		if ee, ok := err.(*exitError); ok {
			return ee.code
		}
		return 1
	}
	return 0
}

// tc runs one command and returns its stdout, stderr and exit code.
func tc(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := runCtx(context.Background(), args, &out, &errb)
	t.Logf("$ tiercache %s  (exit %d)\n%s%s", strings.Join(args, " "), code, out.String(), errb.String())
	return out.String(), errb.String(), code
}

// mustTC runs a command that must succeed and print want.
func mustTC(t *testing.T, want string, args ...string) string {
	t.Helper()
	out, errs, code := tc(t, args...)
	if code != 0 || !strings.Contains(out, want) {
		t.Fatalf("tiercache %s: exit %d, stdout %q, stderr %q; want exit 0 and %q", strings.Join(args, " "), code, out, errs, want)
	}
	return out
}

// failTC runs a command that must fail with a message containing want.
func failTC(t *testing.T, want string, args ...string) {
	t.Helper()
	out, errs, code := tc(t, args...)
	if code == 0 || !strings.Contains(errs, want) {
		t.Errorf("tiercache %s: exit %d, stdout %q, stderr %q; want a non-zero exit and %q", strings.Join(args, " "), code, out, errs, want)
	}
}

type testServer struct {
	admin  string
	cancel context.CancelFunc
	done   chan int
	log    *syncBuf
}

// startServe runs 'tiercache serve args...' in-process until the test ends
// (or stop), and waits until its admin API at adminSock answers.
func startServe(t *testing.T, adminSock string, args ...string) *testServer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &testServer{admin: adminSock, cancel: cancel, done: make(chan int, 1), log: &syncBuf{}}
	go func() { s.done <- runCtx(ctx, append([]string{"serve"}, args...), s.log, s.log) }()
	t.Cleanup(func() { s.stop(t) })
	c := admin.NewClient(adminSock)
	if err := c.Wait(context.Background(), 20*time.Second); err != nil {
		cancel()
		t.Fatalf("server did not come up: %v\n%s", err, s.log.String())
	}
	return s
}

func (s *testServer) stop(t *testing.T) {
	if s.cancel == nil {
		return
	}
	s.cancel()
	s.cancel = nil
	select {
	case code := <-s.done:
		if code != 0 {
			t.Errorf("serve exited %d:\n%s", code, s.log.String())
		}
	case <-time.After(60 * time.Second):
		t.Errorf("serve did not stop")
	}
}

func writePattern(t *testing.T, sock string, off int64, n int, b byte) {
	t.Helper()
	c, err := nbd.Dial(context.Background(), "unix", sock, "default", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.WriteAt(bytes.Repeat([]byte{b}, n), off, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}

// writeBlocks writes count 4 KiB blocks of b at off, every other block.
func writeBlocks(t *testing.T, sock string, off int64, count int, b byte) {
	t.Helper()
	c, err := nbd.Dial(context.Background(), "unix", sock, "default", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := bytes.Repeat([]byte{b}, 4096)
	for i := 0; i < count; i++ {
		if err := c.WriteAt(p, off+int64(i)*8192, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestOpsCommands drives every admin command against the embedded default
// served in-process, with right and wrong input.
func TestOpsCommands(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	srv := startServe(t, sock, "--data-dir", dir)
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("admin socket: %v mode %v, want 0600", err, fi.Mode().Perm())
	}
	// Scattered 4 KiB writes (a long sequential one would bypass the cache).
	const n = 256 * 4096
	writeBlocks(t, filepath.Join(dir, "tiercache.sock"), 1<<20, 256, 0x5a)

	// Commands find the server through --data-dir (its admin.sock),
	// through $TIERCACHE_ADMIN, and through --admin.
	// Background writeback may already have cleaned the blocks: the
	// assertions hold either way.
	out := mustTC(t, "export default (writeback)", "usage", "--data-dir", dir)
	if !strings.Contains(out, "pending writeback") || !strings.Contains(out, "[#") {
		t.Errorf("usage output:\n%s", out)
	}
	t.Setenv("TIERCACHE_ADMIN", sock)
	out = mustTC(t, "{", "usage", "--json")
	var u admin.Usage
	if err := json.Unmarshal([]byte(out), &u); err != nil || len(u.Exports) != 1 || u.Exports[0].Cached != n || u.Cache == nil || u.Cache.CachedBytes != n {
		t.Fatalf("usage --json: %v %+v", err, u)
	}
	out = mustTC(t, "write_ops", "stats", "--admin", sock)
	for _, want := range []string{"hit_ratio", "writeback_eta", "latency_write", "cache set", "dirty_blocks"} {
		if !strings.Contains(out, want) {
			t.Errorf("stats lacks %q", want)
		}
	}
	out = mustTC(t, `"write_ops": 256`, "stats", "--json")
	var st admin.Stats
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Exports[0].Volume.WriteBytes != n {
		t.Fatalf("stats --json: %v %+v", err, st)
	}
	// With an interval: one line per export per interval, COUNT times;
	// --watch[=INTERVAL] repeats until interrupted.
	out = mustTC(t, "r/s", "stats", "0.1", "3")
	if n := strings.Count(out, " default "); n != 3 {
		t.Errorf("stats 0.1 3: %d lines for the export, want 3:\n%s", n, out)
	}
	// --watch is interrupted once it has printed two lines (or after a
	// minute, which fails): how many a fixed wall-clock time allows
	// depends on the machine's load.
	var werr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	wout := &cancelAfter{want: " default ", n: 2, cancel: cancel}
	code := runCtx(ctx, []string{"stats", "--watch=0.1"}, wout, &werr)
	cancel()
	if got := wout.String(); code != 0 || strings.Count(got, " default ") < 2 {
		t.Errorf("stats --watch=0.1: exit %d, %d lines:\n%s%s", code, strings.Count(got, " default "), got, werr.String())
	}
	failTC(t, "INTERVAL \"fast\"", "stats", "fast")

	// flush
	mustTC(t, "default: wrote back", "flush", "default")
	mustTC(t, "0 B dirty", "flush")
	failTC(t, `no export named "nope" (exports: default)`, "flush", "nope")

	// set
	mustTC(t, "cache_mode          writeback", "set", "default")
	mustTC(t, "writethrough  (changed)", "set", "default", "cache_mode=writethrough")
	mustTC(t, "cache_mode          writethrough", "set", "default")
	failTC(t, `unknown setting "cache_mod"`, "set", "default", "cache_mod=none")
	failTC(t, `unknown cache mode "fast"`, "set", "default", "cache_mode=fast")
	failTC(t, "writeback_percent 150 (want 0..100)", "set", "default", "writeback_percent=150")
	failTC(t, `"cache_mode": want key=value`, "set", "default", "cache_mode")
	failTC(t, `no export named "nope"`, "set", "nope", "cache_mode=none")
	failTC(t, "set needs the EXPORT", "set")
	// Other keys are validated here and applied when the engine accepts
	// them; until then the engine's refusal is reported as it is.
	if out, errs, code := tc(t, "set", "default", "sequential_cutoff=8M"); code == 0 {
		if !regexp.MustCompile(`sequential_cutoff +8 MiB +\(changed\)`).MatchString(out) {
			t.Errorf("sequential_cutoff accepted but not shown: %s", out)
		}
	} else if !strings.Contains(errs, "refused") {
		t.Errorf("sequential_cutoff refused without saying why: %s", errs)
	}

	// check (online)
	mustTC(t, "no problems found", "check")

	// attach: wrong input (TestAttachDetachCommands covers the rest).
	failTC(t, "want NAME=PATH", "attach", "x")
	failTC(t, "accepts 1 arg(s), received 0", "attach")

	// detach leaves the backing file complete and released.
	writePattern(t, filepath.Join(dir, "tiercache.sock"), 0, 8192, 0x77)
	mustTC(t, "can be used alone", "detach", "default")
	failTC(t, `export "default" was detached`, "detach", "default")
	failTC(t, `export "default" was detached`, "set", "default", "cache_mode=none")
	out = mustTC(t, "cache device", "usage")
	if strings.Contains(out, "export default") {
		t.Errorf("usage still lists the detached export:\n%s", out)
	}
	// The detach of the only export freed every bucket (they stayed used
	// until a restart).
	if !regexp.MustCompile(`used \(buckets\) +0 B `).MatchString(out) || strings.Contains(out, "of which empty") {
		t.Errorf("usage after detaching the only export shows buckets used:\n%s", out)
	}
	srv.stop(t)
	backing := filepath.Join(dir, "backing.img")
	f, err := os.Open(backing)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20+2*n)
	if _, err := f.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !bytes.Equal(buf[:8192], bytes.Repeat([]byte{0x77}, 8192)) {
		t.Error("backing file does not hold the data written through the cache")
	}
	for i := 0; i < 256; i++ {
		off := 1<<20 + i*8192
		if !bytes.Equal(buf[off:off+4096], bytes.Repeat([]byte{0x5a}, 4096)) {
			t.Fatalf("backing file lacks block %d written through the cache", i)
		}
	}
	if id, err := backingid.Read(backing); err != nil || id.Set != "" {
		t.Errorf("backing still claimed after detach: %+v %v", id, err)
	}

	// No server: a clear error and exit 1.
	failTC(t, "no tiercache server is running at "+sock, "usage")
	failTC(t, "no tiercache server is running at", "stats", "--admin", filepath.Join(dir, "none.sock"))

	// Offline check and inspect of the stopped set.
	mustTC(t, "no problems found", "check", "--cache", filepath.Join(dir, "cache.img"))
	mustTC(t, "backing devices        none", "inspect", "superblock", "--cache", filepath.Join(dir, "cache.img"))
	mustTC(t, "checkpoint generation", "inspect", "journal", "--cache", filepath.Join(dir, "cache.img"))
	mustTC(t, "flush epoch", "inspect", "index", "--cache", filepath.Join(dir, "cache.img"))
	failTC(t, "want superblock, journal or index", "inspect", "bogus", "--cache", filepath.Join(dir, "cache.img"))
	failTC(t, "--cache PATH is required", "inspect", "superblock")
	failTC(t, "is not a tiercache cache device", "check", "--cache", backing)
	failTC(t, "is not a tiercache cache device", "inspect", "index", "--cache", backing)
	failTC(t, "is not a tiercache cache device", "inspect", "superblock", "--cache", backing)

	// The released backing file is served alone without --force.
	alone := startServe(t, filepath.Join(dir, "a2.sock"), "--data-dir", dir, "--export", "default="+backing,
		"--listen", "unix:"+filepath.Join(dir, "alone.sock"), "--admin", filepath.Join(dir, "a2.sock"))
	mustTC(t, "default (plain)", "stats", "--admin", alone.admin)
	failTC(t, "plain export", "set", "default", "cache_mode=none", "--admin", alone.admin)
	failTC(t, "serves no cache set", "check", "--admin", alone.admin)
}

// TestCheckFindsCorruption formats a small set, serves and stops it,
// corrupts one cached (dirty) block and expects check to fail.
func TestCheckFindsCorruption(t *testing.T) {
	dir := t.TempDir()
	cachePath, backing := filepath.Join(dir, "c.img"), filepath.Join(dir, "b.img")
	for p, size := range map[string]int64{cachePath: 64 << 20, backing: 16 << 20} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, size); err != nil {
			t.Fatal(err)
		}
	}
	mustTC(t, "cache set", "format", "--cache", cachePath, "--backing", "default="+backing, "--bucket-size", "256K")
	sock := filepath.Join(dir, "admin.sock")
	srv := startServe(t, sock, "--data-dir", dir, "--cache", cachePath)
	writePattern(t, filepath.Join(dir, "tiercache.sock"), 0, 64<<10, 0x42)
	srv.stop(t)
	out := mustTC(t, "dirty", "inspect", "index", "--cache", cachePath, "--limit", "1")
	// export  lba  cache block  cache offset ...: take the offset of lba 0.
	var off int64 = -1
	for _, line := range strings.Split(out, "\n") {
		fs := strings.Fields(line)
		if len(fs) == 7 && fs[0] == "default" && fs[1] == "0" {
			fmt.Sscan(fs[3], &off)
		}
	}
	if off < 0 {
		t.Fatalf("no index line for lba 0:\n%s", out)
	}
	f, err := os.OpenFile(cachePath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("bitrot"), off+10); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out, _, code := tc(t, "check", "--cache", cachePath)
	if code != 1 || !strings.Contains(out, "PROBLEM: cache: data checksum mismatch") || !strings.Contains(out, "lba 0") {
		t.Errorf("check of a corrupt set: exit %d\n%s", code, out)
	}
}

// TestServeConfig: unknown keys are errors with line numbers, bad TOML
// names line and column, and flags override the file.
func TestServeConfig(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	os.WriteFile(bad, []byte("# tiercache\nlog_level = \"debug\"\ncach = \"/dev/x\"\n\n[backing]\nhome = \"/dev/y\"\n[exprt]\nx = \"y\"\n"), 0o600)
	failTC(t, `bad.toml:3: unknown key "cach"`, "serve", "--config", bad)
	failTC(t, `bad.toml:7: unknown key "exprt" (known keys`, "serve", "--config", bad)
	// The example shipped in dist/ parses.
	if _, err := loadServeConfig("../../dist/tiercache.toml"); err != nil {
		t.Errorf("dist/tiercache.toml: %v", err)
	}
	syntax := filepath.Join(dir, "syntax.toml")
	os.WriteFile(syntax, []byte("log_level = \"debug\"\nlisten = [\"unix:/x\"\n"), 0o600)
	failTC(t, "syntax.toml:2:", "serve", "--config", syntax)
	wrongType := filepath.Join(dir, "type.toml")
	os.WriteFile(wrongType, []byte("read_only = \"yes\"\n"), 0o600)
	failTC(t, "type.toml", "serve", "--config", wrongType)

	// A good file; --admin on the command line overrides the file's.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tcpAddr := l.Addr().String()
	l.Close()
	good := filepath.Join(dir, "good.toml")
	os.WriteFile(good, []byte(fmt.Sprintf(`data_dir = %q
log_format = "json"
listen = ["unix:%s"]
admin = "%s"
admin_tcp = %q
shutdown_timeout = "5s"
`, dir, filepath.Join(dir, "nbd.sock"), filepath.Join(dir, "from-file.sock"), tcpAddr)), 0o600)
	flagSock := filepath.Join(dir, "from-flag.sock")
	srv := startServe(t, flagSock, "--config", good, "--admin", flagSock)
	if _, err := os.Stat(filepath.Join(dir, "from-file.sock")); err == nil {
		t.Error("the file's admin socket was used although --admin was given")
	}
	if !strings.Contains(srv.log.String(), `"msg":"admin API listening"`) {
		t.Errorf("log_format json not applied:\n%s", srv.log.String())
	}
	// Over TCP every request needs the bearer token that serve wrote into
	// the data directory (0600); /metrics too without metrics_no_auth.
	resp, err := http.Get("http://" + tcpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(body), "needs its bearer token") {
		t.Errorf("/metrics over --admin-tcp without the token: %s\n%.2000s", resp.Status, body)
	}
	tok, err := os.ReadFile(filepath.Join(dir, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "admin.token")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("admin.token: %v, mode %v; want 0600", err, fi.Mode())
	}
	req, _ := http.NewRequest("GET", "http://"+tcpAddr+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(tok)))
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `tiercache_export_info{export="default",mode="writeback"} 1`) {
		t.Errorf("/metrics over --admin-tcp with the token:\n%.2000s", body)
	}
	mustTC(t, "default", "stats", "--admin", "tcp:"+tcpAddr, "--data-dir", dir)
	failTC(t, "needs its bearer token", "stats", "--admin", "tcp:"+tcpAddr, "--admin-token-file", filepath.Join(dir, "missing.token"))
}

// TestTwoServersShareDataDir: the default admin socket is best effort, so a
// second server with the same data directory still starts (without it),
// and leaves the first one's socket alone when it stops.
func TestTwoServersShareDataDir(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	startServe(t, sock, "--data-dir", dir)
	img := filepath.Join(dir, "plain.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	log := &syncBuf{}
	done := make(chan int, 1)
	go func() {
		done <- runCtx(ctx, []string{"serve", "--data-dir", dir, "--export", "p=" + img, "--listen", "unix:" + filepath.Join(dir, "p.sock")}, log, log)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(log.String(), "admin API not started") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if code := <-done; code != 0 || !strings.Contains(log.String(), "admin API not started") {
		t.Fatalf("second server: exit %d\n%s", code, log.String())
	}
	mustTC(t, "export default", "usage", "--admin", sock)
	// An explicit --admin that is taken is an error.
	failTC(t, "another server is already listening", "serve", "--data-dir", dir, "--export", "p="+img,
		"--listen", "unix:"+filepath.Join(dir, "p2.sock"), "--admin", sock)
}

// TestServeTakenSocketBeforeRecovery: a second server asked to listen on
// a socket another server holds is refused before it opens its cache set:
// recovery (which writes a checkpoint) does not run, the set's checkpoint
// generation is unchanged.
func TestServeTakenSocketBeforeRecovery(t *testing.T) {
	dir := t.TempDir()
	startServe(t, filepath.Join(dir, "admin.sock"), "--data-dir", dir)
	cachePath, backing := filepath.Join(dir, "c2.img"), filepath.Join(dir, "b2.img")
	for p, size := range map[string]int64{cachePath: 16 << 20, backing: 4 << 20} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, size); err != nil {
			t.Fatal(err)
		}
	}
	mustTC(t, "cache set", "format", "--cache", cachePath, "--backing", "b="+backing, "--bucket-size", "256K")
	gen := func() string {
		out := mustTC(t, "checkpoint generation", "inspect", "journal", "--cache", cachePath)
		return regexp.MustCompile(`checkpoint generation \d+`).FindString(out)
	}
	before := gen()
	out, errs, code := tc(t, "serve", "--cache", cachePath, "--listen", "unix:"+filepath.Join(dir, "tiercache.sock"), "--admin", "none")
	if code == 0 || !strings.Contains(errs, "another server is already listening") || strings.Contains(out+errs, "cache set recovered") {
		t.Errorf("serve on a taken socket: exit %d, want a refusal before recovery:\n%s%s", code, out, errs)
	}
	if after := gen(); after != before {
		t.Errorf("the refused server wrote a checkpoint: %s, then %s", before, after)
	}
}

// TestFormatChecksSizeFirst: a cache device too small for the bucket size
// is refused with the minimum it needs, before any progress line (format
// printed "format: 0%" and then failed its size check).
func TestFormatChecksSizeFirst(t *testing.T) {
	dir := t.TempDir()
	small, back := filepath.Join(dir, "small.img"), filepath.Join(dir, "b.img")
	for path, size := range map[string]int64{small: 4 << 20, back: 64 << 20} {
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, size); err != nil {
			t.Fatal(err)
		}
	}
	out, errs, code := tc(t, "format", "--cache", small, "--backing", "d="+back)
	if code == 0 || !regexp.MustCompile(`holds fewer than 4 buckets of 1048576 bytes: it needs at least \d+ bytes \(\d+(\.\d)? MiB\)`).MatchString(errs) {
		t.Errorf("format of a 4 MiB cache: exit %d, stderr %q; want a refusal naming the minimum size", code, errs)
	}
	if strings.Contains(out+errs, "format: ") {
		t.Errorf("format printed progress before refusing:\n%s%s", out, errs)
	}
}

// TestHelpExamplesExpand: the help's shell examples put variables in
// double quotes, so that pasted into a shell they expand (the nbdinfo
// example quoted $HOME in single quotes).
func TestHelpExamplesExpand(t *testing.T) {
	single := regexp.MustCompile(`'[^'\n]*\$[A-Za-z_][^'\n]*'`)
	for _, args := range [][]string{{"--help"}, {"serve", "--help"}, {"attach", "--help"}, {"detach", "--help"}, {"stats", "--help"}, {"format", "--help"}} {
		out, _, code := tc(t, args...)
		if code != 0 {
			t.Fatalf("tiercache %s: exit %d", strings.Join(args, " "), code)
		}
		if m := single.FindString(out); m != "" {
			t.Errorf("tiercache %s: %s does not expand in a shell", strings.Join(args, " "), m)
		}
	}
}

// TestIndexPagesCLI: format --index-pages makes a set whose checkpoints
// are index pages; inspect superblock shows both roots and what the
// newest names; check reads back and verifies every page; a leaf page
// damaged on the device makes check fail naming the index page.
func TestIndexPagesCLI(t *testing.T) {
	dir := t.TempDir()
	cachePath, backing := filepath.Join(dir, "c.img"), filepath.Join(dir, "b.img")
	for p, size := range map[string]int64{cachePath: 64 << 20, backing: 16 << 20} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, size); err != nil {
			t.Fatal(err)
		}
	}
	mustTC(t, "pages on the cache device", "format", "--cache", cachePath, "--backing", "default="+backing, "--bucket-size", "256K", "--index-pages")
	sock := filepath.Join(dir, "admin.sock")
	srv := startServe(t, sock, "--data-dir", dir, "--cache", cachePath)
	writePattern(t, filepath.Join(dir, "tiercache.sock"), 0, 4<<20, 0x42) // 1,024 blocks: 9 leaves or more
	srv.stop(t)

	out := mustTC(t, "root slot 1", "inspect", "superblock", "--cache", cachePath)
	for _, want := range []string{`index pages\s+\S+ MiB at offset`, `root slot 0\s+generation`, `names \d+ \(1 inner, \d+ leaves, 3 bucket table\)`, `entries\s+1024 in 1 trees`} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("inspect superblock: no %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "checkpoint header") {
		t.Errorf("inspect superblock shows the roots as checkpoint headers:\n%s", out)
	}
	js := mustTC(t, "index_pages", "inspect", "superblock", "--cache", cachePath, "--json")
	var sbj struct {
		Slots []struct {
			Offset     int64  `json:"offset"`
			Generation uint64 `json:"generation"`
			IndexRoot  bool   `json:"index_root"`
		} `json:"checkpoint_slots"`
		Pages struct {
			Leaves     int64 `json:"leaves"`
			Generation int64 `json:"generation"`
		} `json:"index_pages"`
	}
	if err := json.Unmarshal([]byte(js), &sbj); err != nil {
		t.Fatalf("%v\n%s", err, js)
	}
	if len(sbj.Slots) != 2 || !sbj.Slots[0].IndexRoot || sbj.Pages.Leaves < 6 || sbj.Pages.Generation < 2 {
		t.Fatalf("inspect superblock --json: %+v\n%s", sbj, js)
	}
	out = mustTC(t, "no problems found", "check", "--cache", cachePath)
	if !strings.Contains(out, fmt.Sprintf("index pages of root generation %d: ", sbj.Pages.Generation)) || !strings.Contains(out, "read back and verified") {
		t.Errorf("check of a paged set says nothing of its pages:\n%s", out)
	}

	// A leaf the newest root names: kind 1 at byte 8, its generation at
	// byte 24 (cache/internal/pages, "Page format"). The newest leaves
	// are: pages are copy-on-write and nothing here removes a leaf, so
	// the leaves the last checkpoint that wrote any wrote are all still
	// named, even when a later checkpoint (Close's, after one the timer
	// took) changed no leaf.
	img, err := os.ReadFile(cachePath)
	if err != nil {
		t.Fatal(err)
	}
	leaf, leafGen := int64(-1), int64(-1)
	for off := sbj.Slots[0].Offset + 2*4096; off+4096 <= int64(len(img)) && off < sbj.Slots[0].Offset+64<<20; off += 4096 {
		p := img[off : off+4096]
		g := int64(binary.LittleEndian.Uint64(p[24:]))
		if string(p[:4]) == "TCPG" && p[8] == 1 && g <= sbj.Pages.Generation && g > leafGen {
			leaf, leafGen = off, g
		}
	}
	if leaf < 0 {
		t.Fatal("no leaf page of the newest root found")
	}
	f, err := os.OpenFile(cachePath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{img[leaf+100] ^ 0x10}, leaf+100); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out, _, code := tc(t, "check", "--cache", cachePath)
	if code != 1 || !strings.Contains(out, "PROBLEM:") || !strings.Contains(out, "index page") || !strings.Contains(out, "CRC32C") {
		t.Errorf("check of a set with a damaged index page: exit %d\n%s", code, out)
	}
	t.Logf("check of a damaged leaf at offset %d:\n%s", leaf, out)
}

// cancelAfter is a writer that calls cancel once its output holds n
// occurrences of want: it interrupts a command that repeats until
// interrupted after a given amount of output rather than of time.
type cancelAfter struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	want   string
	n      int
	cancel context.CancelFunc
}

func (w *cancelAfter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, err := w.buf.Write(p)
	if strings.Count(w.buf.String(), w.want) >= w.n {
		w.cancel()
	}
	return n, err
}

func (w *cancelAfter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
