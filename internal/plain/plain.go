// Package plain serves a device as an NBD backend with no cache in front of
// it: the `--export NAME=PATH` form of `tiercache serve`, and the baseline
// that benchmarks compare the cache against.
//
// Every NBD durability rule maps onto one device call: a FUA write and a
// FLUSH are a device Sync, which covers every write completed before it on
// any connection (so the export may advertise CAN_MULTI_CONN).
package plain

import (
	"errors"
	"fmt"

	"github.com/tiercache/tiercache/device"
)

// zeroChunk bounds the buffer used when a device cannot zero natively.
const zeroChunk = 1 << 20

// Backend adapts a device.Device to the nbd.Backend contract.
type Backend struct {
	dev device.Device
}

// New returns a Backend serving dev. The caller keeps ownership of dev.
func New(dev device.Device) *Backend { return &Backend{dev: dev} }

// Size is the device size in bytes.
func (b *Backend) Size() int64 { return b.dev.Size() }

// ReadAt fills p from off.
func (b *Backend) ReadAt(p []byte, off int64) error {
	n, err := b.dev.ReadAt(p, off)
	if err == nil && n != len(p) {
		err = fmt.Errorf("plain: short read at %d: %d of %d bytes", off, n, len(p))
	}
	return err
}

// WriteAt writes p at off; with fua the write is durable before return.
func (b *Backend) WriteAt(p []byte, off int64, fua bool) error {
	if _, err := b.dev.WriteAt(p, off); err != nil {
		return err
	}
	if fua {
		return b.dev.Sync()
	}
	return nil
}

// Flush makes every completed write durable.
func (b *Backend) Flush() error { return b.dev.Sync() }

// Trim deallocates the range when the device can; otherwise it is a no-op,
// which NBD allows (trimmed data may read back unchanged).
func (b *Backend) Trim(off, length int64, fua bool) error {
	if d, ok := b.dev.(device.Discarder); ok {
		if err := d.Discard(off, length); err != nil {
			return err
		}
	}
	if fua {
		return b.dev.Sync()
	}
	return nil
}

// WriteZeroes zeroes the range. With fastOnly it fails with
// errors.ErrUnsupported unless the device zeroes natively.
func (b *Backend) WriteZeroes(off, length int64, fua, mayTrim, fastOnly bool) error {
	if err := device.CheckRange(off, length, b.dev.Size()); err != nil {
		return err
	}
	z, native := b.dev.(device.Zeroer)
	switch {
	case native:
		if err := z.WriteZeroes(off, length); err != nil {
			return err
		}
	case fastOnly:
		return fmt.Errorf("plain: fast zero: %w", errors.ErrUnsupported)
	default:
		buf := make([]byte, min(length, zeroChunk))
		for done := int64(0); done < length; {
			n := min(int64(len(buf)), length-done)
			if _, err := b.dev.WriteAt(buf[:n], off+done); err != nil {
				return err
			}
			done += n
		}
	}
	if fua {
		return b.dev.Sync()
	}
	return nil
}
