package kvm

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"

	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/logwrites"
)

// Point is one power-cut replay of a dm-log-writes log: entries [0, Upto)
// applied, then (for a torn point) the entries of Keep, the last of them
// cut to TornSectors sectors (-1: whole).
type Point struct {
	Kind        string // mark, flush, torn, end
	Upto        int
	Keep        []int
	TornSectors int64
	LastF       int // last kvmload mark (fK) in the replayed part, -1 none
	LastE       int // last ext4 file mark (eK), 0 none
}

func (p Point) String() string {
	s := fmt.Sprintf("%s point at entry %d (after f%d, e%d)", p.Kind, p.Upto, p.LastF, p.LastE)
	if p.Kind == "torn" {
		s += fmt.Sprintf(", %d unflushed entries kept, the last torn to %d sectors", len(p.Keep), p.TornSectors)
	}
	return s
}

// ChoosePoints picks the replay points of a power-cut log whose workload
// marked "fsready" once its file system was made: every mark, FLUSH and
// FUA entry after that mark (full), or a seeded sample of perKind of each,
// and torn points (one per FLUSH interval when full, else perKind): up to a
// FLUSH, then each data entry before the next FLUSH kept or dropped at
// random and the last kept one cut at a sector. The points are in log
// order.
func ChoosePoints(lg *logwrites.Log, seed uint64, full bool, perKind int) ([]Point, error) {
	es := lg.Entries
	ready := -1
	for i, e := range es {
		if e.IsMark() && e.Mark == "fsready" {
			ready = i
			break
		}
	}
	if ready < 0 {
		return nil, fmt.Errorf("no fsready mark in the log")
	}
	lastF, lastE := markIndex(lg)
	var markPts, flushPts []Point
	var flushIdx []int
	for i := ready + 1; i < len(es); i++ {
		switch {
		case es[i].IsMark() && es[i].Mark != "dm-log-writes-end":
			markPts = append(markPts, Point{Kind: "mark", Upto: i + 1, LastF: lastF[i+1], LastE: lastE[i+1]})
		case es[i].IsFlush() || es[i].IsFUA():
			flushPts = append(flushPts, Point{Kind: "flush", Upto: i + 1, LastF: lastF[i+1], LastE: lastE[i+1]})
			if es[i].IsFlush() {
				flushIdx = append(flushIdx, i)
			}
		}
	}
	rng := rand.New(rand.NewPCG(seed, 19))
	sample := func(ps []Point, n int) []Point {
		if full || len(ps) <= n {
			return ps
		}
		rng.Shuffle(len(ps), func(i, j int) { ps[i], ps[j] = ps[j], ps[i] })
		return ps[:n]
	}
	pts := append(sample(markPts, perKind), sample(flushPts, perKind)...)
	nTorn := perKind
	if full {
		nTorn = len(flushIdx) - 1
	}
	for k := 0; k < nTorn && len(flushIdx) > 1; k++ {
		j := k
		if !full {
			j = rng.IntN(len(flushIdx) - 1)
		}
		lo, hi := flushIdx[j], flushIdx[j+1]
		p := Point{Kind: "torn", Upto: lo + 1, LastF: lastF[lo+1], LastE: lastE[lo+1], TornSectors: -1}
		for i := lo + 1; i < hi; i++ {
			if es[i].HasData() && rng.IntN(2) == 0 {
				p.Keep = append(p.Keep, i)
			}
		}
		if len(p.Keep) > 0 {
			last := es[p.Keep[len(p.Keep)-1]]
			p.TornSectors = rng.Int64N(int64(last.NrSectors))
		}
		pts = append(pts, p)
	}
	slices.SortStableFunc(pts, func(a, b Point) int { return a.Upto - b.Upto })
	return pts, nil
}

// EndPoint is the whole log: the devices as the workload left them after
// its clean shutdown.
func EndPoint(lg *logwrites.Log) Point {
	lastF, lastE := markIndex(lg)
	n := len(lg.Entries)
	return Point{Kind: "end", Upto: n, TornSectors: -1, LastF: lastF[n], LastE: lastE[n]}
}

// markIndex returns, for each i in [0, len(entries)], the last kvmload mark
// (fK, -1 none) and ext4 file mark (eK, 0 none) among entries [0, i).
func markIndex(lg *logwrites.Log) (lastF, lastE []int) {
	es := lg.Entries
	lastF, lastE = make([]int, len(es)+1), make([]int, len(es)+1)
	f, e := -1, 0
	for i := 0; i <= len(es); i++ {
		lastF[i], lastE[i] = f, e
		if i < len(es) && es[i].IsMark() && len(es[i].Mark) > 1 {
			n, err := strconv.Atoi(es[i].Mark[1:])
			switch {
			case err != nil:
			case strings.HasPrefix(es[i].Mark, "f"):
				f = n
			case strings.HasPrefix(es[i].Mark, "e"):
				e = n
			}
		}
	}
	return lastF, lastE
}

// FileContents is the content of file i the power-cut workloads' ext4 part
// writes (`yes "tiercache file $i" | head -c $((1000 + i * 3001 % 60000))`).
func FileContents(i int) []byte {
	line := []byte(fmt.Sprintf("tiercache file %d\n", i))
	n := 1000 + i*3001%60000
	return bytes.Repeat(line, n/len(line)+1)[:n]
}

// TornAllowed checks a block that reads as torn at a point after mark fK:
// every 512-byte sector must equal that sector of a content the oracle
// allows in the block (zeroes or a write to it).
func (ev *Events) TornAllowed(k int, lba int64, b []byte) error {
	const sector = 512
	cands := map[uint64][]byte{}
	for _, id := range append([]uint64{0}, ev.WritesTo(lba)...) {
		d := crashtest.Decoded{Kind: crashtest.KindZero}
		if id != 0 {
			d = crashtest.Decoded{Kind: crashtest.KindWrite, ID: id}
		}
		// CheckCrash settles the block on what it accepts: a fresh oracle
		// for each question.
		o, err := ev.OracleAt(k)
		if err != nil {
			return err
		}
		if _, err := o.CheckCrash(lba, d); err == nil {
			cands[id] = make([]byte, crashtest.BlockSize)
			if id != 0 {
				crashtest.Stamp(cands[id], ev.Seed, uint64(lba), id)
			}
		}
	}
	for off := 0; off < crashtest.BlockSize; off += sector {
		ok := false
		for _, c := range cands {
			if bytes.Equal(b[off:off+sector], c[off:off+sector]) {
				ok = true
				break
			}
		}
		if !ok {
			return fmt.Errorf("block %d, torn: sector %d holds no allowed content", lba, off/sector)
		}
	}
	return nil
}
