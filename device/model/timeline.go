package model

import (
	"container/heap"
	"math"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The range of TimeScale. Model time is int64 nanoseconds: at the smallest
// scale it lasts 10 days of wall time.
const (
	minTimeScale = 1e-4
	maxTimeScale = 1e4
)

// never is the model time of an event that is not scheduled.
const never = int64(math.MaxInt64)

// timeline maps model time (ns since the model was created, scaled) to the
// wall clock, and releases waiters at model times from a single goroutine.
//
// Why one goroutine: on a shared 2-core machine Go's timers fire up to a
// millisecond late when the process is idle, and 32 goroutines each
// sleeping in nanosleep cost 32 threads and their context switches. One loop
// per model sleeps until the earliest event and releases every waiter that
// is due, in batches when it wakes late. On the real clock it waits on a Go
// timer for the bulk of a long wait (the goroutine parks, freeing its P),
// then for the last few milliseconds in one ppoll with a nanosecond timeout
// on its own thread (timer slack lowered to 1 ns), which a poke interrupts
// through an eventfd (see waker); without an eventfd it uses short
// nanosleeps instead. Lateness delays a notification but never moves
// model time: every completion time is computed from model state alone, so
// it cannot accumulate into drift.
//
// Invariants (owner's mu held for waiters):
//
//  1. Every waiter's done channel is closed exactly once: by the loop at or
//     after its model time, or by stop.
//  2. The loop is the only goroutine that sleeps for the model.
type timeline struct {
	t0                    time.Time
	scale                 float64               // wall ns per model ns (1: real time)
	fine                  func(d time.Duration) // precise short sleep (nanosleep); nil under a virtual clock
	kick                  chan struct{}         // cap 1: the owner's state changed
	stop                  chan struct{}         // closed by shutdown
	done                  chan struct{}         // closed when the loop has exited
	wait                  waiterHeap            // REQUIRES: owner's mu
	eng                   engine                // the model's decisions
	mu                    *sync.Mutex           // the owner's lock
	coarse, margin, chunk time.Duration
	stopped               bool                 // REQUIRES: owner's mu; no waiter will be released any more
	late                  func() time.Duration // tests: how late the loop wakes up each time
	waker                 *waker               // the real clock's interruptible sleep; nil: timers and nanosleep
}

// engine is the part of a model that makes decisions at model times (the
// HDD's actuator). advanceLocked makes every decision due at or before now
// and returns the model time of the next one, or never.
type engine interface {
	advanceLocked(now int64) int64
}

type waiter struct {
	at   int64
	done chan struct{}
}

type waiterHeap []waiter

func (h waiterHeap) Len() int           { return len(h) }
func (h waiterHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h waiterHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *waiterHeap) Push(x any)        { *h = append(*h, x.(waiter)) }
func (h *waiterHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	*h = old[:len(old)-1]
	return w
}

// nanosleep is the precise short sleep on the real clock.
func nanosleep(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	_ = unix.Nanosleep(&ts, nil) // EINTR: waking early is harmless, the loop rechecks
}

// newTimeline returns a timeline for the model eng guarded by mu. Under a
// virtual clock (testing/synctest) every wait is a Go timer, which the
// bubble fakes exactly; on the real clock the last stretch of each wait is
// a nanosleep.
func newTimeline(mu *sync.Mutex, eng engine, scale float64, virtual bool) *timeline {
	if !(scale > 0) || math.IsInf(scale, 0) {
		scale = 1
	}
	fine := nanosleep
	var w *waker
	if virtual {
		fine = nil
	} else if wk, err := newWaker(); err == nil {
		w = wk // else: timers and nanosleep chunks
	}
	return &timeline{
		t0:     time.Now(),
		scale:  scale,
		fine:   fine,
		kick:   make(chan struct{}, 1),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
		eng:    eng,
		waker:  w,
		mu:     mu,
		coarse: 3 * time.Millisecond,
		margin: 2500 * time.Microsecond,
		chunk:  100 * time.Microsecond,
	}
}

// now is the current model time.
func (tl *timeline) now() int64 {
	return int64(float64(time.Since(tl.t0)) / tl.scale)
}

// wall converts a model duration into a wall-clock one.
func (tl *timeline) wall(d int64) time.Duration {
	return time.Duration(float64(d) * tl.scale)
}

// poke tells the loop that the owner's state changed.
func (tl *timeline) poke() {
	select {
	case tl.kick <- struct{}{}:
	default:
	}
	if tl.waker != nil {
		tl.waker.wake()
	}
}

// closedCh is a done channel for waits that are already over.
var closedCh = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// addLocked returns a channel closed at model time at.
// REQUIRES: tl.mu
func (tl *timeline) addLocked(at int64) <-chan struct{} {
	if at <= tl.now() {
		return closedCh
	}
	c := make(chan struct{})
	tl.releaseAtLocked(at, c)
	return c
}

// releaseAtLocked arranges for c to be closed at model time at.
// REQUIRES: tl.mu
func (tl *timeline) releaseAtLocked(at int64, c chan struct{}) {
	earliest := len(tl.wait) == 0 || at < tl.wait[0].at
	heap.Push(&tl.wait, waiter{at: at, done: c})
	if earliest {
		tl.poke()
	}
}

// waitUntil returns at model time at (at once if it has passed, or if the
// timeline has shut down).
func (tl *timeline) waitUntil(at int64) {
	if at <= tl.now() {
		return
	}
	tl.mu.Lock()
	if tl.stopped {
		tl.mu.Unlock()
		return
	}
	c := make(chan struct{})
	tl.releaseAtLocked(at, c)
	tl.mu.Unlock()
	<-c
}

// run is the loop; it returns after shutdown.
func (tl *timeline) run() {
	defer close(tl.done)
	if tl.fine != nil {
		// The loop's nanosleeps overshoot by the thread's timer slack
		// (50 µs by default), as much as an SSD's whole latency. Lower it
		// on a thread of the loop's own: the thread exits with the loop
		// (a goroutine that returns while locked takes its thread along),
		// so no other goroutine ever runs with the setting.
		runtime.LockOSThread()
		_ = unix.Prctl(unix.PR_SET_TIMERSLACK, 1, 0, 0, 0) // best effort
	}
	var timer *time.Timer
	for {
		select {
		case <-tl.stop:
			return
		default:
		}
		if tl.late != nil {
			time.Sleep(tl.late())
		}
		tl.mu.Lock()
		now := tl.now()
		next := tl.eng.advanceLocked(now)
		for len(tl.wait) > 0 && tl.wait[0].at <= now {
			close(heap.Pop(&tl.wait).(waiter).done)
		}
		if len(tl.wait) > 0 {
			next = min(next, tl.wait[0].at)
		}
		tl.mu.Unlock()
		if next == never {
			select {
			case <-tl.kick:
				continue
			case <-tl.stop:
				return
			}
		}
		// Sleep until next, waking early when kicked.
		for {
			d := tl.wall(next - tl.now())
			if d <= 0 {
				break
			}
			if tl.waker != nil && d <= tl.coarse {
				if tl.waker.sleep(d, tl.kick, tl.stop) {
					break
				}
				continue
			}
			if tl.fine == nil || d > tl.coarse {
				// A Go timer: for the bulk of a long wait (it may fire up
				// to a millisecond late, so stop margin short of next), or
				// for all of it under a virtual clock, where it is exact.
				if tl.fine != nil {
					d -= tl.margin
				}
				if timer == nil {
					timer = time.NewTimer(d)
				} else {
					timer.Reset(d)
				}
				select {
				case <-timer.C:
					continue
				case <-tl.kick:
				case <-tl.stop:
					timer.Stop()
					return
				}
				timer.Stop()
				break
			}
			// The last stretch in short precise sleeps, checking for
			// kicks between them.
			tl.fine(min(d, tl.chunk))
			select {
			case <-tl.kick:
			case <-tl.stop:
				return
			default:
				continue
			}
			break
		}
	}
}

// shutdown stops the loop, waits for it and releases every waiter.
func (tl *timeline) shutdown() {
	select {
	case <-tl.stop:
	default:
		close(tl.stop)
	}
	if tl.waker != nil {
		tl.waker.wake()
	}
	<-tl.done
	if tl.waker != nil {
		tl.waker.close()
	}
	tl.mu.Lock()
	for _, w := range tl.wait {
		close(w.done)
	}
	tl.wait = nil
	tl.stopped = true
	tl.mu.Unlock()
}
