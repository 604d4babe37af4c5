// Package backoff paces the retries of an operation that keeps failing
// for a reason outside the cache, and keeps its log to one line per state
// change.
package backoff

import (
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Retry paces the retries of an operation that keeps failing for a
// reason outside the cache (writeback against a failing or full backing
// device): the wait doubles from backoffMin with each failure in a row, up
// to backoffMax, and a success resets it. It logs once per state change
// (failing, recovered) and a summary every backoffSummary while failing,
// instead of a line per attempt; the summary and the recovered line list
// the distinct errors of the failing state (up to maxErrs), so that no
// failure goes unseen. It counts attempts for the metrics. Safe for
// concurrent use.
type Retry struct {
	log  *slog.Logger
	what string // what is retried, for the log: "writeback"
	attr []any  // log attributes naming the subject, e.g. "volume", name

	// now is the clock (time.Now; tests step it).
	now func() time.Time

	mu       sync.Mutex
	wait     time.Duration // current wait; 0: not failing
	since    time.Time     // start of the failing state
	lastLog  time.Time     // last failing or summary line
	inState  uint64        // failures in this failing state
	lastErr  error
	errs     []string      // distinct errors in this failing state, at most maxErrs
	failures atomic.Uint64 // failed attempts, ever (metric)
	failing  atomic.Bool   // in a failing state (metric)
}

const (
	backoffMin     = 100 * time.Millisecond
	backoffMax     = 30 * time.Second
	backoffSummary = time.Minute
	maxErrs        = 8
)

// New returns a Retry for what (named in its log lines with attr).
func New(log *slog.Logger, what string, attr ...any) *Retry {
	return &Retry{log: log, what: what, attr: attr, now: time.Now}
}

// Failed records a failed attempt and returns how long to wait before the
// next one.
func (b *Retry) Failed(err error) time.Duration {
	b.failures.Add(1)
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	b.inState++
	b.lastErr = err
	if e := err.Error(); len(b.errs) < maxErrs && !slices.Contains(b.errs, e) {
		b.errs = append(b.errs, e)
	}
	if b.wait == 0 {
		b.wait, b.since, b.lastLog = backoffMin, now, now
		b.failing.Store(true)
		b.log.Warn(b.what+" failing; retrying with backoff", append(b.attr, "err", err, "retry_in", b.wait, "max_wait", backoffMax)...)
		return b.wait
	}
	b.wait = min(2*b.wait, backoffMax)
	if now.Sub(b.lastLog) >= backoffSummary {
		b.lastLog = now
		b.log.Warn(b.what+" still failing", append(b.attr, "failures", b.inState, "for", now.Sub(b.since).Round(time.Second), "last_err", err, "errors", strings.Join(b.errs, "; "), "retry_in", b.wait)...)
	}
	return b.wait
}

// OK records a successful attempt: a failing state ends.
func (b *Retry) OK() {
	if !b.failing.Load() {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.wait == 0 {
		return
	}
	b.log.Info(b.what+" recovered", append(b.attr, "failures", b.inState, "after", b.now().Sub(b.since).Round(time.Millisecond), "last_err", b.lastErr, "errors", strings.Join(b.errs, "; "))...)
	b.wait, b.inState, b.lastErr, b.errs = 0, 0, nil, nil
	b.failing.Store(false)
}

// Failures returns the failed attempts ever, and whether the operation is
// failing now (metrics).
func (b *Retry) Failures() (n uint64, failing bool) { return b.failures.Load(), b.failing.Load() }
