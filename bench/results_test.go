package bench

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestReplot renders a report and its charts from a small results.json.
func TestReplot(t *testing.T) {
	dir := t.TempDir()
	rf := resultsFile{
		Env:        envInfo{Date: "2026-11-30 10:55 UTC", CPUs: 2},
		Options:    Options{Rounds: 1, Runtime: 2 * time.Second, FileSize: 64 << 20, Servers: []string{"tiercache", "nbdkit"}, Baselines: true},
		ElapsedSec: 42,
		Commands:   []string{"nbdkit -f -U /w/nbdkit.sock file /w/data.img"},
	}
	for _, w := range Workloads {
		for i, target := range []string{"tiercache", "nbdkit"} {
			rf.Samples = append(rf.Samples, Sample{Round: 1, Target: target, Workload: w.Name,
				IOPS: float64(1000 * (i + 1)), MiBps: float64(100 * (i + 1)), Bytes: 1 << 30,
				ServerCPUSec: 2, HasServerCPU: true})
		}
		if w.Baseline {
			rf.Samples = append(rf.Samples, Sample{Round: 1, Target: "file-direct", Workload: w.Name, IOPS: 4000, Bytes: 1 << 30})
		}
	}
	data, err := json.Marshal(rf)
	if err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(dir, "in.json")
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	if err := replot(in, out, io.Discard); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(out, "RESULTS.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"run took 42s",
		"| 4 KiB randread QD32 | IOPS | 1000 | 2000 | 4000 | – | 0.50 | 0.25 | – |",
		"nbdkit -f -U /w/nbdkit.sock file /w/data.img",
		"![IOPS](iops.png)",
	} {
		if !strings.Contains(string(md), want) {
			t.Errorf("RESULTS.md lacks %q:\n%s", want, md)
		}
	}
	for _, f := range append([]string{"results.json"}, chartFiles...) {
		if fi, err := os.Stat(filepath.Join(out, f)); err != nil || fi.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	if err := replot(filepath.Join(dir, "missing.json"), out, io.Discard); err == nil {
		t.Error("replot of a missing file succeeded")
	}
}
