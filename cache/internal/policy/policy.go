// Package policy holds a volume's per-request policies: sequential
// detection and the promotion of read misses.
//
// Both decide from recent history only and keep it in small, bounded
// structures under the volume's policy lock (never held with the engine's
// Set.mu), so a decision costs a few hundred nanoseconds and no foreground
// request waits on GC or writeback bookkeeping to make it.
//
// Sequential detection (bcache's sequential_cutoff): the last Streams
// streams are remembered as (lowest and highest byte offset reached, bytes
// so far, last use, and the holes a request arriving early left behind).
// Streams reach the cache slightly reordered: the kernel's NBD client
// spreads one stream over several connections, loop over nbdfuse and
// multi-threaded writers complete requests out of order. So a request
// extends a stream when it
//
//   - starts where the stream ends;
//   - starts a little ahead of its end (at most Window(n) bytes, and no
//     more than the stream holds): the gap becomes a hole;
//   - or fills (part of) a hole, however far behind the end: a request
//     that arrived late. Two writers that write one file in alternate
//     pieces, each on its own CPU and so on its own NBD connection, drift
//     apart by many MiB; the one behind fills the holes the other left.
//
// A request a little behind the end that fills no hole rewrites what the
// stream just wrote (a log's last block, a database page): it belongs to
// the stream but adds nothing to it, and does not bypass the cache. A
// request that fits several streams goes to the most recently used one;
// one that fits none replaces the least recently used stream. Tracking
// several streams detects a sequential reader or writer even when other
// streams (several files, several clients) interleave.
//
// A request bypasses the cache when it, or the stream it extends
// (including the request itself, if the stream is dense: its bytes cover
// at least half of its span, so a random writer that lands near a stream
// by chance never builds one), is as long as the cutoff (Bypass). The
// engine chooses the cutoff (package cache, policy.go: sequential_cutoff,
// or for writes in writeback mode the cache's room for a stream).
//
// Promotion: "always" promotes every read miss; "never" promotes none
// (NBD_CMD_CACHE still does: the client asked for it); "after:N" promotes a
// block on its Nth read miss, counted in a bounded table of recently missed
// blocks (a ghost list: when it holds promoteTableMax blocks it is cleared,
// which ages every count at once).
package policy

import (
	"sync"
	"sync/atomic"
)

const (
	Streams         = 16      // streams tracked per volume
	promoteTableMax = 1 << 16 // blocks remembered by after:N (~1.5 MiB)
)

// Holes bounds the holes a stream remembers (the oldest is forgotten:
// a request filling it late starts a stream of its own).
const Holes = 32

type stream struct {
	start int64  // lowest byte offset of the stream
	next  int64  // end of its furthest request
	seen  int64  // bytes of the stream so far
	used  uint64 // policy clock at last use (LRU)
	holes []span // gaps before next not yet written, oldest first
}

// span is the byte range [lo, hi).
type span struct{ lo, hi int64 }

// Window is how far ahead of a stream's end a request of n bytes may
// start, or how far behind it a rewrite may, and still belong to it: room
// for a few requests in flight on other connections.
func Window(n int64) int64 { return min(max(64*n, 256<<10), 32<<20) }

// How a request relates to a stream (stream.relate).
const (
	seqOther   = iota // not part of the stream
	seqNext           // starts at the end, or a little ahead (leaving a hole)
	seqFill           // fills (part of) a hole
	seqRewrite        // rewrites what the stream wrote just before its end
)

// relate says how the request [off, off+n) relates to st.
func (st *stream) relate(off, n int64) int {
	switch {
	case off >= st.next:
		if gap := off - st.next; gap <= Window(n) && gap <= st.seen {
			return seqNext
		}
	case off >= st.start && off < st.next:
		for _, h := range st.holes {
			if off < h.hi && h.lo < off+n {
				return seqFill
			}
		}
		if st.next-off <= Window(n) {
			return seqRewrite
		}
	}
	return seqOther
}

// extend adds the request [off, off+n) to st, as relate classified it.
func (st *stream) extend(off, n int64, how int) {
	switch how {
	case seqNext:
		if off > st.next {
			if len(st.holes) == Holes {
				st.holes = st.holes[1:]
			}
			st.holes = append(st.holes, span{st.next, off})
		}
		st.next, st.seen = off+n, st.seen+n
	case seqFill:
		st.seen += st.fill(off, off+n)
		st.next = max(st.next, off+n)
	}
}

// fill removes [lo, hi) from the stream's holes and returns how many bytes
// of holes it covered.
func (st *stream) fill(lo, hi int64) int64 {
	var got int64
	var out []span
	for _, h := range st.holes {
		if hi <= h.lo || lo >= h.hi {
			out = append(out, h)
			continue
		}
		got += min(hi, h.hi) - max(lo, h.lo)
		if h.lo < lo {
			out = append(out, span{h.lo, lo})
		}
		if hi < h.hi {
			out = append(out, span{hi, h.hi})
		}
	}
	if len(out) > Holes {
		out = out[len(out)-Holes:]
	}
	st.holes = out
	return got
}

// dense reports whether the stream's bytes cover at least half of its
// span.
func (st *stream) dense() bool { return st.next-st.start <= 2*st.seen }

// State is a volume's run-time policy state.
type State struct {
	// StreamAt is when a write last bypassed the cache as part of a
	// stream (unix nanos; 0: never): background writeback waits while a
	// stream bypasses (package cache, streamBypassing).
	StreamAt atomic.Int64

	mu      sync.Mutex // guards everything below; never held with the engine's Set.mu
	clock   uint64
	streams [Streams]stream
	misses  map[uint64]uint8 // after:N: read misses per block
}

// Sequential records a request of n bytes at off and returns the bytes of
// the dense stream it extends, itself included; n when it starts a stream,
// rewrites what its stream wrote or extends a stream that is not dense.
func (p *State) Sequential(off, n int64) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clock++
	// The most recently used stream the request belongs to; else the
	// least recently used slot gets a new stream.
	best, how, lru := -1, seqOther, 0
	for i := range p.streams {
		st := &p.streams[i]
		if st.used != 0 {
			if r := st.relate(off, n); r != seqOther && (best < 0 || st.used > p.streams[best].used) {
				best, how = i, r
			}
		}
		if st.used < p.streams[lru].used {
			lru = i
		}
	}
	if best >= 0 {
		st := &p.streams[best]
		st.extend(off, n, how)
		st.used = p.clock
		if how != seqRewrite && st.dense() {
			return max(st.seen, n)
		}
		return n
	}
	p.streams[lru] = stream{start: off, next: off + n, seen: n, used: p.clock}
	return n
}

// Bypass reports whether a request whose stream holds run bytes (as
// State.Sequential returns) bypasses the cache, for the volume's
// sequential_cutoff and the room the cache has for the stream (bytes; 0
// when short of room): once the stream is as long as the larger of the
// two. A cutoff of 0 turns bypass off.
func Bypass(run, cutoff, room int64) bool {
	return cutoff > 0 && run >= max(cutoff, room)
}

// PromoteMiss counts a read miss of block lba and reports whether the block
// should now be promoted, for a policy that promotes on the need-th miss
// (0: never, 1: always).
func (p *State) PromoteMiss(lba uint64, need int) bool {
	switch need {
	case 0:
		return false
	case 1:
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.misses == nil || len(p.misses) >= promoteTableMax {
		p.misses = make(map[uint64]uint8)
	}
	c := int(p.misses[lba]) + 1
	if c >= need {
		delete(p.misses, lba)
		return true
	}
	p.misses[lba] = uint8(c)
	return false
}
