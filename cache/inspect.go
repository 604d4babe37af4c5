package cache

// Read-only views of a cache device for `tiercache inspect` and the offline
// `tiercache check`. Nothing here writes to the device, so it may be run
// against a copy or a device that is not being served. Run against a device
// that is being served, it sees a moving target: the result may be
// inconsistent (reported as problems), but the device is not harmed.
//
// OpenImage rebuilds the index the way Open does (newest checkpoint plus
// journal replay) into a Set that is never started: no goroutines, no
// writes, no backing devices.
//
// NOTE for the engine: OpenImage repeats the first half of Open. If Open is
// split into a pure "load" step and a "start" step, OpenImage should call
// the load step instead.

import (
	"fmt"
	"log/slog"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// SuperblockCopy is one of the two superblock copies as found on disk.
type SuperblockCopy = ondisk.SuperblockCopy

// ReadSuperblockCopies decodes both superblock copies independently.
func ReadSuperblockCopies(dev device.Device) [2]SuperblockCopy {
	return ondisk.ReadSuperblockCopies(dev)
}

// CheckpointSlot describes one checkpoint slot's header, or one root slot
// of a set formatted with index pages.
type CheckpointSlot = ondisk.CheckpointSlot

// ReadCheckpointSlots decodes both checkpoint headers (not the bodies),
// or for a set formatted with index pages both roots.
func ReadCheckpointSlots(dev device.Device, sb *Superblock) [2]CheckpointSlot {
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		return pages.ReadSetRootSlots(dev, sb)
	}
	return ondisk.ReadCheckpointSlots(dev, sb)
}

// IndexPages describes the page area of a set formatted with index pages
// (ondisk.FeaturePagedIndex) as its newest valid root names it.
type IndexPages = pages.Summary

// ReadIndexPages reads the newest root of a set formatted with index pages
// and the inner pages of its trees (not the leaves) and counts what it
// names. nil, nil for a set without index pages.
func ReadIndexPages(dev device.Device, sb *Superblock) (*IndexPages, error) {
	if !sb.HasFeature(ondisk.FeaturePagedIndex) {
		return nil, nil
	}
	st, _, err := pages.Open(dev, pages.SetLayout(sb), 1)
	if err != nil {
		return nil, err
	}
	return st.Summary(), nil
}

// Image is a cache set rebuilt read-only from a cache device.
type Image struct {
	SB            *Superblock
	Copies        [2]SuperblockCopy
	Slots         [2]CheckpointSlot
	Generation    uint64 // checkpoint generation the index was loaded from
	JournalStart  int64  // journal block where replay started
	JournalEnd    int64  // block after the last replayed one
	JournalBlocks int64  // blocks replayed
	Records       int    // journal records replayed
	// Warnings: what recovery would pass over without failing (a
	// checkpoint slot skipped for an invalid header).
	Warnings []string
	// Pages: the page area, for a set formatted with index pages (nil
	// otherwise), as Open found it (VerifyPages reads every page).
	Pages *IndexPages
	s     *Set
	pg    *pagedIndex
}

// ImageOptions configure OpenImage.
type ImageOptions struct {
	// OnRecord, if set, sees every replayed journal record in order, as a
	// one-line description, before it is applied.
	OnRecord func(string)
}

// OpenImage reads the superblock, the newest checkpoint and the journal of
// dev and rebuilds the index in memory, without writing anything.
func OpenImage(dev device.Device, opts ImageOptions) (*Image, error) {
	im := &Image{Copies: ReadSuperblockCopies(dev)}
	sb, _, err := ondisk.ReadSuperblock(dev)
	if err != nil {
		return im, err
	}
	im.SB = sb
	im.Slots = ReadCheckpointSlots(dev, sb)
	s := newSet(dev, sb.Clone(), slog.New(slog.DiscardHandler))
	volBlocks := make([]uint64, len(sb.Backings))
	var vols []*Volume
	for i, bi := range sb.Backings {
		v := s.newVolume(i, bi, nil)
		volBlocks[i] = v.nblocks
		vols = append(vols, v)
	}
	s.setVols(vols)
	hdr, cd, pg, warn, err := readCheckpoint(dev, sb, volBlocks)
	if err != nil {
		return im, err
	}
	if pg != nil {
		im.pg, im.Pages = pg, pg.st.Summary()
	}
	im.Generation = hdr.Gen
	if warn != "" {
		im.Warnings = append(im.Warnings, warn)
	}
	im.JournalStart = hdr.JPos.Blk
	var onRec func(*ondisk.Rec)
	if opts.OnRecord != nil {
		onRec = func(r *ondisk.Rec) { opts.OnRecord(r.String()) }
	}
	// Open's recovery, keeping clean entries (as after a clean shutdown).
	c := newCollector(s, sb.NBuckets)
	jr := readJournal(dev, sb, hdr, c, onRec)
	im.Records = jr.n
	im.JournalEnd = jr.end.Blk
	im.JournalBlocks = int64(jr.end.Seq - hdr.JPos.Seq)
	if jr.err != nil {
		return im, fmt.Errorf("replaying journal: %w", jr.err)
	}
	if _, _, err := s.recoverIndex(sb.NBuckets, cd, c, cleanKeep, false); err != nil {
		return im, fmt.Errorf("replaying journal: %w", err)
	}
	s.dropUnkeptSupLocked()
	s.listBucketsLocked()
	im.s = s
	if err := s.checkLocked(); err != nil {
		return im, fmt.Errorf("recovered index inconsistent: %w", err)
	}
	return im, nil
}

// VerifyPages reads back every page the newest root names (a set with
// index pages; nothing to do otherwise) and verifies each: its checksum
// and its parent's pointer, kind, tree, order and key range, the trees'
// slot counts, the bucket table's shape (pages.Store.Verify). progress,
// if not nil, sees the pages verified and the total. A damaged page is a
// corruption error naming it (IsCorruption).
func (im *Image) VerifyPages(progress func(done, total int64)) error {
	if im.pg == nil {
		return nil
	}
	_, err := im.pg.st.Verify(progress)
	return err
}

// IndexEntry is one cached 4 KiB block.
type IndexEntry struct {
	Volume      string
	LBA         uint64 // block number on the backing device (offset / 4096)
	CacheBlock  uint32
	CacheOffset int64 // byte offset on the cache device
	Bucket      int64
	Generation  uint32 // the bucket's current generation
	CRC         uint32
	Dirty       bool
}

// VolumeSummary counts a volume's entries in the rebuilt index.
type VolumeSummary struct {
	Name          string
	Size          int64
	Mode          Mode
	CachedBlocks  int64
	DirtyBlocks   int64
	FlushEpoch    uint64
	DirtyIfServed int64 // = DirtyBlocks; clean entries are dropped by Open after a crash
}

// Volumes summarizes the rebuilt index per volume.
func (im *Image) Volumes() []VolumeSummary {
	if im.s == nil {
		return nil
	}
	var out []VolumeSummary
	for _, v := range im.s.vols {
		if v.free {
			continue
		}
		out = append(out, VolumeSummary{Name: v.name, Size: v.size, Mode: v.Mode(), CachedBlocks: v.idx.Cached,
			DirtyBlocks: v.idx.Dirty, FlushEpoch: v.idx.epoch, DirtyIfServed: v.idx.Dirty})
	}
	return out
}

// Index calls fn for every entry of the rebuilt index, volume by volume in
// LBA order, until fn returns false.
func (im *Image) Index(fn func(IndexEntry) bool) {
	if im.s == nil {
		return
	}
	s := im.s
	for _, v := range s.vols {
		cont := true
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			b := int64(e.Block()) / s.bpb
			cont = fn(IndexEntry{Volume: v.name, LBA: e.LBA, CacheBlock: e.Block(), CacheOffset: s.cacheOff(e.Block()),
				Bucket: b, Generation: s.mu.Buckets[b].Gen, CRC: e.CRC, Dirty: e.Dirty()})
			return cont
		})
		if !cont {
			return
		}
	}
}

// Cached reports whether every 4 KiB block of [off, off+n) is in the cache
// right now. It is a hint (the answer may change at once); the admin
// metrics use it to tell cache hits from misses in read latency.
func (v *Volume) Cached(off, n int64) bool {
	if n <= 0 || off < 0 || off+n > v.size {
		return false
	}
	first, count := blockSpan(off, n)
	s := v.s
	s.mu.Lock()
	defer s.mu.Unlock()
	got := 0
	v.idx.Tree.AscendRange(index.Ent{LBA: first}, index.Ent{LBA: first + uint64(count)}, func(index.Ent) bool {
		got++
		return true
	})
	return got == count
}
