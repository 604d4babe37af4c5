package bench

// S6: applications on ext4 through the kernel, as the published seeds ran
// them: pgbench TPC-B (bcache's article: none/writethrough/writearound vs
// writeback) and RocksDB's db_bench (bcachefs: cache vs slow disk).
//
// Each target is tiercache with an SSD-model cache in front of the HDD
// model, reached the way internal/interop's TestKernelExt4 reaches it:
// nbdfuse exposes the export as a file, losetup (direct I/O) makes it a
// block device, ext4 is mounted on it. The PostgreSQL cluster (initdb,
// pgbench -i) is built once per run on a RAM-backed image (a golden
// image) and copied as each target's backing data, so every mode starts
// from the same bytes and the slow init does not run on the HDD model four
// times. RocksDB's data is written through the target itself, as in the
// seed, where the database was written through the cache.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// appTools are the programs S6 runs.
type appTools struct {
	initdb, pgctl, pgbench, psql, dbBench string
}

// findAppTools locates the tools, or says what is missing and how to get
// it. PostgreSQL's server programs live in /usr/lib/postgresql/N/bin on
// Debian, outside PATH.
func findAppTools() (appTools, error) {
	var t appTools
	var missing []string
	look := func(name string, dirs ...string) string {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
		for _, d := range dirs {
			ms, _ := filepath.Glob(filepath.Join(d, name))
			if len(ms) > 0 {
				return ms[len(ms)-1]
			}
		}
		missing = append(missing, name)
		return ""
	}
	pgBin := "/usr/lib/postgresql/*/bin"
	t.initdb = look("initdb", pgBin)
	t.pgctl = look("pg_ctl", pgBin)
	t.pgbench = look("pgbench", pgBin)
	t.psql = look("psql", pgBin)
	t.dbBench = look("db_bench")
	for _, n := range []string{"nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "mount", "umount", "runuser"} {
		look(n)
	}
	if len(missing) > 0 {
		return t, fmt.Errorf("missing %s (scripts/install-deps.sh --bench installs postgresql, rocksdb-tools, libnbd-bin, fuse3)", strings.Join(missing, ", "))
	}
	if os.Geteuid() != 0 {
		return t, errors.New("not root: losetup and mount need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return t, fmt.Errorf("no /dev/fuse: %w", err)
	}
	return t, nil
}

// appSizes are S6's sizes (part of cacheSizes).
type appSizes struct {
	FS        int64         // the ext4 file system, at the start of the HDD model's disk
	Cache     int64         // the SSD model cache
	PgScale   int           // pgbench -s (seed: 10)
	PgClients int           // pgbench -c (seed: 10)
	PgTime    time.Duration // pgbench -T per mode
	RocksKeys int           // keys written with fillseq before readrandom and overwrite
	RocksTime time.Duration // db_bench --duration per benchmark
}

func (a appSizes) line() string {
	return fmt.Sprintf("S6 ext4 %d MiB, cache %d MiB, pgbench scale %d with %d clients for %v per mode, db_bench %d keys and %v per benchmark",
		a.FS>>20, a.Cache>>20, a.PgScale, a.PgClients, a.PgTime, a.RocksKeys, a.RocksTime)
}

// s6Targets are the targets S6 knows (--s6): the cache modes over the HDD
// model; writeback once more in lba writeback order (the default order is
// epoch), for the cost of epoch order on a real overwrite workload; and
// writeback over an object-store image instead of the HDD model (target:
// within 10 % of writeback over the HDD model, the cache warm).
var s6Targets = []string{"none", "writethrough", "writearound", "writeback", "writeback-lba", "writeback-s3"}

// s6Modes are S6's targets: --s6's, else the cache modes, and with
// --s6-lba writeback-lba (no published seed, ~45 s a round: not run by
// default).
func (c *cacheRunner) s6Modes() []string {
	m := []string{"none", "writethrough", "writearound", "writeback"}
	if len(c.s6targets) > 0 {
		m = slices.Clone(c.s6targets)
	}
	if c.s6lba && !slices.Contains(m, "writeback-lba") {
		m = append(m, "writeback-lba")
	}
	return m
}

// s6Rocks reports whether S6 runs db_bench: on none and on writeback,
// when both are targets.
func (c *cacheRunner) s6Rocks() bool {
	m := c.s6Modes()
	return slices.Contains(m, "none") && slices.Contains(m, "writeback")
}

// s6Steps is S6's progress steps: golden image, then per mode pgbench and,
// for none and writeback, three db_bench runs.
func (c *cacheRunner) s6Steps() int {
	n := 1 + len(c.s6Modes())
	if c.s6Rocks() {
		n += 2 * 3
	}
	return n
}

// cmd runs argv with a timeout and returns its combined output.
func (c *cacheRunner) cmd(ctx context.Context, timeout time.Duration, argv ...string) (string, error) {
	c.r.noteCommand(argv)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s: %v\n%s", shellJoin(argv), err, tail(string(out), 1500))
	}
	return string(out), nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// undoStack undoes set-up steps in reverse order.
type undoStack []func() error

func (u *undoStack) push(f func() error) { *u = append(*u, f) }

func (u *undoStack) run() error {
	var errs []error
	for i := len(*u) - 1; i >= 0; i-- {
		if err := (*u)[i](); err != nil {
			errs = append(errs, err)
		}
	}
	*u = nil
	return errors.Join(errs...)
}

// pgCluster is a PostgreSQL server on a mounted file system, run as the
// postgres user (the server refuses root).
type pgCluster struct {
	c    *cacheRunner
	t    appTools
	data string // data directory
	sock string // unix socket directory
}

func (p pgCluster) pgctl(ctx context.Context, args ...string) error {
	argv := append([]string{"runuser", "-u", "postgres", "--", p.t.pgctl, "-D", p.data, "-w"}, args...)
	_, err := p.c.cmd(ctx, 2*time.Minute, argv...)
	return err
}

func (p pgCluster) start(ctx context.Context) error {
	// track_wal_io_timing: pg_stat_wal times the WAL fdatasyncs (walStats).
	return p.pgctl(ctx, "-l", filepath.Join(p.sock, "postgres.log"), "-o", "-k "+p.sock+" -c listen_addresses='' -c track_wal_io_timing=on", "start")
}

// sql runs one statement with psql and returns its unaligned output.
func (p pgCluster) sql(ctx context.Context, q string) (string, error) {
	out, err := p.c.cmd(ctx, time.Minute, p.t.psql, "-h", p.sock, "-U", "postgres", "-qAt", "-c", q, "postgres")
	return strings.TrimSpace(out), err
}

// walStats returns the WAL fdatasyncs since the last reset of pg_stat_wal
// and their mean time in ms. PostgreSQL issues them one at a time (group
// commit), so with the count they say what bounds the TPS: see
// docs/BENCHMARKS.md, "Reading the results".
func (p pgCluster) walStats(ctx context.Context) (syncs int, meanMs float64, err error) {
	out, err := p.sql(ctx, "select wal_sync, wal_sync_time from pg_stat_wal")
	if err != nil {
		return 0, 0, err
	}
	f := strings.Split(out, "|")
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("pg_stat_wal: unexpected output %q", out)
	}
	if syncs, err = strconv.Atoi(f[0]); err != nil {
		return 0, 0, fmt.Errorf("pg_stat_wal: %q: %w", out, err)
	}
	total, err := strconv.ParseFloat(f[1], 64)
	if err != nil {
		return 0, 0, fmt.Errorf("pg_stat_wal: %q: %w", out, err)
	}
	return syncs, total / float64(max(syncs, 1)), nil
}

// stop stops the server, if it runs, without a shutdown checkpoint: the
// image is thrown away after it.
func (p pgCluster) stop(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(p.data, "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return p.pgctl(ctx, "-m", "immediate", "stop")
}

// mountExt4 makes loop a block device over file (sizelimit bytes) and
// mounts ext4 from it on mnt, mkfs first when mkfs is set.
func (c *cacheRunner) mountExt4(ctx context.Context, u *undoStack, file string, size int64, direct, mkfs bool, mnt string) error {
	args := []string{"losetup", "--find", "--show", "--sizelimit", strconv.FormatInt(size, 10)}
	if direct {
		args = append(args, "--direct-io=on")
	}
	out, err := c.cmd(ctx, 30*time.Second, append(args, file)...)
	if err != nil {
		return err
	}
	loop := strings.TrimSpace(out)
	u.push(func() error { _, err := c.cmd(context.Background(), 30*time.Second, "losetup", "-d", loop); return err })
	if mkfs {
		if _, err := c.cmd(ctx, 5*time.Minute, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return err
	}
	if _, err := c.cmd(ctx, time.Minute, "mount", "-t", "ext4", "-o", "noatime", loop, mnt); err != nil {
		return err
	}
	u.push(func() error {
		// Lazy: a server killed under a busy file system must not hang the
		// suite; nothing is measured after it.
		_, err := c.cmd(context.Background(), 2*time.Minute, "umount", "-l", mnt)
		return err
	})
	return nil
}

// appGolden builds the golden image: ext4 with a PostgreSQL cluster
// initialised for pgbench at the configured scale. It is built once per
// suite run and kept for the later rounds (each mode copies it, so it is
// never written after it is built): every round starts from the same bytes,
// and the ~20 s build is not repeated. RunCache removes it at the end.
func (c *cacheRunner) appGolden(ctx context.Context, t appTools) (string, bool, error) {
	if c.golden != "" {
		return c.golden, true, nil
	}
	img, err := c.buildGolden(ctx, t)
	if err != nil {
		return "", false, err
	}
	c.golden = img
	return img, false, nil
}

func (c *cacheRunner) buildGolden(ctx context.Context, t appTools) (string, error) {
	a := c.sz.Apps
	dir := filepath.Join(c.workdir, "s6-golden")
	c.goldenDir = dir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	img := filepath.Join(dir, "golden.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		return "", err
	}
	if err := os.Truncate(img, a.FS); err != nil {
		return "", err
	}
	var u undoStack
	mnt := filepath.Join(dir, "mnt")
	err := func() error {
		if err := c.mountExt4(ctx, &u, img, a.FS, false, true, mnt); err != nil {
			return err
		}
		pg, err := c.newPG(dir, mnt)
		if err != nil {
			return err
		}
		pg.t = t
		if _, err := c.cmd(ctx, 5*time.Minute, "runuser", "-u", "postgres", "--", t.initdb, "-D", pg.data, "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
			return err
		}
		if err := pg.start(ctx); err != nil {
			return err
		}
		u.push(func() error { return pg.pgctl(context.Background(), "-m", "fast", "stop") })
		_, err = c.cmd(ctx, 10*time.Minute, t.pgbench, "-h", pg.sock, "-U", "postgres", "-i", "-q", "-s", strconv.Itoa(a.PgScale), "postgres")
		return err
	}()
	if uerr := u.run(); err == nil {
		err = uerr
	}
	return img, err
}

// newPG prepares the data and socket directories of a cluster on mnt, owned
// by postgres, with dir (holding the socket) reachable by it.
func (c *cacheRunner) newPG(dir, mnt string) (pgCluster, error) {
	pg := pgCluster{c: c, data: filepath.Join(mnt, "pg"), sock: filepath.Join(dir, "pgsock")}
	for _, d := range []string{pg.data, pg.sock} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return pg, err
		}
		if _, err := c.cmd(context.Background(), 10*time.Second, "chown", "postgres:", d); err != nil {
			return pg, err
		}
	}
	// Path traversal for the postgres user.
	for d := dir; len(d) > 1 && strings.HasPrefix(d, c.workdir); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			return pg, err
		}
	}
	return pg, os.Chmod(mnt, 0o755)
}

var (
	tpsRe    = regexp.MustCompile(`(?m)^tps = ([0-9.]+) \(without initial connection time\)`)
	pgLatRe  = regexp.MustCompile(`(?m)^latency average = ([0-9.]+) ms`)
	pgTxRe   = regexp.MustCompile(`(?m)^number of transactions actually processed: (\d+)`)
	dbBenchR = regexp.MustCompile(`(?m)^(\w+)\s*:\s*([0-9.]+) micros/op (\d+) ops/sec`)
)

// s6Result is one mode's figures.
type s6Result struct {
	tps, latMs float64
	tx         int
	rocks      map[string]float64 // db_bench benchmark → ops/s
	hits       string             // what tiercache served during the measured runs
}

func (c *cacheRunner) s6(ctx context.Context) error {
	t, err := findAppTools()
	if err != nil {
		// Say exactly why, as a row of the report, and go on with the rest.
		c.details = append(c.details, detail{Scenario: "S6", Title: "S6 applications (pgbench, db_bench) on ext4 through the kernel: not run",
			Rows: [][]string{{"Reason"}, {err.Error()}}})
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B, writeback / none", Seed: "bcache 2,251–2,742 vs 885–946 TPS (2.4–2.9x)",
			Ours: "not run: " + err.Error(), Ratio: math.NaN(), Bar: "–", Met: "–"})
		c.step += c.s6Steps()
		fmt.Fprintf(c.out, "S6 skipped: %v\n", err)
		return nil
	}
	if err := c.s6Run(ctx, t); err != nil {
		if c.quick || ctx.Err() != nil {
			return err
		}
		// A full run keeps the other scenarios' results and says why S6
		// has none.
		c.details = append(c.details, detail{Scenario: "S6", Title: "S6 applications (pgbench, db_bench) on ext4 through the kernel: failed",
			Rows: [][]string{{"Error"}, {err.Error()}}})
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B, writeback / none", Seed: "bcache 2,251–2,742 vs 885–946 TPS (2.4–2.9x)",
			Ours: "failed: " + err.Error(), Ratio: math.NaN(), Bar: "–", Met: "–"})
		fmt.Fprintf(c.out, "S6 failed: %v\n", err)
	}
	return nil
}

// s6Run runs S6 with the tools found.
func (c *cacheRunner) s6Run(ctx context.Context, t appTools) error {
	a := c.sz.Apps
	t0 := time.Now()
	golden, reused, err := c.appGolden(ctx, t)
	if err != nil {
		return fmt.Errorf("golden image: %w", err)
	}
	if reused {
		c.progress("S6", "golden image", "the first round's, reused")
	} else {
		c.progress("S6", "golden image", fmt.Sprintf("ext4 %d MiB with pgbench scale %d, built in %.0f s", a.FS>>20, a.PgScale, time.Since(t0).Seconds()))
	}
	res := map[string]*s6Result{}
	order := c.s6Modes()
	if c.round%2 == 0 {
		// Interleaved rounds: every other one runs the targets backwards.
		slices.Reverse(order)
	}
	for _, mode := range order {
		r, err := c.s6Mode(ctx, t, golden, mode)
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		res[mode] = r
	}
	return c.s6Report(res)
}

// s6Mode runs pgbench (and for none and writeback db_bench) on one mode.
func (c *cacheRunner) s6Mode(ctx context.Context, t appTools, golden, target string) (res *s6Result, err error) {
	a := c.sz.Apps
	mode, lba := strings.CutSuffix(target, "-lba")
	mode, s3 := strings.CutSuffix(mode, "-s3")
	var srv *server
	var uri string
	if s3 {
		srv, uri, err = c.cachedS3(ctx, "s6-"+target, "ssd", mode, a.Cache, golden)
	} else {
		srv, err = c.cachedFrom(ctx, "s6-"+target, "ssd", "hdd", mode, a.Cache, golden)
	}
	if err != nil {
		return nil, err
	}
	var u undoStack
	// Last: free the target's images (each holds a copy of the golden
	// image) before the next target makes its own.
	u.push(func() error { return os.RemoveAll(filepath.Join(c.workdir, "s6-"+target)) })
	if s3 {
		u.push(func() error {
			// The server was killed holding the lease.
			_, err := c.cmd(context.Background(), 2*time.Minute, c.tcBin, "image", "rm", "--force", uri)
			return err
		})
	}
	u.push(func() error { return c.discard(srv) })
	defer func() {
		if uerr := u.run(); err == nil && uerr != nil {
			err = uerr
		}
	}()
	if lba {
		if err := c.set(ctx, srv, "writeback_order=lba"); err != nil {
			return nil, err
		}
	}
	mode = target
	dir := filepath.Join(c.workdir, "s6-"+mode)
	mnt, err := c.kernelFS(ctx, &u, srv, dir, a.FS)
	if err != nil {
		return nil, err
	}
	pg, err := c.newPG(dir, mnt)
	if err != nil {
		return nil, err
	}
	pg.t = t
	if err := pg.start(ctx); err != nil {
		return nil, err
	}
	u.push(func() error { return pg.stop(context.Background()) })
	// The seed's database fits in RAM: read its files once so the run
	// measures commits, not cold reads (the same in every mode). Then
	// commit what that reading did to the cache (in writeback it promotes
	// the ~180 MB it reads: tens of thousands of journal records, and
	// perhaps a checkpoint), so that the first seconds of pgbench do not
	// pay for the warm-up. Nothing is dirty yet: the flush is one commit.
	if err := catTree(pg.data); err != nil {
		return nil, err
	}
	if _, err := c.flush(ctx, srv); err != nil {
		return nil, err
	}
	if _, err := pg.sql(ctx, "select pg_stat_reset_shared('wal')"); err != nil {
		return nil, err
	}
	v0, s0, err := c.stats(ctx, srv)
	if err != nil {
		return nil, err
	}
	out, err := c.cmd(ctx, a.PgTime+5*time.Minute, t.pgbench, "-h", pg.sock, "-U", "postgres", "-c", strconv.Itoa(a.PgClients), "-j", "2",
		"-T", strconv.Itoa(int(a.PgTime.Seconds())), "postgres")
	if err != nil {
		return nil, err
	}
	res = &s6Result{rocks: map[string]float64{}}
	m := tpsRe.FindStringSubmatch(out)
	if m == nil {
		return nil, fmt.Errorf("pgbench: no tps line in:\n%s", tail(out, 1500))
	}
	res.tps, _ = strconv.ParseFloat(m[1], 64)
	if m := pgLatRe.FindStringSubmatch(out); m != nil {
		res.latMs, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := pgTxRe.FindStringSubmatch(out); m != nil {
		res.tx, _ = strconv.Atoi(m[1])
	}
	v1, s1, err := c.stats(ctx, srv)
	if err != nil {
		return nil, err
	}
	syncs, syncMs, err := pg.walStats(ctx)
	if err != nil {
		return nil, err
	}
	res.hits = fmt.Sprintf("pgbench: %d WAL fdatasyncs, %.2f ms each on average; %.0f flushes (%.0f journal commits), %s written (%s of it bypassed as sequential), %s read (%s hits), %s written back",
		syncs, syncMs, delta(v0, v1, "FlushOps"), delta(s0, s1, "Commits"), mib(delta(v0, v1, "WriteBytes")), mib(delta(v0, v1, "BypassSequentialBytes")),
		mib(delta(v0, v1, "ReadBytes")), mib(delta(v0, v1, "ReadHitBytes")), mib(delta(v0, v1, "WritebackBytes")))
	c.add(Figure{Scenario: "S6", Target: mode, Test: "pgbench TPC-B", Value: res.tps, Unit: "TPS", LatMeanUs: res.latMs * 1000,
		Note: fmt.Sprintf("scale %d, %d clients, %v, %d transactions; %s", a.PgScale, a.PgClients, a.PgTime, res.tx, res.hits)})
	c.progress("S6", mode+" pgbench TPC-B", fmt.Sprintf("%.0f TPS, latency %.1f ms (%s)", res.tps, res.latMs, res.hits))
	if err := pg.stop(ctx); err != nil {
		return nil, err
	}
	if mode != "none" && mode != "writeback" || !c.s6Rocks() {
		return res, nil
	}
	rocks := filepath.Join(mnt, "rocks")
	if err := os.MkdirAll(rocks, 0o755); err != nil {
		return nil, err
	}
	keys := strconv.Itoa(a.RocksKeys)
	dur := strconv.Itoa(int(a.RocksTime.Seconds()))
	// --ops_between_duration_checks=1: by default db_bench looks at the
	// clock every 1,000 operations, over a minute at HDD sync rates.
	common := []string{"--value_size=100", "--key_size=16", "--compression_type=none", "--threads=1", "--seed=1", "--ops_between_duration_checks=1"}
	runDB := func(name string, args ...string) error {
		argv := append(append([]string{t.dbBench}, common...), args...)
		v0, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		out, err := c.cmd(ctx, a.RocksTime+5*time.Minute, argv...)
		if err != nil {
			return err
		}
		m := dbBenchR.FindStringSubmatch(out)
		if m == nil || m[1] != name {
			return fmt.Errorf("db_bench %s: no result line in:\n%s", name, tail(out, 1500))
		}
		ops, _ := strconv.ParseFloat(m[3], 64)
		res.rocks[name] = ops
		v1, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		note := fmt.Sprintf("%s read (%s hits), %s written, %.0f flushes", mib(delta(v0, v1, "ReadBytes")), mib(delta(v0, v1, "ReadHitBytes")),
			mib(delta(v0, v1, "WriteBytes")), delta(v0, v1, "FlushOps"))
		c.add(Figure{Scenario: "S6", Target: mode, Test: "db_bench " + name, Value: ops, Unit: "ops/s", LatMeanUs: mustFloat(m[2]), Note: note})
		c.progress("S6", mode+" db_bench "+name, fmt.Sprintf("%.0f ops/s (%s)", ops, note))
		return nil
	}
	if err := runDB("fillrandom", "--db="+filepath.Join(rocks, "fill"), "--benchmarks=fillrandom", "--sync=1", "--duration="+dur, "--num=100000000"); err != nil {
		return nil, err
	}
	// The database readrandom and overwrite use: written through the
	// target (no WAL: a bulk load), so in writeback it is in the cache as
	// the seed's was.
	if _, err := c.cmd(ctx, 10*time.Minute, append(append([]string{t.dbBench}, common...), "--db="+filepath.Join(rocks, "db"), "--benchmarks=fillseq", "--disable_wal=1", "--num="+keys)...); err != nil {
		return nil, err
	}
	if err := runDB("readrandom", "--db="+filepath.Join(rocks, "db"), "--use_existing_db=1", "--benchmarks=readrandom", "--use_direct_reads=1",
		"--cache_size=8388608", "--duration="+dur, "--num="+keys); err != nil {
		return nil, err
	}
	if err := runDB("overwrite", "--db="+filepath.Join(rocks, "db"), "--use_existing_db=1", "--benchmarks=overwrite", "--sync=1", "--duration="+dur, "--num="+keys); err != nil {
		return nil, err
	}
	return res, nil
}

func mustFloat(s string) float64 {
	v, _ := strconv.ParseFloat(s, 64)
	return v
}

// catTree reads every file under the PostgreSQL data directory dir once
// (into the page cache), except the WAL: pg_wal (~145 MB at scale 10) is
// only written during the run (whole pages, no read first), so reading it
// would only double the warm-up.
func catTree(dir string) error {
	return filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == "pg_wal" {
			return filepath.SkipDir
		}
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(io.Discard, f)
		return err
	})
}

// s6Short are the modes' names in the chart.
var s6Short = map[string]string{"none": "none", "writethrough": "wt", "writearound": "wa", "writeback": "wb", "writeback-lba": "wb lba", "writeback-s3": "wb s3"}

func (c *cacheRunner) s6Report(res map[string]*s6Result) error {
	a := c.sz.Apps
	none, wb := res["none"], res["writeback"]
	rows := [][]string{{"Mode", "TPS", "Latency ms", "x none", "Seed TPS (bcache)", "What tiercache served"}}
	seed := map[string]string{"none": "885–946 (none/wt/wa)", "writethrough": "885–946", "writearound": "885–946", "writeback": "2,251–2,742",
		"writeback-lba": "– (writeback_order=lba)", "writeback-s3": "– (object-store image; target: within 10 % of writeback)"}
	for _, m := range c.s6Modes() {
		r := res[m]
		xNone := "–"
		if none != nil {
			xNone = fmt.Sprintf("%.2f", ratioOf(r.tps, none.tps))
		}
		rows = append(rows, []string{m, fmt.Sprintf("%.0f", r.tps), fmt.Sprintf("%.1f", r.latMs), xNone, seed[m], r.hits})
	}
	c.details = append(c.details, detail{Scenario: "S6", Title: fmt.Sprintf("S6 pgbench TPC-B (scale %d, %d clients, %v per mode) on ext4 via nbdfuse + loop, SATA SSD model in front of the HDD model (writeback-s3: of an object-store image on a local versitygw)", a.PgScale, a.PgClients, a.PgTime), Rows: rows,
		Notes: []string{"Each mode starts from the same golden image (initdb + pgbench -i on a RAM disk) with a cold tiercache cache; the database files are read once before the run so that the page cache holds them (the seed's 160 MB database fits in RAM), so the run measures commits (WAL fsync → NBD FLUSH)."}})
	if none != nil && wb != nil {
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B, writeback / none", Seed: "bcache 2,251–2,742 vs 885–946 TPS (2.4–2.9x)",
			Ours: fmt.Sprintf("%.0f vs %.0f TPS", wb.tps, none.tps), Ratio: ratioOf(wb.tps, none.tps), Bar: "–", Met: "–"})
	}
	for _, m := range []string{"writethrough", "writearound"} {
		if res[m] == nil || none == nil {
			continue
		}
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B, " + m + " / none", Seed: "bcache ~1x (885–946 TPS in none/writethrough/writearound)",
			Ours: fmt.Sprintf("%.0f vs %.0f TPS", res[m].tps, none.tps), Ratio: ratioOf(res[m].tps, none.tps), Bar: "–", Met: "–"})
	}
	if lba := res["writeback-lba"]; lba != nil && wb != nil {
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B in writeback, writeback_order=epoch (default) / lba (the cost of epoch order)", Seed: "–",
			Ours: fmt.Sprintf("%.0f vs %.0f TPS", wb.tps, lba.tps), Ratio: ratioOf(wb.tps, lba.tps), Bar: "–", Met: "–"})
	}
	if s3 := res["writeback-s3"]; s3 != nil && wb != nil {
		r := ratioOf(s3.tps, wb.tps)
		c.checks = append(c.checks, Check{Scenario: "S6", What: "pgbench TPC-B in writeback, object-store image / HDD model backing", Seed: "target: within 10 % of writeback over the HDD model (≥ 0.9)",
			Ours: fmt.Sprintf("%.0f vs %.0f TPS", s3.tps, wb.tps), Ratio: r, Bar: "≥ 0.9", Met: yesNo(r >= 0.9)})
	}
	var groups []string
	var vals []float64
	base, baseName := none, "none"
	if base == nil {
		base, baseName = wb, "writeback"
	}
	for _, m := range c.s6Modes() {
		if base == nil || m == baseName {
			continue
		}
		groups = append(groups, "pgbench "+s6Short[m])
		vals = append(vals, ratioOf(res[m].tps, base.tps))
	}
	if !c.s6Rocks() {
		if len(groups) == 0 {
			return nil
		}
		return chartGroups(c.chartPath("s6.png"), "S6: pgbench on ext4, each target relative to "+baseName+" (higher is better)", "x "+baseName,
			groups, []string{"tiercache target / " + baseName}, [][]float64{vals}, []float64{1})
	}
	rseeds := []struct{ name, seed string }{
		{"fillrandom", "bcachefs 4,181 vs 1,115 ops/s (3.75x)"},
		{"readrandom", "bcachefs 736 vs 95 ops/s (7.74x)"},
		{"overwrite", "bcachefs 967 vs 243 ops/s (~4x), with sync"},
	}
	rrows := [][]string{{"db_bench", "none (HDD model through tiercache)", "writeback (SSD model cache)", "x none", "Seed"}}
	var rratios []float64
	var rgroups []string
	for _, s := range rseeds {
		x, y := none.rocks[s.name], wb.rocks[s.name]
		r := ratioOf(y, x)
		rratios = append(rratios, r)
		rgroups = append(rgroups, "db_bench "+s.name)
		rrows = append(rrows, []string{s.name, fmt.Sprintf("%.0f", x), fmt.Sprintf("%.0f", y), fmt.Sprintf("%.2f", r), s.seed})
		c.checks = append(c.checks, Check{Scenario: "S6", What: "RocksDB db_bench " + s.name + ", writeback / none", Seed: s.seed,
			Ours: fmt.Sprintf("%.0f vs %.0f ops/s", y, x), Ratio: r, Bar: "–", Met: "–"})
	}
	c.details = append(c.details, detail{Scenario: "S6", Title: fmt.Sprintf("S6 RocksDB db_bench (rocksdb-tools), %v per benchmark, same file systems after pgbench", a.RocksTime), Rows: rrows,
		Notes: []string{fmt.Sprintf("fillrandom: a new database, --sync=1 (every write's WAL fsync'd). readrandom and overwrite: a database of %d keys bulk-loaded with fillseq through the target first; readrandom with --use_direct_reads=1 and an 8 MiB block cache (so reads reach the device, not the page cache); overwrite with --sync=1. Values 100 bytes, keys 16, no compression, 1 thread.", a.RocksKeys)}})
	groups = append(groups, rgroups...)
	vals = append(vals, rratios...)
	return chartGroups(c.chartPath("s6.png"), "S6: applications on ext4, each mode relative to none (higher is better)", "x none",
		groups, []string{"tiercache mode / none"}, [][]float64{vals}, []float64{1})
}
