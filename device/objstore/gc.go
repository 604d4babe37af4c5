package objstore

import (
	"errors"
	"fmt"
	"sort"
	"time"

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

// GC runs one garbage-collection round now, at full speed (see
// Options.GCThreshold): the live blocks of segments less than threshold
// live are rewritten as a segment of their own, a checkpoint is stored,
// and every segment no block refers to and the checkpoint covers is
// deleted.
func (d *Device) GC(threshold float64, maxBytes int64) (GCResult, error) {
	res, _, err := d.gcRound(threshold, maxBytes, -1, nil)
	return res, err
}

// errGCStopped: the device was closed during a round.
var errGCStopped = errors.New("objstore: garbage collection stopped by Close")

// gcLoop is the owner's background garbage collection: a round after
// each checkpoint (kicked by flush), more rounds while victims remain,
// reading and rewriting at most Options.GCRate bytes per second.
func (d *Device) gcLoop() {
	defer close(d.gcDone)
	for {
		select {
		case <-d.gcStop:
			return
		case <-d.gcKick:
		}
		for {
			_, more, err := d.gcRound(d.opts.GCThreshold, d.opts.GCBytes, d.opts.GCRate, d.gcStop)
			if err != nil {
				if !errors.Is(err, errGCStopped) && !errors.Is(err, ErrClosedGC) {
					d.opts.Log.Warn("object-store garbage collection failed", "image", d.loc.Name(), "err", err)
				}
				break
			}
			if !more {
				break
			}
		}
	}
}

// kickGC asks the background loop for a round (it coalesces requests).
func (d *Device) kickGC() {
	if d.gcKick == nil {
		return
	}
	select {
	case d.gcKick <- struct{}{}:
	default:
	}
}

// pace waits until n bytes have taken at least n/rate seconds since
// start (rate < 0: no wait), or stop is closed.
func pace(start time.Time, n, rate int64, stop <-chan struct{}) error {
	if rate <= 0 {
		return nil
	}
	wait := time.Until(start.Add(time.Duration(float64(n) / float64(rate) * float64(time.Second))))
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-stop:
		return errGCStopped
	case <-t.C:
		return nil
	}
}

// gcRound is one round of GC; more reports that segments under the
// threshold were left for another round (maxBytes was reached).
//
// The victims' live blocks are read without holding syncMu, so Syncs go
// on meanwhile, at rate bytes per second (< 0: unbounded). Then, under
// syncMu, the blocks whose map entry is still the one read (not
// overwritten by a segment stored meanwhile) are rewritten. They carry
// the content the map already gives them (writes not yet stored stay in
// memory and are not touched), so the segment is an epoch of its own
// that changes nothing a recovery sees: invariant 1 holds between its
// steps. Segments are deleted only at or before the checkpoint the head
// names, which does not refer to them, so no recovery needs them.
func (d *Device) gcRound(threshold float64, maxBytes, rate int64, stop <-chan struct{}) (res GCResult, more bool, err error) {
	type run struct {
		si  segInfo
		ls  []loc
		lba []uint64
	}
	d.mu.Lock()
	switch {
	case d.mu.closed:
		d.mu.Unlock()
		return res, false, ErrClosedGC
	case d.opts.ReadOnly:
		d.mu.Unlock()
		return res, false, errors.New("objstore: garbage collection of a read-only image")
	case d.mu.fenced != nil:
		err := d.mu.fenced
		d.mu.Unlock()
		return res, false, err
	}
	st := d.mu.st
	victims := map[uint32]bool{}
	budget := maxBytes / d.bs
	for i := range st.segs {
		si := &st.segs[i]
		if si.deleted || si.live == 0 || si.ref.Seq >= st.lastSeq {
			continue
		}
		if float64(si.live) < threshold*float64(si.blocks) {
			if si.live > budget {
				more = true
				continue
			}
			victims[uint32(i)] = true
			budget -= si.live
		}
	}
	bySeg := map[uint32][]uint64{}
	for lba, l := range st.index {
		if victims[l.seg] {
			bySeg[l.seg] = append(bySeg[l.seg], lba)
		}
	}
	// One ranged GET per run of consecutive blocks of a segment.
	var runs []run
	moving := map[uint64]loc{}
	for seg, lbas := range bySeg {
		sort.Slice(lbas, func(i, j int) bool { return st.index[lbas[i]].off < st.index[lbas[j]].off })
		for _, lba := range lbas {
			l := st.index[lba]
			moving[lba] = l
			if n := len(runs); n > 0 && runs[n-1].si.ref == st.segs[seg].ref && runs[n-1].ls[len(runs[n-1].ls)-1].off+1 == l.off {
				runs[n-1].ls = append(runs[n-1].ls, l)
				runs[n-1].lba = append(runs[n-1].lba, lba)
				continue
			}
			runs = append(runs, run{si: st.segs[seg], ls: []loc{l}, lba: []uint64{lba}})
		}
	}
	d.mu.Unlock()

	blocks := make(map[uint64]*blk, len(moving))
	start, read := time.Now(), int64(0)
	for _, r := range runs {
		p, err := d.fetch(r.si, r.ls, false)
		if err != nil {
			return res, false, fmt.Errorf("garbage collection: %w", err)
		}
		for i, lba := range r.lba {
			blocks[lba] = &blk{data: p[int64(i)*d.bs : int64(i+1)*d.bs]}
		}
		read += int64(len(p))
		if err := pace(start, read, rate, stop); err != nil {
			return res, false, err
		}
	}

	d.syncMu.Lock()
	defer d.syncMu.Unlock()
	d.mu.Lock()
	switch {
	case d.mu.closed:
		d.mu.Unlock()
		return res, false, ErrClosedGC
	case d.mu.fenced != nil:
		err := d.mu.fenced
		d.mu.Unlock()
		return res, false, err
	case d.parts > 0:
		// An epoch is half stored: a final segment now would end it.
		d.mu.Unlock()
		return res, true, nil
	}
	lbas := make([]uint64, 0, len(moving))
	for lba, l := range moving {
		if cur, ok := d.mu.st.index[lba]; ok && cur == l {
			lbas = append(lbas, lba)
		}
	}
	d.mu.Unlock()

	if len(lbas) > 0 {
		sortU64(lbas)
		before := d.Stats()
		if err := d.storeParts(lbas, blocks, true); err != nil {
			return res, false, fmt.Errorf("garbage collection: %w", err)
		}
		d.epoch++
		if err := d.checkOwner(); err != nil {
			return res, false, err
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
			return res, false, err
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
			return res, false, err
		}
		res.Deleted++
		res.DeletedBytes += segs[i].size
	}
	n, b, err := d.removeOrphans()
	res.Deleted += n
	res.DeletedBytes += b
	if err != nil {
		return res, false, err
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
	return res, more, nil
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
