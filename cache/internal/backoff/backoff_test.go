package backoff

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestRetryBackoff: the wait doubles up to its cap, a success resets it,
// and the log has one line per state change plus a summary a minute, not
// one per attempt.
func TestRetryBackoff(t *testing.T) {
	var logBuf bytes.Buffer
	b := New(slog.New(slog.NewTextHandler(&logBuf, nil)), "writeback", "volume", "v")
	now := time.Unix(1000, 0)
	b.now = func() time.Time { return now }
	fail := errors.New("EIO")
	var waits []time.Duration
	var total time.Duration
	for total < 3*time.Minute {
		d := b.Failed(fail)
		waits = append(waits, d)
		total += d
		now = now.Add(d)
	}
	if waits[0] != backoffMin || waits[1] != 2*backoffMin || waits[len(waits)-1] != backoffMax {
		t.Fatalf("waits %v: want %v doubling to %v", waits, backoffMin, backoffMax)
	}
	if !b.failing.Load() || b.failures.Load() != uint64(len(waits)) {
		t.Fatalf("failing %t, failures %d after %d", b.failing.Load(), b.failures.Load(), len(waits))
	}
	lines := strings.Count(logBuf.String(), "\n")
	// One "failing" line, then a summary at most once a minute.
	if lines < 2 || lines > 1+int(total/backoffSummary) {
		t.Fatalf("%d log lines for %d failures over %v:\n%s", lines, len(waits), total, logBuf.String())
	}
	b.OK()
	b.OK()
	if b.failing.Load() || !strings.Contains(logBuf.String(), "writeback recovered") || strings.Count(logBuf.String(), "recovered") != 1 {
		t.Fatalf("after OK: failing %t\n%s", b.failing.Load(), logBuf.String())
	}
	if d := b.Failed(fail); d != backoffMin {
		t.Fatalf("first failure after recovery waits %v, want %v", d, backoffMin)
	}
}

// TestRetryLogsEveryError: a failing state of three distinct errors logs
// each of them, in two lines (failing, recovered); the same error again
// is listed once.
func TestRetryLogsEveryError(t *testing.T) {
	var logBuf bytes.Buffer
	b := New(slog.New(slog.NewTextHandler(&logBuf, nil)), "writeback", "volume", "v")
	now := time.Unix(1000, 0)
	b.now = func() time.Time { return now }
	for _, e := range []string{"EIO at 0", "EIO at 8", "EIO at 0", "ENOSPC at 16"} {
		now = now.Add(b.Failed(errors.New(e)))
	}
	b.OK()
	out := logBuf.String()
	for _, e := range []string{"EIO at 0", "EIO at 8", "ENOSPC at 16"} {
		if !strings.Contains(out, e) {
			t.Errorf("%q is not in the log:\n%s", e, out)
		}
	}
	if n := strings.Count(out, "\n"); n != 2 {
		t.Errorf("%d log lines for one failing state, want 2:\n%s", n, out)
	}
	if n := strings.Count(out, "EIO at 0"); n != 2 {
		t.Errorf("EIO at 0 in %d places, want 2 (the failing line, once in the recovered line's errors):\n%s", n, out)
	}
}
