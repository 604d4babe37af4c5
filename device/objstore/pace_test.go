package objstore

import (
	"errors"
	"testing"
	"time"
)

// TestPace: garbage collection's rate limit. pace lets n bytes go once
// n/rate seconds have passed since start and waits otherwise; a closed
// stop channel tells the two apart without timing anything (a pace that
// would wait returns errGCStopped at once, one that need not returns nil).
func TestPace(t *testing.T) {
	stopped := make(chan struct{})
	close(stopped)
	now := time.Now()
	cases := []struct {
		name     string
		start    time.Time
		n, rate  int64
		wantWait bool
	}{
		{"1 MiB at 1 MiB/s, started now", now, 1 << 20, 1 << 20, true},
		{"1 MiB at 1 MiB/s, started 10 s ago", now.Add(-10 * time.Second), 1 << 20, 1 << 20, false},
		{"64 MiB at 16 MiB/s, started 1 s ago", now.Add(-time.Second), 64 << 20, 16 << 20, true},
		{"64 MiB at 16 MiB/s, started 10 s ago", now.Add(-10 * time.Second), 64 << 20, 16 << 20, false},
		{"nothing read yet", now, 0, 1 << 20, false},
		{"unbounded", now, 1 << 30, -1, false},
	}
	for _, c := range cases {
		err := pace(c.start, c.n, c.rate, stopped)
		switch {
		case c.wantWait && !errors.Is(err, errGCStopped):
			t.Errorf("%s: pace returned %v, want it to wait (errGCStopped with stop closed)", c.name, err)
		case !c.wantWait && err != nil:
			t.Errorf("%s: pace returned %v, want no wait", c.name, err)
		}
	}
}
