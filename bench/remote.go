package bench

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"
	"unsafe"

	"github.com/tiercache/tiercache/nbd"
)

// The remote backing device benchmark (make bench-remote): the project's
// HDD model served over NBD on loopback TCP by a tiercache server with no
// cache (`serve --export hdd=hdd:FILE`) is the remote; a cache set on a
// SATA SSD model in front of it (backing nbd://127.0.0.1:PORT/hdd) is
// measured beside the remote reached straight. Every case starts a fresh
// remote (so the model's write cache and head start empty), the cases of a
// round run one after the other, rounds repeat the whole list in a
// rotated order, and the report gives each round and the median.
//
// Cases:
//
//   - randwrite: fio's nbd engine, 4 KiB random writes at queue depth 8
//     over a region that fits the cache, straight and through the cache;
//   - drain: RemoteOptions.DrainMiB of 4 KiB random blocks over the first
//     GiB (a fixed seed: the same blocks in every case), written straight
//     to the remote in that (arrival) order at queue depth 32, the same
//     blocks sorted at queue depth 1, and written into the cache (with
//     writeback_percent=100, so nothing is written back meanwhile) and
//     drained by 'tiercache flush' (timed from the end of the writes: what
//     background writeback does once the client is idle counts too); each
//     ends with the remote's FLUSH;
//   - link: the drain's three cases with every read and write of the
//     remote delayed by RemoteOptions.Delay (nbdkit's nbd plugin and delay
//     filter in front of the remote, on TCP);
//   - the same drain through an nbdfuse-mounted file of the remote: the
//     arrival-order writes as pwrite (O_DIRECT) at queue depth 32 on the
//     file, and a cache set whose backing device is the file;
//   - seqread: fio, 1 MiB sequential reads at queue depth 1 of data on
//     the remote, straight and through a cold cache.

// RemoteOptions configure RunRemote.
type RemoteOptions struct {
	Tiercache string // the tiercache binary
	Rounds    int
	Runtime   time.Duration // fio's time-based cases
	DrainMiB  int
	WriteMiB  int           // randwrite's region
	ReadMiB   int           // seqread's length
	Delay     time.Duration // the link case's delay of each read and write
	Workdir   string        // "" = a temporary directory
	Cases     []string
}

var remoteCases = []string{"randwrite", "drain", "link", "fuse", "seqread"}

const remoteSpan = 1 << 30 // the remote export: 1 GiB

func remoteMain(args []string) int {
	o := RemoteOptions{}
	fs := flag.NewFlagSet("tcbench remote", flag.ContinueOnError)
	fs.StringVar(&o.Tiercache, "tiercache", "bin/tiercache", "tiercache binary")
	fs.IntVar(&o.Rounds, "rounds", 3, "rounds of every case")
	fs.DurationVar(&o.Runtime, "runtime", 20*time.Second, "length of each fio random-write run")
	fs.IntVar(&o.DrainMiB, "drain-mib", 64, "MiB of random 4 KiB dirty blocks drained")
	fs.IntVar(&o.WriteMiB, "write-mib", 256, "MiB region of the random writes")
	fs.IntVar(&o.ReadMiB, "read-mib", 256, "MiB read sequentially")
	fs.DurationVar(&o.Delay, "delay", time.Millisecond, "the link case: delay of every read and write (nbdkit's delay filter in front of the remote)")
	fs.StringVar(&o.Workdir, "workdir", "", "work directory (default: a temporary one, removed)")
	cases := fs.String("cases", strings.Join(remoteCases, ","), "cases to run: "+strings.Join(remoteCases, ","))
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	o.Cases = strings.Split(*cases, ",")
	for _, c := range o.Cases {
		if !slices.Contains(remoteCases, c) {
			fmt.Fprintf(os.Stderr, "tcbench remote: unknown case %q\n", c)
			return 2
		}
	}
	ctx, stop := signalContext()
	defer stop()
	if err := RunRemote(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "tcbench remote:", err)
		return 1
	}
	return 0
}

// remoteRun is one RunRemote.
type remoteRun struct {
	o     RemoteOptions
	dir   string
	img   string // the remote's data
	lbas  []int64
	out   io.Writer
	procs []*process
	// figures[name] holds one value per round.
	figures map[string][]float64
}

// RunRemote runs the remote backing benchmark and writes its report.
func RunRemote(ctx context.Context, o RemoteOptions, out io.Writer) (err error) {
	r := &remoteRun{o: o, out: out, figures: map[string][]float64{}}
	if o.Workdir == "" {
		d, err := os.MkdirTemp("", "tcbr")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		r.dir = d
	} else {
		r.dir = o.Workdir
		if err := os.MkdirAll(r.dir, 0o755); err != nil {
			return err
		}
	}
	defer r.stopAll()
	// The remote's data: ReadMiB of random bytes (what seqread reads), the
	// rest a hole.
	r.img = filepath.Join(r.dir, "remote.img")
	if err := writeRandomFile(r.img, int64(o.ReadMiB)<<20, remoteSpan); err != nil {
		return err
	}
	r.lbas = drainLBAs(o.DrainMiB<<20/4096, remoteSpan/4096, 42)
	fmt.Fprintf(out, "remote: tiercache serve --export hdd=hdd:FILE (HDD model, 1 GiB) on loopback TCP; cache: SATA SSD model, writeback\n")
	fmt.Fprintf(out, "start %s, load %s\n", time.Now().UTC().Format(time.RFC3339), loadavg())
	for round := range o.Rounds {
		cs := slices.Clone(o.Cases)
		k := round % len(cs)
		cs = append(cs[k:], cs[:k]...)
		for _, c := range cs {
			if err := ctx.Err(); err != nil {
				return err
			}
			var err error
			switch c {
			case "randwrite":
				err = r.randwrite(ctx)
			case "drain":
				err = r.drain(ctx)
			case "link":
				err = r.link(ctx)
			case "fuse":
				err = r.fuse(ctx)
			case "seqread":
				err = r.seqread(ctx)
			}
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round+1, c, err)
			}
		}
	}
	fmt.Fprintf(out, "end %s, load %s\n\n", time.Now().UTC().Format(time.RFC3339), loadavg())
	r.report()
	return nil
}

// note records one round's figure and prints it at once.
func (r *remoteRun) note(name string, v float64, unit string) {
	r.figures[name] = append(r.figures[name], v)
	fmt.Fprintf(r.out, "  %-44s %10.2f %s   (load %s)\n", name, v, unit, loadavg())
}

// The figures' names (the report's rows and ratios).
const (
	fStraightWrite = "randwrite IOPS, straight to the remote"
	fCacheWrite    = "randwrite IOPS, through the cache"
	fArrival       = "drain: arrival order QD32 straight, s"
	fSortedQD1     = "drain: sorted QD1 straight, s"
	fDrain         = "drain: written back by the cache, s"
	fDrainFill     = "drain: writes into the cache, s"
	fFuseFill      = "nbdfuse: writes into the cache, s"
	fFlushClean    = "drain: tiercache flush with nothing dirty, s"
	fLinkArrival   = "link: arrival order QD32 straight, s"
	fLinkSorted    = "link: sorted QD1 straight, s"
	fLinkFill      = "link: writes into the cache, s"
	fLinkDrain     = "link: written back by the cache, s"
	fFuseArrival   = "nbdfuse: arrival order QD32 pwrite, s"
	fFuseDrain     = "nbdfuse: written back by the cache, s"
	fStraightRead  = "seqread MB/s, straight from the remote"
	fCacheRead     = "seqread MB/s, through the cold cache"
)

func (r *remoteRun) report() {
	w := tabwriter.NewWriter(r.out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "figure\tmedian\trounds\n")
	rows := []string{fStraightWrite, fCacheWrite, fArrival, fSortedQD1, fDrainFill, fDrain, fFlushClean, fLinkArrival, fLinkSorted, fLinkFill, fLinkDrain, fFuseArrival, fFuseFill, fFuseDrain, fStraightRead, fCacheRead}
	for _, n := range rows {
		xs := r.figures[n]
		if len(xs) == 0 {
			continue
		}
		m, _ := median(xs)
		fmt.Fprintf(w, "%s\t%.2f\t%s\n", n, m, fmtList(xs))
	}
	fmt.Fprintf(w, "\nratio (bar)\tmedian of rounds\trounds\n")
	for _, q := range []struct {
		what     string
		num, den string
		bar      float64
	}{
		{"randwrite: cache / straight (>= 10x)", fCacheWrite, fStraightWrite, 10},
		{"drain vs arrival order (>= 2.5x)", fArrival, fDrain, 2.5},
		{"drain vs sorted QD1 (>= 1x)", fSortedQD1, fDrain, 1},
		{"link: drain vs arrival order (>= 2.5x)", fLinkArrival, fLinkDrain, 2.5},
		{"link: drain vs sorted QD1 (>= 1x)", fLinkSorted, fLinkDrain, 1},
		{"nbdfuse drain vs nbdfuse arrival (>= 1x)", fFuseArrival, fFuseDrain, 1},
		{"seqread: cold cache / straight (>= 0.95x)", fCacheRead, fStraightRead, 0.95},
	} {
		a, b := r.figures[q.num], r.figures[q.den]
		n := min(len(a), len(b))
		if n == 0 {
			continue
		}
		var rs []float64
		for i := range n {
			rs = append(rs, a[i]/b[i])
		}
		m, _ := median(rs)
		met := "met"
		if m < q.bar {
			met = "NOT met"
		}
		fmt.Fprintf(w, "%s\t%.2fx %s\t%s\n", q.what, m, met, fmtList(rs))
	}
	w.Flush()
}

func fmtList(xs []float64) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(s, " ")
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// randwrite: fio 4 KiB random writes, straight and through the cache.
func (r *remoteRun) randwrite(ctx context.Context) error {
	job := []string{"--rw=randwrite", "--bs=4k", "--iodepth=8", fmt.Sprintf("--size=%dm", r.o.WriteMiB),
		"--time_based", fmt.Sprintf("--runtime=%d", int(r.o.Runtime.Seconds())), "--ramp_time=3", "--randrepeat=0"}
	rem, err := r.startRemote(ctx, "rw-straight")
	if err != nil {
		return err
	}
	iops, err := r.fio(ctx, rem.uri, job)
	r.release(rem)
	if err != nil {
		return err
	}
	r.note(fStraightWrite, iops, "IOPS")
	rem, err = r.startRemote(ctx, "rw-cache")
	if err != nil {
		return err
	}
	defer r.release(rem)
	tc, err := r.startCache(ctx, "rw-cache", rem.uri, false)
	if err != nil {
		return err
	}
	defer r.release(tc)
	iops, err = r.fio(ctx, tc.uri, job)
	if err != nil {
		return err
	}
	r.note(fCacheWrite, iops, "IOPS")
	return nil
}

// seqread: fio 1 MiB sequential reads at QD1, straight and cold cache.
func (r *remoteRun) seqread(ctx context.Context) error {
	job := []string{"--rw=read", "--bs=1m", "--iodepth=1", fmt.Sprintf("--size=%dm", r.o.ReadMiB)}
	rem, err := r.startRemote(ctx, "rd-straight")
	if err != nil {
		return err
	}
	bw, err := r.fioBW(ctx, rem.uri, job)
	r.release(rem)
	if err != nil {
		return err
	}
	r.note(fStraightRead, bw, "MB/s")
	rem, err = r.startRemote(ctx, "rd-cache")
	if err != nil {
		return err
	}
	defer r.release(rem)
	tc, err := r.startCache(ctx, "rd-cache", rem.uri, false)
	if err != nil {
		return err
	}
	defer r.release(tc)
	bw, err = r.fioBW(ctx, tc.uri, job)
	if err != nil {
		return err
	}
	r.note(fCacheRead, bw, "MB/s")
	return nil
}

// drain: arrival order and sorted QD1 straight, then the cache's drain.
func (r *remoteRun) drain(ctx context.Context) error {
	for _, c := range []struct {
		name string
		qd   int
		sort bool
	}{{fArrival, 32, false}, {fSortedQD1, 1, true}} {
		rem, err := r.startRemote(ctx, "straight")
		if err != nil {
			return err
		}
		lbas := r.lbas
		if c.sort {
			lbas = slices.Sorted(slices.Values(lbas))
		}
		d, err := writeNBD(ctx, "tcp", rem.addr, "hdd", lbas, c.qd)
		r.release(rem)
		if err != nil {
			return err
		}
		r.note(c.name, d.Seconds(), "s")
	}
	rem, err := r.startRemote(ctx, "drain")
	if err != nil {
		return err
	}
	defer r.release(rem)
	return r.cacheDrain(ctx, "drain", rem.uri, false, fDrainFill, fDrain)
}

// cacheDrain fills a fresh cache set over backing with the drain's blocks
// and times its drain.
func (r *remoteRun) cacheDrain(ctx context.Context, tag, backing string, trust bool, fillFig, fig string) error {
	tc, err := r.startCache(ctx, tag, backing, trust)
	if err != nil {
		return err
	}
	defer r.release(tc)
	if err := r.tc(ctx, tc.dir, "set", "vm", "writeback_percent=100"); err != nil {
		return err
	}
	fill, err := writeNBD(ctx, "unix", tc.sock, "vm", r.lbas, 32)
	if err != nil {
		return err
	}
	r.note(fillFig, fill.Seconds(), "s")
	t0 := time.Now()
	if err := r.tc(ctx, tc.dir, "flush", "vm"); err != nil {
		return err
	}
	r.note(fig, time.Since(t0).Seconds(), "s")
	if fig == fDrain {
		// What the command costs with nothing to write back.
		t0 = time.Now()
		if err := r.tc(ctx, tc.dir, "flush", "vm"); err != nil {
			return err
		}
		r.note(fFlushClean, time.Since(t0).Seconds(), "s")
	}
	return nil
}

// link: the drain with every read and write of the remote delayed by
// o.Delay (nbdkit's nbd plugin and delay filter in front of it: a link
// with a round trip).
func (r *remoteRun) link(ctx context.Context) error {
	for _, c := range []struct {
		name string
		qd   int
		sort bool
	}{{fLinkArrival, 32, false}, {fLinkSorted, 1, true}} {
		rem, proxy, err := r.startLinked(ctx, "link-straight")
		if err != nil {
			return err
		}
		lbas := r.lbas
		if c.sort {
			lbas = slices.Sorted(slices.Values(lbas))
		}
		d, err := writeNBD(ctx, "tcp", proxy.addr, "", lbas, c.qd)
		r.release(proxy)
		r.release(rem)
		if err != nil {
			return err
		}
		r.note(c.name, d.Seconds(), "s")
	}
	rem, proxy, err := r.startLinked(ctx, "link-drain")
	if err != nil {
		return err
	}
	defer r.release(rem)
	defer r.release(proxy)
	return r.cacheDrain(ctx, "link", proxy.uri, true, fLinkFill, fLinkDrain)
}

// startLinked starts a remote and nbdkit in front of it on TCP, delaying
// every read and write by o.Delay.
func (r *remoteRun) startLinked(ctx context.Context, tag string) (rem, proxy *served, err error) {
	rem, err = r.startRemote(ctx, tag)
	if err != nil {
		return nil, nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		r.release(rem)
		return nil, nil, err
	}
	addr := l.Addr().String()
	l.Close()
	_, port, _ := net.SplitHostPort(addr)
	ms := fmt.Sprintf("%dms", r.o.Delay.Milliseconds())
	argv := []string{"nbdkit", "-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", port, "--filter=delay",
		"nbd", "uri=" + rem.uri, "delay-read=" + ms, "delay-write=" + ms}
	p, err := startProcess("nbdkit", argv, filepath.Join(rem.dir, "nbdkit.log"))
	if err != nil {
		r.release(rem)
		return nil, nil, err
	}
	r.procs = append(r.procs, p)
	for deadline := time.Now().Add(30 * time.Second); ; {
		c, err := nbd.Dial(ctx, "tcp", addr, "", nbd.ClientOptions{})
		if err == nil {
			c.Close()
			break
		}
		if p.exited() || time.Now().After(deadline) {
			r.discard(p)
			r.release(rem)
			return nil, nil, fmt.Errorf("nbdkit in front of %s: %v: %s", rem.uri, err, p.logTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return rem, &served{p: p, addr: addr, uri: "nbd://" + addr + "/"}, nil
}

// fuse: the drain through an nbdfuse-mounted file of the remote.
func (r *remoteRun) fuse(ctx context.Context) error {
	for _, cache := range []bool{false, true} {
		tag := "fuse-straight"
		if cache {
			tag = "fuse-cache"
		}
		rem, err := r.startRemote(ctx, tag)
		if err != nil {
			return err
		}
		file, unmount, err := r.nbdfuse(ctx, tag, rem.uri)
		if err != nil {
			r.release(rem)
			return err
		}
		if cache {
			err = r.cacheDrain(ctx, tag, file, true, fFuseFill, fFuseDrain)
		} else {
			var d time.Duration
			if d, err = writeFile(file, r.lbas, 32); err == nil {
				r.note(fFuseArrival, d.Seconds(), "s")
			}
		}
		unmount()
		r.release(rem)
		if err != nil {
			return err
		}
	}
	return nil
}

// served is a server started by the benchmark.
type served struct {
	p    *process
	dir  string
	sock string // its unix socket
	addr string // its TCP address (remote only)
	uri  string
}

// startRemote serves the remote's data on the HDD model over TCP (and a
// unix socket, to wait for it).
func (r *remoteRun) startRemote(ctx context.Context, tag string) (*served, error) {
	dir, err := os.MkdirTemp(r.dir, "remote-"+tag+"-")
	if err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.Close()
	sock := filepath.Join(dir, "s")
	argv := []string{r.o.Tiercache, "--data-dir", dir, "serve", "--export", "hdd=hdd:" + r.img,
		"--listen", "unix:" + sock, "--listen", "tcp:" + addr, "--direct", "off"}
	p, err := r.start(ctx, "remote", argv, dir, sock)
	if err != nil {
		return nil, err
	}
	return &served{p: p, dir: dir, sock: sock, addr: addr, uri: "nbd://" + addr + "/hdd"}, nil
}

// startCache formats a fresh writeback cache set (SATA SSD model, twice
// the random-write region) over backing and serves it on a unix socket.
// trust: backing has nothing that identifies it but its path or URI (the
// nbdfuse file; nbdkit's export, which has no description).
func (r *remoteRun) startCache(ctx context.Context, tag, backing string, trust bool) (*served, error) {
	dir, err := os.MkdirTemp(r.dir, "cache-"+tag+"-")
	if err != nil {
		return nil, err
	}
	cf := filepath.Join(dir, "cache.img")
	size := int64(2*max(r.o.WriteMiB, r.o.DrainMiB)) << 20
	if err := os.WriteFile(cf, nil, 0o644); err != nil {
		return nil, err
	}
	if err := os.Truncate(cf, size); err != nil {
		return nil, err
	}
	format := []string{"format", "--cache", "ssd:" + cf, "--backing", "vm=" + backing, "--mode", "writeback", "--direct", "off"}
	if trust {
		format = append(format, "--trust-path")
	}
	if err := r.tc(ctx, dir, format...); err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "s")
	argv := []string{r.o.Tiercache, "--data-dir", dir, "serve", "--cache", "ssd:" + cf, "--listen", "unix:" + sock, "--direct", "off"}
	p, err := r.start(ctx, "cache", argv, dir, sock)
	if err != nil {
		return nil, err
	}
	return &served{p: p, dir: dir, sock: sock, uri: "nbd+unix:///vm?socket=" + sock}, nil
}

func (r *remoteRun) start(ctx context.Context, name string, argv []string, dir, sock string) (*process, error) {
	p, err := startProcess(name, argv, filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	r.procs = append(r.procs, p)
	if err := waitNBD(ctx, p, sock, 30*time.Second); err != nil {
		r.discard(p)
		return nil, err
	}
	return p, nil
}

// discard kills a server whose state the benchmark throws away (the HDD
// model would otherwise destage its write cache at shutdown).
func (r *remoteRun) discard(p *process) {
	if !p.exited() {
		_ = syscall.Kill(-p.pid(), syscall.SIGKILL)
		<-p.done
	}
}

// release discards a server and removes its directory (a case's cache
// image holds up to its whole size).
func (r *remoteRun) release(s *served) {
	r.discard(s.p)
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}

func (r *remoteRun) stopAll() {
	for _, p := range r.procs {
		r.discard(p)
	}
}

// tc runs a tiercache command with --data-dir dir.
func (r *remoteRun) tc(ctx context.Context, dir string, args ...string) error {
	argv := append([]string{r.o.Tiercache, "--data-dir", dir}, args...)
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", shellJoin(argv), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// nbdfuse mounts uri as a file and returns its path and the unmount.
func (r *remoteRun) nbdfuse(ctx context.Context, tag, uri string) (string, func(), error) {
	dir, err := os.MkdirTemp(r.dir, "fuse-"+tag+"-")
	if err != nil {
		return "", nil, err
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return "", nil, err
	}
	pidf := filepath.Join(dir, "pid")
	p, err := startProcess("nbdfuse", []string{"nbdfuse", "-P", pidf, mnt + "/disk", uri}, filepath.Join(dir, "nbdfuse.log"))
	if err != nil {
		return "", nil, err
	}
	r.procs = append(r.procs, p)
	unmount := func() {
		_ = exec.Command("fusermount3", "-u", mnt).Run()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = exec.Command("fusermount3", "-uz", mnt).Run()
			r.discard(p)
		}
		_ = os.RemoveAll(dir)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := os.Stat(pidf); err == nil {
			break
		}
		if p.exited() || time.Now().After(deadline) {
			unmount()
			return "", nil, fmt.Errorf("nbdfuse did not mount %s: %s", uri, p.logTail())
		}
		select {
		case <-ctx.Done():
			unmount()
			return "", nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return mnt + "/disk", unmount, nil
}

// fio runs one fio job on uri and returns its write or read IOPS.
func (r *remoteRun) fio(ctx context.Context, uri string, job []string) (float64, error) {
	j, err := r.runFio(ctx, uri, job)
	if err != nil {
		return 0, err
	}
	return j.Write.IOPS + j.Read.IOPS, nil
}

// fioBW is fio returning MB/s read and written.
func (r *remoteRun) fioBW(ctx context.Context, uri string, job []string) (float64, error) {
	j, err := r.runFio(ctx, uri, job)
	if err != nil {
		return 0, err
	}
	return float64(j.Write.BWBytes+j.Read.BWBytes) / 1e6, nil
}

type fioJobRW struct {
	IOPS    float64 `json:"iops"`
	BWBytes int64   `json:"bw_bytes"`
}

type fioJobOut struct {
	Read  fioJobRW `json:"read"`
	Write fioJobRW `json:"write"`
}

func (r *remoteRun) runFio(ctx context.Context, uri string, job []string) (fioJobOut, error) {
	jf := filepath.Join(r.dir, "fio.json")
	argv := append([]string{"fio", "--name=j", "--ioengine=nbd", "--uri=" + uri, "--output-format=json", "--output=" + jf}, job...)
	if msg, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput(); err != nil {
		return fioJobOut{}, fmt.Errorf("%s: %w: %s", shellJoin(argv), err, msg)
	}
	out, err := os.ReadFile(jf)
	if err != nil {
		return fioJobOut{}, err
	}
	var res struct {
		Jobs []fioJobOut `json:"jobs"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) != 1 {
		return fioJobOut{}, fmt.Errorf("%s: output: %v", shellJoin(argv), err)
	}
	return res.Jobs[0], nil
}

// drainLBAs returns n distinct 4 KiB block numbers below span, in a
// random order fixed by seed.
func drainLBAs(n int, span int64, seed uint64) []int64 {
	rng := rand.New(rand.NewPCG(seed, 1))
	seen := make(map[int64]bool, n)
	out := make([]int64, 0, n)
	for len(out) < n {
		l := rng.Int64N(span)
		if !seen[l] {
			seen[l] = true
			out = append(out, l)
		}
	}
	return out
}

// writeNBD writes a 4 KiB block at each of lbas (in that order, qd in
// flight) to an NBD export, then FLUSHes; it returns the time taken.
func writeNBD(ctx context.Context, network, addr, export string, lbas []int64, qd int) (time.Duration, error) {
	c, err := nbd.Dial(ctx, network, addr, export, nbd.ClientOptions{StructuredReplies: true})
	if err != nil {
		return 0, err
	}
	defer c.Close()
	start := time.Now()
	err = inOrder(lbas, qd, func(buf []byte, off int64) error { return c.WriteAt(buf, off, false) })
	if err == nil {
		err = c.Flush()
	}
	return time.Since(start), err
}

// writeFile is writeNBD with pwrite on a file opened with O_DIRECT, and
// fsync at the end.
func writeFile(path string, lbas []int64, qd int) (time.Duration, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_DIRECT, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	start := time.Now()
	err = inOrder(lbas, qd, func(buf []byte, off int64) error { _, err := f.WriteAt(buf, off); return err })
	if err == nil {
		err = f.Sync()
	}
	return time.Since(start), err
}

// inOrder calls write for each of lbas, taken in order by qd workers.
func inOrder(lbas []int64, qd int, write func(buf []byte, off int64) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, qd)
	for w := range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := alignedBlock()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(lbas)) {
					return
				}
				buf[0], buf[1] = byte(i), byte(i>>8)
				if err := write(buf, lbas[i]*4096); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// alignedBlock returns a 4 KiB buffer aligned for O_DIRECT.
func alignedBlock() []byte {
	b := make([]byte, 8192)
	off := int((4096 - uintptr(unsafe.Pointer(unsafe.SliceData(b)))%4096) % 4096)
	return b[off : off+4096]
}

// writeRandomFile makes a file of size bytes whose first n are random.
func writeRandomFile(path string, n, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(7, 7))
	buf := make([]byte, 1<<20)
	for done := int64(0); done < n; done += int64(len(buf)) {
		for i := 0; i < len(buf); i += 8 {
			v := rng.Uint64()
			for k := range 8 {
				buf[i+k] = byte(v >> (8 * k))
			}
		}
		if _, err := f.Write(buf); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
