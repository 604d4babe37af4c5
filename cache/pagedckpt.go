package cache

import (
	"encoding/binary"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// Checkpoints as index pages (ondisk.FeaturePagedIndex; docs/CACHE.md,
// "Index pages on the cache device"). The two checkpoint slots together
// are one page area (cache/internal/pages): root slots 0 and 1, then the
// pages. A checkpoint compares its snapshot of the index with the one
// the durable root holds (index.Diff skips the subtrees the two share),
// applies the differences to the page trees, and has the store write the
// pages that changed, then root generation g+1 into slot (g+1)%2, which
// is the checkpoint generation: the journal of generation g+1 starts at
// the journal block the root's payload names, exactly as after a
// checkpoint slot. Recovery reads the newest valid root, every page of
// its trees, and replays the journal since it.
//
// Trees: volume slot v's live entries are tree v, its superseded versions
// tree v|pages.SupTree; the bucket table holds the bucket generations.
// The index stays wholly in RAM: the pages are its durable form only.

// pagedCachePages is the store's page cache: the leaves a checkpoint
// changes are read through it (a leaf changed since the last checkpoint
// is held by its tree until written).
const pagedCachePages = 256

// maxPagedVolumes bounds the volume slots of a paged set: a root names
// two trees a slot and carries each slot's flush epoch in one 4 KiB block.
const maxPagedVolumes = 40

// pagedIndex is a paged set's page store and the snapshot its durable
// root holds. Guarded by commitMu (checkpointLocked), like the slots.
type pagedIndex struct {
	st    *pages.Store
	trees []*index.Ptree // per volume slot; nil: empty
	sups  []*index.Stree
	// pages and bytes the last checkpoint wrote (for tests and stats).
	lastPages, lastBytes uint64
}

// pagedLayout is the page area of a paged set: both checkpoint slots.
func pagedLayout(sb *Superblock) pages.Layout {
	return pages.Layout{Off: sb.CkptOff[0], Pages: uint32(2*sb.CkptLen/pages.PageSize - 2), Nonce: sb.Nonce()}
}

// pagedSlotLen is the checkpoint slot length of a paged set of nbuckets
// buckets of bpb blocks: half its page area (pages.AreaPages), at least
// an ordinary slot's.
func pagedSlotLen(nbuckets, bpb int64) int64 {
	area := (2 + pages.AreaPages(nbuckets*bpb, nbuckets, 2*maxPagedVolumes)) * pages.PageSize
	half := (area/2 + blockSize - 1) / blockSize * blockSize
	return max(half, ondisk.CkptSlotLen(nbuckets, bpb, ondisk.MaxBackings))
}

// The root's payload: the journal block the generation starts at, then
// each volume slot's flush epoch.
//
//	jblk u64 | nvols u16 | epoch u64 × nvols
func encodePagedPayload(jblk int64, epochs []uint64) []byte {
	b := make([]byte, 10+8*len(epochs))
	binary.LittleEndian.PutUint64(b, uint64(jblk))
	binary.LittleEndian.PutUint16(b[8:], uint16(len(epochs)))
	for i, e := range epochs {
		binary.LittleEndian.PutUint64(b[10+8*i:], e)
	}
	return b
}

func decodePagedPayload(b []byte, sb *Superblock) (jblk int64, epochs []uint64, err error) {
	bad := func(format string, args ...any) (int64, []uint64, error) {
		return 0, nil, ondisk.Corruptf("index root payload", sb.CkptOff[0], 2*pages.PageSize, format, args...)
	}
	if len(b) < 10 {
		return bad("%d bytes", len(b))
	}
	j := binary.LittleEndian.Uint64(b)
	n := int(binary.LittleEndian.Uint16(b[8:]))
	if j >= uint64(sb.JournalLen/blockSize) || n > maxPagedVolumes || len(b) != 10+8*n {
		return bad("journal block %d, %d volume slots in %d bytes", j, n, len(b))
	}
	epochs = make([]uint64, n)
	for i := range epochs {
		epochs[i] = binary.LittleEndian.Uint64(b[10+8*i:])
	}
	return int64(j), epochs, nil
}

// formatPaged writes the first root (generation 1: no entries, the
// journal from block 0) of a paged set.
func formatPaged(dev device.Device, sb *Superblock, nvols int) error {
	return pages.Format(dev, pagedLayout(sb), encodePagedPayload(0, make([]uint64, nvols)))
}

// writePagedCheckpoint is checkpointLocked's write for a paged set: the
// pages that changed since the durable root, then root h.Gen. The
// snapshot (gens, epochs, trees, vers) is checkpointLocked's.
// REQUIRES: s.commitMu
func (s *Set) writePagedCheckpoint(h ondisk.CkptHeader, gens []uint32, epochs []uint64, trees []*index.Ptree, vers []ondisk.VerSnap) error {
	p := s.pg
	st := p.st
	if err := st.Err(); err != nil {
		return err
	}
	if h.Gen != st.Gen()+1 {
		return fmt.Errorf("%w: paged checkpoint of generation %d after root %d", ErrInvalid, h.Gen, st.Gen())
	}
	if len(trees) > maxPagedVolumes {
		return fmt.Errorf("%w: %d volume slots in a paged set (at most %d)", ErrInvalid, len(trees), maxPagedVolumes)
	}
	p0, b0 := st.PagesWritten, st.BytesWritten
	tab, err := st.Table(len(gens))
	if err != nil {
		return err
	}
	for i, g := range gens {
		tab.Set(i, pages.Bucket{Gen: g}) // an unchanged record changes no page
	}
	sups := make([]*index.Stree, len(trees))
	for vi := range max(len(trees), len(p.trees)) {
		var oldT, newT *index.Ptree
		var oldS, newS *index.Stree
		var epochOf func(uint32) uint64
		if vi < len(p.trees) {
			oldT, oldS = p.trees[vi], p.sups[vi]
		}
		if vi < len(trees) {
			newT, newS, epochOf = trees[vi], vers[vi].Sup, vers[vi].EpochOf
			sups[vi] = newS
		}
		if err := s.applyDiff(st, uint16(vi), oldT, newT, epochOf); err != nil {
			return err
		}
		if err := s.applySupDiff(st, uint16(vi)|pages.SupTree, oldS, newS, epochOf); err != nil {
			return err
		}
	}
	if err := st.Checkpoint(encodePagedPayload(h.JPos.Blk, epochs)); err != nil {
		return err
	}
	p.trees, p.sups = trees, sups
	p.lastPages, p.lastBytes = st.PagesWritten-p0, st.BytesWritten-b0
	if invariants.Enabled {
		if err := p.check(gens); err != nil {
			return fmt.Errorf("paged checkpoint %d differs from its snapshot: %w", h.Gen, err)
		}
	}
	return nil
}

// slotOf is the leaf slot of entry e (live, or a superseded version).
// The slot's bucket generation is written 0: the engine drops a reused
// bucket's entries from the index itself, and an entry the same after
// its bucket was reused (same block, LBA and checksum) is no difference
// to Diff, so a generation written with the entry would go stale. The
// table holds the generations.
func (s *Set) slotOf(e index.Ent, sup bool, epochOf func(uint32) uint64) pages.Slot {
	sl := pages.Slot{LBA: e.LBA, Loc: e.Loc, CRC: e.CRC}
	if sup {
		sl.Loc |= index.DirtyBit
	}
	if sl.Loc&index.DirtyBit != 0 && epochOf != nil {
		sl.Epoch = epochOf(e.Block())
	}
	return sl
}

func (s *Set) applyDiff(st *pages.Store, id uint16, oldT, newT *index.Ptree, epochOf func(uint32) uint64) error {
	var err error
	var t *pages.Tree
	index.Diff(oldT, newT, func(o, n index.Ent, inOld, inNew bool) {
		if err != nil {
			return
		}
		if t == nil {
			t = st.Tree(id)
		}
		if inNew {
			_, _, err = t.Put(s.slotOf(n, false, epochOf))
		} else {
			_, _, err = t.Delete(o.LBA)
		}
	})
	return err
}

func (s *Set) applySupDiff(st *pages.Store, id uint16, oldS, newS *index.Stree, epochOf func(uint32) uint64) error {
	var err error
	var t *pages.Tree
	index.DiffSup(oldS, newS, func(o, n index.Ent, inOld, inNew bool) {
		if err != nil {
			return
		}
		if t == nil {
			t = st.Tree(id)
		}
		if inNew {
			_, _, err = t.Put(s.slotOf(n, true, epochOf))
		} else {
			_, _, err = t.DeleteKey(pages.Key{LBA: o.LBA, Sub: o.Block()})
		}
	})
	return err
}

// check verifies (invariants builds) that the page trees hold exactly the
// snapshot the durable root is said to hold.
func (p *pagedIndex) check(gens []uint32) error {
	for _, id := range p.st.TreeIDs() {
		vi := int(id &^ pages.SupTree)
		var want []index.Ent
		if id&pages.SupTree == 0 {
			if vi < len(p.trees) && p.trees[vi] != nil {
				p.trees[vi].Ascend(func(e index.Ent) bool { want = append(want, e); return true })
			}
		} else if vi < len(p.sups) && p.sups[vi] != nil {
			p.sups[vi].Ascend(func(e index.Ent) bool { want = append(want, e); return true })
		}
		i := 0
		var bad error
		err := p.st.Tree(id).Ascend(0, func(sl pages.Slot) bool {
			loc := sl.Loc
			if id&pages.SupTree != 0 {
				loc &^= index.DirtyBit
			}
			if i >= len(want) || (index.Ent{LBA: sl.LBA, Loc: loc, CRC: sl.CRC}) != want[i] {
				bad = fmt.Errorf("tree %#x slot %d: %+v", id, i, sl)
				return false
			}
			i++
			return true
		})
		if err != nil {
			return err
		}
		if bad != nil {
			return bad
		}
		if i != len(want) {
			return fmt.Errorf("tree %#x holds %d slots, the snapshot %d", id, i, len(want))
		}
	}
	return nil
}

// readPagedCheckpoint is ReadCheckpoint for a paged set: the newest valid
// root and every page of its trees, as the checkpoint they stand for (cd
// passes the same checks as a checkpoint slot's body: it is encoded and
// decoded as one), with the store for the next checkpoint. Damage is a
// corruption error (IsCorruption), never a panic.
func readPagedCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (ondisk.CkptHeader, *ondisk.CkptData, *pagedIndex, string, error) {
	fail := func(err error) (ondisk.CkptHeader, *ondisk.CkptData, *pagedIndex, string, error) {
		return ondisk.CkptHeader{}, nil, nil, "", err
	}
	st, payload, err := pages.Open(dev, pagedLayout(sb), pagedCachePages)
	if err != nil {
		return fail(err)
	}
	jblk, epochs, err := decodePagedPayload(payload, sb)
	if err != nil {
		return fail(err)
	}
	tab, err := st.Table(int(sb.NBuckets))
	if err != nil {
		return fail(ondisk.Corruptf("index root", sb.CkptOff[0], 2*pages.PageSize, "%v", err))
	}
	gens := make([]uint32, sb.NBuckets)
	for i := range gens {
		gens[i] = tab.Get(i).Gen
	}
	nv := len(epochs)
	bpb := sb.BlocksPerBucket()
	total := uint32(sb.NBuckets * bpb)
	p := &pagedIndex{st: st, trees: make([]*index.Ptree, nv), sups: make([]*index.Stree, nv)}
	vers := make([]ondisk.VerSnap, nv)
	epochOf := map[uint32]uint64{}
	at := func(id uint16, sl pages.Slot) error {
		b := sl.Loc &^ index.DirtyBit
		if b >= total || sl.BGen != 0 {
			return ondisk.Corruptf("index page", -1, pages.PageSize, "tree %#x: slot %+v names cache block %d of %d, or a bucket generation", id, sl, b, total)
		}
		if sl.Loc&index.DirtyBit != 0 {
			epochOf[b] = sl.Epoch
		}
		return nil
	}
	for _, id := range st.TreeIDs() {
		vi := int(id &^ pages.SupTree)
		if vi >= nv {
			return fail(ondisk.Corruptf("index root", sb.CkptOff[0], 2*pages.PageSize, "tree %#x beyond the root's %d volume slots", id, nv))
		}
		var ents []index.Ent
		var bad error
		err := st.Tree(id).Ascend(0, func(sl pages.Slot) bool {
			if bad = at(id, sl); bad != nil {
				return false
			}
			e := index.Ent{LBA: sl.LBA, Loc: sl.Loc, CRC: sl.CRC}
			if id&pages.SupTree != 0 {
				e.Loc &^= index.DirtyBit
			}
			ents = append(ents, e)
			return true
		})
		if err == nil {
			err = bad
		}
		if err != nil {
			return fail(err)
		}
		if id&pages.SupTree == 0 {
			p.trees[vi] = index.BuildPtree(ents, nil)
		} else {
			t := index.NewStree()
			for _, e := range ents {
				t.ReplaceOrInsert(e)
			}
			p.sups[vi] = t
		}
	}
	trees := make([]*index.Ptree, nv)
	for vi := range nv {
		trees[vi] = p.trees[vi]
		if trees[vi] == nil {
			trees[vi] = index.NewPtree()
		}
		vers[vi] = ondisk.VerSnap{EpochOf: func(loc uint32) uint64 { return epochOf[loc] }, Sup: p.sups[vi]}
	}
	var body []byte
	if err := ondisk.EncodeCkptBody(gens, epochs, trees, vers, func(b []byte) error { body = append(body, b...); return nil }); err != nil {
		return fail(err)
	}
	cd, err := ondisk.DecodeCkptBody(body, sb.NBuckets, bpb, volBlocks)
	if err != nil {
		return fail(ondisk.Placed(err, sb.CkptOff[0], 2*sb.CkptLen))
	}
	warn := ""
	if _, perr := st.Previous(); perr != nil {
		warn = fmt.Sprintf("the other index root is not intact (%v): recovered from root generation %d", perr, st.Gen())
	}
	h := ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: st.Gen(), JPos: ondisk.JournalPos{Blk: jblk}}
	return h, cd, p, warn, nil
}

// readCheckpoint reads the set's newest checkpoint: a checkpoint slot, or
// for a paged set the newest root and its pages (pg then holds them).
func readCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (h ondisk.CkptHeader, cd *ondisk.CkptData, pg *pagedIndex, warn string, err error) {
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		return readPagedCheckpoint(dev, sb, volBlocks)
	}
	h, cd, warn, err = ondisk.ReadCheckpoint(dev, sb, volBlocks)
	return h, cd, nil, warn, err
}
