package layout

import "fmt"

const (
	segMagic       = "TCSEG\x00\x00\x01"
	segVersion     = 1
	segFixedLen    = 64
	segExtentLen   = 16
	segFlagFinal   = 1
	extentFlagZero = 1
)

// Extent is a run of consecutive blocks in a segment. A zero extent says
// the blocks read as zeroes from this segment on and carries no data.
type Extent struct {
	LBA   uint64 // first block
	Count uint32 // blocks
	Zero  bool
}

// SegmentHeader describes a segment: which image and generation wrote it,
// where it stands in the image's sequence, and which blocks it holds.
type SegmentHeader struct {
	Seq       uint64 // position in the image's sequence of segments (from 1)
	Gen       uint64 // owner generation that wrote it
	Epoch     uint64 // which Sync of its generation (from 1) it belongs to; parts of one epoch share it
	UUID      UUID
	Final     bool // the last part of its epoch: replay applies an epoch only up to a final part
	BlockSize uint32
	Extents   []Extent
	CRCs      []uint32 // CRC32C of each data block, in extent order (zero extents have none)
}

// DataBlocks is the number of data blocks the extents carry.
func (h *SegmentHeader) DataBlocks() int {
	n := 0
	for _, e := range h.Extents {
		if !e.Zero {
			n += int(e.Count)
		}
	}
	return n
}

// Len is the encoded header's length: the byte offset of the first data
// block.
func (h *SegmentHeader) Len() int64 {
	return int64(segFixedLen + segExtentLen*len(h.Extents) + 4*h.DataBlocks() + 4)
}

// BlockOffset is the byte offset in the segment object of data block i.
func (h *SegmentHeader) BlockOffset(i int) int64 {
	return h.Len() + int64(i)*int64(h.BlockSize)
}

// check validates the fields an encoder and a decoder both require.
func (h *SegmentHeader) check(obj string) error {
	if !ValidBlockSize(int(h.BlockSize)) {
		return corrupt(obj, 0, "block size %d", h.BlockSize)
	}
	if h.Seq == 0 {
		return corrupt(obj, 0, "sequence 0")
	}
	var next uint64
	for i, e := range h.Extents {
		if e.Count == 0 {
			return corrupt(obj, 0, "extent %d is empty", i)
		}
		if i > 0 && e.LBA < next {
			return corrupt(obj, 0, "extent %d (block %d) is not after the previous one, which ends at block %d", i, e.LBA, next)
		}
		end := e.LBA + uint64(e.Count)
		if end < e.LBA {
			return corrupt(obj, 0, "extent %d overflows", i)
		}
		next = end
	}
	if n := h.DataBlocks(); n > MaxSegmentBlocks || n != len(h.CRCs) {
		return corrupt(obj, 0, "%d data blocks with %d checksums (at most %d blocks)", n, len(h.CRCs), MaxSegmentBlocks)
	}
	return nil
}

// EncodeSegment returns the segment object for h and data, the data
// blocks in extent order. h.CRCs is ignored and computed from data.
func EncodeSegment(h SegmentHeader, data []byte) ([]byte, error) {
	bs := int(h.BlockSize)
	if !ValidBlockSize(bs) || len(data)%bs != 0 {
		return nil, fmt.Errorf("objstore: encode segment: %d bytes of data in blocks of %d", len(data), bs)
	}
	h.CRCs = make([]uint32, len(data)/bs)
	for i := range h.CRCs {
		h.CRCs[i] = CRC(data[i*bs : (i+1)*bs])
	}
	if err := h.check("segment to encode"); err != nil {
		return nil, err
	}
	hl := int(h.Len())
	out := make([]byte, hl, hl+len(data))
	copy(out, segMagic)
	le.PutUint32(out[8:], segVersion)
	var flags uint32
	if h.Final {
		flags |= segFlagFinal
	}
	le.PutUint32(out[12:], flags)
	le.PutUint64(out[16:], h.Seq)
	le.PutUint64(out[24:], h.Gen)
	le.PutUint64(out[32:], h.Epoch)
	copy(out[40:56], h.UUID[:])
	le.PutUint32(out[56:], h.BlockSize)
	le.PutUint32(out[60:], uint32(len(h.Extents)))
	p := out[segFixedLen:]
	for _, e := range h.Extents {
		le.PutUint64(p, e.LBA)
		le.PutUint32(p[8:], e.Count)
		var f uint32
		if e.Zero {
			f |= extentFlagZero
		}
		le.PutUint32(p[12:], f)
		p = p[segExtentLen:]
	}
	for _, c := range h.CRCs {
		le.PutUint32(p, c)
		p = p[4:]
	}
	le.PutUint32(p, CRC(out[:hl-4]))
	return append(out, data...), nil
}

// SegmentPrefixLen is how many leading bytes of a segment to fetch to have
// its whole header in most cases; DecodeSegmentHeader says when more are
// needed.
const SegmentPrefixLen = 64 << 10

// ShortError is returned by DecodeSegmentHeader when p is a valid start of
// a header that continues past len(p): fetch Need bytes and decode again.
type ShortError struct{ Need int64 }

func (e *ShortError) Error() string {
	return fmt.Sprintf("objstore: segment header needs %d bytes", e.Need)
}

// DecodeSegmentHeader decodes the header at the start of p (a prefix of a
// segment object). It returns a *ShortError when p ends before the header
// does, and an error wrapping ErrCorrupt when the bytes are not a segment
// header or its checksum does not match.
func DecodeSegmentHeader(p []byte) (SegmentHeader, error) {
	const obj = "segment"
	var h SegmentHeader
	if len(p) < segFixedLen {
		if len(p) < len(segMagic) || string(p[:len(segMagic)]) == segMagic {
			return h, &ShortError{Need: segFixedLen}
		}
	}
	if len(p) < len(segMagic) || string(p[:len(segMagic)]) != segMagic {
		return h, corrupt(obj, 0, "bad magic")
	}
	if len(p) < segFixedLen {
		return h, &ShortError{Need: segFixedLen}
	}
	if v := le.Uint32(p[8:]); v != segVersion {
		return h, corrupt(obj, 8, "version %d (this build reads %d)", v, segVersion)
	}
	flags := le.Uint32(p[12:])
	if flags&^segFlagFinal != 0 {
		return h, corrupt(obj, 12, "unknown flags %#x", flags)
	}
	h.Final = flags&segFlagFinal != 0
	h.Seq = le.Uint64(p[16:])
	h.Gen = le.Uint64(p[24:])
	h.Epoch = le.Uint64(p[32:])
	copy(h.UUID[:], p[40:56])
	h.BlockSize = le.Uint32(p[56:])
	nExt := int64(le.Uint32(p[60:]))
	if nExt > MaxSegmentBlocks*2 {
		return h, corrupt(obj, 60, "%d extents", nExt)
	}
	extEnd := segFixedLen + segExtentLen*nExt
	if int64(len(p)) < extEnd {
		return h, &ShortError{Need: extEnd}
	}
	h.Extents = make([]Extent, nExt)
	q := p[segFixedLen:]
	nData := int64(0)
	for i := range h.Extents {
		f := le.Uint32(q[12:])
		if f&^extentFlagZero != 0 {
			return h, corrupt(obj, segFixedLen+int64(i)*segExtentLen+12, "extent %d: unknown flags %#x", i, f)
		}
		h.Extents[i] = Extent{LBA: le.Uint64(q), Count: le.Uint32(q[8:]), Zero: f&extentFlagZero != 0}
		if !h.Extents[i].Zero {
			nData += int64(h.Extents[i].Count)
		}
		q = q[segExtentLen:]
	}
	if nData > MaxSegmentBlocks {
		return h, corrupt(obj, segFixedLen, "%d data blocks (at most %d)", nData, MaxSegmentBlocks)
	}
	hl := extEnd + 4*nData + 4
	if int64(len(p)) < hl {
		return h, &ShortError{Need: hl}
	}
	if want, got := le.Uint32(p[hl-4:]), CRC(p[:hl-4]); want != got {
		return h, corrupt(obj, hl-4, "header checksum %08x, computed %08x", want, got)
	}
	h.CRCs = make([]uint32, nData)
	for i := range h.CRCs {
		h.CRCs[i] = le.Uint32(p[extEnd+4*int64(i):])
	}
	if err := h.check(obj); err != nil {
		return h, err
	}
	return h, nil
}

// DecodeSegment decodes a whole segment object and checks every data
// block's checksum; it returns the header and the data blocks.
func DecodeSegment(p []byte) (SegmentHeader, []byte, error) {
	h, err := DecodeSegmentHeader(p)
	var short *ShortError
	if asShort(err, &short) {
		return h, nil, corrupt("segment", int64(len(p)), "truncated header (needs %d bytes)", short.Need)
	}
	if err != nil {
		return h, nil, err
	}
	data := p[h.Len():]
	bs := int64(h.BlockSize)
	if want := int64(len(h.CRCs)) * bs; int64(len(data)) != want {
		return h, nil, corrupt("segment", h.Len(), "%d bytes of data, header says %d", len(data), want)
	}
	for i, c := range h.CRCs {
		if got := CRC(data[int64(i)*bs : int64(i+1)*bs]); got != c {
			return h, nil, corrupt("segment", h.BlockOffset(i), "block %d checksum %08x, computed %08x", i, c, got)
		}
	}
	return h, data, nil
}

func asShort(err error, s **ShortError) bool {
	if e, ok := err.(*ShortError); ok {
		*s = e
		return true
	}
	return false
}
