package ondisk

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/device"
)

// The journal head record says how far the journal is acknowledged: every
// journal block of generation Gen with a sequence number below Seq, and the
// checkpoint of generation Gen, were durable before any FLUSH they cover
// was answered. The set writes it after the journal blocks (or the
// checkpoint) are synced, and syncs it before the commit returns.
//
// Without it, damage to the last journal blocks (bytes over them, zeros)
// reads exactly like the torn tail of a commit a crash interrupted, and
// replay silently ends before writes that were acknowledged: a torn final
// write and a later-corrupted durable block look the same on the journal
// alone. With it, replay that ends before the head is damage, reported as a
// *JournalLossError; blocks after the head are the unacknowledged tail and
// may be torn.
//
// Two slots, written alternately (a torn write of one leaves the other,
// older, record intact: an older head claims less, never more): the last
// block of each superblock copy (SBMaxEncoded). Format zeroes both.
const (
	jheadMagic = "TCJHEAD\x01"
	jheadLen   = 8 + 4 + 8*5
)

// JournalHeadOff returns the offset of head record slot i (0 or 1).
func JournalHeadOff(i int) int64 { return int64(i+1)*SBCopySize - BlockSize }

// JournalHead is a decoded head record.
type JournalHead struct {
	N     uint64 // write counter: the slot is N%2; the higher wins
	Gen   uint64
	Seq   uint64 // blocks of Gen with seq < this are durable
	Blk   int64  // where block Seq goes
	Nonce uint64
}

// Encode returns the record as a block.
func (h JournalHead) Encode() []byte {
	b := make([]byte, BlockSize)
	copy(b, jheadMagic)
	le.PutUint64(b[12:], h.Nonce)
	le.PutUint64(b[20:], h.N)
	le.PutUint64(b[28:], h.Gen)
	le.PutUint64(b[36:], h.Seq)
	le.PutUint64(b[44:], uint64(h.Blk))
	le.PutUint32(b[8:], CRC32C(b[12:jheadLen]))
	return b
}

// DecodeJournalHead returns the record in b, ok false if b holds no valid
// record of the set with this nonce.
func DecodeJournalHead(b []byte, nonce uint64) (JournalHead, bool) {
	if len(b) < jheadLen || string(b[:8]) != jheadMagic || le.Uint32(b[8:]) != CRC32C(b[12:jheadLen]) {
		return JournalHead{}, false
	}
	h := JournalHead{Nonce: le.Uint64(b[12:]), N: le.Uint64(b[20:]), Gen: le.Uint64(b[28:]), Seq: le.Uint64(b[36:]), Blk: int64(le.Uint64(b[44:]))}
	return h, h.Nonce == nonce
}

// ReadJournalHead returns the newest valid head record of the set, ok
// false if neither slot holds one (never committed). A read error is
// returned: the unreadable slot may hold the newest record.
func ReadJournalHead(dev device.Device, sb *Superblock) (JournalHead, bool, error) {
	var best JournalHead
	found := false
	buf := make([]byte, BlockSize)
	for i := 0; i < 2; i++ {
		if _, err := dev.ReadAt(buf, JournalHeadOff(i)); err != nil {
			return best, false, fmt.Errorf("reading journal head record %d at %d: %w", i, JournalHeadOff(i), err)
		}
		if h, ok := DecodeJournalHead(buf, sb.Nonce()); ok && (!found || h.N > best.N) {
			best, found = h, true
		}
	}
	return best, found, nil
}

// JournalLossError reports metadata that was acknowledged durable and is
// gone: journal blocks before the journal head (their records: writes,
// FLUSHes answered) or a checkpoint newer than the newest valid one. It
// wraps ErrCorrupt.
type JournalLossError struct {
	Gen      uint64 // generation the head record names
	FromSeq  uint64 // first lost journal block
	ToSeq    uint64 // first block after the lost ones (the head)
	Offset   int64  // cache device offset of the first lost block, or of the lost checkpoint's slot
	Found    string // what is there instead
	CkptLost bool   // a whole checkpoint generation is lost (Gen > the newest valid one)
	CkptGen  uint64 // the newest valid checkpoint's generation
}

func (e *JournalLossError) Error() string {
	if e.CkptLost {
		return fmt.Sprintf("%v: acknowledged metadata lost: the journal head record names checkpoint generation %d, but the newest valid checkpoint is generation %d (the slot at offset %d holds %s); writes acknowledged since generation %d may be undone",
			ErrCorrupt, e.Gen, e.CkptGen, e.Offset, e.Found, e.CkptGen)
	}
	return fmt.Sprintf("%v: acknowledged journal blocks lost: the journal head record says blocks %d..%d of generation %d were durable, but the block at offset %d (seq %d) is %s; the writes and FLUSHes they recorded are lost or undone (%d journal blocks)",
		ErrCorrupt, e.FromSeq, e.ToSeq-1, e.Gen, e.Offset, e.FromSeq, e.Found, e.ToSeq-e.FromSeq)
}

func (e *JournalLossError) Unwrap() error { return ErrCorrupt }

// IsJournalLoss reports whether err is (or wraps) a *JournalLossError.
func IsJournalLoss(err error) bool {
	var le *JournalLossError
	return errors.As(err, &le)
}

// ReplayJournal applies the records of generation gen from start until the
// end of the log. It returns the position after the last applied block,
// the number of records applied and the journal head record (the zero
// record if there is none).
//
// Reading and decoding (frame checksum, record validation) run in a
// goroutine one step ahead of apply, through a small queue. The reader
// reads the same blocks in the same order as a sequential replay and stops
// after the first block that is not BlockOK (or a read error), so the
// device sees the same operations (crash-point tests count them); the
// look-ahead past a bad block runs after the reader has stopped.
//
// The replay must reach the journal head record: ending before it is a
// *JournalLossError (acknowledged blocks damaged), as is a head record of
// a generation newer than gen (a newer checkpoint lost). The returned
// position and count are those of the replayed prefix then.
func ReplayJournal(dev device.Device, sb *Superblock, gen uint64, start JournalPos, apply func(*Rec) error) (JournalPos, int, JournalHead, error) {
	head, haveHead, err := ReadJournalHead(dev, sb)
	if err != nil {
		return start, 0, head, err
	}
	end, n, err := replayJournalBlocks(dev, sb, gen, start, apply)
	if err != nil || !haveHead {
		return end, n, head, err
	}
	switch {
	case head.Gen == gen+1 && head.Seq == 0:
		// The newest checkpoint is lost, but no journal block after it
		// was acknowledged: it held what generation gen and its journal
		// (replayed here) hold. ReadCheckpoint has warned.
	case head.Gen > gen:
		slot := sb.CkptOff[head.Gen%2]
		return end, n, head, &JournalLossError{Gen: head.Gen, CkptLost: true, CkptGen: gen, Offset: slot, Found: describeCkptSlot(dev, slot)}
	case head.Gen == gen && end.Seq < head.Seq:
		jblocks := sb.JournalLen / BlockSize
		off := sb.JournalOff + (end.Blk%jblocks)*BlockSize
		return end, n, head, &JournalLossError{Gen: gen, FromSeq: end.Seq, ToSeq: head.Seq, Offset: off, Found: describeJournalBlock(dev, sb, off, gen)}
	}
	return end, n, head, nil
}

// describeJournalBlock says what the journal block at off holds, for a
// JournalLossError.
func describeJournalBlock(dev device.Device, sb *Superblock, off int64, gen uint64) string {
	b := make([]byte, BlockSize)
	if _, err := dev.ReadAt(b, off); err != nil {
		return fmt.Sprintf("unreadable (%v)", err)
	}
	h, _, st, want, got, derr := DecodeJournalBlock(b, sb.Nonce(), gen)
	switch {
	case st == BlockZero:
		return "zeros"
	case st == BlockForeign:
		return fmt.Sprintf("a block of generation %d, not %d", h.Gen, gen)
	case derr != nil:
		return fmt.Sprintf("invalid (%v)", derr)
	case st == BlockBad:
		return fmt.Sprintf("damaged (crc32c expected %#08x, actual %#08x)", want, got)
	}
	return fmt.Sprintf("a valid block of seq %d (out of order)", h.Seq)
}

// describeCkptSlot says what the checkpoint slot at off holds.
func describeCkptSlot(dev device.Device, off int64) string {
	b := make([]byte, BlockSize)
	if _, err := dev.ReadAt(b, off); err != nil {
		return fmt.Sprintf("unreadable (%v)", err)
	}
	if IsZero(b) {
		return "a zeroed header"
	}
	if _, err := DecodeCkptHeader(b, off); err != nil {
		return fmt.Sprintf("an invalid header (%v)", err)
	}
	return "an older generation"
}
