package cache

import (
	"errors"
	"fmt"
)

// ErrCorrupt marks metadata on the cache device that fails validation:
// a superblock, checkpoint or journal block whose checksum or contents are
// wrong where a crash cannot explain it. Test with IsCorruption.
var ErrCorrupt = errors.New("cache: corrupt metadata")

// ErrChecksum marks cached data whose checksum does not match. Clean data is
// re-read from the backing device instead; only dirty data, which exists
// nowhere else, surfaces this error to a client (invariant 4).
var ErrChecksum = errors.New("cache: data checksum mismatch")

// ErrAlreadyFormatted is returned by Format when the cache device already
// holds a valid superblock and FormatOptions.Force is not set.
var ErrAlreadyFormatted = errors.New("cache: device already holds a cache set")

// ErrNotFormatted is returned when neither superblock copy is valid.
var ErrNotFormatted = errors.New("cache: no valid superblock on cache device")

// ErrBackingMismatch is returned by Open when a backing device does not match
// the superblock (invariant 6). The error is a *BackingMismatchError.
var ErrBackingMismatch = errors.New("cache: backing device does not match cache set")

// ErrClosed is returned for I/O on a closed Set.
var ErrClosed = errors.New("cache: set is closed")

// ErrDetached is returned for calls on a volume after Detach removed it
// from the set.
var ErrDetached = errors.New("cache: volume detached from the cache set")

// ErrExists is returned by Attach for a name or device already in the set.
var ErrExists = errors.New("cache: already in the cache set")

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
	// Expected and Actual are crc32c values when HaveSums is set.
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
		s += fmt.Sprintf(": crc32c expected %#08x, actual %#08x", e.Expected, e.Actual)
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

func (e *CorruptionError) Unwrap() error { return e.Err }

// IsCorruption reports whether err stems from corrupt metadata or data.
func IsCorruption(err error) bool {
	return errors.Is(err, ErrCorrupt) || errors.Is(err, ErrChecksum)
}

func corruptf(what string, off, length int64, format string, args ...any) error {
	return &CorruptionError{Err: ErrCorrupt, Device: "cache", What: what, Offset: off, Length: length,
		Detail: fmt.Sprintf(format, args...)}
}

// badf is corruptf for a decoder, which does not know where on the device
// its bytes came from: the caller names the place with placed.
func badf(what, format string, args ...any) error {
	return &CorruptionError{Err: ErrCorrupt, Device: "cache", What: what, Offset: -1,
		Detail: fmt.Sprintf(format, args...)}
}

// placed fills in the place of a corruption error built by badf and returns
// err; other errors are returned unchanged.
func placed(err error, off, length int64) error {
	var ce *CorruptionError
	if errors.As(err, &ce) && ce.Offset < 0 {
		ce.Offset, ce.Length = off, length
	}
	return err
}

// BackingMismatchError names the backing device and the field that differs.
type BackingMismatchError struct {
	Name     string // backing name in the superblock
	Field    string // "id", "size", "missing", "unknown"
	Expected string
	Actual   string
}

func (e *BackingMismatchError) Error() string {
	switch e.Field {
	case "missing":
		return fmt.Sprintf("cache: backing device %q of the cache set was not supplied", e.Name)
	case "unknown":
		return fmt.Sprintf("cache: backing device %q is not part of the cache set", e.Name)
	}
	return fmt.Sprintf("cache: backing device %q: %s mismatch: cache set expects %s, device has %s",
		e.Name, e.Field, e.Expected, e.Actual)
}

func (e *BackingMismatchError) Unwrap() error { return ErrBackingMismatch }
