package bench

import (
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

type key struct{ target, workload string }

// stat is one target's figures for one workload across rounds.
type stat struct {
	med, lo, hi float64
	n           int
	ok          bool
}

func newStat(xs []float64) stat {
	m, ok := median(xs)
	if !ok {
		return stat{}
	}
	lo, hi, _ := minMax(xs)
	n := 0
	for _, x := range xs {
		if !math.IsNaN(x) {
			n++
		}
	}
	return stat{med: m, lo: lo, hi: hi, n: n, ok: true}
}

// summary holds the medians the report is made of.
type summary struct {
	rounds    int
	servers   []string // servers that ran, in the configured order
	baselines []string // baselines that ran
	perf      map[key]stat
	cpu       map[key]stat // server CPU s/GiB
	lat       map[key]stat // mean completion latency, µs
	p99       map[key]stat // p99 completion latency, µs
	other     map[key]stat // CPU cores busy with other work
}

func summarize(samples []Sample, rounds int, servers, baselineNames []string) summary {
	metric := make(map[string]Metric, len(Workloads))
	for _, w := range Workloads {
		metric[w.Name] = w.Metric
	}
	perf := map[key][]float64{}
	cpu := map[key][]float64{}
	lat := map[key][]float64{}
	p99 := map[key][]float64{}
	other := map[key][]float64{}
	for _, s := range samples {
		k := key{s.Target, s.Workload}
		perf[k] = append(perf[k], s.value(metric[s.Workload]))
		cpu[k] = append(cpu[k], s.cpuPerGiB())
		lat[k] = append(lat[k], s.LatMeanUs)
		p99[k] = append(p99[k], s.LatP99Us)
		other[k] = append(other[k], s.OtherCores)
	}
	sum := summary{rounds: rounds, servers: servers, baselines: baselineNames,
		perf: map[key]stat{}, cpu: map[key]stat{}, lat: map[key]stat{}, p99: map[key]stat{}, other: map[key]stat{}}
	for k := range perf {
		sum.perf[k] = newStat(perf[k])
		sum.cpu[k] = newStat(cpu[k])
		sum.lat[k] = newStat(lat[k])
		sum.p99[k] = newStat(p99[k])
		sum.other[k] = newStat(other[k])
	}
	return sum
}

const dash = "–"

func formatValue(v float64) string {
	switch {
	case math.IsNaN(v):
		return dash
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

func cellValue(s stat) string {
	if !s.ok {
		return dash
	}
	return formatValue(s.med)
}

func cellRatio(a, b stat) string {
	if !a.ok || !b.ok {
		return dash
	}
	r, ok := ratio(a.med, b.med)
	if !ok {
		return dash
	}
	return fmt.Sprintf("%.2f", r)
}

func (s summary) has(name string) bool {
	for _, n := range s.servers {
		if n == name {
			return true
		}
	}
	return false
}

// peers are the servers tiercache is compared with.
func (s summary) peers() []string {
	var out []string
	for _, n := range s.servers {
		if n != "tiercache" {
			out = append(out, n)
		}
	}
	return out
}

// throughputTable: median IOPS or MiB/s per target and the ratios of
// tiercache to each peer and, for the baseline workloads, to fio O_DIRECT
// on the file (the stretch goal).
func (s summary) throughputTable() [][]string {
	tc := s.has("tiercache")
	head := []string{"Workload", "Unit"}
	head = append(head, s.servers...)
	head = append(head, s.baselines...)
	if tc {
		for _, p := range s.peers() {
			head = append(head, "tiercache/"+p)
		}
		for _, b := range s.baselines {
			head = append(head, "tiercache/"+b)
		}
	}
	rows := [][]string{head}
	for _, w := range Workloads {
		row := []string{w.Title, w.Metric.String()}
		for _, t := range s.servers {
			row = append(row, cellValue(s.perf[key{t, w.Name}]))
		}
		for _, b := range s.baselines {
			row = append(row, cellValue(s.perf[key{b, w.Name}]))
		}
		if tc {
			mine := s.perf[key{"tiercache", w.Name}]
			for _, p := range s.peers() {
				row = append(row, cellRatio(mine, s.perf[key{p, w.Name}]))
			}
			for _, b := range s.baselines {
				row = append(row, cellRatio(mine, s.perf[key{b, w.Name}]))
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// statTable renders one map of stats per server (and baselines if withBase).
func (s summary) statTable(m map[key]stat, withBase bool) [][]string {
	targets := append([]string(nil), s.servers...)
	if withBase {
		targets = append(targets, s.baselines...)
	}
	rows := [][]string{append([]string{"Workload"}, targets...)}
	for _, w := range Workloads {
		row := []string{w.Title}
		for _, t := range targets {
			row = append(row, cellValue(m[key{t, w.Name}]))
		}
		rows = append(rows, row)
	}
	return rows
}

// spreadTable gives min–max of the rounds for every target.
func (s summary) spreadTable() [][]string {
	targets := append(append([]string(nil), s.servers...), s.baselines...)
	rows := [][]string{append([]string{"Workload", "Unit"}, targets...)}
	for _, w := range Workloads {
		row := []string{w.Title, w.Metric.String()}
		for _, t := range targets {
			st := s.perf[key{t, w.Name}]
			if !st.ok {
				row = append(row, dash)
				continue
			}
			row = append(row, fmt.Sprintf("%s–%s (n=%d)", formatValue(st.lo), formatValue(st.hi), st.n))
		}
		rows = append(rows, row)
	}
	return rows
}

// latencyTable gives mean and p99 completion latency, medians of the rounds.
func (s summary) latencyTable() [][]string {
	targets := append(append([]string(nil), s.servers...), s.baselines...)
	rows := [][]string{append([]string{"Workload"}, targets...)}
	for _, w := range Workloads {
		row := []string{w.Title}
		for _, t := range targets {
			k := key{t, w.Name}
			if !s.lat[k].ok {
				row = append(row, dash)
				continue
			}
			row = append(row, cellValue(s.lat[k])+" / "+cellValue(s.p99[k]))
		}
		rows = append(rows, row)
	}
	return rows
}

// writeText renders rows as an aligned plain-text table.
func writeText(w io.Writer, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	for _, r := range rows {
		if _, err := fmt.Fprintln(tw, strings.Join(r, "\t")+"\t"); err != nil {
			return err
		}
	}
	return tw.Flush()
}

// writeMarkdown renders rows as a Markdown table, the first row as header;
// every column but the first is right-aligned.
func writeMarkdown(w io.Writer, rows [][]string) error {
	if len(rows) == 0 {
		return nil
	}
	var b strings.Builder
	line := func(cells []string) {
		b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
	}
	line(rows[0])
	sep := make([]string, len(rows[0]))
	for i := range sep {
		sep[i] = "---:"
	}
	sep[0] = "---"
	line(sep)
	for _, r := range rows[1:] {
		line(r)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// printSummary writes the stdout report.
func printSummary(w io.Writer, s summary) error {
	fmt.Fprintf(w, "\nThroughput, median of %d round(s) (higher is better):\n", s.rounds)
	if err := writeText(w, s.throughputTable()); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nServer CPU seconds per GiB moved, median (lower is better):\n")
	if err := writeText(w, s.statTable(s.cpu, false)); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nCompletion latency µs, mean / p99, median of rounds:\n")
	return writeText(w, s.latencyTable())
}
