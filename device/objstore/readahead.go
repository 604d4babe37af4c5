package objstore

import (
	"sync"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// Readahead for a sequential reader: once a read of a segment's blocks
// starts where the previous one ended, the next readaheadBytes of the same
// segment are fetched in the background, so that the reader's next miss
// finds them in memory instead of waiting for a GET; and once a client
// read continues the previous one within half of readaheadBytes of its
// segment's end, the start of the segment holding the image's next blocks
// is fetched too (aheadTarget, aheadNext). Segments are
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
	// next: the start of the segment a sequential reader goes on to
	// (aheadNext), fetched before the reader leaves its segment.
	next bool
}

// readahead holds at most three ranges: the one the reader is in, the
// next, and the start of the segment after it.
type readahead struct {
	mu      sync.Mutex
	ranges  []*raRange
	lastRef layout.SegRef
	lastEnd int64  // block after the last read's run, in lastRef
	lastLBA uint64 // block after the last client read (aheadTarget)
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
		ra.add(si, r, from)
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

// add keeps r and the ranges still ahead of a reader at block from of
// si: si's beyond from, and another segment's start (next), the most
// recent three. REQUIRES ra.mu.
func (ra *readahead) add(si segInfo, r *raRange, from int64) {
	keep := ra.ranges[:0]
	for _, o := range ra.ranges {
		if o.ref == si.ref && o.to > from || o.ref != si.ref && o.next {
			keep = append(keep, o)
		}
	}
	ra.ranges = append(keep, r)
	if len(ra.ranges) > 3 {
		ra.ranges = ra.ranges[len(ra.ranges)-3:]
	}
}

// aheadNext starts fetching blocks [from, from+readaheadBytes) of segment
// next, unless a range of it already covers from: a sequential reader
// (aheadTarget) nears the end of its segment, and the image's next blocks
// start there.
func (d *Device) aheadNext(next segInfo, from int64) {
	ra := &d.ra
	ra.mu.Lock()
	defer ra.mu.Unlock()
	for _, r := range ra.ranges {
		if r.ref == next.ref && r.from <= from && from < r.to {
			return
		}
	}
	r := &raRange{ref: next.ref, from: from, to: min(from+readaheadBytes/d.bs, next.blocks), done: make(chan struct{}), next: true}
	if r.to <= r.from {
		return
	}
	// Beside the reader's own ranges (at most two).
	ra.ranges = append(ra.ranges, r)
	if len(ra.ranges) > 3 {
		ra.ranges = ra.ranges[len(ra.ranges)-3:]
	}
	go d.fetchAhead(next, r)
}

// aheadTarget is for a client read of blocks [first, end) whose last run
// lies in segment si up to data block last: once the read continues the
// previous one (lastLBA) and fewer than half of readaheadBytes of si are
// left after it, and the image's blocks after si's last are that many
// LBAs on and begin another segment, it returns that segment and the
// data block they start at. REQUIRES d.mu.
func (d *Device) aheadTarget(first, end uint64, si segInfo, last int64) (segInfo, int64, bool) {
	ra := &d.ra
	ra.mu.Lock()
	seq := ra.lastLBA == first
	ra.lastLBA = end
	ra.mu.Unlock()
	left := si.blocks - 1 - last
	if !seq || left*d.bs >= readaheadBytes/2 {
		return segInfo{}, 0, false
	}
	// The segment's remaining blocks continue the read's LBAs (an image
	// written sequentially): check its last one, then look past it.
	tail := end - 1 + uint64(left)
	if l, ok := d.mu.st.index[tail]; !ok || d.mu.st.segs[l.seg].ref != si.ref || int64(l.off) != si.blocks-1 {
		return segInfo{}, 0, false
	}
	l, ok := d.mu.st.index[tail+1]
	if !ok || d.mu.st.segs[l.seg].ref == si.ref {
		return segInfo{}, 0, false
	}
	return d.mu.st.segs[l.seg], int64(l.off), true
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
