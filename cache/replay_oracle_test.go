package cache

// The record-by-record replay: the test oracle of recovery's resolver
// (recovery.go). It loads the checkpoint, then applies the journal's
// records one by one in journal order (applyLocked).

import (
	"fmt"
	"math"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// replayOld recovers from checkpoint cd and journal records recs record by
// record, returning the first record's error.
// REQUIRES: exclusive access, after resetIndexLocked
func (s *Set) replayOld(cd *ondisk.CkptData, recs []*ondisk.Rec) error {
	for vi := range cd.Vols {
		if vi >= len(s.vols) {
			break // slots detached after this checkpoint: empty (decodeCkptBody)
		}
		s.loadCheckpointLocked(vi, &cd.Vols[vi])
	}
	for _, r := range recs {
		if err := s.applyLocked(r); err != nil {
			return fmt.Errorf("%v: %w", r, err)
		}
	}
	return nil
}

// loadCheckpointLocked builds volume vi's index from its checkpoint part:
// the entries (in strictly increasing LBA order, as decodeCkptBody checked)
// are bulk-loaded into nearly full leaves, each leaf's summary (its dirty
// entries' oldest epoch) computed on the way; the bucket counts, epochs
// and the recovery-time reverse map follow (no random B-tree inserts).
// REQUIRES: exclusive access, after resetIndexLocked
func (s *Set) loadCheckpointLocked(vi int, cv *ondisk.CkptVol) {
	v := s.vols[vi]
	v.idx.epoch = cv.Epoch
	aggs := make([]uint64, (len(cv.Ents)+index.LeafBulkFill-1)/index.LeafBulkFill)
	for i := range aggs {
		aggs[i] = math.MaxUint64
	}
	for i, e := range cv.Ents {
		loc := e.Block()
		if s.mu.Owner != nil {
			s.mu.Owner[loc] = index.OwnerKey(vi, e.LBA)
		}
		b := &s.mu.Buckets[int64(loc)/s.bpb]
		b.Live++
		v.idx.Cached++
		if e.Dirty() {
			ep := cv.EpochOf[loc]
			b.Dirty++
			v.idx.Dirty++
			s.mu.SetBlockEpoch(loc, ep)
			aggs[i/index.LeafBulkFill] = min(aggs[i/index.LeafBulkFill], ep)
		}
	}
	v.idx.Tree = index.BuildPtree(cv.Ents, aggs)
	v.idx.Sup = index.NewStree()
	for _, x := range cv.Sup {
		s.mu.InsertSup(vi, x)
	}
}

// marksOf returns the regions marked at the end of recs, per volume: a
// mark record marks its region, an unmark record ends that.
func marksOf(recs []*ondisk.Rec) map[uint16]map[uint64]bool {
	m := map[uint16]map[uint64]bool{}
	for _, r := range recs {
		switch r.Type {
		case ondisk.RecMark:
			if m[r.Vol] == nil {
				m[r.Vol] = map[uint64]bool{}
			}
			m[r.Vol][r.Region] = true
		case ondisk.RecUnmark:
			delete(m[r.Vol], r.Region)
		}
	}
	return m
}

// dropCleanLocked drops the clean entries recovery drops after an unclean
// shutdown (resolver.finish): every one (cleanDrop), or those in the
// regions of 2^shift blocks marked (cleanKeepUnmarked).
// REQUIRES: exclusive access
func (s *Set) dropCleanLocked(p cleanPolicy, shift uint8, marked map[uint16]map[uint64]bool) int {
	n := 0
	for vi, v := range s.vols {
		var drop []index.Ent
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			if !e.Dirty() && (p == cleanDrop || marked[uint16(vi)][e.LBA>>shift]) {
				drop = append(drop, e)
			}
			return true
		})
		for _, e := range drop {
			v.idx.Tree.Delete(e)
			s.mu.Unaccount(vi, e)
		}
		n += len(drop)
	}
	return n
}

// applyLocked replays one journal record. Records come from a checksummed
// block, but their contents are still validated before use.
// REQUIRES: s.mu (or exclusive access during Open)
func (s *Set) applyLocked(r *ondisk.Rec) error {
	total := uint64(s.mu.CacheBlocks())
	vol := func() (*Volume, error) {
		if int(r.Vol) >= len(s.vols) {
			return nil, ondisk.Corruptf("journal record", 0, 0, "volume %d of %d", r.Vol, len(s.vols))
		}
		return s.vols[r.Vol], nil
	}
	switch r.Type {
	case ondisk.RecInsert:
		v, err := vol()
		if err != nil {
			return err
		}
		n := uint64(len(r.CRCs))
		loc := uint64(r.Loc)
		if r.LBA+n > v.nblocks || r.LBA+n < r.LBA || loc+n > total || loc/uint64(s.bpb) != (loc+n-1)/uint64(s.bpb) {
			return ondisk.Corruptf("journal record", 0, 0, "insert out of range: %v", r)
		}
		b := &s.mu.Buckets[loc/uint64(s.bpb)]
		if b.Gen != r.Gen {
			return ondisk.Corruptf("journal record", 0, 0, "insert into bucket %d generation %d, bucket is at %d", loc/uint64(s.bpb), r.Gen, b.Gen)
		}
		for i := uint64(0); i < n; i++ {
			if k := s.mu.Owner[loc+i]; k != 0 {
				// The block is being reused within its generation only if
				// the journal is wrong.
				return ondisk.Corruptf("journal record", 0, 0, "insert into owned cache block %d", loc+i)
			}
			s.mu.Insert(int(r.Vol), r.LBA+i, uint32(loc+i), r.CRCs[i], r.Dirty, r.Epoch, s.keepSuperseded(int(r.Vol)))
		}
		v.idx.epoch = max(v.idx.epoch, r.Epoch)
	case ondisk.RecClean:
		if _, err := vol(); err != nil {
			return err
		}
		if uint64(r.Loc) >= total {
			return ondisk.Corruptf("journal record", 0, 0, "clean out of range: %v", r)
		}
		s.mu.MarkClean(int(r.Vol), r.LBA, r.Loc)
	case ondisk.RecInvalidate:
		if _, err := vol(); err != nil {
			return err
		}
		s.mu.Invalidate(int(r.Vol), r.LBA, min(r.N, 1<<48))
	case ondisk.RecReuse:
		if int64(r.Bucket) >= int64(len(s.mu.Buckets)) {
			return ondisk.Corruptf("journal record", 0, 0, "reuse of bucket %d", r.Bucket)
		}
		if d := s.mu.DropBucket(int64(r.Bucket), false); d > 0 {
			s.log.Error("journal reuses a bucket holding dirty data; dropped", "bucket", r.Bucket, "dirty_blocks", d)
		}
		s.mu.Buckets[r.Bucket].Gen = r.Gen
	case ondisk.RecMark, ondisk.RecUnmark:
		// Recovery reads them (marksOf); the index has nothing of them.
		if _, err := vol(); err != nil {
			return err
		}
	default:
		return ondisk.Corruptf("journal record", 0, 0, "type %d", r.Type)
	}
	return nil
}
