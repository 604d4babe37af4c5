package bench

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Metric is what a workload is judged by.
type Metric int

const (
	// MetricIOPS suits small blocks, where per-request cost dominates.
	MetricIOPS Metric = iota
	// MetricMiBps suits large blocks, where bytes moved dominate.
	MetricMiBps
)

func (m Metric) String() string {
	if m == MetricMiBps {
		return "MiB/s"
	}
	return "IOPS"
}

// Workload is one fio job shape.
type Workload struct {
	Name    string // short id used in files and tables, e.g. "randread-4k-qd32"
	Title   string // human label, e.g. "4 KiB randread QD32"
	RW      string // fio rw= value
	BS      int    // block size in bytes
	IODepth int
	Metric  Metric
	// Baseline marks the workloads also run by fio directly on the file.
	Baseline bool
}

// Workloads are the shapes every server runs, in run order. Queue depths:
// QD1 measures the round-trip latency a single synchronous client sees; QD32
// is a busy file system or VM and the stretch target (4 KiB QD32
// random reads against fio O_DIRECT on the file); 1 MiB at QD8 keeps 8 MiB in
// flight, enough to fill one connection on a 2-core host, where more would
// only wait in the socket.
var Workloads = []Workload{
	{Name: "randread-4k-qd1", Title: "4 KiB randread QD1", RW: "randread", BS: 4 << 10, IODepth: 1, Metric: MetricIOPS, Baseline: true},
	{Name: "randread-4k-qd32", Title: "4 KiB randread QD32", RW: "randread", BS: 4 << 10, IODepth: 32, Metric: MetricIOPS, Baseline: true},
	{Name: "randwrite-4k-qd32", Title: "4 KiB randwrite QD32", RW: "randwrite", BS: 4 << 10, IODepth: 32, Metric: MetricIOPS},
	{Name: "read-1m-qd8", Title: "1 MiB seq read QD8", RW: "read", BS: 1 << 20, IODepth: 8, Metric: MetricMiBps},
	{Name: "write-1m-qd8", Title: "1 MiB seq write QD8", RW: "write", BS: 1 << 20, IODepth: 8, Metric: MetricMiBps},
}

func (w Workload) random() bool { return strings.HasPrefix(w.RW, "rand") }

// fioTiming is how long each fio run lasts.
type fioTiming struct {
	Runtime time.Duration // measured time
	Ramp    time.Duration // unmeasured warm-up before it
}

// fioArgs returns fio's arguments for workload w. target are the arguments
// that choose what is tested (engine and URI, or engine and file); output is
// the JSON file fio writes.
func fioArgs(w Workload, t fioTiming, target []string, output string) []string {
	args := []string{
		"--name=" + w.Name,
	}
	args = append(args, target...)
	args = append(args,
		"--rw="+w.RW,
		"--bs="+strconv.Itoa(w.BS),
		"--iodepth="+strconv.Itoa(w.IODepth),
		"--numjobs=1",
		"--time_based",
		"--runtime="+fioDuration(t.Runtime),
	)
	if t.Ramp > 0 {
		args = append(args, "--ramp_time="+fioDuration(t.Ramp))
	}
	if w.random() {
		// No random map: every block need not be hit exactly once in a
		// pass, and the client spends no CPU tracking it.
		args = append(args, "--norandommap")
	}
	return append(args, "--output-format=json", "--output="+output)
}

// fioDuration formats d as a fio time value.
func fioDuration(d time.Duration) string {
	if d%time.Second == 0 {
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	}
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// nbdURI is the NBD URI of export name on unix socket sock.
func nbdURI(sock string) string {
	return "nbd+unix:///" + exportName + "?socket=" + sock
}

// exportName is the export every server offers. nbdkit's file plugin serves
// any name it is asked for; qemu-nbd and tiercache are told this one.
const exportName = "bench"

// baseline is fio run directly on the data file, without any server.
type baseline struct {
	Name  string // "file-direct" or "file-buffered"
	Title string
	// args returns fio's target arguments for the queue depth.
	args func(file string, iodepth int) []string
}

// baselines run only the workloads marked Baseline. Engine choice: psync at
// QD1 (one pread at a time, as a synchronous client); at QD32 libaio for
// O_DIRECT, and io_uring for buffered I/O because libaio is synchronous on
// buffered files. --invalidate=0 keeps fio from dropping the file's page
// cache, which the servers measured next rely on.
var baselines = []baseline{
	{
		Name:  "file-direct",
		Title: "fio on the file, O_DIRECT",
		args: func(file string, qd int) []string {
			engine := "libaio"
			if qd == 1 {
				engine = "psync"
			}
			return []string{"--filename=" + file, "--ioengine=" + engine, "--direct=1", "--invalidate=0"}
		},
	},
	{
		Name:  "file-buffered",
		Title: "fio on the file, buffered (page cache)",
		args: func(file string, qd int) []string {
			engine := "io_uring"
			if qd == 1 {
				engine = "psync"
			}
			return []string{"--filename=" + file, "--ioengine=" + engine, "--direct=0", "--invalidate=0"}
		},
	},
}

// parseSize parses a byte count such as "1GiB", "64M", "4096" (binary units).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	t = strings.TrimSuffix(strings.TrimSuffix(t, "iB"), "B")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k', 'K':
			mult = 1 << 10
		case 'm', 'M':
			mult = 1 << 20
		case 'g', 'G':
			mult = 1 << 30
		case 't', 'T':
			mult = 1 << 40
		}
		if mult != 1 {
			t = t[:n-1]
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v <= 0 {
		return 0, fmt.Errorf("size %q: want a positive number with an optional K, M, G or T suffix", s)
	}
	if v > (1<<62)/mult {
		return 0, fmt.Errorf("size %q: too large", s)
	}
	return v * mult, nil
}
