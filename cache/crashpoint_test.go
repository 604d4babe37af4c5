package cache

// Crash-point enumeration and error accounting (issue 7, item 2; the
// "fail at operation N, for N = 0, 1, 2, ... until a run finishes without
// reaching N" pattern of pebble's error tests and bbolt's failpoints).
//
// Every device of a run (the cache device and each backing device) goes
// through one cpWorld, which numbers the device operations of the operation
// under test in one sequence. In crash mode the sequence counts writes,
// write-zeroes, discards and syncs; at operation N the world clones every
// device at that instant (device.Mem.CrashClone, in three variants: every
// unsynced block lost, every one kept, and a seeded mix with torn 512-byte
// sectors) and from then on fails every operation, as a dead process issues
// none. Operation N itself has not happened: the crash lies just after
// operation N-1. In error mode the sequence also counts reads, and
// operation N alone fails with a faultdev.InjectedError.
//
// After a crash each clone is reopened (a recovery; for the "open"
// scenarios that recovery follows a crash during recovery), must pass
// Set.Check, and every 4 KiB block of every volume must hold an allowed
// content: its durable content (what a FLUSH or FUA reply, or an operation
// that promises durability, covered) or a content written since. After an
// injected error the error must have surfaced, as an error returned by the
// operation or as a logged warning or error naming it; the test counts
// injected and surfaced errors. Then the devices are reopened as they are
// and after a power cut, and checked in the same way.
//
// The set runs without background goroutines (testingKnobs.noBackground):
// the scenarios call what they would do (commit, writeback sweeps,
// eviction), so the operation sequence replays for a seed. Two sources of
// variation remain: writeback issues the backing writes of one batch from
// several goroutines (their numbering may differ between runs), and
// invariants builds take early checkpoints at random. A failure prints the
// scenario, seed, N, the operation at N and the command that replays it.

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

var (
	flagCPSeed = flag.Int64("cp-seed", -1, "TestCrashPoints/TestErrorPoints: run this workload seed only")
	flagCPAt   = flag.Int("cp-at", -1, "TestCrashPoints/TestErrorPoints: run this point only (with -cp-seed)")
)

// cpSeeds returns the workload seeds each scenario is enumerated for: 4, or
// 2 under the race detector or -short (CI), TIERCACHE_CRASHPOINT_SEEDS for a
// larger sweep (make stress).
func cpSeeds(t *testing.T) []uint64 {
	if *flagCPSeed >= 0 {
		return []uint64{uint64(*flagCPSeed)}
	}
	n := 4
	if testing.Short() || raceEnabled {
		n = 2
	}
	if v := os.Getenv("TIERCACHE_CRASHPOINT_SEEDS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("TIERCACHE_CRASHPOINT_SEEDS=%q: want a positive number", v)
		}
	}
	seeds := make([]uint64, n)
	for i := range seeds {
		seeds[i] = uint64(i)
	}
	return seeds
}

type cpMode int

const (
	cpCrash cpMode = iota // crash just before operation N
	cpFail                // operation N fails with an injected error
)

func (m cpMode) String() string { return [...]string{"crash", "error"}[m] }

// errCrashed is the error of every device operation after the crash point.
var errCrashed = errors.New("crashpoint: process crashed")

// cpWorld numbers the device operations of every device of a run.
type cpWorld struct {
	mode cpMode
	at   int // operation that crashes or fails; -1: none
	cfgs []device.CrashConfig

	// io is held shared by every admitted operation until it completes and
	// exclusively while the devices are cloned, so a crash is one instant.
	io sync.RWMutex
	mu sync.Mutex // guards the fields below; io is taken under it
	// devs are the world's devices, cache first.
	devs   []*cpDev
	armed  bool
	next   int
	dead   bool
	hit    string          // the operation at the crash or fault
	clones [][]*device.Mem // per crash config, per device in devs order
	ops    []string        // counted operations, for messages
}

// cpDev is one device of a world, over a device.Mem.
type cpDev struct {
	w    *cpWorld
	name string
	mem  *device.Mem
}

var (
	_ device.Device    = (*cpDev)(nil)
	_ device.Discarder = (*cpDev)(nil)
	_ device.Zeroer    = (*cpDev)(nil)
)

func newWorld(mode cpMode, at int, rng *rand.Rand) *cpWorld {
	return &cpWorld{mode: mode, at: at, cfgs: []device.CrashConfig{
		{UnsyncedKeep: 0},
		{UnsyncedKeep: 1},
		{UnsyncedKeep: 0.5, TornProb: 0.2, Rand: rng},
	}}
}

func (w *cpWorld) add(name string, mem *device.Mem) *cpDev {
	d := &cpDev{w: w, name: name, mem: mem}
	w.devs = append(w.devs, d)
	return d
}

// arm starts or stops counting: only the operation under test is numbered.
func (w *cpWorld) arm(on bool) {
	w.mu.Lock()
	w.armed = on
	w.mu.Unlock()
}

// counted returns the number of operations counted so far.
func (w *cpWorld) counted() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next
}

func (w *cpWorld) fired() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.hit != ""
}

// begin admits one operation; on success the caller runs it and calls
// w.io.RUnlock.
func (w *cpWorld) begin(d *cpDev, kind faultdev.OpKind, off, n int64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dead {
		return &device.IOError{Op: kind.String(), Path: d.name, Off: off, Len: n, Err: errCrashed}
	}
	if w.armed && (w.mode == cpFail || kind != faultdev.Read) {
		idx := w.next
		w.next++
		desc := fmt.Sprintf("#%d %s %s off=%d len=%d", idx, kind, d.name, off, n)
		if len(w.ops) < 1024 {
			w.ops = append(w.ops, desc)
		}
		if idx == w.at {
			w.hit = desc
			if w.mode == cpFail {
				return &faultdev.InjectedError{Op: faultdev.Op{Kind: kind, Offset: off, Len: n, Index: uint64(idx)}}
			}
			w.dead = true
			w.io.Lock() // operations in flight complete first
			for _, cfg := range w.cfgs {
				var c []*device.Mem
				for _, dd := range w.devs {
					c = append(c, dd.mem.CrashClone(cfg))
				}
				w.clones = append(w.clones, c)
			}
			w.io.Unlock()
			return &device.IOError{Op: kind.String(), Path: d.name, Off: off, Len: n, Err: errCrashed}
		}
	}
	w.io.RLock()
	return nil
}

func (d *cpDev) ReadAt(p []byte, off int64) (int, error) {
	if err := d.w.begin(d, faultdev.Read, off, int64(len(p))); err != nil {
		return 0, err
	}
	defer d.w.io.RUnlock()
	return d.mem.ReadAt(p, off)
}

func (d *cpDev) WriteAt(p []byte, off int64) (int, error) {
	if err := d.w.begin(d, faultdev.Write, off, int64(len(p))); err != nil {
		return 0, err
	}
	defer d.w.io.RUnlock()
	return d.mem.WriteAt(p, off)
}

func (d *cpDev) Sync() error {
	if err := d.w.begin(d, faultdev.Sync, 0, 0); err != nil {
		return err
	}
	defer d.w.io.RUnlock()
	return d.mem.Sync()
}

func (d *cpDev) Discard(off, n int64) error {
	if err := d.w.begin(d, faultdev.Discard, off, n); err != nil {
		return err
	}
	defer d.w.io.RUnlock()
	return d.mem.Discard(off, n)
}

func (d *cpDev) WriteZeroes(off, n int64) error {
	if err := d.w.begin(d, faultdev.Zero, off, n); err != nil {
		return err
	}
	defer d.w.io.RUnlock()
	return d.mem.WriteZeroes(off, n)
}

func (d *cpDev) Size() int64  { return d.mem.Size() }
func (d *cpDev) Close() error { return nil }

// cpLog records warnings and errors the engine logs, and how many of them
// name an injected fault.
type cpLog struct {
	mu       sync.Mutex
	recs     []string
	injected int
	text     strings.Builder // every record, one a line
}

func (h *cpLog) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (h *cpLog) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%v %s", r.Level, r.Message)
	hit := false
	r.Attrs(func(a slog.Attr) bool {
		v := a.Value.Resolve()
		if e, ok := v.Any().(error); ok && errors.Is(e, faultdev.ErrInjected) {
			hit = true
		}
		fmt.Fprintf(&b, " %s=%v", a.Key, v)
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.recs) < 64 {
		h.recs = append(h.recs, b.String())
	}
	h.text.WriteString(b.String())
	h.text.WriteByte('\n')
	if hit {
		h.injected++
	}
	return nil
}

func (h *cpLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *cpLog) WithGroup(string) slog.Handler      { return h }

// all returns every record logged, one a line.
func (h *cpLog) all() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.text.String()
}

func (h *cpLog) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.injected
}

// cpScenario is one operation whose crash points are enumerated.
type cpScenario struct {
	name string
	// fresh: the operation formats the cache device itself (no set before).
	fresh bool
	// prepare builds the state the operation starts from (not counted).
	prepare func(r *cpRun)
	// op is the operation under test. It updates the model as its steps
	// return (a write that returned is maybe-new, a FLUSH that returned
	// makes everything durable).
	op func(r *cpRun) error
	// done applies what the operation promises once it returned nil.
	done func(r *cpRun)
	// check, if set, runs extra checks on a set reopened after the run
	// (finished: the operation returned nil).
	check func(r *cpRun, s *Set, mems []*device.Mem, finished bool)
}

// cpRun is one run of a scenario: a workload seed and a crash or fault point.
type cpRun struct {
	t    *testing.T
	sc   *cpScenario
	seed uint64
	mode cpMode
	at   int
	rng  *rand.Rand
	w    *cpWorld
	log  *cpLog

	bs, nb    int64
	nvols     int
	hide      bool
	initMode  Mode
	order     WritebackOrder
	cache     *cpDev
	backs     []*cpDev
	extra     *cpDev // attach: the device attached by the operation
	set       *Set
	model     []*modelVol
	uncertain bool // an operation failed: cur may hold data that did not land
	wid       uint64
	trail     []string

	oldUUID  [16]byte // reformat: the set formatted over
	oldModel []*modelVol
	modes    []Mode       // per volume: the mode after a restart
	altMode  map[int]Mode // a mode switch in progress: also allowed
	optional string       // a volume the reopened set may not list (attach, detach)
}

func (r *cpRun) logf(format string, args ...any) {
	r.trail = append(r.trail, fmt.Sprintf(format, args...))
}

func (r *cpRun) fatalf(format string, args ...any) {
	r.t.Helper()
	trail := r.trail
	if len(trail) > 80 {
		trail = trail[len(trail)-80:]
	}
	test := "TestCrashPoints"
	if r.mode == cpFail {
		test = "TestErrorPoints"
	}
	r.t.Fatalf("%s seed %d %s point N=%d (%s): %s\nreplay: go test ./cache -run '%s/%s$' -cp-seed %d -cp-at %d -v\n"+
		"operations counted:\n  %s\nworkload:\n  %s\nlog:\n  %s",
		r.sc.name, r.seed, r.mode, r.at, r.w.hit, fmt.Sprintf(format, args...), test, r.sc.name, r.seed, r.at,
		strings.Join(r.w.ops, "\n  "), strings.Join(trail, "\n  "), strings.Join(r.log.recs, "\n  "))
}

// geometry draws the set's shape from the seed: tiny buckets, so that the
// workload seals, evicts and writes back buckets.
func (r *cpRun) geometry() {
	rng := r.rng
	r.bs = blockSize * int64(2+rng.IntN(3))
	r.nb = int64(12 + rng.IntN(6))
	r.nvols = 1 + rng.IntN(2)
	r.hide = rng.IntN(4) == 0
	// Both writeback orders in any two consecutive seeds; the initial mode
	// cycles (the workload switches modes too).
	r.initMode = []Mode{Writeback, Writeback, Writethrough, Writeback, Writearound, None}[r.seed%6]
	r.order = []WritebackOrder{OrderEpoch, OrderLBA}[r.seed%2]
	r.cache = r.w.add("cache", device.NewMem(cacheSizeForPaged(r.nb, r.bs, minJournalLen, r.nvols, testIndexPages(r.seed))))
	for i := 0; i < r.nvols; i++ {
		d, m := r.newBacking(i)
		r.backs = append(r.backs, d)
		r.model = append(r.model, m)
	}
}

// newBacking adds backing device i to the world, with data that is not
// zero (so a read served from the wrong place shows), and returns its model.
func (r *cpRun) newBacking(i int) (*cpDev, *modelVol) {
	rng := r.rng
	size := int64(24+rng.IntN(40)) * blockSize
	if rng.IntN(4) == 0 {
		size -= int64(1+rng.IntN(7)) * 512
	}
	mem := device.NewMem(size)
	p := make([]byte, size)
	stamp(p, 1<<40+uint64(i), i, 0)
	if _, err := mem.WriteAt(p, 0); err != nil {
		r.t.Fatal(err)
	}
	if err := mem.Sync(); err != nil {
		r.t.Fatal(err)
	}
	m := &modelVol{cur: p, cand: make([][][]byte, (size+blockSize-1)/blockSize)}
	for b := range m.cand {
		m.cand[b] = [][]byte{blockOf(m, b)}
	}
	return r.w.add(fmt.Sprintf("back%d", i), mem), m
}

func blockOf(m *modelVol, b int) []byte {
	end := min(int64(b+1)*blockSize, int64(len(m.cur)))
	return bytes.Clone(m.cur[int64(b)*blockSize : end])
}

func (r *cpRun) specs(devs []device.Device) []BackingSpec {
	var out []BackingSpec
	for i, d := range devs {
		if r.hide {
			d = plainDev{d}
		}
		out = append(out, BackingSpec{Name: fmt.Sprintf("vol%d", i), Dev: d, ID: fmt.Sprintf("id-%d", i)})
	}
	return out
}

func (r *cpRun) liveSpecs() []BackingSpec {
	devs := make([]device.Device, len(r.backs))
	for i, b := range r.backs {
		devs[i] = b
	}
	return r.specs(devs)
}

func (r *cpRun) format(force bool) error {
	_, err := Format(r.cache, r.liveSpecs(), FormatOptions{BucketSize: r.bs, JournalSize: minJournalLen, Mode: r.initMode, Force: force, markShift: testMarkShift(r.seed), IndexPages: testIndexPages(r.seed)})
	return err
}

func (r *cpRun) open() error {
	s, err := Open(r.cache, r.liveSpecs(), OpenOptions{Logger: slog.New(r.log), testing: testingKnobs{noBackground: true}})
	if err != nil {
		return err
	}
	r.set = s
	return nil
}

// formatOpen formats, opens and sets each volume's writeback order (not
// counted: the scenarios' preparation).
func (r *cpRun) formatOpen() {
	if err := r.format(false); err != nil {
		r.t.Fatalf("format: %v", err)
	}
	if err := r.open(); err != nil {
		r.t.Fatalf("open: %v", err)
	}
	r.modes = make([]Mode, r.nvols)
	for vi, v := range r.set.vols {
		st := v.Settings()
		st.WritebackOrder = r.order
		st.SequentialCutoff = []int64{0, 16 << 10}[r.rng.IntN(2)]
		if err := v.SetSettings(st); err != nil {
			r.t.Fatalf("settings: %v", err)
		}
		r.modes[vi] = st.Mode
	}
}

// --- model ---

// issued records the current content of the blocks overlapping [off,
// off+n) of volume vi as maybe-new.
func (r *cpRun) issued(vi int, off, n int64) {
	m := r.model[vi]
	for b := off / blockSize; b <= (off+n-1)/blockSize && n > 0; b++ {
		m.cand[b] = append(m.cand[b], blockOf(m, int(b)))
	}
}

// durable collapses the allowed contents of [off, off+n) to the current one.
func (r *cpRun) durable(vi int, off, n int64) {
	m := r.model[vi]
	for b := off / blockSize; b <= (off+n-1)/blockSize && n > 0; b++ {
		m.cand[b] = [][]byte{blockOf(m, int(b))}
	}
}

// flushed: a commit returned, which covers every volume.
func (r *cpRun) flushed() {
	if r.uncertain {
		return // cur may hold writes that failed; keep their alternatives
	}
	for vi, m := range r.model {
		r.durable(vi, 0, int64(len(m.cur)))
	}
}

// --- workload ---

// pump does what the gc goroutine would: evict while free buckets are
// short, and drain when eviction cannot keep up (epoch order never writes
// around the cache while older epochs are in it, so a writer would wait
// for a goroutine that does not run).
func (r *cpRun) pump() error {
	s := r.set
	free := func() int {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.mu.free)
	}
	evict := func() {
		for i := 0; i < 2*int(r.nb) && free() < 3; i++ {
			if !s.evictOne() {
				break
			}
		}
	}
	// Writes in writeback mode are throttled (slept) when dirty data nears
	// the cache size; background writeback keeps it below that.
	for i := 0; i < 8; i++ {
		if share, _, _, _ := s.pressure(); share <= 0.6 {
			break
		}
		for _, v := range s.vols {
			sweepLogged(s, v, 8)
		}
	}
	evict()
	if free() >= 3 {
		return s.err()
	}
	r.logf("drain (pump)")
	if err := s.Drain(context.Background()); err != nil {
		return err
	}
	evict()
	return s.err()
}

func (r *cpRun) randRange(vi int) (int64, int64) {
	size := int64(len(r.model[vi].cur))
	var off, n int64
	if r.rng.IntN(3) == 0 {
		off = r.rng.Int64N(size/512) * 512
		n = int64(1+r.rng.IntN(16)) * 512
	} else {
		off = r.rng.Int64N((size+blockSize-1)/blockSize) * blockSize
		n = int64(1+r.rng.IntN(8)) * blockSize
	}
	if off >= size {
		off = size - 512
	}
	return off, min(n, size-off, r.bs*2)
}

// write writes a stamped range through the volume and tracks it.
func (r *cpRun) write(vi int, off, n int64, fua bool) error {
	if err := r.pump(); err != nil {
		return err
	}
	r.wid++
	p := make([]byte, n)
	stamp(p, r.wid, vi, off)
	r.logf("write w%d vol%d off=%d len=%d fua=%t mode=%v", r.wid, vi, off, n, fua, r.set.vols[vi].Mode())
	copy(r.model[vi].cur[off:], p)
	r.issued(vi, off, n)
	if err := r.set.vols[vi].WriteAt(p, off, fua); err != nil {
		r.uncertain = true
		return err
	}
	if fua && !r.uncertain {
		r.durable(vi, off, n)
	}
	return nil
}

func (r *cpRun) flush(vi int) error {
	r.logf("flush vol%d", vi)
	if err := r.set.vols[vi].Flush(); err != nil {
		return err
	}
	if r.set.isFailed() {
		// After failover a flush syncs the backing devices and covers
		// its own volume only: another volume may have lost writes
		// (its flushes fail).
		if !r.uncertain {
			r.durable(vi, 0, int64(len(r.model[vi].cur)))
		}
		return nil
	}
	r.flushed()
	return nil
}

// step runs one random workload operation.
func (r *cpRun) step() error {
	rng := r.rng
	vi := rng.IntN(r.nvols)
	v := r.set.vols[vi]
	m := r.model[vi]
	switch k := rng.IntN(100); {
	case k < 50:
		off, n := r.randRange(vi)
		return r.write(vi, off, n, rng.IntN(6) == 0)
	case k < 58:
		return r.flush(vi)
	case k < 62:
		off, n := r.randRange(vi)
		fua := rng.IntN(3) == 0
		r.logf("trim vol%d off=%d len=%d fua=%t", vi, off, n, fua)
		a := (off + blockSize - 1) / blockSize * blockSize
		b := (off + n) / blockSize * blockSize
		if off+n == int64(len(m.cur)) {
			b = off + n
		}
		if !r.hide && a < b {
			clear(m.cur[a:b])
			r.issued(vi, a, b-a)
		}
		if err := v.Trim(off, n, fua); err != nil {
			r.uncertain = true
			return err
		}
		if fua && !r.hide && a < b && !r.uncertain {
			r.durable(vi, a, b-a)
		}
	case k < 68:
		off, n := r.randRange(vi)
		fua := rng.IntN(3) == 0
		r.logf("write-zeroes vol%d off=%d len=%d fua=%t", vi, off, n, fua)
		if err := r.pump(); err != nil {
			return err
		}
		clear(m.cur[off : off+n])
		r.issued(vi, off, n)
		if err := v.WriteZeroes(off, n, fua, true, false); err != nil {
			r.uncertain = true
			return err
		}
		if fua && !r.uncertain {
			r.durable(vi, off, n)
		}
	case k < 72:
		mode := Mode(rng.IntN(4))
		r.logf("set-mode vol%d %v", vi, mode)
		r.altMode = map[int]Mode{vi: mode}
		if err := v.SetMode(mode); err != nil {
			return err
		}
		r.altMode = nil
		r.modes[vi] = mode
	case k < 76:
		r.logf("evict")
		r.set.evictOne()
	case k < 80:
		r.logf("writeback sweep vol%d", vi)
		sweepLogged(r.set, v, 1+rng.IntN(16))
	default:
		off, n := r.randRange(vi)
		r.logf("read vol%d off=%d len=%d", vi, off, n)
		got := make([]byte, n)
		if err := v.ReadAt(got, off); err != nil {
			return err
		}
		if !r.uncertain && !bytes.Equal(got, m.cur[off:off+n]) {
			r.fatalf("read vol%d off=%d len=%d: %s", vi, off, n, r.describe(got, m.cur[off:off+n]))
		}
	}
	return nil
}

func (r *cpRun) describe(got, want []byte) string {
	for i := 0; i < len(got); i += 512 {
		e := min(i+512, len(got))
		if !bytes.Equal(got[i:e], want[i:e]) {
			return fmt.Sprintf("first difference in sector %d: got %s, want %s", i/512, describeSector(got[i:e]), describeSector(want[i:e]))
		}
	}
	return "equal"
}

// workload runs n random operations, then leaves a few unflushed writes.
func (r *cpRun) workload(n int) {
	for i := 0; i < n; i++ {
		if err := r.step(); err != nil {
			r.fatalf("workload: %v", err)
		}
	}
	for i := 0; i < 3; i++ {
		vi := r.rng.IntN(r.nvols)
		off, n := r.randRange(vi)
		if err := r.write(vi, off, n, false); err != nil {
			r.fatalf("workload: %v", err)
		}
	}
	if err := r.set.Check(); err != nil {
		r.fatalf("after workload: %v", err)
	}
}

// --- checks ---

// checkContent reads every volume of s and checks each 4 KiB block against
// the allowed contents, sector by sector (an unflushed write may be torn).
func (r *cpRun) checkContent(s *Set, what string, model []*modelVol) {
	for vi, m := range model {
		if removed(s, vi) {
			continue // detached: checkImage checks its backing device
		}
		got := make([]byte, len(m.cur))
		if err := s.vols[vi].ReadAt(got, 0); err != nil {
			r.fatalf("%s: read vol%d: %v", what, vi, err)
		}
		r.checkBlocks(what, vi, m, got)
	}
}

// checkBlocks checks volume vi's content got against the allowed contents
// of m, block by block and sector by sector.
func (r *cpRun) checkBlocks(what string, vi int, m *modelVol, got []byte) {
	for b := range m.cand {
		g := got[int64(b)*blockSize : min(int64(b+1)*blockSize, int64(len(got)))]
		for i := 0; i < len(g); i += 512 {
			e := min(i+512, len(g))
			ok := false
			for _, c := range m.cand[b] {
				ok = ok || bytes.Equal(g[i:e], c[i:e])
			}
			if !ok {
				var allowed []string
				for _, c := range m.cand[b] {
					allowed = append(allowed, describeSectors(c))
				}
				r.fatalf("%s: vol%d block %d holds %s; allowed: %s", what, vi, b, describeSectors(g), strings.Join(allowed, " | "))
			}
		}
	}
}

// checkExact reads every volume through s: with no fault and no crash it
// returns exactly the latest writes (invariant 1).
func (r *cpRun) checkExact(s *Set, what string) {
	for vi, m := range r.model {
		if removed(s, vi) {
			continue // detached: checkImage checks its backing device
		}
		got := make([]byte, len(m.cur))
		if err := s.vols[vi].ReadAt(got, 0); err != nil {
			r.fatalf("%s: vol%d: %v", what, vi, err)
		}
		if !bytes.Equal(got, m.cur) {
			r.fatalf("%s: vol%d: %s", what, vi, r.describe(got, m.cur))
		}
	}
}

// removed reports whether volume slot vi was detached from s.
func removed(s *Set, vi int) bool { return vi >= len(s.vols) || s.vols[vi].free }

func isClosed(s *Set) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.closed
}

// checkImage reopens a set of devices (cache first) as a restart would.
func (r *cpRun) checkImage(mems []*device.Mem, what string, finished bool) {
	devs := make([]device.Device, len(mems)-1)
	for i, m := range mems[1:] {
		devs[i] = m
	}
	s, err := Open(mems[0], r.specs(devs), OpenOptions{Logger: slog.New(&cpLog{}), testing: testingKnobs{noBackground: true}})
	var bm *BackingMismatchError
	absent := false
	if r.optional != "" && errors.As(err, &bm) && bm.Field == "unknown" && bm.Name == r.optional {
		// A detach completed, or an attach did not, before the crash:
		// the set does not list that volume.
		absent = true
		specs := slices.DeleteFunc(r.specs(devs), func(b BackingSpec) bool { return b.Name == r.optional })
		s, err = Open(mems[0], specs, OpenOptions{Logger: slog.New(&cpLog{}), testing: testingKnobs{noBackground: true}})
	}
	if r.sc.fresh {
		r.checkFormatImage(mems, devs, s, err, what)
		return
	}
	if err != nil {
		r.fatalf("%s: reopen: %v", what, err)
	}
	defer s.crashStop()
	if err := s.Check(); err != nil {
		r.fatalf("%s: Check: %v", what, err)
	}
	if err := checkCleanCoherent(s); err != nil {
		r.fatalf("%s: %v", what, err)
	}
	if (absent && r.sc.name == "detach") || (r.sc.name == "detach" && finished) {
		// Removed from the set: the backing device alone holds every
		// write, durably.
		want := r.model[0].cur
		got := make([]byte, len(want))
		if _, err := mems[1].ReadAt(got, 0); err != nil {
			r.fatalf("%s: reading the detached backing device: %v", what, err)
		}
		if !bytes.Equal(got, want) {
			r.fatalf("%s: the detached backing device differs: %s", what, r.describe(got, want))
		}
		if !removed(s, 0) {
			r.fatalf("%s: the detach finished but slot 0 is still in use", what)
		}
	}
	for vi, v := range s.vols {
		if v.free {
			continue
		}
		alt, ok := r.altMode[vi]
		if got := v.Mode(); got != r.modes[vi] && (!ok || got != alt) {
			r.fatalf("%s: vol%d mode %v, want %v", what, vi, got, r.modes[vi])
		}
	}
	r.checkContent(s, what, r.model)
	if r.sc.check != nil {
		r.sc.check(r, s, mems, finished)
	}
}

// checkFormatImage: after a crash during Format the device holds no set
// (Open refuses it with a typed error, and Format then succeeds without
// force), the old set (reformat) or the new, empty one.
func (r *cpRun) checkFormatImage(mems []*device.Mem, devs []device.Device, s *Set, err error, what string) {
	if err != nil {
		if !errors.Is(err, ErrNotFormatted) && !IsCorruption(err) {
			r.fatalf("%s: reopen after a crash in format: untyped error %v", what, err)
		}
		force := r.oldModel != nil
		if _, ferr := Format(mems[0], r.specs(devs), FormatOptions{BucketSize: r.bs, JournalSize: minJournalLen, Force: force, IndexPages: testIndexPages(r.seed)}); ferr != nil {
			r.fatalf("%s: format after a crash in format (force %t): %v (open said %v)", what, force, ferr, err)
		}
		if s, err = Open(mems[0], r.specs(devs), OpenOptions{testing: testingKnobs{noBackground: true}}); err != nil {
			r.fatalf("%s: open after reformat: %v", what, err)
		}
	}
	defer s.crashStop()
	if err := s.Check(); err != nil {
		r.fatalf("%s: Check: %v", what, err)
	}
	model := r.model // the new set: the backing devices' data
	if r.oldModel != nil && s.lay.SetUUID == r.oldUUID {
		model = r.oldModel
	}
	r.checkContent(s, what, model)
}

// --- scenarios ---

func prepareSet(n int) func(r *cpRun) {
	return func(r *cpRun) {
		r.formatOpen()
		r.workload(n)
	}
}

// crashImage replaces the run's devices by a crash clone of them: the
// "open" scenarios recover from it. ref is the content a full recovery
// finds; a crash during recovery must not change it.
func (r *cpRun) crashImage() {
	keep := []float64{0, 0.5, 1}[r.rng.IntN(3)]
	cfg := device.CrashConfig{UnsyncedKeep: keep, TornProb: 0.2, Rand: rand.New(rand.NewPCG(r.seed, 77))}
	r.logf("crash keep=%.1f torn=0.2", keep)
	r.set.crashStop()
	r.rebuild(cfg)
}

// rebuild moves the run to a new world over clones of its devices.
func (r *cpRun) rebuild(cfg device.CrashConfig) {
	old := r.w
	r.w = newWorld(r.mode, r.at, old.cfgs[2].Rand)
	r.cache = r.w.add("cache", r.cache.mem.CrashClone(cfg))
	for i, b := range r.backs {
		r.backs[i] = r.w.add(b.name, b.mem.CrashClone(cfg))
	}
	r.set = nil
}

// recoveredRef opens a copy of the devices, checks what the recovery finds
// against the model and makes it the only allowed content: recovery must
// reproduce it exactly, whatever crashes interrupt it.
func (r *cpRun) recoveredRef() {
	mems := []*device.Mem{r.cache.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 1})}
	devs := make([]device.Device, len(r.backs))
	for i, b := range r.backs {
		devs[i] = b.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
	}
	s, err := Open(mems[0], r.specs(devs), OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		r.fatalf("reference recovery: %v", err)
	}
	defer s.crashStop()
	r.checkContent(s, "reference recovery", r.model)
	for vi, v := range s.vols {
		got := make([]byte, v.Size())
		if err := v.ReadAt(got, 0); err != nil {
			r.fatalf("reference recovery: read: %v", err)
		}
		r.model[vi].cur = got
		for b := range r.model[vi].cand {
			r.model[vi].cand[b] = [][]byte{blockOf(r.model[vi], b)}
		}
	}
}

var cpScenarios = []*cpScenario{
	{
		name:  "format",
		fresh: true,
		prepare: func(r *cpRun) {
			r.modes = make([]Mode, r.nvols)
		},
		op: func(r *cpRun) error { return r.format(false) },
	},
	{
		name:  "reformat",
		fresh: true,
		prepare: func(r *cpRun) {
			r.formatOpen()
			r.workload(30)
			r.oldUUID = r.set.lay.SetUUID
			if err := r.set.Close(); err != nil {
				r.fatalf("close: %v", err)
			}
			r.flushed()
			// The new set shows the backing devices as they are; the old
			// one what the closed set held.
			r.oldModel = r.model
			r.model = nil
			for _, b := range r.backs {
				p := make([]byte, b.mem.Size())
				if _, err := b.mem.ReadAt(p, 0); err != nil {
					r.t.Fatal(err)
				}
				m := &modelVol{cur: p, cand: make([][][]byte, (len(p)+blockSize-1)/blockSize)}
				for bb := range m.cand {
					m.cand[bb] = [][]byte{blockOf(m, bb)}
				}
				r.model = append(r.model, m)
			}
		},
		op: func(r *cpRun) error { return r.format(true) },
	},
	{
		name: "open-after-crash",
		prepare: func(r *cpRun) {
			prepareSet(30)(r)
			r.crashImage()
			r.recoveredRef()
		},
		op: func(r *cpRun) error { return r.open() },
	},
	{
		name: "open-clean",
		prepare: func(r *cpRun) {
			prepareSet(30)(r)
			if err := r.set.Close(); err != nil {
				r.fatalf("close: %v", err)
			}
			r.flushed()
			r.rebuild(device.CrashConfig{UnsyncedKeep: 1})
		},
		op: func(r *cpRun) error { return r.open() },
	},
	{
		name:    "flush",
		prepare: prepareSet(20),
		op: func(r *cpRun) error {
			for i := 0; i < 3; i++ {
				vi := r.rng.IntN(r.nvols)
				off, n := r.randRange(vi)
				if err := r.write(vi, off, n, i == 1); err != nil {
					return err
				}
			}
			return r.flush(0)
		},
	},
	{
		// Client reads: misses promoted into the cache (cache writes),
		// hits verified. A read that returns must return the latest data.
		name:    "read",
		prepare: prepareSet(20),
		op: func(r *cpRun) error {
			for i := 0; i < 6; i++ {
				vi := r.rng.IntN(r.nvols)
				off, n := r.randRange(vi)
				got := make([]byte, n)
				r.logf("read vol%d off=%d len=%d", vi, off, n)
				if err := r.set.vols[vi].ReadAt(got, off); err != nil {
					return err
				}
				if want := r.model[vi].cur[off : off+n]; !bytes.Equal(got, want) {
					r.fatalf("read vol%d off=%d len=%d returned wrong data: %s", vi, off, n, r.describe(got, want))
				}
			}
			return nil
		},
	},
	{
		name:    "close",
		prepare: prepareSet(30),
		op:      func(r *cpRun) error { return r.set.Close() },
		done:    func(r *cpRun) { r.flushed() },
	},
	{
		name:    "writeback",
		prepare: prepareSet(30),
		op: func(r *cpRun) error {
			for _, v := range r.set.vols {
				sweepLogged(r.set, v, writeback.FullBatch)
			}
			return r.set.commit(r.set.appended())
		},
	},
	{
		name:    "drain",
		prepare: prepareSet(30),
		op:      func(r *cpRun) error { return r.set.Drain(context.Background()) },
		done:    func(r *cpRun) { r.flushed() },
	},
	{
		name:    "gc",
		prepare: prepareSet(40),
		op: func(r *cpRun) error {
			s := r.set
			s.mu.Lock()
			n := len(s.mu.sealed)
			s.mu.Unlock()
			for i := 0; i < n; i++ {
				s.evictOne()
			}
			return s.err()
		},
	},
	{
		name:    "mode-switch",
		prepare: prepareSet(30),
		op: func(r *cpRun) error {
			v := r.set.vols[0]
			to := (v.Mode() + 1 + Mode(r.rng.IntN(3))) % 4
			r.logf("set-mode vol0 %v", to)
			r.altMode = map[int]Mode{0: to}
			if err := v.SetMode(to); err != nil {
				return err
			}
			r.modes[0], r.altMode = to, nil
			off, n := r.randRange(0)
			if err := r.write(0, off, n, false); err != nil {
				return err
			}
			return r.flush(0)
		},
	},
	{
		// A new backing device joins the running set (superblock), then
		// takes a write and a FLUSH.
		name: "attach",
		prepare: func(r *cpRun) {
			prepareSet(20)(r)
			d, m := r.newBacking(r.nvols)
			r.extra = d
			r.model = append(r.model, m)
			r.modes = append(r.modes, Mode(r.rng.IntN(4)))
		},
		op: func(r *cpRun) error {
			vi := len(r.model) - 1
			name := fmt.Sprintf("vol%d", vi)
			r.optional = name
			var dev device.Device = r.extra
			if r.hide {
				dev = plainDev{dev}
			}
			r.logf("attach %s mode %v", name, r.modes[vi])
			if _, err := r.set.Attach(BackingSpec{Name: name, Dev: dev, ID: fmt.Sprintf("id-%d", vi)}, AttachOptions{Mode: r.modes[vi]}); err != nil {
				return err
			}
			r.optional = ""
			r.nvols++
			off, n := r.randRange(vi)
			if err := r.write(vi, off, n, false); err != nil {
				return err
			}
			return r.flush(vi)
		},
	},
	{
		name:    "detach",
		prepare: prepareSet(30),
		op: func(r *cpRun) error {
			r.optional = "vol0"
			r.altMode = map[int]Mode{0: None}
			if err := r.set.vols[0].Detach(context.Background(), DetachOptions{}); err != nil {
				return err
			}
			r.modes[0], r.altMode = None, nil
			return nil
		},
		done: func(r *cpRun) { r.flushed() },
	},
}

// cpResult is what one run saw.
type cpResult struct {
	reached  bool // the point was reached (crash or fault happened)
	ops      int  // operations counted
	surfaced bool // error mode: the injected error surfaced
	returned bool // ... as the operation's error
	vanished string
	opErr    error
}

// runPoint runs scenario sc for a seed with a crash or fault at point at.
func runPoint(t *testing.T, sc *cpScenario, seed uint64, mode cpMode, at int) cpResult {
	r := &cpRun{t: t, sc: sc, seed: seed, mode: mode, at: -1, rng: rand.New(rand.NewPCG(seed, 0xc9)), log: &cpLog{}}
	r.w = newWorld(mode, -1, rand.New(rand.NewPCG(seed, uint64(at))))
	r.geometry()
	sc.prepare(r)
	// The world the operation runs in (prepare may have replaced it).
	r.at = at
	r.w.at = at
	r.w.cfgs[2].Rand = rand.New(rand.NewPCG(seed, uint64(at)))
	defer func() {
		if r.set != nil {
			r.set.crashStop()
		}
	}()
	logBefore := r.log.count()
	r.w.arm(true)
	err := sc.op(r)
	r.w.arm(false)
	res := cpResult{ops: r.w.counted(), reached: r.w.fired(), opErr: err}
	if !res.reached {
		if err != nil {
			r.fatalf("operation failed without a fault: %v", err)
		}
		if sc.done != nil {
			sc.done(r)
		}
		if r.set != nil {
			if err := r.set.Check(); err != nil {
				r.fatalf("after the operation: Check: %v", err)
			}
			if !isClosed(r.set) {
				r.checkExact(r.set, "live read after the operation")
			}
		}
		// What the operation promised survives a power cut right after it.
		mems := []*device.Mem{}
		for _, d := range r.w.devs {
			mems = append(mems, d.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 0}))
		}
		r.checkImage(mems, "power cut after the operation", true)
		return res
	}
	switch mode {
	case cpCrash:
		if r.set != nil {
			r.set.crashStop()
		}
		for i, clone := range r.w.clones {
			cfg := r.w.cfgs[i]
			r.checkImage(clone, fmt.Sprintf("crash (unsynced keep=%.1f torn=%.1f)", cfg.UnsyncedKeep, cfg.TornProb), false)
		}
	case cpFail:
		res.returned = err != nil && errors.Is(err, faultdev.ErrInjected)
		res.surfaced = res.returned || r.log.count() > logBefore
		if !res.surfaced {
			res.vanished = fmt.Sprintf("seed %d N=%d %s: operation returned %v, nothing logged", seed, at, r.w.hit, err)
		}
		if err != nil && !errors.Is(err, faultdev.ErrInjected) {
			r.fatalf("operation failed with %v, which does not wrap the injected error", err)
		}
		if err != nil {
			r.uncertain = true
		}
		// No wrong reads from the set that saw the error: each read
		// returns allowed data or an error.
		if r.set != nil && !isClosed(r.set) && r.set.err() == nil {
			r.checkLiveAfterFault()
		}
		if r.set != nil {
			r.set.crashStop()
		}
		var asIs, cut []*device.Mem
		for _, d := range r.w.devs {
			asIs = append(asIs, d.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 1}))
			cut = append(cut, d.mem.CrashClone(device.CrashConfig{UnsyncedKeep: 0}))
		}
		r.checkImage(asIs, "restart after the fault", false)
		r.checkImage(cut, "power cut after the fault", false)
	}
	return res
}

// checkLiveAfterFault reads every volume through the set that saw the
// fault: a read may fail, but one that succeeds returns allowed data.
func (r *cpRun) checkLiveAfterFault() {
	for vi, m := range r.model {
		if removed(r.set, vi) {
			continue
		}
		got := make([]byte, len(m.cur))
		if err := r.set.vols[vi].ReadAt(got, 0); err != nil {
			continue
		}
		r.checkBlocks("read after the fault", vi, m, got)
	}
}

// cpStats sums what a scenario's enumeration saw.
type cpStats struct {
	seeds, points, runs        int
	injected, returned, logged int
	vanished                   []string
	maxOps                     int
	elapsed                    time.Duration
}

// cpFound lists, per scenario, workload seeds beyond the default ones on
// which a larger sweep once found a bug; CI runs them too.
var cpFound = map[string][]uint64{
	// A passthrough write in epoch order retried a failed writeback of
	// older epochs without logging the failure.
	"mode-switch": {30},
}

// enumerate runs N = 0, 1, ... until a run finishes without reaching N.
func enumerate(t *testing.T, sc *cpScenario, mode cpMode) cpStats {
	var st cpStats
	start := time.Now()
	seeds := cpSeeds(t)
	if *flagCPSeed < 0 {
		seeds = append(seeds, cpFound[sc.name]...)
	}
	st.seeds = len(seeds)
	for _, seed := range seeds {
		first, last := 0, 1<<20
		if *flagCPAt >= 0 {
			first, last = *flagCPAt, *flagCPAt
		}
		for at := first; at <= last; at++ {
			res := runPoint(t, sc, seed, mode, at)
			if t.Failed() {
				return st
			}
			st.runs++
			st.maxOps = max(st.maxOps, res.ops)
			if !res.reached {
				break
			}
			st.points++
			if mode == cpFail {
				st.injected++
				switch {
				case res.returned:
					st.returned++
				case res.surfaced:
					st.logged++
				default:
					st.vanished = append(st.vanished, res.vanished)
				}
			}
		}
	}
	st.elapsed = time.Since(start)
	return st
}

// TestCrashPoints crashes every scenario at each of its device writes and
// syncs in turn and checks the recovered set (see the top of this file).
func TestCrashPoints(t *testing.T) {
	for _, sc := range cpScenarios {
		t.Run(sc.name, func(t *testing.T) {
			st := enumerate(t, sc, cpCrash)
			t.Logf("%s: %d crash points over %d seeds (up to %d writes and syncs per run), %d runs, %v",
				sc.name, st.points, st.seeds, st.maxOps, st.runs, st.elapsed.Round(time.Millisecond))
		})
	}
}

// TestErrorPoints fails each device operation (reads too) of every scenario
// in turn and requires every injected error to surface: returned by the
// operation, or logged as a warning or error naming it.
func TestErrorPoints(t *testing.T) {
	for _, sc := range cpScenarios {
		t.Run(sc.name, func(t *testing.T) {
			st := enumerate(t, sc, cpFail)
			t.Logf("%s: %d errors injected over %d seeds: %d returned, %d logged, %d vanished; %d runs, %v",
				sc.name, st.injected, st.seeds, st.returned, st.logged, len(st.vanished), st.runs, st.elapsed.Round(time.Millisecond))
			if len(st.vanished) > 0 {
				t.Errorf("%d injected errors vanished (neither returned nor logged); replay with -cp-seed S -cp-at N:\n  %s",
					len(st.vanished), strings.Join(st.vanished, "\n  "))
			}
		})
	}
}
