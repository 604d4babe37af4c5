package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
)

// replaceMember opens and locks the device at req.Path and resilvers it
// into the served set as its failed mirror member (admin.Config's
// ReplaceMember). The device stays open until the server stops, or is
// closed at once when the replace fails.
func (h *openedSet) replaceMember(ctx context.Context, req admin.ReplaceRequest, fn func(cache.ResilverProgress), direct device.DirectMode) (string, string, error) {
	release, err := lockDevice(devicePath(req.Path), "new mirror member", lockServe)
	if err != nil {
		return "", "", err
	}
	dev, err := openDevice(req.Path, device.FileOptions{Direct: direct})
	if err != nil {
		release()
		return "", "", fmt.Errorf("new mirror member: %w", err)
	}
	member, err := h.set.ReplaceMirrorMember(ctx, dev, cache.ResilverOptions{Force: req.Force, Progress: fn, Rate: req.Rate})
	h.mu.Lock()
	defer h.mu.Unlock()
	// Closed only when the server stops: on an error the mirror may
	// still hold it as the failed member's device.
	h.replaced = append(h.replaced, func() { dev.Close(); release() })
	return member, req.Path, err
}

func newReplaceCmd(g *globals) *cobra.Command {
	var force, asJSON bool
	var rate string
	cmd := &cobra.Command{
		Use:     "replace [DEVICE]",
		Aliases: []string{"attach-mirror"},
		Short:   "Bring a new device into a degraded mirrored cache set as its failed member, while it serves",
		Long: `Resilver DEVICE into the running server's mirrored cache set as the member
that failed (status says which: DEGRADED, member A or B failed), with a
progress bar and ETA. The set keeps serving: every write goes to both the
survivor and DEVICE while the metadata and the buckets that need a copy
(for a new B: those holding dirty data; for a new A: what B holds) are
copied. When it ends the set is redundant again.

A crash or a stop at any point leaves the set degraded on the survivor,
with DEVICE marked not in sync (it is not trusted): run replace again.

Refused: a set that is not mirrored or not degraded, a DEVICE too small
for the member (B needs the metadata region and the buckets holding dirty
data; A the set's whole layout), the survivor itself, and, unless
--force, a DEVICE that holds data or another set's mirror label.

--rate limits the copy (bytes a second); without DEVICE it changes the
limit of the replace running.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var bps int64
			if rate != "" {
				n, err := parseSize(rate)
				if err != nil || n < 0 {
					return fmt.Errorf("replace: --rate %q: give bytes a second (50M, 1G; 0 for no limit)", rate)
				}
				bps = n
			}
			ctx := cmdContext(cmd)
			if len(args) == 0 && rate == "" {
				return fmt.Errorf("replace: give the new DEVICE, or --rate to change the limit of the replace running")
			}
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			if len(args) == 0 {
				if err := s.c.SetResilverRate(ctx, bps); err != nil {
					return fmt.Errorf("replace --rate: %w", g.apiErr(err))
				}
				limit := "none"
				if bps > 0 {
					limit = human(bps) + "/s"
				}
				fmt.Fprintf(g.stdout, "the running replace's rate limit is now %s\n", limit)
				return nil
			}
			start := time.Now()
			pl := newProgressLine(g.stderr, "replace", human)
			pl.quiet = asJSON
			fin, err := s.c.Replace(ctx, admin.ReplaceRequest{Path: args[0], Force: force, Rate: bps}, pl.update)
			pl.done()
			if err != nil {
				return fmt.Errorf("replace: %w", g.apiErr(err))
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, fin)
			}
			fmt.Fprintf(g.stdout, "%s (copied %s in %s)\n", fin.Message, human(fin.Done), humanDur(time.Since(start).Seconds()))
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "overwrite a device that holds data or another cache set's mirror label")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (the final progress)")
	cmd.Flags().StringVar(&rate, "rate", "", "limit the copy to RATE bytes a second (50M, 1G), leaving the rest of the devices' bandwidth to the served I/O (writes are never limited); default no limit")
	return cmd
}
