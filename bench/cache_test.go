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
}

func TestCachePlannedSteps(t *testing.T) {
	c := &cacheRunner{sz: fullSizes()}
	// S1 5+2*3, S2 16, S3 9, S4 6, S5 1+2*2*3, S6 1+4+2*3, S7 3*3, S8 3*3, S9 2.
	if n := c.plannedSteps(scenarioNames); n != 86 {
		t.Errorf("full suite steps = %d, want 86", n)
	}
	c.s6lba = true // S6 1+5+2*3
	if n := c.plannedSteps([]string{"S6"}); n != 12 {
		t.Errorf("S6 steps with --s6-lba = %d, want 12", n)
	}
	c.sz, c.s6lba = quickSizes(), false
	if n := c.plannedSteps([]string{"S5"}); n != 1+2*3 {
		t.Errorf("quick S5 steps = %d", n)
	}
}
