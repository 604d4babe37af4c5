// Command tiercache is a userspace tiered block device: an SSD cache in front
// of HDDs, served over NBD. This file only wires the CLI; every subcommand
// lives in internal/cli.
package main

import (
	"os"

	"github.com/tiercache/tiercache/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:]))
}
