// Package ondisk holds the on-disk formats of a cache set and their codecs:
// the superblock (two alternating copies), the journal (framed 4 KiB blocks
// of records), the checkpoints (two alternating slots) and the volume
// settings stored in the superblock. It knows the layout and the checksums
// and returns typed corruption errors for anything it refuses; it knows
// nothing of an open set. The byte layout is described in package cache's
// doc.go.
package ondisk

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

// Superblock is the static description of a cache set: its identity, its
// layout on the cache device and the backing devices it serves. It changes
// rarely (mode changes, clean-shutdown flag), and every change writes the
// older of the two copies with the next sequence number (bbolt's meta pages),
// so a torn superblock write always leaves the other copy intact.
type Superblock struct {
	Version    uint32
	Seq        uint64   // higher wins; copies alternate
	SetUUID    [16]byte // identity of the cache set
	BlockSize  int64    // always 4096
	BucketSize int64
	NBuckets   int64
	JournalOff int64 // journal region (circular)
	JournalLen int64
	CkptOff    [2]int64 // two checkpoint slots, written alternately
	CkptLen    int64
	BucketsOff int64 // first bucket
	Clean      bool  // set by Close after a final checkpoint; cleared by Open
	Backings   []BackingInfo
	// CacheID is the identity of the cache device itself (the caller's, as
	// for BackingInfo.ID): a copy of the cache device holds the same set,
	// and opening the copy must not write its stale dirty data into the
	// original's backing devices. Empty: none recorded (the device had no
	// identity, or the set predates the field). Kept in an optional
	// trailer after the settings trailer.
	CacheID string
	// Features are the format features the set uses (Feature*), in the
	// features trailer; a feature bit this binary does not know is
	// refused as corruption.
	Features uint64
	// CleanUntrusted says that the backing devices may have been written
	// where the journal does not show it (a failover wrote around a dead
	// cache device): the next recovery drops every clean entry, marks or
	// not. Open clears it once it has recovered cold.
	CleanUntrusted bool
	// MarkShift is the size of a mark region, log2 of its blocks
	// (DefaultMarkShift: 1 GiB).
	MarkShift uint8
}

// Format features (Superblock.Features).
const (
	// FeatureWarmClean is set by Format on every set and read by no one:
	// region marks (RecMark) are part of the format's definition
	// (docs/CACHE.md, "Recovery"). It stays known so that the sets
	// formatted with it open.
	FeatureWarmClean = 1 << 0
	// FeatureMirror: the set's metadata and dirty data are mirrored on two
	// devices, whose mirror labels (cache/internal/mirror) say which is
	// current. A binary without it must not open either alone.
	FeatureMirror = 1 << 1
	// FeaturePagedIndex: the two checkpoint slots together are one page
	// area (cache/internal/pages) holding the index as copy-on-write
	// pages under a root; a checkpoint writes the pages that changed,
	// then the root (docs/CACHE.md, "Index pages on the cache device").
	FeaturePagedIndex = 1 << 2
	// KnownFeatures are the features this binary reads and writes.
	KnownFeatures = FeatureWarmClean | FeatureMirror | FeaturePagedIndex
)

// Mark regions: DefaultMarkShift (2^18 blocks, 1 GiB) unless Format was
// told otherwise (tests use small regions), at most MaxMarkShift.
const (
	DefaultMarkShift = 18
	MaxMarkShift     = 30
)

// HasFeature reports whether the set uses feature f.
func (sb *Superblock) HasFeature(f uint64) bool { return sb.Features&f != 0 }

// HasIndexPages reports whether the set keeps its index as pages
// (FeaturePagedIndex).
func (sb *Superblock) HasIndexPages() bool { return sb.HasFeature(FeaturePagedIndex) }

// BackingInfo identifies one backing device of the set (invariant 6).
//
// Its index in Superblock.Backings is the volume's slot: journal records,
// checkpoints and the in-memory owner keys name volumes by slot, so a slot
// never changes while its volume is in the set. Detach leaves a free slot
// (the zero BackingInfo: empty name, size 0) where the volume was, unless it
// was the last one; attach fills the first free slot or appends one.
type BackingInfo struct {
	Name string
	ID   string // caller-supplied stable identity; may be empty
	// Path is where the device was found at Format: a hint that lets
	// `serve --cache` find it again. Identity is checked by ID and Size,
	// never by path.
	Path string
	Size int64
	// Settings are the volume's mode and policy tunables (the mode is
	// stored with the backing record, the rest in a section after the
	// backing list).
	Settings Settings
	// InconsistentSince is when (Unix nanoseconds) the volume's backing
	// device stopped holding the image of some client flush (writeback
	// left epoch order); 0 while it holds one.
	InconsistentSince int64
}

// Free reports whether the record is a free slot left by a detach.
func (b BackingInfo) Free() bool { return b.Name == "" }

// LiveBackings counts the backing devices in the set (free slots left out).
func (sb *Superblock) LiveBackings() int {
	n := 0
	for _, b := range sb.Backings {
		if !b.Free() {
			n++
		}
	}
	return n
}

const (
	BlockSize  = 4096
	BlockShift = 12
	SBCopySize = 64 << 10
	// SBMaxEncoded: the last three blocks of each copy hold a mirror
	// label slot (cache/internal/mirror, FeatureMirror), a lost-writes
	// record slot (lostwrites.go) and a journal head record slot
	// (journalhead.go).
	SBMaxEncoded = SBCopySize - 3*BlockSize
	SBHeaderSize = 24
	SBMagic      = "TIERCSB\x01"
	// FormatVersion is the only superblock version this binary reads or
	// writes; no earlier format was released (FormatVersionError).
	FormatVersion = 4
	MaxBackings   = 64
	sbSettingsTag = 0x53455454 // "SETT": the per-backing settings section
	sbCacheIDTag  = 0x44494143 // "CAID": the cache device identity section
	MaxNameLen    = 255
	MaxPathLen    = 4096
	// MaxLBABlocks bounds a backing device: the index packs LBAs into 40
	// bits (4 PiB of 4 KiB blocks; see ptree.go).
	MaxLBABlocks = index.MaxLBA
	// MaxCacheBlocks: the dirty flag lives in the top bit of a 32-bit cache
	// block number.
	MaxCacheBlocks = 1 << 31
	// MinBuckets and MinJournalLen bound the smallest layout.
	MinBuckets    = 4
	MinJournalLen = 64 << 10
)

// The features section.
const (
	sbFeatureTag         = 0x54414546 // "FEAT": the features section (always present)
	sbFlagCleanUntrusted = 1 << 0     // flag: Superblock.CleanUntrusted
)

// Nonce derives the 64-bit value that tags journal blocks and checkpoints
// of this set, so that metadata left over from an earlier Format of the same
// device is never mistaken for ours.
func (sb *Superblock) Nonce() uint64 { return le.Uint64(sb.SetUUID[:8]) ^ le.Uint64(sb.SetUUID[8:]) }

func (sb *Superblock) BlocksPerBucket() int64 { return sb.BucketSize / BlockSize }

func (sb *Superblock) Encode() ([]byte, error) {
	e := enc{b: make([]byte, SBHeaderSize, 1024)}
	e.u64(sb.Seq)
	e.b = append(e.b, sb.SetUUID[:]...)
	e.u32(uint32(sb.BlockSize))
	e.u64(uint64(sb.BucketSize))
	e.u64(uint64(sb.NBuckets))
	e.u64(uint64(sb.JournalOff))
	e.u64(uint64(sb.JournalLen))
	e.u64(uint64(sb.CkptOff[0]))
	e.u64(uint64(sb.CkptOff[1]))
	e.u64(uint64(sb.CkptLen))
	e.u64(uint64(sb.BucketsOff))
	if sb.Clean {
		e.u8(1)
	} else {
		e.u8(0)
	}
	if len(sb.Backings) > MaxBackings {
		return nil, fmt.Errorf("%w: %d backing devices, at most %d", ErrInvalid, len(sb.Backings), MaxBackings)
	}
	e.u16(uint16(len(sb.Backings)))
	for _, b := range sb.Backings {
		if len(b.Name) > MaxNameLen || len(b.ID) > MaxNameLen || len(b.Path) > MaxPathLen {
			return nil, fmt.Errorf("%w: backing name or id longer than %d bytes, or path longer than %d", ErrInvalid, MaxNameLen, MaxPathLen)
		}
		e.str(b.Name)
		e.str(b.ID)
		e.u64(uint64(b.Size))
		e.u8(uint8(b.Settings.Mode))
		e.str(b.Path)
	}
	// Settings section: tag, then one record per backing in the same order.
	e.u32(sbSettingsTag)
	for _, b := range sb.Backings {
		st := b.Settings
		if st.WritebackOrder == 0 && st.Promote == "" {
			st = DefaultSettings() // a BackingInfo built without settings
		}
		e.u64(uint64(st.SequentialCutoff))
		e.u8(uint8(st.WritebackPercent))
		e.str(st.WritebackOrder.String())
		e.str(st.Promote)
		e.u64(uint64(st.WritebackRateMax))
		e.u64(uint64(b.InconsistentSince))
	}
	if sb.CacheID != "" {
		if len(sb.CacheID) > MaxPathLen {
			return nil, fmt.Errorf("%w: cache device id longer than %d bytes", ErrInvalid, MaxPathLen)
		}
		e.u32(sbCacheIDTag)
		e.str(sb.CacheID)
	}
	if sb.Features&^KnownFeatures != 0 {
		return nil, fmt.Errorf("%w: unknown format features %#x", ErrInvalid, sb.Features&^KnownFeatures)
	}
	e.u32(sbFeatureTag)
	e.u64(sb.Features)
	flags := uint64(0)
	if sb.CleanUntrusted {
		flags |= sbFlagCleanUntrusted
	}
	e.u64(flags)
	if sb.MarkShift > MaxMarkShift {
		return nil, fmt.Errorf("%w: mark region shift %d", ErrInvalid, sb.MarkShift)
	}
	e.u8(sb.MarkShift)
	b := e.b
	if len(b) > SBMaxEncoded {
		return nil, fmt.Errorf("%w: superblock of %d bytes exceeds its %d-byte slot (too many backings or long paths)", ErrInvalid, len(b), SBMaxEncoded)
	}
	copy(b[0:8], SBMagic)
	le.PutUint32(b[8:], FormatVersion)
	le.PutUint32(b[12:], uint32(len(b)-SBHeaderSize))
	le.PutUint32(b[16:], 0)
	le.PutUint32(b[16:], CRC32C(b))
	return b, nil
}

// DecodeSuperblock parses one superblock copy. Any failure wraps ErrCorrupt
// (or ErrNotFormatted when the magic is absent). off is only for messages.
func DecodeSuperblock(b []byte, off int64) (*Superblock, error) {
	if len(b) < SBHeaderSize || string(b[0:8]) != SBMagic {
		return nil, ErrNotFormatted
	}
	version := le.Uint32(b[8:])
	plen := int(le.Uint32(b[12:]))
	if plen > len(b)-SBHeaderSize || plen > SBMaxEncoded-SBHeaderSize {
		return nil, Corruptf("superblock", off, SBCopySize, "payload length %d too large", plen)
	}
	want := le.Uint32(b[16:])
	tmp := make([]byte, SBHeaderSize+plen)
	copy(tmp, b)
	le.PutUint32(tmp[16:], 0)
	if got := CRC32C(tmp); got != want {
		return nil, &CorruptionError{Err: ErrCorrupt, Device: "cache", What: "superblock", Offset: off,
			Length: int64(SBHeaderSize + plen), Expected: want, Actual: got, HaveSums: true}
	}
	if version != FormatVersion {
		return nil, &FormatVersionError{Found: version, Offset: off}
	}
	d := dec{b: b[SBHeaderSize : SBHeaderSize+plen]}
	sb := &Superblock{Version: version}
	sb.Seq = d.u64()
	copy(sb.SetUUID[:], d.take(16))
	sb.BlockSize = int64(d.u32())
	sb.BucketSize = int64(d.u64())
	sb.NBuckets = int64(d.u64())
	sb.JournalOff = int64(d.u64())
	sb.JournalLen = int64(d.u64())
	sb.CkptOff[0] = int64(d.u64())
	sb.CkptOff[1] = int64(d.u64())
	sb.CkptLen = int64(d.u64())
	sb.BucketsOff = int64(d.u64())
	sb.Clean = d.u8() == 1
	n := int(d.u16())
	if n > MaxBackings {
		return nil, Corruptf("superblock", off, SBCopySize, "%d backings", n)
	}
	for i := 0; i < n && !d.bad; i++ {
		var bi BackingInfo
		bi.Name = d.str()
		bi.ID = d.str()
		bi.Size = int64(d.u64())
		bi.Settings.Mode = Mode(d.u8())
		bi.Path = d.str()
		sb.Backings = append(sb.Backings, bi)
	}
	if tag := d.u32(); !d.bad && tag != sbSettingsTag {
		return nil, Corruptf("superblock", off, SBCopySize, "settings section tag %#x, expected %#x", tag, sbSettingsTag)
	}
	for i := range sb.Backings {
		var err error
		b := &sb.Backings[i]
		st := &b.Settings
		st.SequentialCutoff = int64(d.u64() & (1<<62 - 1))
		st.WritebackPercent = int(d.u8())
		order := d.str()
		st.Promote = d.str()
		st.WritebackRateMax = int64(d.u64() & (1<<62 - 1))
		b.InconsistentSince = int64(d.u64() & (1<<63 - 1))
		if st.WritebackOrder, err = ParseWritebackOrder(order); err != nil && !d.bad {
			return nil, Corruptf("superblock", off, SBCopySize, "backing %d settings: %v", i, err)
		}
	}
	// Optional trailers, each once, in this order.
	tag := uint32(0)
	if !d.bad && d.remaining() > 0 {
		tag = d.u32()
	}
	if tag == sbCacheIDTag {
		sb.CacheID = d.str()
		tag = 0
		if !d.bad && d.remaining() > 0 {
			tag = d.u32()
		}
	}
	haveFeatures := tag == sbFeatureTag
	if haveFeatures {
		sb.Features = d.u64()
		flags := d.u64()
		sb.CleanUntrusted = flags&sbFlagCleanUntrusted != 0
		sb.MarkShift = d.u8()
		switch {
		case d.bad:
		case sb.Features&^KnownFeatures != 0:
			return nil, Corruptf("superblock", off, SBCopySize, "unsupported format features %#x", sb.Features&^KnownFeatures)
		case flags&^sbFlagCleanUntrusted != 0:
			return nil, Corruptf("superblock", off, SBCopySize, "unknown superblock flags %#x", flags)
		case sb.MarkShift > MaxMarkShift:
			return nil, Corruptf("superblock", off, SBCopySize, "mark region shift %d", sb.MarkShift)
		}
		tag = 0
	}
	if tag != 0 {
		return nil, Corruptf("superblock", off, SBCopySize, "unknown trailer %#x", tag)
	}
	if !d.bad && !haveFeatures {
		return nil, Corruptf("superblock", off, SBCopySize, "no features section")
	}
	for i := range sb.Backings {
		if err := sb.Backings[i].Settings.Validate(); err != nil && !d.bad {
			return nil, Corruptf("superblock", off, SBCopySize, "backing %d settings: %v", i, err)
		}
	}
	if d.bad || d.remaining() != 0 {
		return nil, Corruptf("superblock", off, SBCopySize, "malformed payload")
	}
	if err := sb.ValidateAt(-1, off); err != nil {
		return nil, err
	}
	return sb, nil
}

// validate checks the layout for internal consistency, and against the
// device size when devSize >= 0. Data from disk goes through here before any
// of it is used as an offset.
func (sb *Superblock) Validate(devSize int64) error { return sb.ValidateAt(devSize, -1) }

// ValidateAt is Validate for the copy at offset off (named in errors; -1:
// not on a device).
func (sb *Superblock) ValidateAt(devSize, off int64) error {
	bad := func(f string, a ...any) error { return Corruptf("superblock", off, SBCopySize, f, a...) }
	if sb.BlockSize != BlockSize {
		return bad("block size %d", sb.BlockSize)
	}
	if sb.BucketSize < 2*BlockSize || sb.BucketSize%BlockSize != 0 || sb.BucketSize > 1<<30 {
		return bad("bucket size %d", sb.BucketSize)
	}
	if sb.NBuckets < MinBuckets || sb.NBuckets*sb.BlocksPerBucket() > MaxCacheBlocks {
		return bad("%d buckets", sb.NBuckets)
	}
	if sb.JournalOff != 2*SBCopySize || sb.JournalLen < MinJournalLen || sb.JournalLen%BlockSize != 0 || sb.JournalLen > 1<<40 {
		return bad("journal region %d+%d", sb.JournalOff, sb.JournalLen)
	}
	if sb.CkptOff[0] != sb.JournalOff+sb.JournalLen || sb.CkptLen < CkptSlotLen(sb.NBuckets, sb.BlocksPerBucket(), len(sb.Backings)) ||
		sb.CkptLen%BlockSize != 0 || sb.CkptOff[1] != sb.CkptOff[0]+sb.CkptLen || sb.CkptLen > 1<<40 {
		return bad("checkpoint slots %v+%d", sb.CkptOff, sb.CkptLen)
	}
	if sb.BucketsOff < sb.CkptOff[1]+sb.CkptLen || sb.BucketsOff%BlockSize != 0 || sb.BucketsOff > 1<<50 {
		return bad("bucket area at %d", sb.BucketsOff)
	}
	end := sb.BucketsOff + sb.NBuckets*sb.BucketSize
	if devSize >= 0 && end > devSize {
		return bad("layout ends at %d beyond device size %d", end, devSize)
	}
	for i, b := range sb.Backings {
		if b.Free() {
			if b.Size != 0 || b.ID != "" || b.Path != "" || i == len(sb.Backings)-1 {
				return bad("backing %d: free slot with size %d, id %q, path %q, or last in the list", i, b.Size, b.ID, b.Path)
			}
			continue
		}
		if b.Size <= 0 || (b.Size+BlockSize-1)/BlockSize >= MaxLBABlocks || !b.Settings.Mode.Valid() || b.Name == "" {
			return bad("backing %d (%q): size %d mode %d", i, b.Name, b.Size, b.Settings.Mode)
		}
		for _, o := range sb.Backings[:i] {
			if o.Name == b.Name {
				return bad("duplicate backing name %q", b.Name)
			}
		}
	}
	return nil
}

// ReadSuperblock returns the newest valid superblock copy of dev and which
// copy (0 or 1) it is. It returns ErrNotFormatted (wrapped) when neither
// copy has the magic, and a corruption error when a copy has the magic but
// no copy is valid.
func ReadSuperblock(dev device.Device) (*Superblock, int, error) {
	if dev.Size() < 2*SBCopySize {
		return nil, 0, fmt.Errorf("%w: cache device of %d bytes", ErrNotFormatted, dev.Size())
	}
	var best *Superblock
	bestIdx := 0
	var errs [2]error
	for i := 0; i < 2; i++ {
		off := int64(i) * SBCopySize
		buf := make([]byte, BlockSize)
		_, err := dev.ReadAt(buf, off)
		if err == nil && string(buf[:8]) == SBMagic {
			if n := SBHeaderSize + int(le.Uint32(buf[12:])); n > BlockSize && n <= SBMaxEncoded {
				buf = make([]byte, (n+BlockSize-1)/BlockSize*BlockSize)
				_, err = dev.ReadAt(buf, off)
			}
		}
		if err != nil {
			// Not a damaged copy but an unreadable one: it may be the
			// newer, and falling back to the other would silently revert
			// the set to older settings. Refuse instead.
			return nil, 0, fmt.Errorf("reading superblock copy %d at %d: %w", i, off, err)
		}
		decode := func(b []byte) (*Superblock, error) {
			sb, err := DecodeSuperblock(b, off)
			if err == nil {
				err = sb.ValidateAt(dev.Size(), off)
			}
			return sb, err
		}
		sb, err := decode(buf)
		if err != nil && !errors.Is(err, ErrNotFormatted) {
			// A damaged copy: the other member of a mirror may hold it
			// intact (read at the longest encoding: the length in a
			// damaged header may be wrong).
			all := make([]byte, SBMaxEncoded/BlockSize*BlockSize)
			if repair(dev, all, off, func(b []byte) bool { _, err := decode(b); return err == nil }) {
				sb, err = decode(all)
			}
		}
		if err != nil {
			errs[i] = err
			continue
		}
		if best == nil || sb.Seq > best.Seq {
			best, bestIdx = sb, i
		}
	}
	if best != nil {
		return best, bestIdx, nil
	}
	if errors.Is(errs[0], ErrNotFormatted) && errors.Is(errs[1], ErrNotFormatted) {
		return nil, 0, ErrNotFormatted
	}
	for _, err := range errs {
		var ve *FormatVersionError
		if errors.As(err, &ve) {
			return nil, 0, ve
		}
	}
	return nil, 0, fmt.Errorf("no valid superblock: copy 0: %v; copy 1: %w", errs[0], errs[1])
}

// WriteSuperblock writes sb (with sb.Seq already advanced) into copy
// sb.Seq%2, then syncs. The other copy still holds the previous version.
func WriteSuperblock(dev device.Device, sb *Superblock) error {
	b, err := sb.Encode()
	if err != nil {
		return err
	}
	// Only the blocks holding the encoding: decode ignores what follows.
	buf := make([]byte, (len(b)+BlockSize-1)/BlockSize*BlockSize)
	copy(buf, b)
	off := int64(sb.Seq%2) * SBCopySize
	if _, err := dev.WriteAt(buf, off); err != nil {
		return fmt.Errorf("writing superblock copy at %d: %w", off, err)
	}
	if err := dev.Sync(); err != nil {
		return fmt.Errorf("syncing superblock: %w", err)
	}
	return nil
}

func (sb *Superblock) Clone() *Superblock {
	c := *sb
	c.Backings = append([]BackingInfo(nil), sb.Backings...)
	return &c
}
