package cache

// Per-volume policies: sequential bypass and promotion of read misses.
// The detection and the promotion counts are package policy's (its doc
// says how streams are found); this file decides with them. Only a write
// in a stream already past sequential_cutoff also reads the cache's room
// for streams, under Set.mu once the policy lock is released (as the
// write's throttle does).
//
// For reads the cutoff is sequential_cutoff: promoting a scan would only
// evict what was read before. For writes in writeback mode it grows with
// the room the cache has for a stream (streamRoom: what is left below the
// volume's writeback target and the cache's throttle point once dirty data
// and superseded versions are counted, none while free buckets are short):
// a stream goes to the cache, at the cache's speed, while it is shorter
// than that room, and bypasses once it is longer. A cache with room
// absorbs a database's table files and logs; a cache short of room
// (earlier jobs' dirty data) bypasses streams at sequential_cutoff, as
// bcache does. The room shrinks as the stream itself fills the cache, so
// a stream takes at most half of it and a stream of any length never
// drives the cache to the throttle point; the streams of several writers
// share it. While a write stream bypasses, the volume's background
// writeback waits for it (streamBypassing). Promotion is skipped, and
// counted as a congestion bypass, when taking space for it would eat into
// the free bucket reserve that foreground writes need.

import (
	"fmt"
	"time"

	"github.com/tiercache/tiercache/cache/internal/policy"
	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
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

// seqRead records a read of n bytes at off and reports whether it is part
// of a stream at least sequential_cutoff long (not promoted).
func (v *Volume) seqRead(off, n int64) bool {
	return policy.Bypass(v.pol.Sequential(off, n), v.cfg.Load().SequentialCutoff, 0)
}

// seqWrite records a write of n bytes at off and reports whether it
// bypasses the cache as part of a stream: at sequential_cutoff, or in
// writeback mode once the stream is longer than the cache's room for it.
// The room, which takes Set.mu, is looked at only for streams already past
// the cutoff.
func (v *Volume) seqWrite(off, n int64) bool {
	run, cutoff := v.pol.Sequential(off, n), v.cfg.Load().SequentialCutoff
	if !policy.Bypass(run, cutoff, 0) {
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
	if v.Mode() == Writeback && (!policy.Bypass(run, cutoff, v.streamRoom()) || v.wb.Stats().Failing || v.backingKeepsUnsynced()) {
		return false
	}
	v.pol.StreamAt.Store(nowNanos())
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
	at := v.pol.StreamAt.Load()
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
