package crashtest

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tiercache/tiercache/nbd"
)

var (
	flagSeed   = flag.Int64("seed", -1, "seed for TestHarnessFake (default: time-based, logged)")
	flagCycles = flag.Int("cycles", 0, "cycles for TestHarnessFake (default 30)")
)

// memBackend is an export with process-crash semantics at 4 KiB block
// granularity: cur is what reads see, synced what survives a crash for sure.
// A crash keeps each block's cur or its synced contents at random.
type memBackend struct {
	mu     sync.Mutex // guards the fields below
	cur    []byte
	synced []byte
	dead   bool // killed: every call fails and changes nothing

	bug string // "" or a deliberate bug the harness must catch
}

var errDead = errors.New("memBackend: killed")

func (m *memBackend) Size() int64 { return int64(len(m.cur)) }

func (m *memBackend) ReadAt(p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dead {
		return errDead
	}
	copy(p, m.cur[off:])
	return nil
}

func (m *memBackend) WriteAt(p []byte, off int64, fua bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dead {
		return errDead
	}
	copy(m.cur[off:], p)
	if fua {
		copy(m.synced[off:off+int64(len(p))], p)
	}
	return nil
}

func (m *memBackend) Flush() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dead {
		return errDead
	}
	if m.bug != "flush-noop" {
		copy(m.synced, m.cur)
	}
	return nil
}

func (m *memBackend) zero(off, length int64, fua bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dead {
		return errDead
	}
	clear(m.cur[off : off+length])
	if fua {
		clear(m.synced[off : off+length])
	}
	return nil
}

func (m *memBackend) Trim(off, length int64, fua bool) error { return m.zero(off, length, fua) }

func (m *memBackend) WriteZeroes(off, length int64, fua, _, _ bool) error {
	return m.zero(off, length, fua)
}

// crash returns the contents after a crash now, and kills m.
func (m *memBackend) crash(rng *rand.Rand) *memBackend {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dead = true
	n := &memBackend{cur: make([]byte, len(m.cur)), synced: make([]byte, len(m.cur)), bug: m.bug}
	for off := 0; off < len(m.cur); off += BlockSize {
		src := m.synced
		if rng.IntN(2) == 0 {
			src = m.cur
		}
		if m.bug == "stale" && rng.IntN(50) == 0 {
			src = make([]byte, len(m.cur)) // a block reverts to zeroes
		}
		copy(n.cur[off:off+BlockSize], src[off:])
	}
	copy(n.synced, n.cur)
	return n
}

// fakeServer serves a memBackend in-process; Kill drops the connections and
// crash-clones the backend.
type fakeServer struct {
	sock string
	be   *memBackend
	srv  *nbd.Server
	rng  *rand.Rand
}

func (f *fakeServer) Start(ctx context.Context) error {
	os.Remove(f.sock)
	ln, err := net.Listen("unix", f.sock)
	if err != nil {
		return err
	}
	// A listener the last server's Serve took up only after its Shutdown
	// is closed late: it must not unlink the socket this one created.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	f.srv = nbd.NewServer(nbd.Config{})
	if err := f.srv.AddExport(nbd.Export{Name: "x", Backend: f.be}); err != nil {
		ln.Close()
		return err
	}
	go f.srv.Serve(ln)
	return nil
}

func (f *fakeServer) Kill() error {
	f.be = f.be.crash(f.rng)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.srv.Shutdown(ctx) // closes connections at once; the old backend is dead
	return nil
}

// Stop shuts the server down the way tiercache does (drain, flush every
// export) and then crash-clones the backend, which after the flush holds
// everything acknowledged. Bug "stop-noflush" skips that flush. A killAfter
// cuts the stop: a plain Kill.
func (f *fakeServer) Stop(ctx context.Context, killAfter time.Duration) (bool, error) {
	if killAfter > 0 {
		return false, f.Kill()
	}
	if f.be.bug == "stop-noflush" {
		f.be.mu.Lock()
		f.be.bug = "flush-noop"
		f.be.mu.Unlock()
		defer func() { f.be.bug = "stop-noflush" }()
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := f.srv.Shutdown(sctx); err != nil {
		return false, err
	}
	f.be = f.be.crash(f.rng)
	return true, nil
}

// StartAndKill: the fake has no recovery to interrupt; it starts and
// crashes at once.
func (f *fakeServer) StartAndKill(ctx context.Context, _ time.Duration) error {
	if err := f.Start(ctx); err != nil {
		return err
	}
	return f.Kill()
}

func newFake(t *testing.T, blocks int64, seed uint64, bug string) (*fakeServer, func(context.Context) (*nbd.Client, error)) {
	f := &fakeServer{
		sock: filepath.Join(t.TempDir(), "nbd.sock"),
		be:   &memBackend{cur: make([]byte, blocks*BlockSize), synced: make([]byte, blocks*BlockSize), bug: bug},
		rng:  rand.New(rand.NewPCG(seed, 99)),
	}
	t.Cleanup(func() { f.Kill() })
	dial := func(ctx context.Context) (*nbd.Client, error) {
		return nbd.Dial(ctx, "unix", f.sock, "x", nbd.ClientOptions{})
	}
	return f, dial
}

// TestHarnessFake runs the harness against an in-process server whose
// storage has honest crash semantics: it must pass. Replay with
//
//	go test ./internal/crashtest -run TestHarnessFake -seed N -v
func TestHarnessFake(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if *flagSeed >= 0 {
		seed = uint64(*flagSeed)
	}
	cycles := 30
	if *flagCycles > 0 {
		cycles = *flagCycles
	}
	t.Logf("seed %d", seed)
	srv, dial := newFake(t, 512, seed, "")
	st, err := Run(context.Background(), Config{
		Server: srv, Dial: dial, Seed: seed, Cycles: cycles, OpsPerCycle: 100,
		TrimPercent: 3, ZeroPercent: 3, StopPercent: 30,
		Replay: fmt.Sprintf("go test ./internal/crashtest -run TestHarnessFake -seed %d -v", seed),
		Logf:   t.Logf,
	})
	t.Logf("%v", st)
	if err != nil {
		t.Fatal(err)
	}
	if st.Cycles != cycles || st.Writes == 0 || st.Flushes == 0 || st.BlocksVerified == 0 {
		t.Fatalf("run did too little: %v", st)
	}
	if st.CleanStops == 0 {
		t.Fatalf("no clean stop in %d cycles at 30%%: %v", cycles, st)
	}
	if st.FoundMaybeLatest+st.FoundMaybeOlder == 0 {
		t.Fatalf("no unflushed write ever survived a crash: the fake or the harness is wrong: %v", st)
	}
}

// TestHarnessCatchesBugs runs the harness against deliberately broken
// servers: each must be reported as a Failure naming the seed.
func TestHarnessCatchesBugs(t *testing.T) {
	for _, bug := range []string{"flush-noop", "stale", "stop-noflush"} {
		t.Run(bug, func(t *testing.T) {
			srv, dial := newFake(t, 256, 1, bug)
			stops := 0
			if bug == "stop-noflush" {
				// Only stops show it: FLUSH works, so no kill can.
				stops = 50
			}
			st, err := Run(context.Background(), Config{
				Server: srv, Dial: dial, Seed: 1, Cycles: 40, OpsPerCycle: 100, FUAPercent: -1, StopPercent: stops,
			})
			var f *Failure
			if !errors.As(err, &f) {
				t.Fatalf("bug %q not caught (err %v) after %v", bug, err, st)
			}
			if f.Seed != 1 || len(f.OpLog) == 0 {
				t.Fatalf("failure lacks seed or op log: %+v", f)
			}
			t.Logf("caught as expected: %v", f.Err)
		})
	}
}

// TestHarnessCatchesIOError: a read error after the restart is a failure,
// never tolerated.
func TestHarnessCatchesIOError(t *testing.T) {
	srv, dial := newFake(t, 256, 2, "")
	failing := &failingStart{fakeServer: srv}
	_, err := Run(context.Background(), Config{Server: failing, Dial: dial, Seed: 2, Cycles: 3, OpsPerCycle: 50})
	var f *Failure
	if !errors.As(err, &f) {
		t.Fatalf("read error after restart not reported: %v", err)
	}
	t.Logf("caught as expected: %v", f.Err)
}

// failingStart makes the backend fail every call after the first restart.
type failingStart struct {
	*fakeServer
	starts int
}

func (f *failingStart) Start(ctx context.Context) error {
	f.starts++
	if f.starts > 1 {
		f.be = &memBackend{cur: f.be.cur, synced: f.be.synced, dead: true}
	}
	return f.fakeServer.Start(ctx)
}

// TestHarnessFinalScan: data beyond the working area (where the workload
// never wrote) is reported by the final scan.
func TestHarnessFinalScan(t *testing.T) {
	srv, dial := newFake(t, 256, 3, "")
	srv.be.cur[200*BlockSize+7] = 1
	srv.be.synced[200*BlockSize+7] = 1
	_, err := Run(context.Background(), Config{Server: srv, Dial: dial, Seed: 3, Cycles: 2, Blocks: 128, OpsPerCycle: 50})
	var f *Failure
	if !errors.As(err, &f) || !strings.Contains(f.Err.Error(), "beyond the working area") {
		t.Fatalf("stray data beyond the working area not reported: %v", err)
	}
}
