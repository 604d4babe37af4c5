// Command kvm-image builds (or finds in the cache) the test guest image of
// package internal/kvm and prints its directory. scripts/install-deps.sh runs
// it so that the package downloads happen once, before the tests.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/tiercache/tiercache/internal/kvm"
)

func main() {
	dir, err := kvm.CacheDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvm-image:", err)
		os.Exit(1)
	}
	img, err := kvm.Build(context.Background(), dir, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvm-image:", err)
		os.Exit(1)
	}
	fmt.Println(img.Dir)
}
