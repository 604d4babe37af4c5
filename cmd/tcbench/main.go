// Command tcbench runs tiercache's benchmarks: `tcbench cache` the cache
// scenarios S1-S9 (make bench), `tcbench` the NBD server against qemu-nbd
// and nbdkit (make bench-nbd). All of it lives in package bench; see its
// documentation and docs/BENCHMARKS.md.
package main

import (
	"os"

	"github.com/tiercache/tiercache/bench"
)

func main() {
	os.Exit(bench.Main(os.Args[1:]))
}
