package model

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// geometry is the mechanical layout of the modelled disk: zones of
// equal-length tracks, a seek curve and a spindle. It is immutable after
// newGeometry and safe for concurrent use.
//
// Invariants:
//
//  1. Zones are contiguous and ordered by byte offset, zone i starting at
//     zones[i].start, and cover [0, capacity). Track numbers grow with the
//     offset: track 0 is the outermost.
//  2. trackBytes is a positive multiple of 512 and does not grow from one
//     zone to the next (outer tracks hold more).
//  3. skew equals seek(1), so a sequential transfer that crosses a track
//     boundary finds the next track's first sector under the head just as
//     the one-track seek ends, as on a real disk formatted with track skew.
//  4. seek(0) = 0, seek(1) = skew, and seek is non-decreasing in the
//     distance, reaching fullStroke at the last track.
type geometry struct {
	capacity int64
	rev      int64 // ns per revolution
	skew     int64 // ns, the angular offset between consecutive tracks
	tol      int64 // ns: a rotational wait within tol of a full turn is none (rounding)
	zones    []zone
	tracks   int64 // total number of tracks

	t2t, full int64   // ns: seek of one track and of the full stroke
	x0        float64 // stroke fraction where the sqrt part of the curve ends
	a         float64 // ns per sqrt(stroke fraction), fitted to the average
}

type zone struct {
	start      int64 // first byte
	trackBytes int64 // bytes per track (one revolution)
	firstTrack int64
	tracks     int64
}

// seekKnee is the fraction of the full stroke where the seek curve turns
// from sqrt (the arm accelerates and decelerates) to linear (the arm coasts
// at its top speed), as in Ruemmler and Wilkes's two-part curve.
const seekKnee = 0.25

// newGeometry lays out zones over capacity bytes: nZones zones of equal
// track count, whose sustained rate falls linearly from outer to inner
// (bytes per second, track switches included).
func newGeometry(capacity int64, rpm float64, nZones int, outer, inner float64, t2t, avg, full time.Duration) (*geometry, error) {
	switch {
	case capacity <= 0:
		return nil, fmt.Errorf("model: capacity %d is not positive", capacity)
	case !(rpm >= 60 && rpm <= 1e6):
		return nil, fmt.Errorf("model: rpm %v out of range [60, 1e6]", rpm)
	case nZones < 1 || nZones > 1024:
		return nil, fmt.Errorf("model: %d zones, want 1..1024", nZones)
	case !(outer > 0 && inner > 0 && inner <= outer && outer < 1e12):
		return nil, fmt.Errorf("model: zone rates outer %v inner %v: want 0 < inner <= outer", outer, inner)
	case !(t2t > 0 && t2t <= avg && avg <= full && full <= 10*time.Second):
		return nil, fmt.Errorf("model: seek times track-to-track %v, average %v, full stroke %v: want 0 < t2t <= avg <= full <= 10s", t2t, avg, full)
	}
	g := &geometry{
		capacity: capacity,
		rev:      int64(60e9 / rpm),
		t2t:      int64(t2t),
		full:     int64(full),
		x0:       seekKnee,
	}
	if g.t2t >= g.rev {
		return nil, errors.New("model: the track-to-track seek must be shorter than a revolution")
	}
	// Track size from the sustained rate: a track's bytes pass in one
	// revolution, and each track switch costs t2t, so
	// sustained = trackBytes / (rev + t2t).
	var perRound int64 // bytes in one track of every zone
	sizes := make([]int64, nZones)
	for i := range sizes {
		rate := outer
		if nZones > 1 {
			rate = outer - (outer-inner)*float64(i)/float64(nZones-1)
		}
		b := int64(rate*float64(g.rev+g.t2t)/1e9) / 512 * 512
		sizes[i] = max(b, 512)
		perRound += sizes[i]
	}
	perZone := (capacity + perRound - 1) / perRound // tracks per zone
	var start, track int64
	for _, b := range sizes {
		if start >= capacity {
			break
		}
		g.zones = append(g.zones, zone{start: start, trackBytes: b, firstTrack: track, tracks: perZone})
		start += b * perZone
		track += perZone
	}
	// The last zone may be cut short by the capacity.
	last := &g.zones[len(g.zones)-1]
	last.tracks = (capacity - last.start + last.trackBytes - 1) / last.trackBytes
	g.tracks = last.firstTrack + last.tracks
	g.fitSeek(float64(avg))
	g.skew = g.seek(1)
	g.tol = max(int64(512)*g.rev/g.zones[0].trackBytes, 1) // one sector
	return g, nil
}

// seekFrac is the seek curve over the stroke fraction x in (0, 1]:
//
//	s(x) = t2t + a·(√x − √x1)                          for x ≤ x0
//	s(x) = s(x0) + (full − s(x0))·(x − x0)/(1 − x0)    for x > x0
//
// where x1 is one track's fraction, so that s(x1) = t2t.
func (g *geometry) seekFrac(x, x1 float64) float64 {
	if x <= g.x0 {
		return float64(g.t2t) + g.a*(math.Sqrt(x)-math.Sqrt(x1))
	}
	knee := float64(g.t2t) + g.a*(math.Sqrt(g.x0)-math.Sqrt(x1))
	return knee + (float64(g.full)-knee)*(x-g.x0)/(1-g.x0)
}

// fitSeek chooses a so that the mean seek between two uniformly random
// positions, ∫ s(x)·2(1−x) dx over (0, 1], equals avg (the datasheet's
// "average seek"), keeping s(x0) ≤ full so the curve stays monotonic.
func (g *geometry) fitSeek(avg float64) {
	x1 := 1 / float64(g.tracks)
	mean := func() float64 {
		const steps = 2000
		sum := 0.0
		for i := range steps {
			x := (float64(i) + 0.5) / steps
			sum += g.seekFrac(x, x1) * 2 * (1 - x) / steps
		}
		return sum
	}
	lo, hi := 0.0, float64(g.full-g.t2t)/(math.Sqrt(g.x0)-math.Sqrt(min(x1, g.x0)))
	if math.IsInf(hi, 0) || math.IsNaN(hi) {
		hi = 0
	}
	for range 60 {
		g.a = (lo + hi) / 2
		if mean() < avg {
			lo = g.a
		} else {
			hi = g.a
		}
	}
	g.a = lo
}

// seek returns the time to move the head across d tracks (ns).
func (g *geometry) seek(d int64) int64 {
	if d < 0 {
		d = -d
	}
	if d == 0 {
		return 0
	}
	x1 := 1 / float64(g.tracks)
	return int64(g.seekFrac(min(float64(d)*x1, 1), x1))
}

// locate returns the zone, the track and the offset within that track of
// byte off (0 <= off < capacity).
func (g *geometry) locate(off int64) (z *zone, track, within int64) {
	i := len(g.zones) - 1
	for i > 0 && g.zones[i].start > off {
		i--
	}
	z = &g.zones[i]
	rel := off - z.start
	return z, z.firstTrack + rel/z.trackBytes, rel % z.trackBytes
}

// track returns the track holding byte off, clamped to the disk.
func (g *geometry) track(off int64) int64 {
	off = min(max(off, 0), g.capacity-1)
	_, t, _ := g.locate(off)
	return t
}

// angle is the spindle phase (ns into a revolution) at which byte within of
// track passes under the head: θ = (within/trackBytes·rev + track·skew) mod rev.
func (g *geometry) angle(z *zone, track, within int64) int64 {
	return (within*g.rev/z.trackBytes + track%g.rev*g.skew%g.rev) % g.rev
}

// rotWait is how long the head, over the right track at model time t, waits
// for phase θ: (θ − t) mod rev, with a wait within tol of a full turn taken
// as none (the previous transfer ended exactly there, give or take rounding).
func (g *geometry) rotWait(t, theta int64) int64 {
	w := ((theta-t)%g.rev + g.rev) % g.rev
	if w > g.rev-g.tol {
		w = 0
	}
	return w
}

// access is the mechanical service of n bytes at off starting at model time
// t with the head over track head. Track by track: seek to the track, wait
// for the first sector, transfer at the zone's media rate.
type access struct {
	end                   int64 // model time the last byte is transferred
	track                 int64 // where the head is left
	seeks                 int64 // seeks (not counting sequential track switches)
	seekTracks            int64 // their total distance in tracks
	seekTime, rotTime, xf int64 // ns spent seeking, waiting, transferring
}

func (g *geometry) access(head, t, off, n int64) access {
	a := access{track: head}
	n = max(n, 1) // a zero-length command still positions
	for n > 0 && off < g.capacity {
		z, trk, within := g.locate(off)
		piece := min(n, z.trackBytes-within)
		if trk != a.track {
			d := trk - a.track
			s := g.seek(d)
			// A one-track move onto a track's first byte is the switch of
			// a sequential transfer, not a seek.
			if d != 1 || within != 0 {
				a.seeks++
				a.seekTracks += max(d, -d)
			}
			a.seekTime += s
			t += s
			a.track = trk
		}
		w := g.rotWait(t, g.angle(z, trk, within))
		x := piece * g.rev / z.trackBytes
		a.rotTime += w
		a.xf += x
		t += w + x
		off += piece
		n -= piece
	}
	a.end = t
	return a
}

// position estimates the positioning time (seek plus rotational wait) of a
// request at off for a head over track head at model time t: the key of
// shortest-positioning-time-first scheduling.
func (g *geometry) position(head, t, off int64) int64 {
	off = min(max(off, 0), g.capacity-1)
	z, trk, within := g.locate(off)
	s := g.seek(trk - head)
	return s + g.rotWait(t+s, g.angle(z, trk, within))
}

// sustained is the sequential rate (bytes/s) in the zone holding off.
func (g *geometry) sustained(off int64) float64 {
	z, _, _ := g.locate(min(max(off, 0), g.capacity-1))
	return float64(z.trackBytes) * 1e9 / float64(g.rev+g.skew)
}
