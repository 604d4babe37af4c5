package cache

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// A mirrored set (FeatureMirror) keeps its metadata and dirty data on two
// cache devices through a mirror.Mirror, which the Set uses as its cache
// device (s.dev) and tells which buckets may hold dirty data (s.mir()). This
// file is the Set's side of it: mapping buckets to the mirror's slots as
// they open, releasing slots once nothing dirty is left in them, the
// resync after an unclean shutdown and the mirror's part of the stats.
// docs/DESIGN.md, "Mirrored cache devices".

// refuseMirrored refuses an offline change written to one cache device
// when the set is mirrored: the other member would go stale unnoticed.
func refuseMirrored(sb *Superblock, what string) error {
	if sb.HasFeature(ondisk.FeatureMirror) {
		return fmt.Errorf("%w: %s offline on one member of a mirrored cache set (it would leave the other stale); do it through the server", ErrInvalid, what)
	}
	return nil
}

// mirrorDegraded reports whether the set is mirrored and runs on one
// member: its dirty data has one copy, so writeback runs at full speed
// to shrink what a second failure would lose (wbRate).
// An attach running is not degraded in this sense: the dirty data had one
// copy before it, and the attach is what makes a second.
func (s *Set) mirrorDegraded() bool {
	m := s.mir()
	return m != nil && !m.Redundant() && !s.attaching.Load()
}

// MirrorUses reports whether dev is a member device of the set's mirror
// (the caller must keep it open while the set is).
func (s *Set) MirrorUses(dev device.Device) bool {
	m := s.mir()
	return m != nil && (m.Device(mirror.A) == dev || m.Device(mirror.B) == dev)
}

// mirrorWatch has a member failure wake every volume's writeback loop, so
// that the full speed of a degraded set starts at once rather than at the
// loop's next decision. The kick runs on its own goroutine: the failure
// may be noticed under the set's locks.
func (s *Set) mirrorWatch() {
	if s.mir() == nil {
		return
	}
	s.mir().OnFail(func(mirror.Member) {
		go func() {
			if vols := s.volSnap.Load(); vols != nil {
				for _, v := range *vols {
					v.wb.Kick()
				}
			}
		}()
	})
}

// mirrorHolds reports whether a dirty block may go to cache block loc:
// while writes reach both members (both live, or one being resilvered),
// only into a bucket mapped on B. REQUIRES: not s.mu (the mirror's own
// lock is taken).
func (s *Set) mirrorHolds(loc uint32) bool {
	if s.mir() == nil || !s.mir().WritesBoth() {
		return true
	}
	return s.mir().Covers(s.cacheOff(loc))
}

// mirrorOpenLocked maps bucket bi, being opened, on B. It reports false
// when bi must not be opened: only B is live and it has no slot for it
// (writes into it would have nowhere to go). With both live an unmapped
// bucket opens and takes clean data only (mirrorHolds).
// REQUIRES: s.mu
func (s *Set) mirrorOpenLocked(bi int64) bool {
	m := s.mir()
	if m == nil {
		return true
	}
	gen := s.mu.Buckets[bi].Gen
	if m.Map(bi, gen, 0) {
		return true
	}
	s.mirrorReclaimLocked()
	if m.Map(bi, gen, 0) {
		return true
	}
	return m.Redundant() || m.Primary() == mirror.A
}

// mirrorRetryLocked maps the open bucket, unmapped when it opened for
// want of a slot, from its current fill on, once a slot may have come
// free (something was made durable since the last try).
// REQUIRES: s.mu
func (s *Set) mirrorRetryLocked(bi int64, fill uint32) {
	m := s.mir()
	if m == nil || m.Mapped(bi) {
		return
	}
	if d := s.durable.Load(); d != s.mu.mirTried {
		s.mu.mirTried = d
		s.mirrorReclaimLocked()
		m.Map(bi, s.mu.Buckets[bi].Gen, fill)
	}
}

// mirrorReclaimLocked releases the slots B's copy is no longer needed in:
// those of free buckets and, with both members live, of sealed buckets
// with nothing dirty left (not even superseded versions) once the records
// that cleaned them are durable: until then a recovery from B alone would
// still find them dirty. A bucket is seen clean at one scan (s.mu.seq
// noted) and released at a later one that finds that seq durable.
// REQUIRES: s.mu
func (s *Set) mirrorReclaimLocked() {
	m := s.mir()
	var rel []int64
	durable := s.durable.Load()
	m.MappedBuckets(func(b int64) {
		a := &s.mu.alloc[b]
		switch {
		case a.state == bucketFree:
			rel = append(rel, b)
		case a.state == bucketSealed && s.mu.Buckets[b].Dirty == 0 && m.Redundant() && a.pins == 0:
			seen, ok := s.mu.mirClean[b]
			if !ok {
				if s.mu.mirClean == nil {
					s.mu.mirClean = map[int64]uint64{}
				}
				s.mu.mirClean[b] = s.mu.seq
			} else if seen <= durable {
				rel = append(rel, b)
			}
		default:
			delete(s.mu.mirClean, b)
		}
	})
	for _, b := range rel {
		delete(s.mu.mirClean, b)
		m.Release(b)
	}
}

// mirrorRepair replaces p, cache block loc read with a checksum other than
// crc, with the mirror's other copy when that one has it, rewriting the bad
// copy (mirror.RepairFrom); it reports whether p holds the block now. The
// caller holds loc's bucket pinned.
func (s *Set) mirrorRepair(p []byte, loc, crc uint32) bool {
	return s.mir() != nil && s.mir().RepairFrom(p, s.cacheOff(loc), func(q []byte) bool { return ondisk.CRC32C(q) == crc })
}

// mirrorLoadLocked finds the mappings on B for the recovered buckets'
// generations. REQUIRES: s.mu (no I/O runs yet: Open)
func (s *Set) mirrorLoadLocked() error {
	gens := make([]uint32, len(s.mu.Buckets))
	for i := range s.mu.Buckets {
		gens[i] = s.mu.Buckets[i].Gen
	}
	return s.mir().LoadSlots(gens)
}

// mirrorResync makes B hold every dirty block. After an unclean shutdown
// (verify) the members agree on what was synced, but the journal replayed
// from A may hold inserts whose data reached A and not B before the
// crash: each dirty entry, and each clean one B covers (reads go to
// either copy), is checked on B by checksum and copied from A where B's
// copy differs. A bucket with dirty data and no slot (a damaged
// slot header, or a slot reused just before the crash whose new header
// was not durable: the old one names a bucket with nothing dirty left) is
// mapped, taking the slot of a bucket with nothing dirty when none is
// free, and its dirty blocks copied in any case. It returns the blocks copied. With one member live
// there is nothing to resync.
func (s *Set) mirrorResync(verify bool) (int, error) {
	m := s.mir()
	if m == nil || !m.Redundant() {
		return 0, nil
	}
	type blk struct {
		loc   uint32
		crc   uint32
		check bool
	}
	var blks []blk
	s.mu.Lock()
	for _, v := range s.vols {
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			if e.Dirty() {
				blks = append(blks, blk{loc: e.Block(), crc: e.CRC})
			}
			return true
		})
		v.idx.Sup.Ascend(func(e index.Ent) bool {
			blks = append(blks, blk{loc: e.Block(), crc: e.CRC})
			return true
		})
	}
	need := map[int64]bool{} // buckets holding dirty or superseded blocks
	for _, b := range blks {
		need[int64(b.loc)/s.bpb] = true
	}
	// release frees the slot of a mapped bucket that holds no dirty or
	// superseded block: a slot header left from before the crash (the
	// header of the bucket that reused the slot was not durable yet).
	release := func() bool {
		victim := int64(-1)
		m.MappedBuckets(func(b int64) {
			if victim < 0 && !need[b] {
				victim = b
			}
		})
		if victim < 0 {
			return false
		}
		m.Release(victim)
		return true
	}
	unmapped := map[int64]bool{}
	for i := range blks {
		b := &blks[i]
		bi := int64(b.loc) / s.bpb
		b.check = verify || unmapped[bi]
		if m.Mapped(bi) {
			continue
		}
		unmapped[bi], b.check = true, true
		if !m.Map(bi, s.mu.Buckets[bi].Gen, 0) {
			s.mirrorReclaimLocked()
			for !m.Map(bi, s.mu.Buckets[bi].Gen, 0) && release() {
			}
			if !m.Mapped(bi) {
				s.mu.Unlock()
				return 0, fmt.Errorf("mirror: no slot on B for bucket %d's dirty data (B too small for the dirty data recovered)", bi)
			}
		}
	}
	if verify {
		// Clean blocks B covers too: a read would find a stale copy by
		// its checksum and repair it, but count it as damage.
		for _, v := range s.vols {
			v.idx.Tree.Ascend(func(e index.Ent) bool {
				if !e.Dirty() && m.Covers(s.cacheOff(e.Block())) {
					blks = append(blks, blk{loc: e.Block(), crc: e.CRC, check: true})
				}
				return true
			})
		}
	}
	s.mu.Unlock()
	buf := make([]byte, blockSize)
	copied := 0
	for _, b := range blks {
		if !b.check {
			continue
		}
		off := s.cacheOff(b.loc)
		err := m.ReadMember(mirror.B, buf, off)
		if err == nil && ondisk.CRC32C(buf) == b.crc {
			continue
		}
		if err != nil && !errors.Is(err, mirror.ErrNoCopy) {
			return copied, err
		}
		if err := m.ReadMember(mirror.A, buf, off); err != nil {
			return copied, err
		}
		if ondisk.CRC32C(buf) != b.crc {
			continue // A's copy is bad too: reads report it
		}
		if err := m.WriteMember(mirror.B, buf, off); err != nil {
			return copied, err
		}
		copied++
	}
	if copied > 0 {
		if err := m.Sync(); err != nil {
			return copied, err
		}
	}
	return copied, nil
}

// MirrorStats is the mirror's part of SetStats (nil for a set on one
// cache device).
type MirrorStats struct {
	// Degraded: one member failed (or is missing or stale); the set runs
	// on the other, and a second failure is a cache failover.
	Degraded bool
	// Failed names the failed member ("A": the --cache device, "B": the
	// --cache-mirror device) when Degraded.
	Failed string
	// Slots and SlotsUsed: B's bucket slots and those holding a copy.
	Slots, SlotsUsed int64
	// Reads: the reads each member served (A, B); a block both hold is
	// read from each in turn. ReadRetries: reads that failed on one
	// member and were served by the other; Repairs: copies rewritten from
	// the other member (after a read error or a checksum failure).
	Reads                [2]uint64
	ReadRetries, Repairs uint64
	// Gen is the mirror generation (bumped at each member failure and
	// twice per resilver).
	Gen uint64
	// Resilver is the progress of the resilver running (nil when none).
	Resilver *ResilverProgress `json:",omitempty"`
	// WritethroughBlocks: writeback writes that went to the backing
	// device too because B had no slot free (B smaller than the dirty
	// data).
	WritethroughBlocks uint64
}

func (s *Set) mirrorStats() *MirrorStats {
	if s.mir() == nil {
		return nil
	}
	st := s.mir().Stats()
	out := &MirrorStats{Slots: st.Slots, SlotsUsed: st.SlotsUsed, Reads: st.Reads, ReadRetries: st.ReadRetries, Repairs: st.Repairs, Gen: st.Gen,
		WritethroughBlocks: s.stats.mirrorThrough.Load(), Resilver: resilverProgress(st.Resilver)}
	for r, f := range st.Failed {
		if f {
			out.Degraded = true
			out.Failed = mirror.Member(r).String()
		}
	}
	return out
}

// mir returns the set's mirror, nil for a set on one cache device.
func (s *Set) mir() *mirror.Mirror { return s.mirp.Load() }
