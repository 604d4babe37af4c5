package cli

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
)

func newStatusCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "One screen on the running server: version, uptime, listeners, cache set and state, every export",
		Long: `Show the running server on one screen, like 'casadm -L': its version,
pid and uptime, the NBD listeners and admin API, the cache set (UUID,
device, size, ok or failed) and each export with its mode, size, cached
and dirty data, hit ratio, whether its backing device alone is consistent
(epoch order: what is left if the cache device is lost) and device.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := g.connect(cmdContext(cmd))
			if err != nil {
				return err
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, s.st)
			}
			return printStatus(g.stdout, s)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newListCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the running server's exports: mode, size, cached, dirty, hit ratio, device",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := g.connect(cmdContext(cmd))
			if err != nil {
				return err
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, struct {
					Exports []admin.ExportInfo `json:"exports"`
				}{s.st.Exports})
			}
			s.header(g.stdout)
			return printExports(g.stdout, s.st.Exports)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printStatus(out io.Writer, s *session) error {
	st := s.st
	w := newTable(out, 0)
	fmt.Fprintf(w, "server\t%s, pid %d, up %s (since %s)\n", st.Version, st.PID, humanDur(st.UptimeSeconds), st.Started.Local().Format(time.DateTime))
	fmt.Fprintf(w, "admin API\t%s (found by %s)\n", joinOrNone(st.Admin), s.id.Found)
	fmt.Fprintf(w, "NBD\t%s\n", joinOrNone(st.Listeners))
	if c := st.Set; c != nil {
		fmt.Fprintf(w, "cache set\t%s\n", c.UUID)
		fmt.Fprintf(w, "cache device\t%s (%s: %d buckets of %s, the rest metadata)\n", c.CachePath, human(max(c.DeviceSize, c.CacheSize)), c.Buckets, human(c.BucketSize))
		if m := c.Mirror; m != nil {
			fmt.Fprintf(w, "mirror device\t%s (metadata and dirty data on both; %d of %d slots in use)\n", m.Path, m.SlotsUsed, m.Slots)
		}
		state := "ok"
		switch c.State {
		case "ok":
		case "degraded":
			failed, survivor := "B, the mirror device", "the cache device"
			if c.Mirror.Failed == "A" {
				failed, survivor = "A, the cache device", "the mirror device"
			}
			state = fmt.Sprintf("DEGRADED: member %s failed; serving in writeback on %s alone, whose failure would fail the set over (replace the failed device)", failed, survivor)
			if rs := c.Mirror.Resilver; rs != nil && rs.Member == c.Mirror.Failed {
				state = fmt.Sprintf("DEGRADED: member %s, is being resilvered (not in sync yet); serving on %s alone until the copy ends", failed, survivor)
			}
		default:
			state = strings.ToUpper(c.State) + ": " + c.FailCause + " (every export is served from its backing device)"
		}
		fmt.Fprintf(w, "state\t%s; %s cached, %s dirty\n", state, human(c.CachedBytes), human(c.DirtyBytes))
		if m := c.Mirror; m != nil && m.Resilver != nil && m.Resilver.Total > 0 {
			rs := m.Resilver
			limit := ""
			if rs.Rate > 0 {
				limit = ", limited to " + human(rs.Rate) + "/s"
			}
			who := rs.Member
			if rs.Path != "" {
				who += " (" + rs.Path + ")"
			}
			fmt.Fprintf(w, "resilver\tmember %s: %s of %s copied (%.0f%%)%s, ETA %s\n", who, human(rs.Done), human(rs.Total), 100*float64(rs.Done)/float64(rs.Total), limit, humanDur(rs.ETASeconds))
		}
		for _, l := range c.LostWrites {
			fmt.Fprintf(w, "LOST WRITES\t%s\n", l)
		}
		if len(c.LostWrites) > 0 {
			fmt.Fprintf(w, "\tacknowledge each failover, once handled, with 'tiercache lost-writes --ack ID'\n")
		}
		if c.LostWritesUnrecorded != "" {
			fmt.Fprintf(w, "\tNOT RECORDED on the cache device (only this server knows): %s\n", c.LostWritesUnrecorded)
		}
	} else {
		fmt.Fprintf(w, "cache set\tnone (plain exports only)\n")
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out)
	return printExports(out, st.Exports)
}

func printExports(out io.Writer, exports []admin.ExportInfo) error {
	if len(exports) == 0 {
		fmt.Fprintln(out, "no exports")
		return nil
	}
	w := newTable(out, 0)
	fmt.Fprintln(w, "EXPORT\tMODE\tSIZE\tCACHED\tDIRTY\tHIT\tCONSISTENT\tDEVICE")
	var notes []string
	for _, e := range exports {
		cached, dirty, hit, cons := "-", "-", "-", "-"
		if e.Cached {
			cached, dirty, hit = human(e.CachedBytes), human(e.DirtyBytes), fmt.Sprintf("%.1f%%", 100*e.HitRatio)
			cons = consistencyShort(e.Consistency)
			if !e.BackingConsistent && e.WritebackOrder != "lba" {
				notes = append(notes, fmt.Sprintf("%s: backing device consistent: %s", e.Name, consistencyText(e.Consistency)))
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Name, e.Mode, human(e.Size), cached, dirty, hit, cons, e.Path)
		if r := e.Remote; r != nil {
			notes = append(notes, remoteText(e.Name, r))
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if len(notes) > 0 {
		fmt.Fprintln(out)
		for _, n := range notes {
			fmt.Fprintln(out, n)
		}
	}
	return nil
}

// consistencyShort is the CONSISTENT column: whether the volume's backing
// device alone holds a consistent image (epoch order, not degraded).
func consistencyShort(c admin.Consistency) string {
	switch {
	case c.BackingConsistent:
		return "yes"
	case c.InconsistentSince != nil && c.CatchingUp:
		return "no, since " + c.InconsistentSince.Local().Format(time.TimeOnly) + ", catching up"
	case c.InconsistentSince != nil:
		return "no, since " + c.InconsistentSince.Local().Format(time.TimeOnly)
	case c.WritebackOrder == "lba":
		return "no (lba order)"
	}
	return "no"
}

// consistencyText says whether the volume's backing device alone holds a
// consistent image, since when not, and when it will again.
func consistencyText(c admin.Consistency) string {
	switch {
	case c.BackingConsistent:
		return "yes"
	case c.InconsistentSince != nil && c.CatchingUp:
		return "no, since " + c.InconsistentSince.Local().Format(time.DateTime) + "; catching up now: consistent again once the catch-up pass has written back everything dirty from before its cut"
	case c.InconsistentSince != nil:
		return "no, since " + c.InconsistentSince.Local().Format(time.DateTime) + "; consistent again once writeback catches up (a full drain, or the catch-up pass that starts once 5 s have passed since the degrade and since the last write stream around the cache)"
	case c.WritebackOrder == "lba":
		return "no (writeback_order lba: writeback does not keep the order of flushes)"
	}
	return "no; consistent again once writeback catches up (a full drain, or the catch-up pass that starts once 5 s have passed since the degrade and since the last write stream around the cache)"
}
