package nbd

import (
	"log/slog"
	"runtime"
	"runtime/debug"
	"sync"
	"time"
)

// budget bounds the payload bytes in flight on all of a server's
// connections together. Each connection may hold up to its reserve without
// drawing on the shared pool, so that connections which stop reading their
// replies (and so never release what they hold) cannot take the last byte
// from the others: a well-behaved client always has its reserve. Beyond
// the reserve a connection draws on the pool, up to its own cap
// (Config.MaxInFlightBytes). Total payload memory is bounded by
// MaxConnections x reserve + pool (+ one request larger than the pool,
// admitted when the pool is empty so that it cannot wait forever).
//
// After a load peak the payload buffers (pooled in sync.Pools that only a
// GC empties) would stay with the process; when nothing is in flight any
// more the budget hands the memory back to the OS (trim).
type budget struct {
	mu      sync.Mutex // guards every field below and those of each byteSem
	pool    int64      // bytes of the shared pool
	used    int64      // pool bytes held (beyond connections' reserves)
	total   int64      // all bytes held, reserves included
	waiters map[*byteSem]struct{}

	// Trimming: peak is the most held since the last trim; a trim is
	// scheduled (timer) when total drops to 0 after a peak of at least
	// trimAfter, at most once per trimEvery.
	peak      int64
	trimAfter int64
	lastTrim  time.Time
	timer     *time.Timer
	log       *slog.Logger
}

const trimEvery = 10 * time.Second

func newBudget(pool, trimAfter int64, log *slog.Logger) *budget {
	return &budget{pool: pool, trimAfter: trimAfter, waiters: map[*byteSem]struct{}{}, log: log}
}

// byteSem is one connection's share of the budget. Only the connection's
// reader acquires; workers release. A request larger than the
// connection's cap is admitted alone (when nothing else of the connection
// is in flight), so it cannot deadlock.
type byteSem struct {
	b       *budget
	cond    sync.Cond // L is b.mu; signalled on release and on abort
	max     int64     // the connection's cap
	reserve int64     // held without drawing on the pool
	used    int64
	closed  bool
}

func (b *budget) newSem(max, reserve int64) *byteSem {
	s := &byteSem{b: b, max: max, reserve: reserve}
	s.cond.L = &b.mu
	return s
}

// beyond is how much of used bytes comes from the pool.
func (s *byteSem) beyond(used int64) int64 { return max(0, used-s.reserve) }

// acquire blocks until n bytes fit in the connection's cap and the pool;
// it returns false if the semaphore was aborted.
func (s *byteSem) acquire(n int64) bool {
	b := s.b
	b.mu.Lock()
	defer b.mu.Unlock()
	for {
		if s.closed {
			return false
		}
		if s.takeLocked(n) {
			return true
		}
		b.waiters[s] = struct{}{}
		s.cond.Wait()
		delete(b.waiters, s)
	}
}

// tryAcquire is acquire without waiting: it reports whether it took n
// bytes (false also when the semaphore was aborted).
func (s *byteSem) tryAcquire(n int64) bool {
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	return !s.closed && s.takeLocked(n)
}

// takeLocked takes n bytes if they fit now. REQUIRES: s.b.mu
func (s *byteSem) takeLocked(n int64) bool {
	b := s.b
	need := s.beyond(s.used+n) - s.beyond(s.used)
	if (s.used == 0 || s.used+n <= s.max) && (need == 0 || b.used == 0 || b.used+need <= b.pool) {
		s.used += n
		b.used += need
		b.total += n
		b.peak = max(b.peak, b.total)
		return true
	}
	return false
}

func (s *byteSem) release(n int64) {
	b := s.b
	b.mu.Lock()
	freed := s.beyond(s.used) - s.beyond(s.used-n)
	s.used -= n
	b.used -= freed
	b.total -= n
	if freed > 0 {
		for w := range b.waiters {
			w.cond.Signal()
		}
	}
	s.cond.Signal()
	if b.total == 0 && b.peak >= b.trimAfter && b.timer == nil {
		b.timer = time.AfterFunc(max(time.Second, time.Until(b.lastTrim.Add(trimEvery))), b.trim)
	}
	b.mu.Unlock()
}

// abort wakes the reader if it is waiting; further acquires fail.
func (s *byteSem) abort() {
	s.b.mu.Lock()
	s.closed = true
	s.b.mu.Unlock()
	s.cond.Broadcast()
}

// trim returns the memory of idle payload buffers to the OS if nothing is
// in flight (else the next time nothing is).
func (b *budget) trim() {
	b.mu.Lock()
	b.timer = nil
	if b.total > 0 {
		b.mu.Unlock()
		return
	}
	peak := b.peak
	b.peak = 0
	b.lastTrim = time.Now()
	b.mu.Unlock()
	// A GC moves sync.Pool contents to the victim cache, the next one
	// (FreeOSMemory's) frees them and returns the pages.
	runtime.GC()
	debug.FreeOSMemory()
	b.log.Debug("nbd: nothing in flight after a peak: returned idle buffer memory to the OS", "peak_bytes", peak, "took", time.Since(b.lastTrim))
}

// stop cancels a pending trim.
func (b *budget) stop() {
	b.mu.Lock()
	if b.timer != nil {
		b.timer.Stop()
		b.timer = nil
	}
	b.mu.Unlock()
}
