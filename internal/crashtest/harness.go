package crashtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/nbd"
)

// Server is the process under test. Start starts it (or restarts it after
// Kill) and returns once it accepts connections. Kill ends it the hard way
// (SIGKILL for a process) and returns once it is gone: no reply can be sent
// and no write can reach storage after Kill returns.
type Server interface {
	Start(ctx context.Context) error
	Kill() error
}

// StartKiller is optionally implemented by a Server that can be killed
// while it starts, before it accepts connections (for tiercache: while it
// replays the journal and recovers the index).
type StartKiller interface {
	// StartAndKill starts the server and kills it after delay, listening
	// or not by then, and returns once it is gone.
	StartAndKill(ctx context.Context, delay time.Duration) error
}

// Stopper is optionally implemented by a Server that can also be stopped
// gracefully (SIGTERM for tiercache serve: stop taking requests, answer
// those taken in, flush every export, exit 0).
type Stopper interface {
	// Stop asks the server to stop cleanly and returns once it is gone. If
	// killAfter > 0 and it is still running that long after the request,
	// it is killed there (a crash in the middle of the shutdown). clean
	// reports that it exited by itself with success; err reports anything
	// else that is wrong (a failed exit it was not killed into, a hang, a
	// race report).
	Stop(ctx context.Context, killAfter time.Duration) (clean bool, err error)
}

// Config describes one run.
type Config struct {
	// Server is started by Run, killed and restarted every cycle, and left
	// running at the end (the caller stops it, gracefully if it likes).
	Server Server
	// Dial opens a client connection to the export.
	Dial func(ctx context.Context) (*nbd.Client, error)

	// Seed drives the workload and the kill plan. Replay a failure with it.
	Seed uint64
	// Cycles is the number of kill/restart/verify cycles.
	Cycles int
	// Conns is the number of client connections (default 4).
	Conns int
	// Depth is the number of writers per connection, each with one
	// request in flight; the client pipelines them (default 2).
	Depth int
	// Blocks is the working area in 4 KiB blocks from offset 0 (default:
	// the whole export). The export must read as zeroes there at the start.
	Blocks int64
	// MaxWriteBlocks bounds one write, trim or write-zeroes (default 16,
	// i.e. 64 KiB).
	MaxWriteBlocks int
	// OpsPerCycle is the mean number of operations before the kill
	// (default 200; each cycle draws from [1, 2*OpsPerCycle], one cycle in
	// ten from [1, 5] to kill soon after a restart).
	OpsPerCycle int
	// Percentages of operations; the rest are writes. Defaults: 8% flush,
	// 5% read-and-check; FUA is a share of writes (default 10%). Trim and
	// write-zeroes are off unless set. Zero selects the default, a negative
	// value turns the operation off.
	FlushPercent, ReadPercent, TrimPercent, ZeroPercent, FUAPercent int
	// StopPercent is the share of cycles that end with a graceful stop
	// instead of a kill, for a Server that implements Stopper (default 0:
	// none). Half of those stops are cut by a kill 0-1.5x the last clean
	// stop's duration after they were asked for. After a clean stop every
	// acknowledged operation must have survived (Oracle.CleanStop); after a
	// cut one, the crash promises hold.
	StopPercent int
	// HangTimeout fails the run when operations are outstanding and none
	// completes for this long (default 60 s).
	HangTimeout time.Duration
	// Replay is the command that replays this run, printed with failures.
	Replay string
	// Logf, if set, receives one line per cycle.
	Logf func(format string, args ...any)
	// LogTail is how many operation log lines a Failure keeps (default 200).
	LogTail int
}

// Stats counts what a run did.
type Stats struct {
	Cycles                                        int
	Writes, FUAWrites, Flushes, Trims, Zeroes     int64
	LiveReads                                     int64 // blocks checked against invariant 1 between kills
	BytesWritten                                  int64
	BlocksVerified, BytesVerified                 int64 // read back and checked after restarts
	BytesScanned                                  int64 // the whole export, read and checked once at the end
	InFlightAtKill                                int64 // modifying operations without a reply when killed
	KillsDuringWrites, KillsAfterFlush, KillsIdle int
	KillsAfterRestart                             int // second kills right after a restart, before any client I/O
	KillsDuringStart                              int // kills before the restarted server listened (StartKiller)
	CleanStops, StopsCut                          int // graceful stops that ended cleanly / that a kill cut (Stopper)
	// Outcomes of the blocks checked after restarts.
	FoundDurable, FoundMaybeLatest, FoundMaybeOlder int64
}

func (s Stats) String() string {
	stops := ""
	if s.CleanStops+s.StopsCut > 0 {
		stops = fmt.Sprintf(", %d clean stops and %d stops cut by a kill instead", s.CleanStops, s.StopsCut)
	}
	return fmt.Sprintf("%d cycles (kills: %d during writes, %d right after a flush, %d idle; %d more during start, %d right after a restart%s), %d writes (%d FUA), %d flushes, %d trims, %d write-zeroes, %d MiB written, %d blocks / %d MiB verified after restarts (%d durable, %d latest maybe-new, %d older maybe-new), %d ops in flight at kills, %d blocks live-checked, %d MiB scanned at the end",
		s.Cycles, s.KillsDuringWrites, s.KillsAfterFlush, s.KillsIdle, s.KillsDuringStart, s.KillsAfterRestart, stops, s.Writes, s.FUAWrites, s.Flushes, s.Trims, s.Zeroes,
		s.BytesWritten>>20, s.BlocksVerified, s.BytesVerified>>20, s.FoundDurable, s.FoundMaybeLatest, s.FoundMaybeOlder,
		s.InFlightAtKill, s.LiveReads, s.BytesScanned>>20)
}

// Failure is a broken promise (or an error the run could not get past),
// with what is needed to replay it (STYLE example 6).
type Failure struct {
	Seed   uint64
	Cycle  int
	Err    error
	Replay string
	OpLog  []string // the tail, oldest first
}

func (f *Failure) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d cycle %d: %v", f.Seed, f.Cycle, f.Err)
	if f.Replay != "" {
		fmt.Fprintf(&b, "\nreplay: %s", f.Replay)
	}
	fmt.Fprintf(&b, "\nop log (last %d):\n  %s", len(f.OpLog), strings.Join(f.OpLog, "\n  "))
	return b.String()
}

func (f *Failure) Unwrap() error { return f.Err }

// Kill kinds.
const (
	killDuringWrites = iota // while every connection keeps writing
	killAfterFlush          // as soon as a FLUSH reply arrives, others still writing
	killIdle                // after the clients went quiet (background writeback running)
)

var killNames = []string{"during writes", "after flush", "idle"}

// run is the state of one Run.
type run struct {
	cfg       Config
	oracle    *Oracle
	startTime time.Duration // how long the last Start took
	stopTime  time.Duration // how long the last clean Stop took
	st        Stats
	stMu      sync.Mutex // guards st during a cycle's workload

	logMu sync.Mutex // guards the ring below
	ring  []string
	next  int
	full  bool
}

// Run runs cfg.Cycles kill cycles. It returns the counts and, on a broken
// promise, a *Failure.
func Run(ctx context.Context, cfg Config) (Stats, error) {
	if cfg.Server == nil || cfg.Dial == nil {
		return Stats{}, errors.New("crashtest: Config needs Server and Dial")
	}
	if cfg.Conns <= 0 {
		cfg.Conns = 4
	}
	if cfg.Depth <= 0 {
		cfg.Depth = 2
	}
	if cfg.MaxWriteBlocks <= 0 {
		cfg.MaxWriteBlocks = 16
	}
	if cfg.OpsPerCycle <= 0 {
		cfg.OpsPerCycle = 200
	}
	if cfg.FlushPercent == 0 {
		cfg.FlushPercent = 8
	}
	if cfg.ReadPercent == 0 {
		cfg.ReadPercent = 5
	}
	if cfg.FUAPercent == 0 {
		cfg.FUAPercent = 10
	}
	for _, p := range []*int{&cfg.FlushPercent, &cfg.ReadPercent, &cfg.TrimPercent, &cfg.ZeroPercent, &cfg.FUAPercent} {
		*p = max(*p, 0)
	}
	if cfg.HangTimeout <= 0 {
		cfg.HangTimeout = 60 * time.Second
	}
	if cfg.LogTail <= 0 {
		cfg.LogTail = 200
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	r := &run{cfg: cfg, ring: make([]string, cfg.LogTail)}
	if err := r.start(ctx); err != nil {
		return r.st, r.fail(0, fmt.Errorf("starting the server: %w", err))
	}
	c, err := cfg.Dial(ctx)
	if err != nil {
		return r.st, r.fail(0, fmt.Errorf("dial: %w", err))
	}
	size := c.Size()
	multi := c.Flags()&nbd.FlagCanMultiConn != 0
	c.Close()
	if cfg.Blocks <= 0 || cfg.Blocks*BlockSize > size {
		cfg.Blocks = size / BlockSize
		r.cfg.Blocks = cfg.Blocks
	}
	if cfg.Blocks < int64(cfg.MaxWriteBlocks)*2 {
		return r.st, fmt.Errorf("crashtest: working area of %d blocks is too small", cfg.Blocks)
	}
	r.oracle = NewOracle(cfg.Blocks, multi)
	r.logf("run seed %d: %d blocks, %d conns x %d writers, multi-conn %t", cfg.Seed, cfg.Blocks, cfg.Conns, cfg.Depth, multi)
	for cycle := 1; cycle <= cfg.Cycles; cycle++ {
		if err := ctx.Err(); err != nil {
			return r.st, err
		}
		if err := r.cycle(ctx, cycle); err != nil {
			return r.st, err
		}
		r.st.Cycles++
	}
	if err := r.scanAll(ctx, size); err != nil {
		return r.st, r.fail(cfg.Cycles, err)
	}
	return r.st, nil
}

// scanAll reads the whole export once at the end: the working area must
// still match the oracle, and everything beyond it must still be zero (a
// write or writeback sent to the wrong place would show there).
func (r *run) scanAll(ctx context.Context, size int64) error {
	c, err := r.cfg.Dial(ctx)
	if err != nil {
		return fmt.Errorf("dial for the final scan: %w", err)
	}
	defer c.Close()
	buf := make([]byte, 256*BlockSize)
	for off := int64(0); off+BlockSize <= size; off += int64(len(buf)) {
		p := buf[:min(int64(len(buf)), size/BlockSize*BlockSize-off)]
		if err := c.ReadAt(p, off); err != nil {
			return fmt.Errorf("final scan: READ at %d: %w", off, err)
		}
		for i := int64(0); i < int64(len(p))/BlockSize; i++ {
			lba := off/BlockSize + i
			d := Decode(p[i*BlockSize:(i+1)*BlockSize], r.cfg.Seed, uint64(lba))
			if lba < r.cfg.Blocks {
				if _, err := r.oracle.CheckCrash(lba, d); err != nil {
					return fmt.Errorf("final scan: %w", err)
				}
			} else if d.Kind != KindZero {
				return fmt.Errorf("final scan: block %d beyond the working area holds %v; nothing was written there", lba, d)
			}
		}
		r.st.BytesScanned += int64(len(p))
	}
	return nil
}

// start starts the server, remembering how long it took to listen.
func (r *run) start(ctx context.Context) error {
	t0 := time.Now()
	if err := r.cfg.Server.Start(ctx); err != nil {
		return err
	}
	r.startTime = time.Since(t0)
	return nil
}

func (r *run) logf(format string, args ...any) {
	r.logMu.Lock()
	defer r.logMu.Unlock()
	r.ring[r.next] = fmt.Sprintf(format, args...)
	r.next++
	if r.next == len(r.ring) {
		r.next, r.full = 0, true
	}
}

func (r *run) tail() []string {
	r.logMu.Lock()
	defer r.logMu.Unlock()
	if !r.full {
		return append([]string(nil), r.ring[:r.next]...)
	}
	return append(append([]string(nil), r.ring[r.next:]...), r.ring[:r.next]...)
}

func (r *run) fail(cycle int, err error) *Failure {
	var f *Failure
	if errors.As(err, &f) {
		return f
	}
	return &Failure{Seed: r.cfg.Seed, Cycle: cycle, Err: err, Replay: r.cfg.Replay, OpLog: r.tail()}
}

// cycleState is shared by the workers of one cycle.
type cycleState struct {
	cycle   int
	killed  atomic.Bool  // set before Kill: errors from now on are expected
	stop    atomic.Bool  // workers issue nothing more
	issued  atomic.Int64 // operations issued
	done    atomic.Int64 // operations completed (progress, for the hang check)
	pending atomic.Int64 // operations outstanding
	trigger chan struct{}
	trigOne sync.Once
	killAt  int64
	kind    int

	claimMu sync.Mutex // guards busy
	busy    []bool

	errMu sync.Mutex // guards err
	err   error      // the first unexpected error
}

func (cs *cycleState) fire() { cs.trigOne.Do(func() { close(cs.trigger) }) }

func (cs *cycleState) setErr(err error) {
	cs.errMu.Lock()
	if cs.err == nil {
		cs.err = err
	}
	cs.errMu.Unlock()
	cs.stop.Store(true)
	cs.fire()
}

func (cs *cycleState) getErr() error {
	cs.errMu.Lock()
	defer cs.errMu.Unlock()
	return cs.err
}

// claim marks [lba, lba+n) busy, or reports false if part of it is.
func (cs *cycleState) claim(lba, n int64) bool {
	cs.claimMu.Lock()
	defer cs.claimMu.Unlock()
	for b := lba; b < lba+n; b++ {
		if cs.busy[b] {
			return false
		}
	}
	for b := lba; b < lba+n; b++ {
		cs.busy[b] = true
	}
	return true
}

func (cs *cycleState) release(lba, n int64) {
	cs.claimMu.Lock()
	defer cs.claimMu.Unlock()
	for b := lba; b < lba+n; b++ {
		cs.busy[b] = false
	}
}

func (r *run) cycle(ctx context.Context, cycle int) error {
	cfg := &r.cfg
	prng := rand.New(rand.NewPCG(cfg.Seed, uint64(cycle)<<32))
	cs := &cycleState{
		cycle:   cycle,
		trigger: make(chan struct{}),
		killAt:  1 + prng.Int64N(int64(2*cfg.OpsPerCycle)),
		busy:    make([]bool, cfg.Blocks),
	}
	if prng.IntN(10) == 0 {
		// Soon after the restart: recovery's writeback and the first
		// writes after it.
		cs.killAt = 1 + prng.Int64N(5)
	}
	switch k := prng.IntN(10); {
	case k < 5:
		cs.kind = killDuringWrites
	case k < 8:
		cs.kind = killAfterFlush
	default:
		cs.kind = killIdle
	}
	startKill := prng.IntN(10) == 0
	startFrac := prng.Float64() * 1.5
	doubleKill := prng.IntN(10) == 0
	doubleWait := time.Duration(prng.IntN(100)) * time.Millisecond
	idleFlush := prng.IntN(2) == 0
	idleWait := time.Duration(prng.IntN(300)) * time.Millisecond
	// The graceful-stop plan has its own stream, so that the kill plans of
	// runs without stops stay what they were for a given seed.
	srng := rand.New(rand.NewPCG(cfg.Seed, uint64(cycle)<<32|1))
	stopper, _ := cfg.Server.(Stopper)
	stop := stopper != nil && srng.IntN(100) < cfg.StopPercent
	var stopKill time.Duration
	if srng.IntN(2) == 0 {
		// 0 when no stop finished yet: the stop then runs to its end.
		stopKill = time.Duration(float64(r.stopTime) * srng.Float64() * 1.5)
	}
	end := "kill"
	if stop {
		end = "graceful stop"
		if stopKill > 0 {
			end += fmt.Sprintf(" (kill %v into it)", stopKill)
		}
	}
	r.logf("cycle %d: %s %s after %d ops", cycle, end, killNames[cs.kind], cs.killAt)

	clients := make([]*nbd.Client, cfg.Conns)
	for i := range clients {
		c, err := cfg.Dial(ctx)
		if err != nil {
			for _, c := range clients[:i] {
				c.Close()
			}
			return r.fail(cycle, fmt.Errorf("dial connection %d: %w", i, err))
		}
		clients[i] = c
	}
	var wg sync.WaitGroup
	for i, c := range clients {
		for d := range cfg.Depth {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.worker(cs, c, i, rand.New(rand.NewPCG(cfg.Seed^uint64(cycle)<<20, uint64(i*cfg.Depth+d)+1)))
			}()
		}
	}
	workersDone := make(chan struct{})
	go func() { wg.Wait(); close(workersDone) }()

	// Wait for the trigger, watching for hangs.
	if err := r.await(cs, cs.trigger, "workload"); err != nil {
		cs.setErr(err)
	}
	if cs.getErr() == nil && cs.kind == killIdle {
		cs.stop.Store(true)
		if err := r.await(cs, workersDone, "quiescing"); err != nil {
			cs.setErr(err)
		} else {
			if idleFlush {
				tok := r.oracle.FlushStart(0)
				r.logf("c%d conn0 idle flush", cycle)
				if err := clients[0].Flush(); err != nil {
					cs.setErr(fmt.Errorf("idle FLUSH failed before any kill: %w", err))
				} else {
					r.oracle.FlushAck(tok)
					r.count(func(s *Stats) { s.Flushes++ })
				}
			}
			time.Sleep(idleWait)
		}
	}
	if err := cs.getErr(); err != nil {
		cs.killed.Store(true)
		cs.stop.Store(true)
		cfg.Server.Kill()
		for _, c := range clients {
			c.Close()
		}
		<-workersDone
		return r.fail(cycle, err)
	}
	cs.killed.Store(true)
	cs.stop.Store(true)
	inflight := cs.pending.Load()
	clean := false
	if stop {
		r.logf("c%d STOP (%s, %d ops issued, %d in flight)", cycle, killNames[cs.kind], cs.issued.Load(), inflight)
		t0 := time.Now()
		var err error
		clean, err = stopper.Stop(ctx, stopKill)
		if err != nil {
			return r.fail(cycle, fmt.Errorf("graceful stop: %w", err))
		}
		if clean {
			r.stopTime = time.Since(t0)
		}
		r.logf("c%d stopped in %v, clean %t", cycle, time.Since(t0), clean)
	} else {
		r.logf("c%d KILL (%s, %d ops issued, %d in flight)", cycle, killNames[cs.kind], cs.issued.Load(), inflight)
		if err := cfg.Server.Kill(); err != nil {
			return r.fail(cycle, fmt.Errorf("kill: %w", err))
		}
	}
	// A server that stops cleanly answers what it took in and closes the
	// connections itself: the clients are closed only once their
	// operations ended, so that no reply sent is thrown away.
	if !clean {
		for _, c := range clients {
			c.Close()
		}
	}
	select {
	case <-workersDone:
	case <-time.After(cfg.HangTimeout):
		return r.fail(cycle, fmt.Errorf("client operations did not end within %v of the kill or stop", cfg.HangTimeout))
	}
	for _, c := range clients {
		c.Close()
	}
	if err := cs.getErr(); err != nil {
		return r.fail(cycle, err) // an operation failed before the kill
	}
	if clean {
		// Every operation has ended and the server is gone: what was
		// acknowledged is all there is.
		r.oracle.CleanStop()
		r.st.CleanStops++
	} else if stop {
		r.st.StopsCut++
	}
	switch cs.kind {
	case killDuringWrites:
		r.st.KillsDuringWrites++
	case killAfterFlush:
		r.st.KillsAfterFlush++
	default:
		r.st.KillsIdle++
	}
	r.st.InFlightAtKill += inflight

	if sk, ok := cfg.Server.(StartKiller); ok && startKill {
		delay := time.Duration(float64(r.startTime) * startFrac)
		r.logf("c%d KILL during start, %v after exec", cycle, delay)
		if err := sk.StartAndKill(ctx, delay); err != nil {
			return r.fail(cycle, fmt.Errorf("start and kill: %w", err))
		}
		r.st.KillsDuringStart++
	}
	if err := r.start(ctx); err != nil {
		return r.fail(cycle, fmt.Errorf("restart after kill: %w", err))
	}
	if doubleKill {
		// Again, before any client I/O: whatever recovery started (journal
		// replay, writeback of recovered dirty data, checkpoints) is cut.
		time.Sleep(doubleWait)
		r.logf("c%d KILL again %v after the restart", cycle, doubleWait)
		if err := cfg.Server.Kill(); err != nil {
			return r.fail(cycle, fmt.Errorf("second kill: %w", err))
		}
		if err := r.start(ctx); err != nil {
			return r.fail(cycle, fmt.Errorf("restart after the second kill: %w", err))
		}
		r.st.KillsAfterRestart++
	}
	before := r.st
	if err := r.verify(ctx, cs); err != nil {
		return r.fail(cycle, err)
	}
	how := "killed"
	switch {
	case clean:
		how = "stopped cleanly"
	case stop:
		how = fmt.Sprintf("stopped and killed %v into the stop", stopKill)
	}
	cfg.Logf("cycle %d: %s %s after %d ops (%d in flight); verified %d blocks (%d durable, %d latest maybe-new, %d older maybe-new)",
		cycle, how, killNames[cs.kind], cs.issued.Load(), inflight, r.st.BlocksVerified-before.BlocksVerified,
		r.st.FoundDurable-before.FoundDurable, r.st.FoundMaybeLatest-before.FoundMaybeLatest, r.st.FoundMaybeOlder-before.FoundMaybeOlder)
	return nil
}

// await waits for ch, failing when operations are outstanding and none
// completes for HangTimeout.
func (r *run) await(cs *cycleState, ch <-chan struct{}, phase string) error {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	last, since := cs.done.Load(), time.Now()
	for {
		select {
		case <-ch:
			return nil
		case <-tick.C:
		}
		if d := cs.done.Load(); d != last || cs.pending.Load() == 0 {
			last, since = d, time.Now()
			continue
		}
		if time.Since(since) > r.cfg.HangTimeout {
			return fmt.Errorf("hang during %s: %d operations outstanding, none completed for %v", phase, cs.pending.Load(), r.cfg.HangTimeout)
		}
	}
}

func (r *run) count(f func(*Stats)) {
	r.stMu.Lock()
	f(&r.st)
	r.stMu.Unlock()
}

// worker issues operations on one connection until the cycle stops.
func (r *run) worker(cs *cycleState, c *nbd.Client, conn int, rng *rand.Rand) {
	cfg := &r.cfg
	buf := make([]byte, cfg.MaxWriteBlocks*BlockSize)
	for !cs.stop.Load() {
		n := cs.issued.Add(1)
		if n == cs.killAt && cs.kind != killAfterFlush {
			if cs.kind == killIdle {
				cs.stop.Store(true)
			}
			cs.fire()
		}
		k := rng.IntN(100)
		var err error
		switch {
		case k < cfg.FlushPercent:
			err = r.flush(cs, c, conn, n)
		case k < cfg.FlushPercent+cfg.ReadPercent:
			err = r.liveRead(cs, c, conn, rng, buf)
		case k < cfg.FlushPercent+cfg.ReadPercent+cfg.TrimPercent:
			err = r.modify(cs, c, conn, rng, OpTrim, buf)
		case k < cfg.FlushPercent+cfg.ReadPercent+cfg.TrimPercent+cfg.ZeroPercent:
			err = r.modify(cs, c, conn, rng, OpZero, buf)
		default:
			err = r.modify(cs, c, conn, rng, OpWrite, buf)
		}
		if err != nil {
			if !cs.killed.Load() {
				cs.setErr(err)
			}
			return
		}
	}
}

func (r *run) flush(cs *cycleState, c *nbd.Client, conn int, n int64) error {
	tok := r.oracle.FlushStart(conn)
	r.logf("c%d conn%d flush", cs.cycle, conn)
	cs.pending.Add(1)
	err := c.Flush()
	cs.pending.Add(-1)
	if err != nil {
		return fmt.Errorf("FLUSH on conn %d failed before any kill: %w", conn, err)
	}
	cs.done.Add(1)
	r.oracle.FlushAck(tok)
	r.logf("c%d conn%d flush ok", cs.cycle, conn)
	r.count(func(s *Stats) { s.Flushes++ })
	if cs.kind == killAfterFlush && n >= cs.killAt {
		cs.fire()
	}
	return nil
}

// pick draws a range of 1..MaxWriteBlocks blocks, a third of the time in
// the first eighth of the area so that blocks are overwritten often.
func (r *run) pick(rng *rand.Rand) (lba, n int64) {
	n = 1 + rng.Int64N(int64(r.cfg.MaxWriteBlocks))
	area := r.cfg.Blocks
	if rng.IntN(3) == 0 {
		area = max(area/8, 2*int64(r.cfg.MaxWriteBlocks))
	}
	lba = rng.Int64N(area - n + 1)
	return lba, n
}

// claimRange picks and claims a free range; ok false if none was found in a
// few tries (the cycle is crowded).
func (r *run) claimRange(cs *cycleState, rng *rand.Rand) (lba, n int64, ok bool) {
	for range 8 {
		lba, n = r.pick(rng)
		if cs.claim(lba, n) {
			return lba, n, true
		}
	}
	return 0, 0, false
}

func (r *run) modify(cs *cycleState, c *nbd.Client, conn int, rng *rand.Rand, kind OpKind, buf []byte) error {
	lba, n, ok := r.claimRange(cs, rng)
	if !ok {
		return nil
	}
	fua := rng.IntN(100) < r.cfg.FUAPercent
	op, err := r.oracle.Begin(kind, lba, n, conn, fua, cs.cycle)
	if err != nil {
		return err
	}
	r.logf("c%d conn%d issue %v", cs.cycle, conn, op)
	off, length := lba*BlockSize, n*BlockSize
	cs.pending.Add(1)
	switch kind {
	case OpWrite:
		p := buf[:length]
		for i := int64(0); i < n; i++ {
			Stamp(p[i*BlockSize:(i+1)*BlockSize], r.cfg.Seed, uint64(lba+i), op.ID)
		}
		err = c.WriteAt(p, off, fua)
	case OpZero:
		err = c.WriteZeroes(off, length, fua, rng.IntN(2) == 0, false)
	case OpTrim:
		err = c.Trim(off, length, fua)
	}
	cs.pending.Add(-1)
	if err != nil {
		return fmt.Errorf("%v failed before any kill: %w", op, err)
	}
	cs.done.Add(1)
	r.oracle.Ack(op)
	cs.release(lba, n)
	r.logf("c%d conn%d ack w%d", cs.cycle, conn, op.ID)
	r.count(func(s *Stats) {
		switch kind {
		case OpWrite:
			s.Writes++
			s.BytesWritten += length
			if fua {
				s.FUAWrites++
			}
		case OpZero:
			s.Zeroes++
		case OpTrim:
			s.Trims++
		}
	})
	return nil
}

// liveRead reads a claimed range and checks it against the latest
// operations (invariant 1, no crash involved).
func (r *run) liveRead(cs *cycleState, c *nbd.Client, conn int, rng *rand.Rand, buf []byte) error {
	lba, n, ok := r.claimRange(cs, rng)
	if !ok {
		return nil
	}
	p := buf[:n*BlockSize]
	cs.pending.Add(1)
	err := c.ReadAt(p, lba*BlockSize)
	cs.pending.Add(-1)
	if err != nil {
		return fmt.Errorf("READ lba %d+%d on conn %d failed before any kill: %w", lba, n, conn, err)
	}
	cs.done.Add(1)
	for i := int64(0); i < n; i++ {
		d := Decode(p[i*BlockSize:(i+1)*BlockSize], r.cfg.Seed, uint64(lba+i))
		if err := r.oracle.CheckLive(lba+i, d); err != nil {
			return fmt.Errorf("read without a crash (invariant 1): %w", err)
		}
	}
	cs.release(lba, n)
	r.count(func(s *Stats) { s.LiveReads += n })
	return nil
}

// verify reads back every block ever touched after a restart and checks it
// against the oracle, which then adopts what it found.
func (r *run) verify(ctx context.Context, cs *cycleState) error {
	cfg := &r.cfg
	touched := r.oracle.Touched()
	// Runs of consecutive blocks, at most 64 (256 KiB) each.
	type span struct{ lba, n int64 }
	var spans []span
	for _, b := range touched {
		if k := len(spans) - 1; k >= 0 && spans[k].lba+spans[k].n == b && spans[k].n < 64 {
			spans[k].n++
			continue
		}
		spans = append(spans, span{b, 1})
	}
	conns := min(cfg.Conns, max(1, len(spans)))
	work := make(chan span)
	vs := &cycleState{cycle: cs.cycle, trigger: make(chan struct{})}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var outcomes [3]int64
	var blocks int64
	for i := 0; i < conns; i++ {
		c, err := cfg.Dial(ctx)
		if err != nil {
			close(work)
			wg.Wait()
			return fmt.Errorf("dial after restart: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			buf := make([]byte, 64*BlockSize)
			for sp := range work {
				if vs.stop.Load() {
					continue
				}
				p := buf[:sp.n*BlockSize]
				vs.pending.Add(1)
				err := c.ReadAt(p, sp.lba*BlockSize)
				vs.pending.Add(-1)
				vs.done.Add(1)
				if err != nil {
					vs.setErr(fmt.Errorf("READ lba %d+%d after restart (never an I/O error): %w", sp.lba, sp.n, err))
					continue
				}
				for j := int64(0); j < sp.n; j++ {
					d := Decode(p[j*BlockSize:(j+1)*BlockSize], cfg.Seed, uint64(sp.lba+j))
					out, err := r.oracle.CheckCrash(sp.lba+j, d)
					if err != nil {
						vs.setErr(fmt.Errorf("after kill and restart: %w", err))
						break
					}
					mu.Lock()
					outcomes[out]++
					blocks++
					mu.Unlock()
				}
			}
		}()
	}
	allDone := make(chan struct{})
	go func() {
		for _, sp := range spans {
			work <- sp
		}
		close(work)
		wg.Wait()
		close(allDone)
	}()
	if err := r.await(vs, allDone, "verification"); err != nil {
		return err
	}
	if err := vs.getErr(); err != nil {
		return err
	}
	r.st.BlocksVerified += blocks
	r.st.BytesVerified += blocks * BlockSize
	r.st.FoundDurable += outcomes[Durable]
	r.st.FoundMaybeLatest += outcomes[MaybeLatest]
	r.st.FoundMaybeOlder += outcomes[MaybeOlder]
	r.logf("c%d verified %d blocks", cs.cycle, blocks)
	return nil
}
