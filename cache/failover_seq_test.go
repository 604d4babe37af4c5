package cache

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// Sequences of errors (TestDeviceFailureModel/seq): several single faults
// on the cache device and on the first backing device, each at the n-th
// read, write (write-zeroes and discards count as writes) or sync of its
// device, some of them bursts of consecutive operations of one kind (a run
// of cacheErrLimit cache errors fails the set over); then one fault at a
// random operation of the reopen (recovery) that follows the run. Every
// fault must surface: its text (which names the device and the operation)
// appears in an error the run got back or in a warning or error the engine
// logged. Wrong data and panics fail the model as in the other targets.

// seqFault is the error of one scheduled fault. Its text names the device
// and the operation, so the test finds it in returned errors and logs.
type seqFault struct {
	dev string
	op  faultdev.Op
}

func (e *seqFault) Error() string {
	return fmt.Sprintf("injected fault <%s#%d %s>", e.dev, e.op.Index, e.op.Kind)
}

// Unwrap returns faultdev.ErrInjected and syscall.EIO, as
// faultdev.InjectedError does.
func (e *seqFault) Unwrap() []error { return []error{faultdev.ErrInjected, syscall.EIO} }

// seqClass groups operation kinds: 0 reads, 1 writes (and write-zeroes,
// discards), 2 syncs.
func seqClass(k faultdev.OpKind) int {
	switch k {
	case faultdev.Read:
		return 0
	case faultdev.Sync:
		return 2
	}
	return 1
}

// seqSched fails the scheduled operations of one device.
type seqSched struct {
	dev    string
	healed *atomic.Bool
	mu     sync.Mutex
	seen   [3]int            // operations so far, per class
	at     map[[2]int]bool   // (class, n) to fail
	fired  []string          // the faults that fired (their texts)
	plan   []string          // the schedule, for the log
	only   func(uint64) bool // reopen: fail by device operation index instead
}

func (q *seqSched) Inject(op faultdev.Op) faultdev.Fault {
	if q.healed != nil && q.healed.Load() {
		return faultdev.Fault{}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	c := seqClass(op.Kind)
	n := q.seen[c]
	q.seen[c]++
	if (q.only != nil && q.only(op.Index)) || q.at[[2]int{c, n}] {
		f := &seqFault{dev: q.dev, op: op}
		q.fired = append(q.fired, f.Error())
		return faultdev.Error(f)
	}
	return faultdev.Fault{}
}

func (q *seqSched) firedFaults() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]string(nil), q.fired...)
}

// newSeqScheds draws a schedule of 2-6 faults (some of them bursts of 3)
// over the cache and backing devices from the seed.
func newSeqScheds(seed uint64, healed *atomic.Bool) (cache, back *seqSched) {
	rng := rand.New(rand.NewPCG(seed, 0x5e9))
	cache = &seqSched{dev: "cache", healed: healed, at: map[[2]int]bool{}}
	back = &seqSched{dev: "back", healed: healed, at: map[[2]int]bool{}}
	for range 2 + rng.IntN(5) {
		q := cache
		if rng.IntN(3) == 0 {
			q = back
		}
		c := rng.IntN(3)
		n := rng.IntN([]int{60, 80, 20}[c])
		burst := 1
		if rng.IntN(3) == 0 {
			burst = cacheErrLimit
		}
		for i := range burst {
			q.at[[2]int{c, n + i}] = true
		}
		q.plan = append(q.plan, fmt.Sprintf("%s %s #%d x%d", q.dev, []string{"read", "write", "sync"}[c], n, burst))
	}
	return cache, back
}

// seqFaultsIn lists the scheduled faults an error wraps.
func seqFaultsIn(err error) []*seqFault {
	var out []*seqFault
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if f, ok := e.(*seqFault); ok {
			out = append(out, f)
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		}
	}
	walk(err)
	return out
}

// wrapsBackingFault reports whether err wraps a fault of the backing device.
func wrapsBackingFault(err error) bool {
	for _, f := range seqFaultsIn(err) {
		if f.dev == "back" {
			return true
		}
	}
	return false
}

// noteErr keeps an error the run got back, for the surfacing check. On
// the mirror target no request may fail: one member lost loses nothing.
func (r *failRun) noteErr(err error) {
	r.t.Helper()
	if err != nil {
		r.errs = append(r.errs, err.Error())
		if r.target == "mirror" {
			r.fatalf("mirror: a request failed with one member lost: %v", err)
		}
	}
}

// checkSeqErr fails the run unless err (from a request, seq target) is an
// injected fault or the failover's refusal of unreachable data.
func (r *failRun) checkSeqErr(what string, err error) {
	r.t.Helper()
	if err != nil && !errors.Is(err, faultdev.ErrInjected) && !errors.Is(err, ErrDirtyUnreachable) && !errors.Is(err, ErrLostWrites) {
		r.fatalf("%s failed with %v, which wraps no injected fault", what, err)
	}
}

// checkSurfaced fails the run if a fault that fired appears in no error
// the run got back and in no logged warning or error.
func (r *failRun) checkSurfaced(scheds ...*seqSched) {
	r.t.Helper()
	errs := strings.Join(r.errs, "\n")
	logs := r.logs.all()
	var vanished []string
	n := 0
	for _, q := range scheds {
		for _, f := range q.firedFaults() {
			n++
			tok := f[strings.Index(f, "<"):]
			if !strings.Contains(errs, tok) && !strings.Contains(logs, tok) {
				vanished = append(vanished, f)
			}
		}
	}
	r.seqInjected += int64(n)
	if len(vanished) > 0 {
		r.fatalf("%d of %d injected faults vanished (neither returned nor logged): %s", len(vanished), n, strings.Join(vanished, "; "))
	}
}

// reopenWithFault reopens the set after the run with one fault at a random
// operation of the cache device during recovery (an error during recovery
// from errors): Open fails with it, or logs it and goes on. Either way the
// healed reopen that follows must find every block allowed.
func (r *failRun) reopenWithFault(cacheMem device.Device, specs []BackingSpec, rng *rand.Rand) {
	r.t.Helper()
	k := uint64(rng.IntN(40))
	q := &seqSched{dev: "reopen", at: map[[2]int]bool{}, only: func(i uint64) bool { return i == k }}
	r.logf("reopen with a fault at cache device op %d", k)
	s, err := Open(faultdev.Wrap(cacheMem, q), specs, OpenOptions{Logger: slog.New(r.logs), ColdClean: r.coldClean(), testing: testingKnobs{noBackground: true}})
	r.logf("reopen with a fault: %v", err)
	r.noteErr(err)
	if err != nil {
		r.checkSeqErr("reopen", err)
	} else {
		if err := s.Check(); err != nil {
			r.fatalf("reopen with a fault at op %d succeeded but Check: %v", k, err)
		}
		s.crashStop()
	}
	r.checkSurfaced(q)
}
