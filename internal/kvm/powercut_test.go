package kvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/logwrites"
	"github.com/tiercache/tiercache/nbd"
)

// The devices of one power-cut run, as slices of one dm-log-writes device
// (sizes in MiB): the cache, the stamped export's backing device, the ext4
// export's backing device.
const (
	pcCacheMiB = 32
	pcDiskMiB  = 16
	pcFsMiB    = 64
	pcLogMiB   = 384
	pcBlocks   = 2048 // stamped blocks of export "disk"
)

// pcMode is one power-cut run: a cache mode and writeback order.
type pcMode struct {
	name, mode, order string
}

var pcModes = []pcMode{
	{"wb", "writeback", "lba"},
	{"epoch", "writeback", "epoch"},
	{"wt", "writethrough", "lba"},
	{"wa", "writearound", "lba"},
	{"none", "none", "lba"},
}

// pcGuestScript runs the workload of every mode, each on its own pair of
// disks (/dev/vd[2i] data, /dev/vd[2i+1] log).
const pcGuestScript = `set -u
TC=/host/tiercache
C=$((@CACHE@*2048)) A=$((@DISK@*2048)) F=$((@FS@*2048))
# No udev in the guest: dmsetup mknodes makes the /dev/mapper nodes.
dmc() { dmsetup create "$@" && dmsetup mknodes "$1"; }
run_mode() { # NAME DATA LOG MODE ORDER
	name=$1 data=$2 log=$3 mode=$4 order=$5
	lw=lw-$name adm=/run/$name.admin sock=/run/$name.sock
	dmc $lw --table "0 $((C+A+F)) log-writes $data $log" || return 1
	dmc $name-cache --table "0 $C linear /dev/mapper/$lw 0" || return 1
	dmc $name-disk --table "0 $A linear /dev/mapper/$lw $C" || return 1
	dmc $name-fs --table "0 $F linear /dev/mapper/$lw $((C+A))" || return 1
	# The dm slices have no UUID and the guest no udev: nothing identifies
	# them but their paths.
	$TC format --cache /dev/mapper/$name-cache --backing disk=/dev/mapper/$name-disk --backing fs=/dev/mapper/$name-fs \
		--mode $mode --bucket-size 256K --trust-path >/tmp/$name.format 2>&1 || { echo "format failed"; cat /tmp/$name.format; return 1; }
	$TC serve --cache /dev/mapper/$name-cache --listen unix:$sock --admin $adm >/tmp/$name.log 2>&1 &
	pid=$!
	for i in $(seq 1 60); do [ -S $sock ] && [ -S $adm ] && break; sleep 0.5; done
	$TC set disk writeback_order=$order --admin $adm >/dev/null && $TC set fs writeback_order=$order --admin $adm >/dev/null || return 1
	nbd-client -unix $sock /dev/nbd0 -N disk -b 4096 -C 2 >/dev/null || return 1
	nbd-client -unix $sock /dev/nbd1 -N fs -b 4096 -C 1 >/dev/null || return 1
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/nbd1 && mount -t ext4 /dev/nbd1 /mnt || return 1
	# The new file system written back, so that from the mark on the backing
	# device alone holds a file system at every flushed prefix.
	sync && $TC flush fs --admin $adm >/dev/null || return 1
	dash /host/lwmark.sh $lw fsready
	/host/kvmload -dev /dev/nbd0 -blocks @BLOCKS@ -writes @WRITES@ -seed @SEED@ -events /host/$name.events \
		-mark "dash /host/lwmark.sh $lw" &
	lpid=$!
	for i in $(seq 1 @FILES@); do
		yes "tiercache file $i" | head -c $((1000 + i * 3001 % 60000)) >/mnt/f$i
		xfs_io -c fsync /mnt/f$i && xfs_io -c fsync /mnt && dash /host/lwmark.sh $lw e$i || return 1
	done
	wait $lpid || { echo "kvmload failed"; return 1; }
	umount /mnt && nbd-client -d /dev/nbd0 >/dev/null && nbd-client -d /dev/nbd1 >/dev/null
	kill -TERM $pid && wait $pid || { echo "tiercache exit $?"; tail /tmp/$name.log; return 1; }
	dmsetup status $lw
	dmsetup remove $name-fs && dmsetup remove $name-disk && dmsetup remove $name-cache && dmsetup remove $lw
}
`

// TestPowerCut cuts the power of the whole guest at points of a
// dm-log-writes log (the method of xfstests generic/482): in the guest,
// tiercache's cache and backing devices are slices of one log-writes
// device, so one log holds every write of all of them in the order it
// reached stable media, with FLUSH and FUA marks. A stamped-block workload
// (kvmload, with the crashtest oracle) and ext4 files with fsync run
// through the kernel NBD client. On the host the log is replayed onto fresh
// images up to each point, tiercache starts on them, and the test checks:
// the offline check is clean before and after recovery, recovery succeeds,
// every write acknowledged durable before the point reads back and nothing
// else appears (crashtest.Oracle.CheckCrash), the ext4 export fscks clean
// and holds every file fsynced before the point, and with epoch-order
// writeback the backing device alone fscks clean (a flushed prefix).
//
// Points: workload marks, tiercache's own FLUSH and FUA entries, and points
// between two FLUSHes with each unflushed write kept or dropped at random
// and one torn (a drive with a volatile cache). make kernel (and so make
// test) runs a short workload in every mode and replays a seeded sample of
// the points (TIERCACHE_KVM_POINTS, default 4 per kind and mode); make
// kernel-sweep a longer workload and every point (TIERCACHE_KVM_FULL=1).
// TIERCACHE_KVM_SEED replays a run.
func TestPowerCut(t *testing.T) {
	img := guestImage(t)
	full := os.Getenv("TIERCACHE_KVM_FULL") != ""
	perKind := 4
	if s := os.Getenv("TIERCACHE_KVM_POINTS"); s != "" {
		perKind, _ = strconv.Atoi(s)
	}
	seed := uint64(time.Now().UnixNano() % 100000)
	if s := os.Getenv("TIERCACHE_KVM_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (TIERCACHE_KVM_SEED=%d: the same workload and sample of points; the log also depends on the guest's timing)", seed, seed)
	modes := pcModes
	writes, files := 150, 3
	if full {
		writes, files = 2000, 30
	}
	if s := os.Getenv("TIERCACHE_KVM_MODES"); s != "" {
		modes = nil
		for _, m := range pcModes {
			if slices.Contains(strings.Split(s, ","), m.name) {
				modes = append(modes, m)
			}
		}
	}

	// TIERCACHE_KVM_KEEP=DIR keeps the guest's logs and events there (and
	// reuses them, without booting, if DIR already holds them). Without
	// it a failed run keeps them too (pcKeepFailed): the guest's timing
	// is not reproducible, so the seed alone does not give the same log.
	dir := os.Getenv("TIERCACHE_KVM_KEEP")
	if dir == "" {
		dir = t.TempDir()
		defer pcKeepFailed(t, dir, modes, seed)
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	hostBin := filepath.Join(t.TempDir(), "tiercache")
	if out, err := exec.Command("go", "build", "-o", hostBin, "github.com/tiercache/tiercache/cmd/tiercache").CombinedOutput(); err != nil {
		t.Fatalf("building tiercache: %v\n%s", err, out)
	}
	for _, tool := range []string{"qemu-img", "e2fsck", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is required (scripts/install-deps.sh installs it)", tool)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, modes[len(modes)-1].name+".events")); err != nil {
		pcGuest(t, img, dir, modes, writes, files, seed)
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			pc := &powerCut{t: t, bin: hostBin, dir: t.TempDir(), mode: m}
			pc.run(filepath.Join(dir, m.name+".log"), filepath.Join(dir, m.name+".events"), full, perKind, seed)
		})
	}
}

// pcKeepFailed moves the logs and events of a failed run out of the test's
// temporary directory and says how to replay the same points on them.
func pcKeepFailed(t *testing.T, dir string, modes []pcMode, seed uint64) {
	if !t.Failed() {
		return
	}
	keep, err := os.MkdirTemp("", "tiercache-powercut-")
	if err != nil {
		t.Log(err)
		return
	}
	var names []string
	for _, m := range modes {
		for _, f := range []string{m.name + ".log", m.name + ".events"} {
			if os.Rename(filepath.Join(dir, f), filepath.Join(keep, f)) == nil {
				names = append(names, f)
			}
		}
	}
	if len(names) == 0 {
		os.Remove(keep)
		return
	}
	var env []string
	for _, k := range []string{"TIERCACHE_KVM_FULL", "TIERCACHE_KVM_POINTS", "TIERCACHE_KVM_MODES"} {
		if v := os.Getenv(k); v != "" {
			env = append(env, k+"="+v)
		}
	}
	t.Logf("the guest's logs are kept in %s (%s); the same points replay, without booting, with\n\tTIERCACHE_KVM_KEEP=%s TIERCACHE_KVM_SEED=%d %s go test -count=1 -v -run 'TestPowerCut$' ./internal/kvm/",
		keep, strings.Join(names, " "), keep, seed, strings.Join(env, " "))
}

// pcGuest boots the guest and runs the workload of each mode, leaving
// NAME.log (the dm-log-writes log device) and NAME.events in dir.
func pcGuest(t *testing.T, img *Image, dir string, modes []pcMode, writes, files int, seed uint64) {
	guestBinary(t, dir)
	if err := os.WriteFile(filepath.Join(dir, "lwmark.sh"), []byte(lwmarkScript), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "kvmload"), "github.com/tiercache/tiercache/internal/kvm/kvmload")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building kvmload: %v\n%s", err, out)
	}
	dataSize := int64(pcCacheMiB+pcDiskMiB+pcFsMiB) << 20
	var disks []Disk
	script := strings.NewReplacer("@CACHE@", strconv.Itoa(pcCacheMiB), "@DISK@", strconv.Itoa(pcDiskMiB), "@FS@", strconv.Itoa(pcFsMiB),
		"@BLOCKS@", strconv.Itoa(pcBlocks), "@WRITES@", strconv.Itoa(writes), "@SEED@", strconv.FormatUint(seed, 10),
		"@FILES@", strconv.Itoa(files)).Replace(pcGuestScript)
	for i, m := range modes {
		disks = append(disks,
			Disk{Path: sparse(t, filepath.Join(dir, m.name+".data"), dataSize)},
			Disk{Path: sparse(t, filepath.Join(dir, m.name+".log"), pcLogMiB<<20)})
		script += fmt.Sprintf("run_mode %s /dev/vd%c /dev/vd%c %s %s || { echo \"MODE %s FAIL\"; exit 1; }\necho \"MODE %s done\"\n",
			m.name, 'a'+2*i, 'a'+2*i+1, m.mode, m.order, m.name, m.name)
	}
	res, err := Run(context.Background(), Config{Image: img, Share: dir, Script: script, Disks: disks, Timeout: 20 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("guest workload, %d modes: %v", len(modes), res.Elapsed.Round(time.Second))
	if res.Status != 0 {
		t.Fatalf("guest script exit status %d; console:\n%s", res.Status, res.Log)
	}
	for _, m := range modes {
		os.Remove(filepath.Join(dir, m.name+".data"))
	}
}

type powerCut struct {
	t    *testing.T
	bin  string
	dir  string
	mode pcMode
	seed uint64

	lg *logwrites.Log
	ev *Events

	durable  int // blocks found holding the write the oracle required durable
	maybe    int // blocks found holding a maybe-new (unflushed) write
	tornRead int // torn blocks found, each sector holding allowed content
}

func (pc *powerCut) run(logPath, evPath string, full bool, perKind int, seed uint64) {
	t := pc.t
	lf, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	fi, _ := lf.Stat()
	if pc.lg, err = logwrites.Open(lf, fi.Size()); err != nil {
		t.Fatal(err)
	}
	ef, err := os.Open(evPath)
	if err != nil {
		t.Fatal(err)
	}
	pc.ev, err = ReadEvents(ef)
	ef.Close()
	if err != nil {
		t.Fatal(err)
	}
	pc.seed = seed
	points, err := ChoosePoints(pc.lg, seed, full, perKind)
	if err != nil {
		t.Fatal(err)
	}
	var flushes, fuas, marks, fileMarks int
	for _, e := range pc.lg.Entries {
		switch {
		case e.IsMark():
			marks++
			if strings.HasPrefix(e.Mark, "e") {
				fileMarks++
			}
		case e.IsFlush():
			flushes++
		case e.IsFUA():
			fuas++
		}
	}
	t.Logf("log: %d entries (%d FLUSH, %d FUA, %d marks); workload: %d kvmload marks, %d ext4 files; %d points to replay",
		len(pc.lg.Entries), flushes, fuas, marks, pc.ev.Marks, fileMarks, len(points))

	base := pc.newImages(filepath.Join(pc.dir, "base"))
	defer base.close()
	rp := pc.lg.NewReplayer(base)
	at := 0
	start := time.Now()
	var checked, failures int
	for _, p := range points {
		for ; at < p.Upto; at++ {
			if err := rp.Apply(pc.lg.Entries[at], -1); err != nil {
				t.Fatal(err)
			}
		}
		n, err := pc.check(base, p)
		checked += n
		if err != nil {
			failures++
			t.Errorf("%v: %v", p, err)
		}
	}
	el := time.Since(start)
	kinds := map[string]int{}
	for _, p := range points {
		kinds[p.Kind]++
	}
	t.Logf("%s: %d points replayed (%d marks, %d FLUSH/FUA, %d torn), %d blocks checked (%d durable writes found, %d unflushed writes found, %d torn), %d failures, %v per replay; %d sectors of plain writes kept from overwriting a FUA write of their FLUSH interval",
		pc.mode.name, len(points), kinds["mark"], kinds["flush"], kinds["torn"], checked, pc.durable, pc.maybe, pc.tornRead, failures,
		(el / time.Duration(max(1, len(points)))).Round(time.Millisecond), rp.Kept)
}

// images are the three device images of a replay, addressed as the one
// data device of the log.
type images struct {
	cache, disk, fs *os.File
}

func (pc *powerCut) newImages(prefix string) *images {
	im := &images{}
	var err error
	for _, x := range []struct {
		f    **os.File
		name string
		mib  int64
	}{{&im.cache, "cache", pcCacheMiB}, {&im.disk, "disk", pcDiskMiB}, {&im.fs, "fs", pcFsMiB}} {
		if *x.f, err = os.Create(prefix + "." + x.name); err != nil {
			pc.t.Fatal(err)
		}
		if err := (*x.f).Truncate(x.mib << 20); err != nil {
			pc.t.Fatal(err)
		}
	}
	return im
}

func (im *images) close() {
	im.cache.Close()
	im.disk.Close()
	im.fs.Close()
}

// WriteAt writes at an offset of the log's data device, split at the
// boundaries of the three slices.
func (im *images) WriteAt(p []byte, off int64) (int, error) {
	bounds := []struct {
		f     *os.File
		start int64
		end   int64
	}{{im.cache, 0, pcCacheMiB << 20}, {im.disk, pcCacheMiB << 20, (pcCacheMiB + pcDiskMiB) << 20}, {im.fs, (pcCacheMiB + pcDiskMiB) << 20, (pcCacheMiB + pcDiskMiB + pcFsMiB) << 20}}
	n := 0
	for len(p) > 0 {
		found := false
		for _, b := range bounds {
			if off >= b.start && off < b.end {
				k := min(int64(len(p)), b.end-off)
				if _, err := b.f.WriteAt(p[:k], off-b.start); err != nil {
					return n, err
				}
				p, off, n = p[k:], off+k, n+int(k)
				found = true
				break
			}
		}
		if !found {
			return n, fmt.Errorf("write at %d past the data device", off)
		}
	}
	return n, nil
}

func copyImage(dst string, src *os.File) error {
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer out.Close()
	if _, err := src.Seek(0, io.SeekStart); err != nil {
		return err
	}
	// Sparse-aware copy is not needed at these sizes.
	if _, err := io.Copy(out, src); err != nil {
		return err
	}
	return out.Close()
}

// check replays p onto copies of base and checks everything it promises;
// it returns the number of stamped blocks checked.
func (pc *powerCut) check(base *images, p Point) (int, error) {
	d := filepath.Join(pc.dir, "work")
	os.RemoveAll(d)
	os.MkdirAll(d, 0o755)
	cache, disk, fs := filepath.Join(d, "cache.img"), filepath.Join(d, "disk.img"), filepath.Join(d, "fs.img")
	for _, c := range []struct {
		dst string
		src *os.File
	}{{cache, base.cache}, {disk, base.disk}, {fs, base.fs}} {
		if err := copyImage(c.dst, c.src); err != nil {
			return 0, err
		}
	}
	if p.Kind == "torn" {
		im := &images{}
		var err error
		for _, x := range []struct {
			f    **os.File
			path string
		}{{&im.cache, cache}, {&im.disk, disk}, {&im.fs, fs}} {
			if *x.f, err = os.OpenFile(x.path, os.O_RDWR, 0); err != nil {
				return 0, err
			}
		}
		// A torn point starts right after a FLUSH entry.
		tr := pc.lg.NewReplayer(im)
		for i, idx := range p.Keep {
			sectors := int64(-1)
			if i == len(p.Keep)-1 {
				sectors = p.TornSectors
			}
			if err := tr.Apply(pc.lg.Entries[idx], sectors); err != nil {
				im.close()
				return 0, err
			}
		}
		im.close()
	}
	if pc.mode.order == "epoch" {
		// The backing device alone, as the power cut left it: a file
		// system (files fsynced may still be only in the cache).
		alone := filepath.Join(d, "fs-alone.img")
		if err := copyFile(alone, fs); err != nil {
			return 0, err
		}
		if err := pc.fsck(alone, 0); err != nil {
			return 0, fmt.Errorf("epoch order: the ext4 backing device alone: %w", err)
		}
	}
	if err := pc.offlineCheck(cache); err != nil {
		return 0, fmt.Errorf("tiercache check before recovery: %w", err)
	}
	sock, adm := filepath.Join(d, "nbd.sock"), filepath.Join(d, "admin.sock")
	srv := exec.Command(pc.bin, "serve", "--cache", cache, "--backing", "disk="+disk, "--backing", "fs="+fs, "--force",
		"--listen", "unix:"+sock, "--admin", adm)
	var slog bytes.Buffer
	srv.Stdout, srv.Stderr = &slog, &slog
	if err := srv.Start(); err != nil {
		return 0, err
	}
	exited := make(chan error, 1)
	go func() { exited <- srv.Wait() }()
	stopped := false
	defer func() {
		if !stopped {
			srv.Process.Kill()
			<-exited
		}
	}()
	for i := 0; ; i++ {
		_, err1 := os.Stat(sock)
		_, err2 := os.Stat(adm)
		if err1 == nil && err2 == nil {
			break
		}
		select {
		case err := <-exited:
			stopped = true
			return 0, fmt.Errorf("tiercache serve (recovery) exited: %v\n%s", err, slog.String())
		case <-time.After(50 * time.Millisecond):
		}
		if i > 600 {
			return 0, fmt.Errorf("tiercache serve did not listen in 30 s\n%s", slog.String())
		}
	}
	n, err := pc.checkBlocks(sock, p)
	if err != nil {
		return n, fmt.Errorf("%w\ntiercache serve:\n%s", err, slog.String())
	}
	flat := filepath.Join(d, "fs-flat.img")
	if p.LastE > 0 {
		if out, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", "nbd+unix:///fs?socket="+sock, flat).CombinedOutput(); err != nil {
			return n, fmt.Errorf("qemu-img convert of export fs: %v\n%s", err, out)
		}
	}
	srv.Process.Signal(syscall.SIGTERM)
	err = <-exited
	stopped = true
	if err != nil {
		return n, fmt.Errorf("tiercache serve after recovery: exit %v\n%s", err, slog.String())
	}
	if err := pc.offlineCheck(cache); err != nil {
		return n, fmt.Errorf("tiercache check after recovery and clean stop: %w", err)
	}
	if p.LastE > 0 {
		if err := pc.fsck(flat, p.LastE); err != nil {
			return n, fmt.Errorf("ext4 export through tiercache: %w", err)
		}
	}
	return n, nil
}

// offlineCheck runs tiercache check on the replayed cache device. The
// backing devices are not at the paths the set records (the guest's
// /dev/mapper slices), and offline check opens them only there, so it
// reports each as not checked; every other problem fails.
func (pc *powerCut) offlineCheck(cache string) error {
	out, err := exec.Command(pc.bin, "check", "--cache", cache, "--json").Output()
	var res struct {
		Problems []string `json:"problems"`
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		return fmt.Errorf("%v; output not JSON: %v\n%s", err, jerr, out)
	}
	var bad []string
	for _, p := range res.Problems {
		if !(strings.HasPrefix(p, "backing device ") && strings.Contains(p, ": not checked: open /dev/mapper/") &&
			strings.Contains(p, "no such file or directory")) {
			bad = append(bad, p)
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("%s\n%s", strings.Join(bad, "; "), out)
	}
	if err != nil && len(res.Problems) == 0 {
		return fmt.Errorf("%v\n%s", err, out)
	}
	return nil
}

// checkBlocks reads every block of export disk and checks it against the
// oracle of the point.
func (pc *powerCut) checkBlocks(sock string, p Point) (int, error) {
	o, err := pc.ev.OracleAt(p.LastF)
	if err != nil {
		return 0, err
	}
	c, err := nbd.Dial(context.Background(), "unix", sock, "disk", nbd.ClientOptions{})
	if err != nil {
		return 0, err
	}
	defer c.Close()
	torn := pc.tornBlock(p)
	buf := make([]byte, 256*crashtest.BlockSize)
	var bad []string
	for lba := int64(0); lba < pc.ev.Blocks; lba += 256 {
		if err := c.ReadAt(buf, lba*crashtest.BlockSize); err != nil {
			return 0, err
		}
		for i := int64(0); i < 256; i++ {
			b := buf[i*crashtest.BlockSize : (i+1)*crashtest.BlockSize]
			got := crashtest.Decode(b, pc.ev.Seed, uint64(lba+i))
			out, err := o.CheckCrash(lba+i, got)
			if err != nil && lba+i == torn && got.Kind == crashtest.KindTorn {
				// The torn write itself, read back through tiercache from
				// the backing device (writearound, none, or an uncommitted
				// insert): each sector must hold what an allowed content
				// holds there.
				if err = pc.ev.TornAllowed(p.LastF, lba+i, b); err == nil {
					pc.tornRead++
					continue
				}
			}
			switch {
			case err != nil:
				if len(bad) < 10 {
					bad = append(bad, err.Error())
				}
			case out == crashtest.Durable && got.Kind == crashtest.KindWrite:
				pc.durable++
			case out != crashtest.Durable:
				pc.maybe++
			}
		}
	}
	if len(bad) > 0 {
		return int(pc.ev.Blocks), fmt.Errorf("stamped export: %s", strings.Join(bad, "; "))
	}
	return int(pc.ev.Blocks), nil
}

// tornBlock returns the block of export disk that the torn entry of a torn
// point cuts inside (-1: none, or the entry is not on that export's backing
// device). Only that block may read as torn: every other entry of the point
// landed whole, and tiercache's own copy in the cache carries a checksum.
func (pc *powerCut) tornBlock(p Point) int64 {
	if p.Kind != "torn" || len(p.Keep) == 0 || p.TornSectors < 0 {
		return -1
	}
	e := pc.lg.Entries[p.Keep[len(p.Keep)-1]]
	ss := pc.lg.SectorSize
	start, end := int64(pcCacheMiB)<<20, int64(pcCacheMiB+pcDiskMiB)<<20
	cut := int64(e.Sector)*ss + p.TornSectors*ss
	if cut < start || cut >= end || cut >= int64(e.Sector+e.NrSectors)*ss || (cut-start)%crashtest.BlockSize == 0 {
		return -1
	}
	return (cut - start) / crashtest.BlockSize
}

// fsck replays the ext4 journal of img, requires a clean e2fsck -fn, and
// that files 1..lastE hold what the guest wrote.
func (pc *powerCut) fsck(img string, lastE int) error {
	if out, err := exec.Command("e2fsck", "-E", "journal_only", "-p", img).CombinedOutput(); err != nil {
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() > 1 {
			return fmt.Errorf("e2fsck journal replay: %v\n%s", err, out)
		}
	}
	if out, err := exec.Command("e2fsck", "-f", "-n", img).CombinedOutput(); err != nil {
		return fmt.Errorf("e2fsck -fn: %v\n%s", err, out)
	}
	for i := 1; i <= lastE; i++ {
		out, err := exec.Command("debugfs", "-R", fmt.Sprintf("cat /f%d", i), img).Output()
		if err != nil {
			return fmt.Errorf("debugfs cat /f%d: %v", i, err)
		}
		if !bytes.Equal(out, FileContents(i)) {
			return fmt.Errorf("file f%d, fsynced before the point: %d bytes, want %d, contents differ", i, len(out), len(FileContents(i)))
		}
	}
	return nil
}
