package bench

// The cache scenarios: `tcbench cache`, behind `make bench`.
//
// Each scenario runs tiercache with its cache set on device models (an HDD
// model behind an SSD model, see docs/MODELS.md) side by side with the plain
// HDD model served without a cache (or, for S5, with qemu-nbd on the same
// RAM-backed file), all through NBD with fio, and compares the ratios with
// the published bcache and bcachefs figures. Every image lives in a RAM-backed
// directory (/dev/shm when it exists), so the models alone decide the
// devices' timing. The models run on the real clock: the CLI does not expose
// their TimeScale, so the suite fits its time budget by its sizes, which
// cacheSizes documents.

import (
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
	"strconv"
	"strings"
	"syscall"
	"time"
)

// CacheOptions configure `tcbench cache`.
type CacheOptions struct {
	Quick     bool
	Workdir   string
	Keep      bool
	Out       string
	Publish   bool
	Tiercache string
	Rev       string   // what the tiercache binary was built from, for the report
	Only      []string // scenarios to run, e.g. S1, S3; all when empty
	Rounds    int      // times the whole scenario list runs (medians reported); 0 or 1: once
	S6LBA     bool     // S6 also runs pgbench in writeback with writeback_order=lba
	S6        []string // S6's targets (s6Targets), in this order; default the four modes
	S7Jobs    []string // S7's cases to run (s7JobNames); all when empty
	// AB, when set, is a second tiercache binary that S7 and S8 also run,
	// in both writeback orders, beside the first in every round (an A/B
	// of two builds side by side); ABRev names it in the report.
	AB, ABRev string
}

var scenarioNames = []string{"S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "S9", "S10"}

// cacheSizes are the sizes and times of a suite run. The full suite keeps the
// seeds' shapes where the time budget (15 minutes on 2 cores, models on the
// real clock) allows and says where it does not.
type cacheSizes struct {
	Backing     int64         // the data region at the start of each HDD image, where every workload runs
	Disk        int64         // each HDD image (sparse past Backing): the model's whole disk
	S1Writes    int64         // bytes of 4 KiB fsync'd random writes through tiercache (seed: 64 MiB)
	S1HDDTime   time.Duration // cap on the same job on the plain HDD model (~135 writes/s)
	S1Pairs     int           // reads before and after the writes, per target, alternating between the two
	Runtime     time.Duration // measured time of time-based runs (S2, S3)
	Ramp        time.Duration
	S2Cache     int64
	S3Region    int64 // working set of S3, read once to warm the cache
	S3Cache     int64
	S4Writes    int64
	S5Region    int64
	S5Rounds    int
	S5Runtime   time.Duration
	S5Ramp      time.Duration
	SmallCache  int64 // S1 and S4 cache images
	FioMaxRetry int
	Apps        appSizes   // S6
	Cliff       cliffSizes // S7-S9
	Hit         hitSizes   // S10
}

func fullSizes() cacheSizes {
	return cacheSizes{
		Backing:    1 << 30,
		Disk:       8 << 30, // 1 GiB at the outer edge reads at ~139 MB/s, as the seed's 137
		S1Writes:   64 << 20,
		S1HDDTime:  15 * time.Second,
		S1Pairs:    3,
		Runtime:    6 * time.Second,
		Ramp:       2 * time.Second, // past the HDD model's 16 MiB write-cache burst (~1 s)
		S2Cache:    512 << 20,
		S3Region:   256 << 20,
		S3Cache:    2 << 30, // 8x the working set: see docs/BENCHMARKS.md, S3 (a 512 MiB cache ran out of free buckets under 64 KiB randrw)
		S4Writes:   8 << 20, // 2,048 fsync'd writes: epoch-order drain ~17 s, QD1 replay ~17 s
		S5Region:   256 << 20,
		S5Rounds:   2,
		S5Runtime:  5 * time.Second,
		S5Ramp:     time.Second, // RAM devices: nothing to skip but the connection's start
		SmallCache: 256 << 20,
		Apps: appSizes{FS: 2 << 30, Cache: 1 << 30, PgScale: 10, PgClients: 10, PgTime: 30 * time.Second,
			RocksKeys: 300000, RocksTime: 10 * time.Second},
		Cliff: fullCliffSizes(),
		Hit:   fullHitSizes(),
	}
}

func quickSizes() cacheSizes {
	return cacheSizes{
		Backing:    64 << 20,
		Disk:       512 << 20,
		S1Writes:   1 << 20,
		S1HDDTime:  3 * time.Second,
		S1Pairs:    1,
		Runtime:    time.Second,
		Ramp:       0,
		S2Cache:    64 << 20,
		S3Region:   16 << 20,
		S3Cache:    64 << 20,
		S4Writes:   1 << 20,
		S5Region:   16 << 20,
		S5Rounds:   1,
		S5Runtime:  time.Second,
		SmallCache: 64 << 20,
		Apps: appSizes{FS: 256 << 20, Cache: 128 << 20, PgScale: 1, PgClients: 4, PgTime: 2 * time.Second,
			RocksKeys: 10000, RocksTime: 1 * time.Second},
		Cliff: quickCliffSizes(),
		Hit:   quickHitSizes(),
	}
}

const cacheUsage = `tcbench cache runs tiercache's cache scenarios S1-S10 with fio through NBD
(S6-S8 also on ext4 through the kernel): tiercache on device models (HDD
behind an SSD) side by side with the plain HDD model (and, in S5, qemu-nbd),
and compares the ratios with the published figures and with the plain HDD
model when the data outgrows the cache (S7, S8); S10 measures cache hits on
a local disk against the disk itself and qemu-nbd (files under /var/tmp, or
TIERCACHE_HIT_DIR). See docs/BENCHMARKS.md.

Usage: go run ./cmd/tcbench cache [flags]

Needs fio (with the nbd engine) and qemu-nbd:
  apt-get install -y fio qemu-utils

Flags:
`

func cacheMain(args []string) int {
	fs := flag.NewFlagSet("tcbench cache", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(os.Stderr, cacheUsage)
		fs.PrintDefaults()
	}
	var o CacheOptions
	var only string
	fs.BoolVar(&o.Quick, "quick", false, "CI smoke run: tiny sizes and 1 s runs; checks that every scenario runs, measures nothing worth quoting (under 2 minutes)")
	fs.StringVar(&o.Workdir, "workdir", "", "directory for images, sockets, logs and fio JSON (default: a new directory under /dev/shm, removed at the end)")
	fs.BoolVar(&o.Keep, "keep", false, "keep the temporary workdir")
	fs.StringVar(&o.Out, "out", "", "report directory (default: bench/out/cache in the module)")
	fs.BoolVar(&o.Publish, "publish", false, "copy CACHE_RESULTS.md, cache-results.json, bars.png and the charts of the scenarios run into docs/bench in the module (a run of S7-S9 alone: CLIFF_RESULTS.md, cliff-*, beside the whole suite's report)")
	fs.StringVar(&o.Tiercache, "tiercache", "", "use this tiercache binary instead of building ./cmd/tiercache")
	fs.StringVar(&o.Rev, "tiercache-rev", "", "with --tiercache: the commit the binary was built from, for the report")
	fs.StringVar(&only, "only", "", "comma-separated scenarios to run (S1..S10), in this order; default all")
	fs.BoolVar(&o.S6LBA, "s6-lba", false, "S6 also runs pgbench in writeback with writeback_order=lba (what epoch order costs; ~45 s more a round)")
	var s6 string
	fs.StringVar(&s6, "s6", "", "comma-separated S6 targets to run: "+strings.Join(s6Targets, ", ")+" (writeback-s3: writeback over an object-store image on a local versitygw; db_bench runs only with none and writeback both); default the four modes")
	var s7 string
	fs.StringVar(&s7, "s7", "", "comma-separated S7 cases to run: "+strings.Join(s7JobNames, ", ")+" (drain also runs seqwrite, its reference); default all")
	fs.StringVar(&o.AB, "ab", "", "S7 and S8 also run this tiercache binary, in both writeback orders, beside the first in every round (targets named \"B\")")
	fs.StringVar(&o.ABRev, "ab-rev", "", "with --ab: the commit that binary was built from, for the report")
	fs.IntVar(&o.Rounds, "rounds", 1, "run the scenarios this many times, one round after the other, and report each bar's median round (every round's ratio is shown)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if o.Rounds < 1 {
		fmt.Fprintf(os.Stderr, "tcbench cache: --rounds %d: want at least 1\n", o.Rounds)
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "tcbench cache: unexpected arguments %q\n", fs.Args())
		return 2
	}
	for _, s := range strings.Split(only, ",") {
		s = strings.ToUpper(strings.TrimSpace(s))
		if s == "" {
			continue
		}
		if !slices.Contains(scenarioNames, s) {
			fmt.Fprintf(os.Stderr, "tcbench cache: --only: unknown scenario %q (known: %s)\n", s, strings.Join(scenarioNames, ", "))
			return 2
		}
		o.Only = append(o.Only, s)
	}
	for _, j := range strings.Split(s6, ",") {
		if j = strings.TrimSpace(j); j == "" {
			continue
		}
		if !slices.Contains(s6Targets, j) {
			fmt.Fprintf(os.Stderr, "tcbench cache: --s6: unknown target %q (known: %s)\n", j, strings.Join(s6Targets, ", "))
			return 2
		}
		o.S6 = append(o.S6, j)
	}
	for _, j := range strings.Split(s7, ",") {
		if j = strings.TrimSpace(j); j == "" {
			continue
		}
		if !slices.Contains(s7JobNames, j) {
			fmt.Fprintf(os.Stderr, "tcbench cache: --s7: unknown case %q (known: %s)\n", j, strings.Join(s7JobNames, ", "))
			return 2
		}
		o.S7Jobs = append(o.S7Jobs, j)
	}
	ctx, stop := signalContext()
	defer stop()
	if err := RunCache(ctx, o, os.Stdout); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(os.Stderr, "tcbench cache: interrupted; servers stopped")
			return 130
		}
		fmt.Fprintln(os.Stderr, "tcbench cache:", err)
		return 1
	}
	return 0
}

// cacheRunner holds the state of one suite run.
type cacheRunner struct {
	r         *runner // fio runs, process registry, command log
	sz        cacheSizes
	quick     bool
	keep      bool // --keep: the workdir stays, every server's directory in it
	s6lba     bool
	s6targets []string // CacheOptions.S6
	s7jobs    []string
	// s3st is S6's object-store (writeback-s3), started on first use;
	// s3n numbers its images.
	s3st  *s3Store
	s3n   int
	tcBin string
	// abBin and abRev: CacheOptions.AB and ABRev.
	abBin, abRev string
	workdir      string
	master       string // pseudo-random data, copied into each backing image
	figs         []Figure
	checks       []Check   // this round's
	rounds       [][]Check // every finished round's checks
	round        int       // 1-based
	nrounds      int
	details      []detail // the last round's
	dirs         []string // the current scenario's tcDir directories
	// golden is S6's golden image, built in the first round that runs S6
	// and kept in goldenDir until the suite ends.
	golden, goldenDir string
	// cliffGolden is S7's and S8's empty ext4 image, built once.
	cliffGolden string
	loads       []string
	step        int
	total       int
	started     time.Time
	out         io.Writer
	outDir      string
	names       reportSet // the report's file names
}

// Figure is one measured value.
type Figure struct {
	Scenario   string  `json:"scenario"`
	Target     string  `json:"target"`
	Test       string  `json:"test"`
	Value      float64 `json:"value"`
	Unit       string  `json:"unit"`
	Round      int     `json:"round,omitempty"` // S5's own rounds
	SuiteRound int     `json:"suite_round"`     // the suite's round (--rounds)
	LatMeanUs  float64 `json:"lat_mean_us,omitempty"`
	LatP99Us   float64 `json:"lat_p99_us,omitempty"`
	LatP999Us  float64 `json:"lat_p999_us,omitempty"`
	LatMaxUs   float64 `json:"lat_max_us,omitempty"`
	ServerCPU  float64 `json:"server_cpu_s_per_gib,omitempty"`
	Note       string  `json:"note,omitempty"`
}

// Check is one bar, with the seed's figure beside ours.
type Check struct {
	Scenario string  `json:"scenario"`
	What     string  `json:"what"`
	Seed     string  `json:"seed"`
	Ours     string  `json:"ours"`
	Ratio    float64 `json:"ratio"`
	Bar      string  `json:"bar"`
	Met      string  `json:"met"` // yes, no, or "-" (no bar)
	// Over several rounds: every round's ratio in round order; the fields
	// above are those of the median round (see medianChecks).
	RoundRatios []float64 `json:"round_ratios,omitempty"`
}

// detail is a scenario's own table.
type detail struct {
	Scenario string     `json:"scenario"`
	Title    string     `json:"title"`
	Rows     [][]string `json:"rows"`
	Notes    []string   `json:"notes,omitempty"`
}

// RunCache runs the scenarios and writes the report.
func RunCache(ctx context.Context, o CacheOptions, stdout io.Writer) (err error) {
	root, rootErr := moduleRoot()
	if o.Out == "" {
		if rootErr != nil {
			return fmt.Errorf("--out not given: %w", rootErr)
		}
		o.Out = filepath.Join(root, "bench", "out", "cache")
	}
	if err := checkTools([]string{"qemu-nbd"}); err != nil {
		return err
	}
	c := &cacheRunner{sz: fullSizes(), quick: o.Quick, out: stdout, keep: o.Keep, s6lba: o.S6LBA, s6targets: o.S6, s7jobs: o.S7Jobs, abBin: o.AB, abRev: o.ABRev}
	if o.Quick {
		c.sz = quickSizes()
	}
	c.r = &runner{log: stdout}
	c.outDir = o.Out
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return fmt.Errorf("create report dir: %w", err)
	}
	wd := o.Workdir
	if wd == "" {
		base := ""
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			base = "/dev/shm"
		}
		if wd, err = os.MkdirTemp(base, "tcbench-cache-"); err != nil {
			return fmt.Errorf("create workdir: %w", err)
		}
		if !o.Keep {
			defer func() {
				if rerr := os.RemoveAll(wd); rerr != nil {
					err = errors.Join(err, fmt.Errorf("remove workdir: %w", rerr))
				}
			}()
		}
	}
	if c.workdir, err = prepareWorkdir(wd); err != nil {
		return err
	}
	c.r.workdir = c.workdir
	defer func() {
		if serr := c.r.servers.stopAll(); serr != nil {
			err = errors.Join(err, serr)
		}
		if c.goldenDir != "" {
			err = errors.Join(err, os.RemoveAll(c.goldenDir))
		}
		if c.cliffGolden != "" {
			err = errors.Join(err, os.RemoveAll(filepath.Dir(c.cliffGolden)))
		}
	}()
	fmt.Fprintf(stdout, "tcbench cache: workdir %s, report %s\n", c.workdir, o.Out)
	if c.tcBin, err = tiercacheBinary(ctx, o.Tiercache, root, rootErr, c.workdir); err != nil {
		return err
	}
	scen := o.Only
	if len(scen) == 0 {
		scen = scenarioNames
	}
	c.names = newReportSet(scen)
	c.nrounds = max(o.Rounds, 1)
	c.total = c.plannedSteps(scen) * c.nrounds
	fmt.Fprintf(stdout, "tcbench cache: scenarios %s, %d round(s), %d steps, sizes %s\n", strings.Join(scen, " "), c.nrounds, c.total, c.sizesLine())
	c.master = filepath.Join(c.workdir, "master.img")
	if err := createDataFile(ctx, c.master, c.sz.Backing); err != nil {
		return err
	}
	loadStart := loadAvg()
	c.started = time.Now()
	runs := map[string]func(context.Context) error{"S1": c.s1, "S2": c.s2, "S3": c.s3, "S4": c.s4, "S5": c.s5, "S6": c.s6, "S7": c.s7, "S8": c.s8, "S9": c.s9, "S10": c.s10}
	for c.round = 1; c.round <= c.nrounds; c.round++ {
		c.checks, c.details = nil, nil
		for _, s := range scen {
			c.loads = append(c.loads, fmt.Sprintf("round %d %s start %s: load %s", c.round, s, time.Now().UTC().Format("15:04:05"), loadAvg()))
			fmt.Fprintf(stdout, "tcbench cache: == round %d/%d %s == (load %s)\n", c.round, c.nrounds, s, loadAvg())
			if err := runs[s](ctx); err != nil {
				return fmt.Errorf("round %d %s: %w", c.round, s, err)
			}
			// The scenario's servers are gone: free its images (RAM in
			// /dev/shm; a whole round's would take ~19 GiB).
			for _, d := range c.dirs {
				if err := os.RemoveAll(d); err != nil {
					return err
				}
			}
			c.dirs = nil
		}
		c.rounds = append(c.rounds, c.checks)
		if c.round < c.nrounds {
			// The rounds so far, in case the run is cut short.
			if _, err := c.report(ctx, o, root, loadStart, false); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "tcbench cache: report of rounds 1-%d in %s\n", c.round, filepath.Join(o.Out, c.names.md()))
		}
	}
	c.loads = append(c.loads, fmt.Sprintf("end %s: load %s", time.Now().UTC().Format("15:04:05"), loadAvg()))
	rep, err := c.report(ctx, o, root, loadStart, true)
	if err != nil {
		return err
	}
	if err := rep.print(stdout); err != nil {
		return err
	}
	elapsed := time.Since(c.started)
	fmt.Fprintf(stdout, "\ntcbench cache: report in %s (took %v)\n", filepath.Join(o.Out, c.names.md()), elapsed.Round(time.Second))
	if o.Publish {
		if rootErr != nil {
			return fmt.Errorf("--publish: %w", rootErr)
		}
		dst := filepath.Join(root, "docs", "bench")
		if err := publishRun(o.Out, dst, c.names, scen); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "tcbench cache: published to %s\n", dst)
	}
	return nil
}

// report writes the report of the finished rounds into o.Out.
func (c *cacheRunner) report(ctx context.Context, o CacheOptions, root, loadStart string, final bool) (cacheReport, error) {
	env := collectEnv(ctx, root, c.tcBin, c.workdir)
	env.LoadStart = loadStart
	if o.Rev != "" {
		env.Tiercache = "commit " + o.Rev
	}
	rep := cacheReport{set: c.names, Env: env, Quick: o.Quick, Sizes: c.sz, ElapsedSec: time.Since(c.started).Seconds(), Loads: c.loads,
		Commands: c.r.commands, Retries: c.r.retries, Rounds: len(c.rounds), Checks: medianChecks(c.rounds), Details: c.details, Figures: c.figs}
	if !final {
		rep.Partial = fmt.Sprintf("rounds 1-%d of %d (the run was still going when this was written)", len(c.rounds), c.nrounds)
	}
	// The report lists scenarios in order whatever order --only ran them in.
	slices.SortStableFunc(rep.Checks, func(a, b Check) int { return strings.Compare(a.Scenario, b.Scenario) })
	slices.SortStableFunc(rep.Details, func(a, b detail) int { return strings.Compare(a.Scenario, b.Scenario) })
	if err := chartBars(c.chartPath("bars.png"), rep.Checks); err != nil {
		return rep, err
	}
	return rep, rep.write(o.Out)
}

func (c *cacheRunner) sizesLine() string {
	s := c.sz
	return fmt.Sprintf("HDD image %d MiB (data and workloads in its first %d MiB), S1 %d MiB of fsync'd 4K writes (plain HDD capped at %v), runs %v (S2, S3 jobs that write: after a %v ramp), S3 working set %d MiB, S4 %d MiB of writes, S5 %d MiB x %d rounds x %v after a %v ramp, %s",
		s.Disk>>20, s.Backing>>20, s.S1Writes>>20, s.S1HDDTime, s.Runtime, s.Ramp, s.S3Region>>20, s.S4Writes>>20, s.S5Region>>20, s.S5Rounds, s.S5Runtime, s.S5Ramp, s.Apps.line()) + "; " + s.Cliff.line() + "; " + s.Hit.line()
}

// plannedSteps counts the progress steps of the scenarios.
func (c *cacheRunner) plannedSteps(scen []string) int {
	n := 0
	for _, s := range scen {
		switch s {
		case "S1":
			n += 3 + 4*c.sz.S1Pairs // the reads before, alternating; HDD: writes; tiercache: writes, drain; the reads after, alternating
		case "S2":
			n += 4 * len(s2Jobs(c.sz))
		case "S3":
			n += 1 + 2*len(s3Jobs(c.sz))
		case "S4":
			n += 2*2 + 2
		case "S5":
			n += 1 + c.sz.S5Rounds*2*len(s5Jobs(c.sz))
		case "S6":
			n += c.s6Steps()
		case "S7":
			n += c.s7Steps()
		case "S8":
			n += 3 * len(c.cliffTargets())
		case "S9":
			n += 2
		case "S10":
			n += c.sz.Hit.steps()
		}
	}
	return n
}

// progress prints one finished step.
func (c *cacheRunner) progress(scenario, what, result string) {
	c.step++
	el := time.Since(c.started)
	eta := ""
	if c.step > 0 && c.step < c.total {
		left := time.Duration(float64(el) / float64(c.step) * float64(c.total-c.step))
		eta = fmt.Sprintf(", ~%v left", left.Round(time.Second))
	}
	fmt.Fprintf(c.out, "[%d/%d %v%s] %s %s: %s\n", c.step, c.total, el.Round(time.Second), eta, scenario, what, result)
}

func (c *cacheRunner) add(f Figure) {
	f.SuiteRound = c.round
	c.figs = append(c.figs, f)
}

// job is one fio job of the suite.
type job struct {
	Name    string
	Title   string
	RW      string
	BS      int
	QD      int
	Size    int64 // region from Offset (fio --size)
	Offset  int64 // fio --offset
	IOSize  int64 // bytes to move; 0 with Runtime > 0: time-based
	Runtime time.Duration
	Ramp    time.Duration
	Fsync   bool // fsync after every write (fio --fsync=1)
	FsyncN  int  // fsync after every FsyncN writes (fio --fsync=N), when not Fsync
	EndSync bool // fsync at the end (fio --end_fsync=1)
	MixRead int  // percentage of reads of a randrw job (fio --rwmixread); 0: fio's 50
	Seed    int  // fio --randseed, 0: fio's default
	Metric  Metric
	// BSSplit is fio's --bssplit (block sizes and their shares), which
	// overrides BS.
	BSSplit string
	// File, when set, is a file on a mounted file system that fio writes
	// with libaio and O_DIRECT (the kernel path) instead of the NBD export.
	File string
	// NumJobs is fio --numjobs (0: 1); each job of the NBD engine opens
	// its own connection, each of QD requests.
	NumJobs int
}

func (j job) args(uri, out string) []string {
	a := []string{"--name=" + j.Name}
	if j.File != "" {
		a = append(a, "--ioengine=libaio", "--direct=1", "--filename="+j.File)
	} else {
		a = append(a, "--ioengine=nbd", "--uri="+uri)
	}
	a = append(a, "--rw="+j.RW, "--bs="+strconv.Itoa(j.BS), "--iodepth="+strconv.Itoa(j.QD), "--numjobs="+strconv.Itoa(max(j.NumJobs, 1)),
		"--size="+strconv.FormatInt(j.Size, 10))
	if j.Offset > 0 {
		a = append(a, "--offset="+strconv.FormatInt(j.Offset, 10))
	}
	if j.BSSplit != "" {
		a = append(a, "--bssplit="+j.BSSplit)
	}
	if j.MixRead > 0 {
		a = append(a, "--rwmixread="+strconv.Itoa(j.MixRead))
	}
	switch {
	case j.IOSize > 0:
		a = append(a, "--io_size="+strconv.FormatInt(j.IOSize, 10))
		if j.Runtime > 0 {
			a = append(a, "--runtime="+fioDuration(j.Runtime)) // a cap, not time-based
		}
	case j.Runtime > 0:
		a = append(a, "--time_based", "--runtime="+fioDuration(j.Runtime))
		if j.Ramp > 0 {
			a = append(a, "--ramp_time="+fioDuration(j.Ramp))
		}
		if strings.HasPrefix(j.RW, "rand") {
			a = append(a, "--norandommap")
		}
	}
	if j.Fsync {
		a = append(a, "--fsync=1")
	} else if j.FsyncN > 0 {
		a = append(a, "--fsync="+strconv.Itoa(j.FsyncN))
	}
	if j.EndSync {
		a = append(a, "--end_fsync=1")
	}
	if j.Seed != 0 {
		a = append(a, "--randseed="+strconv.Itoa(j.Seed))
	}
	return append(a, "--output-format=json", "--output="+out)
}

// timeBased reports whether fio runs j for a fixed time.
func (j job) timeBased() bool { return j.IOSize == 0 && j.Runtime > 0 }

// fioRun is one fio run's figures.
type fioRun struct {
	res  fioResult
	win  cpuWindow
	wall time.Duration
}

func (f fioRun) value(m Metric) float64 {
	if m == MetricMiBps {
		return f.res.BW / (1 << 20)
	}
	return f.res.IOPS
}

func (f fioRun) cpuPerGiB() float64 {
	v, ok := cpuPerGiB(f.win.server.Seconds(), f.res.Bytes)
	if !ok {
		return 0
	}
	return v
}

// fio runs job j against the NBD server srv.
func (c *cacheRunner) fio(ctx context.Context, srv *server, j job, tag string) (fioRun, error) {
	out := filepath.Join(c.workdir, fmt.Sprintf("fio.%s.%s.json", tag, j.Name))
	uri := "nbd+unix:///" + srv.export + "?socket=" + srv.sock
	c.r.noteCommand(append([]string{"fio"}, j.args(uri, "OUT.json")...))
	c.r.opts.Ramp = j.Ramp
	c.r.opts.Runtime = 0 // runFio's short-run check only for time-based jobs
	if j.timeBased() {
		c.r.opts.Runtime = j.Runtime
	}
	t0 := time.Now()
	res, win, err := c.r.runFioRetry(ctx, j.args(uri, out), out, srv.p.pid())
	if err != nil {
		if srv.p.exited() {
			return fioRun{}, fmt.Errorf("%s %s: %w; server exited (%v), its output:\n%s", srv.name, j.Name, err, srv.p.err, srv.p.logTail())
		}
		return fioRun{}, fmt.Errorf("%s %s: %w", srv.name, j.Name, err)
	}
	return fioRun{res: res, win: win, wall: time.Since(t0)}, nil
}

// server is a running NBD server of the suite.
type server struct {
	name    string
	export  string
	sock    string
	dataDir string // tiercache's --data-dir (its admin socket); "" for others
	p       *process
	bin     string
}

// startServer starts argv, which listens on sock, and waits for NBD.
func (c *cacheRunner) startServer(ctx context.Context, name, export, sock, dataDir string, argv []string) (*server, error) {
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	c.r.noteCommand(argv)
	p, err := startProcess(name, argv, filepath.Join(filepath.Dir(sock), name+".log"))
	if err != nil {
		return nil, err
	}
	c.r.servers.add(p, sock)
	if err := waitNBD(ctx, p, sock, 30*time.Second); err != nil {
		_ = c.r.servers.stop(p)
		return nil, err
	}
	return &server{name: name, export: export, sock: sock, dataDir: dataDir, p: p, bin: c.tcBin}, nil
}

// stop stops the server cleanly (SIGTERM); tiercache gets a generous grace:
// it syncs every export, and the HDD model then destages its write cache.
func (c *cacheRunner) stop(s *server) error {
	err := s.p.stop(90 * time.Second)
	return errors.Join(err, c.r.servers.stop(s.p))
}

// discard kills a server whose devices the suite throws away (SIGKILL), so
// that the HDD model's destaging of up to 16 MiB of random writes at
// shutdown (10-20 s) does not eat the time budget. Nothing is measured
// after it.
func (c *cacheRunner) discard(s *server) error {
	if !s.p.exited() {
		_ = syscall.Kill(-s.p.pid(), syscall.SIGKILL)
		<-s.p.done
	}
	return c.r.servers.stop(s.p)
}

// tcDir makes a fresh directory for one tiercache server.
func (c *cacheRunner) tcDir(tag string) (string, error) {
	d := filepath.Join(c.workdir, tag)
	c.dirs = append(c.dirs, d)
	if err := os.RemoveAll(d); err != nil {
		return "", err
	}
	return d, os.MkdirAll(d, 0o755)
}

// backing copies the master data into a new image in dir.
func (c *cacheRunner) backing(ctx context.Context, dir string) (string, error) {
	return c.backingFrom(ctx, dir, c.master)
}

// backingFrom copies src (holes stay holes) into a new image in dir.
func (c *cacheRunner) backingFrom(ctx context.Context, dir, src string) (string, error) {
	dst := filepath.Join(dir, "hdd.img")
	cmd := exec.CommandContext(ctx, "cp", "--sparse=always", src, dst)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("copy data: %v: %s", err, out)
	}
	// The rest of the disk is a hole: it reads as zeros and takes no RAM.
	return dst, os.Truncate(dst, c.sz.Disk)
}

// plainHDD serves a fresh copy of the data on the HDD model, no cache.
func (c *cacheRunner) plainHDD(ctx context.Context, tag string) (*server, error) {
	dir, err := c.tcDir(tag)
	if err != nil {
		return nil, err
	}
	b, err := c.backing(ctx, dir)
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "nbd.sock")
	argv := []string{c.tcBin, "serve", "--export", "vol=hdd:" + b, "--listen", "unix:" + sock, "--data-dir", dir, "--direct", "off"}
	return c.startServer(ctx, "tiercache", "vol", sock, dir, argv)
}

// cached formats a cache set (cacheSpec kind: "ssd", "nvme", or "" for a
// plain file; backKind likewise) over a fresh copy of the data and serves it.
func (c *cacheRunner) cached(ctx context.Context, tag, cacheKind, backKind, mode string, cacheSize int64) (*server, error) {
	return c.cachedFrom(ctx, tag, cacheKind, backKind, mode, cacheSize, c.master)
}

// cachedFrom is cached with the backing data copied from src.
func (c *cacheRunner) cachedFrom(ctx context.Context, tag, cacheKind, backKind, mode string, cacheSize int64, src string) (*server, error) {
	return c.cachedFromBin(ctx, c.tcBin, tag, cacheKind, backKind, mode, cacheSize, src)
}

// cachedFromBin is cachedFrom served by the tiercache binary bin.
func (c *cacheRunner) cachedFromBin(ctx context.Context, bin, tag, cacheKind, backKind, mode string, cacheSize int64, src string) (*server, error) {
	dir, err := c.tcDir(tag)
	if err != nil {
		return nil, err
	}
	b, err := c.backingFrom(ctx, dir, src)
	if err != nil {
		return nil, err
	}
	return c.serveCache(ctx, bin, dir, cacheKind, devSpec(backKind, b), mode, cacheSize)
}

// devSpec is a device argument: path with its model kind ("ssd", "hdd",
// ...; "" for none).
func devSpec(kind, p string) string {
	if kind == "" {
		return p
	}
	return kind + ":" + p
}

// serveCache formats a cache set in dir (a new cache file of cacheSize,
// model cacheKind) over the backing device backing (a device argument of
// format --backing) and serves it as export vol.
func (c *cacheRunner) serveCache(ctx context.Context, bin, dir, cacheKind, backing, mode string, cacheSize int64) (*server, error) {
	cf := filepath.Join(dir, "cache.img")
	if err := os.WriteFile(cf, nil, 0o644); err != nil {
		return nil, err
	}
	if err := os.Truncate(cf, cacheSize); err != nil {
		return nil, err
	}
	spec := devSpec
	format := []string{bin, "format", "--cache", spec(cacheKind, cf), "--backing", "vol=" + backing, "--mode", mode, "--direct", "off", "--data-dir", dir}
	c.r.noteCommand(format)
	if out, err := exec.CommandContext(ctx, format[0], format[1:]...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("%s: %v\n%s", shellJoin(format), err, out)
	}
	sock := filepath.Join(dir, "nbd.sock")
	argv := []string{bin, "serve", "--cache", spec(cacheKind, cf), "--listen", "unix:" + sock, "--data-dir", dir, "--direct", "off"}
	srv, err := c.startServer(ctx, "tiercache", "vol", sock, dir, argv)
	if srv != nil {
		srv.bin = bin
	}
	return srv, err
}

// admin runs a tiercache admin command against s.
func (c *cacheRunner) admin(ctx context.Context, s *server, args ...string) ([]byte, error) {
	argv := append([]string{s.bin, "--data-dir", s.dataDir}, args...)
	c.r.noteCommand(argv)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("%s: %v: %s", shellJoin(argv), err, strings.TrimSpace(string(ee.Stderr)))
		}
		return nil, fmt.Errorf("%s: %w", shellJoin(argv), err)
	}
	return out, nil
}

// set changes settings of export vol.
func (c *cacheRunner) set(ctx context.Context, s *server, kv ...string) error {
	_, err := c.admin(ctx, s, append([]string{"set", "vol"}, kv...)...)
	return err
}

// flush drains vol's dirty data and returns the wall time it took.
func (c *cacheRunner) flush(ctx context.Context, s *server) (time.Duration, error) {
	t0 := time.Now()
	_, err := c.admin(ctx, s, "flush", "vol")
	return time.Since(t0), err
}

// signalContext cancels on SIGINT or SIGTERM; a second signal kills.
func signalContext() (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		stop()
	}()
	return ctx, stop
}
