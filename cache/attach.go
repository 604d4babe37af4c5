package cache

// Attach and detach: the set's volume list changes while it serves. The
// protocol and its crash atomicity (one write of the superblock's older
// copy) are described once, in docs/CACHE.md, "Attach and detach (volume
// slots)".

import (
	"context"
	"fmt"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/internal/invariants"
)

// DirtyBlocks returns the volume's dirty block count.
func (v *Volume) DirtyBlocks() int64 {
	v.s.mu.Lock()
	defer v.s.mu.Unlock()
	return v.idx.Dirty
}

// drainFirstBatch is DrainDirty's first batch (blocks; 4 MiB): the first
// progress report, and a cancellation, come soon.
const drainFirstBatch = 1024

// DrainDirty writes every dirty block of the volume back to its backing
// device and commits (Set.drain). progress, if set, is called after each
// batch with the dirty blocks left. It returns when none is left, or with
// an error when some dirty data cannot be written back (a failing device,
// or an *UnwritableError for blocks failing their checksum), or when ctx
// ends. Under a constant stream of new writes in writeback mode it may not
// finish; switch the mode first to be sure it does.
func (v *Volume) DrainDirty(ctx context.Context, progress func(dirtyBlocks int64)) error {
	if err := v.s.drain(ctx, []*Volume{v}, drainFirstBatch, progress); err != nil {
		return fmt.Errorf("flushing %s: %w", v.name, err)
	}
	return nil
}

// DetachOptions configure Volume.Detach.
type DetachOptions struct {
	// Progress, if set, is called with the dirty blocks left while the
	// volume's dirty data is written back.
	Progress func(dirtyBlocks int64)
	// BeforeRemove, if set, runs when the volume holds nothing in the cache
	// (committed) and before the superblock drops it. An error aborts the
	// detach: the volume stays in the set, in mode none, open to I/O again.
	BeforeRemove func() error
}

// Detach removes the volume from the set and leaves its backing device
// complete: mode none (persisted), dirty data written back and synced, the
// volume closed to I/O (calls in flight finish first; later ones fail with
// ErrDetached), every cached block dropped and committed, its writeback
// goroutine stopped, its slot freed in the superblock, and then the buckets
// left empty freed (freeEmptyBuckets). Callers stop sending I/O first
// (remove the NBD export and end its connections). On an error before the
// slot is freed the volume stays in the set, in mode none, and serves I/O
// again.
func (v *Volume) Detach(ctx context.Context, opts DetachOptions) error {
	if v.free {
		return fmt.Errorf("detach: %w", ErrDetached)
	}
	if !v.detaching.CompareAndSwap(false, true) {
		return fmt.Errorf("detach %s: %w: a detach is already running", v.name, ErrInvalid)
	}
	defer v.detaching.Store(false)
	if err := v.SetMode(None); err != nil {
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	// Write back while clients may still write (passthrough now), then
	// again after closing the gate, when nothing new can become dirty.
	if err := v.DrainDirty(ctx, opts.Progress); err != nil {
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	v.gate.Lock()
	v.gone = true
	v.gate.Unlock()
	reopen := func() {
		v.gate.Lock()
		v.gone = false
		v.gate.Unlock()
	}
	if err := v.DrainDirty(ctx, opts.Progress); err != nil {
		reopen()
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	s := v.s
	v.rmw.Lock()
	s.mu.Lock()
	if v.idx.Dirty != 0 || v.idx.NSup != 0 {
		n := v.idx.Dirty + v.idx.NSup
		s.mu.Unlock()
		v.rmw.Unlock()
		reopen()
		return fmt.Errorf("detach %s: %d dirty blocks left after writeback", v.name, n)
	}
	s.mu.Invalidate(v.vi, 0, v.nblocks)
	s.appendLocked(&ondisk.Rec{Type: ondisk.RecInvalidate, Vol: uint16(v.vi), LBA: 0, N: v.nblocks})
	v.idx.mutations++
	target := s.mu.seq
	s.mu.Unlock()
	v.rmw.Unlock()
	if err := s.commit(target); err != nil {
		reopen()
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	if err := v.back.Sync(); err != nil {
		reopen()
		return fmt.Errorf("detach %s: syncing backing device: %w", v.name, err)
	}
	if opts.BeforeRemove != nil {
		if err := opts.BeforeRemove(); err != nil {
			reopen()
			return fmt.Errorf("detach %s: %w", v.name, err)
		}
	}
	if err := s.removeVolume(v); err != nil {
		reopen()
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	// The buckets only v filled are empty now: free them at once rather
	// than when GC runs short, so that the cache reports them free.
	if _, err := s.freeEmptyBuckets(); err != nil {
		s.log.Warn("freeing the buckets of a detached volume", "volume", v.name, "err", err)
	}
	return nil
}

// removeVolume frees v's slot: writeback goroutine stopped, placeholder in
// the slot list, checkpoint, superblock. v is empty and closed to I/O.
func (s *Set) removeVolume(v *Volume) error {
	s.volMu.Lock()
	defer s.volMu.Unlock()
	v.wb.Stop()
	restart := func() {
		v.wb.Restart()
		s.mu.Lock()
		s.startWritebackLocked(v)
		s.mu.Unlock()
	}
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.sbMu.Lock() // held to the end: no other superblock update in between
	defer s.sbMu.Unlock()
	s.mu.Lock()
	if v.idx.Cached != 0 || v.idx.Dirty != 0 || v.idx.NSup != 0 {
		n := v.idx.Cached + v.idx.NSup
		s.mu.Unlock()
		restart()
		return fmt.Errorf("%d blocks still cached", n)
	}
	if invariants.Enabled && (v.idx.Tree.Len() != 0 || v.idx.Sup.Len() != 0 || len(v.idx.wbInflight) != 0) {
		invariants.AssertionFailedf("detach: slot %d still indexes %d entries, %d superseded, %d versions, %d in writeback",
			v.vi, v.idx.Tree.Len(), v.idx.Sup.Len(), len(v.idx.wbInflight))
	}
	old := s.vols
	vols := slices.Clone(s.vols) // never shorter: see Set.vols
	vols[v.vi] = s.newVolume(v.vi, BackingInfo{}, nil)
	s.setVols(vols)
	s.mu.Unlock()
	// The checkpoint starts a journal generation with no record of the
	// slot; the journal before it is never replayed again.
	if err := s.checkpointLocked(0); err != nil {
		// The set has failed (sticky); the superblock still lists v.
		s.mu.Lock()
		s.setVols(old)
		s.mu.Unlock()
		return err
	}
	err := s.updateSuperblockLocked(func(nsb *Superblock) error {
		nsb.Backings[v.vi] = BackingInfo{}
		for len(nsb.Backings) > 0 && nsb.Backings[len(nsb.Backings)-1].Free() {
			nsb.Backings = nsb.Backings[:len(nsb.Backings)-1]
		}
		return nil
	})
	if err != nil {
		s.mu.Lock()
		s.setVols(old)
		s.mu.Unlock()
		restart()
		return err
	}
	s.log.Info("volume detached", "volume", v.name, "slot", v.vi)
	return nil
}

// startWritebackLocked starts v's writeback goroutine, unless the set is
// closed (Close waits for no goroutine started after it).
// REQUIRES: s.mu
func (s *Set) startWritebackLocked(v *Volume) {
	if !s.mu.closed {
		s.runWriteback(v)
	}
}

// AttachOptions configure Set.Attach.
type AttachOptions struct {
	Mode Mode // the new volume's cache mode (zero value: Writeback)
}

// Attach adds a backing device to the open set as a new volume, while the
// other volumes keep serving. Only the cache device is written (the
// superblock); the backing device is only measured. A name or an ID
// already in the set is refused with ErrExists.
func (s *Set) Attach(spec BackingSpec, opts AttachOptions) (*Volume, error) {
	if spec.Dev == nil || spec.Name == "" || len(spec.Name) > ondisk.MaxNameLen || len(spec.ID) > ondisk.MaxNameLen || len(spec.Path) > ondisk.MaxPathLen {
		return nil, fmt.Errorf("attach %q: %w: want a name of 1..%d bytes, an id of at most %d, a path of at most %d, and a device",
			spec.Name, ErrInvalid, ondisk.MaxNameLen, ondisk.MaxNameLen, ondisk.MaxPathLen)
	}
	if !opts.Mode.Valid() {
		return nil, fmt.Errorf("attach %s: %w: mode %d", spec.Name, ErrInvalid, int(opts.Mode))
	}
	size := spec.Dev.Size()
	if size <= 0 || (size+blockSize-1)/blockSize >= ondisk.MaxLBABlocks {
		return nil, fmt.Errorf("attach %s: %w: device size %d", spec.Name, ErrInvalid, size)
	}
	s.volMu.Lock()
	defer s.volMu.Unlock()
	if err := s.err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	closed := s.mu.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.sbMu.Lock()
	defer s.sbMu.Unlock()
	slot := len(s.sb.Backings)
	for i, b := range s.sb.Backings {
		switch {
		case b.Free():
			slot = min(slot, i)
		case b.Name == spec.Name:
			return nil, fmt.Errorf("attach %s: %w: a volume of that name exists", spec.Name, ErrExists)
		case b.ID != "" && b.ID == spec.ID:
			return nil, fmt.Errorf("attach %s: %w: the device (id %s) is attached as %q", spec.Name, ErrExists, spec.ID, b.Name)
		}
	}
	if slot >= ondisk.MaxBackings {
		return nil, fmt.Errorf("attach %s: %w: the set has %d backing devices, at most %d", spec.Name, ErrInvalid, slot, ondisk.MaxBackings)
	}
	nslots := max(len(s.sb.Backings), slot+1)
	s.mu.Lock()
	nvols := max(len(s.vols), nslots) // the checkpoint writes every in-memory slot
	s.mu.Unlock()
	if s.lay.HasFeature(ondisk.FeaturePagedIndex) && nvols > pages.MaxVolumes {
		return nil, fmt.Errorf("attach %s: %w: a set with index pages holds at most %d backing devices", spec.Name, ErrInvalid, pages.MaxVolumes)
	}
	if need := ondisk.CkptSlotLen(s.lay.NBuckets, s.bpb, nvols); need > s.lay.CkptLen {
		return nil, fmt.Errorf("attach %s: %w: the checkpoint slots of this set (%d bytes) cannot hold %d backing devices (%d bytes); format a new set",
			spec.Name, ErrInvalid, s.lay.CkptLen, nslots, need)
	}
	st := DefaultSettings()
	st.Mode = opts.Mode
	bi := BackingInfo{Name: spec.Name, ID: spec.ID, Path: spec.Path, Size: size, Settings: st}
	err := s.updateSuperblockLocked(func(nsb *Superblock) error {
		if slot < len(nsb.Backings) {
			nsb.Backings[slot] = bi
		} else {
			nsb.Backings = append(nsb.Backings, bi)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", spec.Name, err)
	}
	v := s.newVolume(slot, bi, spec.Dev)
	s.mu.Lock()
	vols := make([]*Volume, max(len(s.vols), nslots))
	copy(vols, s.vols)
	vols[slot] = v
	s.setVols(vols)
	s.startWritebackLocked(v)
	s.mu.Unlock()
	s.log.Info("volume attached", "volume", v.name, "slot", slot, "size", size, "mode", opts.Mode.String())
	return v, nil
}
