package model

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/tiercache/tiercache/device"
)

// Workload is a fio-like job for Run: QueueDepth workers issue requests of
// BlockSize bytes, sequential (one shared cursor, so concurrent requests
// are consecutive, as fio's iodepth gives) or uniformly random over
// [0, Span), until Total bytes have moved or Duration has passed.
type Workload struct {
	Name       string
	Write      bool
	Random     bool
	BlockSize  int64
	QueueDepth int
	Span       int64         // 0: the whole device
	Total      int64         // bytes; 0: until Duration
	Duration   time.Duration // model time; 0: until Total
	SyncEach   bool          // Sync after every write (fsync per write)
	Ramp       time.Duration // model time run before measuring (fio's ramp_time), not part of Duration
	Seed       uint64
}

// Result is what Run measured: figures in model time.
type Result struct {
	Workload
	Ops, Bytes int64
	Elapsed    time.Duration // model time
	MBps, IOPS float64       // MB is 1e6 bytes
	Stats      Stats         // the model's counters for the run (if a Model)
}

// Run drives d with w and measures it. scale is the device's TimeScale
// (wall time per model time; 0 means 1), so that results are in model time.
func Run(d device.Device, w Workload, scale float64) (Result, error) {
	if scale <= 0 {
		scale = 1
	}
	if w.BlockSize <= 0 || w.QueueDepth <= 0 {
		return Result{}, errors.New("model: workload needs a block size and a queue depth")
	}
	if w.Span <= 0 || w.Span > d.Size() {
		w.Span = d.Size()
	}
	if w.Span < w.BlockSize || (w.Total <= 0 && w.Duration <= 0) {
		return Result{}, errors.New("model: workload needs a span of at least one block and a total or a duration")
	}
	blocks := w.Span / w.BlockSize
	limit := int64(1<<62 - 1)
	if w.Total > 0 {
		limit = (w.Total + w.BlockSize - 1) / w.BlockSize
	}
	var before Stats
	m, isModel := d.(Model)
	if isModel {
		before = m.Stats()
	}
	var (
		next  atomic.Int64 // index of the next request
		done  atomic.Int64 // requests completed
		wg    sync.WaitGroup
		errMu sync.Mutex
		first error
	)
	wallLimit := time.Duration(float64(w.Duration+w.Ramp) * scale)
	start := time.Now()
	for q := range w.QueueDepth {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(w.Seed, uint64(q)))
			buf := make([]byte, w.BlockSize)
			for {
				i := next.Add(1) - 1
				if i >= limit || (w.Duration > 0 && time.Since(start) >= wallLimit) {
					return
				}
				off := i % blocks * w.BlockSize
				if w.Random {
					off = rng.Int64N(blocks) * w.BlockSize
				}
				var err error
				if w.Write {
					_, err = d.WriteAt(buf, off)
					if err == nil && w.SyncEach {
						err = d.Sync()
					}
				} else {
					_, err = d.ReadAt(buf, off)
				}
				if err != nil {
					errMu.Lock()
					if first == nil {
						first = err
					}
					errMu.Unlock()
					return
				}
				done.Add(1)
			}
		}()
	}
	// After the ramp, measuring starts afresh.
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	from, opsBefore := start, int64(0)
	if w.Ramp > 0 {
		ramp := time.NewTimer(time.Duration(float64(w.Ramp) * scale))
		select {
		case <-ramp.C:
			from, opsBefore = time.Now(), done.Load()
			if isModel {
				before = m.Stats()
			}
		case <-finished:
			ramp.Stop()
		}
	}
	<-finished
	wall := time.Since(from)
	r := Result{Workload: w, Ops: done.Load() - opsBefore}
	r.Bytes = r.Ops * w.BlockSize
	r.Elapsed = time.Duration(float64(wall) / scale)
	if s := r.Elapsed.Seconds(); s > 0 {
		r.MBps = float64(r.Bytes) / 1e6 / s
		r.IOPS = float64(r.Ops) / s
	}
	if isModel {
		r.Stats = diffStats(m.Stats(), before)
	}
	return r, first
}

func diffStats(a, b Stats) Stats {
	a.Reads -= b.Reads
	a.Writes -= b.Writes
	a.Syncs -= b.Syncs
	a.Discards -= b.Discards
	a.BytesRead -= b.BytesRead
	a.BytesWritten -= b.BytesWritten
	a.BufferHits -= b.BufferHits
	a.CachedWrites -= b.CachedWrites
	a.Destages -= b.Destages
	a.Seeks -= b.Seeks
	a.SeekTracks -= b.SeekTracks
	a.AgeForced -= b.AgeForced
	a.SeekTime -= b.SeekTime
	a.RotationalWait -= b.RotationalWait
	a.TransferTime -= b.TransferTime
	a.BusyTime -= b.BusyTime
	return a
}

// nullDevice holds no data: reads leave the buffer as it is, writes are
// dropped. Calibration measures the model, not the data path, and a null
// inner device lets it model a disk of any size in no memory.
type nullDevice struct{ size int64 }

func (n nullDevice) ReadAt(p []byte, off int64) (int, error)  { return len(p), nil }
func (n nullDevice) WriteAt(p []byte, off int64) (int, error) { return len(p), nil }
func (n nullDevice) Sync() error                              { return nil }
func (n nullDevice) Size() int64                              { return n.size }
func (n nullDevice) Close() error                             { return nil }
func (n nullDevice) String() string                           { return "null" }

// CalibrationRow is one line of the calibration table.
type CalibrationRow struct {
	Model     string // "hdd", "ssd", "nvme", "hdd (3 TB)"...
	Test      string
	Metric    string // "MB/s" or "IOPS"
	Value     float64
	Reference string // the real drive's published figure, with its source
	Result    Result
}

// CalibrationOptions choose how long Calibrate runs.
type CalibrationOptions struct {
	// TimeScale runs the models faster than real time (0: 1). Under
	// testing/synctest (virtual time) use 1 and the run takes seconds.
	TimeScale float64
	// Seconds is the model time each throughput test runs (0: 5 s for the
	// HDD, 1 s for the SSDs).
	Seconds float64
	// FragWrites is the number of 4 KiB fsync'd random writes of the
	// fragmentation experiment (0: 16384, 64 MiB as published).
	FragWrites int64
	// Only limits the run to the named models ("hdd", "ssd", "nvme").
	Only []string

	virtual bool
}

// Calibrate measures the default models with the standard table (fio-like
// jobs on a null inner device) and writes the table to w (if not nil).
func Calibrate(w io.Writer, o CalibrationOptions) ([]CalibrationRow, error) {
	if o.TimeScale <= 0 {
		o.TimeScale = 1
	}
	if o.FragWrites <= 0 {
		o.FragWrites = 16384
	}
	want := func(k string) bool {
		if len(o.Only) == 0 {
			return true
		}
		for _, x := range o.Only {
			if x == k {
				return true
			}
		}
		return false
	}
	var rows []CalibrationRow
	add := func(model, test, metric, ref string, r Result) {
		v := r.IOPS
		if metric == "MB/s" {
			v = r.MBps
		}
		rows = append(rows, CalibrationRow{Model: model, Test: test, Metric: metric, Value: v, Reference: ref, Result: r})
	}
	secs := func(def float64) time.Duration {
		if o.Seconds > 0 {
			def = o.Seconds
		}
		return time.Duration(def * float64(time.Second))
	}
	const (
		mib = 1 << 20
		gib = 1 << 30
	)
	type job struct {
		test, metric, ref string
		wl                Workload
	}
	run := func(name string, open func() (Model, error), jobs []job) error {
		for _, j := range jobs {
			d, err := open()
			if err != nil {
				return err
			}
			r, err := Run(d, j.wl, o.TimeScale)
			d.Close()
			if err != nil {
				return fmt.Errorf("%s %s: %w", name, j.test, err)
			}
			add(name, j.test, j.metric, j.ref, r)
		}
		return nil
	}

	if want(KindHDD) {
		hdd := func(capacity int64, wt bool) func() (Model, error) {
			return func() (Model, error) {
				p := DefaultHDD()
				p.TimeScale, p.virtual, p.WriteThrough = o.TimeScale, o.virtual, wt
				p.Capacity = capacity
				return NewHDD(nullDevice{8 * gib}, p)
			}
		}
		d := secs(5)
		seq := func(write bool, qd int) Workload {
			return Workload{Write: write, BlockSize: mib, QueueDepth: qd, Span: gib, Duration: d}
		}
		rnd := func(write bool, qd int) Workload {
			return Workload{Write: write, Random: true, BlockSize: 4096, QueueDepth: qd, Duration: d, Seed: 1}
		}
		ramped := func(w Workload) Workload { w.Ramp = 2 * time.Second; return w }
		first := func(w Workload) Workload { w.Duration = time.Second; return w }
		const seqRef = "137 (ext4, published experiment); datasheet 156 (per brief), 210 at OD"
		jobs := []job{
			{"seq read 1M QD1", "MB/s", seqRef, seq(false, 1)},
			{"seq read 1M QD32", "MB/s", seqRef, seq(false, 32)},
			{"seq write 1M QD1 (after 2 s ramp)", "MB/s", seqRef, ramped(seq(true, 1))},
			{"seq write 1M QD32 (after 2 s ramp)", "MB/s", seqRef, ramped(seq(true, 32))},
			{"rand read 4K QD1", "IOPS", "75-120 (7200 rpm: 1/(8.5+4.17 ms) = 79)", rnd(false, 1)},
			{"rand read 4K QD32", "IOPS", "no datasheet figure; NCQ roughly doubles QD1 (estimate)", rnd(false, 32)},
			{"rand write 4K QD1 (after 2 s ramp)", "IOPS", "no datasheet figure; 4K QD1 write benchmarks of 7200 rpm disks: ~1.2-1.5 MB/s (300-370 IOPS, estimate)", ramped(rnd(true, 1))},
			{"rand write 4K QD32 (after 2 s ramp)", "IOPS", "no datasheet figure", ramped(rnd(true, 32))},
			{"rand write 4K QD1, first 1 s (cache absorbs)", "IOPS", "", first(rnd(true, 1))},
		}
		if err := run("hdd 8 GiB", hdd(0, false), jobs); err != nil {
			return rows, err
		}
		wt := []job{
			{"rand write 4K QD1", "IOPS", "~ random read (write cache off)", rnd(true, 1)},
			{"seq write 1M QD1", "MB/s", "loses a revolution per request: ~1/(7.5+8.3 ms) x 1 MiB", seq(true, 1)},
			{"seq write 1M QD32", "MB/s", seqRef, seq(true, 32)},
		}
		if err := run("hdd 8 GiB, write cache off", hdd(0, true), wt); err != nil {
			return rows, err
		}
		frag := []job{{"64 MiB rand write 4K + fsync each, 1 GiB span", "IOPS", "not published (the experiment reports the result: 137 MB/s)",
			Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 1, Span: gib, Total: o.FragWrites * 4096, SyncEach: true, Seed: 2}},
			{"then seq read 1M QD1 of the 1 GiB", "MB/s", "137 (ext4 in place, published)", Workload{BlockSize: mib, QueueDepth: 1, Span: gib, Total: gib}},
		}
		if err := run("hdd 8 GiB", hdd(0, false), frag); err != nil {
			return rows, err
		}
		if err := run("hdd 3 TB (Capacity=3e12)", hdd(3e12, false), frag); err != nil {
			return rows, err
		}
	}
	ssdJobs := func(ref [6]string) []job {
		d := secs(1)
		return []job{
			{"seq read 1M QD32", "MB/s", ref[0], Workload{BlockSize: mib, QueueDepth: 32, Span: gib, Duration: d}},
			{"seq write 1M QD32", "MB/s", ref[1], Workload{Write: true, BlockSize: mib, QueueDepth: 32, Span: gib, Duration: d}},
			{"rand read 4K QD1", "IOPS", ref[2], Workload{Random: true, BlockSize: 4096, QueueDepth: 1, Duration: d, Seed: 3}},
			{"rand write 4K QD1", "IOPS", ref[3], Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 1, Duration: d, Seed: 3}},
			{"rand read 4K QD32", "IOPS", ref[4], Workload{Random: true, BlockSize: 4096, QueueDepth: 32, Duration: d, Seed: 3}},
			{"rand write 4K QD32", "IOPS", ref[5], Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 32, Duration: d, Seed: 3}},
		}
	}
	for _, k := range []struct {
		kind string
		ref  [6]string
	}{
		{KindSSD, [6]string{"550 (860 EVO datasheet)", "520", "10,000", "42,000", "98,000", "90,000"}},
		{KindNVMe, [6]string{"3,500 (970 EVO Plus 1 TB datasheet)", "3,300", "19,000", "60,000", "600,000 (QD32, 4 threads)", "550,000"}},
	} {
		if !want(k.kind) {
			continue
		}
		open := func() (Model, error) {
			base := SATASSD()
			if k.kind == KindNVMe {
				base = NVMeSSD()
			}
			base.TimeScale, base.virtual = o.TimeScale, o.virtual
			return NewSSD(nullDevice{8 * gib}, base)
		}
		if err := run(k.kind, open, ssdJobs(k.ref)); err != nil {
			return rows, err
		}
	}
	if w != nil {
		PrintCalibration(w, rows)
	}
	return rows, nil
}

// PrintCalibration writes rows as a table.
func PrintCalibration(w io.Writer, rows []CalibrationRow) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "model\ttest\tmodel figure\treference (real drive)\tmodel detail")
	for _, r := range rows {
		s := r.Result.Stats
		detail := fmt.Sprintf("%d ops in %.2fs", r.Result.Ops, r.Result.Elapsed.Seconds())
		if s.Seeks > 0 || s.BufferHits > 0 || s.Destages > 0 {
			detail += fmt.Sprintf(", %d seeks, %d buffer hits, %d destages", s.Seeks, s.BufferHits, s.Destages)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f %s\t%s\t%s\n", r.Model, r.Test, r.Value, r.Metric, r.Reference, detail)
	}
	tw.Flush()
}
