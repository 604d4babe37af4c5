package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"time"
)

// tcStats is the part of `tiercache stats --json` the suite reads. The
// counters are read as any JSON value and the numbers kept (numbers only):
// the admin API also reports flags (a degraded set, say) beside them.
type tcStats struct {
	Set     map[string]any `json:"set"`
	Exports []struct {
		Name   string         `json:"name"`
		Mode   string         `json:"mode"`
		Volume map[string]any `json:"volume"`
	} `json:"exports"`
}

// numbers keeps the numeric values of m, and its flags as 1 (true) or 0,
// under the engine's Go field names: the admin API names them in
// snake_case (read_hit_bytes; older servers sent ReadHitBytes), and
// bypass_write_bytes is BypassBytes.
func numbers(m map[string]any) map[string]float64 {
	out := make(map[string]float64, len(m))
	for k, v := range m {
		k = goName(k)
		switch x := v.(type) {
		case float64:
			out[k] = x
		case bool:
			out[k] = 0
			if x {
				out[k] = 1
			}
		}
	}
	return out
}

// goName turns an API counter name (dirty_blocks) into the engine's field
// name (DirtyBlocks); a name without underscores keeps its spelling but
// for the first letter.
func goName(k string) string {
	if k == "bypass_write_bytes" {
		return "BypassBytes"
	}
	var b strings.Builder
	for _, w := range strings.Split(k, "_") {
		if w != "" {
			b.WriteString(strings.ToUpper(w[:1]) + w[1:])
		}
	}
	return b.String()
}

// vol returns export vol's counters and the set's.
func (c *cacheRunner) stats(ctx context.Context, s *server) (vol, set map[string]float64, err error) {
	out, err := c.admin(ctx, s, "stats", "--json")
	if err != nil {
		return nil, nil, err
	}
	var st tcStats
	if err := json.Unmarshal(out, &st); err != nil {
		return nil, nil, fmt.Errorf("stats --json: %w", err)
	}
	for _, e := range st.Exports {
		if e.Name == "vol" {
			return numbers(e.Volume), numbers(st.Set), nil
		}
	}
	return nil, nil, fmt.Errorf("stats --json: no export vol")
}

func delta(a, b map[string]float64, k string) float64 { return b[k] - a[k] }

func mib(b float64) string { return fmt.Sprintf("%.1f MiB", b/(1<<20)) }

func pct(x float64) string { return fmt.Sprintf("%.0f %%", 100*x) }

func yesNo(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}

func ratioOf(a, b float64) float64 {
	if b <= 0 || math.IsNaN(a) || math.IsNaN(b) {
		return math.NaN()
	}
	return a / b
}

// ---------------------------------------------------------------- S1

func (c *cacheRunner) s1(ctx context.Context) error {
	sz := c.sz
	read := job{Name: "s1-seqread-1m-qd1", RW: "read", BS: 1 << 20, QD: 1, Size: sz.Backing, Metric: MetricMiBps}
	writes := job{Name: "s1-randwrite-4k-fsync", RW: "randwrite", BS: 4096, QD: 1, Size: sz.Backing, IOSize: sz.S1Writes, Fsync: true, Seed: 5, Metric: MetricIOPS}
	type res struct {
		before, after, iops float64
		befores, afters     []float64
		n                   int64
		drain               time.Duration
		dirty, hitAfter     float64
		srv                 *server
	}
	results := map[string]*res{}
	targets := []string{"HDD model", "tiercache"}
	// Both targets stay up from the first read to the last: the reads
	// before the writes and after them alternate between the two
	// (S1Pairs times each), so that the load of a shared machine, which
	// slows the real-clock models by a fifth within minutes, weighs on both
	// alike. The HDD model writes in place, so its read beside tiercache's
	// stands for the machine's speed at that moment (the side-by-side
	// ratios).
	defer func() {
		for _, r := range results {
			if r.srv != nil {
				_ = c.discard(r.srv) // nothing is measured after; the HDD model need not destage
			}
		}
	}()
	for _, target := range targets {
		var srv *server
		var err error
		if target == "HDD model" {
			srv, err = c.plainHDD(ctx, "s1-hdd")
		} else {
			srv, err = c.cached(ctx, "s1-tc", "ssd", "hdd", "writeback", sz.SmallCache)
		}
		if err != nil {
			return err
		}
		results[target] = &res{srv: srv}
	}
	// reads runs the alternating sequential reads of phase ("before" or
	// "after") and keeps each target's values in pair order.
	reads := func(phase string) error {
		for pair := 1; pair <= sz.S1Pairs; pair++ {
			for _, target := range rotate(targets, pair-1) {
				r := results[target]
				a, err := c.fio(ctx, r.srv, read, fmt.Sprintf("s1-%s-%s%d", strings.ReplaceAll(target, " ", "-"), phase, pair))
				if err != nil {
					return err
				}
				v := a.res.BW / 1e6
				note := ""
				if phase == "before" {
					r.befores = append(r.befores, v)
				} else {
					r.afters = append(r.afters, v)
					note = fmt.Sprintf(" (%.0f %% of before)", 100*v/r.before)
				}
				c.add(Figure{Scenario: "S1", Target: target, Test: fmt.Sprintf("seq read 1 MiB QD1 %s (%d of %d, alternating)", phase, pair, sz.S1Pairs), Value: v, Unit: "MB/s", LatMeanUs: a.res.LatMeanUs, LatP99Us: a.res.LatP99Us})
				c.progress("S1", fmt.Sprintf("%s sequential read %s (%d/%d)", target, phase, pair, sz.S1Pairs), fmt.Sprintf("%.1f MB/s%s", v, note))
			}
		}
		return nil
	}
	if err := reads("before"); err != nil {
		return err
	}
	for _, r := range results {
		r.before, _ = median(r.befores)
	}
	for _, target := range targets {
		r := results[target]
		srv := r.srv
		w := writes
		if target == "HDD model" {
			w.Runtime = sz.S1HDDTime
		}
		wr, err := c.fio(ctx, srv, w, "s1-"+strings.ReplaceAll(target, " ", "-"))
		if err != nil {
			return err
		}
		r.iops = wr.res.IOPS
		r.n = wr.res.Bytes / 4096
		c.add(Figure{Scenario: "S1", Target: target, Test: "4 KiB random writes, fsync each", Value: r.iops, Unit: "IOPS", LatMeanUs: wr.res.LatMeanUs, LatP99Us: wr.res.LatP99Us,
			Note: fmt.Sprintf("%d writes in %.1f s", r.n, wr.res.RuntimeSec)})
		c.progress("S1", target+" fsync'd 4K random writes", fmt.Sprintf("%.0f IOPS, %d writes in %.1f s", r.iops, r.n, wr.res.RuntimeSec))

		if target == "tiercache" {
			v0, _, err := c.stats(ctx, srv)
			if err != nil {
				return err
			}
			r.dirty = v0["DirtyBlocks"]
			// The drain is not what S1 measures (S4 times the two
			// orders): whichever order writes the blocks back, each
			// lands at its own LBA, so the layout read afterwards is
			// the same. Sorted, it takes ~10 s instead of ~115 s in
			// arrival order. The writes above ran in the default
			// (epoch) order.
			if err := c.set(ctx, srv, "writeback_order=lba"); err != nil {
				return err
			}
			d, err := c.flush(ctx, srv)
			if err != nil {
				return err
			}
			r.drain = d
			v1, _, err := c.stats(ctx, srv)
			if err != nil {
				return err
			}
			c.add(Figure{Scenario: "S1", Target: target, Test: "drain (tiercache flush, lba order)", Value: d.Seconds(), Unit: "s",
				Note: fmt.Sprintf("%.0f dirty blocks before, %.0f after", r.dirty, v1["DirtyBlocks"])})
			c.progress("S1", "tiercache drain (flush, lba order)", fmt.Sprintf("%.0f dirty 4K blocks in %.1f s, %.0f left", r.dirty, d.Seconds(), v1["DirtyBlocks"]))
		}
	}
	v0, _, err := c.stats(ctx, results["tiercache"].srv)
	if err != nil {
		return err
	}
	if err := reads("after"); err != nil {
		return err
	}
	for _, r := range results {
		r.after, _ = median(r.afters)
	}
	v1, _, err := c.stats(ctx, results["tiercache"].srv)
	if err != nil {
		return err
	}
	results["tiercache"].hitAfter = delta(v0, v1, "ReadHitBytes")
	hitNote := fmt.Sprintf("Of the %s tiercache read after the writes: %s cache hits, %s bypassed as sequential, %s misses.", mib(delta(v0, v1, "ReadBytes")),
		mib(delta(v0, v1, "ReadHitBytes")), mib(delta(v0, v1, "BypassSequentialBytes")), mib(delta(v0, v1, "ReadMissBytes")))
	rows := [][]string{{"Target", "Seq read before MB/s", "fsync'd 4K writes", "Write IOPS", "Drain", "Seq read after MB/s", "After / before"}}
	for _, t := range targets {
		r := results[t]
		drain := "– (in place)"
		if t == "tiercache" {
			drain = fmt.Sprintf("%.1f s (%.0f blocks, lba order)", r.drain.Seconds(), r.dirty)
		}
		rows = append(rows, []string{t, fmt.Sprintf("%.1f", r.before), fmt.Sprint(r.n), fmt.Sprintf("%.0f", r.iops), drain, fmt.Sprintf("%.1f", r.after), pct(r.after / r.before)})
	}
	rows = append(rows, []string{"seed: ext4 (in place)", "137", "16,384", "–", "–", "137", "100 %"}, []string{"seed: Btrfs (CoW)", "137", "16,384", "–", "–", "16", "12 %"})
	c.details = append(c.details, detail{Scenario: "S1", Title: "S1 fragmentation: 4 KiB fsync'd random writes into the first 1 GiB, then a sequential read", Rows: rows,
		Notes: []string{fmt.Sprintf("The plain HDD model's write phase is capped at %v (it writes in place, so how many writes it gets does not change the read after); tiercache does all %d MiB.", sz.S1HDDTime, sz.S1Writes>>20),
			fmt.Sprintf("\"Before\" and \"after\" are the medians of %d reads per target, alternating between the two servers (both stay up). %s", sz.S1Pairs, hitNote)}})
	tc, hdd := results["tiercache"], results["HDD model"]
	// The medians of the pairs' ratios: a stall that hits one read of a
	// pair (the machine is shared) moves one ratio, not the median.
	pairRatios := func(a, b []float64) (float64, string) {
		var rs []float64
		for i := range min(len(a), len(b)) {
			rs = append(rs, ratioOf(a[i], b[i]))
		}
		m, _ := median(rs)
		txt := make([]string, len(rs))
		for i, x := range rs {
			txt[i] = fmt.Sprintf("%.2f", x)
		}
		return m, strings.Join(txt, ", ")
	}
	sideBefore, beforeText := pairRatios(tc.befores, hdd.befores)
	sideAfter, afterText := pairRatios(tc.afters, hdd.afters)
	rt := hdd.after / hdd.before
	c.checks = append(c.checks, Check{Scenario: "S1", What: "HDD model: sequential read after the random writes / before",
		Seed: "ext4 137 → 137 MB/s (100 %); Btrfs CoW 16 MB/s (12 %, −88 %)",
		Ours: fmt.Sprintf("%.1f → %.1f MB/s (in place: this is how far the machine moved between the two)", hdd.before, hdd.after), Ratio: rt, Bar: "≥ 0.95", Met: yesNo(rt >= 0.95)})
	// tiercache's own after/before moves with the machine as the HDD
	// model's does; against the HDD model's reads beside it, what is left
	// is what the writes did to tiercache's layout.
	frag := ratioOf(sideAfter, sideBefore)
	c.checks = append(c.checks, Check{Scenario: "S1", What: "tiercache: sequential read after the random writes / before, each against the HDD model's read beside it",
		Seed:  "ext4 137 → 137 MB/s (100 %); Btrfs CoW 16 MB/s (12 %, −88 %)",
		Ours:  fmt.Sprintf("%.1f → %.1f MB/s; tiercache / HDD model %.2f before (pairs %s), %.2f after", tc.before, tc.after, sideBefore, beforeText, sideAfter),
		Ratio: frag, Bar: "≥ 0.95", Met: yesNo(frag >= 0.95)})
	c.checks = append(c.checks, Check{Scenario: "S1", What: "sequential read after the random writes, tiercache / HDD model (side by side: median of the alternating pairs' ratios)",
		Seed: "ext4 in place 137 MB/s vs Btrfs CoW 16 MB/s (12 %)", Ours: fmt.Sprintf("medians %.1f vs %.1f MB/s; pairs %s", tc.after, hdd.after, afterText),
		Ratio: sideAfter, Bar: "≥ 0.95", Met: yesNo(sideAfter >= 0.95)})
	c.checks = append(c.checks, Check{Scenario: "S1", What: "fsync'd 4K random writes, tiercache (writeback) / HDD model",
		Seed: "– (not published)", Ours: fmt.Sprintf("%.0f vs %.0f IOPS", tc.iops, hdd.iops), Ratio: ratioOf(tc.iops, hdd.iops), Bar: "–", Met: "–"})
	return chartGroups(c.chartPath("s1.png"), "S1: sequential read (1 MiB QD1) before and after 4 KiB fsync'd random writes", "MB/s",
		targets, []string{"before", "after"}, [][]float64{{hdd.before, tc.before}, {hdd.after, tc.after}}, nil)
}

// ---------------------------------------------------------------- S2

var s2Modes = []string{"none", "writethrough", "writearound", "writeback"}

// s2Jobs are S2's runs. Only the jobs that write have a ramp (Ramp skips
// the HDD model's write-cache burst, ~1 s of 16 MiB at interface speed);
// a read job has no transient to skip (the cache is cold and the HDD
// model's queue fills in its first milliseconds), so its ramp would only
// cost time. S3 likewise.
func s2Jobs(sz cacheSizes) []job {
	return []job{
		{Name: "seqread-1m-qd1", Title: "seq read 1 MiB QD1", RW: "read", BS: 1 << 20, QD: 1, Size: sz.Backing, Runtime: sz.Runtime, Metric: MetricMiBps},
		{Name: "randread-4k-qd32", Title: "rand read 4 KiB QD32", RW: "randread", BS: 4096, QD: 32, Size: sz.Backing, Runtime: sz.Runtime, Metric: MetricIOPS},
		{Name: "randwrite-4k-qd32", Title: "rand write 4 KiB QD32", RW: "randwrite", BS: 4096, QD: 32, Size: sz.Backing, Runtime: sz.Runtime, Ramp: sz.Ramp, Metric: MetricIOPS},
		{Name: "randrw-4k-qd32", Title: "mixed 4 KiB QD32 (50 % reads)", RW: "randrw", BS: 4096, QD: 32, Size: sz.Backing, Runtime: sz.Runtime, Ramp: sz.Ramp, Metric: MetricIOPS},
	}
}

func (c *cacheRunner) s2(ctx context.Context) error {
	jobs := s2Jobs(c.sz)
	vals := map[string]map[string]float64{} // mode → job → value
	bypassRows := [][]string{{"Mode", "Seq read: bytes read", "bypassed (sequential)", "cache hits", "promoted", "Whole run: bypass sequential / mode / congestion / cache full", "Write bytes", "Dirty at end"}}
	for _, mode := range s2Modes {
		srv, err := c.cached(ctx, "s2-"+mode, "ssd", "hdd", mode, c.sz.S2Cache)
		if err != nil {
			return err
		}
		vals[mode] = map[string]float64{}
		start, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		var afterSeq map[string]float64
		for i, j := range jobs {
			fr, err := c.fio(ctx, srv, j, "s2-"+mode)
			if err != nil {
				return err
			}
			v := fr.value(j.Metric)
			vals[mode][j.Name] = v
			c.add(Figure{Scenario: "S2", Target: mode, Test: j.Title, Value: v, Unit: j.Metric.String(), LatMeanUs: fr.res.LatMeanUs, LatP99Us: fr.res.LatP99Us, ServerCPU: fr.cpuPerGiB()})
			extra := ""
			if i == 0 {
				if afterSeq, _, err = c.stats(ctx, srv); err != nil {
					return err
				}
				extra = fmt.Sprintf(" (read %s: %s bypassed as sequential, %s hits, %s promoted)", mib(delta(start, afterSeq, "ReadBytes")),
					mib(delta(start, afterSeq, "BypassSequentialBytes")), mib(delta(start, afterSeq, "ReadHitBytes")), mib(delta(start, afterSeq, "PromoteBytes")))
			}
			c.progress("S2", mode+" "+j.Title, fmt.Sprintf("%s %s%s", formatValue(v), j.Metric, extra))
		}
		end, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		bypassRows = append(bypassRows, []string{mode, mib(delta(start, afterSeq, "ReadBytes")), mib(delta(start, afterSeq, "BypassSequentialBytes")),
			mib(delta(start, afterSeq, "ReadHitBytes")), mib(delta(start, afterSeq, "PromoteBytes")),
			fmt.Sprintf("%s / %s / %s / %s", mib(end["BypassSequentialBytes"]), mib(end["BypassModeBytes"]), mib(end["BypassCongestionBytes"]), mib(end["BypassCacheFullBytes"])),
			mib(end["WriteBytes"]), fmt.Sprintf("%.0f blocks", end["DirtyBlocks"])})
		if err := c.discard(srv); err != nil {
			return err
		}
	}
	head := []string{"Workload", "Unit"}
	head = append(head, s2Modes...)
	for _, m := range s2Modes[1:] {
		head = append(head, m+"/none")
	}
	rows := [][]string{head}
	ratios := make([][]float64, len(s2Modes)-1)
	groups := make([]string, len(jobs))
	for ji, j := range jobs {
		groups[ji] = j.Name
		row := []string{j.Title, j.Metric.String()}
		for _, m := range s2Modes {
			row = append(row, formatValue(vals[m][j.Name]))
		}
		for mi, m := range s2Modes[1:] {
			r := ratioOf(vals[m][j.Name], vals["none"][j.Name])
			ratios[mi] = append(ratios[mi], r)
			row = append(row, fmt.Sprintf("%.2f", r))
		}
		rows = append(rows, row)
	}
	c.details = append(c.details, detail{Scenario: "S2", Title: "S2 cache modes (SATA SSD model in front of the HDD model, fresh cache set per mode, cold cache)", Rows: rows},
		detail{Scenario: "S2", Title: "S2 why sequential reads bypass: `tiercache stats --json` around the sequential read, and for the whole run", Rows: bypassRows})
	seq := jobs[0].Name
	for _, m := range s2Modes[1:] {
		r := ratioOf(vals[m][seq], vals["none"][seq])
		c.checks = append(c.checks, Check{Scenario: "S2", What: "sequential read, " + m + " / none",
			Seed: "bcache: 4K reads at QD32 no gain in any mode (bypassed)", Ours: fmt.Sprintf("%.1f vs %.1f MiB/s", vals[m][seq], vals["none"][seq]),
			Ratio: r, Bar: "0.95–1.05", Met: yesNo(r >= 0.95 && r <= 1.05)})
	}
	rw := jobs[2].Name
	r := ratioOf(vals["writeback"][rw], vals["none"][rw])
	c.checks = append(c.checks, Check{Scenario: "S2", What: "4K random write QD32, writeback / none",
		Seed: "bcache pgbench: 885–946 TPS (none/wt/wa) vs 2,251–2,742 (writeback), 2.4–2.9x", Ours: fmt.Sprintf("%.0f vs %.0f IOPS", vals["writeback"][rw], vals["none"][rw]),
		Ratio: r, Bar: "≥ 10", Met: yesNo(r >= 10)})
	for _, j := range []job{jobs[1], jobs[3]} {
		for _, m := range s2Modes[1:] {
			c.checks = append(c.checks, Check{Scenario: "S2", What: j.Title + ", " + m + " / none (cold cache)", Seed: "–",
				Ours: fmt.Sprintf("%s vs %s %s", formatValue(vals[m][j.Name]), formatValue(vals["none"][j.Name]), j.Metric), Ratio: ratioOf(vals[m][j.Name], vals["none"][j.Name]), Bar: "–", Met: "–"})
		}
	}
	return chartGroups(c.chartPath("s2.png"), "S2: each mode relative to none (cold cache, fio via NBD)", "x none",
		groups, s2Modes[1:], ratios, nil)
}

// ---------------------------------------------------------------- S3

func s3Jobs(sz cacheSizes) []job {
	return []job{
		{Name: "randread-4k-qd32", Title: "rand read 4 KiB QD32", RW: "randread", BS: 4096, QD: 32, Size: sz.S3Region, Runtime: sz.Runtime, Metric: MetricIOPS},
		{Name: "randread-256k-qd8", Title: "rand read 256 KiB QD8", RW: "randread", BS: 256 << 10, QD: 8, Size: sz.S3Region, Runtime: sz.Runtime, Metric: MetricMiBps},
		{Name: "randrw-4k-qd32", Title: "randrw 4 KiB QD32 (50 % reads)", RW: "randrw", BS: 4096, QD: 32, Size: sz.S3Region, Runtime: sz.Runtime, Ramp: sz.Ramp, Metric: MetricIOPS},
		{Name: "randrw-64k-qd8", Title: "randrw 64 KiB QD8 (50 % reads)", RW: "randrw", BS: 64 << 10, QD: 8, Size: sz.S3Region, Runtime: sz.Runtime, Ramp: sz.Ramp, Metric: MetricMiBps},
	}
}

func (c *cacheRunner) s3(ctx context.Context) error {
	jobs := s3Jobs(c.sz)
	vals := map[string]map[string]float64{}
	targets := []string{"HDD model (no cache)", "tiercache (NVMe model, warm)"}
	hitNote := ""
	for ti, target := range targets {
		var srv *server
		var err error
		if ti == 0 {
			srv, err = c.plainHDD(ctx, "s3-hdd")
		} else {
			srv, err = c.cached(ctx, "s3-tc", "nvme", "hdd", "writeback", c.sz.S3Cache)
		}
		if err != nil {
			return err
		}
		vals[target] = map[string]float64{}
		var v0 map[string]float64
		if ti == 1 {
			// Warm: read the working set once, sequentially, with the
			// sequential cutoff off so that it is promoted.
			if err := c.set(ctx, srv, "sequential_cutoff=0"); err != nil {
				return err
			}
			warm := job{Name: "warm-read-1m-qd8", RW: "read", BS: 1 << 20, QD: 8, Size: c.sz.S3Region, Metric: MetricMiBps}
			fr, err := c.fio(ctx, srv, warm, "s3")
			if err != nil {
				return err
			}
			if err := c.set(ctx, srv, "sequential_cutoff=4M"); err != nil {
				return err
			}
			if v0, _, err = c.stats(ctx, srv); err != nil {
				return err
			}
			c.add(Figure{Scenario: "S3", Target: target, Test: "warm: sequential read of the working set", Value: fr.value(MetricMiBps), Unit: "MiB/s",
				Note: fmt.Sprintf("%s promoted, %.0f blocks cached", mib(v0["PromoteBytes"]), v0["CachedBlocks"])})
			c.progress("S3", "warm the cache", fmt.Sprintf("%s read at %.0f MiB/s, %s promoted", mib(float64(c.sz.S3Region)), fr.value(MetricMiBps), mib(v0["PromoteBytes"])))
		}
		for _, j := range jobs {
			fr, err := c.fio(ctx, srv, j, "s3-"+fmt.Sprint(ti))
			if err != nil {
				return err
			}
			v := fr.value(j.Metric)
			vals[target][j.Name] = v
			c.add(Figure{Scenario: "S3", Target: target, Test: j.Title, Value: v, Unit: j.Metric.String(), LatMeanUs: fr.res.LatMeanUs, LatP99Us: fr.res.LatP99Us})
			c.progress("S3", target+" "+j.Title, fmt.Sprintf("%s %s", formatValue(v), j.Metric))
		}
		if ti == 1 {
			v1, _, err := c.stats(ctx, srv)
			if err != nil {
				return err
			}
			rb := delta(v0, v1, "ReadBytes")
			hitNote = fmt.Sprintf("During the measured runs tiercache read %s, %s of it cache hits (%s); misses %s, bypassed %s.", mib(rb), mib(delta(v0, v1, "ReadHitBytes")),
				pct(ratioOf(delta(v0, v1, "ReadHitBytes"), rb)), mib(delta(v0, v1, "ReadMissBytes")), mib(delta(v0, v1, "BypassBytes")))
		}
		if err := c.discard(srv); err != nil {
			return err
		}
	}
	seeds := map[string][3]string{ // seed text, bar text, bar value
		"randread-4k-qd32":  {"bcachefs 2,128 vs 264 IOPS (8.1x)", "≥ 8", "8"},
		"randread-256k-qd8": {"bcachefs 490 vs 55 MiB/s (8.9x)", "–", ""},
		"randrw-4k-qd32":    {"bcachefs ~3,050 vs ~270 IOPS (11x)", "≥ 10", "10"},
		"randrw-64k-qd8":    {"–", "≥ 10", "10"},
	}
	rows := [][]string{{"Workload", "Unit", targets[0], targets[1], "Speed-up", "Seed"}}
	var sp []float64
	var groups []string
	for _, j := range jobs {
		a, b := vals[targets[1]][j.Name], vals[targets[0]][j.Name]
		r := ratioOf(a, b)
		sp = append(sp, r)
		groups = append(groups, j.Name)
		s := seeds[j.Name]
		rows = append(rows, []string{j.Title, j.Metric.String(), formatValue(b), formatValue(a), fmt.Sprintf("%.1fx", r), s[0]})
		met := "–"
		if s[2] != "" {
			var bar float64
			fmt.Sscan(s[2], &bar)
			met = yesNo(r >= bar)
		}
		c.checks = append(c.checks, Check{Scenario: "S3", What: j.Title + ", warm cache / no cache", Seed: s[0],
			Ours: fmt.Sprintf("%s vs %s %s", formatValue(a), formatValue(b), j.Metric), Ratio: r, Bar: s[1], Met: met})
	}
	c.details = append(c.details, detail{Scenario: "S3", Title: fmt.Sprintf("S3 warm cache: %d MiB working set, read once before the runs", c.sz.S3Region>>20), Rows: rows, Notes: []string{hitNote}})
	return chartGroups(c.chartPath("s3.png"), "S3: warm cache speed-up over the HDD model (higher is better)", "x no cache",
		groups, []string{"tiercache / HDD"}, [][]float64{sp}, []float64{8, 10})
}

// ---------------------------------------------------------------- S4

// S4 fills the cache with 4 KiB random writes, each followed by an fsync
// (one flush epoch per write, as a database commits), with background
// writeback held, then times `tiercache flush` in each writeback order:
// epoch (oldest epoch first, a backing sync between epochs: arrival order)
// and lba (one sorted sweep). As a reference the same writes (same fio seed)
// go straight to the HDD model in arrival order, once at QD32 ending with
// one fsync (the drive's NCQ and write cache reorder what they can) and once
// at QD1 with an fsync after each write (the order epoch writeback keeps).
func (c *cacheRunner) s4(ctx context.Context) error {
	fill := job{Name: "s4-randwrite-4k-fsync", RW: "randwrite", BS: 4096, QD: 1, Size: c.sz.Backing, IOSize: c.sz.S4Writes, Fsync: true, Seed: 7, Metric: MetricIOPS}
	type res struct {
		fillIOPS float64
		dirty    float64
		secs     float64
	}
	results := map[string]*res{}
	orders := []string{"lba", "epoch"}
	for _, order := range orders {
		srv, err := c.cached(ctx, "s4-"+order, "ssd", "hdd", "writeback", c.sz.SmallCache)
		if err != nil {
			return err
		}
		// Hold background writeback (capped at 1 byte/s) while the
		// writes arrive; flush (Drain) is not capped.
		if err := c.set(ctx, srv, "writeback_rate_max=1", "writeback_order="+order); err != nil {
			return err
		}
		fr, err := c.fio(ctx, srv, fill, "s4-"+order)
		if err != nil {
			return err
		}
		v0, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		r := &res{fillIOPS: fr.res.IOPS, dirty: v0["DirtyBlocks"]}
		c.progress("S4", "fill the cache (writeback_order="+order+")", fmt.Sprintf("%.0f IOPS, %.0f dirty blocks (%.0f written back already)", fr.res.IOPS, r.dirty, v0["WritebackBytes"]/4096))
		d, err := c.flush(ctx, srv)
		if err != nil {
			return err
		}
		r.secs = d.Seconds()
		results[order] = r
		v1, _, err := c.stats(ctx, srv)
		if err != nil {
			return err
		}
		c.add(Figure{Scenario: "S4", Target: "tiercache writeback_order=" + order, Test: "drain (tiercache flush)", Value: r.secs, Unit: "s",
			Note: fmt.Sprintf("%.0f dirty blocks, %s written back, %.0f left", r.dirty, mib(delta(v0, v1, "WritebackBytes")), v1["DirtyBlocks"])})
		c.progress("S4", "drain (writeback_order="+order+")", fmt.Sprintf("%.0f blocks in %.2f s (%.0f blocks/s), %.0f left", r.dirty, r.secs, r.dirty/r.secs, v1["DirtyBlocks"]))
		if err := c.stop(srv); err != nil {
			return err
		}
	}
	type replayRes struct {
		name string
		n    float64
		secs float64
	}
	var replays []replayRes
	q32 := fill
	q32.Name, q32.QD, q32.Fsync, q32.EndSync = "s4-replay-qd32", 32, false, true
	q1 := fill
	q1.Name = "s4-replay-qd1-fsync"
	for _, rj := range []struct {
		j    job
		name string
	}{{q32, "direct to the HDD model, arrival order, QD32, one fsync at the end"}, {q1, "direct to the HDD model, arrival order, QD1, fsync after each"}} {
		srv, err := c.plainHDD(ctx, "s4-hdd")
		if err != nil {
			return err
		}
		fr, err := c.fio(ctx, srv, rj.j, "s4-hdd")
		if err != nil {
			return err
		}
		if err := c.stop(srv); err != nil {
			return err
		}
		n := float64(fr.res.Bytes / 4096)
		rsec := fr.wall.Seconds()
		replays = append(replays, replayRes{rj.name, n, rsec})
		c.add(Figure{Scenario: "S4", Target: "HDD model", Test: rj.name, Value: rsec, Unit: "s",
			Note: fmt.Sprintf("%.0f writes, fio runtime %.2f s, %.0f IOPS (time is fio's wall time)", n, fr.res.RuntimeSec, fr.res.IOPS)})
		c.progress("S4", rj.name, fmt.Sprintf("%.0f writes in %.2f s (%.0f/s)", n, rsec, n/rsec))
	}
	lba, epoch := results["lba"], results["epoch"]
	rows := [][]string{{"Way to the HDD", "Blocks", "Time s", "Blocks/s", "Time vs lba drain"}}
	for _, o := range orders {
		r := results[o]
		rows = append(rows, []string{"tiercache flush, writeback_order=" + o, fmt.Sprintf("%.0f", r.dirty), fmt.Sprintf("%.2f", r.secs), fmt.Sprintf("%.0f", r.dirty/r.secs), fmt.Sprintf("%.1fx", r.secs/lba.secs)})
	}
	for _, rp := range replays {
		rows = append(rows, []string{"same writes " + rp.name, fmt.Sprintf("%.0f", rp.n), fmt.Sprintf("%.2f", rp.secs), fmt.Sprintf("%.0f", rp.n/rp.secs), fmt.Sprintf("%.1fx", rp.secs/lba.secs)})
	}
	c.details = append(c.details, detail{Scenario: "S4", Title: fmt.Sprintf("S4 writeback drain: %d MiB of 4 KiB random writes, fsync after each, over the first %d MiB of a %d MiB HDD model", c.sz.S4Writes>>20, c.sz.Backing>>20, c.sz.Disk>>20), Rows: rows,
		Notes: []string{fmt.Sprintf("Fill rate through tiercache (SATA SSD model): %.0f IOPS (lba run), %.0f IOPS (epoch run). Background writeback was held with writeback_rate_max=1 during the fill; flush is not capped. Each fsync closes a flush epoch, so epoch order writes the blocks back in arrival order with a backing sync between epochs.", lba.fillIOPS, epoch.fillIOPS)}})
	c.checks = append(c.checks, Check{Scenario: "S4", What: "drain time: arrival order (writeback_order=epoch) / LBA-sorted (lba)", Seed: "– (no seed)",
		Ours: fmt.Sprintf("%.2f s vs %.2f s", epoch.secs, lba.secs), Ratio: epoch.secs / lba.secs, Bar: "–", Met: "–"})
	for _, rp := range replays {
		c.checks = append(c.checks, Check{Scenario: "S4", What: "time: same writes " + rp.name + " / lba drain", Seed: "–",
			Ours: fmt.Sprintf("%.2f s vs %.2f s", rp.secs, lba.secs), Ratio: rp.secs / lba.secs, Bar: "–", Met: "–"})
	}
	return chartGroups(c.chartPath("s4.png"), "S4: time to put the same fsync'd random writes on the HDD model (lower is better)", "seconds",
		[]string{"flush lba", "flush epoch", "direct QD32", "direct QD1+fsync"}, []string{"time"}, [][]float64{{lba.secs, epoch.secs, replays[0].secs, replays[1].secs}}, nil)
}

// ---------------------------------------------------------------- S5

func s5Jobs(sz cacheSizes) []job {
	return []job{
		{Name: "randread-4k-qd1", Title: "rand read 4 KiB QD1", RW: "randread", BS: 4096, QD: 1, Size: sz.S5Region, Runtime: sz.S5Runtime, Ramp: sz.S5Ramp, Metric: MetricIOPS},
		{Name: "randread-4k-qd32", Title: "rand read 4 KiB QD32", RW: "randread", BS: 4096, QD: 32, Size: sz.S5Region, Runtime: sz.S5Runtime, Ramp: sz.S5Ramp, Metric: MetricIOPS},
		{Name: "read-1m-qd8", Title: "seq read 1 MiB QD8", RW: "read", BS: 1 << 20, QD: 8, Size: sz.S5Region, Runtime: sz.S5Runtime, Ramp: sz.S5Ramp, Metric: MetricMiBps},
	}
}

func (c *cacheRunner) s5(ctx context.Context) error {
	jobs := s5Jobs(c.sz)
	tc, err := c.cached(ctx, "s5", "", "", "writeback", c.sz.S3Cache)
	if err != nil {
		return err
	}
	backing := filepath.Join(c.workdir, "s5", "hdd.img")
	qsock := filepath.Join(c.workdir, "s5", "qemu.sock")
	qargv, err := serverArgv("qemu-nbd", "", backing, qsock)
	if err != nil {
		return err
	}
	q, err := c.startServer(ctx, "qemu-nbd", exportName, qsock, "", qargv)
	if err != nil {
		return err
	}
	if err := c.set(ctx, tc, "sequential_cutoff=0"); err != nil {
		return err
	}
	warm := job{Name: "warm-read-1m-qd8", RW: "read", BS: 1 << 20, QD: 8, Size: c.sz.S5Region, Metric: MetricMiBps}
	if _, err := c.fio(ctx, tc, warm, "s5"); err != nil {
		return err
	}
	if err := c.set(ctx, tc, "sequential_cutoff=4M"); err != nil {
		return err
	}
	v0, _, err := c.stats(ctx, tc)
	if err != nil {
		return err
	}
	c.progress("S5", "warm the cache", fmt.Sprintf("%s promoted", mib(v0["PromoteBytes"])))
	servers := map[string]*server{"tiercache": tc, "qemu-nbd": q}
	names := []string{"tiercache", "qemu-nbd"}
	samples := map[string]map[string][]float64{"tiercache": {}, "qemu-nbd": {}}
	cpu := map[string]map[string][]float64{"tiercache": {}, "qemu-nbd": {}}
	for round := 1; round <= c.sz.S5Rounds; round++ {
		for _, name := range rotate(names, round-1) {
			for _, j := range jobs {
				fr, err := c.fio(ctx, servers[name], j, fmt.Sprintf("s5-r%d-%s", round, name))
				if err != nil {
					return err
				}
				v := fr.value(j.Metric)
				samples[name][j.Name] = append(samples[name][j.Name], v)
				cpu[name][j.Name] = append(cpu[name][j.Name], fr.cpuPerGiB())
				c.add(Figure{Scenario: "S5", Target: name, Test: j.Title, Value: v, Unit: j.Metric.String(), Round: round, LatMeanUs: fr.res.LatMeanUs, LatP99Us: fr.res.LatP99Us, ServerCPU: fr.cpuPerGiB()})
				c.progress("S5", fmt.Sprintf("round %d/%d %s %s", round, c.sz.S5Rounds, name, j.Title), fmt.Sprintf("%s %s, server %.2f CPU s/GiB", formatValue(v), j.Metric, fr.cpuPerGiB()))
			}
		}
	}
	v1, _, err := c.stats(ctx, tc)
	if err != nil {
		return err
	}
	rb := delta(v0, v1, "ReadBytes")
	hit := ratioOf(delta(v0, v1, "ReadHitBytes"), rb)
	for _, s := range []*server{tc, q} {
		if err := c.discard(s); err != nil {
			return err
		}
	}
	rows := [][]string{{"Workload", "Unit", "tiercache (cache hits)", "qemu-nbd", "tiercache / qemu-nbd", "CPU s/GiB tiercache", "CPU s/GiB qemu-nbd", "spread tiercache", "spread qemu-nbd"}}
	var rs []float64
	var groups []string
	for _, j := range jobs {
		a, b := newStat(samples["tiercache"][j.Name]), newStat(samples["qemu-nbd"][j.Name])
		ca, cb := newStat(cpu["tiercache"][j.Name]), newStat(cpu["qemu-nbd"][j.Name])
		r := ratioOf(a.med, b.med)
		rs = append(rs, r)
		groups = append(groups, j.Name)
		rows = append(rows, []string{j.Title, j.Metric.String(), formatValue(a.med), formatValue(b.med), fmt.Sprintf("%.2f", r), formatValue(ca.med), formatValue(cb.med),
			formatValue(a.lo) + "–" + formatValue(a.hi), formatValue(b.lo) + "–" + formatValue(b.hi)})
		c.checks = append(c.checks, Check{Scenario: "S5", What: j.Title + ", tiercache cache hits / qemu-nbd (RAM)", Seed: "target 1.0x",
			Ours: fmt.Sprintf("%s vs %s %s", formatValue(a.med), formatValue(b.med), j.Metric), Ratio: r, Bar: "≥ 0.9", Met: yesNo(r >= 0.9)})
	}
	c.details = append(c.details, detail{Scenario: "S5", Title: fmt.Sprintf("S5 overhead: both devices plain files in RAM (%d MiB working set), median of %d rounds, servers alternating", c.sz.S5Region>>20, c.sz.S5Rounds), Rows: rows,
		Notes: []string{fmt.Sprintf("tiercache read %s during the measured runs, %s of it from the cache (hit ratio %s).", mib(rb), mib(delta(v0, v1, "ReadHitBytes")), pct(hit))}})
	return chartGroups(c.chartPath("s5.png"), "S5: tiercache cache hits relative to qemu-nbd, both in RAM (higher is better)", "x qemu-nbd",
		groups, []string{"tiercache / qemu-nbd"}, [][]float64{rs}, []float64{0.9})
}
