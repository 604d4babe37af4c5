package nbddev

import (
	"math/rand/v2"
	"testing"
)

// TestChooser: an ascending stream stays on one connection, interleaved
// with random requests that take the connections in turn; it moves once
// its connection has streamDepth requests in flight; a new generation
// forgets the streams and the counts of the old one.
func TestChooser(t *testing.T) {
	const n = 4
	var c chooser
	rng := rand.New(rand.NewPCG(1, 2))
	first := c.pick(1, 0, 4096, n)
	c.done(1, first)
	used := map[int]int{}
	off := int64(4096)
	for i := range 1000 {
		off += 4096 * (1 + rng.Int64N(64)) // sorted blocks with gaps
		k := c.pick(1, off, off+4096, n)
		c.done(1, k)
		if k != first {
			t.Fatalf("stream request %d at %d went to connection %d, the stream is on %d", i, off, k, first)
		}
		// A random request (far from the stream) between two of its own.
		r := c.pick(1, (1<<40)+rng.Int64N(1<<40), (1<<40)+rng.Int64N(1<<40)+4096, n)
		c.done(1, r)
		used[r]++
	}
	if len(used) != n {
		t.Fatalf("random requests used connections %v, want all %d", used, n)
	}

	// Requests in flight: at streamDepth the stream moves, and stays on
	// its new connection.
	var got []int
	for range streamDepth + 10 {
		off += 4096
		got = append(got, c.pick(1, off, off+4096, n))
	}
	for i, k := range got {
		want := first
		if i >= streamDepth {
			want = got[streamDepth]
		}
		if k != want {
			t.Fatalf("in-flight request %d of the stream on connection %d, want %d (moves after %d)", i, k, want, streamDepth)
		}
	}
	if got[streamDepth] == first {
		t.Fatalf("the stream did not move off connection %d with %d in flight", first, streamDepth)
	}

	// A new generation, with the old one's requests still in flight: it
	// starts with nothing in flight, and the old one's completions do not
	// count in it.
	k := c.pick(2, off, off+4096, n)
	for range streamDepth - 1 {
		off += 4096
		if k2 := c.pick(2, off, off+4096, n); k2 != k {
			t.Fatalf("generation 2: stream moved to %d from %d before %d in flight", k2, k, streamDepth)
		}
	}
	for _, k := range got {
		c.done(1, k)
	}
	off += 4096
	if k2 := c.pick(2, off, off+4096, n); k2 == k {
		t.Fatalf("generation 2: stream stayed on %d with %d in flight (generation 1's completions counted)", k, streamDepth)
	}
}
