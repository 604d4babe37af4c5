package cache

import (
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/index"
)

// volIndex is a volume's part of the index (index.Vol, also listed in
// Set.mu.Vols) and the engine's per-volume state kept beside it. Guarded
// by Set.mu.
type volIndex struct {
	index.Vol
	busy []blockRange // backing writes in flight (claims)
	// wbInflight holds the cache blocks a writeback batch has taken and not
	// yet marked clean, so that two batches (background, eviction, Drain)
	// never write the same version twice.
	wbInflight map[uint32]struct{}
	mutations  uint64 // bumped by every write; promotion checks it
	epoch      uint64 // client flush epoch, bumped by Flush
	// Vol.Replayable: passthrough skips its invalidation record while it
	// is false, as no record or checkpoint entry exists that the record
	// could cancel (docs/CACHE.md, "Flush protocol"). Set by
	// appendInsertLocked, cleared only by a durable checkpoint whose
	// snapshot held no entry of the volume when no insert of it was
	// appended after the snapshot.
	//
	// insertSeq is Set.mu.seq just after the volume's last insert record.
	insertSeq uint64
	// marks: the regions whose mark record was appended in this journal
	// generation (marks.go).
	marks map[uint64]*regionMark
}

type blockRange struct{ lba, n uint64 }

func (r blockRange) overlaps(lba, n uint64) bool { return r.lba < lba+n && lba < r.lba+r.n }

// keepSuperseded reports whether volume vi keeps superseded dirty versions
// (epoch order, not degraded to lba order: order.go).
func (s *Set) keepSuperseded(vi int) bool {
	return s.epochSetting(vi) && !s.vol(vi).ord.degraded.Load()
}

// Check verifies the index invariants (10 to 15 in docs/DESIGN.md) and the
// bucket lists. Tests run it after every test; `tiercache check` runs it
// on an opened set. It returns the first violation found.
func (s *Set) Check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checkLocked()
}

// REQUIRES: s.mu
func (s *Set) checkLocked() error { return s.checkIndexLocked(true) }

// checkIndexLocked is Check; exact as in index.Index.Check (Check and Open
// built with -tags invariants use exact).
// REQUIRES: s.mu
func (s *Set) checkIndexLocked(exact bool) error {
	if err := s.mu.Check(exact); err != nil {
		return err
	}
	return s.checkListsLocked()
}

// checkListsLocked is the part of checkIndexLocked that reads no entry:
// the bucket lists and the allocator's states against the live counts.
// REQUIRES: s.mu
func (s *Set) checkListsLocked() error {
	nb := int64(len(s.mu.Buckets))
	inFree := make([]bool, nb)
	for _, bi := range s.mu.free {
		if inFree[bi] {
			return fmt.Errorf("bucket %d twice on the free list", bi)
		}
		inFree[bi] = true
	}
	inFIFO := make([]bool, nb)
	for _, bi := range s.mu.sealed {
		if inFIFO[bi] {
			return fmt.Errorf("bucket %d twice in the sealed FIFO", bi)
		}
		inFIFO[bi] = true
	}
	if len(s.mu.alloc) != len(s.mu.Buckets) {
		return fmt.Errorf("%d buckets in the allocator, %d in the index", len(s.mu.alloc), len(s.mu.Buckets))
	}
	for i := range s.mu.alloc {
		a := &s.mu.alloc[i]
		if (a.state == bucketFree || a.state == bucketFreeing) && s.mu.Buckets[i].Live != 0 {
			return fmt.Errorf("bucket %d is %v with %d live entries (invariant 11)", i, a.state, s.mu.Buckets[i].Live)
		}
		if a.fill > uint32(s.bpb) || a.pins < 0 {
			return fmt.Errorf("bucket %d: fill %d pins %d", i, a.fill, a.pins)
		}
		if (a.state == bucketFree) != inFree[i] {
			return fmt.Errorf("bucket %d is %v, on free list %t", i, a.state, inFree[i])
		}
		if (a.state == bucketSealed) != inFIFO[i] {
			return fmt.Errorf("bucket %d is %v, in sealed FIFO %t", i, a.state, inFIFO[i])
		}
		if a.state == bucketOpen && int64(i) != s.mu.open {
			return fmt.Errorf("bucket %d open but open bucket is %d", i, s.mu.open)
		}
	}
	return nil
}
