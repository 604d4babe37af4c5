package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
)

func newSetCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "set EXPORT [key=value ...]",
		Short: "Show or change an export's settings live (cache_mode, sequential_cutoff, ...)",
		Long: `Show an export's settings, or change them while it serves. Changes are
validated, applied at once and recorded in the cache set's superblock, so
they survive restarts.

Keys:
  cache_mode          writeback | writethrough | writearound | none
  sequential_cutoff   bytes (4M, 512K, 0 = off): longer sequential streams bypass the cache
  writeback_percent   0..100: target share of the cache that may be dirty
  writeback_order     epoch | lba
  promote             always | never | after:N
  writeback_rate_max  bytes per second (0 = no cap)

Examples:
  tiercache set default
  tiercache set default cache_mode=writethrough`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			export := args[0]
			kv := map[string]string{}
			var order []string
			for _, a := range args[1:] {
				k, v, ok := strings.Cut(a, "=")
				if !ok || k == "" {
					return fmt.Errorf("%q: want key=value (keys: %s)", a, strings.Join(cache.SettingKeys, ", "))
				}
				if _, dup := kv[k]; dup {
					return fmt.Errorf("%s given twice", k)
				}
				kv[k] = v
				order = append(order, k)
			}
			// Catch typos before asking the server (which validates again).
			probe := cache.DefaultSettings()
			for _, k := range order {
				if err := cache.ParseSetting(&probe, k, kv[k]); err != nil {
					return fmt.Errorf("%s=%s: %w", k, kv[k], err)
				}
			}
			c := g.client()
			ctx := cmdContext(cmd)
			var (
				cur map[string]string
				err error
			)
			if len(kv) == 0 {
				cur, err = c.Settings(ctx, export)
			} else {
				cur, err = c.SetSettings(ctx, export, kv)
			}
			if err != nil {
				return g.apiErr(err)
			}
			w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			keys := append([]string(nil), cache.SettingKeys...)
			for k := range cur {
				if !contains(keys, k) {
					keys = append(keys, k)
				}
			}
			for _, k := range keys {
				v, ok := cur[k]
				if !ok {
					continue
				}
				mark := ""
				if _, changed := kv[k]; changed {
					mark = "\t(changed)"
				}
				fmt.Fprintf(w, "%s\t%s%s\n", k, v, mark)
			}
			return w.Flush()
		},
	}
	return cmd
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
