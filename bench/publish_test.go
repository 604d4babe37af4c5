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
