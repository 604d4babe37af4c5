package kvm

import (
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/tiercache/tiercache/internal/logwrites"
)

// testLog builds a log from a compact description: "w" a write of 8
// sectors, "fua" a FUA write, "F" an empty FLUSH, "d" a discard, any other
// word a mark of that name.
func testLog(words ...string) *logwrites.Log {
	lg := &logwrites.Log{SectorSize: 512}
	for i, w := range words {
		e := logwrites.Entry{Index: i, Sector: uint64(8 * i), NrSectors: 8}
		switch w {
		case "w":
		case "fua":
			e.Flags = logwrites.FlagFUA
		case "F":
			e.Flags, e.Sector, e.NrSectors = logwrites.FlagFlush, 0, 0
		case "d":
			e.Flags = logwrites.FlagDiscard
		default:
			e.Flags, e.Sector, e.NrSectors, e.Mark = logwrites.FlagMark, 0, 0, w
		}
		lg.Entries = append(lg.Entries, e)
	}
	return lg
}

// A log as the power-cut workloads leave it: set-up writes before fsready,
// then kvmload's FLUSH marks (fK) and the ext4 file marks (eK) among
// writes, FUA writes and FLUSHes.
var pointsLog = []string{
	"w", "F", "w", "fsready", // 0-3: before the workload
	"w", "w", "fua", "F", "f0", // 4-8
	"w", "e1", "w", "d", "F", // 9-13
	"fua", "w", "w", "F", "f1", "e2", // 14-19
	"w", "F", "dm-log-writes-end", // 20-22
}

// TestChoosePointsFull: with full, every mark and every FLUSH and FUA
// entry after fsready is a point (the end mark is not: EndPoint is the
// end), each torn point starts at a FLUSH and keeps only data entries
// before the next one, one torn point per interval between two FLUSHes, and
// each point knows the last fK and eK mark it replays.
func TestChoosePointsFull(t *testing.T) {
	lg := testLog(pointsLog...)
	pts, err := ChoosePoints(lg, 1, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	type pt struct {
		kind         string
		upto         int
		lastF, lastE int
	}
	var got []pt
	for _, p := range pts {
		got = append(got, pt{p.Kind, p.Upto, p.LastF, p.LastE})
	}
	// Marks: f0 (8), e1 (10), f1 (18), e2 (19). FLUSH/FUA: 6, 7, 13, 14,
	// 17, 21. Torn: from each FLUSH but the last (7, 13, 17) to the next.
	want := []pt{
		{"flush", 7, -1, 0},
		{"flush", 8, -1, 0}, {"torn", 8, -1, 0},
		{"mark", 9, 0, 0},
		{"mark", 11, 0, 1},
		{"flush", 14, 0, 1}, {"torn", 14, 0, 1},
		{"flush", 15, 0, 1},
		{"flush", 18, 0, 1}, {"torn", 18, 0, 1},
		{"mark", 19, 1, 1},
		{"mark", 20, 1, 2},
		{"flush", 22, 1, 2},
	}
	slices.SortStableFunc(got, func(a, b pt) int {
		if a.upto != b.upto {
			return a.upto - b.upto
		}
		if a.kind < b.kind {
			return -1
		}
		if a.kind > b.kind {
			return 1
		}
		return 0
	})
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("points:\n got %v\nwant %v", got, want)
	}
	flushes := []int{7, 13, 17, 21}
	for _, p := range pts {
		if p.Kind != "torn" {
			if len(p.Keep) != 0 {
				t.Errorf("%v: keeps entries", p)
			}
			continue
		}
		lo := p.Upto - 1
		hi := flushes[slices.Index(flushes, lo)+1]
		checkTorn(t, lg, p, lo, hi)
	}
	end := EndPoint(lg)
	if end.Kind != "end" || end.Upto != len(lg.Entries) || end.LastF != 1 || end.LastE != 2 || end.TornSectors != -1 {
		t.Errorf("end point %+v", end)
	}
}

// checkTorn checks a torn point between the FLUSH at lo and the next at hi:
// kept entries in order, data writes strictly between, the last one cut
// inside it.
func checkTorn(t *testing.T, lg *logwrites.Log, p Point, lo, hi int) {
	t.Helper()
	if !lg.Entries[lo].IsFlush() {
		t.Errorf("%v: does not start at a FLUSH", p)
	}
	if !slices.IsSorted(p.Keep) || len(slices.Compact(slices.Clone(p.Keep))) != len(p.Keep) {
		t.Errorf("%v: kept entries %v not in log order", p, p.Keep)
	}
	for _, i := range p.Keep {
		if i <= lo || i >= hi || !lg.Entries[i].HasData() {
			t.Errorf("%v: keeps entry %v, not a data write between FLUSHes %d and %d", p, lg.Entries[i], lo, hi)
		}
	}
	switch {
	case len(p.Keep) == 0 && p.TornSectors != -1:
		t.Errorf("%v: nothing kept, yet a torn sector count", p)
	case len(p.Keep) > 0 && (p.TornSectors < 0 || p.TornSectors >= int64(lg.Entries[p.Keep[len(p.Keep)-1]].NrSectors)):
		t.Errorf("%v: torn at %d sectors of a %d-sector write", p, p.TornSectors, lg.Entries[p.Keep[len(p.Keep)-1]].NrSectors)
	}
}

// TestChoosePointsSample: a sample has at most perKind points of each
// kind, all of them points of the full set, in log order; the same seed
// draws the same sample.
func TestChoosePointsSample(t *testing.T) {
	lg := testLog(pointsLog...)
	full, err := ChoosePoints(lg, 1, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	key := func(p Point) string { return fmt.Sprintf("%s@%d", p.Kind, p.Upto) }
	inFull := map[string]bool{}
	for _, p := range full {
		inFull[key(p)] = true
	}
	flushes := []int{7, 13, 17, 21}
	seen := map[string]bool{}
	for seed := uint64(0); seed < 50; seed++ {
		pts, err := ChoosePoints(lg, seed, false, 2)
		if err != nil {
			t.Fatal(err)
		}
		again, _ := ChoosePoints(lg, seed, false, 2)
		if !reflect.DeepEqual(pts, again) {
			t.Fatalf("seed %d: two draws differ", seed)
		}
		if !slices.IsSortedFunc(pts, func(a, b Point) int { return a.Upto - b.Upto }) {
			t.Errorf("seed %d: not in log order: %v", seed, pts)
		}
		kinds := map[string]int{}
		for _, p := range pts {
			kinds[p.Kind]++
			seen[key(p)] = true
			if p.Kind == "torn" {
				lo := p.Upto - 1
				i := slices.Index(flushes, lo)
				if i < 0 || i == len(flushes)-1 {
					t.Fatalf("seed %d: %v does not start at a FLUSH followed by another", seed, p)
				}
				checkTorn(t, lg, p, lo, flushes[i+1])
			} else if !inFull[key(p)] {
				t.Errorf("seed %d: %v is not a point of the full set", seed, p)
			}
		}
		if kinds["mark"] != 2 || kinds["flush"] != 2 || kinds["torn"] != 2 {
			t.Errorf("seed %d: %v points of each kind, want 2", seed, kinds)
		}
	}
	// Over 50 seeds every mark and FLUSH point is drawn at least once.
	for _, p := range full {
		if p.Kind != "torn" && !seen[key(p)] {
			t.Errorf("%v never drawn in 50 seeds", p)
		}
	}
}

// TestChoosePointsSmall: a log with fewer points of a kind than asked gives
// them all; one with a single FLUSH has no torn point (no interval); a log
// without the fsready mark is refused.
func TestChoosePointsSmall(t *testing.T) {
	pts, err := ChoosePoints(testLog("fsready", "w", "F", "f0", "w"), 3, false, 4)
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != 2 || pts[0].Kind != "flush" || pts[0].Upto != 3 || pts[1].Kind != "mark" || pts[1].Upto != 4 || pts[1].LastF != 0 {
		t.Errorf("points %v", pts)
	}
	if _, err := ChoosePoints(testLog("w", "F", "f0"), 1, true, 0); err == nil {
		t.Error("a log without fsready accepted")
	}
}
