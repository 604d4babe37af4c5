// Command kvm-bench measures tiercache against bcache and dm-cache inside
// the test guest of package internal/kvm (Debian's kernel under qemu TCG),
// each system on its own pair of like virtual disks: a 2 GiB SSD (an
// unthrottled virtio disk) and an 8 GiB HDD (the same, throttled by qemu
// to 200 operations per second). bcache runs in writeback mode on
// /dev/bcache0; dm-cache (smq, writeback, 32 KiB blocks, metadata in the
// SSD's first 64 MiB) on /dev/mapper/dmc; tiercache in writeback mode,
// served in the guest and reached through the kernel NBD client with 2
// connections. All three are set up at once and each fills a region
// sequentially (sequential_cutoff 0 in bcache and tiercache, so the fill is
// cached; dm-cache's smq policy decides itself what it promotes, and the
// console log has its hit counters). Then the systems take turns, job by
// job and round by round: fio 4 KiB random reads and 4 KiB random writes
// at QD16 over the region, and after those, on an ext4 made on the
// device's first GiB, 4 KiB random writes into a 64 MiB file with an fsync
// after each (a database's commit pattern: FLUSH through every layer). It
// prints each figure and tiercache's ratios to bcache and to dm-cache.
//
// TCG makes CPU ~20 times dearer than on the host, which magnifies the CPU
// cost per I/O: the ratios measured in one guest are the result, not the
// absolute IOPS. make bench runs it (docs/BENCHMARKS.md).
package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tiercache/tiercache/internal/kvm"
)

//go:embed guest.sh
var guestScript string

func main() {
	rounds := flag.Int("rounds", 1, "rounds (each system once per round: bcache, dm-cache, tiercache)")
	runtime := flag.Int("runtime", 10, "seconds per fio job (after a 2 s ramp)")
	region := flag.String("region", "256M", "region filled and then read and written at random")
	bin := flag.String("bin", "", "tiercache binary to run in the guest (static; default: build this tree's with CGO_ENABLED=0)")
	keep := flag.String("keep", "", "directory to keep the disks, fio's JSON and the console log in (default: a temporary directory, removed)")
	flag.Parse()
	if err := run(*rounds, *runtime, *region, *bin, *keep); err != nil {
		fmt.Fprintln(os.Stderr, "kvm-bench:", err)
		os.Exit(1)
	}
}

func run(rounds, runtime int, region, bin, keep string) error {
	cacheDir, err := kvm.CacheDir()
	if err != nil {
		return err
	}
	img, err := kvm.Build(context.Background(), cacheDir, os.Stderr)
	if err != nil {
		return err
	}
	dir := keep
	if dir == "" {
		if dir, err = os.MkdirTemp("", "kvm-bench-"); err != nil {
			return err
		}
		defer os.RemoveAll(dir)
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if bin != "" {
		b, err := os.ReadFile(bin)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "tiercache"), b, 0o755); err != nil {
			return err
		}
	} else {
		build := exec.Command("go", "build", "-o", filepath.Join(dir, "tiercache"), "github.com/tiercache/tiercache/cmd/tiercache")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("building tiercache for the guest: %v\n%s", err, out)
		}
	}
	// Each system's SSD and HDD, in guest.sh's order (vda, vdb for
	// bcache; vdc, vdd for dm-cache; vde, vdf for tiercache). Sparse.
	var disks []kvm.Disk
	for _, sys := range systems {
		for _, d := range []struct {
			name string
			size int64
			iops int
		}{{"ssd", 2 << 30, 0}, {"hdd", 8 << 30, 200}} {
			path := filepath.Join(dir, sys+"-"+d.name+".img")
			os.Remove(path)
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			err = f.Truncate(d.size)
			f.Close()
			if err != nil {
				return err
			}
			disks = append(disks, kvm.Disk{Path: path, IOPS: d.iops})
		}
	}
	load0, _ := os.ReadFile("/proc/loadavg")
	script := strings.NewReplacer("@RAMP@", strconv.Itoa(ramp), "@REGION@", region, "@RUNTIME@", strconv.Itoa(runtime), "@ROUNDS@", strconv.Itoa(rounds)).Replace(guestScript)
	fmt.Fprintf(os.Stderr, "kvm-bench: booting the guest (%d rounds, %d s per job, region %s)\n", rounds, runtime, region)
	res, err := kvm.Run(context.Background(), kvm.Config{
		Image: img, Share: dir, Script: script, MemMiB: 1536, Timeout: time.Duration(rounds) * 30 * time.Minute,
		Disks: disks,
		// Under TCG the kernel finds the vCPUs' TSCs unsynchronized and
		// falls back to the HPET, an emulated device: every clock read
		// (the block layer's accounting; clock_gettime, which the vDSO
		// then cannot serve) becomes a device access. A real machine
		// reads the TSC; so does the guest with tsc=reliable.
		KernelArgs: "tsc=reliable",
	})
	if res != nil {
		os.WriteFile(filepath.Join(dir, "console.log"), []byte(res.Log), 0o644)
	}
	if err != nil {
		return err
	}
	if res.Status != 0 {
		return fmt.Errorf("guest script exit status %d; console:\n%s", res.Status, res.Log)
	}
	load1, _ := os.ReadFile("/proc/loadavg")
	fmt.Printf("kvm-bench: Debian %s guest under qemu TCG, 2 vCPUs, clock source %s; per system an SSD of 2 GiB (virtio) and an HDD of 8 GiB (virtio at 200 IOPS); systems in turns, job by job; region %s; fio 4 KiB QD16 libaio O_DIRECT, %d s per job; guest %v; host load average before %s, after %s\n\n",
		img.KernelVersion, clocksource(res.Log), region, runtime, res.Elapsed.Round(time.Second), strings.Join(strings.Fields(string(load0))[:3], " "), strings.Join(strings.Fields(string(load1))[:3], " "))
	fmt.Println("| round | job | bcache IOPS | dm-cache IOPS | tiercache IOPS | tiercache / bcache | tiercache / dm-cache |")
	fmt.Println("|---|---|---|---|---|---|---|")
	jobs := []string{"randread", "randwrite", "fsync"}
	name := map[string]string{"randread": "4K random reads (cache hits)", "randwrite": "4K random writes",
		"fsync": "ext4: 4K random writes, fsync each, QD1"}
	type fig struct{ b, d, t float64 }
	all := map[string][]fig{}
	for r := 1; r <= rounds; r++ {
		for _, j := range jobs {
			b, err := iops(filepath.Join(dir, fmt.Sprintf("bcache-%s-%d.json", j, r)))
			if err != nil {
				return err
			}
			d, err := iops(filepath.Join(dir, fmt.Sprintf("dmcache-%s-%d.json", j, r)))
			if err != nil {
				return err
			}
			t, err := iops(filepath.Join(dir, fmt.Sprintf("tiercache-%s-%d.json", j, r)))
			if err != nil {
				return err
			}
			all[j] = append(all[j], fig{b, d, t})
			fmt.Printf("| %d | %s | %.0f | %.0f | %.0f | %.2fx | %.2fx |\n", r, name[j], b, d, t, t/b, t/d)
		}
	}
	if rounds > 1 {
		// Medians of each system's IOPS and of the ratios of each round
		// (the systems of one round ran back to back under the same load).
		for _, j := range jobs {
			var bs, ds, ts, tb, td []float64
			for _, f := range all[j] {
				bs, ds, ts, tb, td = append(bs, f.b), append(ds, f.d), append(ts, f.t), append(tb, f.t/f.b), append(td, f.t/f.d)
			}
			fmt.Printf("| median of %d | %s | %.0f | %.0f | %.0f | %.2fx | %.2fx |\n", rounds, name[j], median(bs), median(ds), median(ts), median(tb), median(td))
		}
	}
	fmt.Println()
	ds, err := devStats(filepath.Join(dir, "devstat.txt"))
	if err != nil {
		return err
	}
	fmt.Printf("Requests the disks completed during each job, its %d s ramp included (the guest's /sys/block/X/stat): reads / writes / flushes of the system's own device, its SSD and its HDD, and per fio I/O, counting fio's IOPS over the ramp too\n\n", ramp)
	fmt.Println("| round | job | system | own device r / w / flush | SSD r / w / flush | HDD r / w / flush | SSD writes per I/O | SSD flushes per I/O | HDD flushes per I/O |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for r := 1; r <= rounds; r++ {
		for _, j := range jobs {
			for _, sys := range systems {
				name := fmt.Sprintf("%s-%s-%d", sys, j, r)
				d, ok := ds[name]
				if !ok {
					return fmt.Errorf("devstat.txt: no line for %s", name)
				}
				v, err := iops(filepath.Join(dir, name+".json"))
				if err != nil {
					return err
				}
				n := v * float64(runtime+ramp)
				fmt.Printf("| %d | %s | %s | %s %d / %d / %d | %d / %d / %d | %d / %d / %d | %.2f | %.2f | %.2f |\n", r, j, sys,
					d.dev, d.top.reads, d.top.writes, d.top.flushes, d.ssd.reads, d.ssd.writes, d.ssd.flushes, d.hdd.reads, d.hdd.writes, d.hdd.flushes,
					float64(d.ssd.writes)/n, float64(d.ssd.flushes)/n, float64(d.hdd.flushes)/n)
			}
		}
	}
	fmt.Println()
	fmt.Println("tiercache server CPU (user + system, /proc/PID/stat) and nbd0's requests over each job, its 2 s ramp included (fsync: mkfs, mount and umount too); idle: 10 s with the client connected, no I/O")
	fmt.Println()
	fmt.Println("| round | job | requests | server CPU s | CPU per request ms |")
	fmt.Println("|---|---|---|---|---|")
	for r := 1; r <= rounds; r++ {
		rows, err := serverCPU(filepath.Join(dir, fmt.Sprintf("tiercache-cpu-%d.txt", r)))
		if err != nil {
			return err
		}
		for _, c := range rows {
			per := "–"
			if c.requests > 0 {
				per = fmt.Sprintf("%.2f", c.cpu.Seconds()*1000/float64(c.requests))
			}
			fmt.Printf("| %d | %s | %d | %.2f | %s |\n", r, c.job, c.requests, c.cpu.Seconds(), per)
		}
	}
	return nil
}

// systems are the caches guest.sh compares, in the order of their disks.
var systems = []string{"bcache", "dmcache", "tiercache"}

// ramp is guest.sh's fio --ramp_time, in seconds.
const ramp = 2

// diskReqs is what one disk completed over a job.
type diskReqs struct{ reads, writes, flushes int64 }

// jobDisks is one line of guest.sh's devstat.txt.
type jobDisks struct {
	dev           string // the system's own device (bcache0, dm-2, nbd0)
	ssd, hdd, top diskReqs
}

// devStats parses guest.sh's devstat.txt: one "NAME DEV" line a job
// followed by reads, writes and flushes of the SSD, the HDD and DEV.
func devStats(path string) (map[string]jobDisks, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]jobDisks{}
	for i, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		if len(f) != 11 {
			return nil, fmt.Errorf("%s:%d: %q: want NAME DEV and 9 counts", path, i+1, l)
		}
		var n [9]int64
		for j := range n {
			if n[j], err = strconv.ParseInt(f[j+2], 10, 64); err != nil || n[j] < 0 {
				return nil, fmt.Errorf("%s:%d: %q: count %d is not a count", path, i+1, l, j+1)
			}
		}
		out[f[0]] = jobDisks{dev: f[1], ssd: diskReqs{n[0], n[1], n[2]}, hdd: diskReqs{n[3], n[4], n[5]}, top: diskReqs{n[6], n[7], n[8]}}
	}
	return out, nil
}

// clocksource returns the guest's clock source as guest.sh prints it.
func clocksource(console string) string {
	for _, l := range strings.Split(console, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "clocksource: "); ok {
			return v
		}
	}
	return "unknown"
}

// cpuRow is the server's CPU and the NBD requests over one measured step.
type cpuRow struct {
	job      string
	cpu      time.Duration
	requests int64
}

// userHZ is the unit of /proc/PID/stat's utime and stime on x86.
const userHZ = 100

// serverCPU parses guest.sh's tiercache-cpu-ROUND.txt: one "JOB CPU0 CPU1
// REQ0 REQ1" a line, CPU in clock ticks (utime + stime), requests as
// nbd0's completed reads + writes.
func serverCPU(path string) ([]cpuRow, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rows []cpuRow
	for i, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		if len(f) != 5 {
			return nil, fmt.Errorf("%s:%d: %q: want JOB CPU0 CPU1 REQ0 REQ1", path, i+1, l)
		}
		var n [4]int64
		for j := range n {
			if n[j], err = strconv.ParseInt(f[j+1], 10, 64); err != nil {
				return nil, fmt.Errorf("%s:%d: %v", path, i+1, err)
			}
		}
		if n[1] < n[0] || n[3] < n[2] {
			return nil, fmt.Errorf("%s:%d: %q: counters went backwards", path, i+1, l)
		}
		rows = append(rows, cpuRow{job: f[0], cpu: time.Duration(n[1]-n[0]) * time.Second / userHZ, requests: n[3] - n[2]})
	}
	return rows, nil
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// iops returns the read plus write IOPS of fio's JSON output.
func iops(path string) (float64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	// fio may print notes before the JSON.
	if i := strings.IndexByte(string(b), '{'); i > 0 {
		b = b[i:]
	}
	var out struct {
		Jobs []struct {
			Read  struct{ IOPS float64 } `json:"read"`
			Write struct{ IOPS float64 } `json:"write"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return 0, fmt.Errorf("%s: %v", path, err)
	}
	if len(out.Jobs) == 0 {
		return 0, fmt.Errorf("%s: no jobs", path)
	}
	return out.Jobs[0].Read.IOPS + out.Jobs[0].Write.IOPS, nil
}
