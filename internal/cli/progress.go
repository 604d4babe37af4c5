package cli

import (
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progress reports a long operation: a bar on a terminal, otherwise a line
// per tenth, so logs of scripted runs still show that work goes on.
type progress struct {
	mu   sync.Mutex
	bar  *progressbar.ProgressBar
	w    io.Writer
	what string
	last int64 // last tenth printed (non-TTY)
}

func newProgress(w io.Writer, what string, total int64) *progress {
	p := &progress{w: w, what: what, last: -1}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.bar = progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription(what),
			progressbar.OptionShowCount(),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionClearOnFinish(),
		)
	}
	return p
}

// set records that done of total units are complete.
func (p *progress) set(done, total int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		p.bar.ChangeMax64(total)
		p.bar.Set64(done)
		return
	}
	if total <= 0 {
		return
	}
	tenth := done * 10 / total
	if tenth != p.last {
		p.last = tenth
		fmt.Fprintf(p.w, "%s: %d%%\n", p.what, tenth*10)
	}
}

func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		p.bar.Finish()
	}
}
