package bench

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// publishDir writes each of names into a new directory holding "tag name".
func publishDir(t *testing.T, tag string, names []string) string {
	t.Helper()
	d := t.TempDir()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(d, n), []byte(tag+" "+n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// published maps each file in dir to the tag of the run that wrote it.
func published(t *testing.T, dir string) map[string]string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		tag, name, _ := strings.Cut(string(b), " ")
		if name != e.Name() {
			t.Fatalf("%s holds %q", e.Name(), b)
		}
		got[e.Name()] = tag
	}
	return got
}

// TestPublishRun: publishing replaces only the files of the scenarios the
// run ran. A run of S1-S6 once removed the published S7-S9 report
// (CLIFF_RESULTS.md, cliff-*) and the whole suite's S7-S9 charts.
func TestPublishRun(t *testing.T) {
	cache, cliff := reportSet{}.files(), reportSet{cliff: true}.files()
	old := slices.Concat(cache, cliff)
	s1to6 := []string{"S1", "S2", "S3", "S4", "S5", "S6"}

	t.Run("S1-S6", func(t *testing.T) {
		dst := publishDir(t, "old", old)
		// S6 ran and drew no chart: the published s6.png is not this run's.
		src := publishDir(t, "new", []string{"CACHE_RESULTS.md", "cache-results.json", "bars.png", "s1.png", "s2.png", "s3.png", "s4.png", "s5.png"})
		if err := publishRun(src, dst, newReportSet(s1to6), s1to6); err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"CACHE_RESULTS.md": "new", "cache-results.json": "new", "bars.png": "new",
			"s1.png": "new", "s2.png": "new", "s3.png": "new", "s4.png": "new", "s5.png": "new",
			"s7.png": "old", "s8.png": "old", "s9.png": "old"}
		for _, n := range cliff {
			want[n] = "old"
		}
		if got := published(t, dst); !maps.Equal(got, want) {
			t.Errorf("published %v, want %v", got, want)
		}
	})

	t.Run("whole suite", func(t *testing.T) {
		dst := publishDir(t, "old", old)
		src := publishDir(t, "new", cache)
		if err := publishRun(src, dst, newReportSet(scenarioNames), scenarioNames); err != nil {
			t.Fatal(err)
		}
		want := map[string]string{}
		for _, n := range cache {
			want[n] = "new"
		}
		if got := published(t, dst); !maps.Equal(got, want) {
			t.Errorf("published %v, want %v (the S7-S9 set superseded)", got, want)
		}
	})

	t.Run("S7,S8", func(t *testing.T) {
		dst := publishDir(t, "old", old)
		src := publishDir(t, "new", []string{"CLIFF_RESULTS.md", "cliff-results.json", "cliff-bars.png", "cliff-s7.png", "cliff-s8.png"})
		scen := []string{"S7", "S8"}
		if err := publishRun(src, dst, newReportSet(scen), scen); err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"CLIFF_RESULTS.md": "new", "cliff-results.json": "new", "cliff-bars.png": "new",
			"cliff-s7.png": "new", "cliff-s8.png": "new", "cliff-s9.png": "old"}
		for _, n := range cache {
			want[n] = "old"
		}
		if got := published(t, dst); !maps.Equal(got, want) {
			t.Errorf("published %v, want %v", got, want)
		}
	})
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
