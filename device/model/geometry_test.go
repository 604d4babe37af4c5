package model

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

func defaultGeometry(t *testing.T, capacity int64) *geometry {
	t.Helper()
	p := DefaultHDD()
	g, err := newGeometry(capacity, p.RPM, p.Zones, p.OuterRate, p.InnerRate, p.TrackToTrack, p.AvgSeek, p.FullStroke)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func ms(ns int64) float64 { return float64(ns) / 1e6 }

func TestSeekCurve(t *testing.T) {
	for _, capacity := range []int64{8 << 20, 1 << 30, 3e12} {
		g := defaultGeometry(t, capacity)
		if g.seek(0) != 0 {
			t.Errorf("capacity %d: seek(0) = %d", capacity, g.seek(0))
		}
		if got := time.Duration(g.seek(1)); got != time.Millisecond {
			t.Errorf("capacity %d: seek(1) = %v, want 1ms", capacity, got)
		}
		if got := time.Duration(g.seek(g.tracks - 1)); got < 16*time.Millisecond || got > 17*time.Millisecond {
			t.Errorf("capacity %d: full stroke %v, want ~17ms", capacity, got)
		}
		prev := int64(0)
		for d := int64(0); d < g.tracks; d += max(g.tracks/1000, 1) {
			s := g.seek(d)
			if s < prev {
				t.Fatalf("capacity %d: seek(%d) = %d < seek of a shorter distance %d", capacity, d, s, prev)
			}
			prev = s
		}
		if capacity < 1<<30 {
			continue
		}
		// The mean over random pairs of positions is the datasheet average.
		rng := rand.New(rand.NewPCG(1, 2))
		sum := 0.0
		const n = 200000
		for range n {
			a, b := rng.Int64N(g.tracks), rng.Int64N(g.tracks)
			sum += float64(g.seek(a - b))
		}
		if mean := sum / n / 1e6; math.Abs(mean-8.5) > 0.15 {
			t.Errorf("capacity %d: mean random seek %.2f ms, want 8.5", capacity, mean)
		}
		t.Logf("capacity %d: %d tracks, seek 1/3 stroke %.2f ms, a=%.0f", capacity, g.tracks, ms(g.seek(g.tracks/3)), g.a)
	}
}

func TestZones(t *testing.T) {
	g := defaultGeometry(t, 3e12)
	if r := g.sustained(0) / 1e6; math.Abs(r-140) > 1 {
		t.Errorf("outer zone sustained %.1f MB/s, want 140", r)
	}
	if r := g.sustained(3e12-1) / 1e6; math.Abs(r-70) > 1.5 {
		t.Errorf("inner zone sustained %.1f MB/s, want 70", r)
	}
	for i := 1; i < len(g.zones); i++ {
		if g.zones[i].start <= g.zones[i-1].start || g.zones[i].trackBytes > g.zones[i-1].trackBytes {
			t.Fatalf("zone %d does not follow zone %d: %+v %+v", i, i-1, g.zones[i], g.zones[i-1])
		}
	}
	// A sequential pass over a track boundary costs the track switch only.
	z := g.zones[0]
	a := g.access(0, 0, 0, 10*z.trackBytes)
	want := 10*g.rev + 9*g.skew
	if a.end < want || a.end > want+1000 || a.rotTime > 1000 {
		t.Errorf("10 tracks sequential: %d ns (rotational wait %d), want %d", a.end, a.rotTime, want)
	}
}

// TestServiceTime checks the service-time function against the textbook
// figures: sequential is transfer only, random is seek + half a
// revolution + transfer, a short forward seek is cheaper than a long one.
func TestServiceTime(t *testing.T) {
	g := defaultGeometry(t, 1e12)
	rng := rand.New(rand.NewPCG(3, 4))

	// Sequential 1 MiB requests back to back: each costs its transfer.
	var head, tm, off int64
	head = g.track(0)
	first := g.access(head, 0, 0, 1<<20)
	head, tm, off = first.track, first.end, 1<<20
	for range 50 {
		a := g.access(head, tm, off, 1<<20)
		if a.rotTime > 1000 { // rounding: a few ns
			t.Fatalf("sequential request at %d waited %d ns for rotation", off, a.rotTime)
		}
		head, tm, off = a.track, a.end, off+1<<20
	}
	rate := float64(off-1<<20) / (float64(tm-first.end) / 1e9) / 1e6
	if rate < 135 || rate > 141 {
		t.Errorf("sequential rate %.1f MB/s, want ~140 (outer zone)", rate)
	}

	// Random 4 KiB: mean of seek + rotation + transfer.
	const n = 20000
	var sum, seekSum, rotSum float64
	for range n {
		from := rng.Int64N(g.tracks)
		at := rng.Int64N(1e12)
		o := rng.Int64N(g.capacity/4096) * 4096
		a := g.access(from, at, o, 4096)
		sum += float64(a.end - at)
		seekSum += float64(a.seekTime)
		rotSum += float64(a.rotTime)
	}
	mean, seekMean, rotMean := sum/n/1e6, seekSum/n/1e6, rotSum/n/1e6
	t.Logf("random 4K: %.2f ms = seek %.2f + rotation %.2f + transfer", mean, seekMean, rotMean)
	if math.Abs(seekMean-8.5) > 0.3 || math.Abs(rotMean-4.17) > 0.15 || math.Abs(mean-12.7) > 0.4 {
		t.Errorf("random 4K: %.2f ms (seek %.2f, rotation %.2f), want ~12.7 = 8.5 + 4.17 + 0.03", mean, seekMean, rotMean)
	}

	// A short forward seek (1 MiB-64 MiB ahead) costs less than a long one.
	var short, long float64
	for range n {
		at := rng.Int64N(1e12)
		o := rng.Int64N(g.capacity/2/4096) * 4096
		h := g.track(o)
		short += float64(g.access(h, at, o+(1<<20)+rng.Int64N(63<<20)/4096*4096, 4096).end - at)
		long += float64(g.access(h, at, o+g.capacity/3, 4096).end - at)
	}
	if short >= long*0.6 {
		t.Errorf("short forward seeks %.2f ms, long %.2f ms: want short much cheaper", short/n/1e6, long/n/1e6)
	}
	t.Logf("short seek access %.2f ms, 1/3 stroke %.2f ms", short/n/1e6, long/n/1e6)

	// Just ahead of the head on the same track: no seek, a short wait.
	z, trk, within := g.locate(0)
	at := g.angle(z, trk, within) + g.rev*5 // the head is over byte 0 now
	a := g.access(trk, at, 64<<10, 4096)
	if a.seeks != 0 || a.rotTime > g.rev/10 {
		t.Errorf("64 KiB ahead on the same track: %d seeks, wait %d ns", a.seeks, a.rotTime)
	}
}

func TestGeometryRejects(t *testing.T) {
	p := DefaultHDD()
	bad := []func(){
		func() { p.RPM = 0 },
		func() { p.OuterRate = -1 },
		func() { p.InnerRate = p.OuterRate * 2 },
		func() { p.AvgSeek = p.FullStroke * 2 },
		func() { p.Zones = 0 },
		func() {
			p.TrackToTrack = 20 * time.Millisecond
			p.AvgSeek = 30 * time.Millisecond
			p.FullStroke = 40 * time.Millisecond
		},
	}
	for i, f := range bad {
		p = DefaultHDD()
		f()
		if _, err := newGeometry(1<<30, p.RPM, p.Zones, p.OuterRate, p.InnerRate, p.TrackToTrack, p.AvgSeek, p.FullStroke); err == nil {
			t.Errorf("case %d: bad parameters accepted", i)
		}
	}
	if _, err := newGeometry(0, 7200, 16, 1, 1, 1, 1, 1); err == nil {
		t.Error("zero capacity accepted")
	}
}
