package cache

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// Resilver: a degraded mirrored set takes a new device as its failed
// member while it serves (mirror.BeginResilver has the label protocol).
// The set's part: which buckets need a copy on the new member, and, for a
// new A, that no clean entry keeps pointing at data only the dead A held.

// ResilverOptions are ReplaceMirrorMember's.
type ResilverOptions struct {
	// Force accepts a device that holds data or another set's mirror
	// label (it is overwritten).
	Force bool
	// Progress, if set, is called as the copy advances.
	Progress func(ResilverProgress)
	// Rate limits the copy to this many bytes a second (0: no limit),
	// leaving the rest of the devices' bandwidth to the set's I/O.
	Rate int64
}

// ResilverProgress is a resilver's progress (also in SetStats.Mirror
// while it runs).
type ResilverProgress struct {
	Member      string // "A" or "B": the member being brought in
	Done, Total int64  // bytes copied, to copy
	Started     time.Time
	// ETA is the time left at the rate so far, or at the limit when that
	// is slower (0 until a rate is known).
	ETA time.Duration
	// Rate is the copy's limit in bytes a second (0: none).
	Rate int64
}

func resilverProgress(st *mirror.ResilverStats) *ResilverProgress {
	if st == nil {
		return nil
	}
	p := &ResilverProgress{Member: st.Member.String(), Done: st.Done, Total: st.Total, Started: st.Started, Rate: st.Rate}
	if el := time.Since(st.Started); st.Done > 0 && st.Total > st.Done {
		p.ETA = time.Duration(float64(el) * float64(st.Total-st.Done) / float64(st.Done))
	}
	if st.Rate > 0 && st.Total > st.Done {
		// The rate so far may be above the limit (the first chunks).
		p.ETA = max(p.ETA, time.Duration(float64(st.Total-st.Done)/float64(st.Rate)*float64(time.Second)))
	}
	return p
}

// SetResilverRate changes the rate limit of the resilver running to
// bytesPerSec (0: no limit); the copy sees it within 100 ms.
func (s *Set) SetResilverRate(bytesPerSec int64) error {
	if s.mir() == nil {
		return fmt.Errorf("%w: this cache set is not mirrored: no resilver runs", ErrInvalid)
	}
	if bytesPerSec < 0 {
		return fmt.Errorf("%w: a rate of %d bytes a second: give a positive rate, or 0 for no limit", ErrInvalid, bytesPerSec)
	}
	if _, ok := s.mir().Resilvering(); !ok {
		return fmt.Errorf("%w: no resilver is running (start one with replace)", ErrInvalid)
	}
	s.mir().SetResilverRate(bytesPerSec)
	return nil
}

// ReplaceMirrorMember brings dev in as the failed member of the degraded
// mirrored set while the set serves, and returns that member ("A" or
// "B") once both are in sync. On an error the set stays degraded on its
// survivor and dev is not trusted (a crash at any point opens the same
// way). Refusals (errors.Is ErrInvalid) say what was expected and found.
//
// On a set on one cache device it attaches dev as the set's mirror,
// member B (attachMirror), and resilvers it the same way.
func (s *Set) ReplaceMirrorMember(ctx context.Context, dev device.Device, opts ResilverOptions) (string, error) {
	if err := s.err(); err != nil {
		return "", fmt.Errorf("replace: the cache set has failed over: %w", err)
	}
	if s.mir() == nil {
		s.attaching.Store(true)
		defer s.attaching.Store(false)
		if err := s.attachMirror(dev, opts.Force); err != nil {
			if errors.Is(err, mirror.ErrRefused) {
				return "", fmt.Errorf("%w: attach-mirror: %v", ErrInvalid, err)
			}
			return "", fmt.Errorf("attach-mirror: %w", err)
		}
	}
	s.mir().SetResilverRate(opts.Rate)
	r, err := s.mir().BeginResilver(dev, opts.Force)
	if err != nil {
		if errors.Is(err, mirror.ErrRefused) {
			return "", fmt.Errorf("%w: replace: %v", ErrInvalid, err)
		}
		return "", fmt.Errorf("replace: %w", err)
	}
	if err := s.resilver(ctx, r, opts); err != nil {
		s.mir().AbortResilver(err)
		return "", fmt.Errorf("replace: member %v: %w", r, err)
	}
	if err := s.mir().FinishResilver(); err != nil {
		s.mir().AbortResilver(err)
		return "", fmt.Errorf("replace: member %v: %w", r, err)
	}
	s.log.Warn("mirrored cache set redundant again", "member_replaced", r.String())
	return r.String(), nil
}

// attachMirror makes the set on one cache device a mirrored set whose
// member B, dev, is failed (not in sync): the device labelled member A of
// a new mirror, then the superblock's FeatureMirror made durable, then the
// mirror put in the device's place (s.dev.swap: from its return on every
// write goes through the mirror). A crash before the superblock says
// FeatureMirror opens the set on one device (A's label is a leftover Open
// ignores); after it, as a mirror degraded on A. dev is checked first
// (mirror.CheckAttach), so a refusal changes nothing.
func (s *Set) attachMirror(dev device.Device, force bool) error {
	s.attachMu.Lock()
	defer s.attachMu.Unlock()
	if s.mir() != nil {
		return nil // attached by a call before: replace it (BeginResilver refuses a second)
	}
	a := s.dev.Get()
	s.sbMu.Lock()
	lay := mirror.LayoutOf(s.sb)
	s.sbMu.Unlock()
	if err := mirror.CheckAttach(a, dev, lay, force); err != nil {
		return err
	}
	if err := mirror.AttachLabel(a, lay.Nonce); err != nil {
		return err
	}
	s.sbMu.Lock()
	err := s.updateSuperblockLocked(func(nsb *Superblock) error { nsb.Features |= ondisk.FeatureMirror; return nil })
	s.sbMu.Unlock()
	if err != nil {
		return err
	}
	m, err := mirror.Assemble(a, nil, false, s.log)
	if err != nil {
		return err
	}
	if err := m.Init(lay); err != nil {
		return err
	}
	s.mirp.Store(m)
	s.mirrorWatch()
	s.dev.Swap(m)
	s.log.Warn("mirror attached: the cache set is a mirror degraded on A until the resilver of B ends")
	return nil
}

func (s *Set) resilver(ctx context.Context, r mirror.Member, opts ResilverOptions) error {
	m := s.mir()
	progress := func() {
		if opts.Progress != nil {
			if p := resilverProgress(m.Stats().Resilver); p != nil {
				opts.Progress(*p)
			}
		}
	}
	if r == mirror.B {
		if _, err := s.mirrorMapDirty(); err != nil {
			return err
		}
		if err := m.ClearSlotHeaders(ctx); err != nil {
			return err
		}
	}
	buckets := m.MappedGens()
	m.AddResilverTotal(s.lay.BucketsOff + int64(len(buckets))*s.lay.BucketSize)
	progress()
	if err := m.CopyMeta(ctx, progress); err != nil {
		return err
	}
	if err := m.CopyBuckets(ctx, buckets, progress); err != nil {
		return err
	}
	if r == mirror.B {
		// Dirty data that was being written when the copy started, in
		// a bucket that was not mapped then (none is expected: buckets
		// with writes in flight are pinned, and mapped): map and copy.
		more, err := s.mirrorMapDirty()
		if err != nil {
			return err
		}
		if len(more) > 0 {
			m.AddResilverTotal(int64(len(more)) * s.lay.BucketSize)
			if err := m.CopyBuckets(ctx, more, progress); err != nil {
				return err
			}
		}
		if err := s.mirrorCheckCovered(); err != nil {
			return err
		}
	} else if err := s.dropUncovered(ctx); err != nil {
		return err
	}
	progress()
	return nil
}

// mirrorMapDirty maps on B, during a resilver of B, every bucket that may
// hold dirty data: with dirty or superseded entries, open, or with writes
// in flight. It returns the buckets it mapped now, once the records
// appended before it looked are durable: a bucket it found clean may have
// been cleaned by a record not durable yet, and a recovery from B must
// not find it dirty without a copy there (writes made dirty after it
// looked go to mapped buckets only: mirrorHolds).
func (s *Set) mirrorMapDirty() ([]mirror.BucketGen, error) {
	s.mu.Lock()
	seen := s.mu.seq
	mapped, err := s.mirrorMapDirtyLocked()
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := s.commitRecords(seen); err != nil {
		return nil, err
	}
	return mapped, nil
}

// REQUIRES: s.mu
func (s *Set) mirrorMapDirtyLocked() ([]mirror.BucketGen, error) {
	m := s.mir()
	sup := map[int64]bool{}
	for _, v := range s.vols {
		v.idx.Sup.Ascend(func(e index.Ent) bool {
			sup[int64(e.Block())/s.bpb] = true
			return true
		})
	}
	var want []int64
	for bi := range int64(len(s.mu.Buckets)) {
		a, b := &s.mu.alloc[bi], &s.mu.Buckets[bi]
		if a.state != bucketFree && (a.state == bucketOpen || a.pins > 0 || b.Dirty > 0 || sup[bi]) {
			want = append(want, bi)
		}
	}
	var mapped []mirror.BucketGen
	for _, bi := range want {
		gen := s.mu.Buckets[bi].Gen
		if m.Mapped(bi) {
			// A bucket open before the resilver began, mapped since
			// from its fill then (mirrorRetryLocked): its blocks
			// before that may be dirty.
			if m.CoverAll(bi, gen) {
				mapped = append(mapped, mirror.BucketGen{Bucket: bi, Gen: gen})
			}
			continue
		}
		if !m.Map(bi, gen, 0) {
			s.mirrorReclaimLocked()
			if !m.Map(bi, gen, 0) {
				return nil, fmt.Errorf("%w: the new member B has %d slots, fewer than the %d buckets that hold dirty data now: write the dirty data back first (tiercache flush; with the set degraded writeback runs at full speed), then replace again", ErrInvalid, m.Stats().Slots, len(want))
			}
		}
		mapped = append(mapped, mirror.BucketGen{Bucket: bi, Gen: gen})
	}
	return mapped, nil
}

// mirrorCheckCovered checks, at the end of a resilver of B, that B holds
// a copy of every dirty block.
func (s *Set) mirrorCheckCovered() error {
	var bad []uint32
	ls, err := s.entriesIn(func(loc int64) bool { return !s.mir().Covers(s.cacheOff(uint32(loc))) })
	if err != nil {
		return err
	}
	for _, l := range ls {
		if l.e.Dirty() {
			bad = append(bad, l.e.Block())
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("%d dirty blocks (the first at cache block %d) have no copy on the new member B: retry the replace", len(bad), bad[0])
	}
	return nil
}

// dropUncovered, at the end of a resilver of A, evicts every sealed
// bucket that B holds no whole copy of: its clean entries point at data
// only the dead A held (the new A holds what the copy put there: B's
// copies). The eviction bumps the bucket's generation durably, so no
// replay brings the entries back. The open bucket is sealed first, with
// whatever fill it has. A bucket in use is retried; one that stays so
// fails the resilver.
func (s *Set) dropUncovered(ctx context.Context) error {
	m := s.mir()
	covered := func(bi int64) bool { return m.Covers(s.cacheOff(uint32(bi * s.bpb))) }
	for range 3 {
		if err := ctx.Err(); err != nil {
			return err
		}
		victims := map[int64]bool{}
		s.mu.Lock()
		left := 0
		for bi := range int64(len(s.mu.Buckets)) {
			if s.mu.Buckets[bi].Live == 0 || covered(bi) {
				continue
			}
			left++
			if a := &s.mu.alloc[bi]; a.state == bucketOpen && bi == s.mu.open {
				// Sealed now rather than once it fills (an idle set
				// would never): the blocks B has no copy of are in it
				// already. The next write opens a bucket B maps (or
				// goes around the cache: mirrorOpenLocked).
				a.state = bucketSealed
				s.mu.sealed = append(s.mu.sealed, uint32(bi))
				s.mu.open = -1
			}
			if s.mu.alloc[bi].state == bucketSealed {
				victims[bi] = true
			}
		}
		s.mu.Unlock()
		if left == 0 {
			return nil
		}
		found := map[int64][]located{}
		ls, err := s.entriesIn(func(loc int64) bool { return victims[loc/s.bpb] })
		if err != nil {
			return err
		}
		for _, l := range ls {
			bi := int64(l.e.Block()) / s.bpb
			found[bi] = append(found[bi], l)
		}
		for bi := range victims {
			s.evictVictim(bi, found[bi])
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for bi := range int64(len(s.mu.Buckets)) {
		if s.mu.Buckets[bi].Live > 0 && !covered(bi) {
			return fmt.Errorf("bucket %d (%v) holds entries whose data only the failed A held and cannot be evicted now: retry the replace", bi, s.mu.alloc[bi].state)
		}
	}
	return nil
}
