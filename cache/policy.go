package cache

// Per-volume policies: sequential bypass and promotion of read misses.
//
// Both decide from recent history only and keep it in small, bounded
// structures under the volume's policy lock (never held with Set.mu), so a
// decision costs a few hundred nanoseconds and no foreground request waits
// on GC or writeback bookkeeping to make it. Only a write in a stream
// already past sequential_cutoff also reads the cache's room for streams,
// under Set.mu once the policy lock is released (as the write's throttle
// does).
//
// Sequential detection (bcache's sequential_cutoff): the last seqStreams
// streams are remembered as (lowest and highest byte offset reached, bytes
// so far, last use, and the holes a request arriving early left behind).
// Streams reach the cache slightly reordered: the kernel's NBD client
// spreads one stream over several connections, loop over nbdfuse and
// multi-threaded writers complete requests out of order. So a request
// extends a stream when it
//
//   - starts where the stream ends;
//   - starts a little ahead of its end (at most seqWindow(n) bytes, and no
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
// by chance never builds one), is as long as the cutoff (seqBypass). For
// reads the cutoff is sequential_cutoff: promoting a scan would only evict
// what was read before. For writes in writeback mode it grows with the
// room the cache has for a stream (streamRoom: what is left below the
// volume's writeback target and the cache's throttle point once dirty data
// and superseded versions are counted, none while free buckets are short):
// a
// stream goes to the cache, at the cache's speed, while it is shorter than
// that room, and bypasses once it is longer. A cache with room absorbs a
// database's table files and logs; a cache short of room (earlier jobs'
// dirty data) bypasses streams at sequential_cutoff, as bcache does. The
// room shrinks as the stream itself fills the cache, so a stream takes at
// most half of it and a stream of any length never drives the cache to
// the throttle point; the streams of several writers share it. While a
// write stream bypasses, the volume's background writeback waits for it
// (streamBypassing).
//
// Promotion: "always" promotes every read miss; "never" promotes none
// (NBD_CMD_CACHE still does: the client asked for it); "after:N" promotes a
// block on its Nth read miss, counted in a bounded table of recently missed
// blocks (a ghost list: when it holds promoteTableMax blocks it is cleared,
// which ages every count at once). Promotion is skipped, and counted as a
// congestion bypass, when taking space for it would eat into the free
// bucket reserve that foreground writes need.

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
)

const (
	seqStreams      = 16      // streams tracked per volume
	promoteTableMax = 1 << 16 // blocks remembered by after:N (~1.5 MiB)
)

// bypassReason says why bytes skipped the cache.
type bypassReason int

const (
	bypassNone       bypassReason = iota
	bypassSequential              // part of a stream longer than sequential_cutoff
	bypassMode                    // writearound/none mode, or write-zeroes
	bypassCongested               // promotion skipped: the free reserve is low
	bypassFull                    // write sent around: no free bucket in time
	bypassFailed                  // write sent around: cache device error or failover
)

// seqHoles bounds the holes a stream remembers (the oldest is forgotten:
// a request filling it late starts a stream of its own).
const seqHoles = 32

type stream struct {
	start int64  // lowest byte offset of the stream
	next  int64  // end of its furthest request
	seen  int64  // bytes of the stream so far
	used  uint64 // policy clock at last use (LRU)
	holes []span // gaps before next not yet written, oldest first
}

// span is the byte range [lo, hi).
type span struct{ lo, hi int64 }

// seqWindow is how far ahead of a stream's end a request of n bytes may
// start, or how far behind it a rewrite may, and still belong to it: room
// for a few requests in flight on other connections.
func seqWindow(n int64) int64 { return min(max(64*n, 256<<10), 32<<20) }

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
		if gap := off - st.next; gap <= seqWindow(n) && gap <= st.seen {
			return seqNext
		}
	case off >= st.start && off < st.next:
		for _, h := range st.holes {
			if off < h.hi && h.lo < off+n {
				return seqFill
			}
		}
		if st.next-off <= seqWindow(n) {
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
			if len(st.holes) == seqHoles {
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
	if len(out) > seqHoles {
		out = out[len(out)-seqHoles:]
	}
	st.holes = out
	return got
}

// dense reports whether the stream's bytes cover at least half of its
// span.
func (st *stream) dense() bool { return st.next-st.start <= 2*st.seen }

// policy is a volume's run-time policy state.
type policy struct {
	// streamAt is when a write last bypassed the cache as part of a
	// stream (unix nanos; 0: never): background writeback waits while a
	// stream bypasses (streamBypassing).
	streamAt atomic.Int64

	mu      sync.Mutex // guards everything below; never held with Set.mu
	clock   uint64
	streams [seqStreams]stream
	misses  map[uint64]uint8 // after:N: read misses per block
}

// sequential records a request of n bytes at off and returns the bytes of
// the dense stream it extends, itself included; n when it starts a stream,
// rewrites what its stream wrote or extends a stream that is not dense.
func (p *policy) sequential(off, n int64) int64 {
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

// seqBypass reports whether a request whose stream holds run bytes (as
// policy.sequential returns) bypasses the cache, for the volume's
// sequential_cutoff and the room the cache has for the stream (bytes; 0
// when short of room): once the stream is as long as the larger of the
// two. A cutoff of 0 turns bypass off.
func seqBypass(run, cutoff, room int64) bool {
	return cutoff > 0 && run >= max(cutoff, room)
}

// seqRead records a read of n bytes at off and reports whether it is part
// of a stream at least sequential_cutoff long (not promoted).
func (v *Volume) seqRead(off, n int64) bool {
	return seqBypass(v.pol.sequential(off, n), v.cfg.Load().SequentialCutoff, 0)
}

// seqWrite records a write of n bytes at off and reports whether it
// bypasses the cache as part of a stream: at sequential_cutoff, or in
// writeback mode once the stream is longer than the cache's room for it.
// The room, which takes Set.mu, is looked at only for streams already past
// the cutoff.
func (v *Volume) seqWrite(off, n int64) bool {
	run, cutoff := v.pol.sequential(off, n), v.cfg.Load().SequentialCutoff
	if !seqBypass(run, cutoff, 0) {
		return false
	}
	// Writethrough gains nothing from caching a stream. In writeback mode
	// the cache takes a stream while it has room for it, and while
	// writeback keeps failing: the backing device is away, a write around
	// the cache would fail or a flush could not make it durable, so the
	// stream is absorbed like any other write (until the cache is full).
	// A backing that keeps unsynced writes (device.SyncKeeper, an
	// object-store image) holds a write around the cache in memory until a
	// sync stores it, and that sync needs the store: in writeback mode its
	// streams are always absorbed, so a FLUSH or FUA needs only the cache
	// device, whether or not the store answers.
	if v.Mode() == Writeback && (!seqBypass(run, cutoff, v.streamRoom()) || v.wb.Stats().Failing || v.backingKeepsUnsynced()) {
		return false
	}
	v.pol.streamAt.Store(nowNanos())
	return true
}

// backingKeepsUnsynced reports whether v's backing device keeps the writes
// a failed sync could not make durable (device.SyncKeeper): an object-store
// image, whose writes are durable only once a sync has stored them.
func (v *Volume) backingKeepsUnsynced() bool {
	k, ok := v.back.(device.SyncKeeper)
	return ok && k.KeepsUnsynced()
}

// streamBypassing reports whether a write stream of v bypassed the cache
// within writeback.IdleAfter: background writeback waits for it
// (writeback.RateIn.Stream).
func (v *Volume) streamBypassing() bool { return v.streamWithin(writeback.IdleAfter) }

// streamWithin reports whether a write stream of v bypassed the cache
// within d.
func (v *Volume) streamWithin(d time.Duration) bool {
	at := v.pol.streamAt.Load()
	return at != 0 && nowNanos()-at < int64(d)
}

// streamRoom is the room the cache has for a write stream of v, in bytes:
// the smaller of the blocks below the throttle point (throttleStart of the
// cache) that hold neither dirty data nor superseded versions of any
// volume, and what is left of v's writeback target (writeback_percent of
// the cache) once v's own dirty data and superseded versions are counted.
// Clean data counts as room: eviction frees it without writing anything
// back. Below the target, background writeback does not run while the
// volume is busy, so the part of a stream the cache took is not written
// back under the rest of the stream, which bypasses to the same disk. None
// while free buckets are short: eviction is behind, and a stream taken
// into the cache then would wait for it, or go around the cache anyway.
func (v *Volume) streamRoom() int64 {
	s := v.s
	pct := int64(v.cfg.Load().WritebackPercent)
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.mu.free) < s.lowWater() {
		return 0
	}
	total := s.mu.CacheBlocks()
	var d int64
	for _, u := range s.vols {
		d += u.idx.Dirty + u.idx.NSup
	}
	room := min(int64(writeback.ThrottleStart*float64(total))-d, total*pct/100-(v.idx.Dirty+v.idx.NSup))
	return max(room, 0) * blockSize
}

// promoteMiss counts a read miss of block lba and reports whether the block
// should now be promoted, for a policy that promotes on the need-th miss
// (0: never, 1: always).
func (p *policy) promoteMiss(lba uint64, need int) bool {
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

// Settings returns the volume's current settings.
func (v *Volume) Settings() Settings {
	return *v.cfg.Load()
}

// SetSettings validates s, persists it in the superblock and applies it.
// Every key acts at once: the mode on the next request, the others at the
// next policy decision or writeback pass.
func (v *Volume) SetSettings(st Settings) error {
	if err := st.Validate(); err != nil {
		return err
	}
	return v.updateSettings("settings of", func(Settings) Settings { return st })
}

// updateSettings persists change(the current settings) in the superblock
// and applies it: SetSettings and SetMode. Writes in flight are excluded
// (rmw) so that none straddles the change.
func (v *Volume) updateSettings(what string, change func(Settings) Settings) error {
	if err := v.enter(); err != nil {
		return err
	}
	defer v.exit()
	v.rmw.Lock()
	defer v.rmw.Unlock()
	s := v.s
	v.ord.mu.Lock()
	defer v.ord.mu.Unlock()
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	st := change(*v.cfg.Load())
	// Into epoch order with dirty data written back in lba order: the
	// backing device is not a flushed image until the next full drain.
	wasEpoch := v.cfg.Load().WritebackOrder == OrderEpoch
	intoEpoch := st.WritebackOrder == OrderEpoch && !wasEpoch && v.hasDirty()
	var since int64
	err := s.updateSuperblockLocked(func(nsb *Superblock) error {
		nsb.Backings[v.vi].Settings = st
		switch {
		case intoEpoch:
			since = time.Now().UnixNano()
			nsb.Backings[v.vi].InconsistentSince = since
		case st.WritebackOrder != OrderEpoch:
			nsb.Backings[v.vi].InconsistentSince = 0
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("%s %s: %w", what, v.name, err)
	}
	switch {
	case intoEpoch:
		why := degradeSettings
		v.ord.degraded.Store(true)
		v.ord.cut.Store(0)
		v.ord.since.Store(since)
		v.ord.at.Store(since)
		v.ord.reason.Store(&why)
		v.ord.degrades.Add(1)
	case st.WritebackOrder != OrderEpoch:
		v.ord.degraded.Store(false)
		v.ord.cut.Store(0)
		v.ord.since.Store(0)
	}
	v.cfg.Store(&st)
	if st.WritebackOrder != OrderEpoch {
		// Left epoch order: older versions are moot (the newest is what
		// lba order writes back). The superblock already says lba, so
		// replay will not keep them either.
		s.mu.Lock()
		s.mu.DropAllSup(v.vi)
		s.mu.Unlock()
	}
	s.kickWB()
	return nil
}
