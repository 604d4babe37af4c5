package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestServerCPU(t *testing.T) {
	p := filepath.Join(t.TempDir(), "tiercache-cpu-1.txt")
	os.WriteFile(p, []byte("idle 120 123 4000 4000\nrandread 123 923 4000 6500\n"), 0o644)
	rows, err := serverCPU(p)
	if err != nil {
		t.Fatal(err)
	}
	want := []cpuRow{{"idle", 30 * time.Millisecond, 0}, {"randread", 8 * time.Second, 2500}}
	if len(rows) != len(want) {
		t.Fatalf("got %v, want %v", rows, want)
	}
	for i := range want {
		if rows[i] != want[i] {
			t.Errorf("row %d: got %+v, want %+v", i, rows[i], want[i])
		}
	}
	for _, bad := range []string{"idle 1 2 3\n", "idle 5 4 0 0\n", "idle 1 2 x 4\n"} {
		os.WriteFile(p, []byte(bad), 0o644)
		if _, err := serverCPU(p); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestClocksource(t *testing.T) {
	if got := clocksource("init: ready at 12s\r\nclocksource: tsc\r\njob x done\r\n"); got != "tsc" {
		t.Errorf("got %q", got)
	}
	if got := clocksource("nothing"); got != "unknown" {
		t.Errorf("got %q", got)
	}
}

func TestDevStats(t *testing.T) {
	p := filepath.Join(t.TempDir(), "devstat.txt")
	os.WriteFile(p, []byte("tiercache-fsync-1 nbd0 0 1229 564 4 1961 0 18 309 101\nbcache-fsync-1 bcache0 18 1268 690 4 313 313 21 1693 0\n"), 0o644)
	ds, err := devStats(p)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]jobDisks{
		"tiercache-fsync-1": {"nbd0", diskReqs{0, 1229, 564}, diskReqs{4, 1961, 0}, diskReqs{18, 309, 101}},
		"bcache-fsync-1":    {"bcache0", diskReqs{18, 1268, 690}, diskReqs{4, 313, 313}, diskReqs{21, 1693, 0}},
	}
	if len(ds) != len(want) {
		t.Fatalf("got %v, want %v", ds, want)
	}
	for k, w := range want {
		if ds[k] != w {
			t.Errorf("%s: got %+v, want %+v", k, ds[k], w)
		}
	}
	for _, bad := range []string{"x nbd0 1 2 3\n", "x nbd0 1 2 3 4 5 6 7 8 y\n", "x nbd0 1 2 3 4 5 6 7 8 -1\n"} {
		os.WriteFile(p, []byte(bad), 0o644)
		if _, err := devStats(p); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
