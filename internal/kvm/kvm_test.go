package kvm

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// image is the guest image, built (or found in the cache) once per test
// binary by guestImage.
var image *Image

// guestImage returns the guest image, building it on first use. A missing
// qemu or apt fails the test in CI (scripts/install-deps.sh installs them)
// and skips it elsewhere.
func guestImage(t *testing.T) *Image {
	t.Helper()
	for _, tool := range []string{"qemu-system-x86_64", "apt-get", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is required in CI (scripts/install-deps.sh installs it): %v", tool, err)
			}
			t.Skipf("%s not installed; run scripts/install-deps.sh", tool)
		}
	}
	if image == nil {
		dir, err := CacheDir()
		if err != nil {
			t.Fatal(err)
		}
		img, err := Build(context.Background(), dir, testWriter{t})
		if err != nil {
			t.Fatal(err)
		}
		image = img
	}
	return image
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestBoot boots the guest and runs a script that checks what every other
// test relies on: the script's exit status comes back, the modules are
// loaded, the tools run, and a virtio disk backed by a host file is written.
func TestBoot(t *testing.T) {
	img := guestImage(t)
	dir := t.TempDir()
	disk := dir + "/disk.img"
	if err := os.WriteFile(disk, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, 16<<20); err != nil {
		t.Fatal(err)
	}
	script := `set -e
for m in nbd dm_mod dm_log_writes dm_cache bcache ext4 xfs; do grep -q "^$m " /proc/modules || { echo "module $m not loaded"; exit 1; }; done
nbd-client --help 2>&1 | grep -q nbd-client
mkfs.ext4 -V 2>&1 | grep -q mke2fs
mkfs.xfs -V
fio --version
dmsetup version
fallocate --version
echo hello-from-guest | dd of=/dev/vda bs=4096 conv=sync oflag=direct 2>/dev/null
exit 7
`
	res, err := Run(context.Background(), Config{Image: img, Share: dir, Script: script, Disks: []Disk{{Path: disk}}, Timeout: 3 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("boot and script: %v", res.Elapsed)
	if res.Status != 7 {
		t.Fatalf("exit status %d, want 7; console:\n%s", res.Status, res.Log)
	}
	b, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(b), "hello-from-guest\n") {
		t.Fatalf("the guest's write is not on the host file: %q", b[:32])
	}
}
