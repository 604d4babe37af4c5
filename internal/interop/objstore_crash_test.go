package interop

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device/objstore"
	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/s3test"
	"github.com/tiercache/tiercache/nbd"
)

// startObjStore starts a versitygw with a bucket "images" and points the
// test's environment (and so every tiercache it runs) at it, with its
// credentials from the environment alone.
func startObjStore(t *testing.T) *s3test.Server {
	t.Helper()
	srv := s3test.Start(t)
	srv.Bucket("images")
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	return srv
}

// storeKiller is a killableServer whose every second Kill first kills the
// store (versitygw, SIGKILL: a PUT or GET of writeback may be in flight),
// then tiercache, and restarts the store on the same address and
// directory: both die together and come back.
type storeKiller struct {
	*killableServer
	srv               *s3test.Server
	kills, storeKills int
}

func (k *storeKiller) Kill() error {
	k.kills++
	if k.kills%2 == 1 {
		return k.killableServer.Kill()
	}
	k.storeKills++
	k.srv.Kill()
	err := k.killableServer.Kill()
	k.srv.Restart()
	return err
}

// TestKillCyclesObjStore runs the SIGKILL harness over a writeback set whose
// backing device is an object-store image on a real versitygw: tiercache
// is killed at random points (writeback to the image in flight among them),
// at every second kill together with versitygw (storeKiller), and
// restarted, taking the image's lease of its dead predecessor, and every
// flushed block must read back (the three-state oracle).
func TestKillCyclesObjStore(t *testing.T) {
	seed, cycles := crashConfig(t)
	cycles = max(cycles/10, 2)
	srv := startObjStore(t)
	const uri = "s3://images/crash"
	run(t, time.Minute, bin, "image", "create", uri, "--size", "64M")
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	ks := &storeKiller{killableServer: newKillableServer(t, "--cache", cachePath), srv: srv}
	start := time.Now()
	st, err := crashtest.Run(context.Background(), crashtest.Config{
		Server:         ks,
		Dial:           ks.dial("vol"),
		Seed:           seed + 300,
		Cycles:         cycles,
		Conns:          4,
		Blocks:         24 * mib / crashtest.BlockSize,
		OpsPerCycle:    150,
		MaxWriteBlocks: 16,
		TrimPercent:    2,
		ZeroPercent:    2,
		Replay:         fmt.Sprintf("go test ./internal/interop -run 'TestKillCyclesObjStore$' -seed %d -cycles %d -v", seed, cycles*10),
		Logf:           t.Logf,
	})
	t.Logf("objstore: %v in %v; server: %s; the store killed with it %d of %d times", st, time.Since(start).Round(time.Millisecond), ks.recoveryStats(), ks.storeKills, ks.kills)
	if ks.storeKills == 0 {
		t.Error("the store was never killed")
	}
	if err != nil {
		log := ""
		if ks.log != nil {
			log = ks.log.String()
			if len(log) > 8000 {
				log = "...\n" + log[len(log)-8000:]
			}
		}
		t.Fatalf("%v\nserver log (current process):\n%s", err, log)
	}
}

// TestCacheLossObjStore loses the cache device of a writeback set whose
// backing device is an object-store image: epochs of stamped 4 KiB writes,
// each ended by a FLUSH, go through the server while writeback (target 0 %:
// it runs all the time) stores them in the image; the server is SIGKILLed
// with dirty data in the cache and the cache file deleted. What the
// operator then has is the image alone: `image info` names its newest
// epoch, and a fresh cache set formatted over it (the dead server's lease
// taken without --force) serves a disk that must be exactly the state
// after one of the client's flushes, block by block, never a mix of two
// and never a state no flush produced.
func TestCacheLossObjStore(t *testing.T) {
	seed, _ := crashConfig(t)
	startObjStore(t)
	const uri = "s3://images/lost"
	const blocks = 2048 // 8 MiB touched
	run(t, time.Minute, bin, "image", "create", uri, "--size", "64M")
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	ks := newKillableServer(t, "--cache", cachePath)
	ctx := context.Background()
	if err := ks.Start(ctx); err != nil {
		t.Fatal(err)
	}
	admin := filepath.Join(ks.args[1], "admin.sock")
	run(t, time.Minute, bin, "set", "--admin", admin, "vol", "writeback_percent=0")
	c, err := ks.dial("vol")(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// states[e][b] is the stamp block b holds after the e-th flush (0:
	// never written, reads as zeroes).
	rng := rand.New(rand.NewPCG(seed, 22))
	cur := make([]uint32, blocks)
	states := [][]uint32{slices.Clone(cur)}
	stamp := func(b int64, id uint32) []byte {
		p := make([]byte, 4096)
		for i := 0; i < len(p); i += 16 {
			binary.LittleEndian.PutUint64(p[i:], uint64(b))
			binary.LittleEndian.PutUint64(p[i+8:], uint64(id))
		}
		return p
	}
	const epochs, perEpoch = 60, 48
	for e := 1; e <= epochs; e++ {
		for w := range perEpoch {
			b := rng.Int64N(blocks)
			id := uint32(e*perEpoch + w)
			if err := c.WriteAt(stamp(b, id), b*4096, false); err != nil {
				t.Fatal(err)
			}
			cur[b] = id
		}
		if err := c.Flush(); err != nil {
			t.Fatal(err)
		}
		states = append(states, slices.Clone(cur))
	}
	stats := run(t, time.Minute, bin, "stats", "--admin", admin)
	c.Close()
	if err := ks.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(cachePath); err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(stats, "\n") {
		if strings.Contains(l, "dirty_blocks") || strings.Contains(l, "objstore_epoch") {
			t.Logf("before the kill: %s", strings.TrimSpace(l))
		}
	}

	info := run(t, time.Minute, bin, "image", "info", uri)
	if !strings.Contains(info, "newest epoch: ") || !strings.Contains(info, "owner:        ") {
		t.Fatalf("image info after the loss:\n%s", info)
	}
	t.Logf("image info after the cache device was lost:\n%s", info)

	fresh := sparseFile(t, dir, "fresh.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", fresh, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	ks2 := newKillableServer(t, "--cache", fresh)
	if err := ks2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	c2, err := ks2.dial("vol")(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	got := make([]uint32, blocks)
	p := make([]byte, 1<<20)
	for off := int64(0); off < blocks*4096; off += int64(len(p)) {
		if err := c2.ReadAt(p, off); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < len(p); i += 4096 {
			b := (off + int64(i)) / 4096
			blk := p[i : i+4096]
			if allZero(blk) {
				got[b] = 0
				continue
			}
			if !bytes.Equal(blk, stamp(b, binary.LittleEndian.Uint32(blk[8:]))) {
				t.Fatalf("block %d holds no write's stamp", b)
			}
			got[b] = binary.LittleEndian.Uint32(blk[8:])
		}
	}
	match := -1
	for e := len(states) - 1; e >= 0; e-- {
		if slices.Equal(got, states[e]) {
			match = e
			break
		}
	}
	if match < 0 {
		// Name the first block that differs from the nearest state.
		best, bestDiff := 0, blocks+1
		for e, s := range states {
			n := 0
			for b := range s {
				if s[b] != got[b] {
					n++
				}
			}
			if n < bestDiff {
				best, bestDiff = e, n
			}
		}
		t.Fatalf("the image after the cache loss is no flush's state: nearest is flush %d, %d blocks differ", best, bestDiff)
	}
	t.Logf("the image is the state after flush %d of %d (seed %d)", match, epochs, seed)
	if err := ks2.stop(); err != nil {
		t.Fatal(err)
	}
}

func allZero(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}

// TestObjStoreFioVerifyModes runs fio verify through a cache set whose
// backing device is an object-store image on versitygw, in every cache
// mode: two jobs write 6 MiB each of random 4..64 KiB blocks with crc32c
// headers and read them back, through an 8 MiB cache (writeback, eviction
// and misses to the image run during the pass); then a restarted server
// (the image's lease taken from the stopped one) verifies everything
// again.
func TestObjStoreFioVerifyModes(t *testing.T) {
	need(t, "fio")
	startObjStore(t)
	for _, mode := range []string{"writeback", "writethrough", "writearound", "none"} {
		t.Run(mode, func(t *testing.T) {
			uri := "s3://images/fio-" + mode
			run(t, time.Minute, bin, "image", "create", uri, "--size", "128M")
			dir := t.TempDir()
			cachePath := sparseFile(t, dir, "cache.img", 8*mib)
			run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", mode, "--bucket-size", "256K")
			s := startServer(t, "--cache", cachePath, "--data-dir", dir)
			fioVerify(t, s.uri("vol"), 2, "6m", "--do_verify=1")
			s.stop()
			s2 := startServer(t, "--cache", cachePath, "--data-dir", dir)
			fioVerify(t, s2.uri("vol"), 2, "6m", "--verify_only=1")
			s2.stop()
		})
	}
}

// TestObjStoreOutageAbsorbed cuts the link to the store (every request
// answered 503 by s3test.Proxy) under a served writeback set: writes and
// flushes go on, acknowledged by the cache; once the store is back, detach
// writes everything back and the image alone holds what was written.
func TestObjStoreOutageAbsorbed(t *testing.T) {
	srv := startObjStore(t)
	proxy := s3test.NewProxy(t, srv)
	t.Setenv("AWS_ENDPOINT_URL", proxy.Endpoint())
	const uri = "s3://images/outage"
	run(t, time.Minute, bin, "image", "create", uri, "--size", "64M")
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 32*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	s := startServer(t, "--cache", cachePath, "--data-dir", dir)
	admin := filepath.Join(dir, "admin.sock")
	run(t, time.Minute, bin, "set", "--admin", admin, "vol", "writeback_percent=0")
	proxy.CutAfter(0)
	ctx := context.Background()
	c, err := nbd.Dial(ctx, "unix", s.sock, "vol", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i*7) ^ byte(i>>12)
	}
	for off := 0; off < len(want); off += 256 << 10 {
		if err := c.WriteAt(want[off:off+256<<10], int64(off), false); err != nil {
			t.Fatalf("write during the outage: %v", err)
		}
		if err := c.Flush(); err != nil {
			t.Fatalf("flush during the outage: %v\n%s", err, s.log)
		}
		if off == 0 {
			// From here on the server knows the store is away: the rest
			// of the stream (sequential, past sequential_cutoff with
			// writeback_percent=0) is absorbed instead of bypassing.
			waitFor(t, 2*time.Minute, func() bool {
				return strings.Contains(s.log.String(), "writeback to the backing device failing")
			}, "writeback failing during the outage")
		}
	}
	got := make([]byte, len(want))
	if err := c.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read during the outage: %v (equal %v)", err, bytes.Equal(got, want))
	}
	c.Close()
	t.Logf("during the outage: %v", proxy.Counts())
	proxy.CutAfter(-1)
	out := run(t, 5*time.Minute, bin, "detach", "--admin", admin, "vol")
	if !strings.Contains(out, "is detached") {
		t.Fatalf("detach after the outage:\n%s", out)
	}
	s.stop()
	l, err := objstore.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	d, err := objstore.Open(l.WithEnv(), objstore.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the image after the outage: %v (equal %v)", err, bytes.Equal(got, want))
	}
}

// TestObjStoreServeRace starts two servers at once, each with its own cache
// set formatted over the same image: exactly one takes the image's lease and
// serves; the other exits with an error naming the winner's host and pid.
// A third cache set formatted over the image while the winner serves is
// formatted (format opens the image read-only and takes no lease).
//
// The second set used to be formatted while the first server was
// starting: 2 runs of 20 failed in format with "get .../head: objstore:
// precondition failed", the head read as a HEAD then a GET with If-Match
// while the server fenced it in between (device/objstore
// TestReadDuringUpdate has that interleaving deterministically).
func TestObjStoreServeRace(t *testing.T) {
	startObjStore(t)
	const uri = "s3://images/race"
	run(t, time.Minute, bin, "image", "create", uri, "--size", "64M")
	type contender struct {
		dir, cache string
		cmd        *exec.Cmd
		out        *syncBuffer
		done       <-chan error
	}
	var cs [2]contender
	for i := range cs {
		cs[i].dir = shortDir(t)
		cs[i].cache = sparseFile(t, cs[i].dir, "cache.img", 16*mib)
		run(t, time.Minute, bin, "format", "--cache", cs[i].cache, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	}
	for i := range cs {
		cs[i].cmd, cs[i].out, cs[i].done = background(t, bin, "serve", "--cache", cs[i].cache, "--data-dir", cs[i].dir,
			"--listen", "unix:"+filepath.Join(cs[i].dir, "nbd.sock"))
	}
	// Each one either serves or exits.
	exited := [2]error{}
	serving := 0
	for i := range cs {
		waitFor(t, time.Minute, func() bool {
			select {
			case err := <-cs[i].done:
				exited[i] = err
				if err == nil {
					exited[i] = errors.New("exit status 0")
				}
				return true
			default:
				return strings.Contains(cs[i].out.String(), "msg=serving")
			}
		}, "a contender to serve or exit")
		if exited[i] == nil {
			serving++
		}
	}
	if serving != 1 {
		t.Fatalf("%d of 2 servers serve the image, want exactly 1:\n%s\n---\n%s", serving, cs[0].out, cs[1].out)
	}
	third := sparseFile(t, shortDir(t), "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", third, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	for i := range cs {
		if exited[i] == nil {
			if want := fmt.Sprintf("%s is owned by ", uri); !strings.Contains(cs[1-i].out.String(), want) ||
				!strings.Contains(cs[1-i].out.String(), fmt.Sprintf(" pid %d ", cs[i].cmd.Process.Pid)) {
				t.Errorf("the loser does not name the winner (pid %d):\n%s", cs[i].cmd.Process.Pid, cs[1-i].out)
			}
			cs[i].cmd.Process.Signal(syscall.SIGTERM)
			if err := <-cs[i].done; err != nil {
				t.Errorf("the winner exited with %v:\n%s", err, cs[i].out)
			}
			continue
		}
		t.Logf("the loser: %v: %s", exited[i], strings.TrimSpace(cs[i].out.String()))
	}
}
