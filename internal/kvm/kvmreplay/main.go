// Command kvmreplay replays a power-cut log inside the test guest
// (internal/kvm), for caches whose recovery only the kernel can run: bcache
// and dm-cache. The log is dm-log-writes' log of one data device holding
// the cache's devices as slices; kvmload's events file gives the oracle of
// the stamped-block workload, and the ext4 part's files are
// kvm.FileContents.
//
// For each point (kvm.ChoosePoints, plus the end of the log) it writes the
// data device as the point left it onto -work, runs -up (which assembles
// the cache on -work and must leave the stamped device at -stamp and the
// ext4 device at -fs), checks every stamped block against the oracle of the
// point (crashtest.Oracle.CheckCrash), replays ext4's journal, requires a
// clean e2fsck -fn, mounts it read-only and compares every file fsynced
// before the point, and runs -down. It prints one POINT line per point and
// a SUMMARY line; it exits non-zero only when it cannot run the replay (a
// point that fails its checks is reported, not fatal: the checked system is
// not tiercache).
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/kvm"
	"github.com/tiercache/tiercache/internal/logwrites"
)

type replay struct {
	name, up, down, stamp, fs, mnt string
	lg                             *logwrites.Log
	ev                             *kvm.Events

	blocks, durable, maybe, tornRead int
	fails                            map[string]int
}

func main() {
	r := &replay{fails: map[string]int{}}
	logPath := flag.String("log", "", "the log device")
	events := flag.String("events", "", "kvmload's events file")
	size := flag.Int64("size", 0, "bytes of the logged data device")
	base := flag.String("base", "/tmp/base.img", "file the log is replayed into, point after point")
	work := flag.String("work", "/dev/loop0", "device each point is written to before -up")
	flag.StringVar(&r.name, "name", "cache", "name of the system in the output")
	flag.StringVar(&r.up, "up", "", "shell command assembling the cache on -work")
	flag.StringVar(&r.down, "down", "", "shell command taking it apart")
	flag.StringVar(&r.stamp, "stamp", "", "the stamped device, once -up ran")
	flag.StringVar(&r.fs, "fs", "", "the ext4 device, once -up ran")
	flag.StringVar(&r.mnt, "mnt", "/mnt", "mount point for the ext4 check")
	seed := flag.Uint64("seed", 1, "seed of the sample of points")
	perKind := flag.Int("points", 4, "points of each kind (mark, FLUSH/FUA, torn) in the sample")
	full := flag.Bool("full", false, "every point instead of a sample")
	flag.Parse()
	if err := r.run(*logPath, *events, *base, *work, *size, *seed, *perKind, *full); err != nil {
		fmt.Fprintln(os.Stderr, "kvmreplay:", err)
		os.Exit(1)
	}
}

func (r *replay) run(logPath, events, basePath, work string, size int64, seed uint64, perKind int, full bool) error {
	lf, err := os.Open(logPath)
	if err != nil {
		return err
	}
	defer lf.Close()
	lsize, err := lf.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	if r.lg, err = logwrites.Open(lf, lsize); err != nil {
		return err
	}
	ef, err := os.Open(events)
	if err != nil {
		return err
	}
	r.ev, err = kvm.ReadEvents(ef)
	ef.Close()
	if err != nil {
		return err
	}
	points, err := kvm.ChoosePoints(r.lg, seed, full, perKind)
	if err != nil {
		return err
	}
	points = append(points, kvm.EndPoint(r.lg))
	base, err := os.Create(basePath)
	if err != nil {
		return err
	}
	defer base.Close()
	if err := base.Truncate(size); err != nil {
		return err
	}
	kinds := map[string]int{}
	rp := r.lg.NewReplayer(base)
	at := 0
	start := time.Now()
	endOK := false
	for _, p := range points {
		for ; at < p.Upto; at++ {
			if err := rp.Apply(r.lg.Entries[at], -1); err != nil {
				return err
			}
		}
		kinds[p.Kind]++
		if err := r.write(base, work, p); err != nil {
			return err
		}
		kind, err := r.check(p)
		if err != nil {
			r.fails[kind]++
			fmt.Printf("POINT %s %v FAIL %s: %v\n", r.name, p, kind, err)
		} else {
			fmt.Printf("POINT %s %v ok\n", r.name, p)
			endOK = endOK || p.Kind == "end"
		}
		if out, err := exec.Command("sh", "-c", r.down).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v\n%s", r.down, err, out)
		}
	}
	nf := 0
	var fk []string
	for _, k := range []string{"recovery", "stamped", "fsck", "files"} {
		nf += r.fails[k]
		fk = append(fk, fmt.Sprintf("%s=%d", k, r.fails[k]))
	}
	fmt.Printf("SUMMARY name=%s entries=%d points=%d mark=%d flush=%d torn=%d end=%d blocks=%d durable=%d maybe=%d tornread=%d failures=%d %s endok=%t per=%.1fs fuakept=%d\n",
		r.name, len(r.lg.Entries), len(points), kinds["mark"], kinds["flush"], kinds["torn"], kinds["end"], r.blocks, r.durable, r.maybe, r.tornRead,
		nf, strings.Join(fk, " "), endOK, time.Since(start).Seconds()/float64(len(points)), rp.Kept)
	return nil
}

// write puts the data device as point p left it onto work: the base image
// (entries [0, p.Upto)) and, for a torn point, its kept entries.
func (r *replay) write(base *os.File, work string, p kvm.Point) error {
	w, err := os.OpenFile(work, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer w.Close()
	if _, err := io.Copy(io.NewOffsetWriter(w, 0), io.NewSectionReader(base, 0, 1<<62)); err != nil {
		return err
	}
	// A torn point starts right after a FLUSH entry.
	tr := r.lg.NewReplayer(w)
	for i, idx := range p.Keep {
		sectors := int64(-1)
		if i == len(p.Keep)-1 {
			sectors = p.TornSectors
		}
		if err := tr.Apply(r.lg.Entries[idx], sectors); err != nil {
			return err
		}
	}
	return w.Sync()
}

// check assembles the cache on the point's devices and checks it; the
// string names the kind of a failure.
func (r *replay) check(p kvm.Point) (string, error) {
	if out, err := exec.Command("sh", "-c", r.up).CombinedOutput(); err != nil {
		return "recovery", fmt.Errorf("%s: %v\n%s", r.up, err, out)
	}
	if err := r.checkBlocks(p); err != nil {
		return "stamped", err
	}
	if out, err := exec.Command("e2fsck", "-E", "journal_only", "-p", r.fs).CombinedOutput(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() > 1 {
			return "fsck", fmt.Errorf("e2fsck journal replay: %v\n%s", err, out)
		}
	}
	if out, err := exec.Command("e2fsck", "-f", "-n", r.fs).CombinedOutput(); err != nil {
		return "fsck", fmt.Errorf("e2fsck -fn: %v\n%s", err, out)
	}
	if out, err := exec.Command("mount", "-t", "ext4", "-o", "ro", r.fs, r.mnt).CombinedOutput(); err != nil {
		return "fsck", fmt.Errorf("mount: %v\n%s", err, out)
	}
	defer exec.Command("umount", r.mnt).Run()
	for i := 1; i <= p.LastE; i++ {
		b, err := os.ReadFile(fmt.Sprintf("%s/f%d", r.mnt, i))
		if err != nil {
			return "files", fmt.Errorf("file f%d, fsynced before the point: %v", i, err)
		}
		if !bytes.Equal(b, kvm.FileContents(i)) {
			return "files", fmt.Errorf("file f%d, fsynced before the point: %d bytes, want %d, contents differ", i, len(b), len(kvm.FileContents(i)))
		}
	}
	return "", nil
}

// checkBlocks reads every stamped block and checks it against the oracle
// of the point's last mark.
func (r *replay) checkBlocks(p kvm.Point) error {
	o, err := r.ev.OracleAt(p.LastF)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(r.stamp, os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	const chunk = 256
	buf := aligned(chunk * crashtest.BlockSize)
	var bad []string
	nbad := 0
	for lba := int64(0); lba < r.ev.Blocks; lba += chunk {
		n := min(chunk, r.ev.Blocks-lba)
		if _, err := f.ReadAt(buf[:n*crashtest.BlockSize], lba*crashtest.BlockSize); err != nil {
			return fmt.Errorf("reading blocks %d+%d: %w", lba, n, err)
		}
		for i := int64(0); i < n; i++ {
			b := buf[i*crashtest.BlockSize : (i+1)*crashtest.BlockSize]
			got := crashtest.Decode(b, r.ev.Seed, uint64(lba+i))
			out, err := o.CheckCrash(lba+i, got)
			if err != nil && p.Kind == "torn" && got.Kind == crashtest.KindTorn {
				// A write torn by the cut, read back as it landed: each
				// sector must hold what an allowed content holds there.
				if err = r.ev.TornAllowed(p.LastF, lba+i, b); err == nil {
					r.tornRead++
					continue
				}
			}
			switch {
			case err != nil:
				nbad++
				if len(bad) < 5 {
					bad = append(bad, err.Error())
				}
			case out == crashtest.Durable && got.Kind == crashtest.KindWrite:
				r.durable++
			case out != crashtest.Durable:
				r.maybe++
			}
		}
	}
	r.blocks += int(r.ev.Blocks)
	if nbad > 0 {
		return fmt.Errorf("%d of %d stamped blocks wrong: %s", nbad, r.ev.Blocks, strings.Join(bad, "; "))
	}
	return nil
}

// aligned returns an n-byte buffer aligned for O_DIRECT.
func aligned(n int) []byte {
	b := make([]byte, n+crashtest.BlockSize)
	off := int(crashtest.BlockSize - uintptr(unsafe.Pointer(unsafe.SliceData(b)))%crashtest.BlockSize)
	return b[off%crashtest.BlockSize:][:n]
}
