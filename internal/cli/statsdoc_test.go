package cli

import (
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache"
)

// TestStatsDocumented fails when a row 'tiercache stats' prints has no
// line in the "What each stat means" tables of docs/OPERATIONS.md: every
// counter of the engine (under the name stats prints), every derived row
// and every latency row.
func TestStatsDocumented(t *testing.T) {
	b, err := os.ReadFile(walkDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n## What each stat means")
	if i < 0 {
		t.Fatalf("%s has no section \"What each stat means\"", walkDoc)
	}
	sec := doc[i+1:]
	if j := strings.Index(sec[1:], "\n## "); j >= 0 {
		sec = sec[:j+1]
	}
	documented := map[string]bool{}
	for _, l := range strings.Split(sec, "\n") {
		if !strings.HasPrefix(l, "| `") {
			continue
		}
		first, _, _ := strings.Cut(strings.TrimPrefix(l, "| "), " |")
		for _, m := range regexp.MustCompile("`([a-z0-9_]+)`").FindAllStringSubmatch(first, -1) {
			documented[m[1]] = true
		}
	}
	var rows []string
	for _, typ := range []reflect.Type{reflect.TypeFor[cache.VolumeStats](), reflect.TypeFor[cache.SetStats]()} {
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			if f.Type == reflect.TypeFor[cache.Mode]() || shownDerived[f.Name] {
				continue // in the header, or one of the derived rows
			}
			rows = append(rows, statName(f.Name))
		}
	}
	rows = append(rows, "hit_ratio", "writeback_rate", "writeback_eta", "backing_consistent")
	for _, r := range remoteRows {
		rows = append(rows, r.name)
	}
	for _, r := range objStoreRows {
		rows = append(rows, r.name)
	}
	for _, op := range latencyRows {
		rows = append(rows, "latency_"+strings.ReplaceAll(op, "/", "_"))
	}
	for _, r := range rows {
		if !documented[r] {
			t.Errorf("stats prints %s, which %s's \"What each stat means\" does not explain", r, walkDoc)
		}
	}
}
