package kvm

import (
	"context"
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

//go:embed testdata/nbd-matrix.sh
var nbdMatrixScript string

// guestBinary builds the tiercache binary for the guest (static, no cgo)
// into dir once per test binary.
func guestBinary(t *testing.T, dir string) {
	t.Helper()
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "tiercache"), "github.com/tiercache/tiercache/cmd/tiercache")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building tiercache for the guest: %v\n%s", err, out)
	}
}

func sparse(t *testing.T, path string, size int64) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return path
}

// nbdMatrixChecks are the checks testdata/nbd-matrix.sh prints, in order.
var nbdMatrixChecks = []string{
	"c1-bs512-ext4", "c1-bs4096-xfs", "c4-bs512-xfs", "c4-bs4096-ext4", "c4-seq-bypass",
	"blkdiscard", "blkdiscard-z", "fallocate-z", "fsync-flush", "o_dsync-fua",
	"kill9-flushed-kept", "disconnect-inflight", "restart-under-mounted-fs",
	"slower-than-timeout", "online-check", "clean-stop", "offline-check",
}

// TestKernelNBD runs the kernel's NBD client (nbd-client, nbd.ko) against
// tiercache inside one guest boot: testdata/nbd-matrix.sh has the checks.
// Each must print ok; the test logs the matrix as a table.
func TestKernelNBD(t *testing.T) {
	img := guestImage(t)
	dir := t.TempDir()
	guestBinary(t, dir)
	disks := []Disk{
		{Path: sparse(t, filepath.Join(dir, "cache.img"), 64<<20)},
		{Path: sparse(t, filepath.Join(dir, "backing.img"), 512<<20)},
	}
	res, err := Run(context.Background(), Config{Image: img, Share: dir, Script: nbdMatrixScript, Disks: disks, Timeout: 12 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("guest boot and matrix: %v", res.Elapsed.Round(time.Second))
	got := map[string]string{}
	took := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^CHECK (\S+) (ok|FAIL) ?(\S*)\r?$`).FindAllStringSubmatch(res.Log, -1) {
		got[m[1]], took[m[1]] = m[2], m[3]
	}
	var table strings.Builder
	failed := false
	for _, name := range nbdMatrixChecks {
		st := got[name]
		if st == "" {
			st = "missing"
		}
		if st != "ok" {
			failed = true
		}
		table.WriteString("| " + name + " | " + st + " | " + took[name] + " |\n")
	}
	t.Logf("kernel NBD client matrix:\n%s", table.String())
	if failed || res.Status != 0 {
		t.Fatalf("exit status %d; console:\n%s", res.Status, res.Log)
	}
	if testing.Verbose() {
		t.Logf("console:\n%s", res.Log)
	}
}
