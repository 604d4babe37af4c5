package bench

// S7–S9: when the data outgrows the cache.
//
// S7 writes 3x and 5x the cache on a fresh cache: sequential streams,
// mixed-size random writes with fsyncs and a random read/write mix with
// fsyncs (fio through NBD), and RocksDB db_bench fillrandom of a database
// 2x the cache on ext4 through the kernel.
// S8 is the shared server's history on ext4 through the kernel: 4 KiB random
// overwrites of a small region at QD16 with an fsync every 32 writes (small
// flush epochs, superseded versions), then a large sequential write, then
// fillrandom. Each runs on the plain HDD model and on tiercache in every
// writeback order, side by side in one run; the report gives each ratio and
// the p99.9 and slowest write. S9 charts the hit ratio over time while a
// cache warms under pure random reads and under a 70/30 read/write mix.
//
// A tiercache run is cut at max(CapMin, CapFactor x the plain HDD model's
// time for the same job): a stall shows as a low ratio and "cut", not as a
// suite that never ends. A run that is still not done CliffGrace after its
// cap (no completion at all: fio's own runtime limit waits for requests in
// flight) has its server killed; the report says "stalled".

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/admin"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// cliffSizes are S7–S9's sizes (part of cacheSizes).
type cliffSizes struct {
	Cache       int64         // every tiercache target's SSD model cache
	SeqWrite    int64         // S7 sequential write, 1 MiB QD4
	SeqWrite5   int64         // S7 sequential write of 5x the cache (0: not run; --quick)
	MixWrite    int64         // S7 mixed-size random writes with fsyncs
	MixRW       int64         // S7 bytes written by the random read/write mix with fsyncs (0: not run)
	MixRegion   int64         // the region they cover
	FS          int64         // S7/S8 ext4, at the start of the HDD model's disk
	RocksKeys   int           // fillrandom keys (4 KiB values)
	DrainFill   int64         // S7: sequential dirty data drained by tiercache flush
	RandDrain   int64         // S7: random 4 KiB dirty data drained by tiercache flush
	HistRegion  int64         // S8: the region the history overwrites
	HistWrites  int64         // S8: bytes of 4 KiB overwrites
	HistHDDTime time.Duration // S8: cap of the history on the plain HDD model (it writes in place)
	HistSeq     int64         // S8: the sequential write after the history
	CapMin      time.Duration
	CapFactor   float64
	Grace       time.Duration // after the cap, before a server is killed as stalled
	// ConsistentWait bounds S8's wait, after its last job, for a degraded
	// volume to become consistent again.
	ConsistentWait time.Duration
	WarmRegion     int64         // S9 working set
	WarmTime       time.Duration // S9 per job
	WarmSample     time.Duration // S9 sampling interval of the hit ratio
}

func fullCliffSizes() cliffSizes {
	return cliffSizes{Cache: 256 << 20, SeqWrite: 768 << 20, SeqWrite5: 1280 << 20, MixWrite: 768 << 20, MixRW: 768 << 20, MixRegion: 1 << 30, DrainFill: 192 << 20, RandDrain: 64 << 20, FS: 2 << 30, RocksKeys: 131072,
		HistRegion: 32 << 20, HistWrites: 256 << 20, HistHDDTime: 10 * time.Second, HistSeq: 512 << 20,
		CapMin: 20 * time.Second, CapFactor: 4, Grace: 15 * time.Second, ConsistentWait: time.Minute,
		WarmRegion: 32 << 20, WarmTime: 20 * time.Second, WarmSample: 2 * time.Second}
}

func quickCliffSizes() cliffSizes {
	return cliffSizes{Cache: 64 << 20, SeqWrite: 96 << 20, MixWrite: 16 << 20, MixRW: 8 << 20, MixRegion: 64 << 20, DrainFill: 32 << 20, RandDrain: 1 << 20, FS: 256 << 20, RocksKeys: 4000,
		HistRegion: 4 << 20, HistWrites: 8 << 20, HistHDDTime: 2 * time.Second, HistSeq: 32 << 20,
		CapMin: 10 * time.Second, CapFactor: 4, Grace: 10 * time.Second, ConsistentWait: 10 * time.Second,
		WarmRegion: 4 << 20, WarmTime: 2 * time.Second, WarmSample: 500 * time.Millisecond}
}

func (z cliffSizes) line() string {
	return fmt.Sprintf("S7-S9 cache %d MiB; S7 sequential write %d MiB and %d MiB, mixed random writes %d MiB over %d MiB, random read/write mix writing %d MiB, drain of %d MiB sequential and of %d MiB random 4K dirty data, fillrandom %d keys x 4 KiB on ext4 %d MiB; S8 %d MiB of 4K overwrites of %d MiB (plain HDD capped at %v), then %d MiB sequential, then fillrandom; tiercache runs cut at max(%v, %.0fx the plain HDD's time); S9 %d MiB working set, %v per job",
		z.Cache>>20, z.SeqWrite>>20, z.SeqWrite5>>20, z.MixWrite>>20, z.MixRegion>>20, z.MixRW>>20, z.DrainFill>>20, z.RandDrain>>20, z.RocksKeys, z.FS>>20, z.HistWrites>>20, z.HistRegion>>20, z.HistHDDTime, z.HistSeq>>20,
		z.CapMin, z.CapFactor, z.WarmRegion>>20, z.WarmTime)
}

// cliffTarget is one column of S7 and S8: the plain HDD model (order "")
// or tiercache in writeback mode with one writeback order, served by the
// suite's tiercache binary or (bin) the --ab one.
type cliffTarget struct{ name, order, bin string }

// bare reports whether t is the plain HDD model.
func (t cliffTarget) bare() bool { return t.order == "" }

var (
	hddBefore     = cliffTarget{"HDD model", "", ""}
	hddAfter      = cliffTarget{"HDD model, again", "", ""}
	tiercacheRuns = []cliffTarget{{"tiercache epoch", "epoch", ""}, {"tiercache lba", "lba", ""}}
)

// cliffTargets are the round's targets: the plain HDD model, tiercache in
// each writeback order (with --ab the second binary in both orders too,
// after the first binary's targets in odd rounds and before them in even
// ones), and the plain HDD model again. The machine's load drifts within
// a round by more than the differences measured, so each tiercache run is
// compared with the mean of the plain runs that bracket it (cliffBase). The
// first plain run's times set the caps.
func (c *cacheRunner) cliffTargets() []cliffTarget {
	if c.abBin == "" {
		return slices.Concat([]cliffTarget{hddBefore}, tiercacheRuns, []cliffTarget{hddAfter})
	}
	b := "B"
	if c.abRev != "" {
		b += " " + c.abRev
	}
	a := tiercacheRuns
	bt := []cliffTarget{{"tiercache epoch (" + b + ")", "epoch", c.abBin}, {"tiercache lba (" + b + ")", "lba", c.abBin}}
	if c.round%2 == 0 {
		a, bt = bt, a
	}
	return slices.Concat([]cliffTarget{hddBefore}, a, bt, []cliffTarget{hddAfter})
}

// cliffBase is what a case's tiercache runs are compared with: the mean of
// the plain HDD model's runs before and after them (runs[0] and the last
// run), or the one of them that ran.
func cliffBase(runs []cliffRun) cliffRun {
	b, a := runs[0], runs[len(runs)-1]
	switch {
	case len(runs) < 2 || a.skipped != "":
		return b
	case b.skipped != "":
		return a
	}
	m := b
	m.value = (b.value + a.value) / 2
	m.p999Ms, m.maxMs = max(b.p999Ms, a.p999Ms), max(b.maxMs, a.maxMs)
	return m
}

// cliffRun is one job's result on one target.
type cliffRun struct {
	value          float64 // MB/s or ops/s
	unit           string
	p999Ms, maxMs  float64 // write latency; NaN when unknown
	secs           float64 // wall time
	cap            time.Duration
	cut            bool   // stopped at its cap before it was done
	stalled        bool   // still not done after cap + grace: the server was killed
	skipped        string // why the job did not run
	tc             string // what tiercache did during it
	doneOf, wantOf string // work done of work asked, e.g. "512 of 768 MiB"
	// cpu is the CPU time (user + system) the server used during the
	// job; 0 when unknown. On two shared cores a job the plain HDD model
	// serves near the no-device ceiling is bound by CPU, and this is where
	// tiercache's extra work shows.
	cpu time.Duration
	// fillrandom (db_bench --statistics): bytes RocksDB wrote to its
	// tables by memtable flushes and by compactions while the job ran, and
	// the time its writes stalled; 0 when unknown.
	flushBytes, compactBytes, stallSecs float64
}

// serverCPU is srv's CPU time so far; ok is false when it cannot be read
// (no server, or a killed one).
func serverCPU(srv *server) (d time.Duration, ok bool) {
	if srv == nil || srv.p == nil {
		return 0, false
	}
	d, err := processCPU(srv.p.pid())
	return d, err == nil
}

// cpuSince sets r.cpu from srv's CPU time at the job's start (c0, ok0).
func (r *cliffRun) cpuSince(srv *server, c0 time.Duration, ok0 bool) {
	if c1, ok := serverCPU(srv); ok && ok0 {
		r.cpu = c1 - c0
	}
}

// note is what the report says of the run: what tiercache did and the
// server's CPU time.
func (r cliffRun) note() string {
	cpu := ""
	if r.cpu > 0 {
		cpu = fmt.Sprintf("server CPU %.1f s", r.cpu.Seconds())
	}
	return joinNote(r.tc, cpu)
}

// tableBytes is what RocksDB wrote to its tables during a fillrandom run
// (0 when unknown).
func (r cliffRun) tableBytes() float64 { return r.flushBytes + r.compactBytes }

// rocksText says what RocksDB wrote during a fillrandom run ("" when
// unknown).
func (r cliffRun) rocksText() string {
	if r.tableBytes() == 0 {
		return ""
	}
	return fmt.Sprintf("RocksDB wrote %s to its tables (%s by flushes, %s by compactions), its writes stalled %.1f s", mib(r.tableBytes()), mib(r.flushBytes), mib(r.compactBytes), r.stallSecs)
}

func (r cliffRun) status() string {
	switch {
	case r.skipped != "":
		return "not run: " + r.skipped
	case r.stalled:
		return fmt.Sprintf("stalled: killed %.0f s after its start (cap %v)", r.secs, r.cap)
	case r.cut:
		return fmt.Sprintf("cut at %v (%s of %s)", r.cap, r.doneOf, r.wantOf)
	}
	return "done"
}

// capFor is the cap of a tiercache run of a job the plain HDD model did in
// base.
func (c *cacheRunner) capFor(base float64) time.Duration {
	z := c.sz.Cliff
	d := time.Duration(z.CapFactor * base * float64(time.Second)).Round(time.Second)
	return max(d, z.CapMin)
}

// watchdog kills srv when it fires; fired says whether it did.
type watchdog struct {
	t     *time.Timer
	fired atomic.Bool
}

// watch arms a watchdog for a run cut at limit (none when limit is 0: the
// plain HDD model's runs are not cut).
func (c *cacheRunner) watch(srv *server, limit time.Duration) *watchdog {
	w := &watchdog{}
	if limit <= 0 {
		return w
	}
	w.t = time.AfterFunc(limit+c.sz.Cliff.Grace, func() {
		w.fired.Store(true)
		_ = syscall.Kill(-srv.p.pid(), syscall.SIGKILL)
	})
	return w
}

func (w *watchdog) stop() bool {
	if w.t != nil {
		w.t.Stop()
	}
	return w.fired.Load()
}

// cliffFio runs j on srv, cut at limit when limit > 0 (a tiercache run).
func (c *cacheRunner) cliffFio(ctx context.Context, srv *server, j job, tag string, limit time.Duration) (cliffRun, error) {
	r := cliffRun{unit: "MB/s", p999Ms: math.NaN(), maxMs: math.NaN(), cap: limit}
	if limit > 0 {
		j.Runtime = limit
	} else if j.IOSize > 0 && j.Runtime > 0 {
		r.cap = j.Runtime
	}
	wd := c.watch(srv, limit)
	c0, ok0 := serverCPU(srv)
	t0 := time.Now()
	fr, err := c.fio(ctx, srv, j, tag)
	r.secs = time.Since(t0).Round(100 * time.Millisecond).Seconds()
	r.cpuSince(srv, c0, ok0)
	if wd.stop() {
		r.stalled = true
		return r, nil
	}
	if err != nil {
		return r, err
	}
	r.value = fr.res.BW / 1e6
	r.p999Ms, r.maxMs = fr.res.WriteP999Us/1000, fr.res.WriteMaxUs/1000
	want := j.IOSize
	if fr.res.Bytes < want {
		r.cut = true
	}
	r.doneOf, r.wantOf = mib(float64(fr.res.Bytes)), mib(float64(want))
	return r, nil
}

// tcCounters is what a cliff run reports of tiercache's counters: v0 and
// v1 the volume's before and after, s1 the set's after. WritebackDegrades and
// BackingConsistent are reported by servers that degrade epoch order when
// writeback falls behind.
func tcCounters(v0, v1, s1 map[string]float64) string {
	s := fmt.Sprintf("%s written, %s bypassed as sequential, %s around (cache full), %.1f s of space waits, %s written back; after: %s dirty, %s superseded, %.0f of %.0f buckets free",
		mib(delta(v0, v1, "WriteBytes")), mib(delta(v0, v1, "BypassSequentialBytes")), mib(delta(v0, v1, "BypassCacheFullBytes")),
		delta(v0, v1, "SpaceWaitNanos")/1e9, mib(delta(v0, v1, "WritebackBytes")),
		mib(4096*v1["DirtyBlocks"]), mib(4096*v1["SupersededBlocks"]), s1["FreeBuckets"], s1["Buckets"])
	if _, ok := v1["WritebackDegrades"]; ok {
		s += fmt.Sprintf("; degraded %.0f times", delta(v0, v1, "WritebackDegrades"))
	}
	if c, ok := v1["BackingConsistent"]; ok && c == 0 {
		s += "; backing device not consistent at the end"
	}
	return s
}

// untilConsistent waits (up to limit) for a volume whose backing device is
// not consistent (it degraded from epoch order) to become consistent again
// once the load has stopped, and says how long it took; "" when the server
// does not report the state.
func (c *cacheRunner) untilConsistent(ctx context.Context, srv *server, limit time.Duration) string {
	t0 := time.Now()
	for {
		v, _ := c.quickStats(ctx, srv)
		st, ok := v["BackingConsistent"]
		switch {
		case !ok:
			return ""
		case st == 1 && time.Since(t0) < time.Second:
			return "backing device consistent when the load stopped"
		case st == 1:
			return fmt.Sprintf("backing device consistent again %.1f s after the load stopped (%s dirty left)", time.Since(t0).Seconds(), mib(4096*v["DirtyBlocks"]))
		case time.Since(t0) > limit:
			return fmt.Sprintf("backing device still not consistent %v after the load stopped (%s dirty)", limit, mib(4096*v["DirtyBlocks"]))
		}
		select {
		case <-ctx.Done():
			return ""
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// quickStats reads srv's counters with a short timeout (a stalled server's
// admin API still answers; a killed one does not).
func (c *cacheRunner) quickStats(ctx context.Context, srv *server) (vol, set map[string]float64) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	v, s, err := c.stats(ctx, srv)
	if err != nil {
		return map[string]float64{}, map[string]float64{}
	}
	return v, s
}

// writeLat returns srv's latency summary of all write requests since it
// started, as its backend served them (admin API; zero when unknown).
func (c *cacheRunner) writeLat(ctx context.Context, srv *server) admin.LatencySummary {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := c.admin(ctx, srv, "stats", "--json")
	if err != nil {
		return admin.LatencySummary{}
	}
	var st admin.Stats
	if json.Unmarshal(out, &st) != nil {
		return admin.LatencySummary{}
	}
	for _, e := range st.Exports {
		if e.Name != "vol" {
			continue
		}
		for _, l := range e.Latency {
			if l.Op == "write" && l.Tier == "" {
				return l
			}
		}
	}
	return admin.LatencySummary{}
}

// latText says what the server saw of the write requests between l0 and
// l1 (writeLat): their p99.9 and the slowest ("" when none).
func latText(l0, l1 admin.LatencySummary) string {
	d := l1.Sub(l0)
	if d.Count == 0 {
		return ""
	}
	return fmt.Sprintf("server: %d write requests, p99.9 %s, slowest %s", d.Count, msText(d.P999Micros/1000), msText(d.MaxMicros/1000))
}

// cliffServer starts target t over a fresh copy of src (the master data
// when "").
func (c *cacheRunner) cliffServer(ctx context.Context, tag string, t cliffTarget, src string) (*server, error) {
	if src == "" {
		src = c.master
	}
	if t.order == "" {
		dir, err := c.tcDir(tag)
		if err != nil {
			return nil, err
		}
		b, err := c.backingFrom(ctx, dir, src)
		if err != nil {
			return nil, err
		}
		sock := filepath.Join(dir, "nbd.sock")
		return c.startServer(ctx, "tiercache", "vol", sock, dir, []string{c.tcBin, "serve", "--export", "vol=hdd:" + b, "--listen", "unix:" + sock, "--data-dir", dir, "--direct", "off"})
	}
	srv, err := c.cachedFromBin(ctx, cmp.Or(t.bin, c.tcBin), tag, "ssd", "hdd", "writeback", c.sz.Cliff.Cache, src)
	if err != nil {
		return nil, err
	}
	if err := c.set(ctx, srv, "writeback_order="+t.order); err != nil {
		_ = c.discard(srv)
		return nil, err
	}
	return srv, nil
}

// cliffDiscard stops srv and, unless --keep, removes its directory: an
// S7 target's images hold what its job wrote (up to 5x the cache on top of
// the data, in RAM), and a round has some twenty of them.
func (c *cacheRunner) cliffDiscard(srv *server) error {
	err := c.discard(srv)
	if !c.keep && srv.dataDir != "" {
		err = errors.Join(err, os.RemoveAll(srv.dataDir))
	}
	return err
}

// cliffCase is one job on every target.
type cliffCase struct {
	title string
	runs  []cliffRun // by cacheRunner.cliffTargets
	// bar is the lowest ratio to the plain HDD model that meets the case's
	// bar (0: 0.95); drain is a writeback drain (no request latency).
	bar   float64
	drain bool
	seed  string // the target, for the report (default: never slower than no cache)
}

// ---------------------------------------------------------------- S7

func (c *cacheRunner) s7(ctx context.Context) error {
	z := c.sz.Cliff
	x := func(n int64) float64 { return float64(n) / float64(z.Cache) }
	jobs := []job{
		{Name: "s7-seqwrite-1m-qd4", Title: fmt.Sprintf("fio sequential write %d MiB (%.3gx the cache), 1 MiB QD4", z.SeqWrite>>20, x(z.SeqWrite)),
			RW: "write", BS: 1 << 20, QD: 4, Size: z.SeqWrite, IOSize: z.SeqWrite, EndSync: true, Metric: MetricMiBps},
		{Name: "s7-mixwrite-fsync32", Title: fmt.Sprintf("fio random writes %d MiB (%.3gx the cache) over %d MiB, 4K/64K/1M (1/4, 1/4, 1/2), QD16, fsync every 32", z.MixWrite>>20, x(z.MixWrite), z.MixRegion>>20),
			RW: "randwrite", BS: 4096, BSSplit: "4k/25:64k/25:1m/50", QD: 16, Size: z.MixRegion, IOSize: z.MixWrite, FsyncN: 32, EndSync: true, Seed: 14, Metric: MetricMiBps},
		{Name: "s7-seqwrite5x-1m-qd4", Title: fmt.Sprintf("fio sequential write %d MiB (%.3gx the cache), 1 MiB QD4", z.SeqWrite5>>20, x(z.SeqWrite5)),
			RW: "write", BS: 1 << 20, QD: 4, Size: z.SeqWrite5, IOSize: z.SeqWrite5, EndSync: true, Metric: MetricMiBps},
		// 30 % reads: of the bytes moved (io_size) 70 % are the writes.
		{Name: "s7-mixrw-fsync32", Title: fmt.Sprintf("fio random read/write mix, 30 %% reads: %d MiB written (%.3gx the cache) and %d MiB read over %d MiB, 4K/64K/1M (1/4, 1/4, 1/2), QD16, fsync every 32 writes", z.MixRW>>20, x(z.MixRW), z.MixRW*3/7>>20, z.MixRegion>>20),
			RW: "randrw", MixRead: 30, BS: 4096, BSSplit: "4k/25:64k/25:1m/50", QD: 16, Size: z.MixRegion, IOSize: z.MixRW * 10 / 7 / (1 << 20) << 20, FsyncN: 32, EndSync: true, Seed: 15, Metric: MetricMiBps},
	}
	var cases []cliffCase
	var seqRuns []cliffRun
	for ji, j := range jobs {
		if !c.s7Runs(s7JobNames[ji]) && (ji != 0 || !c.s7Runs("drain")) || !c.s7Sized(s7JobNames[ji]) {
			continue
		}
		cc := cliffCase{title: j.Title}
		var limit time.Duration
		for ti, t := range c.cliffTargets() {
			srv, err := c.cliffServer(ctx, fmt.Sprintf("s7-%s-%d", j.Name, ti), t, "")
			if err != nil {
				return err
			}
			v0, _ := c.quickStats(ctx, srv)
			lim := limit
			if t.bare() {
				lim = 0
			}
			r, err := c.cliffFio(ctx, srv, j, fmt.Sprintf("s7-%d", ti), lim)
			if err != nil {
				_ = c.discard(srv)
				return err
			}
			if ti == 0 {
				limit = c.capFor(r.secs)
			} else if !t.bare() && !r.stalled {
				v1, s1 := c.quickStats(ctx, srv)
				r.tc = tcCounters(v0, v1, s1)
			}
			if err := c.cliffDiscard(srv); err != nil && !r.stalled {
				return err
			}
			c.cliffFigure("S7", t, j.Title, r)
			cc.runs = append(cc.runs, r)
		}
		if ji == 0 {
			seqRuns = cc.runs
		}
		cases = append(cases, cc)
	}
	if c.s7Runs("drain") {
		dr, err := c.s7Drain(ctx, seqRuns)
		if err != nil {
			return err
		}
		cases = append(cases, dr)
	}
	if c.s7Runs("randdrain") {
		dr, err := c.s7RandDrain(ctx)
		if err != nil {
			return err
		}
		cases = append(cases, dr)
	}
	if c.s7Runs("fillrandom") {
		fr, err := c.s7Fillrandom(ctx)
		if err != nil {
			return err
		}
		cases = append(cases, fr)
	}
	return c.cliffReport("S7", fmt.Sprintf("S7 larger than the cache: %d MiB SATA SSD model cache, fresh, in front of the HDD model; tiercache in writeback", z.Cache>>20), cases,
		[]string{"fio through NBD; fillrandom on ext4 via nbdfuse + loop (as S6). Tiercache runs are cut at the cap shown (a multiple of the plain HDD model's time), so a ratio below 1/cap-factor means \"did not finish\"."})
}

// s7JobNames name S7's cases for --s7 (the first four in the order of s7's
// fio jobs).
var s7JobNames = []string{"seqwrite", "mixwrite", "seqwrite5x", "mixrw", "drain", "randdrain", "fillrandom"}

// s7Runs reports whether S7 runs the case named (all when --s7 is empty).
func (c *cacheRunner) s7Runs(name string) bool {
	return len(c.s7jobs) == 0 || slices.Contains(c.s7jobs, name)
}

// s7Sized reports whether the sizes have the case named: the quick run
// (make test) leaves out the 5x sequential write.
func (c *cacheRunner) s7Sized(name string) bool {
	switch name {
	case "seqwrite5x":
		return c.sz.Cliff.SeqWrite5 > 0
	case "mixrw":
		return c.sz.Cliff.MixRW > 0
	}
	return true
}

// s7RandDrain fills the cache with random 4 KiB dirty data (background
// writeback held) and times `tiercache flush` in each writeback order,
// against the same random writes on the plain HDD model in arrival order
// (fio at QD32, writeback's queue depth; the drive's own queue and write
// cache reorder what they hold, as they do for writeback). The density is
// the bar's (64 MiB over 1 GiB, docs/MODELS.md "Random writes"): what
// sorting gains over arrival order grows with the blocks per track.
func (c *cacheRunner) s7RandDrain(ctx context.Context) (cliffCase, error) {
	z := c.sz.Cliff
	cc := cliffCase{title: fmt.Sprintf("drain of %d MiB of random 4 KiB dirty data over %d MiB (tiercache flush) / the same writes on the plain HDD model in arrival order, QD32", z.RandDrain>>20, z.MixRegion>>20),
		bar: 2.5, drain: true, seed: "target: writeback keeps up, ≥ 2.5x arrival order on random dirty data"}
	fill := job{Name: "s7-randdrain-fill", RW: "randwrite", BS: 4096, QD: 32, Size: z.MixRegion, IOSize: z.RandDrain, EndSync: true, Seed: 25, Metric: MetricMiBps}
	for ti, t := range c.cliffTargets() {
		srv, err := c.cliffServer(ctx, fmt.Sprintf("s7-randdrain-%d", ti), t, "")
		if err != nil {
			return cc, err
		}
		r := cliffRun{unit: "MB/s", p999Ms: math.NaN(), maxMs: math.NaN()}
		err = func() error {
			if t.bare() {
				t0 := time.Now()
				fr, err := c.fio(ctx, srv, fill, "s7-randdrain-hdd")
				if err != nil {
					return err
				}
				r.secs = time.Since(t0).Seconds()
				r.value = fr.res.BW / 1e6
				r.tc = "the random writes in arrival order (fio on the plain HDD model)"
				return nil
			}
			return c.fillAndDrain(ctx, srv, fill, fmt.Sprintf("s7-randdrain-%d", ti), &r, "writeback_rate_max=1")
		}()
		if derr := c.cliffDiscard(srv); err == nil {
			err = derr
		}
		if err != nil {
			return cc, err
		}
		c.cliffFigure("S7", t, cc.title, r)
		cc.runs = append(cc.runs, r)
	}
	return cc, nil
}

// s7Drain fills the cache with sequential dirty data (sequential_cutoff
// off, background writeback held) and times `tiercache flush` in each
// writeback order, against the plain HDD model's sequential write rate
// (seq, the first case's runs: its plain runs bracket the drains here).
func (c *cacheRunner) s7Drain(ctx context.Context, seq []cliffRun) (cliffCase, error) {
	z := c.sz.Cliff
	cc := cliffCase{title: fmt.Sprintf("drain of %d MiB of sequential dirty data (tiercache flush) / the plain HDD model's sequential write", z.DrainFill>>20), bar: 0.8, drain: true,
		seed: "target: writeback keeps up, ≥ 80 % of the drive's sequential rate"}
	fill := job{Name: "s7-drain-fill", RW: "write", BS: 1 << 20, QD: 4, Size: z.DrainFill, IOSize: z.DrainFill, EndSync: true, Metric: MetricMiBps}
	ref := func(r cliffRun) cliffRun {
		r.tc = "the sequential write above (the drive's sequential rate)"
		r.p999Ms, r.maxMs = math.NaN(), math.NaN()
		return r
	}
	cc.runs = append(cc.runs, ref(seq[0]))
	c.progress("S7", "HDD model "+cc.title, fmt.Sprintf("%.0f MB/s (the sequential write above)", seq[0].value))
	tgs := c.cliffTargets()
	for ti, t := range tgs[1 : len(tgs)-1] {
		srv, err := c.cliffServer(ctx, fmt.Sprintf("s7-drain-%d", ti), t, "")
		if err != nil {
			return cc, err
		}
		r := cliffRun{unit: "MB/s", p999Ms: math.NaN(), maxMs: math.NaN()}
		err = c.fillAndDrain(ctx, srv, fill, fmt.Sprintf("s7-drain-%d", ti), &r, "sequential_cutoff=0", "writeback_rate_max=1")
		if derr := c.cliffDiscard(srv); err == nil {
			err = derr
		}
		if err != nil {
			return cc, err
		}
		c.cliffFigure("S7", t, cc.title, r)
		cc.runs = append(cc.runs, r)
	}
	cc.runs = append(cc.runs, ref(seq[len(seq)-1]))
	c.progress("S7", hddAfter.name+" "+cc.title, fmt.Sprintf("%.0f MB/s (the sequential write above)", seq[len(seq)-1].value))
	return cc, nil
}

// fillAndDrain applies settings on srv (they hold background writeback),
// writes fill, then times `tiercache flush` and puts the rate it wrote back
// at (MB/s), its time and the counters into r.
func (c *cacheRunner) fillAndDrain(ctx context.Context, srv *server, fill job, name string, r *cliffRun, settings ...string) error {
	if err := c.set(ctx, srv, settings...); err != nil {
		return err
	}
	if _, err := c.fio(ctx, srv, fill, name); err != nil {
		return err
	}
	v0, _ := c.quickStats(ctx, srv)
	d, err := c.flush(ctx, srv)
	if err != nil {
		return err
	}
	v1, s1 := c.quickStats(ctx, srv)
	r.secs = d.Seconds()
	r.value = delta(v0, v1, "WritebackBytes") / d.Seconds() / 1e6
	r.tc = fmt.Sprintf("%s dirty before the flush, written back in %.1f s; ", mib(4096*v0["DirtyBlocks"]), d.Seconds()) + tcCounters(v0, v1, s1)
	return nil
}

// s7Fillrandom is db_bench fillrandom of a database ≥ 2x the cache on a
// fresh ext4 on each target.
func (c *cacheRunner) s7Fillrandom(ctx context.Context) (cliffCase, error) {
	z := c.sz.Cliff
	cc := cliffCase{title: fmt.Sprintf("db_bench fillrandom %d keys x 4 KiB (%s, %.1fx the cache) on ext4", z.RocksKeys, mib(float64(z.RocksKeys)*4096), float64(z.RocksKeys)*4096/float64(z.Cache))}
	t, terr := findAppTools()
	golden, err := c.fsGolden(ctx)
	if err != nil {
		return cc, err
	}
	// The ceiling: the same job with no device under it at all.
	ceiling := ""
	if terr == nil {
		dir := filepath.Join(c.workdir, "s7-rocks-ceiling")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return cc, err
		}
		r, err := c.fillrandom(ctx, t, nil, filepath.Join(dir, "rocks"), 0)
		if rerr := os.RemoveAll(dir); err == nil {
			err = rerr
		}
		if err != nil {
			return cc, err
		}
		ceiling = fmt.Sprintf("the same job in a directory of the workdir (%s), no NBD, no model, in this round: %s ops/s (the most a cache could reach here)", fsType(c.workdir), formatValue(r.value))
		c.add(Figure{Scenario: "S7", Target: "no device", Test: cc.title, Value: r.value, Unit: "ops/s", Note: ceiling})
		c.progress("S7", "no device "+cc.title, fmt.Sprintf("%s ops/s", formatValue(r.value)))
	}
	var limit time.Duration
	for ti, tg := range c.cliffTargets() {
		if terr != nil {
			r := cliffRun{skipped: terr.Error(), p999Ms: math.NaN(), maxMs: math.NaN(), unit: "ops/s"}
			cc.runs = append(cc.runs, r)
			c.progress("S7", tg.name+" "+cc.title, r.status())
			continue
		}
		r, err := c.onExt4(ctx, fmt.Sprintf("s7-rocks-%d", ti), tg, golden, func(srv *server, mnt string) (cliffRun, error) {
			v0, _ := c.quickStats(ctx, srv)
			l0 := c.writeLat(ctx, srv)
			lim := limit
			if tg.bare() {
				lim = 0
			}
			r, err := c.fillrandom(ctx, t, srv, filepath.Join(mnt, "rocks"), lim)
			if err == nil && !r.cut {
				err = c.syncFS(ctx, mnt)
			}
			if err == nil && !r.stalled {
				if !tg.bare() {
					v1, s1 := c.quickStats(ctx, srv)
					r.tc = tcCounters(v0, v1, s1)
				}
				r.tc = joinNote(r.tc, latText(l0, c.writeLat(ctx, srv)), r.rocksText())
			}
			return r, err
		})
		if err != nil {
			return cc, err
		}
		if ti == 0 {
			limit = c.capFor(r.secs)
			r.tc = joinNote(r.tc, ceiling)
		}
		c.cliffFigure("S7", tg, cc.title, r)
		cc.runs = append(cc.runs, r)
	}
	return cc, nil
}

// fsType names the file system dir is on ("tmpfs", "ext4"; "" if unknown).
func fsType(dir string) string {
	out, err := exec.Command("stat", "-f", "-c", "%T", dir).Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// ---------------------------------------------------------------- S8

func (c *cacheRunner) s8(ctx context.Context) error {
	z := c.sz.Cliff
	golden, err := c.fsGolden(ctx)
	if err != nil {
		return err
	}
	if _, err := exec.LookPath("nbdfuse"); err != nil || os.Geteuid() != 0 {
		why := "needs root and nbdfuse (ext4 through the kernel)"
		c.details = append(c.details, detail{Scenario: "S8", Title: "S8 history: not run", Rows: [][]string{{"Reason"}, {why}}})
		c.step += len(c.cliffTargets()) * 3
		fmt.Fprintf(c.out, "S8 skipped: %s\n", why)
		return nil
	}
	tools, toolErr := findAppTools()
	// The history overwrites a region past the file system's end, through
	// NBD (it is the earlier jobs' data; the way it arrives does not matter
	// here, and the kernel path would take 4x longer to fill the cache).
	hist := job{Name: "s8-history", Title: fmt.Sprintf("history: %d MiB of 4 KiB random overwrites of %d MiB (past the file system), QD16, fsync every 32", z.HistWrites>>20, z.HistRegion>>20),
		RW: "randwrite", BS: 4096, QD: 16, Offset: z.FS, Size: z.HistRegion, IOSize: z.HistWrites, FsyncN: 32, Seed: 8, Metric: MetricIOPS}
	seq := job{Name: "s8-seqwrite", Title: fmt.Sprintf("then: sequential write of a %d MiB file (%.3gx the cache), 1 MiB QD4", z.HistSeq>>20, float64(z.HistSeq)/float64(z.Cache)),
		RW: "write", BS: 1 << 20, QD: 4, Size: z.HistSeq, IOSize: z.HistSeq, EndSync: true, Metric: MetricMiBps}
	rocksTitle := fmt.Sprintf("then: db_bench fillrandom %d keys x 4 KiB (%s)", z.RocksKeys, mib(float64(z.RocksKeys)*4096))
	cases := []cliffCase{{title: hist.Title}, {title: seq.Title}, {title: rocksTitle}}
	var limSeq, limRocks time.Duration
	for ti, tg := range c.cliffTargets() {
		var runs [3]cliffRun
		reported := 0 // runs whose progress line is out
		_, err := c.onExt4(ctx, fmt.Sprintf("s8-%d", ti), tg, golden, func(srv *server, mnt string) (cliffRun, error) {
			h := hist
			lim := time.Duration(0)
			if tg.bare() {
				h.Runtime = z.HistHDDTime // in place: how many it gets does not change what follows
			} else {
				lim = max(z.CapMin, 3*z.HistHDDTime)
			}
			v0, _ := c.quickStats(ctx, srv)
			r, err := c.cliffFio(ctx, srv, h, fmt.Sprintf("s8-%d", ti), lim)
			if err != nil {
				return r, err
			}
			if r.stalled {
				runs[0] = r
				runs[1].skipped, runs[2].skipped = "the server stalled before", "the server stalled before"
				return r, nil
			}
			v1, s1 := c.quickStats(ctx, srv)
			if !tg.bare() {
				r.tc = tcCounters(v0, v1, s1)
			}
			r.unit = "MB/s"
			runs[0] = r
			c.progress("S8", tg.name+" history", fmt.Sprintf("%.1f MB/s, %s; %s", r.value, r.status(), r.tc))
			reported = 1

			s := seq
			s.File = filepath.Join(mnt, "sequential")
			lim = limSeq
			if tg.bare() {
				lim = 0
			}
			r, err = c.cliffFio(ctx, srv, s, fmt.Sprintf("s8-%d", ti), lim)
			if err != nil {
				return r, err
			}
			if ti == 0 {
				limSeq = c.capFor(r.secs)
			} else if !tg.bare() && !r.stalled {
				v2, s2 := c.quickStats(ctx, srv)
				r.tc = tcCounters(v1, v2, s2)
				v1 = v2
			}
			runs[1] = r
			c.progress("S8", tg.name+" sequential write after the history", fmt.Sprintf("%.1f MB/s, p99.9 %s, %s; %s", r.value, msText(r.p999Ms), r.status(), r.tc))
			reported = 2
			if r.stalled {
				runs[2].skipped = "the server stalled before"
				return r, nil
			}
			if toolErr != nil {
				runs[2].skipped = toolErr.Error()
				return r, nil
			}
			l0 := c.writeLat(ctx, srv)
			lim = limRocks
			if tg.bare() {
				lim = 0
			}
			r, err = c.fillrandom(ctx, tools, srv, filepath.Join(mnt, "rocks"), lim)
			if err == nil && !r.cut {
				err = c.syncFS(ctx, mnt)
			}
			if err != nil {
				return r, err
			}
			l1 := c.writeLat(ctx, srv)
			if ti == 0 {
				limRocks = c.capFor(r.secs)
			} else if !tg.bare() && !r.stalled {
				v2, s2 := c.quickStats(ctx, srv)
				r.tc = tcCounters(v1, v2, s2)
				if tg.order == "epoch" { // lba order never reports the backing device consistent
					if u := c.untilConsistent(ctx, srv, z.ConsistentWait); u != "" {
						r.tc += "; " + u
					}
				}
			}
			if !r.stalled {
				r.tc = joinNote(r.tc, latText(l0, l1), r.rocksText())
			}
			runs[2] = r
			return r, nil
		})
		if err != nil {
			return err
		}
		for i := range runs {
			if runs[i].skipped != "" {
				runs[i].p999Ms, runs[i].maxMs = math.NaN(), math.NaN()
			}
			if i >= reported {
				c.progress("S8", tg.name+" "+cases[i].title, fmt.Sprintf("%s %s, p99.9 %s, %s", formatValue(runs[i].value), runs[i].unit, msText(runs[i].p999Ms), runs[i].status()))
			}
			c.cliffFigure("S8", tg, cases[i].title, runs[i])
			cases[i].runs = append(cases[i].runs, runs[i])
		}
	}
	return c.cliffReport("S8", fmt.Sprintf("S8 history: a cache already full of earlier jobs' dirty data and superseded versions (%d MiB SATA SSD model cache), ext4 via nbdfuse + loop", z.Cache>>20), cases,
		[]string{fmt.Sprintf("Each target runs the three jobs in order on one file system (a fresh ext4 copied from a golden image). The history on the plain HDD model is capped at %v (it writes in place); on tiercache it runs to its %d MiB. The sequential write and fillrandom on tiercache are cut at the cap shown.", z.HistHDDTime, z.HistWrites>>20)})
}

// ---------------------------------------------------------------- shared

// fsGolden is an empty ext4 of the cliff size (mkfs on a RAM file), built
// once per suite run and copied as each kernel-path target's backing data.
func (c *cacheRunner) fsGolden(ctx context.Context) (string, error) {
	if c.cliffGolden != "" {
		return c.cliffGolden, nil
	}
	dir := filepath.Join(c.workdir, "cliff-golden")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	img := filepath.Join(dir, "ext4.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		return "", err
	}
	if err := os.Truncate(img, c.sz.Cliff.FS); err != nil {
		return "", err
	}
	if _, err := c.cmd(ctx, 5*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", img); err != nil {
		return "", err
	}
	c.cliffGolden = img
	return img, nil
}

// onExt4 starts target tg over a copy of golden, mounts its ext4 through the
// kernel and runs f; everything is undone afterwards.
func (c *cacheRunner) onExt4(ctx context.Context, tag string, tg cliffTarget, golden string, f func(srv *server, mnt string) (cliffRun, error)) (r cliffRun, err error) {
	srv, err := c.cliffServer(ctx, tag, tg, golden)
	if err != nil {
		return r, err
	}
	dir := filepath.Join(c.workdir, tag)
	var u undoStack
	u.push(func() error { return os.RemoveAll(dir) })
	u.push(func() error { return c.discard(srv) })
	defer func() {
		if uerr := u.run(); err == nil && uerr != nil && !r.stalled {
			err = uerr
		}
	}()
	mnt, err := c.kernelFS(ctx, &u, srv, dir, c.sz.Cliff.FS)
	if err != nil {
		return r, err
	}
	return f(srv, mnt)
}

// kernelFS mounts the ext4 at the start of srv's export the way
// internal/interop's TestKernelExt4 does: nbdfuse exposes the export as a
// file, losetup --direct-io=on makes it a block device (size bytes of it),
// ext4 is mounted from it. The undo steps go on u.
func (c *cacheRunner) kernelFS(ctx context.Context, u *undoStack, srv *server, dir string, size int64) (string, error) {
	fuseDir, mnt := filepath.Join(dir, "fuse"), filepath.Join(dir, "mnt")
	if err := os.MkdirAll(fuseDir, 0o700); err != nil {
		return "", err
	}
	pidfile := filepath.Join(dir, "nbdfuse.pid")
	argv := []string{"nbdfuse", "-P", pidfile, filepath.Join(fuseDir, "disk"), "nbd+unix:///" + srv.export + "?socket=" + srv.sock}
	c.r.noteCommand(argv)
	fuse, err := startProcess("nbdfuse", argv, filepath.Join(dir, "nbdfuse.log"))
	if err != nil {
		return "", err
	}
	u.push(func() error {
		_, _ = c.cmd(context.Background(), 30*time.Second, "fusermount3", "-u", fuseDir)
		_ = fuse.stop(10 * time.Second)
		return nil
	})
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(pidfile); err == nil {
			break
		}
		if fuse.exited() || time.Now().After(deadline) {
			return "", fmt.Errorf("nbdfuse not ready: %s", fuse.logTail())
		}
	}
	return mnt, c.mountExt4(ctx, u, filepath.Join(fuseDir, "disk"), size, true, false, mnt)
}

var (
	dbProgressRe = regexp.MustCompile(`\((\d+),(\d+)\) ops and`)
	dbP999Re     = regexp.MustCompile(`P99\.9: ([0-9.]+)`)
	dbMaxRe      = regexp.MustCompile(`(?m)^Min: [0-9.]+\s+Median: [0-9.]+\s+Max: ([0-9.]+)`)
)

// fillrandom runs db_bench fillrandom (4 KiB values, no sync: RocksDB
// syncs its tables and manifest) into a new database in dir, cut at limit
// when limit > 0.
func (c *cacheRunner) fillrandom(ctx context.Context, t appTools, srv *server, dir string, limit time.Duration) (cliffRun, error) {
	z := c.sz.Cliff
	r := cliffRun{unit: "ops/s", p999Ms: math.NaN(), maxMs: math.NaN(), cap: limit}
	argv := []string{t.dbBench, "--db=" + dir, "--benchmarks=fillrandom", "--num=" + strconv.Itoa(z.RocksKeys), "--value_size=4096", "--key_size=16",
		"--compression_type=none", "--threads=1", "--seed=1", "--histogram=1", "--stats_interval_seconds=1", "--statistics=1"}
	c.r.noteCommand(argv)
	timeout := limit
	if timeout <= 0 {
		timeout = 15 * time.Minute
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	wd := c.watch(srv, limit)
	cmd := exec.CommandContext(rctx, argv[0], argv[1:]...)
	cmd.WaitDelay = 5 * time.Second
	c0, ok0 := serverCPU(srv)
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	r.secs = time.Since(t0).Round(100 * time.Millisecond).Seconds()
	r.cpuSince(srv, c0, ok0)
	stalled := wd.stop()
	if ctx.Err() != nil {
		return r, ctx.Err()
	}
	if m := dbBenchR.FindSubmatch(out); m != nil && err == nil {
		r.value, _ = strconv.ParseFloat(string(m[3]), 64)
		if m := dbP999Re.FindSubmatch(out); m != nil {
			v, _ := strconv.ParseFloat(string(m[1]), 64)
			r.p999Ms = v / 1000
		}
		if m := dbMaxRe.FindSubmatch(out); m != nil {
			v, _ := strconv.ParseFloat(string(m[1]), 64)
			r.maxMs = v / 1000
		}
		r.flushBytes, r.compactBytes = dbStat(out, "rocksdb.flush.write.bytes"), dbStat(out, "rocksdb.compact.write.bytes")
		r.stallSecs = dbStat(out, "rocksdb.stall.micros") / 1e6
		r.doneOf, r.wantOf = strconv.Itoa(z.RocksKeys), strconv.Itoa(z.RocksKeys)
		return r, nil
	}
	if rctx.Err() == nil && !stalled {
		return r, fmt.Errorf("%s: %v\n%s", shellJoin(argv), err, tail(string(out), 1500))
	}
	// Cut (or stalled): the last progress line says how far it got.
	done := 0.0
	if ms := dbProgressRe.FindAllSubmatch(out, -1); len(ms) > 0 {
		done, _ = strconv.ParseFloat(string(ms[len(ms)-1][2]), 64)
	}
	r.value = done / r.secs
	r.cut, r.stalled = true, stalled
	r.doneOf, r.wantOf = fmt.Sprintf("%.0f keys", done), fmt.Sprintf("%d", z.RocksKeys)
	return r, nil
}

// syncFS writes out what the file system at mnt still holds dirty, so
// that the counters read after a job count all of its writes: closing its
// database, RocksDB truncates its last log file, which makes ext4 start
// writing that file's data (the memtable's tail, up to a memtable of
// unsynced log) asynchronously, after db_bench has exited.
func (c *cacheRunner) syncFS(ctx context.Context, mnt string) error {
	_, err := c.cmd(ctx, time.Minute, "sync", "-f", mnt)
	return err
}

// dbStat is the COUNT of the ticker name in db_bench --statistics output
// (0 when absent).
func dbStat(out []byte, name string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` COUNT : (\d+)`).FindSubmatch(out)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// cliffFigure records one run and reports it.
func (c *cacheRunner) cliffFigure(scen string, t cliffTarget, title string, r cliffRun) {
	note := joinNote(r.status(), r.note())
	f := Figure{Scenario: scen, Target: t.name, Test: title, Value: r.value, Unit: r.unit, Note: note}
	if !math.IsNaN(r.p999Ms) {
		f.LatP999Us, f.LatMaxUs = r.p999Ms*1000, r.maxMs*1000
	}
	c.add(f)
	if scen == "S7" {
		c.progress(scen, t.name+" "+title, fmt.Sprintf("%s %s, p99.9 %s, %s", formatValue(r.value), r.unit, msText(r.p999Ms), note))
	}
}

// joinNote joins the non-empty parts of a run's note with "; ".
func joinNote(parts ...string) string {
	var out []string
	for _, p := range parts {
		if p != "" {
			out = append(out, p)
		}
	}
	return strings.Join(out, "; ")
}

func msText(ms float64) string {
	if math.IsNaN(ms) {
		return dash
	}
	if ms >= 1000 {
		return fmt.Sprintf("%.1f s", ms/1000)
	}
	return fmt.Sprintf("%.1f ms", ms)
}

// cliffReport writes a scenario's table, checks and chart.
func (c *cacheRunner) cliffReport(scen, title string, cases []cliffCase, notes []string) error {
	rows := [][]string{{"Job", "Target", "Result", "x HDD model", "p99.9 write", "Slowest write", "Run", "What tiercache did"}}
	var groups []string
	tgs := c.cliffTargets()
	ratios := make([][]float64, len(tgs)-2)
	for ci, cc := range cases {
		base := cliffBase(cc.runs)
		before, after := cc.runs[0], cc.runs[len(cc.runs)-1]
		groups = append(groups, fmt.Sprintf("%s.%d", scen, ci+1))
		for ti, r := range cc.runs {
			// A plain run's ratio is to the mean of the two: how far the
			// machine moved the same job within the round.
			ratio := ratioOf(r.value, base.value)
			if r.skipped != "" || base.skipped != "" {
				ratio = math.NaN()
			}
			res := dash
			if r.skipped == "" {
				res = formatValue(r.value) + " " + r.unit
			}
			run := r.status()
			if r.cap > 0 && !r.cut && !r.stalled {
				run = fmt.Sprintf("done in %.1f s (cap %v)", r.secs, r.cap)
			} else if tgs[ti].bare() && r.skipped == "" {
				run = fmt.Sprintf("done in %.1f s", r.secs)
			}
			rows = append(rows, []string{cc.title, tgs[ti].name, res, ratioText(ratio), msText(r.p999Ms), msText(r.maxMs), run, r.note()})
			if tgs[ti].bare() {
				continue
			}
			ratios[ti-1] = append(ratios[ti-1], ratio)
			what := fmt.Sprintf("%s, %s / HDD model", cc.title, tgs[ti].name)
			// A stream that bypasses the cache is the plain device plus
			// tiercache's pass-through: 1.00 at best, so the bar allows
			// the 5 % a side-by-side run on this machine moves (as S2's
			// bypassed reads).
			bar := cmp.Or(cc.bar, 0.95)
			met := yesNo(ratio >= bar)
			if math.IsNaN(ratio) {
				met = dash
			}
			c.checks = append(c.checks, Check{Scenario: scen, What: what, Seed: cmp.Or(cc.seed, "target: never slower than no cache (1.0x, less 5 % noise)"),
				Ours:  fmt.Sprintf("%s vs %s %s (%s; HDD model before %s, after %s)", formatValue(r.value), formatValue(base.value), r.unit, run, formatValue(before.value), formatValue(after.value)),
				Ratio: ratio, Bar: fmt.Sprintf("≥ %.2g", bar), Met: met})
			if cc.drain {
				continue
			}
			p := r.p999Ms / 1000
			met = yesNo(p <= 1)
			if math.IsNaN(p) {
				met = dash
				if r.stalled {
					met = "no"
				}
			}
			c.checks = append(c.checks, Check{Scenario: scen, What: fmt.Sprintf("%s, %s: p99.9 write latency / 1 s", cc.title, tgs[ti].name), Seed: "target: no write waits longer than 1 s",
				Ours: fmt.Sprintf("p99.9 %s, slowest %s (HDD model: %s, %s)", msText(r.p999Ms), msText(r.maxMs), msText(base.p999Ms), msText(base.maxMs)), Ratio: p, Bar: "≤ 1", Met: met})
		}
	}
	c.details = append(c.details, detail{Scenario: scen, Title: title, Rows: rows, Notes: notes})
	var series []string
	for _, t := range tgs[1 : len(tgs)-1] {
		series = append(series, t.name+" / HDD")
	}
	return chartGroupsLabelled(c.chartPath(strings.ToLower(scen)+".png"), scen+": tiercache / the plain HDD model (≥ 1: never slower than no cache)", "x HDD model",
		groups, series, ratios, []float64{1}, true)
}

// ---------------------------------------------------------------- S9

// s9 warms a fresh cache under pure 4 KiB random reads and under a 70/30
// read/write mix over the same working set, and samples the read hit
// ratio (bytes served from the cache / bytes read, per interval).
func (c *cacheRunner) s9(ctx context.Context) error {
	z := c.sz.Cliff
	jobs := []job{
		{Name: "s9-randread", Title: "4 KiB random reads QD16", RW: "randread", BS: 4096, QD: 16, Size: z.WarmRegion, Runtime: z.WarmTime, Seed: 9, Metric: MetricIOPS},
		{Name: "s9-randrw-70-30", Title: "4 KiB random 70 % reads / 30 % writes QD16", RW: "randrw", MixRead: 70, BS: 4096, QD: 16, Size: z.WarmRegion, Runtime: z.WarmTime, Seed: 9, Metric: MetricIOPS},
	}
	rows := [][]string{{"Load", "IOPS", "Hit ratio, last interval", "Time to 50 % hits", "Time to 90 % hits", "Read misses", "Promoted", "Promoted / misses"}}
	var lines []series
	for ji, j := range jobs {
		srv, err := c.cached(ctx, fmt.Sprintf("s9-%d", ji), "ssd", "hdd", "writeback", z.Cache)
		if err != nil {
			return err
		}
		pts, fr, v0, v1, err := c.warmRun(ctx, srv, j)
		_ = c.discard(srv)
		if err != nil {
			return err
		}
		lines = append(lines, series{name: j.Title, pts: pts})
		misses, promoted := delta(v0, v1, "ReadMissOps"), delta(v0, v1, "PromoteOps")
		last := math.NaN()
		if len(pts) > 0 {
			last = pts[len(pts)-1].Y
		}
		rows = append(rows, []string{j.Title, formatValue(fr.res.IOPS), pct(last), timeTo(pts, 0.5), timeTo(pts, 0.9), fmt.Sprintf("%.0f", misses), fmt.Sprintf("%.0f", promoted), pct(ratioOf(promoted, misses))})
		c.add(Figure{Scenario: "S9", Target: "tiercache", Test: j.Title, Value: fr.res.IOPS, Unit: "IOPS",
			Note: fmt.Sprintf("hit ratio in the last interval %s, 50 %% at %s, 90 %% at %s; %.0f read misses, %.0f promoted", pct(last), timeTo(pts, 0.5), timeTo(pts, 0.9), misses, promoted)})
		c.progress("S9", j.Title, fmt.Sprintf("%.0f IOPS; hit ratio at the end %s, 50 %% at %s; %.0f of %.0f misses promoted", fr.res.IOPS, pct(last), timeTo(pts, 0.5), promoted, misses))
	}
	c.details = append(c.details, detail{Scenario: "S9", Title: fmt.Sprintf("S9 warm-up: a fresh %d MiB SATA SSD model cache in front of the HDD model, %d MiB working set, %v per load", z.Cache>>20, z.WarmRegion>>20, z.WarmTime), Rows: rows,
		Notes: []string{fmt.Sprintf("Hit ratio: ReadHitBytes / ReadBytes of `tiercache stats` per %v interval (the writes of the mix also put blocks in the cache, which later reads hit).", z.WarmSample)}})
	return chartLines(c.chartPath("s9.png"), "S9: read hit ratio over time while a fresh cache warms", "seconds", "hit ratio", lines)
}

type series struct {
	name string
	pts  plotter.XYs
}

// timeTo returns when the hit ratio first reached x.
func timeTo(pts plotter.XYs, x float64) string {
	for _, p := range pts {
		if p.Y >= x {
			return fmt.Sprintf("%.0f s", p.X)
		}
	}
	return "not reached"
}

// warmRun runs j (time-based) on srv and samples the hit ratio.
func (c *cacheRunner) warmRun(ctx context.Context, srv *server, j job) (plotter.XYs, fioRun, map[string]float64, map[string]float64, error) {
	v0, _, err := c.stats(ctx, srv)
	if err != nil {
		return nil, fioRun{}, nil, nil, err
	}
	type done struct {
		fr  fioRun
		err error
	}
	dc := make(chan done, 1)
	t0 := time.Now()
	go func() {
		fr, err := c.fio(ctx, srv, j, "s9")
		dc <- done{fr, err}
	}()
	var pts plotter.XYs
	prev := v0
	tick := time.NewTicker(c.sz.Cliff.WarmSample)
	defer tick.Stop()
	for {
		select {
		case d := <-dc:
			if d.err != nil {
				return nil, d.fr, nil, nil, d.err
			}
			v1, _, err := c.stats(ctx, srv)
			return pts, d.fr, v0, v1, err
		case <-tick.C:
			v, _, err := c.stats(ctx, srv)
			if err != nil {
				continue // the next sample will do
			}
			if rb := delta(prev, v, "ReadBytes"); rb > 0 {
				pts = append(pts, plotter.XY{X: time.Since(t0).Seconds(), Y: delta(prev, v, "ReadHitBytes") / rb})
			}
			prev = v
		}
	}
}

// chartLines draws one line per series.
func chartLines(path, title, xlabel, ylabel string, ss []series) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xlabel
	p.Y.Label.Text = ylabel
	p.Y.Min, p.Y.Max = 0, 1.05
	p.Legend.Top = false // bottom right: the lines rise from the bottom left
	p.Legend.Left = false
	for i, s := range ss {
		if len(s.pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(s.pts)
		if err != nil {
			return err
		}
		l.LineStyle.Width = vg.Points(1.5)
		l.LineStyle.Color = palette[i%len(palette)]
		p.Add(l)
		p.Legend.Add(s.name, l)
	}
	if err := savePNG(p, 7*vg.Inch, path); err != nil {
		return errors.Join(fmt.Errorf("chart %s", path), err)
	}
	return nil
}

// s7Steps counts S7's progress steps: every case on every target, and
// fillrandom's run with no device.
func (c *cacheRunner) s7Steps() int {
	n := 0
	for _, j := range s7JobNames {
		if (c.s7Runs(j) || j == "seqwrite" && c.s7Runs("drain")) && c.s7Sized(j) {
			n += len(c.cliffTargets())
		}
	}
	if c.s7Runs("fillrandom") {
		n++
	}
	return n
}
