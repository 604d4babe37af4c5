package mirror

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// The mirror label says who the members of a mirrored set are and which of
// them hold current data. Each member keeps one in two slots, the
// third-to-last 4 KiB block of each superblock copy, written alternately
// (the higher valid counter wins, so a torn write leaves the previous
// label). Format writes it to both members; a member failure writes it,
// with the generation bumped and the failed member marked, to the
// survivor only, so the failed member's own label stays behind.
//
// Block layout (little-endian): magic "TCMIRLBL" (8), crc32c of bytes
// 16..16+len (u32), len (u32), counter (u64), nonce (u64; the set's),
// generation (u64), role (u8: 0 = A, 1 = B, whose label this is), the two
// members' identities ([16] each), failed flags (u8 each).
const (
	labelMagic  = "TCMIRLBL"
	labelHdrLen = 16
	labelBody   = 8 + 8 + 8 + 1 + 2*16 + 2
)

// LabelOff returns the offset of label slot i (0 or 1) on each member.
func LabelOff(i int) int64 { return int64(i+1)*ondisk.SBCopySize - 3*ondisk.BlockSize }

// Label is a decoded mirror label.
type Label struct {
	Counter uint64 // write counter: the slot is Counter%2
	Nonce   uint64 // the set's (ondisk.Superblock.Nonce)
	// Gen is the mirror generation, bumped at every change of membership
	// or member state; the member with the higher one is current.
	Gen    uint64
	Role   Member      // whose label this is
	IDs    [2][16]byte // each member's identity, chosen at Format
	Failed [2]bool     // a member that failed, and is stale since Gen
}

func (l *Label) encode() []byte {
	b := make([]byte, ondisk.BlockSize)
	copy(b, labelMagic)
	p := b[labelHdrLen:]
	binary.LittleEndian.PutUint64(p[0:], l.Counter)
	binary.LittleEndian.PutUint64(p[8:], l.Nonce)
	binary.LittleEndian.PutUint64(p[16:], l.Gen)
	p[24] = byte(l.Role)
	copy(p[25:41], l.IDs[0][:])
	copy(p[41:57], l.IDs[1][:])
	for i, f := range l.Failed {
		if f {
			p[57+i] = 1
		}
	}
	binary.LittleEndian.PutUint32(b[12:], labelBody)
	binary.LittleEndian.PutUint32(b[8:], ondisk.CRC32C(b[labelHdrLen:labelHdrLen+labelBody]))
	return b
}

// decodeLabel returns the label in b; ok is false for a block that holds
// none (zeroes, a torn or foreign block).
func decodeLabel(b []byte) (l Label, ok bool) {
	if len(b) < ondisk.BlockSize || string(b[:8]) != labelMagic {
		return l, false
	}
	if binary.LittleEndian.Uint32(b[12:]) != labelBody {
		return l, false
	}
	p := b[labelHdrLen : labelHdrLen+labelBody]
	if ondisk.CRC32C(p) != binary.LittleEndian.Uint32(b[8:]) {
		return l, false
	}
	l.Counter = binary.LittleEndian.Uint64(p[0:])
	l.Nonce = binary.LittleEndian.Uint64(p[8:])
	l.Gen = binary.LittleEndian.Uint64(p[16:])
	if p[24] > 1 || p[57] > 1 || p[58] > 1 {
		return l, false
	}
	l.Role = Member(p[24])
	copy(l.IDs[0][:], p[25:41])
	copy(l.IDs[1][:], p[41:57])
	l.Failed = [2]bool{p[57] == 1, p[58] == 1}
	return l, true
}

// ReadLabel returns the newer valid label of dev; ok is false when
// neither slot holds one. Errors are the device's.
func ReadLabel(dev device.Device) (l Label, ok bool, err error) {
	buf := make([]byte, ondisk.BlockSize)
	for i := range 2 {
		if _, err := dev.ReadAt(buf, LabelOff(i)); err != nil {
			return l, false, fmt.Errorf("mirror: reading label slot %d: %w", i, err)
		}
		if c, good := decodeLabel(buf); good && (!ok || c.Counter > l.Counter) {
			l, ok = c, true
		}
	}
	return l, ok, nil
}

// writeLabel writes l (as role r, counter bumped past prev) to dev and
// syncs it.
func writeLabel(dev device.Device, l Label, r Member, prev uint64) error {
	l.Role = r
	l.Counter = prev + 1
	if _, err := dev.WriteAt(l.encode(), LabelOff(int(l.Counter%2))); err != nil {
		return err
	}
	return dev.Sync()
}

// NewLabel returns the label of a new mirror (generation 1, both members
// in sync) of the set with the given nonce.
func NewLabel(nonce uint64) (Label, error) {
	l := Label{Nonce: nonce, Gen: 1}
	for i := range l.IDs {
		if _, err := rand.Read(l.IDs[i][:]); err != nil {
			return l, err
		}
	}
	return l, nil
}

// WriteNew writes the label of a new mirror to both members (each with its
// own role) and syncs them. Format calls it after erasing the superblock
// copies of both, so no old label survives.
func WriteNew(a, b device.Device, l Label) error {
	for r, dev := range []device.Device{a, b} {
		old, _, err := ReadLabel(dev)
		if err != nil {
			return err
		}
		if err := writeLabel(dev, l, Member(r), old.Counter); err != nil {
			return fmt.Errorf("mirror: writing the label of member %v: %w", Member(r), err)
		}
	}
	return nil
}
