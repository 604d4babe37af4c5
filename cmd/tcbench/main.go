// Command tcbench runs tiercache's NBD benchmark (make bench). All of it
// lives in package bench; see its documentation and docs/BENCHMARKS.md.
package main

import (
	"os"

	"github.com/tiercache/tiercache/bench"
)

func main() {
	os.Exit(bench.Main(os.Args[1:]))
}
