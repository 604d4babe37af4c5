package cli

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/tiercache/tiercache/admin"
)

// progressLine draws streamed admin.Progress: one line redrawn in place
// on a terminal, else a line per tenth (so logs of scripted runs show that
// work goes on).
type progressLine struct {
	w      io.Writer
	tty    bool
	what   string
	unit   func(int64) string
	last   int64
	drawn  bool
	starts time.Time
	quiet  bool // --json: stdout is for the JSON, stderr stays empty
}

func newProgressLine(w io.Writer, what string, unit func(int64) string) *progressLine {
	p := &progressLine{w: w, what: what, unit: unit, last: -1, starts: time.Now()}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.tty = true
	}
	return p
}

func (p *progressLine) update(pr admin.Progress) {
	if p.quiet || pr.Finished || pr.Total <= 0 {
		return
	}
	frac := float64(pr.Done) / float64(pr.Total)
	line := fmt.Sprintf("%s %s %5.1f%% %s/%s", p.what, bar(frac, 24), 100*frac, p.unit(pr.Done), p.unit(pr.Total))
	if pr.Rate > 0 {
		line += fmt.Sprintf("  %s/s  ETA %s", p.unit(int64(pr.Rate)), humanDur(pr.ETASeconds))
	}
	if p.tty {
		fmt.Fprintf(p.w, "\r\x1b[K%s", line)
		p.drawn = true
		return
	}
	tenth := int64(frac * 10)
	if tenth != p.last {
		p.last = tenth
		fmt.Fprintln(p.w, line)
	}
}

func (p *progressLine) done() {
	if p.tty && p.drawn {
		fmt.Fprint(p.w, "\r\x1b[K")
	}
}

func newFlushCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "flush [EXPORT]",
		Short: "Write an export's dirty data back to its backing device now (all exports without EXPORT)",
		Long: `Write every dirty block of EXPORT (or of every export) back to its backing
device, sync it, and wait until none is left, with a progress bar and ETA.
The export keeps serving meanwhile. In writeback mode new writes make new
dirty data: to empty the cache for good, 'tiercache set EXPORT
cache_mode=writethrough' first, or use 'tiercache detach'.

This is not what an NBD FLUSH (sync, fsync) does: a FLUSH makes acknowledged
writes durable, in the cache (the journal); 'tiercache flush' moves the
dirty data to the backing device, so the cache device holds none of it.`,
		Args:              cobra.MaximumNArgs(1),
		ValidArgsFunction: completeExport(g),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			var names []string
			if len(args) == 1 {
				names = args
			} else {
				for _, e := range s.st.Exports {
					names = append(names, e.Name)
				}
			}
			if !asJSON {
				s.header(g.stdout)
			}
			var results []admin.Progress
			for _, name := range names {
				start := time.Now()
				pl := newProgressLine(g.stderr, "flush "+name, human)
				pl.quiet = asJSON
				fin, err := s.c.Flush(ctx, name, pl.update)
				pl.done()
				if err != nil {
					return fmt.Errorf("flush %s: %w", name, g.apiErr(err))
				}
				results = append(results, fin)
				if !asJSON {
					fmt.Fprintf(g.stdout, "%s: wrote back %s in %s; %s dirty\n", name, human(fin.Done), humanDur(time.Since(start).Seconds()), human(fin.DirtyBytes))
				}
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, map[string]any{"flushed": results})
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (the final progress of each export)")
	return cmd
}
