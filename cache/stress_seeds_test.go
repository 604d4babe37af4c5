package cache

import (
	"fmt"
	"os"
	"strconv"
	"testing"
)

// stressSeeds returns the seeds a seeded model test runs: def seeds from 0
// by default, or TIERCACHE_<name>_SEEDS seeds starting at
// TIERCACHE_<name>_START (default 0) when set, so that `make stress` can
// run thousands and a long sweep can be split into slices that replay.
func stressSeeds(t *testing.T, name string, def int) (first, n uint64) {
	t.Helper()
	n = uint64(def)
	get := func(suffix string) (uint64, bool) {
		key := "TIERCACHE_" + name + "_" + suffix
		v := os.Getenv(key)
		if v == "" {
			return 0, false
		}
		x, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: want a non-negative number", key, v)
		}
		return x, true
	}
	if x, ok := get("SEEDS"); ok {
		n = x
	}
	if x, ok := get("START"); ok {
		first = x
	}
	if n == 0 {
		t.Fatalf("TIERCACHE_%s_SEEDS=0: no seed to run", name)
	}
	return first, n
}

// maxSeedFailures is how many failing seeds a seeded sweep reports before
// it stops: enough to tell one bug from several, few enough to read.
const maxSeedFailures = 10

// seedFailures collects the seeds of a sweep that failed, for its summary.
type seedFailures struct{ seeds []uint64 }

// add records seed as failed and reports whether the sweep should stop.
func (f *seedFailures) add(seed uint64) bool {
	f.seeds = append(f.seeds, seed)
	return len(f.seeds) >= maxSeedFailures
}

func (f *seedFailures) String() string { return fmt.Sprint(f.seeds) }
