// Package logwrites reads the log of the kernel's dm-log-writes target and
// replays it onto images, for power-cut tests of a whole machine (the method
// of xfstests generic/482).
//
// dm-log-writes passes writes through to its data device and appends each
// one, with its data, to a log device in the order the data would reach
// stable media: a plain write is appended only when a later FLUSH
// completes (writes completed before the FLUSH was submitted, then the FLUSH
// entry), a FUA write when it completes. A mark (`dmsetup message DEV 0 mark
// NAME`) is appended at once, so it lands before writes still waiting for a
// FLUSH. Replaying entries [0, i) onto an image that was all zeroes when
// logging began gives the data device's durable state at that point.
//
// # Log format
//
// (Documentation/admin-guide/device-mapper/log-writes.rst and
// drivers/md/dm-log-writes.c; integers little endian; the "sector size" is
// the data device's logical block size.)
//
//	byte 0:  super   magic u64 (0x6a736677736872), version u64 (1),
//	                 nr_entries u64, sectorsize u32; the rest of one
//	                 sector-size block is zero
//	then nr_entries times:
//	         entry   sector u64, nr_sectors u64, flags u64, data_len u64,
//	                 in one sector-size block; a mark's name follows the
//	                 32 bytes (data_len bytes)
//	         data    nr_sectors sector-size blocks (none for a discard or
//	                 a mark)
//
// sector and nr_sectors count sector-size blocks of the data device. The
// super's nr_entries is rewritten after each FUA write and mark, and when
// the target is removed; removing the target (dmsetup remove) before
// reading the log makes it count every entry.
//
// # Overlapping writes
//
// Log order is not the order in which overlapping writes reached the
// media. A plain write that completed before a FUA write to the same
// sectors was issued is logged after it, with the next FLUSH: replayed in
// log order, the older data would land on top. A Replayer replays it as the
// device holds it: the sectors a FUA write wrote since the last FLUSH entry
// are not overwritten by the plain writes (and discards) of the FLUSH that
// ends the interval. The log cannot tell that case from the other one, a
// plain write issued after an overlapping FUA write completed and completed
// itself before the next FLUSH was issued; that order is replayed wrongly
// (the FUA write's data stays). Writers that flush after a FUA write before
// writing the same sectors again (an O_DSYNC write to a block device is a
// FUA write and a FLUSH) never produce it.
package logwrites

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
)

// Flags of an entry.
const (
	FlagFlush    = 1 << 0
	FlagFUA      = 1 << 1
	FlagDiscard  = 1 << 2
	FlagMark     = 1 << 3
	FlagMetadata = 1 << 4
)

const (
	magic   = 0x6a736677736872
	version = 1
)

// ErrCorrupt marks a log that does not parse: a bad super, an entry running
// past the end of the log device, an impossible sector size.
var ErrCorrupt = errors.New("logwrites: corrupt log")

// Entry is one logged bio (or mark).
type Entry struct {
	Index     int
	Sector    uint64 // first sector-size block written on the data device
	NrSectors uint64 // sector-size blocks written (or discarded)
	Flags     uint64
	Mark      string // the mark's name, for a FlagMark entry
	dataOff   int64  // byte offset of the data in the log
}

// IsFlush reports a FLUSH (REQ_PREFLUSH) entry.
func (e Entry) IsFlush() bool { return e.Flags&FlagFlush != 0 }

// IsFUA reports a FUA write.
func (e Entry) IsFUA() bool { return e.Flags&FlagFUA != 0 }

// IsMark reports a mark.
func (e Entry) IsMark() bool { return e.Flags&FlagMark != 0 }

// IsDiscard reports a discard.
func (e Entry) IsDiscard() bool { return e.Flags&FlagDiscard != 0 }

// HasData reports an entry that writes data.
func (e Entry) HasData() bool { return !e.IsMark() && !e.IsDiscard() && e.NrSectors > 0 }

func (e Entry) String() string {
	var f []string
	for _, x := range []struct {
		bit  uint64
		name string
	}{{FlagFlush, "flush"}, {FlagFUA, "fua"}, {FlagDiscard, "discard"}, {FlagMark, "mark"}, {FlagMetadata, "meta"}} {
		if e.Flags&x.bit != 0 {
			f = append(f, x.name)
		}
	}
	s := fmt.Sprintf("#%d sector %d+%d", e.Index, e.Sector, e.NrSectors)
	if len(f) > 0 {
		s += " " + strings.Join(f, ",")
	}
	if e.IsMark() {
		s += " " + e.Mark
	}
	return s
}

// Log is a parsed log.
type Log struct {
	r          io.ReaderAt
	SectorSize int64
	Entries    []Entry
}

// Open parses the log held by r (size bytes: the log device).
func Open(r io.ReaderAt, size int64) (*Log, error) {
	var sb [28]byte
	if _, err := r.ReadAt(sb[:], 0); err != nil {
		return nil, fmt.Errorf("logwrites: reading the super: %w", err)
	}
	if m := binary.LittleEndian.Uint64(sb[0:]); m != magic {
		return nil, fmt.Errorf("%w: super magic %#x, want %#x (not a dm-log-writes log, or logging never started)", ErrCorrupt, m, uint64(magic))
	}
	if v := binary.LittleEndian.Uint64(sb[8:]); v != version {
		return nil, fmt.Errorf("%w: version %d, this reader knows %d", ErrCorrupt, v, version)
	}
	n := binary.LittleEndian.Uint64(sb[16:])
	ss := int64(binary.LittleEndian.Uint32(sb[24:]))
	if ss < 512 || ss > 64<<10 || ss&(ss-1) != 0 {
		return nil, fmt.Errorf("%w: sector size %d", ErrCorrupt, ss)
	}
	l := &Log{r: r, SectorSize: ss}
	off := ss
	hdr := make([]byte, ss)
	for i := uint64(0); i < n; i++ {
		if off+ss > size {
			return nil, fmt.Errorf("%w: entry %d of %d at byte %d is past the end of the log (%d bytes)", ErrCorrupt, i, n, off, size)
		}
		if _, err := r.ReadAt(hdr, off); err != nil {
			return nil, fmt.Errorf("logwrites: entry %d at byte %d: %w", i, off, err)
		}
		e := Entry{
			Index:     int(i),
			Sector:    binary.LittleEndian.Uint64(hdr[0:]),
			NrSectors: binary.LittleEndian.Uint64(hdr[8:]),
			Flags:     binary.LittleEndian.Uint64(hdr[16:]),
			dataOff:   off + ss,
		}
		dataLen := binary.LittleEndian.Uint64(hdr[24:])
		if e.IsMark() {
			if dataLen > uint64(ss-32) {
				return nil, fmt.Errorf("%w: entry %d: mark of %d bytes in a %d-byte entry", ErrCorrupt, i, dataLen, ss)
			}
			e.Mark = string(hdr[32 : 32+dataLen])
		}
		off += ss
		if e.HasData() {
			if e.NrSectors > uint64(size/ss) {
				return nil, fmt.Errorf("%w: entry %d: %d sectors", ErrCorrupt, i, e.NrSectors)
			}
			off += int64(e.NrSectors) * ss
			if off > size {
				return nil, fmt.Errorf("%w: entry %d's data ends at byte %d, past the end of the log (%d bytes)", ErrCorrupt, i, off, size)
			}
		}
		l.Entries = append(l.Entries, e)
	}
	return l, nil
}

// Data returns the entry's data (nil for an entry without).
func (l *Log) Data(e Entry) ([]byte, error) {
	if !e.HasData() {
		return nil, nil
	}
	b := make([]byte, int64(e.NrSectors)*l.SectorSize)
	if _, err := l.r.ReadAt(b, e.dataOff); err != nil {
		return nil, fmt.Errorf("logwrites: data of entry %d: %w", e.Index, err)
	}
	return b, nil
}

// Apply writes the entry onto dst, the image of the data device: its data,
// or zeroes for a discard (what a discard leaves is unspecified; zeroes is
// one of the allowed results). Marks and empty FLUSHes write nothing. With
// sectors >= 0, only the first sectors sector-size blocks of a write land: a
// torn write.
func (l *Log) Apply(dst io.WriterAt, e Entry, sectors int64) error {
	switch {
	case e.IsDiscard():
		z := make([]byte, 1<<20)
		for off, end := int64(e.Sector)*l.SectorSize, int64(e.Sector+e.NrSectors)*l.SectorSize; off < end; off += int64(len(z)) {
			n := min(int64(len(z)), end-off)
			if _, err := dst.WriteAt(z[:n], off); err != nil {
				return err
			}
		}
		return nil
	case !e.HasData():
		return nil
	}
	b, err := l.Data(e)
	if err != nil {
		return err
	}
	if sectors >= 0 && sectors*l.SectorSize < int64(len(b)) {
		b = b[:sectors*l.SectorSize]
	}
	_, err = dst.WriteAt(b, int64(e.Sector)*l.SectorSize)
	return err
}

// Replay applies entries [0, upto) onto dst with a Replayer; dst must hold
// what the data device held when logging began (all zeroes for a fresh
// device).
func (l *Log) Replay(dst io.WriterAt, upto int) error {
	if upto > len(l.Entries) {
		return fmt.Errorf("logwrites: replay up to entry %d of a log of %d", upto, len(l.Entries))
	}
	r := l.NewReplayer(dst)
	for _, e := range l.Entries[:upto] {
		if err := r.Apply(e, -1); err != nil {
			return fmt.Errorf("logwrites: replaying %v: %w", e, err)
		}
	}
	return nil
}

// extent is a range of sectors, [start, end).
type extent struct{ start, end uint64 }

// Replayer applies entries in log order onto an image of the data device,
// keeping the data of a FUA write from the plain writes and discards the
// log places after it in the same FLUSH interval (see "Overlapping writes"
// in the package comment).
type Replayer struct {
	l   *Log
	dst io.WriterAt
	fua []extent // sectors FUA writes wrote since the last FLUSH entry
	// Kept counts the sectors of plain writes and discards not applied
	// because a FUA write of their interval wrote them: the overlaps the
	// log order gets wrong.
	Kept int64
}

// NewReplayer returns a Replayer writing onto dst, at a FLUSH boundary (the
// start of a log, or right after a FLUSH entry).
func (l *Log) NewReplayer(dst io.WriterAt) *Replayer {
	return &Replayer{l: l, dst: dst}
}

// Apply applies e as Log.Apply does (sectors >= 0: a write torn after that
// many sectors), except for the sectors a FUA write of the current FLUSH
// interval wrote, which a plain write or discard leaves alone.
func (r *Replayer) Apply(e Entry, sectors int64) error {
	switch {
	case e.IsFlush() && !e.HasData():
		r.fua = r.fua[:0]
		return nil
	case e.IsFUA():
		if err := r.l.Apply(r.dst, e, sectors); err != nil {
			return err
		}
		n := e.NrSectors
		if sectors >= 0 && uint64(sectors) < n {
			n = uint64(sectors)
		}
		if n > 0 {
			r.fua = append(r.fua, extent{e.Sector, e.Sector + n})
		}
		return nil
	case !e.IsDiscard() && !e.HasData():
		return nil
	}
	end := e.Sector + e.NrSectors
	if sectors >= 0 && !e.IsDiscard() && uint64(sectors) < e.NrSectors {
		end = e.Sector + uint64(sectors)
	}
	free := []extent{{e.Sector, end}}
	for _, f := range r.fua {
		var next []extent
		for _, x := range free {
			if f.end <= x.start || f.start >= x.end {
				next = append(next, x)
				continue
			}
			if x.start < f.start {
				next = append(next, extent{x.start, f.start})
			}
			if f.end < x.end {
				next = append(next, extent{f.end, x.end})
			}
		}
		free = next
	}
	if len(free) == 1 && free[0] == (extent{e.Sector, end}) {
		return r.l.Apply(r.dst, e, sectors)
	}
	var data []byte
	if !e.IsDiscard() {
		var err error
		if data, err = r.l.Data(e); err != nil {
			return err
		}
	}
	applied := uint64(0)
	for _, x := range free {
		applied += x.end - x.start
		off := int64(x.start) * r.l.SectorSize
		n := int64(x.end-x.start) * r.l.SectorSize
		if e.IsDiscard() {
			z := make([]byte, min(n, 1<<20))
			for o := int64(0); o < n; o += int64(len(z)) {
				if _, err := r.dst.WriteAt(z[:min(int64(len(z)), n-o)], off+o); err != nil {
					return err
				}
			}
			continue
		}
		rel := int64(x.start-e.Sector) * r.l.SectorSize
		if _, err := r.dst.WriteAt(data[rel:rel+n], off); err != nil {
			return err
		}
	}
	r.Kept += int64(end-e.Sector) - int64(applied)
	return nil
}
