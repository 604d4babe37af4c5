package policy

import (
	"cmp"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSequentialDetection feeds request streams to the sequential
// detector (default cutoff, 4 MiB) and checks how many of the bytes it
// calls sequential: streams reordered, interleaved or split over
// connections must be found; random requests, rewrites and sparse strides
// must not be.
func TestSequentialDetection(t *testing.T) {
	type req struct{ off, n int64 }
	const cutoff = 4 << 20
	// shuffleWithin reorders reqs so that each lands at most k places
	// from where it was (requests in flight on k connections).
	shuffleWithin := func(reqs []req, k int, seed uint64) []req {
		rng := rand.New(rand.NewPCG(seed, 5))
		key := make([]int, len(reqs))
		idx := make([]int, len(reqs))
		for i := range key {
			key[i], idx[i] = i+rng.IntN(k+1), i
		}
		slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(key[a], key[b]) })
		out := make([]req, len(reqs))
		for i, j := range idx {
			out[i] = reqs[j]
		}
		return out
	}
	seqRun := func(start, total, n int64) []req {
		var out []req
		for off := start; off < start+total; off += n {
			out = append(out, req{off, n})
		}
		return out
	}
	interleave := func(streams ...[]req) []req {
		rng := rand.New(rand.NewPCG(7, 7))
		var out []req
		for {
			var live []int
			for i, s := range streams {
				if len(s) > 0 {
					live = append(live, i)
				}
			}
			if len(live) == 0 {
				return out
			}
			i := live[rng.IntN(len(live))]
			out = append(out, streams[i][0])
			streams[i] = streams[i][1:]
		}
	}
	random := func(count int, region, n int64, seed uint64) []req {
		rng := rand.New(rand.NewPCG(seed, 9))
		out := make([]req, count)
		for i := range out {
			out[i] = req{rng.Int64N(region/n) * n, n}
		}
		return out
	}
	for _, tc := range []struct {
		name     string
		reqs     []req
		min, max float64 // share of the bytes found sequential
	}{
		{"in order, 1 MiB requests", seqRun(0, 256<<20, 1<<20), 0.98, 1},
		{"in order, 4 KiB requests", seqRun(0, 64<<20, 4<<10), 0.93, 1},
		{"reordered within 16 requests of 128 KiB", shuffleWithin(seqRun(0, 256<<20, 128<<10), 16, 1), 0.95, 1},
		{"reordered within 32 requests of 256 KiB", shuffleWithin(seqRun(0, 256<<20, 256<<10), 32, 2), 0.95, 1},
		{"4 writers in their own regions, interleaved", interleave(seqRun(0, 64<<20, 64<<10), seqRun(1<<30, 64<<20, 64<<10),
			seqRun(2<<30, 64<<20, 64<<10), seqRun(3<<30, 64<<20, 64<<10)), 0.9, 1},
		{"one stream over 4 connections, each reordered", interleave(
			shuffleWithin(seqRun(0, 128<<20, 512<<10), 8, 3), random(2000, 1<<30, 4<<10, 4)), 0.45, 1},
		{"two writers in alternate 1 MiB pieces, one 16 MiB behind", func() []req {
			var even, odd []req
			for piece := int64(0); piece < 128; piece++ {
				w := &even
				if piece%2 == 1 {
					w = &odd
				}
				*w = append(*w, seqRun(piece<<20, 1<<20, 128<<10)...)
			}
			ahead := 8 * 8 // 8 pieces of 8 requests: the even writer's first 16 MiB of the file
			return append(even[:ahead:ahead], interleave(even[ahead:], odd)...)
		}(), 0.95, 1},
		{"4 KiB random over 16 MiB", random(200000, 16<<20, 4<<10, 5), 0, 0},
		{"4 KiB random over 1 GiB", random(200000, 1<<30, 4<<10, 6), 0, 0},
		{"64 KiB random over 64 MiB", random(50000, 64<<20, 64<<10, 7), 0, 0},
		{"1 MiB random over 4 GiB", random(20000, 4<<30, 1<<20, 8), 0, 0.01},
		{"one 16 KiB page rewritten", func() []req {
			out := make([]req, 2000)
			for i := range out {
				out[i] = req{1 << 20, 16 << 10}
			}
			return out
		}(), 0, 0},
		{"4 KiB every 32 KiB", func() []req {
			var out []req
			for off := int64(0); off < 256<<20; off += 32 << 10 {
				out = append(out, req{off, 4 << 10})
			}
			return out
		}(), 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p State
			var total, seq int64
			for _, r := range tc.reqs {
				total += r.n
				if Bypass(p.Sequential(r.off, r.n), cutoff, 0) {
					seq += r.n
				}
			}
			share := float64(seq) / float64(total)
			if share < tc.min || share > tc.max {
				t.Errorf("%.3f of %d MiB found sequential, want %.2f..%.2f", share, total>>20, tc.min, tc.max)
			}
		})
	}
}

// TestSeqBypass is the bypass decision's table: a stream bypasses once it
// is as long as the larger of sequential_cutoff and the cache's room for
// streams; 0 turns bypass off whatever the room.
func TestSeqBypass(t *testing.T) {
	const cutoff = 4 << 20
	for _, tc := range []struct {
		run, cutoff, room int64
		want              bool
	}{
		{run: 4 << 20, cutoff: cutoff, room: 0, want: true},         // short of room: the cutoff
		{run: 4<<20 - 1, cutoff: cutoff, room: 0, want: false},      // below the cutoff
		{run: 4 << 20, cutoff: cutoff, room: 1 << 20, want: true},   // room below the cutoff: the cutoff
		{run: 8 << 20, cutoff: cutoff, room: 64 << 20, want: false}, // room: the stream goes to the cache
		{run: 64<<20 - 1, cutoff: cutoff, room: 64 << 20, want: false},
		{run: 64 << 20, cutoff: cutoff, room: 64 << 20, want: true}, // as long as the room
		{run: 1 << 30, cutoff: cutoff, room: 64 << 20, want: true},
		{run: 1 << 30, cutoff: 0, room: 0, want: false}, // disabled
		{run: 1 << 30, cutoff: 0, room: 64 << 20, want: false},
	} {
		if got := Bypass(tc.run, tc.cutoff, tc.room); got != tc.want {
			t.Errorf("Bypass(run %d, cutoff %d, room %d) = %v, want %v", tc.run, tc.cutoff, tc.room, got, tc.want)
		}
	}
}
