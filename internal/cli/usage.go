package cli

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
)

const barWidth = 30

func newUsageCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "usage",
		Short: "Show space per device: size, used, cached, dirty, pending writeback",
		Long: `Show how the running server's devices are used, like 'bcachefs fs usage':
the cache device's bucket space (used, cached, dirty) and, per export, the
device's size, the space allocated on it, how much of it is cached, how much
of that is dirty (newer in the cache than on the device) and how much is
waiting for writeback. Each line has a bar relative to the device's size.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			u, err := s.c.Usage(ctx)
			if err != nil {
				return g.apiErr(err)
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, u)
			}
			s.header(g.stdout)
			var dev int64
			if s.st.Set != nil {
				dev = s.st.Set.DeviceSize
			}
			return printUsage(g.stdout, u, dev)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func usageLine(w io.Writer, what string, n, of int64) {
	fmt.Fprintf(w, "  %s\t%s\t%s\t%s\n", what, human(n), bar(float64(n)/float64(max(of, 1)), barWidth), pct(n, of))
}

// printUsage prints u; devSize is the cache device's whole size (0 if
// unknown), of which the bucket space is c.Size and the rest metadata.
func printUsage(out io.Writer, u admin.Usage, devSize int64) error {
	w := newTable(out, 0)
	if c := u.Cache; c != nil {
		if devSize > 0 {
			fmt.Fprintf(w, "cache device %s (%s)\n", c.Path, human(devSize))
		} else {
			fmt.Fprintf(w, "cache device %s\n", c.Path)
		}
		fmt.Fprintf(w, "  size\t%s\t%d buckets of %s\t\n", human(c.Size), c.Buckets, human(c.Size/max(c.Buckets, 1)))
		if devSize > c.Size {
			fmt.Fprintf(w, "  metadata\t%s\tjournal and checkpoints\t\n", human(devSize-c.Size))
		}
		usageLine(w, "used (buckets)", c.UsedBytes, c.Size)
		if c.EmptyBuckets > 0 {
			bs := c.Size / max(c.Buckets, 1)
			usageLine(w, "  of which empty", c.EmptyBuckets*bs, c.Size)
		}
		usageLine(w, "cached", c.CachedBytes, c.Size)
		usageLine(w, "dirty", c.DirtyBytes, c.Size)
		if c.Failed {
			fmt.Fprintf(w, "  FAILED\tcache device failed; serving from the backing devices (%s)\t\t\n", c.FailCause)
			fmt.Fprintf(w, "  UNREACHABLE\t%s of dirty data on the failed cache device\t\t\n", human(c.UnreachableDirtyBytes))
		}
		fmt.Fprintln(w, "\t\t\t")
	}
	for i, e := range u.Exports {
		if i > 0 {
			fmt.Fprintln(w, "\t\t\t")
		}
		fmt.Fprintf(w, "export %s (%s) on %s\n", e.Name, e.Mode, e.Path)
		if o := e.ObjectStore; o != nil {
			// No tab: the line does not widen the table's columns.
			fmt.Fprintf(w, "  image %s, generation %d, newest epoch %s\n", o.Image, o.Generation, objEpochText(o))
		}
		fmt.Fprintf(w, "  size\t%s\t\t\n", human(e.Size))
		if o := e.ObjectStore; o != nil {
			usageLine(w, "stored (segments)", o.StoredBytes, e.Size)
			usageLine(w, "live (mapped)", o.LiveBytes, e.Size)
			fmt.Fprintf(w, "  space amplification\t%s\t\tstored / live\n", ratioText(o.SpaceAmplification))
			fmt.Fprintf(w, "  GC write amplification\t%s\t\t(writeback + GC PUT) / writeback PUT, %s rewritten\n", ratioText(o.GCWriteAmplification), human(o.GCRewrittenBytes))
			if o.Fenced != "" {
				fmt.Fprintf(w, "  FENCED\t%s\t\t\n", o.Fenced)
			}
		} else {
			usageLine(w, "used (allocated)", e.Used, e.Size)
		}
		if e.Mode != "plain" {
			usageLine(w, "cached", e.Cached, e.Size)
			usageLine(w, "dirty", e.Dirty, e.Size)
			usageLine(w, "pending writeback", e.PendingWriteback, e.Size)
			fmt.Fprintf(w, "  backing device consistent: %s\n", consistencyText(e.Consistency))
			if e.UnreachableDirty > 0 || e.LostWrites > 0 {
				usageLine(w, "UNREACHABLE dirty", e.UnreachableDirty, e.Size)
				usageLine(w, "LOST unflushed", e.LostWrites, e.Size)
			}
		}
	}
	return w.Flush()
}
