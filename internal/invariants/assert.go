package invariants

import (
	"fmt"
	"math/rand/v2"
)

// AssertionFailedf panics with the formatted message in invariants builds and
// does nothing otherwise. Use it for conditions that indicate a bug in
// tiercache itself, never for data read from a device (that is corruption,
// reported as an error).
func AssertionFailedf(format string, args ...any) {
	if Enabled {
		panic(fmt.Sprintf("assertion failed: "+format, args...))
	}
}

// Sometimes returns true with probability pct/100 in invariants builds and
// false otherwise. It forces rare paths (eviction under pressure, early
// checkpoints) to run often in tests.
func Sometimes(pct int) bool {
	return Enabled && rand.IntN(100) < pct
}
