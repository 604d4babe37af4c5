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
	if !h.set.MirrorUses(dev) {
		// Refused before the mirror took it (or the resilver put it
		// aside): free for a retry (with --force, say) at once.
		dev.Close()
		release()
		return member, req.Path, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	// Closed only when the server stops: the mirror holds it as a member
	// (on an error, as the failed member's device).
	h.replaced = append(h.replaced, func() { dev.Close(); release() })
	return member, req.Path, err
}

func newReplaceCmd(g *globals) *cobra.Command {
	var force, asJSON bool
	var rate string
	cmd := &cobra.Command{
		Use:     "replace [DEVICE]",
		Aliases: []string{"attach-mirror"},
		Short:   "Bring a new device into a degraded mirrored cache set as its failed member, or attach a mirror to a set on one device, while it serves",
		Long: `Resilver DEVICE into the running server's mirrored cache set as the member
that failed (status says which: DEGRADED, member A or B failed), with a
progress bar and ETA. The set keeps serving: every write goes to both the
survivor and DEVICE while the metadata and the buckets that need a copy
(for a new B: those holding dirty data; for a new A: what B holds) are
copied. When it ends the set is redundant again.

On a set on one cache device (attach-mirror) DEVICE becomes its mirror,
member B: the set turns into a mirrored set whose B has failed (status:
DEGRADED, member B being resilvered) and B is resilvered as above. From
then on the set is mirrored: restart the server with --cache-mirror DEVICE.

A crash or a stop at any point leaves the set degraded on the survivor,
with DEVICE marked not in sync (it is not trusted): run replace again. An
attach stopped before its first step was durable leaves the set on one
device.

Refused: a mirrored set that is not degraded, a DEVICE too small for the
member (B needs the metadata region and the buckets holding dirty data; A
the set's whole layout), the survivor (or the cache device) itself, and,
unless --force, a DEVICE that holds data or another set's mirror label.

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
			pl := newProgressLine(g.stderr, cmd.CalledAs(), human)
			pl.quiet = asJSON
			fin, err := s.c.Replace(ctx, admin.ReplaceRequest{Path: args[0], Force: force, Rate: bps}, pl.update)
			pl.done()
			if err != nil {
				return fmt.Errorf("%s: %w", cmd.CalledAs(), g.apiErr(err))
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
