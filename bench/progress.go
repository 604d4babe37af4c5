package bench

import (
	"fmt"
	"io"
	"math"
	"os"

	"github.com/schollz/progressbar/v3"
)

// progress reports the harness's steps: a progress bar on a terminal, one
// line per finished step otherwise (CI logs, pipes).
type progress interface {
	start(desc string)
	finish(desc string, s Sample, w Workload)
	close()
}

func newProgress(w io.Writer, total int) progress {
	if f, ok := w.(*os.File); ok && isTerminal(f) {
		bar := progressbar.NewOptions(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription("starting"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionFullWidth(),
			progressbar.OptionClearOnFinish(),
		)
		return &barProgress{bar: bar}
	}
	return &lineProgress{w: w, total: total}
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

type barProgress struct{ bar *progressbar.ProgressBar }

func (p *barProgress) start(desc string) { p.bar.Describe(desc) }

func (p *barProgress) finish(string, Sample, Workload) {
	_ = p.bar.Add(1) // a display error must not stop the benchmark
}

func (p *barProgress) close() { _ = p.bar.Finish() }

type lineProgress struct {
	w     io.Writer
	total int
	done  int
}

func (p *lineProgress) start(string) {}

func (p *lineProgress) finish(desc string, s Sample, w Workload) {
	p.done++
	cpu := ""
	if v := s.cpuPerGiB(); !math.IsNaN(v) {
		cpu = fmt.Sprintf(", server %.2f CPU s/GiB", v)
	}
	fmt.Fprintf(p.w, "[%d/%d] %s: %s %s, mean lat %.0f µs%s, other load %.2f cores\n",
		p.done, p.total, desc, formatValue(s.value(w.Metric)), w.Metric, s.LatMeanUs, cpu, s.OtherCores)
}

func (p *lineProgress) close() {}
