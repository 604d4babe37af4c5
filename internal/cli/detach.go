package cli

import (
	"fmt"

	"github.com/spf13/cobra"
)

func newDetachCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "detach EXPORT",
		Short: "Flush an export, stop caching it and release its backing device for use alone",
		Long: `Detach EXPORT from the cache set while the server runs:

  1. the export is withdrawn: new NBD connections to it are refused
     (disconnect its clients first; connections still open are served
     uncached, straight to the backing device);
  2. its mode becomes none (recorded in the superblock), its dirty data is
     written back and synced, with a progress bar;
  3. every cached block of it is dropped and the drop is committed;
  4. the backing device is released (its user.tiercache.set attribute is
     removed).

The backing device is then complete and can be used alone, for example with
'tiercache serve --export NAME=PATH', mounted through any NBD client, or
attached to nothing at all. If the cache set is served again later, the
export comes back in mode none, uncached.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			pl := newProgressLine(g.stderr, "detach "+name, human)
			fin, err := g.client().Detach(cmdContext(cmd), name, pl.update)
			pl.done()
			if err != nil {
				return fmt.Errorf("detach %s: %w", name, g.apiErr(err))
			}
			fmt.Fprintf(g.stdout, "wrote back %s\n%s\n", human(fin.Done), fin.Message)
			return nil
		},
	}
	return cmd
}
