package ondisk

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/device"
)

// ErrCorrupt marks metadata on the cache device that fails validation:
// a superblock, checkpoint or journal block whose checksum or contents are
// wrong where a crash cannot explain it. Test with IsCorruption.
var ErrCorrupt = errors.New("cache: corrupt metadata")

// ErrChecksum marks cached data whose checksum does not match. Clean data is
// re-read from the backing device instead; only dirty data, which exists
// nowhere else, surfaces this error to a client (invariant 4).
var ErrChecksum = errors.New("cache: data checksum mismatch")

// ErrNotFormatted is returned when neither superblock copy is valid.
var ErrNotFormatted = errors.New("cache: no valid superblock on cache device")

// ErrInvalid is returned for arguments that cannot be honoured (bad sizes,
// unknown mode, too many backings).
var ErrInvalid = errors.New("cache: invalid argument")

// CorruptionError gives the context of a checksum or validation failure.
// It wraps ErrCorrupt (metadata) or ErrChecksum (cached data).
type CorruptionError struct {
	Err    error  // ErrCorrupt or ErrChecksum
	Device string // "cache" or the backing name
	What   string // superblock, checkpoint, journal, data, ...
	Offset int64  // byte offset on Device
	Length int64
	// Expected and Actual are CRC32C values when HaveSums is set.
	Expected, Actual uint32
	HaveSums         bool
	Detail           string
}

func (e *CorruptionError) Error() string {
	s := fmt.Sprintf("%v: %s on %s at offset %d length %d", e.Err, e.What, e.Device, e.Offset, e.Length)
	if e.Offset < 0 {
		s = fmt.Sprintf("%v: %s on %s", e.Err, e.What, e.Device) // place not known to the decoder
	}
	if e.HaveSums {
		s += fmt.Sprintf(": CRC32C expected %#08x, actual %#08x", e.Expected, e.Actual)
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

func (e *CorruptionError) Unwrap() error { return e.Err }

// Corruptf returns a corruption error of the cache device at off.
func Corruptf(what string, off, length int64, format string, args ...any) error {
	return &CorruptionError{Err: ErrCorrupt, Device: "cache", What: what, Offset: off, Length: length,
		Detail: fmt.Sprintf(format, args...)}
}

// Badf is Corruptf for a decoder, which does not know where on the device
// its bytes came from: the caller names the place with Placed.
func Badf(what, format string, args ...any) error {
	return &CorruptionError{Err: ErrCorrupt, Device: "cache", What: what, Offset: -1,
		Detail: fmt.Sprintf(format, args...)}
}

// Placed fills in the place of a corruption error built by Badf and returns
// err; other errors are returned unchanged.
func Placed(err error, off, length int64) error {
	var ce *CorruptionError
	if errors.As(err, &ce) && ce.Offset < 0 {
		ce.Offset, ce.Length = off, length
	}
	return err
}

// FormatVersionError is returned by Open (and ReadSuperblock) for an intact
// superblock of a format version this binary does not read: a set made by
// a pre-release build (version 2) or by a newer one. Nothing is written.
type FormatVersionError struct {
	Found  uint32 // the superblock's version
	Offset int64  // the copy's offset
}

func (e *FormatVersionError) Error() string {
	if e.Found < FormatVersion {
		return fmt.Sprintf("cache: superblock at %d is format version %d, this build reads only version %d: "+
			"the set was made by a pre-release build; write its dirty data back with that build "+
			"(tiercache flush, then stop), then format the device again with this one", e.Offset, e.Found, FormatVersion)
	}
	return fmt.Sprintf("cache: superblock at %d is format version %d, this build reads only version %d: "+
		"the set was made by a newer build; open it with that build", e.Offset, e.Found, FormatVersion)
}

// Repairer is a cache device that holds a second copy of the metadata
// region (a mirrored set's two members): a metadata block that fails its
// check is read from the other copy. RepairFrom reports whether p holds a
// copy good accepts now, the bad copy having been rewritten with it.
type Repairer interface {
	RepairFrom(p []byte, off int64, good func([]byte) bool) bool
}

// repair is dev's RepairFrom, false when dev has no second copy.
func repair(dev device.Device, p []byte, off int64, good func([]byte) bool) bool {
	r, ok := dev.(Repairer)
	return ok && r.RepairFrom(p, off, good)
}
