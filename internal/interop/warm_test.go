package interop

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/nbd"
)

// TestWarmAfterSIGKILLThroughBinary measures issue 21's warm-after-crash
// promise through the binary: a 16 MiB read set of a 128 MiB volume (64
// MiB cache) is read until it is served from the cache; a mixed workload (fio: random reads
// and writes of 4-64 KiB with a FLUSH every 16, and random 64 KiB trims,
// outside the read set, rate-limited so that it and the read set fit in
// the cache) runs for a second; the read set's hit ratio is measured (the
// bytes served from the cache over those read, from `tiercache stats
// --json`); the workload runs again and the server is killed with SIGKILL
// at a random moment of it and restarted, and the read set's hit ratio is measured again: in writeback,
// writethrough and writearound mode (none caches nothing) the two differ
// by at most 5 points, and the read set reads back its content. The
// cold-clean case restarts with --cold-clean (no clean data kept, what a
// set without region marks does after a crash) and requires the drop to
// show: the measurement sees a cold cache.
func TestWarmAfterSIGKILLThroughBinary(t *testing.T) {
	need(t, "fio")
	t.Parallel() // self-contained: its own files, sockets and processes
	for _, mode := range []string{"writeback", "writethrough", "writearound"} {
		t.Run(mode, func(t *testing.T) { warmAfterKill(t, mode, false) })
	}
	t.Run("cold-clean", func(t *testing.T) { warmAfterKill(t, "writethrough", true) })
}

func warmAfterKill(t *testing.T, mode string, coldClean bool) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x3a7))
	const (
		setLen = 16 * mib
		chunk  = 64 << 10
	)
	dir := t.TempDir()
	back := randomFile(t, dir, "back.img", 128*mib, seed)
	orig := make([]byte, setLen)
	f, err := os.Open(back)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.ReadAt(orig, 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	cachePath := sparseFile(t, dir, "cache.img", 64*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "a="+back, "--bucket-size", "256K", "--mode", mode)
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", cachePath, "--data-dir", dd)

	stats := func() (hit, miss uint64) {
		t.Helper()
		var st struct {
			Exports []struct {
				Volume struct {
					ReadHitBytes  uint64 `json:"read_hit_bytes"`
					ReadMissBytes uint64 `json:"read_miss_bytes"`
				}
			}
		}
		out := run(t, time.Minute, bin, "stats", "--json", "--data-dir", dd)
		if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Exports) != 1 {
			t.Fatalf("stats --json: %v\n%s", err, out)
		}
		return st.Exports[0].Volume.ReadHitBytes, st.Exports[0].Volume.ReadMissBytes
	}
	// readSet reads the read set in a random order of 64 KiB chunks (not
	// sequential: no sequential bypass), checks its content and returns
	// its hit ratio.
	readSet := func(how string) float64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := nbd.Dial(ctx, "unix", s.sock, "a", nbd.ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		h0, m0 := stats()
		p := make([]byte, chunk)
		for _, i := range rng.Perm(setLen / chunk) {
			off := int64(i) * chunk
			if err := c.ReadAt(p, off); err != nil {
				t.Fatalf("%s: read at %d: %v\n%s", how, off, err, s.log)
			}
			if !bytes.Equal(p, orig[off:off+chunk]) {
				t.Fatalf("%s: the read set's chunk at %d differs from the backing device's content\n%s", how, off, s.log)
			}
		}
		h1, m1 := stats()
		if h1+m1-h0-m0 < setLen {
			t.Fatalf("%s: stats count %d bytes read, want at least %d", how, h1+m1-h0-m0, setLen)
		}
		return float64(h1-h0) / float64(h1+m1-h0-m0)
	}
	// Promotion of the misses completes behind the reads: read until
	// the read set is served from the cache.
	for i := 0; readSet("warm-up") < 0.99; i++ {
		if i == 10 {
			t.Fatalf("the read set is not cached after %d reads", i+1)
		}
	}

	workload := func(runtime string) []string {
		return []string{"--thread", "--ioengine=nbd", "--uri=" + s.uri("a"), "--time_based", "--runtime=" + runtime,
			"--name=rw", "--rw=randrw", "--bsrange=4k-64k", "--iodepth=8", "--fsync=16", "--rate=4m,4m",
			fmt.Sprintf("--offset=%d", 32*mib), fmt.Sprintf("--size=%d", 16*mib),
			"--name=trim", "--rw=randtrim", "--bs=64k", "--iodepth=2", "--rate=1m",
			fmt.Sprintf("--offset=%d", 96*mib), fmt.Sprintf("--size=%d", 16*mib)}
	}
	// The read set is measured between two runs of the workload, not
	// during one: under load reads may be sent to the backing device
	// (misses that say nothing about what the cache holds).
	run(t, time.Minute, "fio", workload("1s")...)
	before := readSet("before the kill")
	fio, fout, fdone := background(t, "fio", workload("60s")...)
	defer func() { fio.Process.Kill() }()
	time.Sleep(time.Duration(200+rng.IntN(800)) * time.Millisecond)
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil
	fio.Process.Kill()
	<-fdone
	if out := fout.String(); len(out) > 0 {
		t.Logf("fio (killed with the server): %.300s", out)
	}
	args := []string{"--cache", cachePath, "--data-dir", dd}
	if coldClean {
		args = append(args, "--cold-clean")
	}
	s = startServer(t, args...)
	after := readSet("after the restart")
	t.Logf("%s: read set hit ratio %.3f before SIGKILL, %.3f after the restart", mode, before, after)
	if before < 0.9 {
		t.Fatalf("the read set was not warm before the kill (hit ratio %.3f): the test would prove nothing", before)
	}
	d := before - after
	switch {
	case coldClean && d < 0.5:
		t.Fatalf("with --cold-clean the hit ratio went from %.3f to %.3f: the measurement does not see a cold cache", before, after)
	case !coldClean && (d > 0.05 || d < -0.05):
		t.Fatalf("hit ratio %.3f before SIGKILL, %.3f after the restart: more than 5 points apart\n%s", before, after, s.log)
	}
}
