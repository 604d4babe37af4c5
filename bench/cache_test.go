package bench

import (
	"slices"
	"testing"
	"time"
)

func TestCacheJobArgs(t *testing.T) {
	j := job{Name: "w", RW: "randwrite", BS: 4096, QD: 1, Size: 1 << 30, IOSize: 64 << 20, Runtime: 30 * time.Second, Fsync: true, Seed: 5}
	got := j.args("nbd+unix:///vol?socket=/s", "o.json")
	want := []string{"--name=w", "--ioengine=nbd", "--uri=nbd+unix:///vol?socket=/s", "--rw=randwrite", "--bs=4096", "--iodepth=1", "--numjobs=1",
		"--size=1073741824", "--io_size=67108864", "--runtime=30s", "--fsync=1", "--randseed=5", "--output-format=json", "--output=o.json"}
	if !slices.Equal(got, want) {
		t.Errorf("fixed-size job args\n got %q\nwant %q", got, want)
	}
	if j.timeBased() {
		t.Error("a job with io_size is not time-based")
	}
	tb := job{Name: "r", RW: "randread", BS: 4096, QD: 32, Size: 1 << 20, Runtime: 8 * time.Second, Ramp: 2 * time.Second}
	got = tb.args("U", "o")
	for _, a := range []string{"--time_based", "--runtime=8s", "--ramp_time=2s", "--norandommap"} {
		if !slices.Contains(got, a) {
			t.Errorf("time-based job args %q lack %s", got, a)
		}
	}
	if !tb.timeBased() {
		t.Error("time-based job not recognised")
	}
	// The kernel path: a file on a mounted file system, libaio and
	// O_DIRECT instead of the NBD export.
	kf := job{Name: "k", RW: "randrw", MixRead: 70, BS: 4096, BSSplit: "4k/50:1m/50", QD: 16, Offset: 2 << 30, Size: 32 << 20, IOSize: 64 << 20, FsyncN: 32, File: "/mnt/f"}
	got = kf.args("U", "o")
	want = []string{"--name=k", "--ioengine=libaio", "--direct=1", "--filename=/mnt/f", "--rw=randrw", "--bs=4096", "--iodepth=16", "--numjobs=1",
		"--size=33554432", "--offset=2147483648", "--bssplit=4k/50:1m/50", "--rwmixread=70", "--io_size=67108864", "--fsync=32", "--output-format=json", "--output=o"}
	if !slices.Equal(got, want) {
		t.Errorf("file job args\n got %q\nwant %q", got, want)
	}
}

func TestDBBenchParse(t *testing.T) {
	out := []byte(`2026/12/02-07:28:15  ... thread 0: (45000,45000) ops and (42266.3,42266.3) ops/second in (1.064677,1.064677) seconds
2026/12/02-07:28:16  ... thread 0: (15000,60000) ops and (15000.0,39852.0) ops/second in (1.000000,1.506000) seconds
fillrandom   :      62.722 micros/op 15487 ops/sec 1.291 seconds 20000 operations;   60.7 MB/s
Microseconds per write:
Count: 20000 Average: 62.7174  StdDev: 1990.51
Min: 5  Median: 9.2280  Max: 172131
Percentiles: P50: 9.23 P75: 13.52 P99: 145.23 P99.9: 7920.00 P99.99: 110000.00
rocksdb.stall.micros COUNT : 88428
rocksdb.compact.write.bytes COUNT : 210495172
rocksdb.flush.write.bytes COUNT : 439832016
rocksdb.remote.compact.write.bytes COUNT : 7
`)
	m := dbBenchR.FindSubmatch(out)
	if m == nil || string(m[1]) != "fillrandom" || string(m[3]) != "15487" {
		t.Errorf("result line: %q", m)
	}
	if m := dbP999Re.FindSubmatch(out); m == nil || string(m[1]) != "7920.00" {
		t.Errorf("p99.9: %q", m)
	}
	if m := dbMaxRe.FindSubmatch(out); m == nil || string(m[1]) != "172131" {
		t.Errorf("max: %q", m)
	}
	if f, c, st := dbStat(out, "rocksdb.flush.write.bytes"), dbStat(out, "rocksdb.compact.write.bytes"), dbStat(out, "rocksdb.stall.micros"); f != 439832016 || c != 210495172 || st != 88428 {
		t.Errorf("statistics: flush %v, compaction %v, stall %v", f, c, st)
	}
	if v := dbStat(out, "rocksdb.wal.bytes"); v != 0 {
		t.Errorf("absent ticker: %v", v)
	}
	if ms := dbProgressRe.FindAllSubmatch(out, -1); len(ms) != 2 || string(ms[1][2]) != "60000" {
		t.Errorf("progress lines: %q", ms)
	}
}

func TestCachePlannedSteps(t *testing.T) {
	c := &cacheRunner{sz: fullSizes()}
	// S1 3+4*3, S2 16, S3 9, S4 6, S5 1+2*2*3, S6 1+4+2*3, S7 7*4+1 (four
	// targets: the plain HDD model before and after; fillrandom with no
	// device), S8 3*4, S9 2, S10 1+3*(3*3+3+2).
	if n := c.plannedSteps(scenarioNames); n != 156 {
		t.Errorf("full suite steps = %d, want 156", n)
	}
	c.s7jobs = []string{"drain"} // and seqwrite, its reference
	if n := c.plannedSteps([]string{"S7"}); n != 2*4 {
		t.Errorf("S7 steps with --s7 drain = %d, want 8", n)
	}
	c.s7jobs = nil
	c.abBin = "other" // S8 and S7 run two more targets
	if n := c.plannedSteps([]string{"S7", "S8"}); n != 7*6+1+3*6 {
		t.Errorf("S7, S8 steps with --ab = %d, want %d", n, 7*6+1+3*6)
	}
	c.abBin = ""
	c.s6lba = true // S6 1+5+2*3
	if n := c.plannedSteps([]string{"S6"}); n != 12 {
		t.Errorf("S6 steps with --s6-lba = %d, want 12", n)
	}
	c.s6lba, c.s6targets = false, []string{"writeback", "writeback-s3"} // S6 1+2, no db_bench
	if n := c.plannedSteps([]string{"S6"}); n != 3 {
		t.Errorf("S6 steps with --s6 writeback,writeback-s3 = %d, want 3", n)
	}
	c.s6targets = nil
	c.sz, c.s6lba = quickSizes(), false
	if n := c.plannedSteps([]string{"S5"}); n != 1+2*3 {
		t.Errorf("quick S5 steps = %d", n)
	}
	if n := c.plannedSteps([]string{"S10"}); n != 1+14 {
		t.Errorf("quick S10 steps = %d, want 15", n)
	}
	// The quick run has no 5x sequential write: S7 6*4+1.
	if n := c.plannedSteps([]string{"S7"}); n != 6*4+1 {
		t.Errorf("quick S7 steps = %d, want %d", n, 6*4+1)
	}
}

func TestStatsNumbers(t *testing.T) {
	// Today's API (snake_case) and older servers' (Go names) read alike.
	for _, m := range []map[string]any{
		{"dirty_blocks": 7.0, "bypass_sequential_bytes": 4096.0, "bypass_write_bytes": 1.0, "backing_consistent": true, "degrade_reason": "space-wait"},
		{"DirtyBlocks": 7.0, "BypassSequentialBytes": 4096.0, "BypassBytes": 1.0, "BackingConsistent": true},
	} {
		n := numbers(m)
		if n["DirtyBlocks"] != 7 || n["BypassSequentialBytes"] != 4096 || n["BypassBytes"] != 1 || n["BackingConsistent"] != 1 || len(n) != 4 {
			t.Errorf("numbers(%v) = %v", m, n)
		}
	}
}
