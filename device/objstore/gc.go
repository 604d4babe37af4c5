package objstore

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// GCResult says what one garbage-collection round did.
type GCResult struct {
	Rewritten    int64 // live blocks copied to a new segment
	Deleted      int   // segments deleted
	DeletedBytes int64
	StoredBytes  int64 // segment bytes after the round
	LiveBytes    int64 // bytes the map refers to
}

// GC runs one garbage-collection round now (see Options.GCThreshold):
// the live blocks of segments less than threshold live are rewritten as a
// segment of their own, a checkpoint is stored, and every segment no
// block refers to and the checkpoint covers is deleted.
func (d *Device) GC(threshold float64, maxBytes int64) (GCResult, error) {
	d.syncMu.Lock()
	defer d.syncMu.Unlock()
	return d.gcLocked(threshold, maxBytes)
}

// gcLocked is GC. The rewritten blocks carry the content the map already
// gives them (writes not yet stored stay in memory and are not touched),
// so the segment is an epoch of its own that changes nothing a recovery
// sees: invariant 1 holds between its steps. Segments are deleted only
// at or before the checkpoint the head names, which does not refer to
// them, so no recovery needs them. REQUIRES d.syncMu.
func (d *Device) gcLocked(threshold float64, maxBytes int64) (GCResult, error) {
	var res GCResult
	d.mu.Lock()
	switch {
	case d.mu.closed:
		d.mu.Unlock()
		return res, ErrClosedGC
	case d.opts.ReadOnly:
		d.mu.Unlock()
		return res, errors.New("objstore: garbage collection of a read-only image")
	case d.mu.fenced != nil:
		err := d.mu.fenced
		d.mu.Unlock()
		return res, err
	case d.parts > 0:
		// An epoch is half stored: a final segment now would end it.
		d.mu.Unlock()
		return res, nil
	}
	st := d.mu.st
	victims := map[uint32]bool{}
	budget := maxBytes / d.bs
	for i := range st.segs {
		si := &st.segs[i]
		if si.deleted || si.live == 0 || si.ref.Seq >= st.lastSeq {
			continue
		}
		if float64(si.live) < threshold*float64(si.blocks) && si.live <= budget {
			victims[uint32(i)] = true
			budget -= si.live
		}
	}
	moving := map[uint64]loc{}
	for lba, l := range st.index {
		if victims[l.seg] {
			moving[lba] = l
		}
	}
	d.mu.Unlock()

	if len(moving) > 0 {
		lbas := make([]uint64, 0, len(moving))
		for lba := range moving {
			lbas = append(lbas, lba)
		}
		sortU64(lbas)
		blocks := make(map[uint64]*blk, len(lbas))
		for _, lba := range lbas {
			l := moving[lba]
			d.mu.Lock()
			si := d.mu.st.segs[l.seg]
			d.mu.Unlock()
			p, err := d.fetch(si, []loc{l})
			if err != nil {
				return res, fmt.Errorf("garbage collection: %w", err)
			}
			blocks[lba] = &blk{data: p}
		}
		before := d.Stats()
		if err := d.storeParts(lbas, blocks, true); err != nil {
			return res, fmt.Errorf("garbage collection: %w", err)
		}
		d.epoch++
		if err := d.checkOwner(); err != nil {
			return res, err
		}
		d.statsMu.Lock()
		d.stats.GCBlocks += int64(len(lbas))
		// Counted as garbage collection, not as writeback.
		d.stats.GCBytesPut += d.stats.BytesPut - before.BytesPut
		d.stats.SegmentsPut, d.stats.BytesPut, d.stats.BlocksWritten = before.SegmentsPut, before.BytesPut, before.BlocksWritten
		d.statsMu.Unlock()
		res.Rewritten = int64(len(lbas))
	}
	if !d.ckptFresh {
		// Only a checkpoint of the map as it is now is sure not to refer
		// to a segment that has no live block now.
		if err := d.writeCheckpoint(); err != nil {
			return res, err
		}
	}
	ck := d.head.Checkpoint
	d.mu.Lock()
	var dead []int
	for i := range d.mu.st.segs {
		si := &d.mu.st.segs[i]
		if !si.deleted && si.live == 0 && ck != nil && si.ref.Seq <= ck.Seq {
			si.deleted = true
			dead = append(dead, i)
		}
	}
	segs := d.mu.st.segs
	d.mu.Unlock()
	for _, i := range dead {
		if err := d.s.remove(layout.SegName(segs[i].ref.Seq, segs[i].ref.Gen)); err != nil {
			return res, err
		}
		res.Deleted++
		res.DeletedBytes += segs[i].size
	}
	n, b, err := d.removeOrphans()
	res.Deleted += n
	res.DeletedBytes += b
	if err != nil {
		return res, err
	}
	d.mu.Lock()
	for _, si := range d.mu.st.segs {
		if !si.deleted {
			res.StoredBytes += si.size
		}
	}
	res.LiveBytes = int64(len(d.mu.st.index)) * d.bs
	d.mu.Unlock()
	d.statsMu.Lock()
	d.stats.GCRuns++
	d.stats.GCDeleted += int64(res.Deleted)
	d.stats.GCDeletedByte += res.DeletedBytes
	d.statsMu.Unlock()
	return res, nil
}

// removeOrphans deletes the objects that can never count: segments of an
// older generation that the map does not know (written by an owner after
// it was fenced, parts of an epoch it never finished, or segments before
// the checkpoint that it does not refer to), and checkpoints other than
// the head's. Every segment recovery can reach is in the map's table: the
// checkpoint's, and those replayed or written after it. Objects of newer
// generations are left alone (a newer owner's, if this device is being
// fenced now). REQUIRES d.syncMu.
func (d *Device) removeOrphans() (n int, bytes int64, err error) {
	objs, err := d.s.list(layout.SegDir)
	if err != nil {
		return 0, 0, err
	}
	known := map[layout.SegRef]bool{}
	d.mu.Lock()
	for _, si := range d.mu.st.segs {
		if !si.deleted {
			known[si.ref] = true
		}
	}
	d.mu.Unlock()
	for _, o := range objs {
		seq, gen, perr := layout.ParseSeqGen(o.Name[len(layout.SegDir):])
		if perr != nil || gen >= d.gen || known[layout.SegRef{Seq: seq, Gen: gen}] {
			continue
		}
		if err := d.s.remove(o.Name); err != nil {
			return n, bytes, err
		}
		n++
		bytes += o.Size
	}
	cks, err := d.s.list(layout.CkptDir)
	if err != nil {
		return n, bytes, err
	}
	for _, o := range cks {
		seq, gen, perr := layout.ParseSeqGen(o.Name[len(layout.CkptDir):])
		if perr != nil || gen > d.gen {
			continue
		}
		if c := d.head.Checkpoint; c != nil && c.Seq == seq && c.Gen == gen {
			continue
		}
		if err := d.s.remove(o.Name); err != nil {
			return n, bytes, err
		}
	}
	return n, bytes, nil
}

// ErrClosedGC is returned by GC on a closed device.
var ErrClosedGC = errors.New("objstore: garbage collection of a closed device")
