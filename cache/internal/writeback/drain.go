package writeback

import (
	"context"
	"slices"
)

const (
	drainBatch = 65536 // blocks per batch of Drain (256 MiB of disk; 24 B each in memory)

	// DrainChecksumTries: Drain gives up on a dirty block version whose
	// cached copy has failed its checksum in this many passes in a row (a
	// read of the cache device may fail once; a corrupt block fails every
	// time).
	DrainChecksumTries = 3
)

// DrainFull is Drain's largest (and a whole-set drain's first) batch.
const DrainFull = drainBatch

// StuckError is Drain's error when a pass wrote nothing back, nothing was
// busy, and every version that failed its checksum in it has failed it
// DrainChecksumTries passes in a row.
type StuckError struct {
	Bad   []Version // the versions given up on
	Dirty int64     // dirty blocks left
}

func (e *StuckError) Error() string { return "writeback: dirty blocks fail their checksum" }

// Drain writes back every dirty block of ws and commits, in passes. A pass
// sweeps each volume's dirty blocks in LBA order in batches (the first of
// first blocks, doubling up to drainBatch: each batch ends with a backing
// sync), then commits; progress, if set, is called with the dirty blocks
// left after each batch. It returns:
//
//   - nil once no dirty block is left (each volume that left epoch order
//     returns to it: Volume.RestoreOrder);
//   - the error of a backing write, a commit, the set or ctx;
//   - a *StuckError when a pass wrote nothing back, nothing was busy, and
//     every version that failed its checksum in it has failed it
//     DrainChecksumTries passes in a row.
//
// A pass that wrote nothing while blocks were busy (in a batch of the loop
// or of eviction, or claimed by a passthrough write) waits for a claim to
// be released before the next pass; a pass that wrote something, or whose
// failing versions have not yet failed often enough, is followed by the
// next at once. Under a constant stream of new dirty writes it may not
// finish.
func Drain(ctx context.Context, set Set, ws []*Writer, first int, progress func(dirtyBlocks int64)) error {
	dirtyLeft := func() int64 {
		left := int64(0)
		for _, w := range ws {
			left += w.c.Dirty()
		}
		if progress != nil {
			progress(left)
		}
		return left
	}
	dirtyLeft()
	fails := map[Version]int{} // versions failing their checksum: passes in a row
	batch := first
	for {
		written := 0
		var bad []Version
		for wi, w := range ws {
			from := uint64(0)
			for end := false; !end; {
				if err := ctx.Err(); err != nil {
					return err
				}
				if err := set.Err(); err != nil {
					return err
				}
				var lbas []uint64
				for len(lbas) < batch && !end {
					got, next, done := w.c.ScanDirty(from, batch-len(lbas), drainVisit)
					lbas, from, end = append(lbas, got...), next, done
				}
				if len(lbas) > 0 {
					var rep report
					n, err := w.blocks(lbas, &rep, nil)
					for _, it := range rep.corrupt {
						bad = append(bad, Version{wi, it.LBA, it.Loc, it.CRC})
					}
					if err != nil {
						return err
					}
					written += n
					dirtyLeft()
				}
				batch = min(2*batch, drainBatch)
			}
		}
		if err := set.Commit(); err != nil {
			return err
		}
		left := dirtyLeft()
		if left == 0 {
			for _, w := range ws {
				w.c.RestoreOrder()
			}
			return nil
		}
		for _, x := range bad {
			fails[x]++
		}
		for x := range fails {
			if !ws[x.Vol].c.HasVersion(x.LBA, x.Loc, x.CRC) {
				delete(fails, x) // overwritten or dropped since
			}
		}
		if written > 0 {
			continue
		}
		var released <-chan struct{}
		busy := false
		for _, w := range ws {
			ch, b := w.c.Released()
			if released == nil {
				released = ch
			}
			busy = busy || b
		}
		if !busy {
			if len(bad) > 0 && !slices.ContainsFunc(bad, func(x Version) bool { return fails[x] < DrainChecksumTries }) {
				return &StuckError{Bad: bad, Dirty: left}
			}
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-released:
		}
	}
}
