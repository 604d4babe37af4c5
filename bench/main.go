package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Options configure a harness run; Main fills them from flags.
type Options struct {
	Rounds    int
	Runtime   time.Duration
	Ramp      time.Duration
	FileSize  int64
	Servers   []string
	Baselines bool
	Workdir   string // "" = a temporary directory, removed afterwards
	Keep      bool   // keep the temporary workdir (logs, fio JSON)
	Out       string // report directory
	Publish   bool   // copy the report and charts into docs/bench
	Tiercache string // prebuilt tiercache binary; "" = go build
	Quick     bool
	Replot    string // re-render the report from this results.json; run nothing
}

const usage = `tcbench runs tiercache's NBD benchmark: the same fio workloads against
tiercache, qemu-nbd and nbdkit (file plugin) serving one file over unix
sockets, interleaved round by round, plus fio directly on the file.

Usage: go run ./cmd/tcbench [flags]
       go run ./cmd/tcbench cache [--quick] [flags]   (the cache scenarios S1-S5; cache --help)

Needs fio (with the nbd engine), qemu-nbd and nbdkit:
  apt-get install -y fio qemu-utils libnbd-bin nbdkit

Flags:
`

// Main runs the harness with command-line arguments args (without the
// program name) and returns the process exit code.
func Main(args []string) int {
	if len(args) > 0 && args[0] == "cache" {
		return cacheMain(args[1:])
	}
	if len(args) > 0 && args[0] == "remote" {
		return remoteMain(args[1:])
	}
	opts, err := parseFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tcbench:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// After the first signal, let a second one kill the harness at
		// once; Pdeathsig then takes the servers down with it.
		<-ctx.Done()
		stop()
	}()
	if err := Run(ctx, opts, os.Stdout); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(os.Stderr, "tcbench: interrupted; servers stopped")
			return 130
		}
		fmt.Fprintln(os.Stderr, "tcbench:", err)
		return 1
	}
	return 0
}

func parseFlags(args []string, errOut io.Writer) (Options, error) {
	fs := flag.NewFlagSet("tcbench", flag.ContinueOnError)
	fs.SetOutput(errOut)
	fs.Usage = func() {
		fmt.Fprint(errOut, usage)
		fs.PrintDefaults()
	}
	var o Options
	var size, servers string
	fs.IntVar(&o.Rounds, "rounds", 5, "rounds; each runs every server once, the order rotating, and the report gives medians")
	fs.DurationVar(&o.Runtime, "runtime", 10*time.Second, "measured time of each fio run")
	fs.DurationVar(&o.Ramp, "ramp", 2*time.Second, "unmeasured warm-up before each fio run")
	fs.StringVar(&size, "size", "1GiB", "size of the data file (K, M, G suffixes, binary)")
	fs.StringVar(&servers, "servers", strings.Join(serverNames, ","), "comma-separated servers to run: "+strings.Join(serverNames, ", "))
	fs.BoolVar(&o.Baselines, "baselines", true, "also run fio directly on the file (O_DIRECT and buffered) for the random-read workloads")
	fs.StringVar(&o.Workdir, "workdir", "", "directory for the data file, sockets, server logs and fio JSON (default: a new temporary directory, removed at the end)")
	fs.BoolVar(&o.Keep, "keep", false, "keep the temporary workdir")
	fs.StringVar(&o.Out, "out", "", "report directory (default: bench/out in the module)")
	fs.BoolVar(&o.Publish, "publish", false, "copy RESULTS.md, results.json and the charts into docs/bench in the module")
	fs.StringVar(&o.Tiercache, "tiercache", "", "use this tiercache binary instead of building ./cmd/tiercache")
	fs.StringVar(&o.Replot, "replot", "", "run nothing: re-render RESULTS.md and the charts into --out from this results.json (with --publish, also into docs/bench)")
	fs.BoolVar(&o.Quick, "quick", false, "CI smoke run: 1 round, 2 s per workload, no ramp, 64 MiB file (flags given explicitly still win)")
	if err := fs.Parse(args); err != nil {
		return Options{}, err
	}
	if fs.NArg() > 0 {
		return Options{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.Quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["rounds"] {
			o.Rounds = 1
		}
		if !set["runtime"] {
			o.Runtime = 2 * time.Second
		}
		if !set["ramp"] {
			o.Ramp = 0
		}
		if !set["size"] {
			size = "64MiB"
		}
	}
	var err error
	if o.FileSize, err = parseSize(size); err != nil {
		return Options{}, fmt.Errorf("--size: %w", err)
	}
	if o.FileSize%(1<<20) != 0 {
		return Options{}, fmt.Errorf("--size %s: want a multiple of 1 MiB", size)
	}
	if o.Rounds < 1 {
		return Options{}, fmt.Errorf("--rounds %d: want at least 1", o.Rounds)
	}
	if o.Runtime < time.Second {
		return Options{}, fmt.Errorf("--runtime %v: want at least 1s", o.Runtime)
	}
	if o.Ramp < 0 {
		return Options{}, fmt.Errorf("--ramp %v: must not be negative", o.Ramp)
	}
	for _, s := range strings.Split(servers, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(serverNames, s) {
			return Options{}, fmt.Errorf("--servers: unknown server %q (known: %s)", s, strings.Join(serverNames, ", "))
		}
		if !slices.Contains(o.Servers, s) {
			o.Servers = append(o.Servers, s)
		}
	}
	if len(o.Servers) == 0 && !o.Baselines {
		return Options{}, errors.New("nothing to run: no --servers and --baselines=false")
	}
	return o, nil
}

// Run runs the harness and writes the report; progress and the summary go
// to stdout. Every server it started is stopped before it returns, also
// when ctx is cancelled.
func Run(ctx context.Context, o Options, stdout io.Writer) (err error) {
	root, rootErr := moduleRoot()
	if o.Out == "" {
		if rootErr != nil {
			return fmt.Errorf("--out not given: %w", rootErr)
		}
		o.Out = filepath.Join(root, "bench", "out")
	}
	if o.Replot != "" {
		if err := replot(o.Replot, o.Out, stdout); err != nil {
			return err
		}
		return publishIf(o, root, rootErr, stdout)
	}
	if err := checkTools(o.Servers); err != nil {
		return err
	}
	r := &runner{opts: o, log: stdout}
	if r.workdir, err = prepareWorkdir(o.Workdir); err != nil {
		return err
	}
	if o.Workdir == "" && !o.Keep {
		defer func() {
			if rerr := os.RemoveAll(r.workdir); rerr != nil {
				err = errors.Join(err, fmt.Errorf("remove workdir: %w", rerr))
			}
		}()
	}
	defer func() {
		if serr := r.servers.stopAll(); serr != nil {
			err = errors.Join(err, serr)
		}
	}()
	fmt.Fprintf(stdout, "tcbench: workdir %s, report %s\n", r.workdir, o.Out)

	if slices.Contains(o.Servers, "tiercache") {
		if r.tcBin, err = tiercacheBinary(ctx, o.Tiercache, root, rootErr, r.workdir); err != nil {
			return err
		}
	}
	r.file = filepath.Join(r.workdir, "data.img")
	fmt.Fprintf(stdout, "tcbench: writing %d MiB data file %s\n", o.FileSize>>20, r.file)
	if err := createDataFile(ctx, r.file, o.FileSize); err != nil {
		return err
	}
	if r.dataFile, err = os.OpenFile(r.file, os.O_RDWR, 0); err != nil {
		return fmt.Errorf("open data file: %w", err)
	}
	defer r.dataFile.Close()

	var baseNames []string
	nBase := 0
	if o.Baselines {
		for _, b := range baselines {
			baseNames = append(baseNames, b.Name)
		}
		for _, w := range Workloads {
			if w.Baseline {
				nBase++
			}
		}
	}
	total := o.Rounds * (len(o.Servers)*len(Workloads) + len(baseNames)*nBase)
	perStep := o.Runtime + o.Ramp
	fmt.Fprintf(stdout, "tcbench: %d round(s) x (%d server(s) x %d workloads + %d baseline runs), %v each: about %v\n",
		o.Rounds, len(o.Servers), len(Workloads), len(baseNames)*nBase, perStep, (time.Duration(total) * perStep).Round(time.Second))
	r.printCommands(stdout)

	loadStart := loadAvg()
	started := time.Now()
	r.prog = newProgress(stdout, total)
	for round := 1; round <= o.Rounds; round++ {
		for _, name := range rotate(o.Servers, round-1) {
			if err := r.serverTurn(ctx, round, name); err != nil {
				r.prog.close()
				return fmt.Errorf("round %d: %w", round, err)
			}
		}
		if o.Baselines {
			for _, b := range baselines {
				if err := r.baselineTurn(ctx, round, b); err != nil {
					r.prog.close()
					return fmt.Errorf("round %d: %w", round, err)
				}
			}
		}
	}
	r.prog.close()
	elapsed := time.Since(started)

	sum := summarize(r.samples, o.Rounds, o.Servers, baseNames)
	if err := printSummary(stdout, sum); err != nil {
		return fmt.Errorf("print summary: %w", err)
	}
	env := collectEnv(ctx, root, r.tcBin, r.workdir)
	env.LoadStart = loadStart
	if err := r.writeReport(o.Out, sum, env, elapsed); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\ntcbench: report in %s (took %v)\n", filepath.Join(o.Out, "RESULTS.md"), elapsed.Round(time.Second))
	return publishIf(o, root, rootErr, stdout)
}

// publishIf copies the report into docs/bench when --publish is set.
func publishIf(o Options, root string, rootErr error, stdout io.Writer) error {
	if !o.Publish {
		return nil
	}
	if rootErr != nil {
		return fmt.Errorf("--publish: %w", rootErr)
	}
	dst := filepath.Join(root, "docs", "bench")
	if err := publish(o.Out, dst); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "tcbench: published to %s\n", dst)
	return nil
}

// printCommands shows every command line the run will use, so that any
// result can be reproduced by hand.
func (r *runner) printCommands(w io.Writer) {
	fmt.Fprintln(w, "tcbench: commands (OUT.json is per run):")
	for _, name := range r.opts.Servers {
		sock := filepath.Join(r.workdir, name+".sock")
		argv, err := serverArgv(name, r.tcBin, r.file, sock)
		if err != nil {
			continue // validated in parseFlags
		}
		fmt.Fprintf(w, "  server:   %s\n", shellJoin(argv))
	}
	if len(r.opts.Servers) > 0 {
		sock := filepath.Join(r.workdir, "SERVER.sock")
		for _, wl := range Workloads {
			argv := append([]string{"fio"}, fioArgs(wl, r.timing(), []string{"--ioengine=nbd", "--uri=" + nbdURI(sock)}, "OUT.json")...)
			fmt.Fprintf(w, "  fio:      %s\n", shellJoin(argv))
		}
	}
	if r.opts.Baselines {
		for _, b := range baselines {
			for _, wl := range Workloads {
				if wl.Baseline {
					argv := append([]string{"fio"}, fioArgs(wl, r.timing(), b.args(r.file, wl.IODepth), "OUT.json")...)
					fmt.Fprintf(w, "  baseline: %s\n", shellJoin(argv))
				}
			}
		}
	}
}

// checkTools fails early, with the install command, when a tool is missing.
func checkTools(servers []string) error {
	need := []string{"fio"}
	for _, s := range servers {
		if s != "tiercache" {
			need = append(need, s)
		}
	}
	var missing []string
	for _, t := range need {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing %s; install with: apt-get install -y fio qemu-utils libnbd-bin nbdkit", strings.Join(missing, ", "))
	}
	out, err := exec.Command("fio", "--enghelp=nbd").CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("uri")) {
		return fmt.Errorf("fio has no nbd engine (fio --enghelp=nbd: %v, %q)", err, bytes.TrimSpace(out))
	}
	return nil
}

// moduleRoot finds the tiercache module's root from the working directory.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.Contains(data, []byte("module github.com/tiercache/tiercache\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("not inside the tiercache module (no go.mod for github.com/tiercache/tiercache above the working directory)")
		}
		dir = parent
	}
}

func prepareWorkdir(dir string) (string, error) {
	if dir == "" {
		d, err := os.MkdirTemp("", "tcbench-")
		if err != nil {
			return "", fmt.Errorf("create workdir: %w", err)
		}
		return d, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create workdir: %w", err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("workdir: %w", err)
	}
	// A unix socket path must fit in sun_path (108 bytes).
	if len(abs)+len("/tiercache.sock") >= 108 {
		return "", fmt.Errorf("workdir %s: path too long for unix sockets", abs)
	}
	return abs, nil
}

// tiercacheBinary returns the binary to benchmark: the one given, or a
// fresh build of ./cmd/tiercache. It checks that it has the serve command.
func tiercacheBinary(ctx context.Context, given, root string, rootErr error, workdir string) (string, error) {
	bin := given
	if bin == "" {
		if rootErr != nil {
			return "", fmt.Errorf("build tiercache: %w", rootErr)
		}
		bin = filepath.Join(workdir, "tiercache")
		gobin, err := goTool()
		if err != nil {
			return "", err
		}
		cmd := exec.CommandContext(ctx, gobin, "build", "-o", bin, "./cmd/tiercache")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build ./cmd/tiercache: %w\n%s", err, bytes.TrimSpace(out))
		}
	}
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(hctx, bin, "serve", "--help").CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--listen")) {
		return "", fmt.Errorf("%s has no usable serve command (%v); run with --servers qemu-nbd,nbdkit until it does. Its help said:\n%s",
			bin, err, bytes.TrimSpace(out))
	}
	return bin, nil
}

// goTool finds the go command: on PATH, or in $GOROOT/bin.
func goTool() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	if gr := os.Getenv("GOROOT"); gr != "" {
		p := filepath.Join(gr, "bin", "go")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("go command not found on PATH or in $GOROOT/bin")
}

// firstLine returns the first line of a command's output, or "unknown".
func firstLine(ctx context.Context, name string, args ...string) string {
	out, err := exec.CommandContext(ctx, name, args...).Output()
	if err != nil {
		return "unknown"
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	if sc.Scan() {
		return strings.TrimSpace(sc.Text())
	}
	return "unknown"
}
