package cache

import (
	"errors"
	"fmt"
	"strings"

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

// FormatVersionError: Open refuses a set of another format version
// (a pre-release build's) and writes nothing.
type FormatVersionError = ondisk.FormatVersionError

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

// UnwritableError is returned by Set.Drain and Volume.DrainDirty when dirty
// blocks cannot be written back because their cached copy fails its
// checksum: a drain gives up once a pass writes nothing back, with nothing
// busy, and every block version that failed its checksum in that pass has
// failed it in Tries passes in a row. It wraps ErrChecksum.
type UnwritableError struct {
	Blocks []UnwritableBlock // the versions given up on (the first maxUnwritableNamed)
	N      int               // how many versions were given up on
	Dirty  int64             // dirty blocks left in the drained volumes
	Tries  int
}

// UnwritableBlock is a dirty block version a drain gave up on.
type UnwritableBlock struct {
	Volume      string
	LBA         uint64
	CacheOffset int64 // of its cached copy
}

// maxUnwritableNamed bounds UnwritableError.Blocks.
const maxUnwritableNamed = 16

func (e *UnwritableError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d dirty blocks cannot be written back: %d failed their checksum %d times in a row (", e.Dirty, e.N, e.Tries)
	for i, x := range e.Blocks {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s lba %d at cache offset %d", x.Volume, x.LBA, x.CacheOffset)
	}
	if e.N > len(e.Blocks) {
		fmt.Fprintf(&b, ", and %d more", e.N-len(e.Blocks))
	}
	b.WriteString("): ")
	b.WriteString(ErrChecksum.Error())
	return b.String()
}

func (e *UnwritableError) Unwrap() error { return ErrChecksum }

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
