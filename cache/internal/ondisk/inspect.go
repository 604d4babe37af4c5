package ondisk

import (
	"encoding/binary"
	"fmt"

	"github.com/tiercache/tiercache/device"
)

// SuperblockCopy is one of the two superblock copies as found on disk.
type SuperblockCopy struct {
	Index  int
	Offset int64
	SB     *Superblock // nil when the copy is invalid
	Err    error       // why the copy is invalid
}

// ReadSuperblockCopies decodes both superblock copies independently.
func ReadSuperblockCopies(dev device.Device) [2]SuperblockCopy {
	var out [2]SuperblockCopy
	for i := range out {
		off := int64(i) * SBCopySize
		out[i] = SuperblockCopy{Index: i, Offset: off}
		if dev.Size() < 2*SBCopySize {
			out[i].Err = fmt.Errorf("%w: cache device of %d bytes", ErrNotFormatted, dev.Size())
			continue
		}
		buf := make([]byte, BlockSize)
		if _, err := dev.ReadAt(buf, off); err != nil {
			out[i].Err = fmt.Errorf("reading superblock copy %d: %w", i, err)
			continue
		}
		if string(buf[:8]) == SBMagic {
			if n := SBHeaderSize + int(binary.LittleEndian.Uint32(buf[12:])); n > BlockSize && n <= SBCopySize {
				buf = make([]byte, (n+BlockSize-1)/BlockSize*BlockSize)
				if _, err := dev.ReadAt(buf, off); err != nil {
					out[i].Err = fmt.Errorf("reading superblock copy %d: %w", i, err)
					continue
				}
			}
		}
		sb, err := DecodeSuperblock(buf, off)
		if err == nil {
			err = sb.ValidateAt(dev.Size(), off)
		}
		if err != nil {
			out[i].Err = err
			continue
		}
		out[i].SB = sb
	}
	return out
}

// CheckpointSlot describes one checkpoint slot's header.
type CheckpointSlot struct {
	Index        int
	Offset       int64
	Generation   uint64
	JournalBlock int64  // where the journal of this generation starts
	JournalSeq   uint64 // its first sequence number
	BodyLen      uint64
	BodyCRC      uint32
	Err          error // header invalid (never written, torn, or foreign)
	// IndexRoot: the set is formatted with index pages, and this is root
	// slot Index of its page area (JournalBlock from the root's payload,
	// no body, JournalSeq 0), naming Trees trees.
	IndexRoot bool
	Trees     int
}

// ReadCheckpointSlots decodes both checkpoint slots' headers (not the
// bodies) of a set formatted without index pages.
func ReadCheckpointSlots(dev device.Device, sb *Superblock) [2]CheckpointSlot {
	var out [2]CheckpointSlot
	for i := range out {
		out[i] = CheckpointSlot{Index: i, Offset: sb.CkptOff[i]}
		buf := make([]byte, BlockSize)
		if _, err := dev.ReadAt(buf, sb.CkptOff[i]); err != nil {
			out[i].Err = fmt.Errorf("reading checkpoint slot %d: %w", i, err)
			continue
		}
		h, err := DecodeCkptHeader(buf, sb.CkptOff[i])
		if err == nil && (h.Nonce != sb.Nonce() || h.Gen%2 != uint64(i)) {
			err = Corruptf("checkpoint header", sb.CkptOff[i], BlockSize, "slot %d holds generation %d of another set", i, h.Gen)
		}
		if err != nil {
			out[i].Err = err
			continue
		}
		out[i].Generation, out[i].JournalBlock, out[i].JournalSeq = h.Gen, h.JPos.Blk, h.JPos.Seq
		out[i].BodyLen, out[i].BodyCRC = h.BodyLen, h.BodyCRC
	}
	return out
}
