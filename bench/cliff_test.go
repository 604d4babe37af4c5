package bench

import (
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestCliffBracket: each tiercache run of S7-S8 is compared with the mean
// of the plain HDD model's runs before and after it in the same round.
// A single plain run first, as the cases once had, let the machine's load
// drift between it and the tiercache runs move a fillrandom ratio by 0.6-1.9x
// from round to round.
func TestCliffBracket(t *testing.T) {
	c := &cacheRunner{outDir: t.TempDir(), round: 1}
	tgs := c.cliffTargets()
	if len(tgs) < 4 || !tgs[0].bare() || !tgs[len(tgs)-1].bare() {
		t.Fatalf("targets %v: want the plain HDD model first and last", tgs)
	}
	for _, tg := range tgs[1 : len(tgs)-1] {
		if tg.bare() {
			t.Fatalf("targets %v: a plain run between the tiercache runs", tgs)
		}
	}
	run := func(v float64) cliffRun { return cliffRun{value: v, unit: "ops/s", p999Ms: 10, maxMs: 20} }
	cases := []cliffCase{
		{title: "job", runs: []cliffRun{run(120), run(90), run(110), run(80)}},
		// The plain run after the tiercache runs did not happen: the one
		// before is the base.
		{title: "cut short", runs: []cliffRun{run(50), run(50), run(25), {skipped: "no tool", p999Ms: math.NaN(), maxMs: math.NaN()}}},
	}
	if err := c.cliffReport("S7", "S7 test", cases, nil); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{
		"job, tiercache epoch / HDD model":       0.9,
		"job, tiercache lba / HDD model":         1.1,
		"cut short, tiercache epoch / HDD model": 1,
		"cut short, tiercache lba / HDD model":   0.5,
	}
	got := map[string]float64{}
	for _, ch := range c.checks {
		if strings.Contains(ch.What, "HDD model, again") {
			t.Errorf("check on the plain HDD model: %q", ch.What)
		}
		if strings.HasSuffix(ch.What, " / HDD model") {
			got[ch.What] = ch.Ratio
		}
	}
	for w, r := range want {
		if g, ok := got[w]; !ok || math.Abs(g-r) > 1e-9 {
			t.Errorf("%s: ratio %v (present %v), want %v", w, g, ok, r)
		}
	}
	if len(got) != len(want) {
		t.Errorf("ratio checks %v, want %v", got, want)
	}
	// The table gives both plain runs, each against their mean.
	rows := c.details[0].Rows
	if len(rows) != 1+len(cases)*len(tgs) || rows[1][1] != "HDD model" || rows[1][3] != "1.20" || rows[4][1] != "HDD model, again" || rows[4][3] != "0.80" {
		t.Errorf("table rows %q", rows)
	}
}

// TestCliffServerCPU: a run's note gives the server's CPU time during the
// job, read from /proc (here of the test's own process), and leaves it out
// when it is unknown.
func TestCliffServerCPU(t *testing.T) {
	srv := &server{p: &process{cmd: &exec.Cmd{Process: &os.Process{Pid: os.Getpid()}}}}
	c0, ok0 := serverCPU(srv)
	if !ok0 {
		t.Fatal("no CPU time for a live process")
	}
	var r cliffRun
	x := uint64(1)
	for r.cpu <= 0 { // burn CPU until the kernel has counted a tick of it
		for range 1 << 20 {
			x = x*6364136223846793005 + 1442695040888963407
		}
		r.cpuSince(srv, c0, ok0)
	}
	if !strings.Contains(r.note(), "server CPU ") {
		t.Errorf("note %q lacks the server's CPU time (%v, %d)", r.note(), r.cpu, x)
	}
	if _, ok := serverCPU(nil); ok {
		t.Error("CPU time of no server")
	}
	var none cliffRun
	none.cpuSince(nil, c0, ok0)
	if none.cpu != 0 || strings.Contains(none.note(), "CPU") {
		t.Errorf("unknown CPU time reported: %v, %q", none.cpu, none.note())
	}
}
