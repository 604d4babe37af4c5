package interop

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/crashtest"
)

// flakyRemote is an nbdkit export over a file with its cache filter in
// writeback mode, so that a SIGKILL loses every write it acknowledged that
// no FLUSH covered. Its methods return errors instead of failing the
// test: they run on the harness's goroutines.
type flakyRemote struct {
	sock  string
	args  []string
	cmd   *exec.Cmd
	done  chan struct{}
	out   *syncBuffer
	kills int
}

func (r *flakyRemote) running() bool { return r.cmd != nil }

func (r *flakyRemote) start() error {
	os.Remove(r.sock)
	r.out = &syncBuffer{}
	cmd := exec.Command(r.args[0], r.args[1:]...)
	cmd.Stdout, cmd.Stderr = r.out, r.out
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	r.cmd, r.done = cmd, done
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("unix", r.sock); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-done:
			r.cmd = nil
			return fmt.Errorf("nbdkit exited: %s", r.out)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nbdkit did not listen on %s", r.sock)
		}
	}
}

// kill sends SIGKILL to nbdkit (our child, by pid) and waits for it.
func (r *flakyRemote) kill() {
	if r.cmd == nil {
		return
	}
	r.cmd.Process.Kill()
	<-r.done
	r.cmd = nil
	r.kills++
}

// remoteKillServer is a crashtest.Server for a cache set whose backing
// device is a flakyRemote: besides tiercache's SIGKILL, the remote is
// SIGKILLed (losing its unflushed writes) and restarted at a random moment
// of about half the cycles while the clients write, and killed with
// tiercache at the end of about half of them.
type remoteKillServer struct {
	*killableServer
	remote *flakyRemote
	rng    *rand.Rand

	chaos   chan struct{} // closed to stop the current cycle's remote killer
	chaosWG sync.WaitGroup
	errMu   sync.Mutex
	err     error      // a restart of the remote that failed
	midKill int        // remote kills while tiercache was running
	events  syncBuffer // remote kills and tiercache's remote link log lines, for a failure's report
}

func (s *remoteKillServer) Start(ctx context.Context) error {
	if err := s.startRemote(); err != nil {
		return err
	}
	if err := s.killableServer.Start(ctx); err != nil {
		return err
	}
	s.chaos = make(chan struct{})
	if s.rng.IntN(2) == 0 {
		delay := time.Duration(20+s.rng.IntN(400)) * time.Millisecond
		down := time.Duration(s.rng.IntN(100)) * time.Millisecond
		s.chaosWG.Add(1)
		go func(stop chan struct{}) {
			defer s.chaosWG.Done()
			select {
			case <-stop:
				return
			case <-time.After(delay):
			}
			s.remote.kill()
			s.midKill++
			fmt.Fprintf(&s.events, "%s remote killed while tiercache runs, restarting in %v\n", time.Now().Format("15:04:05.000"), down)
			time.Sleep(down)
			if err := s.remote.start(); err != nil {
				s.errMu.Lock()
				s.err = err
				s.errMu.Unlock()
			}
		}(s.chaos)
	}
	return nil
}

func (s *remoteKillServer) startRemote() error {
	s.errMu.Lock()
	err := s.err
	s.errMu.Unlock()
	if err != nil {
		return err
	}
	if s.remote.running() {
		return nil
	}
	return s.remote.start()
}

func (s *remoteKillServer) StartAndKill(ctx context.Context, delay time.Duration) error {
	if err := s.startRemote(); err != nil {
		return err
	}
	return s.killableServer.StartAndKill(ctx, delay)
}

func (s *remoteKillServer) Kill() error {
	if s.chaos != nil {
		close(s.chaos)
		s.chaosWG.Wait()
		s.chaos = nil
	}
	err := s.killableServer.Kill()
	for _, l := range strings.Split(s.log.String(), "\n") {
		if strings.Contains(l, "nbd backing") || strings.Contains(l, "backing device sync") {
			fmt.Fprintln(&s.events, l)
		}
	}
	fmt.Fprintf(&s.events, "%s tiercache killed\n", time.Now().Format("15:04:05.000"))
	if s.rng.IntN(2) == 0 {
		s.remote.kill()
		fmt.Fprintf(&s.events, "%s remote killed with it\n", time.Now().Format("15:04:05.000"))
	}
	return err
}

// TestKillCyclesRemote is TestKillCycles with a remote backing device: the
// set's backing device is an nbdkit export (nbd+unix URI) that loses
// every acknowledged write no FLUSH covered when it is killed. Each cycle
// SIGKILLs tiercache at a random moment while four clients write stamped
// blocks, as TestKillCycles does; in about half the cycles the remote is
// also SIGKILLed and restarted while the clients run, and in about half
// it is killed together with tiercache. After every restart every block
// ever written is checked against the three-state oracle: nothing a FLUSH
// (or a FUA write) covered is lost, nothing else appears, no read fails.
// Writeback and writethrough, a fifth of TestKillCycles's cycles each (10
// by default).
//
// Replay a failure with the seed it logs:
//
//	go test ./internal/interop -run 'TestKillCyclesRemote/writeback' -seed N -v
func TestKillCyclesRemote(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	need(t, "nbdkit")
	seed, cycles := crashConfig(t)
	cycles = max(cycles/5, 2)
	t.Logf("seed %d, %d cycles per mode", seed, cycles)
	for i, mode := range []string{"writeback", "writethrough"} {
		t.Run(mode, func(t *testing.T) {
			seed := seed + 100 + uint64(i)
			dir := shortDir(t)
			img := sparseFile(t, dir, "remote.img", 64*mib)
			rsock := filepath.Join(dir, "r.sock")
			remote := &flakyRemote{sock: rsock, args: []string{"nbdkit", "-f", "--exit-with-parent", "-U", rsock,
				"--filter=exportname", "--filter=cache", "file", img, "cache=writeback", "exportdesc=fixed:crash-" + mode}}
			if err := remote.start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(remote.kill)
			uri := "nbd+unix:///?socket=" + rsock
			cachePath := sparseFile(t, dir, "cache.img", 16*mib)
			run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", mode, "--bucket-size", "256K")
			srv := &remoteKillServer{
				killableServer: newKillableServer(t, "--cache", cachePath, "--remote-timeout", "1m"),
				remote:         remote,
				rng:            rand.New(rand.NewPCG(seed, 0x4e6d)),
			}
			start := time.Now()
			st, err := crashtest.Run(context.Background(), crashtest.Config{
				Server:         srv,
				Dial:           srv.dial("vol"),
				Seed:           seed,
				Cycles:         cycles,
				Conns:          4,
				Blocks:         24 * mib / crashtest.BlockSize,
				OpsPerCycle:    150,
				MaxWriteBlocks: 16,
				// No trims: NBD leaves a trimmed block's contents
				// unspecified, and nbdkit's cache filter keeps serving
				// the old data until it is killed, then zeroes, which the
				// oracle's "zeroes or the old data, stable" rejects.
				ZeroPercent: 2,
				Replay:      fmt.Sprintf("go test ./internal/interop -run 'TestKillCyclesRemote/%s$' -seed %d -cycles %d -v", mode, seed-100-uint64(i), cycles*5),
				Logf:        t.Logf,
				LogTail:     2000,
			})
			if srv.chaos != nil {
				close(srv.chaos)
				srv.chaosWG.Wait()
			}
			t.Logf("%s: %v in %v; server: %s; remote killed %d times (%d while tiercache ran)", mode, st, time.Since(start).Round(time.Millisecond),
				srv.recoveryStats(), remote.kills, srv.midKill)
			if err == nil {
				srv.errMu.Lock()
				err = srv.err
				srv.errMu.Unlock()
			}
			if err != nil {
				log := ""
				if srv.log != nil {
					log = srv.log.String()
					if len(log) > 8000 {
						log = "...\n" + log[len(log)-8000:]
					}
				}
				t.Fatalf("%v\nserver log (current process):\n%s\nremote events:\n%s", err, log, &srv.events)
			}
			if srv.midKill == 0 {
				t.Errorf("the remote was never killed while tiercache ran: the test tested nothing remote")
			}
			if err := srv.stop(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
