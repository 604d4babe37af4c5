package cache

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

var flagFailSeed = flag.Int64("fail-seed", -1, "run TestDeviceFailureModel for this seed only")

// TestDeviceFailureModel is the model test of failing devices (crash_test's
// oracle style). A cache set over 1–2 volumes runs random writes (aligned
// and sector-granular, some FUA), reads, flushes, write-zeroes, trims, mode
// switches, GC steps and drains while a fault-injecting wrapper breaks one
// device:
//
//   - cache: at a random device operation the cache device dies for good
//     (every operation fails, or only writes and syncs, or only reads),
//     sometimes after scattered transient errors; the set must fail over
//     to passthrough (at once or after cacheErrLimit data errors);
//   - backing: scattered errors, or the backing device dead from a random
//     operation on; the cache set must never fail over because of it, and
//     after the device heals everything must read back;
//   - mirror: the set is mirrored and one member fails (failover_mirror_test.go
//     has the fault and the properties added): no request may fail, the set
//     serves on in writeback mode on the survivor, and whichever way it
//     reopens nothing flushed is lost.
//
// Per block the model keeps the contents a read may return now (one, or
// several after a failed write, which may or may not have landed; a read
// collapses them) and the contents allowed after a restart (the durable one
// and everything written since; FLUSH and FUA collapse them). Properties:
//
//   - a read that succeeds returns an allowed content: never zeroes or
//     older backing data in place of dirty data;
//   - a read that fails wraps ErrDirtyUnreachable (cache target) and, after
//     failover, covers a block that is dirty in the index; reads of other
//     blocks are served from the backing device;
//   - after failover, a write fails only as a fenced write
//     (ErrDirtyUnreachable); Flush fails exactly when the volume lost
//     unflushed writes (ErrLostWrites); Stats report the unreachable data;
//   - after the run the devices are healed and the set reopened: it opens,
//     passes Check, and every block holds a content allowed after a
//     restart (the fence kept the failed cache's dirty data current).
//
// Replay a failure with
//
//	go test ./cache -run TestDeviceFailureModel -fail-seed N -v
func TestDeviceFailureModel(t *testing.T) {
	def := 400
	if testing.Short() || raceEnabled {
		def = 80
	}
	first, seeds := stressSeeds(t, "FAILMODEL", def)
	for _, target := range []string{"cache", "backing", "seq", "mirror"} {
		t.Run(target, func(t *testing.T) {
			if *flagFailSeed >= 0 {
				runFailSeed(t, target, uint64(*flagFailSeed))
				return
			}
			var failovers, unreachable, fenced, lostFlush, injected, seqInjected, degraded, lazy, leafFaults atomic.Int64
			var failed seedFailures
			for seed := first; seed < first+seeds; seed++ {
				ok := t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
					r := runFailSeed(t, target, seed)
					if r.failedOver {
						failovers.Add(1)
					}
					if r.degraded {
						degraded.Add(1)
					}
					if r.lazy {
						lazy.Add(1)
					}
					if r.leafFault {
						leafFaults.Add(1)
					}
					unreachable.Add(r.unreachableReads)
					fenced.Add(r.fencedWrites)
					lostFlush.Add(r.lostFlushes)
					injected.Add(r.injected)
					seqInjected.Add(r.seqInjected)
				})
				if !ok && failed.add(seed) {
					break
				}
			}
			if len(failed.seeds) > 0 {
				t.Fatalf("%s: seeds %v failed (a sweep stops at %d); each failure above prints its replay command",
					target, failed.seeds, maxSeedFailures)
			}
			t.Logf("seeds %d..%d: %d device operations failed; %d sets failed over; %d reads refused on unreachable dirty data, %d fenced writes, %d flushes refused for lost writes",
				first, first+seeds-1, injected.Load(), failovers.Load(), unreachable.Load(), fenced.Load(), lostFlush.Load())
			t.Logf("%d sets opened lazily under the fault (index pages, after a clean close), %d of them failed over on an index leaf they could not read", lazy.Load(), leafFaults.Load())
			if target == "cache" && seeds >= 200 && leafFaults.Load() == 0 {
				t.Errorf("no lazily opened set met an index leaf it could not read: the workload does not exercise leaf faults")
			}
			if target == "seq" {
				t.Logf("seq: %d scheduled faults fired (run and reopen), every one returned or logged", seqInjected.Load())
			}
			if target == "mirror" {
				t.Logf("mirror: %d sets ran degraded on the survivor", degraded.Load())
				if degraded.Load() < int64(seeds/4) {
					t.Errorf("only %d of %d seeds lost a member: the workload does not exercise a degraded mirror", degraded.Load(), seeds)
				}
			}
			if target == "cache" && failovers.Load() < int64(seeds/4) {
				t.Errorf("only %d of %d seeds failed over: the workload does not exercise passthrough", failovers.Load(), seeds)
			}
		})
	}
}

type failVol struct {
	now   [][][]byte // per block: contents a read may return now
	crash [][][]byte // per block: contents allowed after a restart
}

type failRun struct {
	t          *testing.T
	seed       uint64
	target     string
	rng        *rand.Rand
	log        []string
	set        *Set
	vols       []*failVol
	wid        uint64
	failedOver bool
	degraded   bool // mirror: a member failed
	// lazy: the set opened under the fault was opened lazily (a paged
	// seed: its data written and closed cleanly first); leafFault: it
	// found an index leaf it could not read.
	lazy, leafFault bool
	// counted for the summary
	unreachableReads, fencedWrites, lostFlushes int64
	injected                                    int64 // faults fired
	seqInjected                                 int64 // seq: scheduled faults fired, run and reopen
	logs                                        *cpLog
	errs                                        []string // errors the run got back (seq)
}

// coldClean is what docs/OPERATIONS.md tells an operator to do on a
// restart after a failover: recover cold if the log said the failed cache
// device could not record that its clean data is untrusted.
func (r *failRun) coldClean() bool {
	return strings.Contains(r.logs.all(), "start the next server on it with --cold-clean")
}

func (r *failRun) logf(format string, args ...any) {
	r.log = append(r.log, fmt.Sprintf(format, args...))
}

func (r *failRun) fatalf(format string, args ...any) {
	r.t.Helper()
	last := r.log
	if len(last) > 120 {
		last = last[len(last)-120:]
	}
	logs := strings.Split(strings.TrimSpace(r.logs.all()), "\n")
	if len(logs) > 60 {
		logs = logs[len(logs)-60:]
	}
	r.t.Fatalf("%s seed %d: %s\nreplay: go test ./cache -run 'TestDeviceFailureModel/%s' -fail-seed %d -v (background goroutines run: the timing does not replay; -count=N repeats)\nop log:\n  %s\nengine log (warnings and errors, last 60):\n  %s",
		r.target, r.seed, fmt.Sprintf(format, args...), r.target, r.seed, strings.Join(last, "\n  "), strings.Join(logs, "\n  "))
}

// addCand adds c to the set l unless it is there.
func addCand(l [][]byte, c []byte) [][]byte {
	for _, x := range l {
		if bytes.Equal(x, c) {
			return l
		}
	}
	return append(l, c)
}

func runFailSeed(t *testing.T, target string, seed uint64) *failRun {
	rng := rand.New(rand.NewPCG(seed, 0xfa11))
	r := &failRun{t: t, seed: seed, target: target, rng: rng, logs: &cpLog{}}
	bs := int64(blockSize) * int64(2+rng.IntN(3))
	nb := int64(minBuckets + rng.IntN(6))
	nvols := 1 + rng.IntN(2)
	// Paged seeds but the mirror's start from data written and closed
	// cleanly, so that the Open under the fault is lazy: it reads the
	// volumes' index leaves from the failing device when first needed.
	paged := target != "mirror" && testIndexPages(seed)
	cacheMem := device.NewMem(cacheSizeForPaged(nb, bs, minJournalLen, nvols, paged))
	var specs, faultSpecs []BackingSpec
	// The fault: dead from device operation deadAt on (of the given
	// kinds), after transient errors with probability pTransient.
	deadAt := uint64(20 + rng.IntN(600))
	kinds := []string{"all", "all", "writes", "reads"}[rng.IntN(4)]
	pTransient := []float64{0, 0, 0.01, 0.05}[rng.IntN(4)]
	var healed atomic.Bool
	frng := rand.New(rand.NewPCG(seed, 0xbad))
	var fmu sync.Mutex
	inj := faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if healed.Load() {
			return faultdev.Fault{}
		}
		hit := false
		switch kinds {
		case "writes":
			hit = op.Kind != faultdev.Read
		case "reads":
			hit = op.Kind == faultdev.Read
		default:
			hit = true
		}
		if op.Index >= deadAt && hit {
			return faultdev.Error(nil)
		}
		fmu.Lock()
		tr := frng.Float64() < pTransient
		fmu.Unlock()
		if tr {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	})
	var fdCache *faultdev.Device
	var fdBack *faultdev.Device
	var cacheDev device.Device = cacheMem
	var seqC, seqB *seqSched
	var mf *mirrorFault
	if target == "mirror" {
		deadAt = uint64(rng.IntN(620)) // from the first operation: in Open too
	}
	if paged && target == "cache" && seed%2 == 1 {
		// Soon after the lazy Open, while most leaves are still to be
		// read from the device.
		deadAt = 8 + deadAt%40
	}
	if target == "cache" {
		fdCache = faultdev.Wrap(cacheMem, inj)
		cacheDev = fdCache
	}
	if target == "seq" {
		seqC, seqB = newSeqScheds(seed, &healed)
		r.logf("fault schedule: %s", strings.Join(append(seqC.plan, seqB.plan...), ", "))
		fdCache = faultdev.Wrap(cacheMem, seqC)
		cacheDev = fdCache
	}
	for i := 0; i < nvols; i++ {
		b := device.NewMem(int64(16+rng.IntN(32)) * blockSize)
		name := fmt.Sprintf("vol%d", i)
		specs = append(specs, BackingSpec{Name: name, Dev: b})
		var d device.Device = b
		if target == "backing" && i == 0 {
			fdBack = faultdev.Wrap(b, inj)
			d = fdBack
		}
		if target == "seq" && i == 0 {
			fdBack = faultdev.Wrap(b, seqB)
			d = fdBack
		}
		faultSpecs = append(faultSpecs, BackingSpec{Name: name, Dev: d})
		nblk := b.Size() / blockSize
		fv := &failVol{now: make([][][]byte, nblk), crash: make([][][]byte, nblk)}
		for k := range fv.now {
			fv.now[k] = [][]byte{make([]byte, blockSize)}
			fv.crash[k] = [][]byte{make([]byte, blockSize)}
		}
		r.vols = append(r.vols, fv)
	}
	mode := []Mode{Writeback, Writeback, Writethrough, Writearound}[rng.IntN(4)]
	r.logf("format: %d buckets of %d, %d volumes, mode %v; %s dies at op %d (%s), transient p=%.2f", nb, bs, nvols, mode, target, deadAt, kinds, pTransient)
	fopts := FormatOptions{BucketSize: bs, JournalSize: minJournalLen, Mode: mode, markShift: testMarkShift(seed)}
	oopts := OpenOptions{Logger: slog.New(r.logs)}
	if target == "mirror" {
		mf = newMirrorFault(r, cacheMem, specs, fopts, nb, inj)
		fopts.Mirror, cacheDev, oopts.Mirror = mf.mem[mirror.B], mf.dev[mirror.A], mf.dev[mirror.B]
	}
	fopts.IndexPages = paged
	if _, err := Format(cacheMem, specs, fopts); err != nil {
		t.Fatal(err)
	}
	if paged {
		r.lazyPrefix(cacheMem, specs)
	}
	s, err := Open(cacheDev, faultSpecs, oopts)
	if err == nil && s.pg != nil && s.pg.lazy != nil {
		r.lazy = true
		defer func() { r.leafFault = s.leafFaulted() != nil }()
	}
	if err != nil {
		if mf != nil {
			s, err = mf.openMissing(r, faultSpecs, oopts, err)
		}
	}
	if err != nil {
		r.logf("open failed under the fault: %v", err)
		if target == "seq" {
			r.noteErr(err)
			r.checkSeqErr("open", err)
			r.checkSurfaced(seqC, seqB)
		}
		return r
	}
	r.set = s
	defer func() { s.crashStop() }()
	for vi, v := range s.vols {
		st := v.Settings()
		st.WritebackOrder = []WritebackOrder{OrderEpoch, OrderLBA}[rng.IntN(2)]
		st.WritebackPercent = []int{0, 10, 100}[rng.IntN(3)]
		st.SequentialCutoff = []int64{0, 16 << 10}[rng.IntN(2)]
		if err := v.SetSettings(st); err != nil {
			r.logf("settings vol%d: %v", vi, err)
			r.noteErr(err)
		}
	}
	nops := 80 + rng.IntN(80)
	for i := 0; i < nops; i++ {
		r.step()
		if err := s.Check(); err != nil {
			// A lazily opened set's Check reads every leaf: one the
			// dead device cannot give back is its error, and the set
			// fails over at its next commit. That commit may be a
			// background one that runs before the Flush below: the
			// Flush then commits on a failed set and, with nothing
			// lost, succeeds. So only the failover is required here;
			// what it lost is judged by the reads and flushes that
			// follow, as after any failover.
			var fe *index.FaultError
			if !r.lazy || !errors.As(err, &fe) {
				r.fatalf("after op %d: Check: %v", i, err)
			}
			if s.isFailed() {
				continue
			}
			ferr := s.Flush()
			r.logf("check: %v; flush: %v", err, ferr)
			r.noteErr(ferr)
			if !s.isFailed() {
				r.fatalf("after op %d: Check met a leaf it could not read (%v), and the set did not fail over at the next Flush (%v)", i, err, ferr)
			}
		}
	}
	// Every block, one at a time.
	for vi := range r.vols {
		for b := range r.vols[vi].now {
			r.read(vi, int64(b)*blockSize, blockSize)
		}
	}
	st := s.Stats()
	if mf != nil {
		mf.checkRun(r, st)
	}
	if target == "backing" && st.Failed {
		r.fatalf("backing device errors failed the cache set over: %s", st.Cause)
	}
	if st.Failed {
		var dirty int64
		for _, v := range s.vols {
			vs := v.Stats()
			dirty += vs.DirtyBlocks
			if vs.UnreachableDirtyBlocks != vs.DirtyBlocks {
				r.fatalf("vol %s: UnreachableDirtyBlocks %d, DirtyBlocks %d", v.name, vs.UnreachableDirtyBlocks, vs.DirtyBlocks)
			}
			r.unreachableReads += int64(vs.UnreachableReadErrors)
			r.fencedWrites += int64(vs.FencedWriteErrors)
		}
		if st.UnreachableDirtyBlocks != dirty {
			r.fatalf("set: UnreachableDirtyBlocks %d, want %d", st.UnreachableDirtyBlocks, dirty)
		}
		err := s.Drain(context.Background())
		r.noteErr(err)
		if !errors.Is(err, ErrCacheFailed) {
			r.fatalf("Drain after failover: %v, want ErrCacheFailed", err)
		}
	}
	if target == "cache" && fdCache.Injected() > 0 && !st.Failed && deadAt < fdCache.Ops() && kinds != "reads" {
		// Writes or syncs failed for good: a commit of the next write's
		// journal records must fail the set over. A write that leaves
		// no record (mode none or writearound, no entry of the volume
		// findable by a recovery: idx.Replayable) needs no cache I/O,
		// and its flush only syncs the backing device, so the dead
		// device may go unnoticed. (A dead read path alone is noticed
		// only when cached data is read.)
		//
		// Seed 111 (cache target) is such a run: the device dies at op
		// 35 while both volumes are in mode none, every SetMode to a
		// caching mode then fails on the superblock write, and the
		// probe's flush did no cache I/O; it failed over only when an
		// invariants-build random checkpoint synced the device.
		r.wid++
		p := make([]byte, blockSize)
		stamp(p, r.wid, 0, 0)
		err := s.vols[0].WriteAt(p, 0, false)
		r.apply(0, 0, p, err == nil, false)
		pending := s.appended() > s.durable.Load()
		r.logf("probe: vol0 mode %v, records to commit %v", s.vols[0].Mode(), pending)
		if err := s.Flush(); pending && !s.isFailed() {
			r.fatalf("cache device dead since op %d (now %d) and the set has not failed over after committing records (flush: %v)", deadAt, fdCache.Ops(), err)
		}
	}
	if fdBack != nil {
		r.injected += int64(fdBack.Injected())
	}
	if fdCache != nil {
		r.injected += int64(fdCache.Injected())
	}
	s.crashStop()
	if mf != nil {
		// After the stop: a background write (writeback, a checkpoint)
		// may fail the member until then.
		r.injected += int64(mf.fd.Injected())
		st := s.Stats()
		mf.checkStopped(r, st)
		r.degraded = st.Mirror.Degraded
	}
	if target == "seq" {
		r.reopenWithFault(cacheMem, specs, rand.New(rand.NewPCG(seed, 0x5ea)))
		r.checkSurfaced(seqC, seqB)
	}
	// Heal: reopen on the bare devices (a repaired cache device, a
	// restarted process).
	healed.Store(true)
	var s2 *Set
	if mf != nil {
		s2 = mf.reopen(r, specs, r.degraded)
	} else {
		r.logf("heal + reopen")
		s2, err = Open(cacheMem, specs, OpenOptions{ColdClean: r.coldClean()})
		if err != nil {
			r.fatalf("reopen on the healed devices: %v", err)
		}
	}
	r.set = s2
	defer func() { s2.crashStop() }()
	if err := s2.Check(); err != nil {
		r.fatalf("after reopen: Check: %v", err)
	}
	if err := checkCleanCoherent(s2); err != nil {
		r.fatalf("after heal and reopen: %v", err)
	}
	for vi, fv := range r.vols {
		v := s2.vols[vi]
		got := make([]byte, v.Size())
		if err := v.ReadAt(got, 0); err != nil {
			r.fatalf("read after heal: %v", err)
		}
		for b := range fv.crash {
			g := got[b*blockSize : (b+1)*blockSize]
			ok := false
			for _, c := range fv.crash[b] {
				ok = ok || bytes.Equal(g, c)
			}
			if !ok {
				r.fatalf("after heal and reopen, vol%d block %d holds %s; allowed %s", vi, b, describeSectors(g), r.cands(fv.crash[b]))
			}
		}
	}
	r.failedOver = st.Failed
	return r
}

// lazyPrefix writes blocks of every volume through a set on the bare
// devices and closes it cleanly: every write is durable.
func (r *failRun) lazyPrefix(cache device.Device, specs []BackingSpec) {
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		r.fatalf("open for the lazy prefix: %v", err)
	}
	for range 4 * len(r.vols) {
		vi := r.rng.IntN(len(r.vols))
		off, n := r.randRange(vi)
		r.wid++
		p := make([]byte, n)
		stamp(p, r.wid, vi, off)
		err := s.vols[vi].WriteAt(p, off, false)
		r.logf("prefix write w%d vol%d off=%d len=%d: %v", r.wid, vi, off, n, err)
		if err != nil {
			r.fatalf("prefix write: %v", err)
		}
		r.apply(vi, off, p, true, true) // durable: Close commits it
	}
	if err := s.Close(); err != nil {
		r.fatalf("close after the lazy prefix: %v", err)
	}
}

func (r *failRun) cands(l [][]byte) string {
	var s []string
	for _, c := range l {
		s = append(s, describeSectors(c))
	}
	return strings.Join(s, " | ")
}

func (r *failRun) randRange(vi int) (int64, int64) {
	size := int64(len(r.vols[vi].now)) * blockSize
	var off, n int64
	if r.rng.IntN(3) == 0 {
		off = r.rng.Int64N(size/512) * 512
		n = int64(1+r.rng.IntN(16)) * 512
	} else {
		off = r.rng.Int64N(size/blockSize) * blockSize
		n = int64(1+r.rng.IntN(8)) * blockSize
	}
	return off, min(n, size-off)
}

// apply records a write of p at off: ok says it succeeded, fua that it was
// durable on return.
func (r *failRun) apply(vi int, off int64, p []byte, ok, fua bool) {
	fv := r.vols[vi]
	for b := off / blockSize; b <= (off+int64(len(p))-1)/blockSize; b++ {
		lo := max(off, b*blockSize)
		hi := min(off+int64(len(p)), (b+1)*blockSize)
		var next [][]byte
		for _, c := range fv.now[b] {
			n := bytes.Clone(c)
			copy(n[lo-b*blockSize:hi-b*blockSize], p[lo-off:hi-off])
			next = addCand(next, n)
		}
		if ok {
			fv.now[b] = next
		} else {
			for _, n := range next {
				fv.now[b] = addCand(fv.now[b], n)
			}
		}
		if ok && fua {
			fv.crash[b] = append([][]byte(nil), next...)
		} else {
			for _, n := range next {
				fv.crash[b] = addCand(fv.crash[b], n)
			}
		}
	}
}

func (r *failRun) read(vi int, off, n int64) {
	v := r.set.vols[vi]
	fv := r.vols[vi]
	failedBefore := r.set.isFailed()
	first, cnt := blockSpan(off, n)
	// After failover no block becomes dirty, but a writeback batch in
	// flight at the failover may still mark blocks clean (their data is on
	// the backing device): so dirtiness is taken before the read.
	r.set.mu.Lock()
	dirtyBefore := v.dirtyInLocked(first, uint64(cnt))
	r.set.mu.Unlock()
	got := make([]byte, n)
	err := v.ReadAt(got, off)
	r.logf("read vol%d off=%d len=%d: %v", vi, off, n, err)
	if err != nil {
		r.noteErr(err)
		if r.target == "cache" && !errors.Is(err, ErrDirtyUnreachable) {
			r.fatalf("read vol%d off=%d len=%d failed with %v (want ErrDirtyUnreachable or success)", vi, off, n, err)
		}
		if r.target == "seq" {
			r.checkSeqErr(fmt.Sprintf("read vol%d off=%d len=%d", vi, off, n), err)
		}
		if failedBefore && r.target != "backing" {
			r.set.mu.Lock()
			dirty := dirtyBefore || v.dirtyInLocked(first, uint64(cnt))
			r.set.mu.Unlock()
			if !dirty && (r.target == "cache" || errors.Is(err, ErrDirtyUnreachable) || !wrapsBackingFault(err)) {
				r.fatalf("after failover, read vol%d off=%d len=%d of blocks not dirty in the cache failed: %v", vi, off, n, err)
			}
		}
		return
	}
	for b := int64(first); b < int64(first)+int64(cnt); b++ {
		lo := max(off, b*blockSize)
		hi := min(off+n, (b+1)*blockSize)
		var keep [][]byte
		for _, c := range fv.now[b] {
			if bytes.Equal(c[lo-b*blockSize:hi-b*blockSize], got[lo-off:hi-off]) {
				keep = append(keep, c)
			}
		}
		if len(keep) == 0 {
			r.fatalf("read vol%d off=%d len=%d: block %d returned %s; allowed %s (failed over: %t)", vi, off, n, b,
				describeSectors(got[lo-off:hi-off]), r.cands(fv.now[b]), r.set.isFailed())
		}
		fv.now[b] = keep
	}
}

func (r *failRun) step() {
	rng := r.rng
	s := r.set
	vi := rng.IntN(len(r.vols))
	v := s.vols[vi]
	fv := r.vols[vi]
	failedBefore := s.isFailed()
	if failedBefore && !r.failedOver {
		r.failedOver = true
		r.logf("-- failed over: %v", s.Failed())
	}
	switch k := rng.IntN(100); {
	case k < 35, k >= 97:
		off, n := r.randRange(vi)
		fua := rng.IntN(5) == 0
		r.wid++
		p := make([]byte, n)
		stamp(p, r.wid, vi, off)
		zero := k >= 97
		var err error
		if zero {
			clear(p)
			err = v.WriteZeroes(off, n, fua, true, false)
		} else {
			err = v.WriteAt(p, off, fua)
		}
		r.logf("write(zero=%t) w%d vol%d off=%d len=%d fua=%t mode=%v: %v", zero, r.wid, vi, off, n, fua, v.Mode(), err)
		if err != nil && failedBefore && r.target == "cache" && !errors.Is(err, ErrDirtyUnreachable) {
			r.fatalf("after failover, write failed with %v (want success or a fenced write)", err)
		}
		r.noteErr(err)
		if r.target == "seq" {
			r.checkSeqErr("write", err)
		}
		r.apply(vi, off, p, err == nil, fua)
	case k < 60:
		off, n := r.randRange(vi)
		r.read(vi, off, n)
	case k < 70:
		err := v.Flush()
		r.logf("flush vol%d: %v", vi, err)
		r.noteErr(err)
		if r.target == "seq" {
			r.checkSeqErr("flush", err)
			s.mu.Lock()
			lost := v.fo.lost
			s.mu.Unlock()
			if failedBefore && lost > 0 && !errors.Is(err, ErrLostWrites) {
				r.fatalf("after failover, flush: %v with %d lost blocks, want ErrLostWrites", err, lost)
			}
			if failedBefore && lost == 0 && err != nil && !wrapsBackingFault(err) {
				r.fatalf("after failover, flush: %v with no lost block and no backing fault", err)
			}
		}
		if failedBefore && r.target == "cache" {
			s.mu.Lock()
			lost := v.fo.lost
			s.mu.Unlock()
			if (err != nil) != (lost > 0) || (err != nil && !errors.Is(err, ErrLostWrites)) {
				r.fatalf("after failover, flush: %v with %d lost blocks", err, lost)
			}
			if err != nil {
				r.lostFlushes++
			}
		}
		if err == nil {
			for b := range fv.crash {
				fv.crash[b] = append([][]byte(nil), fv.now[b]...)
			}
		}
	case k < 75:
		off, n := r.randRange(vi)
		err := v.Trim(off, n, false)
		r.logf("trim vol%d off=%d len=%d: %v", vi, off, n, err)
		r.noteErr(err)
		a := (off + blockSize - 1) / blockSize
		for b := a; (b+1)*blockSize <= off+n; b++ {
			fv.now[b] = addCand(fv.now[b], make([]byte, blockSize))
			fv.crash[b] = addCand(fv.crash[b], make([]byte, blockSize))
		}
	case k < 82:
		mode := Mode(rng.IntN(4))
		err := v.SetMode(mode)
		r.logf("set-mode vol%d %v: %v", vi, mode, err)
		r.noteErr(err)
	case k < 90:
		r.logf("gc")
		s.evictOne()
	case k < 95:
		n := sweepLogged(s, v, 1+rng.IntN(8))
		r.logf("writeback vol%d: %d blocks", vi, n)
	default:
		err := s.Drain(context.Background())
		r.logf("drain: %v", err)
		r.noteErr(err)
		if err == nil && !s.isFailed() {
			if st := s.Stats(); st.DirtyBlocks != 0 {
				r.fatalf("after drain: %d dirty blocks", st.DirtyBlocks)
			}
		}
	}
}
