package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"
)

func TestMedian(t *testing.T) {
	nan := math.NaN()
	tests := []struct {
		in   []float64
		want float64
		ok   bool
	}{
		{nil, 0, false},
		{[]float64{nan}, 0, false},
		{[]float64{3}, 3, true},
		{[]float64{5, 1, 3}, 3, true},
		{[]float64{4, 1, 3, 2}, 2.5, true},
		{[]float64{9, nan, 1, 5}, 5, true},
	}
	for _, tt := range tests {
		got, ok := median(tt.in)
		if ok != tt.ok || got != tt.want {
			t.Errorf("median(%v) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
	in := []float64{3, 1, 2}
	median(in)
	if in[0] != 3 {
		t.Error("median reordered its input")
	}
}

func TestMinMax(t *testing.T) {
	lo, hi, ok := minMax([]float64{math.NaN(), 4, -1, 7})
	if !ok || lo != -1 || hi != 7 {
		t.Errorf("minMax = %v, %v, %v", lo, hi, ok)
	}
	if _, _, ok := minMax(nil); ok {
		t.Error("minMax(nil) ok")
	}
}

func TestRatio(t *testing.T) {
	tests := []struct {
		a, b, want float64
		ok         bool
	}{
		{50, 100, 0.5, true},
		{100, 0, 0, false},
		{100, -1, 0, false},
		{math.NaN(), 1, 0, false},
		{1, math.NaN(), 0, false},
	}
	for _, tt := range tests {
		got, ok := ratio(tt.a, tt.b)
		if ok != tt.ok || got != tt.want {
			t.Errorf("ratio(%v, %v) = %v, %v; want %v, %v", tt.a, tt.b, got, ok, tt.want, tt.ok)
		}
	}
}

func TestCPUPerGiB(t *testing.T) {
	if v, ok := cpuPerGiB(3, 2<<30); !ok || v != 1.5 {
		t.Errorf("cpuPerGiB(3 s, 2 GiB) = %v, %v", v, ok)
	}
	if _, ok := cpuPerGiB(3, 0); ok {
		t.Error("cpuPerGiB with no bytes ok")
	}
}

func TestParseSize(t *testing.T) {
	good := map[string]int64{"4096": 4096, "64M": 64 << 20, "64MiB": 64 << 20, "1G": 1 << 30, "1GiB": 1 << 30, "2k": 2048, "1TB": 1 << 40}
	for in, want := range good {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "G", "-1G", "0", "1.5G", "1X", "99999999999T"} {
		if got, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", in, got)
		}
	}
}

func TestRotate(t *testing.T) {
	names := []string{"a", "b", "c"}
	for r, want := range []string{"abc", "bca", "cab", "abc"} {
		if got := strings.Join(rotate(names, r), ""); got != want {
			t.Errorf("rotate(%d) = %s, want %s", r, got, want)
		}
	}
}

// TestSummary checks medians, ratios and the rendered tables from samples
// with known values.
func TestSummary(t *testing.T) {
	var samples []Sample
	add := func(target, wl string, round int, iops float64, cpu float64) {
		s := Sample{Round: round, Target: target, Workload: wl, IOPS: iops, MiBps: iops, Bytes: 1 << 30}
		if cpu >= 0 {
			s.ServerCPUSec, s.HasServerCPU = cpu, true
		}
		samples = append(samples, s)
	}
	for round, v := range []float64{100, 300, 200} {
		add("tiercache", "randread-4k-qd32", round+1, v, v/100)
		add("qemu-nbd", "randread-4k-qd32", round+1, 2*v, 1)
		add("file-direct", "randread-4k-qd32", round+1, 4*v, -1)
	}
	sum := summarize(samples, 3, []string{"tiercache", "qemu-nbd"}, []string{"file-direct"})
	if st := sum.perf[key{"tiercache", "randread-4k-qd32"}]; st.med != 200 || st.lo != 100 || st.hi != 300 || st.n != 3 {
		t.Errorf("tiercache stat = %+v", st)
	}
	if st := sum.cpu[key{"tiercache", "randread-4k-qd32"}]; st.med != 2 {
		t.Errorf("tiercache cpu = %+v, want median 2 s/GiB", st)
	}
	if st := sum.cpu[key{"file-direct", "randread-4k-qd32"}]; st.ok {
		t.Errorf("baseline has server cpu %+v", st)
	}

	rows := sum.throughputTable()
	wantHead := "Workload Unit tiercache qemu-nbd file-direct tiercache/qemu-nbd tiercache/file-direct"
	if got := strings.Join(rows[0], " "); got != wantHead {
		t.Errorf("head = %s\nwant %s", got, wantHead)
	}
	var row []string
	for _, r := range rows {
		if r[0] == "4 KiB randread QD32" {
			row = r
		}
	}
	if got, want := strings.Join(row, " "), "4 KiB randread QD32 IOPS 200 400 800 0.50 0.25"; got != want {
		t.Errorf("row = %s\nwant %s", got, want)
	}
	if got := strings.Join(rows[1], " "); !strings.Contains(got, "– – – – –") {
		t.Errorf("missing workload not dashed: %s", got)
	}

	var md bytes.Buffer
	if err := writeMarkdown(&md, rows[:2]); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(md.String(), "| Workload | Unit |") || !strings.Contains(md.String(), "| --- | ---: |") {
		t.Errorf("markdown:\n%s", md.String())
	}
	var txt bytes.Buffer
	if err := printSummary(&txt, sum); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(txt.String(), "0.50") {
		t.Errorf("text summary lacks the ratio:\n%s", txt.String())
	}
}

func TestFormatValue(t *testing.T) {
	for v, want := range map[float64]string{math.NaN(): "–", 123456.7: "123457", 42.25: "42.2", 1.234: "1.23"} {
		if got := formatValue(v); got != want {
			t.Errorf("formatValue(%v) = %s, want %s", v, got, want)
		}
	}
}
