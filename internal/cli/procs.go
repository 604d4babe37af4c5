package cli

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
)

// The processors (GOMAXPROCS) the Go runtime runs serve's goroutines on.
//
// A cache hit is little work and a few goroutine wake-ups (the NBD reader
// on the request, the AIO reaper on the completion). While processors sit
// idle, each wake-up also wakes a thread for an idle processor to look for
// more work; it finds none and sleeps again: futex wake-ups and context
// switches that cost one connection more CPU per request than the request
// itself. With --procs auto (the default) serve runs with one processor per
// connection serving an export, at most Go's default (the CPUs the process
// may use), and with Go's default while no connection serves (recovery,
// writeback while idle). --procs N, or GOMAXPROCS in the environment, fixes
// the count instead.

// procsFor is the GOMAXPROCS of --procs auto while conns connections
// serve, cpus being Go's default.
func procsFor(conns, cpus int) int {
	if conns == 0 {
		return cpus
	}
	return min(conns, cpus)
}

// servingProcs applies --procs spec: it fixes GOMAXPROCS (N) or returns
// the nbd.Config.OnServing hook that sets it by procsFor (auto); nil when
// GOMAXPROCS is set in the environment (it wins) or the count is fixed.
func servingProcs(spec string) (func(n int), error) {
	if spec != "auto" {
		n, err := strconv.Atoi(spec)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--procs %q: want auto or a number of processors (1 or more)", spec)
		}
		if os.Getenv("GOMAXPROCS") == "" {
			runtime.GOMAXPROCS(n)
		}
		return nil, nil
	}
	if os.Getenv("GOMAXPROCS") != "" {
		return nil, nil
	}
	cpus := runtime.GOMAXPROCS(0)
	cur := cpus
	return func(n int) {
		// Called in order, under the NBD server's lock.
		if p := procsFor(n, cpus); p != cur {
			cur = p
			runtime.GOMAXPROCS(p)
		}
	}, nil
}
