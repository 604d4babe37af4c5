package layout

import "fmt"

const (
	ckptMagic     = "TCCKP\x00\x00\x01"
	ckptVersion   = 1
	ckptFixedLen  = 64
	ckptSegLen    = 16
	ckptExtentLen = 24
)

// SegRef names a segment object: its sequence number and generation.
type SegRef struct{ Seq, Gen uint64 }

// MapExtent maps Count consecutive blocks from LBA to consecutive data
// blocks of segment Segs[Seg] starting at data block Off.
type MapExtent struct {
	LBA   uint64
	Count uint32
	Seg   uint32 // index into Checkpoint.Segs
	Off   uint32 // data block index in that segment
}

// Checkpoint is the image's map after segment Seq: every written block's
// place. Blocks it does not map read as zeroes.
type Checkpoint struct {
	UUID      UUID
	BlockSize uint32
	Gen       uint64 // generation that wrote it
	Seq       uint64 // it covers segments 1..Seq
	Segs      []SegRef
	Extents   []MapExtent // LBA-sorted, disjoint
	CRCs      []uint32    // CRC32C of each mapped block, in extent order
}

func (c *Checkpoint) check(obj string) error {
	if !ValidBlockSize(int(c.BlockSize)) {
		return corrupt(obj, 0, "block size %d", c.BlockSize)
	}
	for i := 1; i < len(c.Segs); i++ {
		if c.Segs[i].Seq <= c.Segs[i-1].Seq {
			return corrupt(obj, 0, "segment table entry %d (seq %d) is not after entry %d (seq %d)", i, c.Segs[i].Seq, i-1, c.Segs[i-1].Seq)
		}
	}
	if n := len(c.Segs); n > 0 && c.Segs[n-1].Seq > c.Seq {
		return corrupt(obj, 0, "refers to segment %d, after its own sequence %d", c.Segs[n-1].Seq, c.Seq)
	}
	var next, blocks uint64
	for i, e := range c.Extents {
		if e.Count == 0 {
			return corrupt(obj, 0, "extent %d is empty", i)
		}
		if i > 0 && e.LBA < next {
			return corrupt(obj, 0, "extent %d (block %d) overlaps the previous one", i, e.LBA)
		}
		if int(e.Seg) >= len(c.Segs) {
			return corrupt(obj, 0, "extent %d refers to segment %d of %d", i, e.Seg, len(c.Segs))
		}
		if uint64(e.Off)+uint64(e.Count) > MaxSegmentBlocks {
			return corrupt(obj, 0, "extent %d lies past the largest segment", i)
		}
		next = e.LBA + uint64(e.Count)
		if next < e.LBA {
			return corrupt(obj, 0, "extent %d overflows", i)
		}
		blocks += uint64(e.Count)
	}
	if blocks != uint64(len(c.CRCs)) {
		return corrupt(obj, 0, "%d mapped blocks with %d checksums", blocks, len(c.CRCs))
	}
	return nil
}

// EncodeCheckpoint returns the checkpoint object for c.
func EncodeCheckpoint(c *Checkpoint) ([]byte, error) {
	if err := c.check("checkpoint to encode"); err != nil {
		return nil, err
	}
	n := ckptFixedLen + ckptSegLen*len(c.Segs) + ckptExtentLen*len(c.Extents) + 4*len(c.CRCs) + 4
	out := make([]byte, n)
	copy(out, ckptMagic)
	le.PutUint32(out[8:], ckptVersion)
	le.PutUint32(out[12:], c.BlockSize)
	copy(out[16:32], c.UUID[:])
	le.PutUint64(out[32:], c.Gen)
	le.PutUint64(out[40:], c.Seq)
	le.PutUint32(out[48:], uint32(len(c.Segs)))
	le.PutUint32(out[52:], uint32(len(c.Extents)))
	le.PutUint64(out[56:], uint64(len(c.CRCs)))
	p := out[ckptFixedLen:]
	for _, s := range c.Segs {
		le.PutUint64(p, s.Seq)
		le.PutUint64(p[8:], s.Gen)
		p = p[ckptSegLen:]
	}
	for _, e := range c.Extents {
		le.PutUint64(p, e.LBA)
		le.PutUint32(p[8:], e.Count)
		le.PutUint32(p[12:], e.Seg)
		le.PutUint32(p[16:], e.Off)
		p = p[ckptExtentLen:]
	}
	for _, x := range c.CRCs {
		le.PutUint32(p, x)
		p = p[4:]
	}
	le.PutUint32(p, CRC(out[:n-4]))
	return out, nil
}

// DecodeCheckpoint decodes a checkpoint object; any inconsistency is an
// error wrapping ErrCorrupt.
func DecodeCheckpoint(p []byte) (*Checkpoint, error) {
	const obj = "checkpoint"
	if len(p) < ckptFixedLen+4 || string(p[:len(ckptMagic)]) != ckptMagic {
		return nil, corrupt(obj, 0, "bad magic or too short (%d bytes)", len(p))
	}
	if v := le.Uint32(p[8:]); v != ckptVersion {
		return nil, corrupt(obj, 8, "version %d (this build reads %d)", v, ckptVersion)
	}
	c := &Checkpoint{BlockSize: le.Uint32(p[12:]), Gen: le.Uint64(p[32:]), Seq: le.Uint64(p[40:])}
	copy(c.UUID[:], p[16:32])
	nSegs, nExt, nBlocks := uint64(le.Uint32(p[48:])), uint64(le.Uint32(p[52:])), le.Uint64(p[56:])
	if nBlocks > MaxCheckpointBlocks {
		return nil, corrupt(obj, 56, "%d blocks", nBlocks)
	}
	want := ckptFixedLen + ckptSegLen*nSegs + ckptExtentLen*nExt + 4*nBlocks + 4
	if uint64(len(p)) != want {
		return nil, corrupt(obj, int64(len(p)), "%d bytes, its counts need %d", len(p), want)
	}
	if w, g := le.Uint32(p[len(p)-4:]), CRC(p[:len(p)-4]); w != g {
		return nil, corrupt(obj, int64(len(p)-4), "checksum %08x, computed %08x", w, g)
	}
	q := p[ckptFixedLen:]
	c.Segs = make([]SegRef, nSegs)
	for i := range c.Segs {
		c.Segs[i] = SegRef{Seq: le.Uint64(q), Gen: le.Uint64(q[8:])}
		q = q[ckptSegLen:]
	}
	c.Extents = make([]MapExtent, nExt)
	for i := range c.Extents {
		c.Extents[i] = MapExtent{LBA: le.Uint64(q), Count: le.Uint32(q[8:]), Seg: le.Uint32(q[12:]), Off: le.Uint32(q[16:])}
		q = q[ckptExtentLen:]
	}
	c.CRCs = make([]uint32, nBlocks)
	for i := range c.CRCs {
		c.CRCs[i] = le.Uint32(q)
		q = q[4:]
	}
	if err := c.check(obj); err != nil {
		return nil, err
	}
	return c, nil
}

// String summarizes c for logs and errors.
func (c *Checkpoint) String() string {
	return fmt.Sprintf("checkpoint after segment %d (generation %d, %d blocks in %d segments)", c.Seq, c.Gen, len(c.CRCs), len(c.Segs))
}
