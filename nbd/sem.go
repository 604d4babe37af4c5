package nbd

import "sync"

// byteSem bounds the bytes of payload in flight on one connection. Only the
// connection's reader acquires; workers release. A request larger than the
// whole budget is admitted alone (when nothing else is in flight), so it
// cannot deadlock.
type byteSem struct {
	mu     sync.Mutex // guards the fields below
	cond   sync.Cond  // signalled on release and on abort
	max    int64
	used   int64
	closed bool
}

func newByteSem(max int64) *byteSem {
	s := &byteSem{max: max}
	s.cond.L = &s.mu
	return s
}

// acquire blocks until n bytes fit in the budget; it returns false if the
// semaphore was aborted.
func (s *byteSem) acquire(n int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for !s.closed && s.used > 0 && s.used+n > s.max {
		s.cond.Wait()
	}
	if s.closed {
		return false
	}
	s.used += n
	return true
}

func (s *byteSem) release(n int64) {
	s.mu.Lock()
	s.used -= n
	s.mu.Unlock()
	s.cond.Signal()
}

// abort wakes the reader if it is waiting; further acquires fail.
func (s *byteSem) abort() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cond.Broadcast()
}
