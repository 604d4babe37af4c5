package cache

import (
	"crypto/rand"
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// The on-disk types that are part of this package's API. Package ondisk
// holds them with their codecs.
type (
	Superblock  = ondisk.Superblock
	BackingInfo = ondisk.BackingInfo
	Mode        = ondisk.Mode
	Settings    = ondisk.Settings
	// WritebackOrder is Settings.WritebackOrder: OrderEpoch or OrderLBA.
	WritebackOrder = ondisk.WritebackOrder
)

// The cache modes (see Mode).
const (
	Writeback    = ondisk.Writeback
	Writethrough = ondisk.Writethrough
	Writearound  = ondisk.Writearound
	None         = ondisk.None
)

// The writeback orders (see WritebackOrder).
const (
	OrderEpoch = ondisk.OrderEpoch
	OrderLBA   = ondisk.OrderLBA
)

const (
	blockSize         = ondisk.BlockSize
	blockShift        = ondisk.BlockShift
	defaultBucketSize = 1 << 20
	minBuckets        = ondisk.MinBuckets
	minJournalLen     = ondisk.MinJournalLen
)

// SettingKeys lists the keys ParseSetting accepts, in display order.
var SettingKeys = ondisk.SettingKeys

// DefaultSettings are the settings of a freshly formatted volume.
func DefaultSettings() Settings { return ondisk.DefaultSettings() }

// ParseMode parses a mode name as printed by Mode.String.
func ParseMode(s string) (Mode, error) { return ondisk.ParseMode(s) }

// ParseSetting applies key=value to s. Sizes accept K, M, G suffixes.
func ParseSetting(s *Settings, key, value string) error { return ondisk.ParseSetting(s, key, value) }

// ReadSuperblock returns the newest valid superblock copy of cacheDev. It
// returns ErrNotFormatted (wrapped) when neither copy has the magic, and a
// corruption error when a copy has the magic but no copy is valid. On
// member B of a mirrored set (smaller than the layout it holds) it reads
// B's copy of the set's superblock.
func ReadSuperblock(cacheDev device.Device) (*Superblock, error) {
	sb, _, err := ondisk.ReadSuperblock(cacheDev)
	if err != nil && IsCorruption(err) && MirrorMember(cacheDev) == "B" {
		sb, _, err = ondisk.ReadSuperblock(mirror.LayoutSized{Device: cacheDev})
	}
	return sb, err
}

// MirrorMember returns "A" or "B" when dev is that member of a mirrored
// set (by its mirror label), else "".
func MirrorMember(dev device.Device) string {
	if l, ok, _ := memberLabel(dev); ok {
		return l.Role.String()
	}
	return ""
}

// memberLabel returns dev's mirror label; labelled is false when dev holds
// none, or only the one an attach of a mirror left on the set's one cache
// device when it stopped before the superblock said FeatureMirror
// (mirror.AttachLabel): that label means nothing. Errors are the device's.
func memberLabel(dev device.Device) (l mirror.Label, labelled bool, err error) {
	l, labelled, err = mirror.ReadLabel(dev)
	if err != nil || !labelled || l.Role != mirror.A {
		return l, labelled, err
	}
	if sb, _, err := ondisk.ReadSuperblock(dev); err == nil && !sb.HasFeature(ondisk.FeatureMirror) {
		return l, false, nil
	}
	return l, true, nil
}

// BackingSpec names a backing device supplied to Format or Open.
type BackingSpec struct {
	Name string
	Dev  device.Device
	// ID is a stable identity supplied by the caller (e.g. a UUID kept in
	// an xattr or a partition label). It may be empty; when both the
	// superblock and the spec have one, Open requires them to match.
	ID string
	// Path is recorded in the superblock at Format as a hint for finding
	// the device again; it is not checked.
	Path string
}

// FormatOptions configure Format.
type FormatOptions struct {
	BucketSize int64 // default 1 MiB; a multiple of 4 KiB, at least 8 KiB
	Mode       Mode  // initial mode of every volume (zero value: Writeback)
	Force      bool  // overwrite an existing cache set
	Progress   func(done, total int64)
	// CacheID is recorded as Superblock.CacheID: the cache device's own
	// identity (see there); may be empty.
	CacheID string
	// JournalSize is the journal region size; 0 picks cache size/64
	// clamped to [256 KiB, 64 MiB].
	JournalSize int64
	// DryRun makes Format refuse what it would refuse and return the
	// superblock it would write, writing nothing: a caller that records
	// identities on the devices first checks that the format goes ahead.
	DryRun bool
	// Mirror, when set, is the set's second cache device (B): every
	// metadata write and every dirty block is written to both, clean data
	// to the first only, so Mirror may be smaller (it needs the metadata
	// region and room for the dirty data: docs/OPERATIONS.md, "Mirrored
	// cache devices").
	Mirror device.Device
	// IndexPages formats the set with its index as pages on the cache
	// device (ondisk.FeaturePagedIndex): a checkpoint writes the index
	// pages that changed, then a root. Its metadata region is larger
	// (docs/CACHE.md, "Index pages on the cache device"), and the set
	// holds at most 40 volume slots.
	IndexPages bool
	// markShift, if not 0, is the mark region size (log2 of blocks)
	// instead of ondisk.DefaultMarkShift: tests use small regions.
	markShift uint8
}

// minDeviceSize is the smallest cache device Format lays out minBuckets
// buckets of bs on (journal length jl, 0 for the default): the bucket count
// Format starts its search from, and the layout of that many, must both
// fit.
func minDeviceSize(bs, jl, bpb int64) int64 {
	size := int64(0)
	for range 3 { // the default journal grows with the device
		j := jl
		if j == 0 {
			j = min(max(size/64, 256<<10), 64<<20)
		}
		head := 2*ondisk.SBCopySize + j
		per := bs + 2*(4+bpb*(ondisk.CkptEntrySize+ondisk.CkptEpochExtra))
		search := head + 2*ondisk.CkptSlotLen(0, bpb, ondisk.MaxBackings) + bs + minBuckets*per
		align := min(bs, 1<<20)
		layout := (head+2*ondisk.CkptSlotLen(minBuckets, bpb, ondisk.MaxBackings)+align-1)/align*align + minBuckets*bs
		size = (max(search, layout) + 4095) / 4096 * 4096
	}
	return size
}

// Format writes a new, empty cache set onto cacheDev. It writes only the
// cache device: backing devices keep their bytes (they are only measured).
func Format(cacheDev device.Device, backings []BackingSpec, opts FormatOptions) (*Superblock, error) {
	// No backing device is fine: they can be attached later (Set.Attach).
	if len(backings) > ondisk.MaxBackings {
		return nil, fmt.Errorf("%w: %d backing devices (want at most %d)", ErrInvalid, len(backings), ondisk.MaxBackings)
	}
	if !opts.Mode.Valid() {
		return nil, fmt.Errorf("%w: mode %v", ErrInvalid, opts.Mode)
	}
	if !opts.Force {
		sb, err := ReadSuperblock(cacheDev)
		if err == nil {
			u := sb.SetUUID
			return nil, fmt.Errorf("%w (set %x-%x-%x-%x-%x, %d backing devices); use force to overwrite", ErrAlreadyFormatted, u[0:4], u[4:6], u[6:8], u[8:10], u[10:16], sb.LiveBackings())
		}
		var ve *FormatVersionError
		if errors.As(err, &ve) {
			// A set this build cannot read may still hold the only copy
			// of dirty data: overwrite it only on purpose.
			return nil, fmt.Errorf("%w of format version %d, which this build does not read (it reads only %d): "+
				"write its dirty data back with the build that made it (tiercache flush, then stop), then use force to overwrite it",
				ErrAlreadyFormatted, ve.Found, ondisk.FormatVersion)
		}
		if !errors.Is(err, ErrNotFormatted) && !IsCorruption(err) {
			// The device could not be read: it may hold a set.
			return nil, fmt.Errorf("format: checking for an existing cache set: %w", err)
		}
	}
	progress := func(done int64) {
		if opts.Progress != nil {
			opts.Progress(done, 3)
		}
	}
	progress(0)
	bs := opts.BucketSize
	if bs == 0 {
		bs = defaultBucketSize
	}
	if bs < 2*blockSize || bs%blockSize != 0 || bs > 1<<30 {
		return nil, fmt.Errorf("%w: bucket size %d (want a multiple of 4096 between 8 KiB and 1 GiB)", ErrInvalid, bs)
	}
	devSize := cacheDev.Size()
	jl := opts.JournalSize
	if jl == 0 {
		jl = min(max(devSize/64, 256<<10), 64<<20)
	}
	jl = jl / blockSize * blockSize
	if jl < minJournalLen {
		return nil, fmt.Errorf("%w: journal size %d (at least %d)", ErrInvalid, jl, minJournalLen)
	}
	// New sets keep their clean cache warm across crashes (region marks).
	sb := &Superblock{Version: ondisk.FormatVersion, Seq: 1, BlockSize: blockSize, BucketSize: bs,
		JournalOff: 2 * ondisk.SBCopySize, JournalLen: jl, CacheID: opts.CacheID,
		Features: ondisk.FeatureWarmClean, MarkShift: ondisk.DefaultMarkShift}
	if opts.markShift != 0 {
		sb.MarkShift = opts.markShift
	}
	if _, err := rand.Read(sb.SetUUID[:]); err != nil {
		return nil, err
	}
	for _, b := range backings {
		if b.Dev == nil || b.Name == "" {
			return nil, fmt.Errorf("%w: backing %q without name or device", ErrInvalid, b.Name)
		}
		st := DefaultSettings()
		st.Mode = opts.Mode
		sb.Backings = append(sb.Backings, BackingInfo{Name: b.Name, ID: b.ID, Size: b.Dev.Size(), Path: b.Path, Settings: st})
	}
	// Solve for the bucket count: each bucket costs its size plus its share
	// of two checkpoint slots.
	bpb := bs / blockSize
	// Checkpoint slots have room for maxBackings volumes (a few KiB), so
	// that attach never needs a larger slot.
	fixed := sb.JournalOff + jl + 2*ondisk.CkptSlotLen(0, bpb, ondisk.MaxBackings) + bs
	per := bs + 2*(4+bpb*(ondisk.CkptEntrySize+ondisk.CkptEpochExtra))
	slotLen := func(n int64) int64 { return ondisk.CkptSlotLen(n, bpb, ondisk.MaxBackings) }
	if opts.IndexPages {
		if len(backings) > pages.MaxVolumes {
			return nil, fmt.Errorf("%w: %d backing devices (a set with index pages holds at most %d)", ErrInvalid, len(backings), pages.MaxVolumes)
		}
		if bpb > pages.MaxBucketBlocks {
			return nil, fmt.Errorf("%w: bucket size %d (a set with index pages takes buckets of at most %d bytes: the bucket table counts blocks in 16 bits)", ErrInvalid, bs, pages.MaxBucketBlocks*blockSize)
		}
		sb.Features |= ondisk.FeaturePagedIndex
		slotLen = func(n int64) int64 { return pages.SlotLen(n, bpb) }
		fixed = sb.JournalOff + jl + 2*pages.SlotLen(0, bpb) + bs
		per = bs + (2*(pages.SlotLen(1024, bpb)-pages.SlotLen(0, bpb))+1023)/1024
	}
	n := (devSize - fixed) / per
	for ; n >= minBuckets; n-- {
		sb.NBuckets = n
		sb.CkptOff[0] = sb.JournalOff + jl
		sb.CkptLen = slotLen(n)
		sb.CkptOff[1] = sb.CkptOff[0] + sb.CkptLen
		align := min(bs, 1<<20)
		sb.BucketsOff = (sb.CkptOff[1] + sb.CkptLen + align - 1) / align * align
		if sb.BucketsOff+n*bs <= devSize {
			break
		}
	}
	if n > ondisk.MaxCacheBlocks/bpb {
		n = ondisk.MaxCacheBlocks / bpb
		sb.NBuckets = n
	}
	if n < minBuckets {
		return nil, fmt.Errorf("%w: cache device of %d bytes holds fewer than %d buckets of %d bytes: it needs at least %d bytes (%.1f MiB) with this bucket size; a smaller bucket size needs less",
			ErrInvalid, devSize, minBuckets, bs, minDeviceSize(bs, opts.JournalSize, bpb), float64(minDeviceSize(bs, opts.JournalSize, bpb))/(1<<20))
	}
	if err := sb.Validate(devSize); err != nil {
		return nil, fmt.Errorf("format: computed layout invalid: %w", err)
	}
	if opts.Mirror != nil {
		if err := mirror.CheckSize(mirror.LayoutOf(sb), opts.Mirror.Size()); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		sb.Features |= ondisk.FeatureMirror
	}
	if opts.DryRun {
		if _, err := sb.Encode(); err != nil {
			return nil, fmt.Errorf("format: %w", err)
		}
		return sb, nil
	}
	// Empty checkpoint of generation 1, then the superblock copies.
	trees := make([]*index.Ptree, len(backings))
	for i := range trees {
		trees[i] = index.NewPtree()
	}
	// Destroy the superblock of any earlier set on the device first, and
	// make that durable: the steps below overwrite its checkpoint slots, and
	// a crash among them must not leave its superblock valid (it would open
	// from an older checkpoint, or none, and serve stale data). A crash from
	// here on leaves a device with no set, which Format accepts again.
	zero := make([]byte, blockSize)
	for _, dev := range []device.Device{cacheDev, opts.Mirror} {
		if dev == nil {
			continue
		}
		for _, off := range []int64{0, ondisk.SBCopySize, ondisk.JournalHeadOff(0), ondisk.JournalHeadOff(1), ondisk.LostWritesOff(0), ondisk.LostWritesOff(1), mirror.LabelOff(0), mirror.LabelOff(1)} {
			if _, err := dev.WriteAt(zero, off); err != nil {
				return nil, fmt.Errorf("format: erasing superblock copy at %d: %w", off, err)
			}
		}
		if err := dev.Sync(); err != nil {
			return nil, fmt.Errorf("format: %w", err)
		}
	}
	if opts.Mirror != nil {
		// From here on the metadata goes to both members.
		m, err := mirror.Format(cacheDev, opts.Mirror, sb)
		if err != nil {
			return nil, fmt.Errorf("format: %w", err)
		}
		cacheDev = m
	}
	// Invalidate the other slot so a stale checkpoint of an earlier set on
	// this device is never considered (the nonce would reject it too).
	if _, err := cacheDev.WriteAt(zero, sb.CkptOff[0]); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	h := ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: 1}
	if sb.HasFeature(ondisk.FeaturePagedIndex) {
		if err := pages.FormatSet(cacheDev, sb, len(backings)); err != nil {
			return nil, fmt.Errorf("format: %w", err)
		}
	} else if err := ondisk.WriteCheckpoint(cacheDev, sb, h, make([]uint32, n), make([]uint64, len(backings)), trees, nil); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(1)
	if err := ondisk.WriteSuperblock(cacheDev, sb); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(2)
	sb.Seq++
	if err := ondisk.WriteSuperblock(cacheDev, sb); err != nil {
		return nil, fmt.Errorf("format: %w", err)
	}
	progress(3)
	return sb.Clone(), nil
}
