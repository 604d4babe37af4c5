package objstore

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// DefaultLeaseTTL is how long a lease lives without renewal. The owner
// renews it every third of that, and stops acknowledging Syncs once its
// last renewal is older than the TTL, so that a takeover after expiry
// never loses an acknowledged flush (given clocks that agree to well
// within the TTL).
const DefaultLeaseTTL = 30 * time.Second

// OwnedError is the refusal to open or remove an image another process
// holds.
type OwnedError struct {
	Loc   Location
	Lease layout.Lease
	Age   time.Duration // since its last renewal
}

func (e *OwnedError) Error() string {
	return fmt.Sprintf("%s is owned by %s pid %d (generation %d), lease renewed %s ago (expires after %s); take it over only if that process is gone (--force)",
		e.Loc.Name(), e.Lease.Host, e.Lease.PID, e.Lease.Gen, e.Age.Round(time.Second), e.Lease.TTL)
}

func (e *OwnedError) Unwrap() error { return ErrOwned }

// readLease returns the lease (nil if none) and its age.
func (s *store) readLease() (*layout.Lease, time.Duration, error) {
	l, _, age, err := s.readLeaseETag()
	return l, age, err
}

func (s *store) readLeaseETag() (*layout.Lease, string, time.Duration, error) {
	p, etag, err := s.getETag(layout.LeaseName)
	if errors.Is(err, errNoObject) {
		return nil, "", 0, nil
	}
	if err != nil {
		return nil, "", 0, err
	}
	l, err := layout.DecodeLease(p)
	if err != nil {
		return nil, "", 0, fmt.Errorf("%s: %w", s.loc.Name(), err)
	}
	return l, etag, time.Since(l.Renewed), nil
}

// lease is a held lease.
type lease struct {
	s *store
	// mu serializes renewals (the renewal loop and a Sync's) and guards
	// the fields below.
	mu      sync.Mutex
	l       layout.Lease
	etag    string
	renewed time.Time // local time the last successful write started
}

// acquireLease takes the image's lease: created if absent, taken over if
// expired or force, else refused with an *OwnedError.
func acquireLease(s *store, ttl time.Duration, force bool) (*lease, error) {
	host, _ := os.Hostname()
	var nonce [8]byte
	rand.Read(nonce[:])
	ls := &lease{s: s, l: layout.Lease{Host: host, PID: os.Getpid(), Nonce: hex.EncodeToString(nonce[:]), TTL: ttl}}
	start := time.Now()
	ls.l.Renewed = start.UTC()
	p, err := layout.EncodeLease(&ls.l)
	if err != nil {
		return nil, err
	}
	etag, err := s.put(layout.LeaseName, p, putIfAbsent, "")
	if errors.Is(err, errPrecondition) {
		old, oldETag, age, rerr := s.readLeaseETag()
		if rerr != nil {
			return nil, rerr
		}
		if old != nil && old.Nonce == ls.l.Nonce {
			// Our own create landed and its answer was lost (the retry
			// found it).
			ls.etag, ls.renewed = oldETag, start
			return ls, nil
		}
		if old != nil && age <= old.TTL && !force && !deadHere(old) {
			return nil, &OwnedError{Loc: s.loc, Lease: *old, Age: age}
		}
		cond, tag := putIfMatch, oldETag
		if old == nil { // released meanwhile
			cond, tag = putIfAbsent, ""
		}
		etag, err = s.put(layout.LeaseName, p, cond, tag)
		if errors.Is(err, errPrecondition) {
			return nil, fmt.Errorf("%s: another process took the lease at the same time: %w", s.loc.Name(), ErrOwned)
		}
	}
	if err != nil {
		return nil, err
	}
	ls.etag, ls.renewed = etag, start
	return ls, nil
}

// deadHere reports whether the lease names a process of this host that no
// longer exists (a server restarted after a crash need not wait out its
// own lease). A reused pid counts as alive: the safe direction.
func deadHere(l *layout.Lease) bool {
	host, err := os.Hostname()
	if err != nil || l.Host != host || l.PID <= 0 || l.PID == os.Getpid() {
		return false
	}
	return syscall.Kill(l.PID, 0) == syscall.ESRCH
}

// renew rewrites the lease if it is still ours (errPrecondition if not).
func (ls *lease) renew(gen uint64) error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	start := time.Now()
	l := ls.l
	l.Gen, l.Renewed = gen, start.UTC()
	p, err := layout.EncodeLease(&l)
	if err != nil {
		return err
	}
	etag, err := ls.s.put(layout.LeaseName, p, putIfMatch, ls.etag)
	if errors.Is(err, errPrecondition) {
		// Our own earlier attempt may have landed (its answer lost, the
		// retry refused): then the lease is ours (our nonce), exactly
		// what we wrote or an earlier renewal. Another nonce, or no
		// lease, is another holder's doing.
		cur, curETag, _, rerr := ls.s.readLeaseETag()
		switch {
		case rerr != nil:
			err = rerr
		case cur != nil && cur.Nonce == ls.l.Nonce && cur.Renewed.Equal(l.Renewed):
			etag, err = curETag, nil
		case cur != nil && cur.Nonce == ls.l.Nonce:
			etag, err = ls.s.put(layout.LeaseName, p, putIfMatch, curETag)
		}
	}
	if err != nil {
		return err
	}
	ls.l, ls.etag, ls.renewed = l, etag, start
	return nil
}

// valid reports whether the lease is certainly still ours.
func (ls *lease) valid() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return time.Since(ls.renewed) < ls.l.TTL
}

// release deletes the lease if it is still ours.
func (ls *lease) release() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	cur, etag, _, err := ls.s.readLeaseETag()
	if err != nil || cur == nil || etag != ls.etag {
		return err
	}
	return ls.s.remove(layout.LeaseName)
}
