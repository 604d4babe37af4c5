package bench

import (
	"math"
	"os"
	"strings"
	"testing"
	"time"
)

func readTestdata(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }

// The testdata files are real fio 3.33 outputs of this harness's command
// lines against nbdkit, 1 s runs.
func TestParseFioJSON(t *testing.T) {
	tests := []struct {
		file                                            string
		bytes                                           int64
		iops, runtime, latMean, latP99, latP999, latMax float64
	}{
		{"fio-randread-nbd.json", 151900160, 37047.952048, 1.001, 851.60632466, 6193.152, 16711.68, 38355.942},
		{"fio-write-nbd.json", 990904320, 936.570862, 1.009, 8477.764616931, 20578.304, 34865.152, 35011.752},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			r, err := parseFioJSON(readTestdata(t, tt.file))
			if err != nil {
				t.Fatal(err)
			}
			if r.Bytes != tt.bytes || !near(r.IOPS, tt.iops) || !near(r.RuntimeSec, tt.runtime) {
				t.Errorf("bytes, iops, runtime = %d, %v, %v; want %d, %v, %v", r.Bytes, r.IOPS, r.RuntimeSec, tt.bytes, tt.iops, tt.runtime)
			}
			if !near(r.BW, float64(tt.bytes)/tt.runtime) {
				t.Errorf("bw = %v, want %v", r.BW, float64(tt.bytes)/tt.runtime)
			}
			if !near(r.LatMeanUs, tt.latMean) || !near(r.LatP99Us, tt.latP99) {
				t.Errorf("latency mean, p99 = %v, %v µs; want %v, %v", r.LatMeanUs, r.LatP99Us, tt.latMean, tt.latP99)
			}
			if !near(r.LatP999Us, tt.latP999) || !near(r.LatMaxUs, tt.latMax) {
				t.Errorf("latency p99.9, max = %v, %v µs; want %v, %v", r.LatP999Us, r.LatMaxUs, tt.latP999, tt.latMax)
			}
			// The writes' own latencies: those of the write job, none of
			// the read job.
			wantW, wantWMax := 0.0, 0.0
			if strings.Contains(tt.file, "write") {
				wantW, wantWMax = tt.latP999, tt.latMax
			}
			if !near(r.WriteP999Us, wantW) || !near(r.WriteMaxUs, wantWMax) {
				t.Errorf("write latency p99.9, max = %v, %v µs; want %v, %v", r.WriteP999Us, r.WriteMaxUs, wantW, wantWMax)
			}
			if r.ClientCPU <= 0 {
				t.Errorf("client cpu = %v, want > 0", r.ClientCPU)
			}
		})
	}
}

func TestParseFioJSONErrors(t *testing.T) {
	refused := readTestdata(t, "fio-connect-refused.json")
	tests := []struct {
		name, data, want string
	}{
		// fio writes its connect error into the --output file before a
		// JSON document with zero I/O and "error": 0.
		{"connect refused", string(refused), "no I/O"},
		{"empty", "", "no JSON"},
		{"no jobs", `{"fio version": "fio-3.33", "jobs": []}`, "no jobs"},
		{"job error", `{"jobs": [{"jobname": "x", "error": 5, "read": {"io_bytes": 4096, "runtime": 1}}]}`, "error 5"},
		{"truncated", `{"jobs": [{"jobname": `, "fio output"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseFioJSON([]byte(tt.data))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestParseFioJSONSkipsPrefix(t *testing.T) {
	data := append([]byte("fio: connected to NBD server\n"), readTestdata(t, "fio-randread-nbd.json")...)
	if _, err := parseFioJSON(data); err != nil {
		t.Fatal(err)
	}
}

func TestFioArgs(t *testing.T) {
	w := Workloads[1] // randread-4k-qd32
	got := strings.Join(fioArgs(w, fioTiming{Runtime: 10 * time.Second, Ramp: 1500 * time.Millisecond},
		[]string{"--ioengine=nbd", "--uri=" + nbdURI("/s.sock")}, "o.json"), " ")
	want := "--name=randread-4k-qd32 --ioengine=nbd --uri=nbd+unix:///bench?socket=/s.sock --rw=randread --bs=4096 --iodepth=32 " +
		"--numjobs=1 --time_based --runtime=10s --ramp_time=1500ms --norandommap --output-format=json --output=o.json"
	if got != want {
		t.Errorf("fioArgs =\n%s\nwant\n%s", got, want)
	}
	seq := strings.Join(fioArgs(Workloads[3], fioTiming{Runtime: 2 * time.Second}, nil, "o.json"), " ")
	if strings.Contains(seq, "ramp_time") || strings.Contains(seq, "norandommap") {
		t.Errorf("sequential run without ramp: %s", seq)
	}
}

func TestShellJoin(t *testing.T) {
	got := shellJoin([]string{"fio", "--uri=nbd+unix:///b?socket=/x y", "it's", "", "--bs=4096"})
	want := `fio '--uri=nbd+unix:///b?socket=/x y' 'it'\''s' '' --bs=4096`
	if got != want {
		t.Errorf("shellJoin = %s, want %s", got, want)
	}
}
