package cache

// Per-volume policies: sequential bypass and promotion of read misses.
//
// Both decide from recent history only and keep it in small, bounded
// structures under the volume's policy lock (never Set.mu), so a decision
// costs a few hundred nanoseconds and no foreground request waits on GC or
// writeback bookkeeping to make it.
//
// Sequential detection (bcache's sequential_cutoff): the last seqStreams
// streams are remembered as (next expected byte offset, bytes so far, last
// use). A request that starts where a stream ended extends it; any other
// request replaces the least recently used stream. A request bypasses the
// cache when its stream, including the request itself, has reached the
// cutoff. Tracking several streams detects a sequential reader or writer
// even when other streams (several files, several clients) interleave.
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
	"time"
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

type stream struct {
	next int64  // byte offset the next request of the stream starts at
	seen int64  // bytes of the stream so far
	used uint64 // policy clock at last use (LRU)
}

// policy is a volume's run-time policy state.
type policy struct {
	mu      sync.Mutex // guards everything below; never held with Set.mu
	clock   uint64
	streams [seqStreams]stream
	misses  map[uint64]uint8 // after:N: read misses per block
}

// sequential records a request of n bytes at off and reports whether it is
// part of a stream at least cutoff bytes long (cutoff 0: never).
func (p *policy) sequential(off, n, cutoff int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clock++
	lru := 0
	for i := range p.streams {
		st := &p.streams[i]
		if st.used != 0 && st.next == off {
			st.next, st.seen, st.used = off+n, st.seen+n, p.clock
			return cutoff > 0 && st.seen >= cutoff
		}
		if st.used < p.streams[lru].used {
			lru = i
		}
	}
	p.streams[lru] = stream{next: off + n, seen: n, used: p.clock}
	return cutoff > 0 && n >= cutoff
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
	st := *v.cfg.Load()
	st.Mode = v.Mode()
	return st
}

// SetSettings validates s, persists it in the superblock and applies it.
// Every key acts at once: the mode on the next request, the others at the
// next policy decision or writeback pass.
func (v *Volume) SetSettings(st Settings) error {
	if err := st.Validate(); err != nil {
		return err
	}
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
		return fmt.Errorf("settings of %s: %w", v.name, err)
	}
	v.mode.Store(int32(st.Mode))
	switch {
	case intoEpoch:
		why := degradeSettings
		v.ord.degraded.Store(true)
		v.ord.since.Store(since)
		v.ord.reason.Store(&why)
		v.ord.degrades.Add(1)
	case st.WritebackOrder != OrderEpoch:
		v.ord.degraded.Store(false)
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
