package admin

import (
	"testing"
	"time"
)

// TestHistogramBuckets: every duration falls in a bucket whose upper
// bound is at least it and less than 12.5% above it, and buckets are
// ordered.
func TestHistogramBuckets(t *testing.T) {
	prev := uint64(0)
	for i := 1; i < 62*histSub; i++ {
		if u := histUpper(i); u <= prev {
			t.Fatalf("bucket %d upper %d <= bucket %d's %d", i, u, i-1, prev)
		} else {
			prev = u
		}
	}
	for _, ns := range []uint64{0, 1, 7, 8, 9, 15, 16, 1000, 1023, 1024, 123456, 1e9, 1<<62 + 12345} {
		i := histBucket(ns)
		u := histUpper(i)
		if u < ns || (ns >= histSub && float64(u-ns) > 0.125*float64(ns)) {
			t.Errorf("%d ns: bucket %d, upper %d", ns, i, u)
		}
		if i > 0 && histUpper(i-1) >= ns {
			t.Errorf("%d ns: bucket %d, but bucket %d's upper %d holds it", ns, i, i-1, histUpper(i-1))
		}
	}
}

// TestLatencyPercentiles: 990 fast and 10 slow observations give a p50
// and p99 near the fast value and a p99.9 near the slow one; Sub of an
// earlier summary leaves only the later observations.
func TestLatencyPercentiles(t *testing.T) {
	var h histogram
	for range 990 {
		h.observe(100 * time.Microsecond)
	}
	for range 10 {
		h.observe(20 * time.Millisecond)
	}
	s := h.summary("read", "")
	near := func(what string, got, want float64) {
		t.Helper()
		if got < want || got > want*1.125+1 {
			t.Errorf("%s = %.1f µs, want %.0f µs (+12.5%%)", what, got, want)
		}
	}
	if s.Count != 1000 {
		t.Errorf("count %d", s.Count)
	}
	near("p50", s.P50Micros, 100)
	near("p99", s.P99Micros, 100)
	near("p99.9", s.P999Micros, 20000)
	if m := s.MeanMicros; m < 298 || m > 300 {
		t.Errorf("mean = %.1f µs, want 299", m)
	}
	for range 100 {
		h.observe(5 * time.Millisecond)
	}
	d := h.summary("read", "").Sub(s)
	if d.Count != 100 {
		t.Errorf("interval count %d, want 100", d.Count)
	}
	near("interval p50", d.P50Micros, 5000)
	near("interval mean", d.MeanMicros, 5000)
}

func TestSnakeName(t *testing.T) {
	for in, want := range map[string]string{"ReadHitBytes": "read_hit_bytes", "GCMoves": "gc_moves", "ReadOps": "read_ops",
		"ThrottleNanos": "throttle_nanos", "ID": "id", "BypassBytes": "bypass_write_bytes", "WritebackRate": "writeback_target_rate"} {
		if got := SnakeName(in); got != want {
			t.Errorf("SnakeName(%q) = %q, want %q", in, got, want)
		}
	}
}
