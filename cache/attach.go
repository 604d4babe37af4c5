package cache

// Per-volume drain and detach, for `tiercache flush EXPORT` and
// `tiercache detach EXPORT` on a running server.
//
// Detach leaves the backing device complete and stops caching it without
// rewriting the set's layout: the volume is switched to mode none
// (persisted in the superblock), its dirty data is written back and synced,
// every cached block of it is invalidated and the invalidation is
// committed. The volume then holds nothing in the cache, so the backing
// device is a complete image that can be used alone; if the set is served
// again the volume is served uncached (mode none) and can be re-enabled
// with `tiercache set EXPORT cache_mode=...`. Removing the backing device
// from the superblock altogether (and adding one to a live set: attach)
// needs the set to renumber its volumes and is left to the engine.

import (
	"context"
	"fmt"
	"time"
)

// DirtyBlocks returns the volume's dirty block count.
func (v *Volume) DirtyBlocks() int64 {
	v.s.mu.Lock()
	defer v.s.mu.Unlock()
	return v.idx.dirty
}

// DrainDirty writes every dirty block of the volume back to its backing
// device and commits. progress, if set, is called after each batch with
// the dirty blocks left. It returns when none is left, or with an error
// when some dirty data cannot be written back (failing checksum or device),
// or when ctx ends. Under a constant stream of new writes in writeback mode
// it may not finish; switch the mode first to be sure it does.
func (v *Volume) DrainDirty(ctx context.Context, progress func(dirtyBlocks int64)) error {
	s := v.s
	report := func() int64 {
		left := v.DirtyBlocks()
		if progress != nil {
			progress(left)
		}
		return left
	}
	report()
	stuck := 0
	for {
		written, failedBefore := 0, v.st.checksumErrors.Load()
		from := uint64(0)
		for {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := s.err(); err != nil {
				return err
			}
			s.mu.Lock()
			lbas := s.dirtyLBAsLocked(v.vi, from, 1024)
			s.mu.Unlock()
			if len(lbas) == 0 {
				break
			}
			n, err := s.writeback(v.vi, lbas)
			if err != nil {
				return fmt.Errorf("flushing %s: %w", v.name, err)
			}
			written += n
			from = lbas[len(lbas)-1] + 1
			report()
		}
		s.mu.Lock()
		target := s.mu.seq
		s.mu.Unlock()
		if err := s.commit(target); err != nil {
			return fmt.Errorf("flushing %s: %w", v.name, err)
		}
		left := report()
		if left == 0 {
			return nil
		}
		if written > 0 {
			stuck = 0
			continue
		}
		if v.st.checksumErrors.Load() > failedBefore {
			stuck++
		}
		if stuck >= 3 {
			return fmt.Errorf("flushing %s: %d dirty blocks cannot be written back: %w", v.name, left, ErrChecksum)
		}
		// Blocks busy with a passthrough write are released quickly.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Detach stops caching the volume and leaves its backing device complete:
// mode none (persisted), dirty data written back and synced, every cached
// block dropped and the drop committed. Callers stop new I/O to the volume
// first (remove the NBD export); I/O still arriving is passed through.
func (v *Volume) Detach(ctx context.Context, progress func(dirtyBlocks int64)) error {
	if err := v.SetMode(None); err != nil {
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	if err := v.DrainDirty(ctx, progress); err != nil {
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	s := v.s
	v.rmw.Lock()
	s.mu.Lock()
	if v.idx.dirty != 0 {
		n := v.idx.dirty
		s.mu.Unlock()
		v.rmw.Unlock()
		return fmt.Errorf("detach %s: %d blocks became dirty during detach", v.name, n)
	}
	s.invalidateLocked(v.vi, 0, v.nblocks)
	s.appendLocked(&rec{typ: recInvalidate, vol: uint16(v.vi), lba: 0, n: v.nblocks})
	v.idx.mutations++
	target := s.mu.seq
	s.mu.Unlock()
	v.rmw.Unlock()
	if err := s.commit(target); err != nil {
		return fmt.Errorf("detach %s: %w", v.name, err)
	}
	if err := v.back.Sync(); err != nil {
		return fmt.Errorf("detach %s: syncing backing device: %w", v.name, err)
	}
	return nil
}
