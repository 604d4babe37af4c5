package interop

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMeasureMirrorCostThroughBinary measures what a mirror costs the
// write path through the binary, with real files and a real client: a
// cache set on one O_DIRECT file against the same set mirrored on a second
// file of the same size (both in TIERCACHE_MEASURE_DIR, or the test's
// temporary directory), each served by the tiercache binary (not
// race-enabled: TIERCACHE_INTEROP_NORACE=1) and driven by fio's NBD
// engine: 4 KiB random writes in writeback mode at queue depth 8 for
// TIERCACHE_MIRROR_SECONDS (default 10) seconds (IOPS), then 300 writes
// each followed by a FLUSH at queue depth 1 (fio's fsync latency). The
// two configurations alternate, TIERCACHE_MIRROR_ROUNDS (default 5) rounds
// each, a fresh format every round; it prints every round, the medians
// and /proc/loadavg, and asserts nothing. TIERCACHE_MIRROR_GOMAXPROCS,
// if set, is the server's GOMAXPROCS. Runs only with TIERCACHE_MEASURE=1:
//
//	TIERCACHE_INTEROP_NORACE=1 TIERCACHE_MEASURE=1 go test ./internal/interop -run TestMeasureMirrorCostThroughBinary -v
func TestMeasureMirrorCostThroughBinary(t *testing.T) {
	if os.Getenv("TIERCACHE_MEASURE") != "1" {
		t.Skip("a measurement: TIERCACHE_MEASURE=1")
	}
	need(t, "fio")
	dir := os.Getenv("TIERCACHE_MEASURE_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	envInt := func(name string, def int) int {
		if v := os.Getenv(name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("%s=%q: %v", name, v, err)
			}
			return n
		}
		return def
	}
	rounds, secs := envInt("TIERCACHE_MIRROR_ROUNDS", 5), envInt("TIERCACHE_MIRROR_SECONDS", 10)
	procs := os.Getenv("TIERCACHE_MIRROR_GOMAXPROCS")
	const (
		cacheSize = 1 << 30
		backSize  = 4 << 30
		span      = 512 << 20 // the writes' range: within the cache
	)
	// The cache files are written out once (no block of theirs is
	// allocated by a measured write or FLUSH, as on a drive) and
	// formatted afresh for every round; the backing file is sparse (it
	// takes only the background writeback, the same in both).
	rd := filepath.Join(dir, "mirror-measure")
	if err := os.MkdirAll(rd, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(rd) })
	a, b := filledFile(t, rd, "a.img", cacheSize), filledFile(t, rd, "b.img", cacheSize)
	type result struct{ iops, flushP50, flushP99 float64 }
	measure := func(mirrored bool) result {
		t.Helper()
		back := sparseFile(t, rd, "back.img", backSize)
		defer os.Remove(back)
		dd := filepath.Join(rd, "data")
		defer os.RemoveAll(dd)
		fargs := []string{"format", "--force", "--cache", a, "--backing", "a=" + back, "--mode", "writeback", "--trust-path"}
		sargs := []string{"--cache", a, "--direct", "on", "--data-dir", dd}
		if mirrored {
			fargs = append(fargs, "--cache-mirror", b)
			sargs = append(sargs, "--cache-mirror", b)
		}
		run(t, time.Minute, bin, fargs...)
		if procs != "" {
			t.Setenv("GOMAXPROCS", procs)
		}
		s := startServer(t, sargs...)
		defer s.stop()
		fio := func(extra ...string) string {
			return run(t, 5*time.Minute, "fio", append([]string{
				"--name=m", "--ioengine=nbd", "--uri=" + s.uri("a"), "--rw=randwrite", "--bs=4k",
				fmt.Sprintf("--size=%d", span), "--output-format=json",
			}, extra...)...)
		}
		var r result
		out := fio("--iodepth=8", "--time_based", fmt.Sprintf("--runtime=%ds", secs), "--randseed=1")
		j := fioJobs(t, out)
		r.iops = j.Write.IOPS
		out = fio("--iodepth=1", "--fsync=1", "--number_ios=300", "--randseed=2")
		j = fioJobs(t, out)
		r.flushP50 = j.Sync.LatNs.Percentile["50.000000"] / 1e3
		r.flushP99 = j.Sync.LatNs.Percentile["99.000000"] / 1e3
		if r.iops == 0 || r.flushP50 == 0 {
			t.Fatalf("fio reported no write IOPS or FLUSH latency:\n%s", out)
		}
		return r
	}
	var single, mirrored []result
	for i := range rounds {
		s, m := measure(false), measure(true)
		single, mirrored = append(single, s), append(mirrored, m)
		t.Logf("round %d: single %.0f IOPS, FLUSH p50 %.0f µs p99 %.0f µs; mirrored %.0f IOPS, FLUSH p50 %.0f µs p99 %.0f µs; load %s",
			i, s.iops, s.flushP50, s.flushP99, m.iops, m.flushP50, m.flushP99, loadavg())
	}
	med := func(rs []result, f func(result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	iops := func(r result) float64 { return r.iops }
	p50 := func(r result) float64 { return r.flushP50 }
	si, mi, sf, mf := med(single, iops), med(mirrored, iops), med(single, p50), med(mirrored, p50)
	t.Logf("medians (GOMAXPROCS %q): write IOPS single %.0f, mirrored %.0f (%.2fx); FLUSH p50 %.0f µs vs %.0f µs (%.2fx); load %s",
		procs, si, mi, mi/si, sf, mf, mf/sf, loadavg())
}

// fioJobs returns the one job of fio's JSON output.
func fioJobs(t *testing.T, out string) fioJob {
	t.Helper()
	i := strings.Index(out, "{")
	if i < 0 {
		t.Fatalf("fio printed no JSON:\n%s", out)
	}
	var r struct {
		Jobs []fioJob `json:"jobs"`
	}
	if err := json.Unmarshal([]byte(out[i:]), &r); err != nil || len(r.Jobs) != 1 || r.Jobs[0].Error != 0 {
		t.Fatalf("fio output (%v):\n%s", err, out)
	}
	return r.Jobs[0]
}

type fioJob struct {
	Error int `json:"error"`
	Write struct {
		IOPS float64 `json:"iops"`
	} `json:"write"`
	Sync struct {
		LatNs struct {
			Percentile map[string]float64 `json:"percentile"`
		} `json:"lat_ns"`
	} `json:"sync"`
}

// filledFile creates dir/name of size bytes, every block written (zeroes)
// and synced.
func filledFile(t *testing.T, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(buf)) {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return p
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
