package interop

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMirrorMemberFailsThroughBinary serves a mirrored cache set (format
// --cache A --cache-mirror B) whose member A or B is a faultyDisk, pulls
// it (every read and write returns EIO from the kernel) after dirty data
// was flushed, and checks through an NBD client what docs/OPERATIONS.md
// promises: nothing is lost, the set keeps serving in writeback on the
// survivor without a failover, and `status` says DEGRADED. After SIGKILL
// the server restarts on both devices (the pulled one back, and stale: its
// label is older, so it is not used) and then on the survivor alone, with
// every flushed block intact (stamped blocks, three-state oracle).
func TestMirrorMemberFailsThroughBinary(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	for _, lost := range []string{"A", "B"} {
		t.Run("lost="+lost, func(t *testing.T) { mirrorMemberFails(t, lost) })
	}
}

func mirrorMemberFails(t *testing.T, lost string) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	disk := newFaultyDisk(t, 16*mib, false)
	dir := t.TempDir()
	back := sparseFile(t, dir, "back.img", 64*mib)
	a, b := disk.path, sparseFile(t, dir, "b.img", 12*mib)
	if lost == "B" {
		a, b = sparseFile(t, dir, "a.img", 48*mib), disk.path
	}
	out := run(t, time.Minute, bin, "format", "--cache", a, "--cache-mirror", b, "--backing", "a="+back, "--bucket-size", "256K")
	if !strings.Contains(out, "mirror device") {
		t.Fatalf("format output names no mirror device:\n%s", out)
	}
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	must, _ := checkers(t, &s)
	c := newStampedClient(t, s.sock, "a", 0, 4096, seed)
	must("write", c.write(0, 64, false))
	must("flush", c.flush())
	must("write", c.write(100, 32, false))
	must("flush", c.flush())
	if st := run(t, time.Minute, bin, "status", "--data-dir", dd); !strings.Contains(st, "mirror device") || strings.Contains(st, "DEGRADED") {
		t.Fatalf("status before the failure:\n%s", st)
	}

	disk.set(t, disk.readT, true)
	disk.set(t, disk.writeT, true)
	must("read after pulling "+lost, c.read(0, 64, false))
	must("read dirty blocks after pulling "+lost, c.read(100, 32, false))
	must("write after pulling "+lost, c.write(200, 32, false))
	must("flush after pulling "+lost, c.flush())
	must("read after pulling "+lost, c.read(200, 32, false))
	st := run(t, time.Minute, bin, "status", "--data-dir", dd)
	t.Logf("status with %s pulled:\n%s", lost, st)
	if !strings.Contains(st, "DEGRADED: member "+lost) {
		t.Fatalf("status does not say DEGRADED with member %s failed:\n%s", lost, st)
	}
	if log := s.log.String(); strings.Contains(log, "CACHE DEVICE FAILED") || !strings.Contains(log, "MIRROR MEMBER FAILED") {
		t.Fatalf("want a member failure and no failover:\n%s", log)
	}

	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil
	disk.set(t, disk.readT, false)
	disk.set(t, disk.writeT, false)
	check := func(how string) {
		t.Helper()
		r := newStampedClient(t, s.sock, "a", 0, 4096, seed)
		r.o = c.o
		for i := int64(0); i < 4096; i += 64 {
			must(how, r.read(i, 64, true))
		}
	}
	s = startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	check("after SIGKILL, restarted on both devices")
	if st := run(t, time.Minute, bin, "status", "--data-dir", dd); !strings.Contains(st, "DEGRADED: member "+lost) {
		t.Fatalf("status after the restart on both: the stale member %s is used:\n%s", lost, st)
	}
	s.stop()
	survivor := a
	if lost == "A" {
		survivor = b
	}
	s = startServer(t, "--cache", survivor, "--data-dir", dd)
	check("restarted on the survivor alone")
}

// TestMirrorReplaceThroughBinary replaces a pulled member of a mirrored
// set through the binary while fio writes: member A or B is a faultyDisk,
// pulled after a first fio region was written and flushed; a second
// region is written degraded; then `tiercache replace --rate` brings a
// new file in while fio keeps writing fresh regions (verify=crc32c
// headers, FLUSHes), the first of them started once `status` shows the
// resilver running with its limit, which `replace --rate` then lowers.
// After the replace, status is no longer
// DEGRADED; the server is killed (SIGKILL) during unflushed writes and
// restarted on the new member alone (--mirror-missing), where every
// flushed region verifies (fio --verify_only): the new member holds the
// metadata and the dirty data by itself; killed again and restarted on
// both, the old survivor is stale (DEGRADED names it) and every flushed
// region verifies again.
// The backing device (a faultyDisk too) fails every write throughout, so
// that every region stays dirty: the degraded set's full-speed writeback
// would otherwise leave only clean data, which a checksum failure reads
// from the backing device, and the test would not see a copy missing.
func TestMirrorReplaceThroughBinary(t *testing.T) {
	need(t, "fio", "qemu-io")
	t.Parallel() // self-contained: its own files, sockets and processes
	for _, lost := range []string{"A", "B"} {
		t.Run("lost="+lost, func(t *testing.T) { mirrorReplace(t, lost) })
	}
}

func mirrorReplace(t *testing.T, lost string) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x5e91))
	disk := newFaultyDisk(t, 16*mib, false)
	backDisk := newFaultyDisk(t, 64*mib, false)
	dir := t.TempDir()
	a, b := disk.path, sparseFile(t, dir, "b.img", 20*mib)
	if lost == "B" {
		a, b = sparseFile(t, dir, "a.img", 48*mib), disk.path
	}
	nw := sparseFile(t, dir, "new.img", 16*mib)
	if lost == "A" {
		nw = sparseFile(t, dir, "new.img", 20*mib)
	}
	run(t, time.Minute, bin, "format", "--cache", a, "--cache-mirror", b, "--backing", "a="+backDisk.path, "--bucket-size", "256K", "--mode", "writeback", "--trust-path")
	backDisk.set(t, backDisk.writeT, true)
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	// Every region stays dirty: at most 7 MiB and 2 MiB of noise, within
	// the 60 buckets of the smaller member.
	f := &mirrorFio{t: t, s: &s, dd: dd, seed: 1000}

	f.write()
	disk.set(t, disk.readT, true)
	disk.set(t, disk.writeT, true)
	f.write() // notices the pulled member
	if st := f.status(); !strings.Contains(st, "DEGRADED: member "+lost) {
		t.Fatalf("status with %s pulled:\n%s", lost, st)
	}

	// The replace, limited so that its copy takes seconds.
	running, rout, rdone := f.startResilver(regexp.MustCompile(`(?m)^resilver\s+member `+lost), "replace", "--data-dir", dd, "--rate", "512K", nw)
	t.Logf("status during the replace:\n%s", running)
	if !strings.Contains(running, "limited to 512 KiB/s") {
		t.Fatalf("status does not show the resilver's rate limit:\n%s", running)
	}
	// The limit of the replace running changes (lowered: the copy only
	// takes longer).
	if out := run(t, time.Minute, bin, "replace", "--data-dir", dd, "--rate", "256K"); !strings.Contains(out, "rate limit is now 256 KiB/s") {
		t.Fatalf("replace --rate without a device:\n%s", out)
	}
	if st := f.status(); !strings.Contains(st, "limited to 256 KiB/s") {
		t.Fatalf("status after replace --rate 256K:\n%s\nreplace: %s", st, rout)
	}
	during, rerr := f.writeUntil(rdone)
	if rerr != nil || !strings.Contains(rout.String(), "in sync again") {
		t.Fatalf("replace: %v\n%s\nserver log:\n%s", rerr, rout, s.log)
	}
	t.Logf("%d fio regions written during the replace: %s", during, strings.TrimSpace(rout.String()))
	if st := f.status(); strings.Contains(st, "DEGRADED") || regexp.MustCompile(`(?m)^resilver\s`).MatchString(st) {
		t.Fatalf("status after the replace:\n%s", st)
	}
	f.write() // redundant again
	for _, l := range strings.Split(f.status(), "\n") {
		if strings.HasPrefix(l, "state") {
			t.Logf("before the first SIGKILL: %s", l)
			if strings.Contains(l, " 0 B dirty") {
				t.Fatalf("no dirty data: the test would prove nothing\n%s", s.log)
			}
		}
	}

	// SIGKILL during unflushed writes.
	f.kill(time.Duration(200+rng.IntN(800)) * time.Millisecond)
	// The new member alone first: a restart on both would resync B from
	// A's dirty blocks (after an unclean shutdown) and hide a copy the
	// resilver missed.
	s = startServer(t, "--cache", nw, "--mirror-missing", "--data-dir", dd)
	f.verify("after SIGKILL, restarted on the new member alone")
	f.kill(time.Duration(200+rng.IntN(800)) * time.Millisecond)
	// Both again: the old survivor is stale now (the new member served
	// alone since) and must not be used.
	newA, newB, survivor := a, nw, "A"
	if lost == "A" {
		newA, newB, survivor = nw, b, "B"
	}
	s = startServer(t, "--cache", newA, "--cache-mirror", newB, "--data-dir", dd)
	if st := f.status(); !strings.Contains(st, "DEGRADED: member "+survivor) {
		t.Fatalf("status after the restart on both, the new member having served alone: the stale %s is used:\n%s", survivor, st)
	}
	f.verify("after SIGKILL, restarted on both, the old survivor stale")
	backDisk.set(t, backDisk.writeT, false) // the server's cleanup stops it
}

// TestAttachMirrorThroughBinary formats a cache set on one device, writes
// flushed data that stays dirty (the backing device refuses writes), then
// runs `tiercache attach-mirror` on the live server while fio keeps
// writing: status shows the set DEGRADED with member B being resilvered
// (progress, the device's path) and then mirrored. After SIGKILL during
// unflushed writes the server restarts on the new mirror alone and every
// flushed block verifies (B holds all the dirty data and metadata); after
// another SIGKILL, on both, the cache device is stale (B served alone
// since) and not used.
func TestAttachMirrorThroughBinary(t *testing.T) {
	need(t, "fio", "qemu-io")
	t.Parallel() // self-contained: its own files, sockets and processes
	backDisk := newFaultyDisk(t, 64*mib, false)
	dir := t.TempDir()
	a, b := sparseFile(t, dir, "a.img", 48*mib), sparseFile(t, dir, "b.img", 20*mib)
	run(t, time.Minute, bin, "format", "--cache", a, "--backing", "a="+backDisk.path, "--bucket-size", "256K", "--mode", "writeback", "--trust-path")
	backDisk.set(t, backDisk.writeT, true)
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", a, "--data-dir", dd)
	// Every region stays dirty: at most 7 MiB and 2 MiB of noise, within
	// the ~70 slots of B.
	f := &mirrorFio{t: t, s: &s, dd: dd, seed: 2000}

	f.write()
	if st := f.status(); strings.Contains(st, "mirror device") || strings.Contains(st, "DEGRADED") {
		t.Fatalf("status of a set on one device:\n%s", st)
	}
	running, aout, adone := f.startResilver(regexp.MustCompile(`(?m)^resilver\s+member B \(`+regexp.QuoteMeta(b)+`\): .* copied`), "attach-mirror", "--data-dir", dd, "--rate", "512K", b)
	t.Logf("status during the attach:\n%s", running)
	if !strings.Contains(running, "DEGRADED: member B, the mirror device, is being resilvered") {
		t.Fatalf("status during the attach does not say DEGRADED, B being resilvered:\n%s", running)
	}
	during, aerr := f.writeUntil(adone)
	if aerr != nil || !strings.Contains(aout.String(), "is attached as the mirror") {
		t.Fatalf("attach-mirror: %v\n%s\nserver log:\n%s", aerr, aout, s.log)
	}
	t.Logf("%d fio regions written during the attach: %s", during, strings.TrimSpace(aout.String()))
	st := f.status()
	if strings.Contains(st, "DEGRADED") || regexp.MustCompile(`(?m)^resilver\s`).MatchString(st) || !regexp.MustCompile(`(?m)^mirror device\s+`+regexp.QuoteMeta(b)).MatchString(st) {
		t.Fatalf("status after the attach:\n%s", st)
	}
	t.Logf("status after the attach:\n%s", st)
	f.write() // mirrored
	if st := f.status(); !strings.Contains(st, "dirty") || strings.Contains(st, " 0 B dirty") {
		t.Fatalf("no dirty data: the test would prove nothing\n%s", st)
	}

	f.kill(500 * time.Millisecond)
	s = startServer(t, "--cache", b, "--mirror-missing", "--data-dir", dd)
	f.verify("after SIGKILL, restarted on the attached mirror alone")
	f.kill(500 * time.Millisecond)
	s = startServer(t, "--cache", a, "--cache-mirror", b, "--data-dir", dd)
	if st := f.status(); !strings.Contains(st, "DEGRADED: member A") {
		t.Fatalf("status after the restart on both, B having served alone: the stale A is used:\n%s", st)
	}
	f.verify("after SIGKILL, restarted on both, A stale")
	backDisk.set(t, backDisk.writeT, false) // the server's cleanup stops it
}

// mirrorFio is the fio workload of the resilver tests through the binary
// on the server *s (a restart puts the new one there), data dir dd:
// regions of 1 MiB from offset 0, up to mirrorMaxRegions, each written by
// fio with crc32c verify headers and FLUSHes, then one FLUSH after all its
// writes completed (TestKillCyclesFio: fio's last FLUSH may be sent before
// its last writes complete), and verified later (fio --verify_only);
// noise writes in the 2 MiB after the regions.
type mirrorFio struct {
	t       *testing.T
	s       **server
	dd      string
	seed    int // fio's randseed of region 0
	regions int // written so far
}

const (
	mirrorRegion     = 1 * mib
	mirrorMaxRegions = 6
)

func (f *mirrorFio) args(i int, extra ...string) []string {
	return append([]string{
		"--name=flushed", "--ioengine=nbd", "--uri=" + (*f.s).uri("a"),
		"--rw=randwrite", "--bsrange=4k-64k", "--iodepth=8",
		fmt.Sprintf("--offset=%d", int64(i)*mirrorRegion), fmt.Sprintf("--size=%d", mirrorRegion), fmt.Sprintf("--randseed=%d", f.seed+i),
		"--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json",
	}, extra...)
}

// write writes and flushes the next region.
func (f *mirrorFio) write() {
	f.t.Helper()
	checkFio(f.t, run(f.t, 5*time.Minute, "fio", f.args(f.regions, "--do_verify=0", "--fsync=16", "--end_fsync=1")...))
	run(f.t, time.Minute, "qemu-io", "-f", "raw", "-c", "flush", (*f.s).uri("a"))
	f.regions++
}

// verify checks every region written.
func (f *mirrorFio) verify(how string) {
	f.t.Helper()
	for j := range f.regions {
		out, err := runErr(5*time.Minute, "fio", f.args(j, "--verify_only=1")...)
		if err != nil {
			f.t.Fatalf("%s: flushed fio region %d of %d does not verify: %v\n%s\nserver log:\n%s", how, j, f.regions, err, out, (*f.s).log)
		}
		checkFio(f.t, out)
	}
}

func (f *mirrorFio) status() string { return run(f.t, time.Minute, bin, "status", "--data-dir", f.dd) }

// startResilver runs the tiercache command args (a replace or an
// attach-mirror) in the background and returns the first status that
// running matches, with the command's output and its end.
func (f *mirrorFio) startResilver(running *regexp.Regexp, args ...string) (string, *syncBuffer, <-chan error) {
	f.t.Helper()
	cmd, out, done := background(f.t, bin, args...)
	f.t.Cleanup(func() { cmd.Process.Kill() })
	for deadline := time.Now().Add(time.Minute); ; {
		select {
		case err := <-done:
			f.t.Fatalf("%s ended before status showed it running: %v\n%s\nserver log:\n%s", args[0], err, out, (*f.s).log)
		default:
		}
		st := f.status()
		if running.MatchString(st) {
			return st, out, done
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("status never showed the %s running:\n%s", args[0], st)
		}
	}
}

// writeUntil writes regions until done (a startResilver's) reports, or
// the last region is written and then waits for it; it returns the
// regions written and done's error.
func (f *mirrorFio) writeUntil(done <-chan error) (int, error) {
	f.t.Helper()
	for n := 1; ; n++ {
		f.write()
		select {
		case err := <-done:
			return n, err
		default:
			if f.regions == mirrorMaxRegions {
				return n, <-done
			}
		}
	}
}

// kill SIGKILLs the server after delay of noise writes (unflushed).
func (f *mirrorFio) kill(delay time.Duration) {
	f.t.Helper()
	s := *f.s
	noise, _, ndone := background(f.t, "fio", "--thread", "--name=noise", "--ioengine=nbd", "--uri="+s.uri("a"),
		"--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16", fmt.Sprintf("--offset=%d", int64(mirrorMaxRegions+1)*mirrorRegion),
		fmt.Sprintf("--size=%d", 2*mib), "--time_based", "--runtime=60s")
	time.Sleep(delay)
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.waited = nil
	noise.Process.Kill()
	<-ndone
}
