package ondisk

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/tiercache/tiercache/device"
)

// The lost-writes record says which acknowledged writes a cache device
// failover lost: writes a client was told had succeeded (without a FLUSH
// after them) whose journal records never became durable. The set writes
// it at failover, the one write to a failed cache device, and keeps it
// until an operator acknowledges each failover it lists; `check` and
// `status` report it until then.
//
// Two slots, written alternately like the journal head (a torn write of
// one leaves the older record, which lists at least as much; an
// acknowledgement is a newer record without the acknowledged failovers):
// the second-to-last block of each superblock copy. Format zeroes both.
//
// Block layout (little-endian): magic "TCLOST" + version (u16, 1), crc32c
// of the bytes from offset 12 to 12+len (u32), len (u32), then nonce, N
// (write counter; the higher valid record wins), NextID (u64 each), the
// failover count (u16) and per failover: ID, Time (Unix ns), Dropped (u64
// each), Cause (str), the volume count (u16) and per volume: Name (str),
// Blocks (u64), More (u8), the range count (u16) and per range LBA and N
// (u64 each). Ranges are in 4 KiB blocks.
const (
	lostMagic   = "TCLOST"
	lostVersion = 1
	lostHdrLen  = 16
	// lostMaxCause bounds the recorded cause of a failover.
	lostMaxCause = 300
	// LostMaxRanges bounds the ranges recorded per volume and failover.
	LostMaxRanges = 32
)

// LostWritesOff returns the offset of lost-writes record slot i (0 or 1).
func LostWritesOff(i int) int64 { return int64(i+1)*SBCopySize - 2*BlockSize }

// LostWrites is a decoded lost-writes record.
type LostWrites struct {
	N      uint64 // write counter: the slot is N%2; the higher wins
	NextID uint64 // ID of the next failover recorded
	Nonce  uint64
	Events []LostEvent // unacknowledged failovers, oldest first
}

// LostEvent is one failover that lost acknowledged writes.
type LostEvent struct {
	ID   uint64
	Time int64 // Unix nanoseconds of the failover
	// Cause is why the set failed over (cut to lostMaxCause bytes).
	Cause string
	Vols  []LostVolume
	// Dropped counts volumes left out for want of room in the block.
	Dropped uint64
}

// LostVolume is what one volume lost in a failover.
type LostVolume struct {
	Name   string
	Blocks uint64      // 4 KiB blocks lost
	Ranges []LostRange // the first of them, sorted and merged
	More   bool        // the lost blocks extend beyond Ranges
}

// LostRange is a run of lost blocks: [LBA, LBA+N) in 4 KiB blocks.
type LostRange struct{ LBA, N uint64 }

// Encode returns the record as one block. Ranges and then whole volumes
// are left out (More, Dropped) when the record would not fit.
func (l LostWrites) Encode() []byte {
	for limit := LostMaxRanges; ; limit /= 2 {
		if b, ok := l.encode(limit, false); ok {
			return b
		}
		if limit == 0 {
			b, _ := l.encode(0, true)
			return b
		}
	}
}

// encode encodes with at most limit ranges per volume; with drop, it
// leaves out the volumes that do not fit.
func (l LostWrites) encode(limit int, drop bool) ([]byte, bool) {
	e := enc{b: make([]byte, lostHdrLen, BlockSize)}
	e.u64(l.Nonce)
	e.u64(l.N)
	e.u64(l.NextID)
	e.u16(uint16(len(l.Events)))
	for _, ev := range l.Events {
		cause := ev.Cause
		if len(cause) > lostMaxCause {
			cause = cause[:lostMaxCause]
		}
		e.u64(ev.ID)
		e.u64(uint64(ev.Time))
		dropAt := len(e.b)
		e.u64(ev.Dropped)
		e.str(cause)
		countAt := len(e.b)
		e.u16(uint16(len(ev.Vols)))
		for i, v := range ev.Vols {
			start := len(e.b)
			rs, more := v.Ranges, v.More
			if len(rs) > limit {
				rs, more = rs[:limit], true
			}
			name := v.Name
			if len(name) > MaxNameLen {
				name = name[:MaxNameLen]
			}
			e.str(name)
			e.u64(v.Blocks)
			if more {
				e.u8(1)
			} else {
				e.u8(0)
			}
			e.u16(uint16(len(rs)))
			for _, r := range rs {
				e.u64(r.LBA)
				e.u64(r.N)
			}
			if drop && len(e.b) > BlockSize {
				// This volume and the rest do not fit: count them.
				e.b = e.b[:start]
				le.PutUint64(e.b[dropAt:], ev.Dropped+uint64(len(ev.Vols)-i))
				le.PutUint16(e.b[countAt:], uint16(i))
				break
			}
		}
	}
	if len(e.b) > BlockSize {
		return nil, false
	}
	b := make([]byte, BlockSize)
	copy(b, e.b)
	copy(b, lostMagic)
	le.PutUint16(b[6:], lostVersion)
	le.PutUint32(b[12:], uint32(len(e.b)-lostHdrLen))
	le.PutUint32(b[8:], CRC32C(b[12:len(e.b)]))
	return b, true
}

// DecodeLostWrites returns the record in b: ok false if b holds no record
// of the set with this nonce (zeros, another set's, or a torn write); an
// error if it has the magic and a valid checksum but cannot be decoded (a
// version this code does not know).
func DecodeLostWrites(b []byte, nonce uint64, off int64) (LostWrites, bool, error) {
	var l LostWrites
	if len(b) < lostHdrLen || string(b[:6]) != lostMagic {
		return l, false, nil
	}
	n := int(le.Uint32(b[12:]))
	if n > len(b)-lostHdrLen || le.Uint32(b[8:]) != CRC32C(b[12:lostHdrLen+n]) {
		return l, false, nil
	}
	if v := le.Uint16(b[6:]); v != lostVersion {
		return l, false, Corruptf("lost-writes record", off, BlockSize, "unsupported version %d", v)
	}
	d := dec{b: b[lostHdrLen : lostHdrLen+n]}
	l.Nonce = d.u64()
	if l.Nonce != nonce {
		return LostWrites{}, false, nil
	}
	l.N = d.u64()
	l.NextID = d.u64()
	ne := int(d.u16())
	for i := 0; i < ne && !d.bad; i++ {
		ev := LostEvent{ID: d.u64(), Time: int64(d.u64() & (1<<63 - 1)), Dropped: d.u64(), Cause: d.str()}
		nv := int(d.u16())
		for j := 0; j < nv && !d.bad; j++ {
			v := LostVolume{Name: d.str(), Blocks: d.u64(), More: d.u8() == 1}
			nr := int(d.u16())
			for k := 0; k < nr && !d.bad; k++ {
				v.Ranges = append(v.Ranges, LostRange{LBA: d.u64(), N: d.u64()})
			}
			ev.Vols = append(ev.Vols, v)
		}
		l.Events = append(l.Events, ev)
	}
	if d.bad || d.remaining() != 0 {
		return LostWrites{}, false, Corruptf("lost-writes record", off, BlockSize, "malformed payload")
	}
	return l, true, nil
}

// ReadLostWrites returns the newest valid lost-writes record of the set
// (the zero record if neither slot holds one). A read error is returned:
// the unreadable slot may hold the newest record.
func ReadLostWrites(dev device.Device, sb *Superblock) (LostWrites, error) {
	best := LostWrites{Nonce: sb.Nonce()}
	buf := make([]byte, BlockSize)
	for i := 0; i < 2; i++ {
		off := LostWritesOff(i)
		if _, err := dev.ReadAt(buf, off); err != nil {
			return best, fmt.Errorf("reading lost-writes record %d at %d: %w", i, off, err)
		}
		l, ok, err := DecodeLostWrites(buf, sb.Nonce(), off)
		if err != nil {
			return best, err
		}
		if ok && l.N > best.N {
			best = l
		}
	}
	return best, nil
}

// WriteLostWrites writes l (with l.N already advanced) into slot l.N%2 and
// syncs.
func WriteLostWrites(dev device.Device, l LostWrites) error {
	off := LostWritesOff(int(l.N % 2))
	if _, err := dev.WriteAt(l.Encode(), off); err != nil {
		return fmt.Errorf("writing lost-writes record at %d: %w", off, err)
	}
	if err := dev.Sync(); err != nil {
		return fmt.Errorf("syncing lost-writes record: %w", err)
	}
	return nil
}

// ErrNoSuchLostEvent is returned by Ack for an ID the record does not
// hold.
var ErrNoSuchLostEvent = errors.New("cache: no such unacknowledged failover")

// Ack returns l without the failovers ids and with its write counter
// advanced, to be written with WriteLostWrites. Every id must be in l:
// otherwise it returns l and ErrNoSuchLostEvent.
func (l LostWrites) Ack(ids []uint64) (LostWrites, error) {
	for _, id := range ids {
		if !slices.ContainsFunc(l.Events, func(e LostEvent) bool { return e.ID == id }) {
			return l, fmt.Errorf("%w: %d", ErrNoSuchLostEvent, id)
		}
	}
	next := l
	next.Events = slices.DeleteFunc(slices.Clone(l.Events), func(e LostEvent) bool { return slices.Contains(ids, e.ID) })
	next.N++
	return next, nil
}

// FormatRanges lists the volume's lost ranges in bytes, "[off,+len)",
// with " ..." when the lost blocks extend beyond them.
func (v LostVolume) FormatRanges() string {
	out := ""
	for i, r := range v.Ranges {
		if i > 0 {
			out += " "
		}
		out += fmt.Sprintf("[%d,+%d)", r.LBA*BlockSize, r.N*BlockSize)
	}
	if v.More {
		out += " ..."
	}
	return out
}

// Describe is one line per volume of the failover's lost writes, for
// check and status.
func (ev LostEvent) Describe() []string {
	var out []string
	at := time.Unix(0, ev.Time).UTC().Format(time.RFC3339)
	for _, v := range ev.Vols {
		out = append(out, fmt.Sprintf("cache device failover %d at %s lost %d bytes of acknowledged writes to volume %q (never made durable; not on the backing device): %s",
			ev.ID, at, v.Blocks*BlockSize, v.Name, v.FormatRanges()))
	}
	if ev.Dropped > 0 {
		out = append(out, fmt.Sprintf("cache device failover %d at %s lost writes to %d more volume(s) (left out of the record for want of room)", ev.ID, at, ev.Dropped))
	}
	return out
}
