package bench

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// cacheCharts are the PNGs the scenarios write.
var cacheCharts = []string{"bars.png", "s1.png", "s2.png", "s3.png", "s4.png", "s5.png", "s6.png", "s7.png", "s8.png", "s9.png"}

// cliffScenarios are the scenarios of the data outgrowing the cache.
var cliffScenarios = []string{"S7", "S8", "S9"}

// reportSet names a run's report files. A run of S7-S9 alone writes them
// with a cliff prefix (CLIFF_RESULTS.md, cliff-results.json, cliff-bars.png,
// cliff-s7.png, ...), so that publishing it never replaces the published
// run of the whole suite; any other run writes CACHE_RESULTS.md,
// cache-results.json, bars.png and sN.png.
type reportSet struct{ cliff bool }

func newReportSet(scen []string) reportSet {
	for _, s := range scen {
		if !slices.Contains(cliffScenarios, s) {
			return reportSet{}
		}
	}
	return reportSet{cliff: len(scen) > 0}
}

func (r reportSet) md() string {
	if r.cliff {
		return "CLIFF_RESULTS.md"
	}
	return "CACHE_RESULTS.md"
}

func (r reportSet) json() string {
	if r.cliff {
		return "cliff-results.json"
	}
	return "cache-results.json"
}

// chart is the file name of chart name (bars.png, s7.png) in this set.
func (r reportSet) chart(name string) string {
	if r.cliff {
		return "cliff-" + name
	}
	return name
}

// files are every file of the set.
func (r reportSet) files() []string {
	fs := []string{r.md(), r.json()}
	for _, c := range cacheCharts {
		if !r.cliff || c == "bars.png" || slices.Contains(cliffScenarios, chartScenario(c)) {
			fs = append(fs, r.chart(c))
		}
	}
	return fs
}

// ranFiles are the files of the set that a run of scen writes: the report,
// its JSON and bars chart, and the charts of the scenarios in scen.
func (r reportSet) ranFiles(scen []string) []string {
	var fs []string
	for _, f := range r.files() {
		c := strings.TrimPrefix(f, "cliff-")
		if s := chartScenario(c); s == "" || slices.Contains(scen, s) {
			fs = append(fs, f)
		}
	}
	return fs
}

// chartScenario is the scenario a per-scenario chart (s7.png) draws, or ""
// for any other file.
func chartScenario(name string) string {
	n, ok := strings.CutSuffix(name, ".png")
	if !ok || !strings.HasPrefix(n, "s") {
		return ""
	}
	return strings.ToUpper(n)
}

func (c *cacheRunner) chartPath(name string) string {
	return filepath.Join(c.outDir, c.names.chart(name))
}

var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
}

// chartGroups draws a grouped bar chart: one group per label in groups, one
// bar per series; vals[series][group]. lines are horizontal reference lines
// (the bars).
func chartGroups(path, title, ylabel string, groups, series []string, vals [][]float64, lines []float64) error {
	return chartGroupsLabelled(path, title, ylabel, groups, series, vals, lines, false)
}

// chartGroupsLabelled is chartGroups, with each bar's value written above
// it when labelled (ratios near 0 beside ones of 20 stay readable).
func chartGroupsLabelled(path, title, ylabel string, groups, series []string, vals [][]float64, lines []float64, labelled bool) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	p.Y.Min = 0
	p.Legend.Top = true
	p.Legend.XOffs = -vg.Points(12)
	barWidth := vg.Points(22)
	n := len(series)
	top := 0.0
	for i, s := range series {
		v := make(plotter.Values, len(groups))
		for j := range groups {
			if j < len(vals[i]) && !math.IsNaN(vals[i][j]) && !math.IsInf(vals[i][j], 0) {
				v[j] = vals[i][j]
				top = max(top, v[j])
			}
		}
		bars, err := plotter.NewBarChart(v, barWidth)
		if err != nil {
			return err
		}
		bars.LineStyle.Width = 0
		bars.Color = palette[i%len(palette)]
		bars.Offset = barWidth * vg.Length(float64(i)-float64(n-1)/2)
		p.Add(bars)
		p.Legend.Add(s, bars)
		if labelled {
			xy := plotter.XYLabels{XYs: make(plotter.XYs, len(v)), Labels: make([]string, len(v))}
			for j := range v {
				xy.XYs[j] = plotter.XY{X: float64(j), Y: v[j]}
				if j < len(vals[i]) && !math.IsNaN(vals[i][j]) {
					xy.Labels[j] = fmt.Sprintf("%.2g", vals[i][j])
				}
			}
			lb, err := plotter.NewLabels(xy)
			if err != nil {
				return err
			}
			lb.Offset = vg.Point{X: bars.Offset - barWidth/3, Y: vg.Points(2)}
			p.Add(lb)
		}
	}
	for _, l := range lines {
		ln, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: l}, {X: float64(len(groups)) - 0.5, Y: l}})
		if err != nil {
			return err
		}
		ln.LineStyle.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		ln.LineStyle.Color = color.Gray{Y: 0x60}
		p.Add(ln)
		top = max(top, l)
	}
	p.NominalX(groups...)
	if top > 0 {
		p.Y.Max = top * 1.25
	}
	width := vg.Length(len(groups)) * max(vg.Length(n)*barWidth*1.5, 1.6*vg.Inch)
	return savePNG(p, width, path)
}

// chartGroupsRange draws one bar per group (vals) with a whisker from lo to
// hi, and horizontal reference lines.
func chartGroupsRange(path, title, ylabel string, groups []string, vals, lo, hi, lines []float64) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	p.Y.Min = 0
	barWidth := vg.Points(18)
	bars, err := plotter.NewBarChart(plotter.Values(vals), barWidth)
	if err != nil {
		return err
	}
	bars.LineStyle.Width = 0
	bars.Color = palette[0]
	p.Add(bars)
	top := 0.0
	for j := range groups {
		top = max(top, vals[j], hi[j])
		w, err := plotter.NewLine(plotter.XYs{{X: float64(j), Y: lo[j]}, {X: float64(j), Y: hi[j]}})
		if err != nil {
			return err
		}
		w.LineStyle.Width = vg.Points(1.5)
		p.Add(w)
	}
	for _, l := range lines {
		ln, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: l}, {X: float64(len(groups)) - 0.5, Y: l}})
		if err != nil {
			return err
		}
		ln.LineStyle.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		ln.LineStyle.Color = color.Gray{Y: 0x60}
		p.Add(ln)
		top = max(top, l)
	}
	p.NominalX(groups...)
	p.Y.Max = top * 1.15
	return savePNG(p, vg.Length(len(groups))*0.6*vg.Inch, path)
}

// savePNG draws p at least 7 inches wide and writes it to path.
func savePNG(p *plot.Plot, width vg.Length, path string) error {
	cv := vgimg.NewWith(vgimg.UseWH(max(width+vg.Inch, 7*vg.Inch), 4*vg.Inch), vgimg.UseDPI(110))
	p.Draw(draw.New(cv))
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: cv}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// cacheReport is cache-results.json and the source of CACHE_RESULTS.md.
type cacheReport struct {
	set        reportSet
	Env        envInfo    `json:"env"`
	Quick      bool       `json:"quick"`
	Sizes      cacheSizes `json:"sizes"`
	ElapsedSec float64    `json:"elapsed_s"`
	Loads      []string   `json:"loads"`
	Commands   []string   `json:"commands"`
	Retries    int        `json:"fio_retries"`
	Rounds     int        `json:"rounds"`
	Partial    string     `json:"partial,omitempty"` // set in a report written between rounds
	Checks     []Check    `json:"checks"`
	Details    []detail   `json:"details"`
	Figures    []Figure   `json:"figures"`
}

func (r cacheReport) checkRows() [][]string {
	head := []string{"Scenario", "Measure", "Seed (published)", "Ours", "Ratio", "Bar", "Met"}
	if r.Rounds > 1 {
		head = []string{"Scenario", "Measure", "Seed (published)", "Ours (median round)", "Median ratio", "Every round", "Bar", "Met (median)"}
	}
	rows := [][]string{head}
	ids := checkIDs(r.Checks)
	for i, c := range r.Checks {
		c.Scenario = ids[i]
		if r.Rounds > 1 {
			each := make([]string, len(c.RoundRatios))
			for i, x := range c.RoundRatios {
				each[i] = ratioText(x)
			}
			rows = append(rows, []string{c.Scenario, c.What, c.Seed, c.Ours, ratioText(c.Ratio), strings.Join(each, ", "), c.Bar, c.Met})
			continue
		}
		rows = append(rows, []string{c.Scenario, c.What, c.Seed, c.Ours, ratioText(c.Ratio), c.Bar, c.Met})
	}
	return rows
}

func ratioText(x float64) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return dash
	}
	return fmt.Sprintf("%.2f", x)
}

// medianChecks folds the rounds' checks into one list in the first round's
// order: each check is the one of its median round (by ratio; the lower
// middle one for an even count, so every field is one round's, never an
// average), with every round's ratio in RoundRatios. A check missing from
// a round has NaN there.
func medianChecks(rounds [][]Check) []Check {
	if len(rounds) == 0 {
		return nil
	}
	key := func(c Check) string { return c.Scenario + "\x00" + c.What }
	var out []Check
	for _, c := range rounds[0] {
		var same []Check
		ratios := make([]float64, len(rounds))
		for i, rc := range rounds {
			ratios[i] = math.NaN()
			for _, x := range rc {
				if key(x) == key(c) {
					ratios[i] = x.Ratio
					same = append(same, x)
					break
				}
			}
		}
		slices.SortStableFunc(same, func(a, b Check) int { return cmpRatio(a.Ratio, b.Ratio) })
		m := same[(len(same)-1)/2]
		if len(rounds) > 1 {
			m.RoundRatios = ratios
		}
		out = append(out, m)
	}
	return out
}

// checkIDs names each check by its scenario and its place in it (S2.3),
// as the bars table and chart show them.
func checkIDs(checks []Check) []string {
	n := map[string]int{}
	ids := make([]string, len(checks))
	for i, c := range checks {
		n[c.Scenario]++
		ids[i] = fmt.Sprintf("%s.%d", c.Scenario, n[c.Scenario])
	}
	return ids
}

// cmpRatio orders ratios with NaN last.
func cmpRatio(a, b float64) int {
	switch an, bn := math.IsNaN(a), math.IsNaN(b); {
	case an && bn:
		return 0
	case an:
		return 1
	case bn:
		return -1
	}
	return cmp.Compare(a, b)
}

// chartBars draws every bar with a numeric threshold as its median ratio
// over the threshold (1 = exactly at the bar, above is met), with the
// rounds' lowest and highest as a whisker, so that bars of different kinds
// (0.95, 8x, 10x) share one axis.
func chartBars(path string, checks []Check) error {
	var groups []string
	var vals []float64
	var lo, hi []float64
	ids := checkIDs(checks)
	for i, c := range checks {
		bar, ok := barValue(c.Bar)
		if !ok || math.IsNaN(c.Ratio) {
			continue
		}
		groups = append(groups, ids[i])
		vals = append(vals, c.Ratio/bar)
		l, h, ok := minMax(c.RoundRatios)
		if !ok {
			l, h = c.Ratio, c.Ratio
		}
		lo, hi = append(lo, l/bar), append(hi, h/bar)
	}
	if len(groups) == 0 {
		return nil
	}
	return chartGroupsRange(path, "Each bar: median ratio / threshold (≥ 1 met; whiskers: lowest and highest round)", "x bar",
		groups, vals, lo, hi, []float64{1})
}

// barValue reads the threshold of a bar text: "≥ 8", "≥ 0.95", or the
// lower end of a range "0.95–1.05".
func barValue(b string) (float64, bool) {
	b = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(b), "≥"))
	if i := strings.Index(b, "–"); i > 0 {
		b = b[:i]
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(b), 64)
	return v, err == nil && v > 0
}

func (r cacheReport) print(w io.Writer) error {
	fmt.Fprintf(w, "\nBars (seed beside ours):\n")
	if err := writeTextLeft(w, r.checkRows()); err != nil {
		return err
	}
	for _, d := range r.Details {
		fmt.Fprintf(w, "\n%s:\n", d.Title)
		if err := writeTextLeft(w, d.Rows); err != nil {
			return err
		}
		for _, n := range d.Notes {
			fmt.Fprintf(w, "  %s\n", n)
		}
	}
	fmt.Fprintln(w, "\nLoad average (1/5/15 min):")
	for _, l := range r.Loads {
		fmt.Fprintf(w, "  %s\n", l)
	}
	return nil
}

// writeTextLeft is writeText with left-aligned columns (long text cells).
func writeTextLeft(w io.Writer, rows [][]string) error {
	widths := map[int]int{}
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], len([]rune(c)))
		}
	}
	var b bytes.Buffer
	for _, r := range rows {
		for i, c := range r {
			b.WriteString(c)
			if i < len(r)-1 {
				for k := len([]rune(c)); k < widths[i]+2; k++ {
					b.WriteByte(' ')
				}
			}
		}
		b.WriteByte('\n')
	}
	_, err := w.Write(b.Bytes())
	return err
}

func (r cacheReport) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var md bytes.Buffer
	p := func(format string, a ...any) { fmt.Fprintf(&md, format, a...) }
	p("# tiercache cache scenarios (S1–S9)\n\n")
	p("Generated by `go run ./cmd/tcbench cache` (bench/cache*.go); do not edit by hand. See docs/BENCHMARKS.md for the method.\n\n")
	if r.Partial != "" {
		p("**Partial report: %s.**\n\n", r.Partial)
	}
	if r.Quick {
		p("**--quick run: tiny sizes, 1 s runs. It checks that everything runs; its figures mean nothing.**\n\n")
	}
	e := r.Env
	p("- Date: %s; run took %s\n", e.Date, (time.Duration(r.ElapsedSec * float64(time.Second))).Round(time.Second))
	p("- Machine: %d CPU(s), %s; %s RAM; kernel %s\n", e.CPUs, e.CPUModel, e.MemTotal, e.Kernel)
	p("- Tools: %s; %s; %s; tiercache %s\n", e.Fio, e.QemuNBD, e.Go, e.Tiercache)
	p("- Load average (1/5/15 min): %s at the start, %s at the end (the machine is shared)\n", e.LoadStart, e.LoadEnd)
	for _, l := range r.Loads {
		p("  - %s\n", l)
	}
	if r.Retries > 0 {
		p("- fio runs interrupted from outside and run again: %d\n", r.Retries)
	}
	s := r.Sizes
	p("- Sizes: HDD image %d MiB (the model's whole disk), data and every workload in its first %d MiB; S1 %d MiB of 4 KiB fsync'd writes through tiercache, plain HDD capped at %v; time-based runs %v (S2 and S3 jobs that write: after a %v ramp); S3 working set %d MiB; S4 %d MiB of writes; S5 %d MiB, %d rounds of %v after a %v ramp; %s\n\n",
		s.Disk>>20, s.Backing>>20, s.S1Writes>>20, s.S1HDDTime, s.Runtime, s.Ramp, s.S3Region>>20, s.S4Writes>>20, s.S5Region>>20, s.S5Rounds, s.S5Runtime, s.S5Ramp, s.Apps.line()+"; "+s.Cliff.line())
	p("## Bars: the seed's figure beside ours\n\n")
	if r.Rounds > 1 {
		p("%d rounds, one after the other; each row is its median round (by ratio), with every round's ratio beside it. The scenario tables below are the last round's.\n\n", r.Rounds)
	}
	if err := writeMarkdown(&md, r.checkRows()); err != nil {
		return err
	}
	p("\n![bars](%s)\n", r.set.chart("bars.png"))
	charts := map[string]string{}
	for _, s := range scenarioNames {
		charts[s] = r.set.chart(strings.ToLower(s) + ".png")
	}
	last := ""
	for _, d := range r.Details {
		p("\n## %s\n\n", d.Title)
		if err := writeMarkdown(&md, d.Rows); err != nil {
			return err
		}
		for _, n := range d.Notes {
			p("\n%s\n", n)
		}
		last = d.Scenario
		if next := r.nextScenario(d); next != last {
			p("\n![%s](%s)\n", d.Scenario, charts[d.Scenario])
		}
	}
	p("\n## Commands\n\n```\n")
	for _, c := range r.Commands {
		p("%s\n", c)
	}
	p("```\n\n## All figures\n\n")
	rows := [][]string{{"Scenario", "Target", "Test", "Round", "Value", "Unit", "Mean lat µs", "p99 lat µs", "p99.9 lat µs", "Max lat µs", "Server CPU s/GiB", "Note"}}
	for _, f := range r.Figures {
		round := ""
		if f.Round > 0 {
			round = fmt.Sprint(f.Round)
		}
		rows = append(rows, []string{f.Scenario, f.Target, f.Test, round, formatValue(f.Value), f.Unit, formatOpt(f.LatMeanUs), formatOpt(f.LatP99Us), formatOpt(f.LatP999Us), formatOpt(f.LatMaxUs), formatOpt(f.ServerCPU), f.Note})
	}
	if err := writeMarkdown(&md, rows); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, r.set.md()), md.Bytes(), 0o644); err != nil {
		return err
	}
	// JSON has no NaN: a ratio that could not be computed is written as 0.
	r.Checks = append([]Check(nil), r.Checks...)
	for i := range r.Checks {
		if math.IsNaN(r.Checks[i].Ratio) || math.IsInf(r.Checks[i].Ratio, 0) {
			r.Checks[i].Ratio = 0
		}
		rr := append([]float64(nil), r.Checks[i].RoundRatios...)
		for j, x := range rr {
			if math.IsNaN(x) || math.IsInf(x, 0) {
				rr[j] = 0
			}
		}
		r.Checks[i].RoundRatios = rr
	}
	r.Figures = append([]Figure(nil), r.Figures...)
	for i := range r.Figures {
		f := &r.Figures[i]
		for _, v := range []*float64{&f.Value, &f.LatMeanUs, &f.LatP99Us, &f.LatP999Us, &f.LatMaxUs, &f.ServerCPU} {
			if math.IsNaN(*v) || math.IsInf(*v, 0) {
				*v = 0
			}
		}
	}
	raw, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, r.set.json()), append(raw, '\n'), 0o644)
}

// nextScenario returns the scenario of the detail after d ("" at the end).
func (r cacheReport) nextScenario(d detail) string {
	for i := range r.Details {
		if r.Details[i].Title == d.Title && i+1 < len(r.Details) {
			return r.Details[i+1].Scenario
		}
	}
	return ""
}

func formatOpt(v float64) string {
	if v == 0 {
		return ""
	}
	return formatValue(v)
}

// removeFiles removes names from dir; missing ones are fine.
func removeFiles(dir string, names []string) error {
	for _, n := range names {
		if err := os.Remove(filepath.Join(dir, n)); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("publish: %w", err)
		}
	}
	return nil
}

// publishRun copies the report of a run of scen in set from src into dst
// (docs/bench). It replaces only what the run measured: the set's report,
// JSON and bars chart, and the charts of the scenarios in scen; the charts
// of scenarios it did not run, and the other set, stay as published. A run
// of the whole suite's set that ran every one of S7-S9 also removes the
// S7-S9 set: its own report holds newer figures for all of them.
func publishRun(src, dst string, set reportSet, scen []string) error {
	if err := publishFiles(src, dst, set.ranFiles(scen)); err != nil {
		return err
	}
	if set.cliff {
		return nil
	}
	for _, s := range cliffScenarios {
		if !slices.Contains(scen, s) {
			return nil
		}
	}
	return removeFiles(dst, reportSet{cliff: true}.files())
}

// publishFiles copies names from src into dst: a name src lacks (a
// scenario that ran and drew no chart) is removed from dst, so that no
// file of an earlier run stands for one this run replaced.
func publishFiles(src, dst string, names []string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join(src, name))
		if os.IsNotExist(err) {
			if err := os.Remove(filepath.Join(dst, name)); err != nil && !os.IsNotExist(err) {
				return fmt.Errorf("publish: %w", err)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
	}
	return nil
}
