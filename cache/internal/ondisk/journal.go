package ondisk

import (
	"fmt"
	"sync"

	"github.com/tiercache/tiercache/device"
)

// Journal records. Each describes one change to the index; replaying them in
// order over the checkpoint they follow rebuilds the index exactly. See the
// package comment for the framing.
const (
	RecInsert     = 1 // a run of blocks now lives at (loc.., gen); dirty or clean
	RecClean      = 2 // block lba at loc was written back: clear dirty if still there
	RecInvalidate = 3 // drop any cached blocks in [lba, lba+n)
	RecReuse      = 4 // bucket starts generation gen: drop everything in it
	// RecMark: backing writes into mark region Region of the volume
	// (LBAs lba>>Superblock.MarkShift == Region) may follow: recovery
	// after an unclean shutdown verifies the region's clean entries
	// against the backing device and drops the stale ones, unless a later
	// RecUnmark ends the mark.
	RecMark = 5
	// RecUnmark: every backing write into the region since its mark has
	// its record before this one; the mark ends.
	RecUnmark = 6
)

const (
	JHeaderSize  = 48
	JPayload     = BlockSize - JHeaderSize
	jMagic       = 0x4C4E524A // "JRNL"
	RecHdrSize   = 3          // type u8, body length u16
	MaxInsertRun = 256
	InsertFixed  = 2 + 8 + 4 + 4 + 1 + 8 + 2
)

// rec is one decoded journal record.
type Rec struct {
	Type   uint8
	Vol    uint16
	LBA    uint64
	N      uint64 // invalidate: block count
	Loc    uint32 // insert: first cache block of the run; clean: cache block
	Gen    uint32 // insert: bucket generation; reuse: new generation
	Bucket uint32 // reuse
	Region uint64 // mark, unmark: LBA >> Superblock.MarkShift
	Dirty  bool
	Epoch  uint64   // insert: client flush epoch of the write
	CRCs   []uint32 // insert: one per block
}

func (r *Rec) String() string {
	switch r.Type {
	case RecInsert:
		return fmt.Sprintf("insert vol=%d lba=%d n=%d loc=%d gen=%d dirty=%t epoch=%d", r.Vol, r.LBA, len(r.CRCs), r.Loc, r.Gen, r.Dirty, r.Epoch)
	case RecClean:
		return fmt.Sprintf("clean vol=%d lba=%d loc=%d", r.Vol, r.LBA, r.Loc)
	case RecInvalidate:
		return fmt.Sprintf("invalidate vol=%d lba=%d n=%d", r.Vol, r.LBA, r.N)
	case RecReuse:
		return fmt.Sprintf("reuse bucket=%d gen=%d", r.Bucket, r.Gen)
	case RecMark:
		return fmt.Sprintf("mark vol=%d region=%d", r.Vol, r.Region)
	case RecUnmark:
		return fmt.Sprintf("unmark vol=%d region=%d", r.Vol, r.Region)
	}
	return fmt.Sprintf("rec(%d)", r.Type)
}

// AppendRec encodes r onto b.
func AppendRec(b []byte, r *Rec) []byte {
	e := enc{b: b}
	start := len(e.b)
	e.u8(r.Type)
	e.u16(0) // body length, patched below
	switch r.Type {
	case RecInsert:
		e.u16(r.Vol)
		e.u64(r.LBA)
		e.u32(r.Loc)
		e.u32(r.Gen)
		if r.Dirty {
			e.u8(1)
		} else {
			e.u8(0)
		}
		e.u64(r.Epoch)
		e.u16(uint16(len(r.CRCs)))
		for _, c := range r.CRCs {
			e.u32(c)
		}
	case RecClean:
		e.u16(r.Vol)
		e.u64(r.LBA)
		e.u32(r.Loc)
	case RecInvalidate:
		e.u16(r.Vol)
		e.u64(r.LBA)
		e.u64(r.N)
	case RecReuse:
		e.u32(r.Bucket)
		e.u32(r.Gen)
	case RecMark, RecUnmark:
		e.u16(r.Vol)
		e.u64(r.Region)
	}
	le.PutUint16(e.b[start+1:], uint16(len(e.b)-start-RecHdrSize))
	return e.b
}

// DecodeRec decodes one record from the front of b and returns the rest.
func DecodeRec(b []byte) (*Rec, []byte, error) {
	if len(b) < RecHdrSize {
		return nil, nil, Badf("journal record", "record header truncated")
	}
	typ, n := b[0], int(le.Uint16(b[1:]))
	if n > len(b)-RecHdrSize {
		return nil, nil, Badf("journal record", "record body of %d bytes exceeds block", n)
	}
	d := dec{b: b[RecHdrSize : RecHdrSize+n]}
	r := &Rec{Type: typ}
	switch typ {
	case RecInsert:
		r.Vol = d.u16()
		r.LBA = d.u64()
		r.Loc = d.u32()
		r.Gen = d.u32()
		switch d.u8() {
		case 0:
		case 1:
			r.Dirty = true
		default:
			d.bad = true
		}
		r.Epoch = d.u64()
		cnt := int(d.u16())
		if cnt == 0 || cnt > MaxInsertRun {
			return nil, nil, Badf("journal record", "insert record with %d blocks", cnt)
		}
		r.CRCs = make([]uint32, 0, cnt)
		for i := 0; i < cnt && !d.bad; i++ {
			r.CRCs = append(r.CRCs, d.u32())
		}
	case RecClean:
		r.Vol = d.u16()
		r.LBA = d.u64()
		r.Loc = d.u32()
	case RecInvalidate:
		r.Vol = d.u16()
		r.LBA = d.u64()
		r.N = d.u64()
	case RecReuse:
		r.Bucket = d.u32()
		r.Gen = d.u32()
	case RecMark, RecUnmark:
		r.Vol = d.u16()
		r.Region = d.u64()
	default:
		return nil, nil, Badf("journal record", "unknown record type %d", typ)
	}
	if d.bad || d.remaining() != 0 {
		return nil, nil, Badf("journal record", "malformed record type %d (%d bytes)", typ, n)
	}
	return r, b[RecHdrSize+n:], nil
}

// BlockHeader is a journal block header.
type BlockHeader struct {
	Nonce      uint64
	Gen        uint64 // checkpoint generation the block follows
	Seq        uint64 // block sequence number within the generation, from the checkpoint's start
	BatchStart uint64 // seq of the first block of the commit this block belongs to
	Used       int    // payload bytes
}

// BlockStatus classifies a journal block read during replay.
type BlockStatus int

const (
	BlockOK      BlockStatus = iota
	BlockZero                // never written (zeroed tail)
	BlockForeign             // valid frame of another set or generation: end of log
	BlockBad                 // checksum or framing mismatch: torn write or corruption
)

// EncodeJournalBlock frames payload (whole records) into a 4 KiB block.
func EncodeJournalBlock(h BlockHeader, payload []byte) []byte {
	b := make([]byte, BlockSize)
	le.PutUint32(b[0:], jMagic)
	le.PutUint64(b[8:], h.Nonce)
	le.PutUint64(b[16:], h.Gen)
	le.PutUint64(b[24:], h.Seq)
	le.PutUint64(b[32:], h.BatchStart)
	le.PutUint16(b[40:], uint16(len(payload)))
	copy(b[JHeaderSize:], payload)
	le.PutUint32(b[4:], CRC32C(b[8:]))
	return b
}

// DecodeJournalBlock validates the frame of b and returns its header and
// records. It never panics. For BlockBad, want/got are the checksums.
func DecodeJournalBlock(b []byte, nonce, gen uint64) (h BlockHeader, recs []*Rec, st BlockStatus, want, got uint32, err error) {
	if len(b) != BlockSize {
		return h, nil, BlockBad, 0, 0, Badf("journal block", "journal block of %d bytes", len(b))
	}
	if IsZero(b) {
		return h, nil, BlockZero, 0, 0, nil
	}
	want = le.Uint32(b[4:])
	got = CRC32C(b[8:])
	if le.Uint32(b[0:]) != jMagic || want != got {
		return h, nil, BlockBad, want, got, nil
	}
	h.Nonce = le.Uint64(b[8:])
	h.Gen = le.Uint64(b[16:])
	h.Seq = le.Uint64(b[24:])
	h.BatchStart = le.Uint64(b[32:])
	h.Used = int(le.Uint16(b[40:]))
	if h.Nonce != nonce || h.Gen != gen {
		return h, nil, BlockForeign, want, got, nil
	}
	if h.Used > JPayload || h.BatchStart > h.Seq {
		return h, nil, BlockBad, want, got, Badf("journal block", "header: used %d, batch start %d, seq %d", h.Used, h.BatchStart, h.Seq)
	}
	p := b[JHeaderSize : JHeaderSize+h.Used]
	for len(p) > 0 {
		var r *Rec
		r, p, err = DecodeRec(p)
		if err != nil {
			// The frame checksum is good, so this is not a torn write.
			return h, nil, BlockBad, want, got, err
		}
		recs = append(recs, r)
	}
	return h, recs, BlockOK, want, got, nil
}

func IsZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// PackRecords splits an encoded record stream into block payloads.
func PackRecords(stream []byte) [][]byte {
	var out [][]byte
	cur := make([]byte, 0, JPayload)
	for len(stream) > 0 {
		n := RecHdrSize + int(le.Uint16(stream[1:]))
		if len(cur)+n > JPayload {
			out = append(out, cur)
			cur = make([]byte, 0, JPayload)
		}
		cur = append(cur, stream[:n]...)
		stream = stream[n:]
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// JournalPos is a position in the circular journal: block index within the
// region and the sequence number of the block written there.
type JournalPos struct {
	Blk int64
	Seq uint64
}

// MaxBatchBlocks is the largest number of journal blocks written between two
// syncs. Replay looks this far past a bad block: a valid block of a later
// batch there proves the bad block was once durable (corruption), otherwise
// the bad block is the torn tail of the last, unacknowledged batch.
func MaxBatchBlocks(jblocks int64) int64 { return min(64, jblocks/4) }

// replayJournalBlocks is ReplayJournal without the head record check.
func replayJournalBlocks(dev device.Device, sb *Superblock, gen uint64, start JournalPos, apply func(*Rec) error) (JournalPos, int, error) {
	nonce := sb.Nonce()
	jblocks := sb.JournalLen / BlockSize
	pos := start
	buf := make([]byte, BlockSize)
	applied := 0
	readBlk := func(i int64) ([]byte, int64, error) {
		off := sb.JournalOff + (i%jblocks)*BlockSize
		_, err := dev.ReadAt(buf, off)
		return buf, off, err
	}
	type decoded struct {
		off       int64
		err       error // read error
		h         BlockHeader
		recs      []*Rec
		st        BlockStatus
		want, got uint32
		derr      error
	}
	blocks := make(chan decoded, 16)
	done := make(chan struct{})
	var reader sync.WaitGroup
	reader.Add(1)
	go func() {
		defer reader.Done()
		defer close(blocks)
		rbuf := make([]byte, BlockSize)
		for n := int64(0); n < jblocks; n++ {
			d := decoded{off: sb.JournalOff + ((start.Blk+n)%jblocks)*BlockSize}
			if _, d.err = dev.ReadAt(rbuf, d.off); d.err == nil {
				d.h, d.recs, d.st, d.want, d.got, d.derr = DecodeJournalBlock(rbuf, nonce, gen)
				// Damage or the end of the log: the other member of a
				// mirror may hold the block (damaged here, or written
				// there only before a crash; either is a block of the
				// log).
				seq := start.Seq + uint64(n)
				if d.st != BlockOK && repair(dev, rbuf, d.off, func(b []byte) bool {
					h, _, st, _, _, _ := DecodeJournalBlock(b, nonce, gen)
					return st == BlockOK && h.Seq == seq
				}) {
					d.h, d.recs, d.st, d.want, d.got, d.derr = DecodeJournalBlock(rbuf, nonce, gen)
				}
			}
			select {
			case blocks <- d:
			case <-done:
				return
			}
			if d.err != nil || d.st != BlockOK {
				return
			}
		}
	}()
	// The reader has stopped when this returns: no device operation of
	// replay outlives it.
	defer reader.Wait()
	defer close(done)
	for n := int64(0); n < jblocks; n++ {
		d, ok := <-blocks
		if !ok {
			break // unreachable: the reader sends jblocks blocks or stops after a final one
		}
		off, err, h, recs, st, want, got, derr := d.off, d.err, d.h, d.recs, d.st, d.want, d.got, d.derr
		if err != nil {
			return pos, applied, fmt.Errorf("reading journal block at %d: %w", off, err)
		}
		if st == BlockOK && h.Seq != pos.Seq {
			return pos, applied, Corruptf("journal", off, BlockSize, "block sequence %d, expected %d", h.Seq, pos.Seq)
		}
		if st == BlockOK {
			for _, r := range recs {
				if err := apply(r); err != nil {
					return pos, applied, fmt.Errorf("journal block at offset %d (seq %d), %v: %w", off, h.Seq, r, err)
				}
				applied++
			}
			pos = JournalPos{Blk: (pos.Blk + 1) % jblocks, Seq: pos.Seq + 1}
			continue
		}
		// End of the log or damage. A later batch of this generation beyond
		// this block means this block was durable once: corruption.
		for j := int64(1); j <= MaxBatchBlocks(jblocks) && n+j < jblocks; j++ {
			b2, _, err := readBlk(pos.Blk + j)
			if err != nil {
				return pos, applied, fmt.Errorf("reading journal: %w", err)
			}
			h2, _, st2, _, _, _ := DecodeJournalBlock(b2, nonce, gen)
			if st2 == BlockOK && h2.Seq > pos.Seq && h2.BatchStart > pos.Seq {
				ce := &CorruptionError{Err: ErrCorrupt, Device: "cache", What: "journal block", Offset: off, Length: BlockSize,
					Detail: fmt.Sprintf("block seq %d unreadable but later batch (seq %d) is durable", pos.Seq, h2.Seq)}
				if st == BlockBad && derr == nil {
					ce.Expected, ce.Actual, ce.HaveSums = want, got, true
				}
				return pos, applied, ce
			}
		}
		if derr != nil {
			// Checksum fine but contents invalid: not a torn write.
			return pos, applied, Placed(derr, off, BlockSize)
		}
		return pos, applied, nil
	}
	return pos, applied, nil
}
