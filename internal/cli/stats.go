package cli

import (
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
)

func newStatsCmd(g *globals) *cobra.Command {
	var asJSON bool
	var watch string
	cmd := &cobra.Command{
		Use:   "stats [INTERVAL [COUNT]]",
		Short: "Show counters per export: hits, misses, bypass, writeback, latency percentiles; with INTERVAL one line per export per interval",
		Long: `Show the running server's counters since it started: one column per
export, then the cache set's. Every counter of the engine is shown (bytes
in binary units, block counts also as bytes, times as durations), followed
by the derived values (hit ratio, measured writeback rate and the time the
dirty data needs at that rate) and each request type's latency in µs:
mean, p50, p99 and p99.9, for reads and writes also per tier (cache,
backing).

With INTERVAL (2, 5s, 500ms; a plain number is seconds), like iostat: one
line per export every INTERVAL, COUNT times (default: until interrupted),
with the rates of that interval: reads and writes per second, MiB/s read
and written, the hit ratio of the interval's reads, dirty data, writeback
MiB/s and the interval's p99 read and write latency in µs. The first line
covers the time since the server started. --watch[=INTERVAL] is the same
(default 2s).

--json prints the API's reply (one object per interval), snake_case, with
the server that answered under "server". docs/OPERATIONS.md explains each
counter.`,
		Args: cobra.MaximumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			interval, count := time.Duration(0), 0
			if watch != "" {
				d, err := parseInterval(watch)
				if err != nil {
					return fmt.Errorf("--watch %q: %w", watch, err)
				}
				interval = d
			}
			if len(args) > 0 {
				d, err := parseInterval(args[0])
				if err != nil {
					return fmt.Errorf("INTERVAL %q: %w", args[0], err)
				}
				interval = d
			}
			if len(args) > 1 {
				n, err := strconv.Atoi(args[1])
				if err != nil || n < 1 {
					return fmt.Errorf("COUNT %q: want a whole number >= 1", args[1])
				}
				count = n
			}
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			if interval == 0 {
				st, _, err := s.c.Stats(ctx)
				if err != nil {
					return g.apiErr(err)
				}
				if asJSON {
					return writeServerJSON(g.stdout, s.id, st)
				}
				s.header(g.stdout)
				return printStats(g.stdout, st)
			}
			if !asJSON {
				s.header(g.stdout)
			}
			var prev *admin.Stats
			for n := 0; count == 0 || n < count; n++ {
				if n > 0 {
					select {
					case <-ctx.Done():
						return nil // interrupted: the normal end of an interval run
					case <-time.After(interval):
					}
				}
				st, _, err := s.c.Stats(ctx)
				if err != nil && ctx.Err() != nil {
					return nil
				}
				if err != nil {
					return g.apiErr(err)
				}
				if asJSON {
					if err := writeServerJSON(g.stdout, s.id, st); err != nil {
						return err
					}
				} else {
					printInterval(g.stdout, st, prev, n%20 == 0)
				}
				prev = &st
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (with INTERVAL: one object per interval)")
	cmd.Flags().StringVar(&watch, "watch", "", "one line per export every `INTERVAL` (--watch alone: 2s), like 'stats INTERVAL'")
	cmd.Flags().Lookup("watch").NoOptDefVal = "2s"
	return cmd
}

// parseInterval reads 5, 2.5, 5s or 500ms (a plain number is seconds).
func parseInterval(s string) (time.Duration, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		f, ferr := strconv.ParseFloat(s, 64)
		if ferr != nil {
			return 0, fmt.Errorf("want seconds (5, 0.5) or a duration (5s, 500ms)")
		}
		d = time.Duration(f * float64(time.Second))
	}
	if d < 10*time.Millisecond {
		return 0, fmt.Errorf("want at least 10ms")
	}
	return d, nil
}

// statName is the name a counter is shown under: the API's (snake_case),
// with *_nanos shown as *_time since it prints as a duration.
func statName(field string) string {
	n := admin.SnakeName(field)
	if s, ok := strings.CutSuffix(n, "_nanos"); ok {
		return s + "_time"
	}
	return n
}

// statValue formats one field: bytes and blocks (as bytes) in binary
// units, nanoseconds as durations, rates per second; ok is false for
// fields that are not numbers.
func statValue(name string, v reflect.Value) (string, bool) {
	var f float64
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		f = float64(v.Int())
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		f = float64(v.Uint())
	case reflect.Float32, reflect.Float64:
		f = v.Float()
	case reflect.Bool:
		if v.Bool() {
			return "yes", true
		}
		return "no", true
	case reflect.String:
		if v.String() == "" {
			return "-", true
		}
		return v.String(), true
	case reflect.Struct:
		if t, ok := v.Interface().(time.Time); ok {
			if t.IsZero() {
				return "-", true
			}
			return t.Local().Format(time.DateTime), true
		}
		return "", false
	default:
		return "", false
	}
	switch {
	case strings.HasSuffix(name, "Bytes"):
		return human(int64(f)), true
	case strings.HasSuffix(name, "Blocks") && !strings.HasSuffix(name, "JournalBlocks"):
		return fmt.Sprintf("%d (%s)", int64(f), human(int64(f)*4096)), true
	case name == "WritebackRate":
		switch {
		case f < 0:
			return "full speed", true
		case f == 0:
			return "0 (under the dirty target)", true
		}
		return humanRate(f), true
	case strings.HasSuffix(name, "Nanos"):
		return humanMicros(f / 1e3), true
	case v.Kind() == reflect.Float32 || v.Kind() == reflect.Float64:
		return fmt.Sprintf("%.3g", f), true
	}
	return fmt.Sprint(int64(f)), true
}

// humanMicros prints a duration given in µs: µs below 10 ms, else a
// rounded duration.
func humanMicros(us float64) string {
	if us < 10000 {
		return fmt.Sprintf("%.0f µs", us)
	}
	return humanDur(us / 1e6)
}

// structRows renders the fields of vals (one struct per column).
func structRows(w io.Writer, vals []reflect.Value) {
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
		if t.Field(i).Type == reflect.TypeFor[cache.Mode]() || shownDerived[name] || hideWhenZero[name] && allZero(vals, i) {
			continue // the mode is in the header
		}
		row := "  " + statName(name)
		ok := true
		for _, v := range vals {
			if !v.IsValid() {
				row += "\t-"
				continue
			}
			s, isStat := statValue(name, v.Field(i))
			if !isStat {
				ok = false
				break
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
	"Failed": true, "Cause": true,
}

// latencyRows are the latency summaries stats prints, op/tier.
var latencyRows = []string{"read", "read/cache", "read/backing", "write", "write/cache", "write/backing", "flush", "trim", "write_zeroes", "prefetch"}

// shownDerived: fields printed as one derived row instead of their own.
var shownDerived = map[string]bool{"BackingConsistent": true, "InconsistentSince": true}

func allZero(vals []reflect.Value, field int) bool {
	for _, v := range vals {
		if v.IsValid() && !v.Field(field).IsZero() {
			return false
		}
	}
	return true
}

// latencyCell prints one latency summary: count, mean and percentiles in µs.
func latencyCell(l admin.LatencySummary) string {
	if l.Count == 0 {
		return "-"
	}
	return fmt.Sprintf("n=%d mean %.0f p50 %.0f p99 %.0f p99.9 %.0f µs", l.Count, l.MeanMicros, l.P50Micros, l.P99Micros, l.P999Micros)
}

// statRow is one row of derived values: its name and the text of a cell.
type statRow[T any] struct {
	name string
	f    func(*T) string
}

// printRows prints rows with a column per export: a row's text of the
// part of the export that part returns, or "-" where it returns nil.
// Nothing is printed when no export has the part.
func printRows[T any](w io.Writer, exports []admin.ExportStats, rows []statRow[T], part func(*admin.ExportStats) *T) {
	parts := make([]*T, len(exports))
	present := false
	for i := range exports {
		parts[i] = part(&exports[i])
		present = present || parts[i] != nil
	}
	if !present {
		return
	}
	for _, r := range rows {
		row := "  " + r.name
		for _, p := range parts {
			if p == nil {
				row += "\t-"
			} else {
				row += "\t" + r.f(p)
			}
		}
		fmt.Fprintln(w, row)
	}
}

func printStats(out io.Writer, st admin.Stats) error {
	w := newTable(out, 0)
	fmt.Fprintf(w, "counters since %s (up %s)\n", st.Started.Local().Format(time.DateTime), humanDur(st.Time.Sub(st.Started).Seconds()))
	header := "export"
	var vals []reflect.Value
	for _, e := range st.Exports {
		header += "\t" + e.Name + " (" + e.Mode + ")"
		if e.Volume != nil {
			vals = append(vals, reflect.ValueOf(e.Volume.VolumeStats))
		} else {
			vals = append(vals, reflect.Value{})
		}
	}
	fmt.Fprintln(w, header)
	anyVolume := false
	for _, v := range vals {
		anyVolume = anyVolume || v.IsValid()
	}
	if anyVolume {
		structRows(w, vals)
		derived := []statRow[admin.ExportStats]{
			{"backing_consistent", func(e *admin.ExportStats) string {
				c := admin.Consistency{WritebackOrder: e.WritebackOrder, BackingConsistent: e.Volume.BackingConsistent, CatchingUp: e.Volume.CatchingUp}
				if t := e.Volume.InconsistentSince; !t.IsZero() {
					c.InconsistentSince = &t
				}
				return consistencyText(c)
			}},
			{"hit_ratio", func(e *admin.ExportStats) string { return fmt.Sprintf("%.1f%%", 100*e.HitRatio) }},
			{"writeback_rate", func(e *admin.ExportStats) string { return humanRate(e.WritebackRate) }},
			{"writeback_eta", func(e *admin.ExportStats) string {
				switch {
				case e.WritebackETASeconds == 0:
					return "-"
				case e.WritebackETASeconds < 0:
					return "idle"
				}
				return humanDur(e.WritebackETASeconds)
			}},
		}
		printRows(w, st.Exports, derived, func(e *admin.ExportStats) *admin.ExportStats {
			if e.Volume == nil {
				return nil
			}
			return e
		})
	}
	printRows(w, st.Exports, remoteRows, func(e *admin.ExportStats) *admin.RemoteLink { return e.Remote })
	printRows(w, st.Exports, objStoreRows, func(e *admin.ExportStats) *admin.ObjectStore { return e.ObjectStore })
	for _, op := range latencyRows {
		name, tier, _ := strings.Cut(op, "/")
		row := "  latency_" + strings.ReplaceAll(op, "/", "_")
		seen := false
		for _, e := range st.Exports {
			cell := "-"
			for _, l := range e.Latency {
				if l.Op == name && l.Tier == tier {
					cell = latencyCell(l)
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
		structRows(w, []reflect.Value{reflect.ValueOf(st.Set.SetStats)})
	}
	return w.Flush()
}

// printInterval prints one line per export: the rates between prev and st
// (since the start when prev is nil), like iostat, in fixed-width columns
// so that the lines of successive intervals align.
func printInterval(out io.Writer, st admin.Stats, prev *admin.Stats, header bool) {
	const format = "%-8s  %-12s %7s %7s %7s %7s %6s %10s %8s %9s %9s\n"
	if header {
		fmt.Fprintf(out, format, "time", "export", "r/s", "w/s", "rMiB/s", "wMiB/s", "hit%", "dirty", "wbMiB/s", "r_p99_us", "w_p99_us")
	}
	dt := st.Time.Sub(st.Started).Seconds()
	if prev != nil {
		dt = st.Time.Sub(prev.Time).Seconds()
	}
	dt = max(dt, 1e-3)
	for _, e := range st.Exports {
		var cur, old cache.VolumeStats
		var oldLat []admin.LatencySummary
		if e.Volume != nil {
			cur = e.Volume.VolumeStats
		}
		if prev != nil {
			for _, p := range prev.Exports {
				if p.Name == e.Name {
					if p.Volume != nil {
						old = p.Volume.VolumeStats
					}
					oldLat = p.Latency
				}
			}
		}
		d := func(a, b uint64) float64 { return float64(a-min(a, b)) / dt }
		mib := func(a, b uint64) string { return fmt.Sprintf("%.1f", d(a, b)/(1<<20)) }
		p99 := func(op string) string {
			for _, l := range e.Latency {
				if l.Op != op || l.Tier != "" {
					continue
				}
				for _, o := range oldLat {
					if o.Op == op && o.Tier == "" {
						l = l.Sub(o)
					}
				}
				if l.Count > 0 {
					return fmt.Sprintf("%.0f", l.P99Micros)
				}
			}
			return "-"
		}
		hit, dirty, wb := "-", "-", "-"
		if e.Volume != nil {
			h, m := cur.ReadHitBytes-min(cur.ReadHitBytes, old.ReadHitBytes), cur.ReadMissBytes-min(cur.ReadMissBytes, old.ReadMissBytes)
			if h+m > 0 {
				hit = fmt.Sprintf("%.1f", 100*float64(h)/float64(h+m))
			}
			dirty = human(cur.DirtyBlocks * 4096)
			wb = mib(cur.WritebackBytes, old.WritebackBytes)
		}
		fmt.Fprintf(out, format, st.Time.Local().Format(time.TimeOnly), e.Name,
			fmt.Sprintf("%.0f", d(cur.ReadOps, old.ReadOps)), fmt.Sprintf("%.0f", d(cur.WriteOps, old.WriteOps)),
			mib(cur.ReadBytes, old.ReadBytes), mib(cur.WriteBytes, old.WriteBytes), hit, dirty, wb, p99("read"), p99("write"))
	}
}
