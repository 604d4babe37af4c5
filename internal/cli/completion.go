package cli

import (
	"context"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
)

// exportNames asks the running server (found as every command finds it)
// for its exports; none when no server answers within a second.
func exportNames(g *globals) []string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	st, err := g.client().Status(ctx)
	if err != nil {
		return nil
	}
	var names []string
	for _, e := range st.Exports {
		names = append(names, e.Name)
	}
	return names
}

// completeExport completes the first argument with the running server's
// export names.
func completeExport(g *globals) func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
	return func(_ *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return exportNames(g), cobra.ShellCompDirectiveNoFileComp
	}
}

// completeExportThenSettings completes an export name, then setting keys
// (key=) and the values of the keys that have a fixed set.
func completeExportThenSettings(g *globals) func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
	values := map[string][]string{
		"cache_mode":      {"writeback", "writethrough", "writearound", "none"},
		"writeback_order": {"epoch", "lba"},
		"promote":         {"always", "never", "after:2"},
	}
	return func(_ *cobra.Command, args []string, partial string) ([]string, cobra.ShellCompDirective) {
		if len(args) == 0 {
			return exportNames(g), cobra.ShellCompDirectiveNoFileComp
		}
		if k, _, ok := strings.Cut(partial, "="); ok {
			var out []string
			for _, v := range values[k] {
				out = append(out, k+"="+v)
			}
			return out, cobra.ShellCompDirectiveNoFileComp
		}
		var out []string
		for _, k := range cache.SettingKeys {
			out = append(out, k+"=")
		}
		return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
	}
}
