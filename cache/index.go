package cache

// The index. Invariants kept in this file (checked by Set.Check):
//
//  1. Every entry of a volume's tree names a cache block loc whose owner[loc]
//     is (volume, lba) of that entry, and every non-zero owner[loc] is named
//     by exactly one entry.
//  2. bucket.live counts the entries pointing into the bucket, and
//     bucket.dirty those of them that are dirty. A bucket with live > 0 is
//     open or sealed, never free (invariant 5: a bucket is reused only after
//     no live entry points into its current generation).
//  3. Volume.idx.dirty and .cached equal the dirty and total entry counts of
//     the volume's tree.
//
// The index is one B-tree per volume of 16-byte entries (one per cached
// 4 KiB block) plus an 8-byte reverse map (owner) per cache block and a
// small table per bucket. The entry does not store the bucket generation:
// invariant 5 is kept by construction (live counts) in memory, and the
// generation is checked where it matters, in the journal and at replay.

import (
	"fmt"

	"github.com/google/btree"
	"github.com/tiercache/tiercache/internal/invariants"
)

// ent maps one 4 KiB block of a volume to a cache block.
type ent struct {
	lba uint64 // backing block number (byte offset / 4096)
	loc uint32 // cache block number; top bit set when dirty
	crc uint32 // crc32c of the 4 KiB block as written to the cache
}

const dirtyBit = 1 << 31

func (e ent) block() uint32 { return e.loc &^ dirtyBit }
func (e ent) dirty() bool   { return e.loc&dirtyBit != 0 }

func entLess(a, b ent) bool { return a.lba < b.lba }

func newTree() *btree.BTreeG[ent] { return btree.NewG[ent](32, entLess) }

// ownerKey packs (volume, lba) for the reverse map; 0 means unowned.
func ownerKey(vol int, lba uint64) uint64 { return uint64(vol+1)<<48 | lba }

func splitOwner(k uint64) (vol int, lba uint64) { return int(k>>48) - 1, k & (1<<48 - 1) }

type bucketState uint8

const (
	bucketFree    bucketState = iota // on the free list, ready to open
	bucketOpen                       // being filled append-only
	bucketSealed                     // full (or recovered with live data); in the FIFO
	bucketFreeing                    // emptied; its reuse record is being made durable
)

func (s bucketState) String() string {
	return [...]string{"free", "open", "sealed", "freeing"}[s]
}

type bucket struct {
	gen   uint32
	live  uint32 // entries pointing into this generation
	dirty uint32 // dirty entries among live
	pins  int32  // reads and unfinished writes in flight into the bucket
	fill  uint32 // blocks handed out (open bucket)
	state bucketState
	atime uint64 // Set.mu.tick at the last read hit or allocation (eviction recency)
}

// volIndex is a volume's part of the index. Guarded by Set.mu.
type volIndex struct {
	tree *btree.BTreeG[ent]
	busy []blockRange // backing writes in flight (claims)
	// wbInflight holds the cache blocks a writeback batch has taken and not
	// yet marked clean, so that two batches (background, eviction, Drain)
	// never write the same version twice.
	wbInflight map[uint32]struct{}
	mutations  uint64 // bumped by every write; promotion checks it
	epoch      uint64 // client flush epoch, bumped by Flush
	dirty      int64
	cached     int64
}

type blockRange struct{ lba, n uint64 }

func (r blockRange) overlaps(lba, n uint64) bool { return r.lba < lba+n && lba < r.lba+r.n }

type bitset []uint64

func newBitset(n int) bitset    { return make(bitset, (n+63)/64) }
func (b bitset) get(i int) bool { return b[i/64]&(1<<(i%64)) != 0 }
func (b bitset) set(i int)      { b[i/64] |= 1 << (i % 64) }

// insertLocked makes lba of volume v point at cache block loc, replacing any
// previous entry.
// REQUIRES: s.mu
func (s *Set) insertLocked(vi int, lba uint64, loc uint32, crc uint32, dirty bool) {
	v := s.vols[vi]
	e := ent{lba: lba, loc: loc, crc: crc}
	if dirty {
		e.loc |= dirtyBit
	}
	if old, ok := v.idx.tree.ReplaceOrInsert(e); ok {
		s.unaccountLocked(vi, old)
	}
	if invariants.Enabled && s.mu.owner[loc] != 0 {
		invariants.AssertionFailedf("cache block %d given to vol %d lba %d is owned (%#x)", loc, vi, lba, s.mu.owner[loc])
	}
	s.mu.owner[loc] = ownerKey(vi, lba)
	b := &s.mu.buckets[int64(loc)/s.bpb]
	b.live++
	v.idx.cached++
	if dirty {
		b.dirty++
		v.idx.dirty++
	}
}

// unaccountLocked releases the cache block of an entry already removed from
// (or replaced in) the tree.
// REQUIRES: s.mu
func (s *Set) unaccountLocked(vi int, old ent) {
	v := s.vols[vi]
	loc := old.block()
	if invariants.Enabled && (s.mu.owner[loc] != ownerKey(vi, old.lba) || s.mu.buckets[int64(loc)/s.bpb].live == 0) {
		invariants.AssertionFailedf("releasing cache block %d of vol %d lba %d: owner %#x, bucket live %d",
			loc, vi, old.lba, s.mu.owner[loc], s.mu.buckets[int64(loc)/s.bpb].live)
	}
	s.mu.owner[loc] = 0
	b := &s.mu.buckets[int64(loc)/s.bpb]
	b.live--
	v.idx.cached--
	if old.dirty() {
		b.dirty--
		v.idx.dirty--
	}
}

// invalidateLocked drops every entry of volume vi in [lba, lba+n).
// REQUIRES: s.mu
func (s *Set) invalidateLocked(vi int, lba, n uint64) {
	v := s.vols[vi]
	var drop []ent
	v.idx.tree.AscendRange(ent{lba: lba}, ent{lba: lba + n}, func(e ent) bool {
		drop = append(drop, e)
		return true
	})
	for _, e := range drop {
		v.idx.tree.Delete(e)
		s.unaccountLocked(vi, e)
	}
}

// markCleanLocked clears the dirty flag of lba if it still lives at loc.
// REQUIRES: s.mu
func (s *Set) markCleanLocked(vi int, lba uint64, loc uint32) bool {
	v := s.vols[vi]
	e, ok := v.idx.tree.Get(ent{lba: lba})
	if !ok || e.block() != loc || !e.dirty() {
		return false
	}
	e.loc &^= dirtyBit
	v.idx.tree.ReplaceOrInsert(e)
	s.mu.buckets[int64(loc)/s.bpb].dirty--
	v.idx.dirty--
	return true
}

// dropBucketLocked removes every entry pointing into bucket bi and returns
// how many of them were dirty (callers only drop buckets without dirty data;
// a non-zero result is a bug or corruption they report).
// REQUIRES: s.mu
func (s *Set) dropBucketLocked(bi int64, onlyClean bool) (droppedDirty int) {
	for loc := bi * s.bpb; loc < (bi+1)*s.bpb; loc++ {
		k := s.mu.owner[loc]
		if k == 0 {
			continue
		}
		vi, lba := splitOwner(k)
		v := s.vols[vi]
		e, ok := v.idx.tree.Get(ent{lba: lba})
		if !ok || int64(e.block()) != loc {
			continue // Check reports this
		}
		if e.dirty() {
			if onlyClean {
				continue
			}
			droppedDirty++
		}
		v.idx.tree.Delete(e)
		s.unaccountLocked(vi, e)
	}
	return droppedDirty
}

// Check verifies the index and allocator invariants listed at the top of
// index.go and the bucket lists. Tests run it after every test; `tiercache
// check` runs it on an opened set. It returns the first violation found.
func (s *Set) Check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checkLocked()
}

// REQUIRES: s.mu
func (s *Set) checkLocked() error {
	nb := int64(len(s.mu.buckets))
	live := make([]uint32, nb)
	dirty := make([]uint32, nb)
	owned := 0
	for _, k := range s.mu.owner {
		if k != 0 {
			owned++
		}
	}
	total := 0
	for vi, v := range s.vols {
		var nd, nc int64
		var err error
		prev := int64(-1)
		v.idx.tree.Ascend(func(e ent) bool {
			loc := int64(e.block())
			switch {
			case int64(e.lba) <= prev:
				err = fmt.Errorf("volume %s: entries out of order at lba %d", v.name, e.lba)
			case e.lba >= v.nblocks:
				err = fmt.Errorf("volume %s: lba %d beyond volume (%d blocks)", v.name, e.lba, v.nblocks)
			case loc >= nb*s.bpb:
				err = fmt.Errorf("volume %s: lba %d points at cache block %d beyond cache", v.name, e.lba, loc)
			case s.mu.owner[loc] != ownerKey(vi, e.lba):
				ov, ol := splitOwner(s.mu.owner[loc])
				err = fmt.Errorf("volume %s: lba %d -> cache block %d owned by (vol %d, lba %d)", v.name, e.lba, loc, ov, ol)
			}
			if err != nil {
				return false
			}
			prev = int64(e.lba)
			live[loc/s.bpb]++
			nc++
			if e.dirty() {
				dirty[loc/s.bpb]++
				nd++
			}
			return true
		})
		if err != nil {
			return err
		}
		if nd != v.idx.dirty || nc != v.idx.cached {
			return fmt.Errorf("volume %s: counted %d dirty/%d cached, accounted %d/%d", v.name, nd, nc, v.idx.dirty, v.idx.cached)
		}
		total += int(nc)
	}
	if total != owned {
		return fmt.Errorf("%d index entries but %d owned cache blocks", total, owned)
	}
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
	for i := range s.mu.buckets {
		b := &s.mu.buckets[i]
		if b.live != live[i] || b.dirty != dirty[i] {
			return fmt.Errorf("bucket %d (%v gen %d): accounted %d live/%d dirty, index has %d/%d",
				i, b.state, b.gen, b.live, b.dirty, live[i], dirty[i])
		}
		if (b.state == bucketFree) != inFree[i] {
			return fmt.Errorf("bucket %d is %v, on free list %t", i, b.state, inFree[i])
		}
		if (b.state == bucketSealed) != inFIFO[i] {
			return fmt.Errorf("bucket %d is %v, in sealed FIFO %t", i, b.state, inFIFO[i])
		}
		if (b.state == bucketFree || b.state == bucketFreeing) && b.live != 0 {
			return fmt.Errorf("bucket %d is %v with %d live entries (invariant 5)", i, b.state, b.live)
		}
		if b.state == bucketOpen && int64(i) != s.mu.open {
			return fmt.Errorf("bucket %d open but open bucket is %d", i, s.mu.open)
		}
		if b.fill > uint32(s.bpb) || b.pins < 0 {
			return fmt.Errorf("bucket %d: fill %d pins %d", i, b.fill, b.pins)
		}
	}
	return nil
}
