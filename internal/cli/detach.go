package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

func newDetachCmd(g *globals) *cobra.Command {
	var cachePath, direct string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "detach [--cache PATH] EXPORT",
		Short: "Write back an export's dirty data and remove its disk from the cache set, complete and usable alone",
		Long: `Detach EXPORT from the cache set:

  1. the export is withdrawn from the NBD server and its connections end
     (requests in flight finish first; other exports are not touched);
  2. its mode becomes none, its dirty data is written back to the backing
     device and synced, with a progress bar;
  3. every cached block of it is dropped and the drop is committed;
  4. the backing device is released (its user.tiercache.set attribute is
     removed) and the volume leaves the cache set's superblock.

The backing device is then complete: it holds every byte written through
the export, and can be used alone ('tiercache serve --export NAME=PATH',
losetup, qemu, mount) or attached again, to this set or another one.

Without --cache the running server detaches it while it serves. With
--cache PATH the cache set on PATH is changed offline (it must not be
served). A crash at any point leaves the set either still listing the
volume, in mode none and holding no dirty data for it (run detach again),
or not listing it; the disk is complete in both cases.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 {
				return nil
			}
			if len(args) > 1 {
				return fmt.Errorf("detach takes one EXPORT, got %d: %s", len(args), strings.Join(args, " "))
			}
			if cachePath != "" {
				return fmt.Errorf("detach needs the EXPORT to detach ('tiercache show --cache %s' lists the volumes)", cachePath)
			}
			names := exportNames(g)
			return fmt.Errorf("detach needs the EXPORT to detach (exports: %s)", joinOrNone(names))
		},
		ValidArgsFunction: completeExport(g),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			if cachePath != "" {
				return detachOffline(g, cachePath, name, direct, asJSON)
			}
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			if !asJSON {
				s.header(g.stdout)
			}
			pl := newProgressLine(g.stderr, "detach "+name, human)
			pl.quiet = asJSON
			fin, err := s.c.Detach(ctx, name, pl.update)
			pl.done()
			if err != nil {
				return fmt.Errorf("detach %s: %w", name, g.apiErr(err))
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, fin)
			}
			fmt.Fprintf(g.stdout, "wrote back %s\n%s\n", human(fin.Done), fin.Message)
			return nil
		},
	}
	cmd.Flags().StringVar(&cachePath, "cache", "", "change the cache set on this cache device offline (not being served)")
	cmd.Flags().StringVar(&direct, "direct", "auto", "offline: O_DIRECT for the devices: auto, on, off")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (the final progress)")
	return cmd
}

func joinOrNone(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}
