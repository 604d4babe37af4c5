package cache

import (
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
// its trees, and replays the journal since it; an Open after a clean
// shutdown reads the root, its inner pages and bucket table and builds
// the volumes' index trees from stubs of their leaves, loaded when first
// needed (lazyleaves.go).
//
// Trees: volume slot v's live entries are tree v, its superseded versions
// tree v|pages.SupTree; the bucket table holds the bucket generations.
// The index is in RAM (its leaves loaded, after a lazy Open, as they are
// needed): the pages are its durable form.

// pagedIndex is a paged set's page store and the snapshot its durable
// root holds. Guarded by commitMu (checkpointLocked), like the slots.
type pagedIndex struct {
	st    *pages.Store
	trees []*index.Ptree // per volume slot; nil: empty
	sups  []*index.Stree
	// pages and bytes the last checkpoint wrote (for tests and stats).
	lastPages, lastBytes uint64
	// lazy: the volumes' trees were built from stubs naming the leaves
	// of the root Open found (lazyleaves.go); nil: every leaf was read.
	lazy *lazyLeaves
}

// newPagedIndex is the paged index of a store just read: its superseded
// versions' trees, the volumes' trees to come (pagedBaseLocked).
func newPagedIndex(st *pages.Store, sups []*index.Stree) *pagedIndex {
	return &pagedIndex{st: st, trees: make([]*index.Ptree, len(sups)), sups: sups}
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
	if len(trees) > pages.MaxVolumes {
		return fmt.Errorf("%w: %d volume slots in a paged set (at most %d)", ErrInvalid, len(trees), pages.MaxVolumes)
	}
	p0, b0 := st.PagesWritten, st.BytesWritten
	tab, err := st.Table(len(gens))
	if err != nil {
		return err
	}
	for i, g := range gens {
		r := tab.Get(i)
		r.Gen = g
		tab.Set(i, r) // an unchanged record changes no page
	}
	count := pages.TableCounter(tab, s.bpb)
	released := len(st.Alloc().ReleasedPages())
	var applied int
	counted := func(e index.Ent, dirty bool, d int) { applied++; count(e, dirty, d) }
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
		if err := pages.ApplyDiff(st, uint16(vi), oldT, newT, epochOf, counted); err != nil {
			return err
		}
		if err := pages.ApplySupDiff(st, uint16(vi)|pages.SupTree, oldS, newS, epochOf, counted); err != nil {
			return err
		}
	}
	if p.lazy != nil {
		if err := s.pinReleasedStubs(trees, st.Alloc().ReleasedPages()[released:]); err != nil {
			return err
		}
	}
	dirty := make([]int64, len(trees))
	for vi := range dirty {
		dirty[vi] = int64(vers[vi].Dirty)
	}
	if err := st.Checkpoint(pages.EncodePayload(h.JPos.Blk, epochs, dirty)); err != nil {
		return err
	}
	p.trees, p.sups = trees, sups
	p.lastPages, p.lastBytes = st.PagesWritten-p0, st.BytesWritten-b0
	if invariants.Enabled && applied > 0 {
		// (With no difference applied the page trees hold what they
		// held: checking would load every leaf of a lazy set.)
		s.mu.Lock()
		err := p.check(gens, s.bpb)
		s.mu.Unlock()
		if err != nil {
			return fmt.Errorf("paged checkpoint %d differs from its snapshot: %w", h.Gen, err)
		}
	}
	return nil
}

// pagedBaseLocked is Open's step between recovery and its first
// checkpoint for a paged set. The page trees hold the checkpoint cd
// (read from them); recovery has rebuilt the index from cd and the
// journal. It applies the differences between cd's entries and the
// recovered trees to the page trees (their leaves read together,
// pages.ApplyDiffSorted) and takes the recovered trees' copy-on-write clones as
// the snapshot the page trees hold (pagedIndex.trees). So the page trees
// need no index tree of their own built at Open, and the checkpoint that
// follows compares trees that share every node recovery did not change.
// REQUIRES: s.commitMu, exclusive access (Open)
func (s *Set) pagedBaseLocked(cd *ondisk.CkptData) error {
	p := s.pg
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.lazy != nil {
		// The trees are built from the page trees' leaves, unchanged.
		p.trees = make([]*index.Ptree, len(s.vols))
		for vi, v := range s.vols {
			p.trees[vi] = v.idx.Tree.Clone()
		}
		for len(p.sups) < len(p.trees) {
			p.sups = append(p.sups, nil)
		}
		return nil
	}
	tab, err := p.st.Table(len(s.mu.Buckets))
	if err != nil {
		return err
	}
	count := pages.TableCounter(tab, s.bpb)
	epochOf := s.mu.SnapshotEpochs()
	p.trees = make([]*index.Ptree, max(len(cd.Vols), len(s.vols)))
	for len(p.sups) < len(p.trees) {
		p.sups = append(p.sups, nil)
	}
	for vi := range p.trees {
		var old []index.Ent
		if vi < len(cd.Vols) {
			old = cd.Vols[vi].Ents
		}
		var cur *index.Ptree
		if vi < len(s.vols) {
			cur = s.vols[vi].idx.Tree.Clone()
		}
		if err := pages.ApplyDiffSorted(p.st, uint16(vi), old, cur, epochOf, count); err != nil {
			return err
		}
		p.trees[vi] = cur
	}
	return nil
}

// check verifies (invariants builds) that the page trees hold exactly the
// snapshot the durable root is said to hold.
func (p *pagedIndex) check(gens []uint32, bpb int64) error {
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
	tab, err := p.st.Table(len(gens))
	if err != nil {
		return err
	}
	cd := &ondisk.CkptData{Vols: make([]ondisk.CkptVol, len(p.trees))}
	for vi := range p.trees {
		if p.trees[vi] != nil {
			p.trees[vi].Ascend(func(e index.Ent) bool { cd.Vols[vi].Ents = append(cd.Vols[vi].Ents, e); return true })
		}
		if p.sups[vi] != nil {
			p.sups[vi].Ascend(func(e index.Ent) bool { cd.Vols[vi].Sup = append(cd.Vols[vi].Sup, index.Ver{Loc: e.Loc}); return true })
		}
	}
	return pages.CountsOf(cd, bpb, tab)
}

// readCheckpoint reads the set's newest checkpoint: a checkpoint slot, or
// for a paged set the newest root and its pages (pg then holds them).
func readCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (h ondisk.CkptHeader, cd *ondisk.CkptData, pg *pagedIndex, warn string, err error) {
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		pr, err := pages.OpenSet(dev, sb)
		if err != nil {
			return ondisk.CkptHeader{}, nil, nil, "", err
		}
		cd, sups, err := pr.ReadCheckpoint(sb, volBlocks, false)
		if err != nil {
			return ondisk.CkptHeader{}, nil, nil, "", err
		}
		return pr.Hdr, cd, newPagedIndex(pr.Store, sups), pr.Warn, nil
	}
	h, cd, warn, err = ondisk.ReadCheckpoint(dev, sb, volBlocks)
	return h, cd, nil, warn, err
}
