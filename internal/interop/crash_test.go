package interop

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/nbd"
)

var (
	crashSeed   = flag.Int64("seed", -1, "seed for TestKillCycles (default: TIERCACHE_CRASH_SEED, else time-based; always logged)")
	crashCycles = flag.Int("cycles", 0, "writeback kill cycles for TestKillCycles (default: TIERCACHE_CRASH_CYCLES, else 50)")
)

// crashConfig resolves the seed and the number of writeback cycles from
// the flags, then the environment (make stress sets TIERCACHE_CRASH_CYCLES).
func crashConfig(t *testing.T) (seed uint64, cycles int) {
	t.Helper()
	seed = uint64(time.Now().UnixNano())
	if s := os.Getenv("TIERCACHE_CRASH_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("TIERCACHE_CRASH_SEED=%q: %v", s, err)
		}
		seed = v
	}
	if *crashSeed >= 0 {
		seed = uint64(*crashSeed)
	}
	cycles = 50
	if s := os.Getenv("TIERCACHE_CRASH_CYCLES"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("TIERCACHE_CRASH_CYCLES=%q: want a positive number", s)
		}
		cycles = v
	}
	if *crashCycles > 0 {
		cycles = *crashCycles
	}
	return seed, cycles
}

// envInt reads a positive integer knob from the environment, or def.
func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil || v <= 0 {
		t.Fatalf("%s=%q: want a positive number", name, s)
	}
	return v
}

// killableServer runs `tiercache serve ARGS --listen unix:SOCK` as a
// crashtest.Server: Start waits until the socket accepts, Kill sends
// SIGKILL and reaps the process. The socket path stays the same across
// restarts (serve replaces a stale socket file).
type killableServer struct {
	t    *testing.T
	args []string
	sock string
	cur  *exec.Cmd
	log  *syncBuffer
	done chan struct{}
	err  error // Wait's result, valid after done is closed
	// env is added to the environment of every start.
	env []string

	// From each start's "cache set open" log line: evidence that kills
	// left dirty data for recovery and writeback.
	starts, dirtyStarts, maxDirty int64
	maxRecovery                   time.Duration
}

var (
	dirtyRE    = regexp.MustCompile(`dirty_blocks=(\d+)`)
	recoveryRE = regexp.MustCompile(`recovery=(\S+)`)
)

// noteStart records the recovery figures the server logged.
func (s *killableServer) noteStart() {
	l := s.log.String()
	s.starts++
	if m := dirtyRE.FindStringSubmatch(l); m != nil {
		if n, _ := strconv.ParseInt(m[1], 10, 64); n > 0 {
			s.dirtyStarts++
			s.maxDirty = max(s.maxDirty, n)
		}
	}
	if m := recoveryRE.FindStringSubmatch(l); m != nil {
		if d, err := time.ParseDuration(m[1]); err == nil {
			s.maxRecovery = max(s.maxRecovery, d)
		}
	}
}

func (s *killableServer) recoveryStats() string {
	return fmt.Sprintf("%d starts, %d of them recovering dirty blocks (at most %d), longest recovery %v",
		s.starts, s.dirtyStarts, s.maxDirty, s.maxRecovery)
}

func newKillableServer(t *testing.T, args ...string) *killableServer {
	// Its own data directory: the admin socket (DATA_DIR/admin.sock) is
	// then per server, so concurrent test runs do not share it, and every
	// restart after SIGKILL finds its own stale socket to replace.
	dir := t.TempDir()
	args = append([]string{"--data-dir", dir}, args...)
	s := &killableServer{t: t, args: args, sock: filepath.Join(dir, "nbd.sock")}
	t.Cleanup(func() {
		if s.cur != nil {
			s.Kill()
		}
	})
	return s
}

func (s *killableServer) Start(ctx context.Context) error {
	if s.cur != nil {
		return errors.New("server already running")
	}
	cmd, done, err := s.spawn()
	if err != nil {
		return err
	}
	s.cur = cmd
	deadline := time.Now().Add(60 * time.Second)
	for {
		// Ready once its log says "serving" (the socket queues connections
		// before the cache set is open and before SIGTERM is handled).
		if strings.Contains(s.log.String(), "msg=serving") {
			c, err := net.Dial("unix", s.sock)
			if err == nil {
				c.Close()
				s.noteStart()
				return nil
			}
		}
		select {
		case <-done:
			s.cur = nil
			return fmt.Errorf("tiercache exited before listening: %v\n%s", s.err, s.log)
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("tiercache did not listen on %s within 60s\n%s", s.sock, s.log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// spawn starts `tiercache serve` with a fresh log; done closes when it has
// exited (s.err is then Wait's result).
func (s *killableServer) spawn() (*exec.Cmd, chan struct{}, error) {
	s.log = &syncBuffer{}
	done := make(chan struct{})
	s.done = done
	cmd := exec.Command(bin, append([]string{"serve", "--listen", "unix:" + s.sock}, s.args...)...)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	cmd.Env = append(append(os.Environ(), s.env...), "GORACE=halt_on_error=1")
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	go func() { s.err = cmd.Wait(); close(done) }()
	return cmd, done, nil
}

// StartAndKill starts the server and SIGKILLs it after delay, listening or
// not: a crash during recovery (crashtest.StartKiller).
func (s *killableServer) StartAndKill(ctx context.Context, delay time.Duration) error {
	if s.cur != nil {
		return errors.New("server already running")
	}
	cmd, done, err := s.spawn()
	if err != nil {
		return err
	}
	select {
	case <-done:
		return fmt.Errorf("tiercache exited by itself %v into its start: %v\n%s", delay, s.err, s.log)
	case <-time.After(delay):
	}
	cmd.Process.Signal(syscall.SIGKILL)
	<-done
	return s.checkLog()
}

// Kill sends SIGKILL. It fails if the process had already exited (it died
// on its own) or its log shows a race or a panic.
func (s *killableServer) Kill() error {
	if s.cur == nil {
		return errors.New("server not running")
	}
	cmd := s.cur
	s.cur = nil
	select {
	case <-s.done:
		return fmt.Errorf("tiercache had exited by itself before the kill: %v\n%s", s.err, s.log)
	default:
	}
	cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	return s.checkLog()
}

func (s *killableServer) checkLog() error {
	if l := s.log.String(); strings.Contains(l, "WARNING: DATA RACE") || strings.Contains(l, "panic:") {
		return fmt.Errorf("tiercache log shows a race or panic:\n%s", l)
	}
	return nil
}

// stop ends the server with SIGTERM and requires exit status 0: a clean
// shutdown after many crashes.
func (s *killableServer) stop() error {
	if s.cur == nil {
		return nil
	}
	s.cur.Process.Signal(syscall.SIGTERM)
	s.cur = nil
	select {
	case <-s.done:
	case <-time.After(60 * time.Second):
		return fmt.Errorf("tiercache did not stop within 60s of SIGTERM\n%s", s.log)
	}
	if s.err != nil {
		return fmt.Errorf("tiercache exited with %v after SIGTERM\n%s", s.err, s.log)
	}
	return s.checkLog()
}

func (s *killableServer) dial(export string) func(context.Context) (*nbd.Client, error) {
	return func(ctx context.Context) (*nbd.Client, error) {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return nbd.Dial(ctx, "unix", s.sock, export, nbd.ClientOptions{})
	}
}

// TestKillCycles kills the race-built tiercache server with SIGKILL at
// random moments while four nbd.Client connections write stamped blocks
// (4..64 KiB, some FUA, periodic FLUSH, some trims and write-zeroes),
// restarts it and checks every block ever written against a three-state
// oracle (internal/crashtest): a block holds its durable contents or one
// written since, never anything else, never an I/O error (invariants 1 and
// 2 across process crashes). The cache set is 16 MiB of 256 KiB buckets in
// front of a 64 MiB backing file, and the workload touches 24 MiB of it, so
// writeback and eviction run throughout. Writeback mode gets 50 cycles (more
// with TIERCACHE_CRASH_CYCLES, as make stress does), each other mode and a
// plain uncached export a fifth of that.
//
// TIERCACHE_CRASH_AREA_MIB (default 24, at most 64), TIERCACHE_CRASH_OPS
// (mean operations per cycle, default 150) and TIERCACHE_CRASH_MAX_BLOCKS
// (largest write in 4 KiB blocks, default 16) vary the set-up for
// exploration; a failure's replay line needs the same values.
//
// The "modeswitch" case (a fifth of the cycles, starting in writeback)
// also switches the export's cache mode through the admin API (`tiercache
// set vol cache_mode=...`) every 2-60 ms while the clients run, so kills
// land in the middle of mode switches (a switch to none drains first).
//
// The "lifecycle" case (a fifth of the cycles) ends cycles in admin
// flushes and checks, TLS and NBD handshakes, listener set-up and graceful
// stops (SIGTERM, some cut by a SIGKILL): see lifecycleServer.
//
// Replay a failure with the seed it logs:
//
//	go test ./internal/interop -run 'TestKillCycles/writeback' -seed N -v
func TestKillCycles(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	seed, cycles := crashConfig(t)
	// Exploration knobs (defaults are the CI set-up).
	areaMiB := envInt(t, "TIERCACHE_CRASH_AREA_MIB", 24)
	ops := envInt(t, "TIERCACHE_CRASH_OPS", 150)
	maxBlocks := envInt(t, "TIERCACHE_CRASH_MAX_BLOCKS", 16)
	if areaMiB > 64 {
		t.Fatalf("TIERCACHE_CRASH_AREA_MIB=%d: the backing file is 64 MiB", areaMiB)
	}
	t.Logf("seed %d, %d writeback cycles, %d MiB area, ~%d ops per cycle, writes up to %d KiB", seed, cycles, areaMiB, ops, maxBlocks*4)
	cases := []struct {
		name   string
		cycles int
	}{
		{"writeback", cycles},
		{"writethrough", max(cycles/5, 2)},
		{"writearound", max(cycles/5, 2)},
		{"none", max(cycles/5, 2)},
		{"plain", max(cycles/5, 2)},
		{"modeswitch", max(cycles/5, 2)},
		{"lifecycle", max(cycles/5, 2)},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seed := seed + uint64(i)
			var args []string
			export := "vol"
			if c.name == "plain" {
				p := sparseFile(t, t.TempDir(), "plain.img", 64*mib)
				args = []string{"--export", "vol=" + p}
			} else {
				mode := c.name
				if mode == "modeswitch" || mode == "lifecycle" {
					mode = "writeback"
				}
				cs := formatSet(t, 16*mib, 64*mib, []string{export}, "--mode", mode, "--bucket-size", "256K")
				args = []string{"--cache", cs.cache}
			}
			var cachePath, tcpAddr, pki string
			if c.name == "lifecycle" {
				need(t, "nbdinfo")
				cachePath = args[1]
				pki = filepath.Join(t.TempDir(), "pki")
				os.Mkdir(pki, 0o700)
				writePKI(t, pki)
				tcpAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
				// TLS offered, not required (no --tls-client-ca, which
				// implies --tls-required): the workload also runs plain on
				// the unix socket. The TCP clients still present their
				// client certificates.
				args = append(args, "--listen", "tcp:"+tcpAddr,
					"--tls-cert", filepath.Join(pki, "server-cert.pem"), "--tls-key", filepath.Join(pki, "server-key.pem"))
			}
			srv := newKillableServer(t, args...)
			var server crashtest.Server = srv
			dial := srv.dial(export)
			stopPercent := 0
			var ms *modeSwitcher
			var lc *lifecycleServer
			switch c.name {
			case "modeswitch":
				ms = &modeSwitcher{killableServer: srv, export: export, rng: rand.New(rand.NewPCG(seed, 0x5e7))}
				server = ms
			case "lifecycle":
				var err error
				if lc, err = newLifecycleServer(t, srv, cachePath, tcpAddr, pki, seed); err != nil {
					t.Fatal(err)
				}
				server, dial, stopPercent = lc, lc.dial, 50
			}
			start := time.Now()
			st, err := crashtest.Run(context.Background(), crashtest.Config{
				Server:         server,
				Dial:           dial,
				StopPercent:    stopPercent,
				Seed:           seed,
				Cycles:         c.cycles,
				Conns:          4,
				Blocks:         int64(areaMiB) * mib / crashtest.BlockSize,
				OpsPerCycle:    ops,
				MaxWriteBlocks: maxBlocks,
				TrimPercent:    2,
				ZeroPercent:    2,
				Replay: fmt.Sprintf("TIERCACHE_CRASH_AREA_MIB=%d TIERCACHE_CRASH_OPS=%d TIERCACHE_CRASH_MAX_BLOCKS=%d go test ./internal/interop -run 'TestKillCycles/%s$' -seed %d -cycles %d -v",
					areaMiB, ops, maxBlocks, c.name, seed-uint64(i), cycles),
				Logf: t.Logf,
			})
			t.Logf("%s: %v in %v; server: %s", c.name, st, time.Since(start).Round(time.Millisecond), srv.recoveryStats())
			if lc != nil {
				t.Logf("lifecycle: %s", lc.summary())
			}
			if ms != nil {
				t.Logf("modeswitch: %d mode switches succeeded, %d failed because of the kill; %d were still running when the kill was ordered", ms.ok, ms.cut, ms.late)
				if ms.ok == 0 {
					t.Errorf("no mode switch completed: the case tests nothing")
				}
			}
			if err != nil {
				if lc != nil {
					lc.abandon() // no goroutine may report after the test
				}
				log := ""
				if srv.log != nil {
					log = srv.log.String()
					if len(log) > 8000 {
						log = "...\n" + log[len(log)-8000:]
					}
				}
				t.Fatalf("%v\nserver log (current process):\n%s", err, log)
			}
			if ms != nil {
				ms.halt()
			}
			stop := srv.stop
			if lc != nil {
				stop = func() error { return lc.end(srv.stop) }
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestKillCyclesFio proves flushed fio data survives SIGKILL. Each round
// writes a fresh 12 MiB region with fio's nbd engine (verify=crc32c
// headers, a FLUSH every 16 writes via --fsync and one at the end via
// --end_fsync) and lets it complete, then flushes once more with qemu-io
// (see below why fio's own FLUSHes are not enough); then a second fio job writes an
// unrelated region without flushes while the server is killed with
// SIGKILL. After a restart, fio --verify_only checks every region written
// by the completed rounds so far. Only completed, flushed passes are
// claimed: fio's verify state of a killed job does not say which writes a
// FLUSH covered, so the killed job's own region is not verified here
// (TestKillCycles covers unflushed and partially flushed data).
func TestKillCyclesFio(t *testing.T) {
	need(t, "fio", "qemu-io")
	seed, _ := crashConfig(t)
	rng := rand.New(rand.NewPCG(seed, 0xf10))
	t.Logf("seed %d", seed)
	cs := formatSet(t, 16*mib, 64*mib, []string{"vol"}, "--mode", "writeback", "--bucket-size", "256K")
	srv := newKillableServer(t, "--cache", cs.cache)
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	uri := fmt.Sprintf("nbd+unix:///vol?socket=%s", srv.sock)
	region := func(i int, extra ...string) []string {
		return append([]string{
			"--name=flushed", "--ioengine=nbd", "--uri=" + uri,
			"--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16",
			fmt.Sprintf("--offset=%dm", 12*i), "--size=12m", fmt.Sprintf("--randseed=%d", 1000+i),
			"--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json",
		}, extra...)
	}
	const rounds = 3
	for i := 0; i < rounds; i++ {
		out := run(t, 5*time.Minute, "fio", region(i, "--do_verify=0", "--fsync=16", "--end_fsync=1")...)
		checkFio(t, out)
		if n := fioSyncs(t, out); n == 0 {
			t.Fatalf("round %d: fio sent no FLUSH (sync total_ios 0); the test would prove nothing:\n%s", i, out)
		}
		// fio's last FLUSH does not cover all of its writes: it can be sent
		// while the last writes are still in flight, and NBD promises only
		// writes completed before the FLUSH was sent (seen: writes handled
		// 70 ms after the server answered fio's last FLUSH). All of fio's
		// writes have completed now; one FLUSH from another client covers
		// them (the export advertises CAN_MULTI_CONN).
		run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "flush", uri)
		// Unflushed writes to [48 MiB, 64 MiB) while the server dies.
		ctx, cancel := context.WithCancel(context.Background())
		// --thread: fio's job processes call setsid, so killing fio alone
		// would leave the writer running into the next server.
		noise := exec.CommandContext(ctx, "fio", "--thread", "--name=noise", "--ioengine=nbd", "--uri="+uri,
			"--rw=randwrite", "--bsrange=4k-64k", "--iodepth=32", "--offset=48m", "--size=16m",
			"--time_based", "--runtime=60s")
		if err := noise.Start(); err != nil {
			cancel()
			t.Fatal(err)
		}
		time.Sleep(time.Duration(200+rng.IntN(800)) * time.Millisecond)
		if err := srv.Kill(); err != nil {
			cancel()
			t.Fatal(err)
		}
		cancel() // fio may still be noticing; its result does not matter
		noise.Wait()
		if err := srv.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		for j := 0; j <= i; j++ {
			out, err := runErr(5*time.Minute, "fio", region(j, "--verify_only=1")...)
			if err != nil {
				t.Fatalf("round %d: flushed fio region %d does not verify after SIGKILL: %v\n%s\nserver log:\n%s", i, j, err, out, srv.log)
			}
			checkFio(t, out)
		}
		t.Logf("round %d: killed during unflushed writes; regions 0..%d verify", i, i)
	}
	if err := srv.stop(); err != nil {
		t.Fatal(err)
	}
}

// fioSyncs returns how many syncs (NBD FLUSH requests with the nbd engine)
// fio's JSON output reports.
func fioSyncs(t *testing.T, out string) int64 {
	t.Helper()
	i := strings.Index(out, "{")
	if i < 0 {
		t.Fatalf("fio printed no JSON:\n%s", out)
	}
	var r struct {
		Jobs []struct {
			Sync struct {
				TotalIOs int64 `json:"total_ios"`
			} `json:"sync"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal([]byte(out[i:]), &r); err != nil {
		t.Fatalf("fio JSON: %v\n%s", err, out)
	}
	var n int64
	for _, j := range r.Jobs {
		n += j.Sync.TotalIOs
	}
	return n
}

// modeSwitcher is a killableServer whose export's cache mode is switched
// through the admin API (PUT settings, as `tiercache set` does) every
// 10-150 ms while it runs, so SIGKILLs land during mode switches.
type modeSwitcher struct {
	*killableServer
	export string
	rng    *rand.Rand
	stop   chan struct{}
	done   chan struct{}
	// switches that succeeded, failed because of the kill, and were still
	// running when the kill was ordered
	ok, cut, late int
	mu            sync.Mutex // guards ok, cut, late
}

func (m *modeSwitcher) Start(ctx context.Context) error {
	if err := m.killableServer.Start(ctx); err != nil {
		return err
	}
	m.stop, m.done = make(chan struct{}), make(chan struct{})
	// The admin API itself (what `tiercache set` calls): spawning the
	// race-built CLI takes about a second, longer than a kill cycle.
	ac := admin.NewClient(filepath.Join(m.args[1], "admin.sock")) // newKillableServer's --data-dir
	// The admin API listens just after the NBD socket Start waited for.
	if err := ac.Wait(ctx, 30*time.Second); err != nil {
		return fmt.Errorf("admin API: %w", err)
	}
	seed := m.rng.Uint64()
	go func() {
		defer close(m.done)
		rng := rand.New(rand.NewPCG(seed, 1))
		for {
			select {
			case <-m.stop:
				return
			case <-time.After(time.Duration(2+rng.IntN(58)) * time.Millisecond):
			}
			mode := []string{"writeback", "writethrough", "writearound", "none"}[rng.IntN(4)]
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			_, err := ac.SetSettings(ctx, m.export, map[string]string{"cache_mode": mode})
			cancel()
			stopped := false
			select {
			case <-m.stop:
				stopped = true
			default:
			}
			m.mu.Lock()
			switch {
			case err == nil:
				m.ok++
			case stopped:
				m.cut++ // the kill cut it short
			}
			if stopped {
				m.late++ // still running when the kill was ordered
			}
			m.mu.Unlock()
			if stopped {
				return
			}
			if err != nil {
				m.t.Errorf("admin API: setting %s cache_mode=%s on a running server: %v", m.export, mode, err)
				return
			}
		}
	}()
	return nil
}

// Kill kills the server with a switch possibly in flight: the switcher is
// told to stop first (a `tiercache set` already running is not
// interrupted, so the kill lands in it), then waited for.
func (m *modeSwitcher) Kill() error {
	if m.stop != nil {
		close(m.stop)
	}
	err := m.killableServer.Kill()
	m.halt()
	return err
}

// halt stops the switcher and waits for it.
func (m *modeSwitcher) halt() {
	if m.stop == nil {
		return
	}
	select {
	case <-m.stop:
	default:
		close(m.stop)
	}
	<-m.done
	m.stop = nil
}
