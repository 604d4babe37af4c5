package bench

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestPublishReplacesRun: publishing a run that lacks some files (a
// scenario left out with --only) removes the previous run's copies of them,
// so docs/bench holds exactly one run.
func TestPublishReplacesRun(t *testing.T) {
	src, dst := t.TempDir(), t.TempDir()
	names := []string{"CACHE_RESULTS.md", "s1.png", "s6.png"}
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dst, n), []byte("old "+n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{"CACHE_RESULTS.md", "s6.png"} {
		if err := os.WriteFile(filepath.Join(src, n), []byte("new "+n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := publishFiles(src, dst, names); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dst)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
		b, err := os.ReadFile(filepath.Join(dst, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != "new "+e.Name() {
			t.Errorf("%s holds %q, want this run's copy", e.Name(), b)
		}
	}
	if want := []string{"CACHE_RESULTS.md", "s6.png"}; !slices.Equal(got, want) {
		t.Errorf("published %v, want %v (s1.png of the previous run removed)", got, want)
	}
}

// TestReportSet: a run of S7-S9 alone has its own file names, so that
// publishing it leaves the whole suite's published run in place.
func TestReportSet(t *testing.T) {
	cl := newReportSet([]string{"S9", "S7"})
	if want := []string{"CLIFF_RESULTS.md", "cliff-results.json", "cliff-bars.png", "cliff-s7.png", "cliff-s8.png", "cliff-s9.png"}; !cl.cliff || !slices.Equal(cl.files(), want) {
		t.Errorf("S7-S9 run: files %v, want %v", cl.files(), want)
	}
	for _, scen := range [][]string{scenarioNames, {"S6", "S7"}, nil} {
		rs := newReportSet(scen)
		if f := rs.files(); rs.cliff || f[0] != "CACHE_RESULTS.md" || f[1] != "cache-results.json" || !slices.Contains(f, "s1.png") || !slices.Contains(f, "s9.png") || len(f) != 2+len(cacheCharts) {
			t.Errorf("run of %v: files %v", scen, f)
		}
	}
}
