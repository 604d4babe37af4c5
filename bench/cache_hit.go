package bench

// S10: a cache hit at device speed. tiercache's cache hits on a real local
// disk, side by side in one run with the disk itself (fio libaio O_DIRECT
// on a file of the same size on the same file system) and with qemu-nbd
// --cache=none --aio=native serving the cache file itself: the choice a
// user makes between them. Unlike S1-S9
// there is no device model: the cache file sits on the file system of
// hitBase (not tmpfs), opened with O_DIRECT by all three.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// hitSizes are S10's sizes (part of cacheSizes).
type hitSizes struct {
	Cache   int64 // the cache file (and the raw write file)
	Region  int64 // the volume region filled through tiercache and read back
	Rounds  int
	Runtime time.Duration
	Ramp    time.Duration
}

func fullHitSizes() hitSizes {
	return hitSizes{Cache: 2 << 30, Region: 1 << 30, Rounds: 3, Runtime: 5 * time.Second, Ramp: time.Second}
}

func quickHitSizes() hitSizes {
	return hitSizes{Cache: 256 << 20, Region: 64 << 20, Rounds: 1, Runtime: time.Second}
}

func (z hitSizes) line() string {
	return fmt.Sprintf("S10 %d MiB cached of a %d MiB cache file on disk, %d rounds x %v after a %v ramp", z.Region>>20, z.Cache>>20, z.Rounds, z.Runtime, z.Ramp)
}

// hitSteps counts S10's progress steps.
func (z hitSizes) steps() int { return 1 + z.Rounds*len(hitRuns(z)) }

// hitRun is one measured run: a job against one target.
type hitRun struct {
	target string // "raw", "qemu-nbd", "tiercache"
	j      job
}

const (
	hitRaw  = "raw O_DIRECT"
	hitQemu = "qemu-nbd"
	hitTC   = "tiercache"
)

// hitRuns lists a round's runs. Reads go to the filled region (all hits);
// the writes last (tiercache's are flushed before the next round).
func hitRuns(z hitSizes) []hitRun {
	rd := func(name, title, rw string, bs, qd, jobs int, m Metric) job {
		return job{Name: name, Title: title, RW: rw, BS: bs, QD: qd, NumJobs: jobs, Size: z.Region, Runtime: z.Runtime, Ramp: z.Ramp, Metric: m}
	}
	qd32 := rd("randread-4k-qd32", "rand read 4 KiB QD32", "randread", 4096, 32, 1, MetricIOPS)
	qd32x2 := rd("randread-4k-qd32x2", "rand read 4 KiB QD32 x 2 connections", "randread", 4096, 32, 2, MetricIOPS)
	qd32x4 := rd("randread-4k-qd32x4", "rand read 4 KiB QD32 x 4 connections", "randread", 4096, 32, 4, MetricIOPS)
	qd1 := rd("randread-4k-qd1", "rand read 4 KiB QD1", "randread", 4096, 1, 1, MetricIOPS)
	seq := rd("read-1m-qd8", "seq read 1 MiB QD8", "read", 1<<20, 8, 1, MetricMiBps)
	wr := rd("randwrite-4k-qd32", "rand write 4 KiB QD32", "randwrite", 4096, 32, 1, MetricIOPS)
	var runs []hitRun
	for _, j := range []job{qd32, qd1, seq} {
		for _, t := range []string{hitRaw, hitQemu, hitTC} {
			runs = append(runs, hitRun{t, j})
		}
	}
	runs = append(runs, hitRun{hitTC, qd32x2}, hitRun{hitTC, qd32x4}, hitRun{hitRaw, qd32x4})
	return append(runs, hitRun{hitRaw, wr}, hitRun{hitTC, wr})
}

// hitBase is where S10 puts its files: a disk, not tmpfs. TIERCACHE_HIT_DIR
// overrides it.
func hitBase() (string, error) {
	for _, d := range []string{os.Getenv("TIERCACHE_HIT_DIR"), "/var/tmp", os.TempDir()} {
		if d == "" {
			continue
		}
		var st unix.Statfs_t
		if err := unix.Statfs(d, &st); err != nil || st.Type == unix.TMPFS_MAGIC {
			continue
		}
		return d, nil
	}
	return "", fmt.Errorf("S10 needs a directory on a disk file system (not tmpfs): set TIERCACHE_HIT_DIR")
}

func (c *cacheRunner) s10(ctx context.Context) (err error) {
	z := c.sz.Hit
	base, err := hitBase()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp(base, "tcbench-hit-")
	if err != nil {
		return err
	}
	c.dirs = append(c.dirs, dir)
	cacheImg := filepath.Join(dir, "cache.img")
	rawImg := filepath.Join(dir, "raw.img")
	backImg := filepath.Join(dir, "back.img")
	// Both files written once end to end, as a device is: no hole or
	// unwritten extent makes either side's reads or writes cheaper.
	for _, f := range []string{cacheImg, rawImg} {
		fill := job{Name: "s10-prefill", RW: "write", BS: 1 << 20, QD: 8, Size: z.Cache, File: f, Metric: MetricMiBps}
		if _, err := c.fioRaw(ctx, fill, "s10-"+filepath.Base(f)); err != nil {
			return err
		}
	}
	if err := os.WriteFile(backImg, nil, 0o644); err != nil {
		return err
	}
	if err := os.Truncate(backImg, z.Region); err != nil {
		return err
	}
	format := []string{c.tcBin, "format", "--cache", cacheImg, "--backing", "vol=" + backImg, "--mode", "writeback", "--direct", "on", "--data-dir", dir}
	c.r.noteCommand(format)
	if out, err := exec.CommandContext(ctx, format[0], format[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v\n%s", shellJoin(format), err, out)
	}
	sock := filepath.Join(dir, "nbd.sock")
	tc, err := c.startServer(ctx, "tiercache", "vol", sock, dir, []string{c.tcBin, "serve", "--cache", cacheImg, "--listen", "unix:" + sock, "--data-dir", dir, "--direct", "on"})
	if err != nil {
		return err
	}
	// Fill the region through tiercache (every block cached, dirty), then
	// write it back so that no writeback runs while reads are measured.
	if err := c.set(ctx, tc, "sequential_cutoff=0"); err != nil {
		return err
	}
	fill := job{Name: "s10-fill", RW: "write", BS: 1 << 20, QD: 8, Size: z.Region, Metric: MetricMiBps}
	if _, err := c.fio(ctx, tc, fill, "s10"); err != nil {
		return err
	}
	if err := c.set(ctx, tc, "sequential_cutoff=4M"); err != nil {
		return err
	}
	if _, err := c.flush(ctx, tc); err != nil {
		return err
	}
	// qemu-nbd serves the same cache file read-only (-r), O_DIRECT and
	// Linux AIO; -t keeps it serving across fio's connections.
	qsock := filepath.Join(dir, "qemu.sock")
	q, err := c.startServer(ctx, "qemu-nbd", "vol", qsock, "", []string{"qemu-nbd", "--cache=none", "--aio=native", "-r", "-t", "-f", "raw", "-x", "vol", "-k", qsock, cacheImg})
	if err != nil {
		return err
	}
	v0, _, err := c.stats(ctx, tc)
	if err != nil {
		return err
	}
	c.progress("S10", "fill and flush", fmt.Sprintf("%s cached", mib(v0["CachedBlocks"]*4096)))

	type sample struct{ v, p50, p99, cpuUs float64 }
	samples := map[string][]sample{} // by target + "/" + job name
	runs := hitRuns(z)
	for round := 1; round <= z.Rounds; round++ {
		// Reads in a rotated order each round; the writes last.
		nr := len(runs) - 2
		order := append(rotateRuns(runs[:nr], round-1), runs[nr:]...)
		for _, hr := range order {
			var fr fioRun
			tag := fmt.Sprintf("s10-r%d-%s", round, strings.ReplaceAll(hr.target, " ", "_"))
			switch hr.target {
			case hitRaw:
				j := hr.j
				j.File = rawImg
				fr, err = c.fioRaw(ctx, j, tag)
			case hitQemu:
				fr, err = c.fio(ctx, q, hr.j, tag)
			default:
				fr, err = c.fio(ctx, tc, hr.j, tag)
			}
			if err != nil {
				return err
			}
			ios := float64(fr.res.Bytes) / float64(hr.j.BS)
			cpuUs := 0.0
			if hr.target != hitRaw && ios > 0 {
				cpuUs = fr.win.server.Seconds() / ios * 1e6
			}
			v := fr.value(hr.j.Metric)
			k := hr.target + "/" + hr.j.Name
			samples[k] = append(samples[k], sample{v, fr.res.LatP50Us, fr.res.LatP99Us, cpuUs})
			c.add(Figure{Scenario: "S10", Target: hr.target, Test: hr.j.Title, Value: v, Unit: hr.j.Metric.String(), Round: round,
				LatMeanUs: fr.res.LatMeanUs, LatP99Us: fr.res.LatP99Us, ServerCPU: fr.cpuPerGiB()})
			c.progress("S10", fmt.Sprintf("round %d/%d %s %s", round, z.Rounds, hr.target, hr.j.Title),
				fmt.Sprintf("%s %s, p50 %.0f µs, p99 %.0f µs, server %.1f µs CPU per I/O", formatValue(v), hr.j.Metric, fr.res.LatP50Us, fr.res.LatP99Us, cpuUs))
			if hr.target == hitTC && strings.Contains(hr.j.RW, "write") {
				if _, err := c.flush(ctx, tc); err != nil {
					return err
				}
			}
		}
	}
	v1, _, err := c.stats(ctx, tc)
	if err != nil {
		return err
	}
	for _, s := range []*server{tc, q} {
		if err := c.discard(s); err != nil {
			return err
		}
	}
	med := func(k string, f func(sample) float64) float64 {
		var xs []float64
		for _, s := range samples[k] {
			xs = append(xs, f(s))
		}
		return newStat(xs).med
	}
	val := func(s sample) float64 { return s.v }
	cpu := func(s sample) float64 { return s.cpuUs }
	p50 := func(s sample) float64 { return s.p50 }
	p99 := func(s sample) float64 { return s.p99 }
	get := func(t, j string, f func(sample) float64) (float64, bool) {
		if len(samples[t+"/"+j]) == 0 {
			return 0, false
		}
		return med(t+"/"+j, f), true
	}
	cell := func(t, j string, f func(sample) float64) string {
		if v, ok := get(t, j, f); ok {
			return formatValue(v)
		}
		return "–"
	}
	rows := [][]string{{"Workload", "Unit", "raw O_DIRECT", "qemu-nbd", "tiercache", "tiercache / raw", "tiercache / qemu-nbd",
		"p50 µs raw / qemu / tc", "p99 µs raw / qemu / tc", "server CPU µs per I/O qemu / tc"}}
	seen := map[string]bool{}
	for _, hr := range runs {
		j := hr.j
		if seen[j.Name] {
			continue
		}
		seen[j.Name] = true
		raw, _ := get(hitRaw, j.Name, val)
		qv, _ := get(hitQemu, j.Name, val)
		tv, _ := get(hitTC, j.Name, val)
		rows = append(rows, []string{j.Title, j.Metric.String(), cell(hitRaw, j.Name, val), cell(hitQemu, j.Name, val), cell(hitTC, j.Name, val),
			ratioCell(tv, raw), ratioCell(tv, qv),
			cell(hitRaw, j.Name, p50) + " / " + cell(hitQemu, j.Name, p50) + " / " + cell(hitTC, j.Name, p50),
			cell(hitRaw, j.Name, p99) + " / " + cell(hitQemu, j.Name, p99) + " / " + cell(hitTC, j.Name, p99),
			cell(hitQemu, j.Name, cpu) + " / " + cell(hitTC, j.Name, cpu)})
	}
	type bar struct {
		what   string
		a, b   float64
		unit   string
		ratio  float64
		barTxt string
		met    bool
	}
	m := func(t, j string, f func(sample) float64) float64 { v, _ := get(t, j, f); return v }
	var bars []bar
	add := func(what string, a, b float64, unit, barTxt string, ok func(r float64) bool) {
		r := ratioOf(a, b)
		bars = append(bars, bar{what, a, b, unit, r, barTxt, ok(r)})
	}
	ge := func(x float64) func(float64) bool { return func(r float64) bool { return r >= x } }
	le := func(x float64) func(float64) bool { return func(r float64) bool { return r <= x } }
	add("4 KiB rand read QD32, 1 connection: tiercache hits / raw O_DIRECT", m(hitTC, "randread-4k-qd32", val), m(hitRaw, "randread-4k-qd32", val), "IOPS", "≥ 0.9", ge(0.9))
	add("4 KiB rand read QD32, 1 connection: tiercache hits / qemu-nbd", m(hitTC, "randread-4k-qd32", val), m(hitQemu, "randread-4k-qd32", val), "IOPS", "≥ 1.5", ge(1.5))
	add("4 KiB rand read QD32: tiercache 2 connections / 1", m(hitTC, "randread-4k-qd32x2", val), m(hitTC, "randread-4k-qd32", val), "IOPS", "–", ge(0))
	add("4 KiB rand read QD32 x 4: tiercache 4 connections / raw 4 jobs", m(hitTC, "randread-4k-qd32x4", val), m(hitRaw, "randread-4k-qd32x4", val), "IOPS", "≥ 0.9", ge(0.9))
	add("4 KiB rand write QD32: tiercache writeback / raw O_DIRECT", m(hitTC, "randwrite-4k-qd32", val), m(hitRaw, "randwrite-4k-qd32", val), "IOPS", "≥ 0.8", ge(0.8))
	add("server CPU per 4 KiB hit (QD32): tiercache / qemu-nbd", m(hitTC, "randread-4k-qd32", cpu), m(hitQemu, "randread-4k-qd32", cpu), "µs", "≤ 1.0", le(1))
	add("1 MiB seq read QD8: tiercache hits / raw O_DIRECT", m(hitTC, "read-1m-qd8", val), m(hitRaw, "read-1m-qd8", val), "MiB/s", "≥ 0.95", ge(0.95))
	add("4 KiB QD1 hit p99 latency: tiercache / raw", m(hitTC, "randread-4k-qd1", p99), m(hitRaw, "randread-4k-qd1", p99), "µs", "≤ 2.0", le(2))
	for _, b := range bars {
		met := yesNo(b.met)
		if b.barTxt == "–" {
			met = "–"
		}
		c.checks = append(c.checks, Check{Scenario: "S10", What: b.what, Seed: "target: the bar, against the raw disk or qemu-nbd on the same file",
			Ours: fmt.Sprintf("%s vs %s %s", formatValue(b.a), formatValue(b.b), b.unit), Ratio: b.ratio, Bar: b.barTxt, Met: met})
	}
	// The QD1 median bar is a difference, not a ratio.
	d50 := m(hitTC, "randread-4k-qd1", p50) - m(hitRaw, "randread-4k-qd1", p50)
	c.checks = append(c.checks, Check{Scenario: "S10", What: "4 KiB QD1 hit p50 latency: tiercache − raw (µs; the Ratio column holds the difference)", Seed: "target: at most 30 µs over the raw disk",
		Ours: fmt.Sprintf("%.0f vs %.0f µs", m(hitTC, "randread-4k-qd1", p50), m(hitRaw, "randread-4k-qd1", p50)), Ratio: d50, Bar: "≤ 30", Met: yesNo(d50 <= 30)})
	c.details = append(c.details, detail{Scenario: "S10", Title: fmt.Sprintf("S10 cache hits on the local disk: %d MiB cached (writeback, filled with sequential_cutoff=0, then flushed) in a %d MiB cache file under %s, median of %d rounds", z.Region>>20, z.Cache>>20, base, z.Rounds),
		Rows: rows, Notes: []string{
			"raw O_DIRECT: fio libaio --direct=1 on a file of the cache file's size on the same file system, written end to end first like the cache file (not the cache file itself, whose first bytes are not all data blocks: holes there read without I/O). qemu-nbd: --cache=none --aio=native -r on the cache file (it reads the same data blocks tiercache does). tiercache: serve --direct on; NBD clients are fio's nbd engine, one connection per fio job.",
			"Server CPU per I/O is the server's utime+stime (/proc/PID/stat) over the measured time divided by the I/Os fio completed in it.",
			fmt.Sprintf("tiercache read %s in the measured runs, %s of it cache hits.", mib(delta(v0, v1, "ReadBytes")), mib(delta(v0, v1, "ReadHitBytes"))),
		}})
	var groups []string
	var vsRaw, vsQemu []float64
	for _, j := range []string{"randread-4k-qd32", "randread-4k-qd1", "read-1m-qd8"} {
		groups = append(groups, j)
		vsRaw = append(vsRaw, ratioOf(m(hitTC, j, val), m(hitRaw, j, val)))
		vsQemu = append(vsQemu, ratioOf(m(hitTC, j, val), m(hitQemu, j, val)))
	}
	return chartGroups(c.chartPath("s10.png"), "S10: tiercache cache hits on the local disk (higher is better)", "ratio",
		groups, []string{"tiercache / raw O_DIRECT", "tiercache / qemu-nbd"}, [][]float64{vsRaw, vsQemu}, []float64{0.9})
}

func ratioCell(a, b float64) string {
	if a == 0 || b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", a/b)
}

// rotateRuns is rotate for runs.
func rotateRuns(rs []hitRun, r int) []hitRun {
	out := make([]hitRun, 0, len(rs))
	for i := range rs {
		out = append(out, rs[(i+r)%len(rs)])
	}
	return out
}

// fioRaw runs j, which has File set, with no server.
func (c *cacheRunner) fioRaw(ctx context.Context, j job, tag string) (fioRun, error) {
	out := filepath.Join(c.workdir, fmt.Sprintf("fio.%s.%s.json", tag, j.Name))
	c.r.noteCommand(append([]string{"fio"}, j.args("", "OUT.json")...))
	c.r.opts.Ramp = j.Ramp
	c.r.opts.Runtime = 0
	if j.timeBased() {
		c.r.opts.Runtime = j.Runtime
	}
	t0 := time.Now()
	res, win, err := c.r.runFioRetry(ctx, j.args("", out), out, 0)
	if err != nil {
		return fioRun{}, fmt.Errorf("fio %s on %s: %w", j.Name, j.File, err)
	}
	return fioRun{res: res, win: win, wall: time.Since(t0)}, nil
}
