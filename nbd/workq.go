package nbd

import (
	"runtime"
	"sync"
)

// workQueue hands requests from a connection's reader to its workers
// without a channel handoff (and usually a thread wake-up) per request.
//
// A worker that finishes a request takes the next one from the queue
// itself, and before it parks it yields a few times (workerSpins) in case
// the reader queues more. A worker is woken (a parked one, or a new one up
// to MaxWorkers) only when no worker is "polling" (woken, just started or
// spinning, so about to look at the queue) and:
//
//   - the reader has queued wakeQueued requests (during a burst), or
//   - the reader is about to block with requests queued (kick: before a
//     socket read, before waiting for budget, when the reader stops), or
//   - a worker took a request and left others queued: that request may be
//     slow, so the others get a worker of their own.
//
// The last two rules keep the guarantee of the channel design: a request
// never waits behind a slow one while a worker could run it (only, within a
// burst, for the microseconds until the reader finishes parsing it).
type workQueue struct {
	mu      sync.Mutex
	cond    sync.Cond  // parked workers wait here; L is &mu
	q       []*request // FIFO: q[head:]
	head    int
	workers int  // started and not exited
	polling int  // workers about to look at q (woken, started or spinning)
	parked  int  // workers waiting on cond
	closed  bool // the reader is done; workers exit when q is empty
}

const (
	// wakeQueued is how many queued requests make the reader wake a worker
	// while it is still parsing a burst.
	wakeQueued = 4
	// workerSpins is how often an idle worker yields before parking.
	workerSpins = 3
)

// push queues r. It returns true if the caller must start a worker
// (counted already).
func (w *workQueue) push(r *request, maxWorkers int) bool {
	w.mu.Lock()
	w.q = append(w.q, r)
	start := false
	if w.polling == 0 && len(w.q)-w.head >= wakeQueued {
		start = w.wakeLocked(maxWorkers)
	}
	w.mu.Unlock()
	return start
}

// pending reports whether requests are queued and no worker is looking
// for them.
func (w *workQueue) pending() bool {
	w.mu.Lock()
	p := w.polling == 0 && len(w.q) > w.head
	w.mu.Unlock()
	return p
}

// kick wakes or starts a worker if requests are queued and no worker is
// polling. It returns true if the caller must start a worker.
func (w *workQueue) kick(maxWorkers int) bool {
	w.mu.Lock()
	start := false
	if w.polling == 0 && len(w.q) > w.head {
		start = w.wakeLocked(maxWorkers)
	}
	w.mu.Unlock()
	return start
}

// wakeLocked makes one more worker poll: a parked one, else a new one if
// allowed (then it returns true). With MaxWorkers busy, the queued
// requests wait for the first worker to finish. REQUIRES: w.mu held.
func (w *workQueue) wakeLocked(maxWorkers int) bool {
	switch {
	case w.parked > 0:
		w.parked--
		w.polling++
		w.cond.Signal()
	case w.workers < maxWorkers:
		w.workers++
		w.polling++
		return true
	}
	return false
}

// next returns the next request for a worker, waiting for one if needed,
// or nil when the queue is closed and empty (the worker must exit); start
// as for push (a worker that takes a request while more are queued and no
// other worker is polling wakes one). A
// worker's first call finds it counted in polling already (by
// wakeLocked); later calls (done set: it just handled a request) count it.
func (w *workQueue) next(done bool, maxWorkers int) (_ *request, start bool) {
	w.mu.Lock()
	if done {
		w.polling++
	}
	for spins := 0; ; {
		if w.head < len(w.q) {
			r := w.q[w.head]
			w.q[w.head] = nil
			w.head++
			if w.head == len(w.q) {
				w.q, w.head = w.q[:0], 0
			}
			w.polling--
			// More is queued and nobody else will look: wake one more
			// worker, since this request may be slow.
			start := false
			if w.head < len(w.q) && w.polling == 0 {
				start = w.wakeLocked(maxWorkers)
			}
			w.mu.Unlock()
			return r, start
		}
		if w.closed {
			w.polling--
			w.workers--
			w.mu.Unlock()
			return nil, false
		}
		if spins < workerSpins {
			spins++
			w.mu.Unlock()
			runtime.Gosched()
			w.mu.Lock()
			continue
		}
		// Park. Whoever wakes us counts us as polling again.
		w.polling--
		w.parked++
		w.cond.Wait()
		spins = 0
	}
}

// close makes workers exit once the queue is empty.
func (w *workQueue) close() {
	w.mu.Lock()
	w.closed = true
	w.polling += w.parked
	w.parked = 0
	w.mu.Unlock()
	w.cond.Broadcast()
}
