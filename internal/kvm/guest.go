package kvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// Image is a bootable guest: a Debian kernel and an initramfs holding
// busybox, the guest tools and the kernel modules the tests load.
type Image struct {
	Kernel        string // vmlinuz
	Initrd        string // uncompressed cpio
	KernelVersion string // e.g. 6.1.0-57-amd64
	Dir           string // the cache directory holding both
}

// guestPackages are the Debian packages whose programs the guest runs. The
// shared libraries they need come from the library packages of their
// dependency closure (see packageClosure); the kernel from the
// linux-image-amd64 metapackage's current image.
var guestPackages = []string{
	"linux-image-amd64",
	"busybox-static",
	"nbd-client",
	"e2fsprogs",
	"xfsprogs",
	"fio",
	"dmsetup",
	"bcache-tools",
	"util-linux",
	"dash",
}

// guestPrograms are copied into the guest with the libraries they need
// (found by name under the packages' bin and sbin directories). busybox
// provides everything else (mount, insmod, dd, ...). Scripts run under dash:
// busybox's own sh runs its applets in preference to PATH, and busybox's
// fallocate, fstrim and blkdiscard lack options the tests use.
var guestPrograms = []string{
	"nbd-client",
	"mke2fs", "mkfs.ext4", "e2fsck", "fsck.ext4", "dumpe2fs",
	"mkfs.xfs", "xfs_repair", "xfs_io",
	"fio",
	"dmsetup",
	"make-bcache", "bcache-super-show",
	"blkdiscard", "fstrim", "fallocate", "blockdev",
	"dash",
}

// guestModules are loaded at boot, after their dependencies, in this order.
var guestModules = []string{
	"virtio_pci", "virtio_blk", "9pnet_virtio", "9p",
	"crc32c_generic", "libcrc32c",
	"nbd", "loop",
	"dm_mod", "dm_log_writes", "dm_cache", "dm_cache_smq", "bcache",
	"ext4", "xfs",
}

// initScript is the guest's /init: mount the pseudo file systems and the
// host's 9p share at /host, load the modules, run /host/script with its
// output on the console, write its exit status to /host/status, power off.
// The kernel panics (and qemu, with -no-reboot, exits) if /init returns.
const initScript = `#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export LD_LIBRARY_PATH=@LIBPATH@
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /tmp /run /mnt /host
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
ln -sf /proc/self/fd /dev/fd
for m in @MODULES@; do insmod $m || echo "init: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none host /host || echo "init: no 9p share"
echo "init: ready at $(cut -d' ' -f1 /proc/uptime)s"
cd /host
dash /host/script </dev/null
echo $? >/host/status.tmp && mv /host/status.tmp /host/status
cd /
umount /host
sync
poweroff -f
`

// builderVersion changes when the way an image is put together changes, so
// that cached images built the old way are not reused.
const builderVersion = "1"

// CacheDir is where downloaded packages and built images are kept between
// runs: $TIERCACHE_KVM_CACHE, else the user cache directory's tiercache/kvm.
func CacheDir() (string, error) {
	if d := os.Getenv("TIERCACHE_KVM_CACHE"); d != "" {
		return d, nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "tiercache", "kvm"), nil
}

// debFile is one package apt would download: its file name and size.
type debFile struct {
	name string
	size int64
	line string // apt's --print-uris line, part of the image's key
}

// Build returns the guest image for the current versions of the guest
// packages, building it under cacheDir first if needed: the packages are
// fetched with `apt-get download` (once; they stay in cacheDir/debs),
// unpacked with `dpkg-deb -x`, and the programs, their libraries and the
// modules are copied into an initramfs. The image directory's name is a
// hash of the package versions and of how the image is built, so a new
// kernel or tool version builds a new image. progress receives one line per
// step.
func Build(ctx context.Context, cacheDir string, progress io.Writer) (*Image, error) {
	if err := os.MkdirAll(filepath.Join(cacheDir, "debs"), 0o755); err != nil {
		return nil, err
	}
	unlock, err := lockDir(cacheDir)
	if err != nil {
		return nil, err
	}
	defer unlock()

	pkgs, err := packageClosure(ctx)
	if err != nil {
		return nil, err
	}
	debs, err := printURIs(ctx, pkgs)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	fmt.Fprintln(h, builderVersion, initScript, guestPrograms, guestModules)
	for _, d := range debs {
		fmt.Fprintln(h, d.line)
	}
	key := hex.EncodeToString(h.Sum(nil))[:16]
	dir := filepath.Join(cacheDir, "image-"+key)
	if img, err := loadImage(dir); err == nil {
		return img, nil
	}

	var missing []string
	for _, d := range debs {
		if fi, err := os.Stat(filepath.Join(cacheDir, "debs", d.name)); err != nil || fi.Size() != d.size {
			missing = append(missing, strings.SplitN(d.name, "_", 2)[0])
		}
	}
	if len(missing) > 0 {
		fmt.Fprintf(progress, "kvm: downloading %d packages into %s\n", len(missing), filepath.Join(cacheDir, "debs"))
		cmd := exec.CommandContext(ctx, "apt-get", append([]string{"download", "-q"}, missing...)...)
		cmd.Dir = filepath.Join(cacheDir, "debs")
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("apt-get download: %v\n%s", err, out)
		}
	}

	fmt.Fprintf(progress, "kvm: building guest image %s\n", dir)
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	pkgRoot := filepath.Join(tmp, "pkgs")
	if err := os.MkdirAll(pkgRoot, 0o755); err != nil {
		return nil, err
	}
	for _, d := range debs {
		cmd := exec.CommandContext(ctx, "dpkg-deb", "-x", filepath.Join(cacheDir, "debs", d.name), pkgRoot)
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("dpkg-deb -x %s: %v\n%s", d.name, err, out)
		}
	}
	root := filepath.Join(tmp, "root")
	kver, err := stageRoot(ctx, pkgRoot, root)
	if err != nil {
		return nil, err
	}
	if err := copyFile(filepath.Join(tmp, "vmlinuz"), filepath.Join(pkgRoot, "boot", "vmlinuz-"+kver)); err != nil {
		return nil, err
	}
	f, err := os.Create(filepath.Join(tmp, "initrd.cpio"))
	if err != nil {
		return nil, err
	}
	if err := writeCpio(f, root); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(tmp, "kver"), []byte(kver), 0o644); err != nil {
		return nil, err
	}
	// The unpacked trees are only needed to build; the debs stay.
	os.RemoveAll(pkgRoot)
	os.RemoveAll(root)
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return nil, err
	}
	return loadImage(dir)
}

func loadImage(dir string) (*Image, error) {
	kver, err := os.ReadFile(filepath.Join(dir, "kver"))
	if err != nil {
		return nil, err
	}
	img := &Image{Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd.cpio"), KernelVersion: string(kver), Dir: dir}
	for _, p := range []string{img.Kernel, img.Initrd} {
		if _, err := os.Stat(p); err != nil {
			return nil, err
		}
	}
	return img, nil
}

// lockDir takes an exclusive lock on dir/lock (two test processes may build
// at once) and returns its release.
func lockDir(dir string) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// packageClosure returns the guest packages and the library packages of
// their dependency closure (apt's candidate versions; recommends and
// suggests left out). Programs and daemons the closure drags in (perl,
// python3, debconf) are left out: the guest runs only guestPrograms.
func packageClosure(ctx context.Context) ([]string, error) {
	args := []string{"depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
		"--no-breaks", "--no-replaces", "--no-enhances"}
	out, err := exec.CommandContext(ctx, "apt-cache", append(args, guestPackages...)...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache depends %v: %w (is the apt index there? apt-get update)", guestPackages, err)
	}
	set := map[string]bool{}
	for _, p := range guestPackages {
		set[p] = true
	}
	for _, line := range strings.Split(string(out), "\n") {
		if line == "" || line[0] == ' ' || line[0] == '<' {
			continue
		}
		if strings.HasPrefix(line, "lib") || strings.HasPrefix(line, "zlib1g") || strings.HasPrefix(line, "linux-image-") {
			set[line] = true
		}
	}
	pkgs := make([]string, 0, len(set))
	for p := range set {
		pkgs = append(pkgs, p)
	}
	sort.Strings(pkgs)
	return pkgs, nil
}

// printURIs asks apt which files `apt-get download` would fetch.
func printURIs(ctx context.Context, pkgs []string) ([]debFile, error) {
	out, err := exec.CommandContext(ctx, "apt-get", append([]string{"download", "--print-uris", "-q"}, pkgs...)...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-get download --print-uris: %w", err)
	}
	var debs []debFile
	for _, line := range strings.Split(string(bytes.TrimSpace(out)), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || !strings.HasSuffix(f[1], ".deb") {
			continue
		}
		var size int64
		fmt.Sscan(f[2], &size)
		debs = append(debs, debFile{name: f[1], size: size, line: line})
	}
	if len(debs) < len(pkgs) {
		return nil, fmt.Errorf("apt-get download --print-uris: %d files for %d packages", len(debs), len(pkgs))
	}
	sort.Slice(debs, func(i, j int) bool { return debs[i].name < debs[j].name })
	return debs, nil
}

// stageRoot fills root with the guest's file tree from the unpacked
// packages and returns the kernel version.
func stageRoot(ctx context.Context, pkgRoot, root string) (string, error) {
	ents, err := os.ReadDir(filepath.Join(pkgRoot, "lib", "modules"))
	if err != nil || len(ents) != 1 {
		return "", fmt.Errorf("want one kernel under %s/lib/modules: %v (%d found)", pkgRoot, err, len(ents))
	}
	kver := ents[0].Name()

	bins := map[string]string{}
	for _, d := range []string{"usr/sbin", "usr/bin", "sbin", "bin"} {
		ents, _ := os.ReadDir(filepath.Join(pkgRoot, d))
		for _, e := range ents {
			if _, ok := bins[e.Name()]; !ok {
				bins[e.Name()] = filepath.Join(d, e.Name())
			}
		}
	}
	var progs []string
	for _, p := range guestPrograms {
		rel, ok := bins[p]
		if !ok {
			return "", fmt.Errorf("guest program %s is in none of the guest packages", p)
		}
		progs = append(progs, rel)
	}
	idx, err := indexLibs(pkgRoot)
	if err != nil {
		return "", err
	}
	libs, err := neededClosure(pkgRoot, idx, progs)
	if err != nil {
		return "", err
	}
	libDirs := map[string]bool{}
	for _, rel := range append(progs, libs...) {
		src, err := resolveIn(pkgRoot, rel)
		if err != nil {
			return "", err
		}
		if err := copyFile(filepath.Join(root, rel), src); err != nil {
			return "", err
		}
		if !strings.Contains(rel, "bin/") {
			libDirs["/"+filepath.Dir(rel)] = true
		}
	}

	// busybox and its applets, except where a real program of the same
	// name is staged.
	bb := filepath.Join(pkgRoot, "bin", "busybox")
	if err := copyFile(filepath.Join(root, "bin", "busybox"), bb); err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bb, "--list-full").Output()
	if err != nil {
		return "", fmt.Errorf("busybox --list-full: %w", err)
	}
	staged := map[string]bool{}
	for _, p := range guestPrograms {
		staged[p] = true
	}
	for _, a := range strings.Fields(string(out)) {
		if staged[filepath.Base(a)] || a == "bin/busybox" {
			continue
		}
		dst := filepath.Join(root, a)
		if _, err := os.Lstat(dst); err == nil {
			continue
		}
		os.MkdirAll(filepath.Dir(dst), 0o755)
		if err := os.Symlink("/bin/busybox", dst); err != nil {
			return "", err
		}
	}

	// Modules, loaded by /init with insmod in dependency order.
	modDir := filepath.Join(pkgRoot, "lib", "modules", kver)
	mods, err := moduleClosure(modDir, guestModules)
	if err != nil {
		return "", err
	}
	var insmods []string
	for _, rel := range mods {
		dst := filepath.Join("lib", "modules", kver, rel)
		if err := copyFile(filepath.Join(root, dst), filepath.Join(modDir, rel)); err != nil {
			return "", err
		}
		insmods = append(insmods, "/"+dst)
	}

	var dirs []string
	for d := range libDirs {
		dirs = append(dirs, d)
	}
	sort.Strings(dirs)
	init := strings.NewReplacer("@LIBPATH@", strings.Join(dirs, ":"), "@MODULES@", strings.Join(insmods, " ")).Replace(initScript)
	for _, d := range []string{"proc", "sys", "dev", "tmp", "run", "mnt", "host", "etc"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	// mkfs.xfs and nbd-client look up /etc/mtab and /proc/mounts.
	os.Symlink("/proc/mounts", filepath.Join(root, "etc", "mtab"))
	if err := os.WriteFile(filepath.Join(root, "init"), []byte(init), 0o755); err != nil {
		return "", err
	}
	return kver, nil
}
