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

// dropCleanLocked drops every clean entry, as recovery does after an
// unclean shutdown (resolver.finish).
// REQUIRES: exclusive access
func (s *Set) dropCleanLocked() int {
	n := 0
	for vi, v := range s.vols {
		var drop []index.Ent
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			if !e.Dirty() {
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
