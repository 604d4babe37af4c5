// Package device is the lowest layer of tiercache: the block devices that the
// cache engine stores data on and that back each export.
//
// A Device is deliberately small (pread, pwrite, fsync, size) so that a file,
// a block device, a memory device with crash semantics, a fault injector or a
// performance model of an HDD can all stand in for one another. Capabilities
// that only some devices have (discard, write-zeroes) are separate one-method
// interfaces found by type assertion, so callers degrade gracefully instead of
// every implementation faking them.
//
// Implementations:
//
//   - File (Linux): a regular file or block device, O_DIRECT where the file
//     system allows it, with any buffer, offset and length accepted.
//   - Mem: memory with crash semantics (CrashClone) for durability tests.
//   - faultdev.Device: a decorator injecting errors, latency, bit flips and
//     torn writes.
//
// Package devicetest holds the conformance suite all of them pass.
//
// Errors: out-of-range requests wrap ErrOutOfRange, requests on a closed
// device wrap ErrClosed, modifying requests on a read-only device wrap
// ErrReadOnly (and syscall.EPERM); failures of the underlying system call are
// an *IOError naming the device, offset and length and wrapping the
// syscall.Errno. Match with errors.Is and errors.As, never ==.
//
// Concurrency contract: ReadAt, WriteAt, Sync, Discard and WriteZeroes may be
// called from many goroutines at once. Overlapping concurrent writes leave the
// overlapped range with either writer's bytes (per sector), as a real disk
// would; callers that need ordering must provide it. Sync makes durable every
// write that completed before Sync was called.
package device

import (
	"errors"
	"fmt"
	"io"
	"syscall"
)

// Device is a fixed-size, randomly addressable block store.
type Device interface {
	// ReadAt reads len(p) bytes at off. A read wholly inside the device
	// returns len(p), nil. A read past Size is an error (ErrOutOfRange).
	io.ReaderAt
	// WriteAt writes len(p) bytes at off. The data is not durable until a
	// later Sync returns nil. A write past Size is an error (ErrOutOfRange).
	io.WriterAt
	// Sync makes every previously completed write durable (fdatasync).
	Sync() error
	// Size is the device size in bytes. It does not change while open.
	Size() int64
	// Close releases the device. It does not imply Sync.
	Close() error
}

// Discarder is implemented by devices that can deallocate a range (hole
// punching on a file, BLKDISCARD on a block device). After Discard the
// range's contents are unspecified (zeroes on a file, possibly old data on a
// block device): use Zeroer when zeroes are required.
type Discarder interface {
	Discard(off, length int64) error
}

// Zeroer is implemented by devices that can zero a range faster than writing
// zero buffers (FALLOC_FL_ZERO_RANGE, BLKZEROOUT). After WriteZeroes the
// range reads as zeroes.
type Zeroer interface {
	WriteZeroes(off, length int64) error
}

// AsyncReader is implemented by devices that can start a read without a
// goroutine waiting for it (File: through Linux AIO). StartReadAt returns
// false, having done nothing, when it cannot start this read so (the
// caller then uses ReadAt); else it calls done exactly once with what
// ReadAt would have returned, on a goroutine the device owns: done must
// not block. p belongs to the read until done is called.
//
// Completions are delivered in batches (File: those one pass of the
// reaper takes from the kernel). done may call later(f), any number of
// times, to have f run once done and every other completion of its batch
// have returned, on the same goroutine: work that costs the same for one
// completion as for many (writing their replies in one syscall) is then
// done once per batch. f must not block either, and must not call later.
type AsyncReader interface {
	StartReadAt(p []byte, off int64, done func(n int, err error, later func(f func()))) bool
}

// Plugger is implemented by devices that can hold back the reads
// AsyncReader's StartReadAt starts until the caller has started all it has
// at hand, and then send them to the device together (File: one
// io_submit). Every Plug must be matched by an Unplug, which submits what
// was held once no Plug is left; a device may submit earlier (File: when
// synchronous I/O arrives, or enough reads are held). A plug never holds
// back a request that someone waits for: between Plug and Unplug the
// caller must not wait for a read it started.
type Plugger interface {
	Plug()
	Unplug()
}

// WithLater calls call with a later (as AsyncReader's done gets) that
// runs what it is given after call returns: for a completion delivered
// alone, off the device's batch.
func WithLater(call func(later func(f func()))) {
	var fs []func()
	call(func(f func()) { fs = append(fs, f) })
	for _, f := range fs {
		f()
	}
}

// SyncKeeper is implemented by devices whose failed Sync loses nothing:
// the writes it could not make durable stay with the device, and a later
// Sync that succeeds makes them durable (an object-store image keeps the
// blocks it could not store in memory). KeepsUnsynced reports whether that
// holds. A file or block device does not promise it: after a failed fsync
// the kernel may have dropped the pages it could not write.
type SyncKeeper interface {
	KeepsUnsynced() bool
}

// ErrOutOfRange is returned for I/O that does not lie inside the device.
var ErrOutOfRange = errors.New("device: I/O out of range")

// ErrClosed is returned for I/O on a closed device.
var ErrClosed = errors.New("device: closed")

// ErrReadOnly is returned for writes, discards and write-zeroes on a device
// opened read-only. It wraps syscall.EPERM so that errno mapping (for an NBD
// error reply, say) needs no special case.
var ErrReadOnly = fmt.Errorf("device: read-only: %w", syscall.EPERM)

// CheckRange reports ErrOutOfRange unless [off, off+n) lies within [0, size).
// It allocates nothing; use RangeError to build the error returned to a
// caller.
func CheckRange(off, n, size int64) error {
	if off < 0 || n < 0 || off > size || n > size-off {
		return ErrOutOfRange
	}
	return nil
}

// RangeError returns an error wrapping ErrOutOfRange that names the
// operation, the request and the device size, for an implementation to return
// once CheckRange has failed.
func RangeError(op string, off, n, size int64) error {
	return fmt.Errorf("device: %s at offset %d length %d (device size %d): %w",
		op, off, n, size, ErrOutOfRange)
}

// IOError describes a failed operation on a named device. Err is the cause
// (a syscall.Errno, io.EOF, ErrClosed, ...) and is reachable with errors.Is
// and errors.As.
type IOError struct {
	Op   string // "read", "write", "sync", "discard", "write-zeroes"
	Path string // device path or name
	Off  int64  // offset of the request (0 for sync)
	Len  int64  // length of the request (0 for sync)
	Err  error
}

func (e *IOError) Error() string {
	if e.Op == "sync" || e.Op == "close" {
		return fmt.Sprintf("device %s: %s: %v", e.Path, e.Op, e.Err)
	}
	return fmt.Sprintf("device %s: %s at offset %d length %d: %v", e.Path, e.Op, e.Off, e.Len, e.Err)
}

func (e *IOError) Unwrap() error { return e.Err }
