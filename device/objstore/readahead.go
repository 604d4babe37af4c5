package objstore

import (
	"sync"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// Readahead for a sequential reader: once a read of a segment's blocks
// starts where the previous one ended, the next readaheadBytes of the same
// segment are fetched in the background, so that the reader's next miss
// finds them in memory instead of waiting for a GET. Segments are
// immutable (a name is never reused), so data fetched ahead is keyed by
// segment and block and can never be stale: a block rewritten since is
// found elsewhere by the map, and each block is still checked against the
// map's CRC when it is used.
const readaheadBytes = 4 << 20

// raRange is one range of a segment fetched ahead.
type raRange struct {
	ref      layout.SegRef
	from, to int64 // data blocks [from, to)
	done     chan struct{}
	data     []byte // set before done is closed; nil on error
}

// readahead holds at most two ranges: the one the reader is in and the
// next.
type readahead struct {
	mu      sync.Mutex
	ranges  []*raRange
	lastRef layout.SegRef
	lastEnd int64 // block after the last read's run, in lastRef
}

// take returns the blocks [from, from+n) of segment ref if fetched ahead
// (waiting for a fetch in flight), and starts the next fetch when the
// reader is sequential and would soon run out.
func (d *Device) take(si segInfo, from, n int64) []byte {
	ra := &d.ra
	ra.mu.Lock()
	seq := ra.lastRef == si.ref && ra.lastEnd == from
	ra.lastRef, ra.lastEnd = si.ref, from+n
	var hit *raRange
	end := from + n // coverage reached by ranges in order
	for _, r := range ra.ranges {
		if r.ref == si.ref && r.from <= from && from+n <= r.to {
			hit = r
		}
		if r.ref == si.ref && r.from <= end && r.to > end {
			end = r.to
		}
	}
	ahead := max(readaheadBytes/d.bs, 2*n)
	if seq && end < si.blocks && end-(from+n) < ahead/2 {
		r := &raRange{ref: si.ref, from: end, to: min(end+ahead, si.blocks), done: make(chan struct{})}
		keep := ra.ranges[:0]
		for _, o := range ra.ranges {
			if o.ref == si.ref && o.to > from {
				keep = append(keep, o)
			}
		}
		ra.ranges = append(keep, r)
		if len(ra.ranges) > 2 {
			ra.ranges = ra.ranges[len(ra.ranges)-2:]
		}
		go d.fetchAhead(si, r)
	}
	ra.mu.Unlock()
	if hit == nil {
		return nil
	}
	<-hit.done
	if hit.data == nil {
		return nil
	}
	return hit.data[(from-hit.from)*d.bs : (from-hit.from+n)*d.bs]
}

func (d *Device) fetchAhead(si segInfo, r *raRange) {
	defer close(r.done)
	p, err := d.s.get(layout.SegName(si.ref.Seq, si.ref.Gen), si.hlen+r.from*d.bs, (r.to-r.from)*d.bs)
	d.statsMu.Lock()
	d.stats.Gets++
	d.stats.BytesGot += int64(len(p))
	d.statsMu.Unlock()
	if err == nil {
		r.data = p
	}
}
