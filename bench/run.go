package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Sample is one fio run against one target in one round.
type Sample struct {
	Round     int     `json:"round"`
	Target    string  `json:"target"` // a server or a baseline name
	Workload  string  `json:"workload"`
	IOPS      float64 `json:"iops"`
	MiBps     float64 `json:"mib_per_s"`
	Bytes     int64   `json:"bytes"`
	LatMeanUs float64 `json:"lat_mean_us"`
	LatP99Us  float64 `json:"lat_p99_us"`
	// ServerCPUSec is the server's user+system CPU during the measured
	// time; HasServerCPU is false for baselines, which have no server.
	ServerCPUSec float64 `json:"server_cpu_s"`
	HasServerCPU bool    `json:"has_server_cpu"`
	ClientCPUPct float64 `json:"fio_cpu_pct"`
	// OtherCores estimates the CPUs kept busy by everything else on the
	// machine during the measured time: all CPUs' busy time, minus the
	// server's and fio's, divided by the wall time. The machine is
	// shared; this says how much it was.
	OtherCores float64 `json:"other_cores"`
}

// value returns the sample's figure for metric m.
func (s Sample) value(m Metric) float64 {
	if m == MetricMiBps {
		return s.MiBps
	}
	return s.IOPS
}

// cpuPerGiB returns the server CPU seconds per GiB moved, NaN if unknown.
func (s Sample) cpuPerGiB() float64 {
	if !s.HasServerCPU {
		return math.NaN()
	}
	v, ok := cpuPerGiB(s.ServerCPUSec, s.Bytes)
	if !ok {
		return math.NaN()
	}
	return v
}

// runner holds the state of one harness run.
type runner struct {
	opts     Options
	workdir  string
	file     string   // the data file every target serves
	dataFile *os.File // kept open to fsync between runs
	tcBin    string
	servers  registry
	prog     progress
	log      io.Writer
	samples  []Sample
	commands []string // every distinct command line, for the report
	retries  int      // fio runs rerun after an outside signal
	seenCmd  map[string]bool
}

// noteCommand records a command line for the report, once.
func (r *runner) noteCommand(argv []string) {
	line := shellJoin(argv)
	if r.seenCmd == nil {
		r.seenCmd = make(map[string]bool)
	}
	if !r.seenCmd[line] {
		r.seenCmd[line] = true
		r.commands = append(r.commands, line)
	}
}

// createDataFile writes size bytes of pseudo-random data to path and syncs
// it, so that reads hit real data (not holes or zero pages) and nothing is
// dirty when the first measurement starts.
func createDataFile(ctx context.Context, path string, size int64) (err error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("create data file: %w", err)
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close data file: %w", cerr)
		}
	}()
	rng := rand.NewChaCha8([32]byte{'t', 'i', 'e', 'r', 'c', 'a', 'c', 'h', 'e'})
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(buf)) {
		if err := ctx.Err(); err != nil {
			return err
		}
		chunk := buf[:min(int64(len(buf)), size-off)]
		if _, err := rng.Read(chunk); err != nil {
			return fmt.Errorf("fill data file: %w", err)
		}
		if _, err := f.WriteAt(chunk, off); err != nil {
			return fmt.Errorf("write data file at %d: %w", off, err)
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync data file: %w", err)
	}
	// Read it back once so that the whole file is in the page cache
	// before the first target runs.
	if _, err := io.Copy(io.Discard, io.NewSectionReader(f, 0, size)); err != nil {
		return fmt.Errorf("warm data file: %w", err)
	}
	return nil
}

// settle makes the data file clean before a measurement, so that writeback
// of the previous run's dirty pages is not charged to the next target.
func (r *runner) settle() error {
	if err := r.dataFile.Sync(); err != nil {
		return fmt.Errorf("sync data file between runs: %w", err)
	}
	return nil
}

// runFio runs fio with args and parses its JSON from outPath. When
// serverPID is positive, the server's CPU time is sampled when the ramp ends
// and after fio exits, so that it covers the measured time (plus fio's
// teardown, which is short).
// cpuWindow is what runFio measured around the fio run.
type cpuWindow struct {
	server time.Duration // the server's CPU time
	system time.Duration // all CPUs' busy time
	wall   time.Duration
}

func (r *runner) runFio(ctx context.Context, args []string, outPath string, serverPID int, ramp time.Duration) (fioResult, cpuWindow, error) {
	argv := append([]string{"fio"}, args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second

	type point struct {
		server, system time.Duration
		at             time.Time
	}
	cpuAt := func() (point, error) {
		p := point{at: time.Now()}
		var err error
		if p.system, err = systemBusy(); err != nil {
			return p, err
		}
		if serverPID > 0 {
			p.server, err = processCPU(serverPID)
		}
		return p, err
	}
	cpu0, err := cpuAt()
	if err != nil {
		return fioResult{}, cpuWindow{}, err
	}
	if err := cmd.Start(); err != nil {
		return fioResult{}, cpuWindow{}, fmt.Errorf("start fio: %w", err)
	}
	waitc := make(chan error, 1)
	go func() { waitc <- cmd.Wait() }()
	var werr error
	waited := false
	if ramp > 0 {
		select {
		case <-time.After(ramp):
			if cpu0, err = cpuAt(); err != nil {
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				<-waitc
				return fioResult{}, cpuWindow{}, fmt.Errorf("at end of ramp: %w", err)
			}
		case werr = <-waitc:
			waited = true
		}
	}
	if !waited {
		werr = <-waitc
	}
	cpu1, cerr := cpuAt()
	if werr != nil {
		if ctx.Err() != nil {
			return fioResult{}, cpuWindow{}, ctx.Err()
		}
		if data, _ := os.ReadFile(outPath); bytes.Contains(append(out.Bytes(), data...), []byte("terminating on signal")) {
			return fioResult{}, cpuWindow{}, fmt.Errorf("%w: signalled (%v)", errFioInterrupted, werr)
		}
		return fioResult{}, cpuWindow{}, fmt.Errorf("fio: %w; output:\n%s", werr, strings.TrimSpace(out.String()))
	}
	if cerr != nil {
		return fioResult{}, cpuWindow{}, fmt.Errorf("after fio: %w", cerr)
	}
	data, err := os.ReadFile(outPath)
	if err != nil {
		return fioResult{}, cpuWindow{}, fmt.Errorf("read fio result: %w", err)
	}
	res, err := parseFioJSON(data)
	if err != nil {
		return fioResult{}, cpuWindow{}, fmt.Errorf("%s: %w", outPath, err)
	}
	if want := r.opts.Runtime.Seconds(); res.RuntimeSec < 0.9*want {
		return fioResult{}, cpuWindow{}, fmt.Errorf("%w: measured %.2fs of %.0fs", errFioInterrupted, res.RuntimeSec, want)
	}
	return res, cpuWindow{server: cpu1.server - cpu0.server, system: cpu1.system - cpu0.system, wall: cpu1.at.Sub(cpu0.at)}, nil
}

// maxFioRetries bounds reruns of a fio run that something outside the
// harness killed.
const maxFioRetries = 2

// runFioRetry runs fio, and runs it again when a signal from outside the
// harness ended it (on a shared machine, someone's `pkill fio`). Any other
// failure is returned at once.
func (r *runner) runFioRetry(ctx context.Context, args []string, outPath string, serverPID int) (fioResult, cpuWindow, error) {
	for attempt := 0; ; attempt++ {
		res, win, err := r.runFio(ctx, args, outPath, serverPID, r.opts.Ramp)
		if err == nil || ctx.Err() != nil || attempt == maxFioRetries || !errors.Is(err, errFioInterrupted) {
			return res, win, err
		}
		r.retries++
		fmt.Fprintf(r.log, "tcbench: %v; running it again\n", err)
	}
}

// errFioInterrupted marks a fio run ended early by something outside the
// harness: a signal it did not send, or a measured time well short of the
// requested one.
var errFioInterrupted = errors.New("fio was interrupted from outside the harness")

func (r *runner) timing() fioTiming {
	return fioTiming{Runtime: r.opts.Runtime, Ramp: r.opts.Ramp}
}

// serverTurn starts one server, runs every workload against it, and stops it.
func (r *runner) serverTurn(ctx context.Context, round int, name string) (err error) {
	sock := filepath.Join(r.workdir, name+".sock")
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	argv, err := serverArgv(name, r.tcBin, r.file, sock)
	if err != nil {
		return err
	}
	r.noteCommand(argv)
	p, err := startProcess(name, argv, filepath.Join(r.workdir, fmt.Sprintf("%s.r%d.log", name, round)))
	if err != nil {
		return err
	}
	r.servers.add(p, sock)
	defer func() {
		if serr := r.servers.stop(p); serr != nil {
			err = errors.Join(err, serr)
		}
	}()
	if err := waitNBD(ctx, p, sock, 15*time.Second); err != nil {
		return err
	}
	for _, w := range Workloads {
		desc := fmt.Sprintf("round %d/%d %-13s %s", round, r.opts.Rounds, name, w.Name)
		r.prog.start(desc)
		if err := r.settle(); err != nil {
			return err
		}
		out := filepath.Join(r.workdir, fmt.Sprintf("fio.r%d.%s.%s.json", round, name, w.Name))
		args := fioArgs(w, r.timing(), []string{"--ioengine=nbd", "--uri=" + nbdURI(sock)}, out)
		r.noteCommand(append([]string{"fio"}, fioArgs(w, r.timing(), []string{"--ioengine=nbd", "--uri=" + nbdURI(sock)}, "OUT.json")...))
		res, win, err := r.runFioRetry(ctx, args, out, p.pid())
		if err != nil {
			if p.exited() {
				return fmt.Errorf("%s %s: %w; server exited (%v), its output:\n%s", name, w.Name, err, p.err, p.logTail())
			}
			return fmt.Errorf("%s %s: %w", name, w.Name, err)
		}
		s := newSample(round, name, w, res, win)
		s.ServerCPUSec, s.HasServerCPU = win.server.Seconds(), true
		r.samples = append(r.samples, s)
		r.prog.finish(desc, s, w)
	}
	return nil
}

// baselineTurn runs fio directly on the data file.
func (r *runner) baselineTurn(ctx context.Context, round int, b baseline) error {
	for _, w := range Workloads {
		if !w.Baseline {
			continue
		}
		desc := fmt.Sprintf("round %d/%d %-13s %s", round, r.opts.Rounds, b.Name, w.Name)
		r.prog.start(desc)
		if err := r.settle(); err != nil {
			return err
		}
		out := filepath.Join(r.workdir, fmt.Sprintf("fio.r%d.%s.%s.json", round, b.Name, w.Name))
		args := fioArgs(w, r.timing(), b.args(r.file, w.IODepth), out)
		r.noteCommand(append([]string{"fio"}, fioArgs(w, r.timing(), b.args(r.file, w.IODepth), "OUT.json")...))
		res, win, err := r.runFioRetry(ctx, args, out, 0)
		if err != nil {
			return fmt.Errorf("%s %s: %w", b.Name, w.Name, err)
		}
		s := newSample(round, b.Name, w, res, win)
		r.samples = append(r.samples, s)
		r.prog.finish(desc, s, w)
	}
	return nil
}

func newSample(round int, target string, w Workload, res fioResult, win cpuWindow) Sample {
	other := 0.0 // JSON has no NaN; wall is never zero in practice
	if win.wall > 0 {
		other = max(0, (win.system-win.server).Seconds()/win.wall.Seconds()-res.ClientCPU/100)
	}
	return Sample{
		OtherCores:   other,
		Round:        round,
		Target:       target,
		Workload:     w.Name,
		IOPS:         res.IOPS,
		MiBps:        res.BW / (1 << 20),
		Bytes:        res.Bytes,
		LatMeanUs:    res.LatMeanUs,
		LatP99Us:     res.LatP99Us,
		ClientCPUPct: res.ClientCPU,
	}
}

// rotate returns names starting at index r mod len(names), so that each
// round a different server goes first.
func rotate(names []string, r int) []string {
	n := len(names)
	out := make([]string, 0, n)
	for i := range n {
		out = append(out, names[(i+r)%n])
	}
	return out
}

// shellJoin renders argv as a command a POSIX shell would parse back.
func shellJoin(argv []string) string {
	parts := make([]string, len(argv))
	for i, a := range argv {
		parts[i] = shellQuote(a)
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s == "" {
		return "''"
	}
	safe := true
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("-_./=:,+@%", c)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
