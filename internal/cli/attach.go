package cli

import (
	"fmt"

	"github.com/spf13/cobra"
)

func newAttachCmd(g *globals) *cobra.Command {
	var backing string
	cmd := &cobra.Command{
		Use:   "attach --backing NAME=PATH",
		Short: "Add a backing device to the running cache set (not implemented yet)",
		Long: `Add a backing device to the running server's cache set.

Not implemented yet: adding a volume to a cache set needs engine support
that does not exist yet. The server answers with an error and this command
exits 1. Until then, include every backing device when formatting:
'tiercache format --cache PATH --backing NAME=PATH ...'.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			name, path, err := parseNamePath("backing", backing)
			if err != nil {
				return err
			}
			if err := g.client().Attach(cmdContext(cmd), name, absSpec(path)); err != nil {
				return fmt.Errorf("attach %s: %w", name, g.apiErr(err))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&backing, "backing", "", "backing device `NAME=PATH` to add")
	return cmd
}
