package cli

import (
	"fmt"
	"io"
	"reflect"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
)

func newStatsCmd(g *globals) *cobra.Command {
	var asJSON bool
	var watch time.Duration
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Show counters per export: hits, misses, hit ratio, bypass, promotions, writeback, errors",
		Long: `Show the running server's counters, one column per export, and the cache
set's counters. Every counter of the engine is shown (byte counts in binary
units, block counts as bytes), followed by the derived values: read hit
ratio, writeback rate and the time the dirty data needs to be written back
at that rate, and the mean latency of each request type.

--watch[=INTERVAL] (default 2s) repeats, adding per-second rates of the
counters. docs/OPERATIONS.md explains each counter.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c := g.client()
			ctx := cmdContext(cmd)
			var prev *admin.Stats
			for {
				st, raw, err := c.Stats(ctx)
				if err != nil && watch > 0 && prev != nil && ctx.Err() != nil {
					return nil // interrupted while asking for the next frame: the normal end of --watch
				}
				if err != nil {
					return g.apiErr(err)
				}
				if asJSON {
					if _, err := g.stdout.Write(raw); err != nil {
						return err
					}
				} else {
					if watch > 0 {
						fmt.Fprintf(g.stdout, "--- %s\n", st.Time.Format(time.DateTime))
					}
					if err := printStats(g.stdout, st, prev); err != nil {
						return err
					}
				}
				if watch <= 0 {
					return nil
				}
				prev = &st
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(watch):
				}
				if !asJSON {
					fmt.Fprintln(g.stdout)
				}
			}
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the API's JSON (with --watch: one object per interval)")
	cmd.Flags().DurationVar(&watch, "watch", 0, "repeat every `INTERVAL` (--watch alone: 2s)")
	cmd.Flags().Lookup("watch").NoOptDefVal = "2s"
	return cmd
}

// snake turns a Go field name into the words shown: ReadHitBytes -> read_hit_bytes.
func snake(s string) string {
	rs := []rune(s)
	var b strings.Builder
	for i, r := range rs {
		// A word starts at an upper-case letter after a lower-case one,
		// or at the last capital of an acronym (GCMoves -> gc_moves).
		if i > 0 && unicode.IsUpper(r) && (unicode.IsLower(rs[i-1]) || i+1 < len(rs) && unicode.IsLower(rs[i+1]) && unicode.IsUpper(rs[i-1])) {
			b.WriteByte('_')
		}
		b.WriteRune(unicode.ToLower(r))
	}
	return b.String()
}

// statValue formats one numeric field: bytes and blocks (as bytes) in
// binary units, other counts as they are.
func statValue(name string, v reflect.Value) (string, float64, bool) {
	var f float64
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		f = float64(v.Int())
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		f = float64(v.Uint())
	case reflect.Float32, reflect.Float64:
		f = v.Float()
	default:
		return "", 0, false
	}
	switch {
	case strings.HasSuffix(name, "Bytes"):
		return human(int64(f)), f, true
	case strings.HasSuffix(name, "Blocks") && !strings.HasSuffix(name, "JournalBlocks"):
		return fmt.Sprintf("%d (%s)", int64(f), human(int64(f)*4096)), f, true
	case strings.HasSuffix(name, "Rate"):
		if f < 0 {
			return "full speed", f, true
		}
		return humanRate(f), f, true
	case strings.HasSuffix(name, "Nanos"):
		return time.Duration(int64(f)).Round(time.Microsecond).String(), f, true
	case v.Kind() == reflect.Float32 || v.Kind() == reflect.Float64:
		return fmt.Sprintf("%.3g", f), f, true
	}
	return fmt.Sprint(int64(f)), f, true
}

func rateSuffix(name string, cur, old float64, dt float64, isBytes bool) string {
	if dt <= 0 || cur < old {
		return ""
	}
	r := (cur - old) / dt
	if r == 0 {
		return ""
	}
	if isBytes {
		return " (+" + humanRate(r) + ")"
	}
	return fmt.Sprintf(" (+%.0f/s)", r)
}

// structRows renders the numeric fields of vals (one struct per column),
// with per-second rates against prevs when given.
func structRows(w io.Writer, vals, prevs []reflect.Value, dt float64) {
	var t reflect.Type
	for _, v := range vals {
		if v.IsValid() {
			t = v.Type()
			break
		}
	}
	if t == nil {
		return
	}
	for i := 0; i < t.NumField(); i++ {
		name := t.Field(i).Name
		if t.Field(i).Type == reflect.TypeFor[cache.Mode]() {
			continue // shown in the header
		}
		row := "  " + snake(name)
		ok := true
		if hideWhenZero[name] && allZero(vals, i) {
			continue
		}
		for j, v := range vals {
			if !v.IsValid() {
				row += "\t-"
				continue
			}
			s, f, isNum := statValue(name, v.Field(i))
			if !isNum {
				ok = false
				break
			}
			if prevs != nil && prevs[j].IsValid() && (strings.HasSuffix(name, "Ops") || strings.HasSuffix(name, "Bytes") || strings.HasSuffix(name, "Errors")) {
				_, old, _ := statValue(name, prevs[j].Field(i))
				s += rateSuffix(name, f, old, dt, strings.HasSuffix(name, "Bytes"))
			}
			row += "\t" + s
		}
		if ok {
			fmt.Fprintln(w, row)
		}
	}
}

// hideWhenZero: counters of a cache device failure, shown only once one is
// not zero (with the set's FAILED line).
var hideWhenZero = map[string]bool{
	"BypassCacheFailedBytes": true, "UnreachableDirtyBlocks": true, "LostWriteBlocks": true,
	"UnreachableReadErrors": true, "FencedWriteErrors": true, "CacheErrors": true, "BackingSyncErrors": true, "EpochDeferBytes": true,
}

func allZero(vals []reflect.Value, field int) bool {
	for _, v := range vals {
		if v.IsValid() && !v.Field(field).IsZero() {
			return false
		}
	}
	return true
}

func printStats(out io.Writer, st admin.Stats, prev *admin.Stats) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	header := "export"
	var vals, prevs []reflect.Value
	dt := 0.0
	if prev != nil {
		dt = st.Time.Sub(prev.Time).Seconds()
		prevs = []reflect.Value{}
	}
	for _, e := range st.Exports {
		header += "\t" + e.Name + " (" + e.Mode + ")"
		if e.Volume != nil {
			vals = append(vals, reflect.ValueOf(*e.Volume))
		} else {
			vals = append(vals, reflect.Value{})
		}
		if prev != nil {
			var pv reflect.Value
			for _, p := range prev.Exports {
				if p.Name == e.Name && p.Volume != nil {
					pv = reflect.ValueOf(*p.Volume)
				}
			}
			prevs = append(prevs, pv)
		}
	}
	fmt.Fprintln(w, header)
	var valid []reflect.Value
	for _, v := range vals {
		if v.IsValid() {
			valid = append(valid, v)
		}
	}
	if len(valid) > 0 {
		structRows(w, vals, prevs, dt)
		derived := []struct {
			name string
			f    func(admin.ExportStats) string
		}{
			{"hit_ratio", func(e admin.ExportStats) string { return fmt.Sprintf("%.1f%%", 100*e.HitRatio) }},
			{"writeback_measured", func(e admin.ExportStats) string { return humanRate(e.WritebackRate) }},
			{"writeback_eta", func(e admin.ExportStats) string {
				switch {
				case e.WritebackETASeconds == 0:
					return "-"
				case e.WritebackETASeconds < 0:
					return "idle"
				}
				return humanDur(e.WritebackETASeconds)
			}},
		}
		for _, d := range derived {
			row := "  " + d.name
			for _, e := range st.Exports {
				if e.Volume == nil {
					row += "\t-"
				} else {
					row += "\t" + d.f(e)
				}
			}
			fmt.Fprintln(w, row)
		}
	}
	for _, op := range []string{"read", "write", "flush", "trim", "write_zeroes", "prefetch"} {
		row := "  latency_" + op
		seen := false
		for _, e := range st.Exports {
			cell := "-"
			for _, l := range e.Latency {
				if l.Op == op {
					cell = fmt.Sprintf("%s avg of %d", humanDur(l.MeanSec), l.Count)
					seen = true
				}
			}
			row += "\t" + cell
		}
		if seen {
			fmt.Fprintln(w, row)
		}
	}
	if st.Set != nil {
		fmt.Fprintln(w, "\t")
		fmt.Fprintln(w, "cache set\t")
		if st.Set.Failed {
			fmt.Fprintf(w, "  FAILED\tcache device failed, serving from the backing devices: %s\n", st.Set.Cause)
		}
		var pv []reflect.Value
		if prev != nil && prev.Set != nil {
			pv = []reflect.Value{reflect.ValueOf(*prev.Set)}
		}
		structRows(w, []reflect.Value{reflect.ValueOf(*st.Set)}, pv, dt)
	}
	return w.Flush()
}
