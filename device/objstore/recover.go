package objstore

import (
	"errors"
	"fmt"
	"time"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// loc is where a written block lives.
type loc struct {
	seg uint32 // index into state.segs
	off uint32 // data block index in the segment
	crc uint32
}

type segInfo struct {
	ref     layout.SegRef
	hlen    int64 // header length: data block i is at hlen + i*blockSize
	blocks  int64 // data blocks it holds
	live    int64 // blocks of it the map refers to
	size    int64 // bytes of the object
	deleted bool  // removed by garbage collection
}

// state is the map of an image: which segment holds each written block.
type state struct {
	uuid      layout.UUID
	bs        int64
	index     map[uint64]loc
	segs      []segInfo
	lastSeq   uint64 // the last segment applied (the final part of an epoch)
	lastEpoch uint64
	lastGen   uint64
	lastTime  time.Time
	sinceCkpt int // segments applied after the checkpoint recovery started from
}

func (st *state) addSeg(ref layout.SegRef, h *layout.SegmentHeader) uint32 {
	n := int64(len(h.CRCs))
	st.segs = append(st.segs, segInfo{ref: ref, hlen: h.Len(), blocks: n, size: h.Len() + n*st.bs})
	return uint32(len(st.segs) - 1)
}

// set maps lba to l (or unmaps it when zero), keeping the live counts.
func (st *state) set(lba uint64, l loc, zero bool) {
	if old, ok := st.index[lba]; ok {
		st.segs[old.seg].live--
	}
	if zero {
		delete(st.index, lba)
		return
	}
	st.index[lba] = l
	st.segs[l.seg].live++
}

// apply maps the blocks of a stored segment.
func (st *state) apply(h *layout.SegmentHeader) {
	si := st.addSeg(layout.SegRef{Seq: h.Seq, Gen: h.Gen}, h)
	d := 0
	for _, e := range h.Extents {
		for i := range uint64(e.Count) {
			if e.Zero {
				st.set(e.LBA+i, loc{}, true)
				continue
			}
			st.set(e.LBA+i, loc{seg: si, off: uint32(d), crc: h.CRCs[d]}, false)
			d++
		}
	}
	st.lastSeq, st.lastEpoch, st.lastGen = h.Seq, h.Epoch, h.Gen
}

// recoverImage rebuilds the map from the bucket alone: the head's newest
// checkpoint, then every later segment in sequence order whose generation
// owns its sequence number (Head.OwnerOf), applied one whole epoch at a
// time (up to a final part), stopping at the first sequence number with no
// such segment. The result is the state after the newest complete epoch.
func recoverImage(s *store, h *layout.Head) (*state, error) {
	uuid, err := h.ImageUUID()
	if err != nil {
		return nil, err
	}
	st := &state{uuid: uuid, bs: int64(h.BlockSize), index: map[uint64]loc{}}
	if c := h.Checkpoint; c != nil {
		name := layout.CkptName(c.Seq, c.Gen)
		p, err := s.get(name, 0, -1)
		if err != nil {
			return nil, fmt.Errorf("image %s: its head names %s: %w", s.loc.Name(), name, err)
		}
		ck, err := layout.DecodeCheckpoint(p)
		if err != nil {
			return nil, fmt.Errorf("image %s: %s: %w", s.loc.Name(), name, err)
		}
		if ck.UUID != uuid || ck.Seq != c.Seq || int64(ck.BlockSize) != st.bs {
			return nil, fmt.Errorf("image %s: %s belongs to image %s (sequence %d, block size %d): %w", s.loc.Name(), name, ck.UUID, ck.Seq, ck.BlockSize, layout.ErrCorrupt)
		}
		if err := st.loadCheckpoint(s, ck); err != nil {
			return nil, err
		}
	}
	var parts []*layout.SegmentHeader
	var partTime time.Time
	for seq := st.lastSeq + 1; ; seq++ {
		gen, ok := h.OwnerOf(seq)
		if !ok {
			break
		}
		sh, mod, err := readSegHeader(s, layout.SegRef{Seq: seq, Gen: gen}, st)
		if errors.Is(err, errNoObject) {
			break
		}
		if err != nil {
			return nil, err
		}
		if len(parts) > 0 && parts[0].Epoch != sh.Epoch {
			return nil, fmt.Errorf("image %s: segment %d (epoch %d) follows an unfinished epoch %d: %w", s.loc.Name(), seq, sh.Epoch, parts[0].Epoch, layout.ErrCorrupt)
		}
		parts = append(parts, sh)
		partTime = mod
		if sh.Final {
			for _, p := range parts {
				st.apply(p)
				st.sinceCkpt++
			}
			st.lastTime = partTime
			parts = parts[:0]
		}
	}
	return st, nil
}

// readSegHeader fetches and checks the header of segment ref.
func readSegHeader(s *store, ref layout.SegRef, st *state) (*layout.SegmentHeader, time.Time, error) {
	name := layout.SegName(ref.Seq, ref.Gen)
	_, mod, size, err := s.stat(name)
	if err != nil {
		return nil, time.Time{}, err
	}
	n := min(int64(layout.SegmentPrefixLen), size)
	for {
		p, err := s.get(name, 0, n)
		if err != nil {
			return nil, time.Time{}, err
		}
		h, err := layout.DecodeSegmentHeader(p)
		var short *layout.ShortError
		if errors.As(err, &short) && short.Need <= size && short.Need > n {
			n = short.Need
			continue
		}
		if errors.As(err, &short) {
			return nil, time.Time{}, fmt.Errorf("image %s: %s: truncated (%d bytes, header needs %d): %w", s.loc.Name(), name, size, short.Need, layout.ErrCorrupt)
		}
		if err != nil {
			return nil, time.Time{}, fmt.Errorf("image %s: %s: %w", s.loc.Name(), name, err)
		}
		if h.Seq != ref.Seq || h.Gen != ref.Gen || h.UUID != st.uuid || int64(h.BlockSize) != st.bs {
			return nil, time.Time{}, fmt.Errorf("image %s: %s holds segment %d of generation %d of image %s: %w", s.loc.Name(), name, h.Seq, h.Gen, h.UUID, layout.ErrCorrupt)
		}
		if want := h.Len() + int64(len(h.CRCs))*st.bs; want != size {
			return nil, time.Time{}, fmt.Errorf("image %s: %s is %d bytes, its header says %d: %w", s.loc.Name(), name, size, want, layout.ErrCorrupt)
		}
		return &h, mod, nil
	}
}

// loadCheckpoint fills the map from a checkpoint. Segment header lengths
// are not in the checkpoint: each referenced segment's header is read
// (one small GET per live segment).
func (st *state) loadCheckpoint(s *store, ck *layout.Checkpoint) error {
	base := make([]uint32, len(ck.Segs))
	for i, ref := range ck.Segs {
		h, _, err := readSegHeader(s, ref, st)
		if err != nil {
			return fmt.Errorf("image %s: checkpoint %d refers to segment %d-%d: %w", s.loc.Name(), ck.Seq, ref.Seq, ref.Gen, err)
		}
		base[i] = st.addSeg(ref, h)
	}
	d := 0
	for _, e := range ck.Extents {
		for i := range uint64(e.Count) {
			st.set(e.LBA+i, loc{seg: base[e.Seg], off: e.Off + uint32(i), crc: ck.CRCs[d]}, false)
			d++
		}
	}
	st.lastSeq = ck.Seq
	return nil
}

// checkpoint builds the checkpoint of the current map.
func (st *state) checkpoint(gen uint64) *layout.Checkpoint {
	ck := &layout.Checkpoint{UUID: st.uuid, BlockSize: uint32(st.bs), Gen: gen, Seq: st.lastSeq}
	lbas := make([]uint64, 0, len(st.index))
	for lba := range st.index {
		lbas = append(lbas, lba)
	}
	sortU64(lbas)
	table := map[uint32]uint32{}
	var used []uint32
	for _, lba := range lbas {
		if _, ok := table[st.index[lba].seg]; !ok {
			table[st.index[lba].seg] = 0
			used = append(used, st.index[lba].seg)
		}
	}
	sortU32(used)
	for i, si := range used {
		table[si] = uint32(i)
		ck.Segs = append(ck.Segs, st.segs[si].ref)
	}
	ck.CRCs = make([]uint32, 0, len(lbas))
	for _, lba := range lbas {
		l := st.index[lba]
		n := len(ck.Extents)
		if n > 0 {
			e := &ck.Extents[n-1]
			if e.LBA+uint64(e.Count) == lba && e.Seg == table[l.seg] && e.Off+e.Count == l.off {
				e.Count++
				ck.CRCs = append(ck.CRCs, l.crc)
				continue
			}
		}
		ck.Extents = append(ck.Extents, layout.MapExtent{LBA: lba, Count: 1, Seg: table[l.seg], Off: l.off})
		ck.CRCs = append(ck.CRCs, l.crc)
	}
	return ck
}
