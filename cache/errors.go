package cache

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// The errors of the on-disk formats (package ondisk), part of this
// package's API.
var (
	ErrCorrupt      = ondisk.ErrCorrupt
	ErrChecksum     = ondisk.ErrChecksum
	ErrNotFormatted = ondisk.ErrNotFormatted
	ErrInvalid      = ondisk.ErrInvalid
)

// CorruptionError gives the context of a checksum or validation failure.
// It wraps ErrCorrupt (metadata) or ErrChecksum (cached data).
type CorruptionError = ondisk.CorruptionError

// ErrAlreadyFormatted is returned by Format when the cache device already
// holds a valid superblock and FormatOptions.Force is not set.
var ErrAlreadyFormatted = errors.New("cache: device already holds a cache set")

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

// IsCorruption reports whether err stems from corrupt metadata or data.
func IsCorruption(err error) bool {
	return errors.Is(err, ErrCorrupt) || errors.Is(err, ErrChecksum)
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
