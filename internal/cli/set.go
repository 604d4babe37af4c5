package cli

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
)

func newSetCmd(g *globals) *cobra.Command {
	var asJSON bool
	var cachePath, direct string
	cmd := &cobra.Command{
		Use:   "set EXPORT [key=value ...]",
		Short: "Show or change an export's settings live (cache_mode, sequential_cutoff, ...)",
		Long: `Show an export's settings, or change them while it serves. Changes are
validated, applied at once and recorded in the cache set's superblock, so
they survive restarts. With --cache PATH the settings recorded in the
cache set on PATH are shown or changed offline (it must not be served;
they apply at the next 'tiercache serve --cache PATH').

Keys:
  cache_mode          writeback | writethrough | writearound | none
  sequential_cutoff   bytes (4M, 512KiB, 0 = off): longer sequential streams bypass the cache
  writeback_percent   0..100: target share of the cache that may be dirty
  writeback_order     epoch | lba
  promote             always | never | after:N
  writeback_rate_max  bytes per second (256K, 10MiB; 0 = no limit)

Examples:
  tiercache set default
  tiercache set default cache_mode=writethrough writeback_rate_max=10M
  tiercache set --cache /dev/nvme0n1p1 home sequential_cutoff=8M`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return fmt.Errorf("set needs the EXPORT whose settings to show or change ('tiercache list' lists the exports)")
			}
			return nil
		},
		ValidArgsFunction: completeExportThenSettings(g),
		RunE: func(cmd *cobra.Command, args []string) error {
			export := args[0]
			kv, order, err := parseSettingArgs(args[1:])
			if err != nil {
				return err
			}
			if cachePath != "" {
				return setOffline(g, cachePath, direct, export, kv, order, asJSON)
			}
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			var cur map[string]string
			if len(kv) == 0 {
				cur, err = s.c.Settings(ctx, export)
			} else {
				cur, err = s.c.SetSettings(ctx, export, kv)
			}
			if err != nil {
				return g.apiErr(err)
			}
			if asJSON {
				return writeServerJSON(g.stdout, s.id, map[string]any{"export": export, "settings": cur, "changed": order})
			}
			s.header(g.stdout)
			return printSettings(g.stdout, cur, kv)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (values as the server stores them: byte counts as numbers)")
	cmd.Flags().StringVar(&cachePath, "cache", "", "show or change the settings recorded in the cache set on this device, offline (not being served)")
	cmd.Flags().StringVar(&direct, "direct", "auto", "offline: O_DIRECT for the devices: auto, on, off")
	return cmd
}

// parseSettingArgs reads key=value arguments, checks them (catching
// typos before the server does, which validates again) and turns human
// units into the stored form.
func parseSettingArgs(args []string) (map[string]string, []string, error) {
	kv := map[string]string{}
	var order []string
	for _, a := range args {
		k, v, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return nil, nil, fmt.Errorf("%q: want key=value (keys: %s)", a, strings.Join(cache.SettingKeys, ", "))
		}
		if _, dup := kv[k]; dup {
			return nil, nil, fmt.Errorf("%s given twice", k)
		}
		nv, err := settingIn(k, v)
		if err != nil {
			return nil, nil, err
		}
		kv[k] = nv
		order = append(order, k)
	}
	probe := cache.DefaultSettings()
	for _, k := range order {
		if err := cache.ParseSetting(&probe, k, kv[k]); err != nil {
			return nil, nil, fmt.Errorf("%s=%s: %w", k, kv[k], err)
		}
	}
	return kv, order, nil
}

// printSettings prints every setting, in the documented order, in human
// units, marking the ones just changed.
func printSettings(out io.Writer, cur, changed map[string]string) error {
	w := newTable(out, 0)
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
		if _, c := changed[k]; c {
			mark = "(changed)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\n", k, settingOut(k, v), mark)
	}
	return w.Flush()
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
