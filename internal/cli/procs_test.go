package cli

import (
	"runtime"
	"testing"
)

// TestServingProcs: --procs auto runs with one processor per connection
// serving, at most Go's default, and Go's default again when none serves;
// --procs N fixes the count; GOMAXPROCS in the environment wins over both;
// anything else is refused.
func TestServingProcs(t *testing.T) {
	for _, c := range []struct{ conns, cpus, want int }{
		{0, 8, 8}, {1, 8, 1}, {3, 8, 3}, {8, 8, 8}, {20, 8, 8}, {1, 1, 1}, {0, 1, 1},
	} {
		if got := procsFor(c.conns, c.cpus); got != c.want {
			t.Errorf("procsFor(%d, %d) = %d, want %d", c.conns, c.cpus, got, c.want)
		}
	}
	cpus := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(cpus) })
	t.Setenv("GOMAXPROCS", "")
	hook, err := servingProcs("auto")
	if err != nil || hook == nil {
		t.Fatalf("auto: hook %v, %v", hook != nil, err)
	}
	for _, n := range []int{1, 2, 0, 1, 0} {
		hook(n)
		if got, want := runtime.GOMAXPROCS(0), procsFor(n, cpus); got != want {
			t.Errorf("auto, %d connections: GOMAXPROCS %d, want %d", n, got, want)
		}
	}
	if hook, err := servingProcs("3"); err != nil || hook != nil || runtime.GOMAXPROCS(0) != 3 {
		t.Errorf("--procs 3: hook %v, %v, GOMAXPROCS %d", hook != nil, err, runtime.GOMAXPROCS(0))
	}
	runtime.GOMAXPROCS(cpus)
	t.Setenv("GOMAXPROCS", "2")
	for _, spec := range []string{"auto", "1"} {
		if hook, err := servingProcs(spec); err != nil || hook != nil || runtime.GOMAXPROCS(0) != cpus {
			t.Errorf("--procs %s with GOMAXPROCS set: hook %v, %v, GOMAXPROCS %d (want it untouched, %d)", spec, hook != nil, err, runtime.GOMAXPROCS(0), cpus)
		}
	}
	for _, bad := range []string{"0", "-1", "all", ""} {
		if _, err := servingProcs(bad); err == nil {
			t.Errorf("--procs %q accepted", bad)
		}
	}
}
