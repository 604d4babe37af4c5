package model

import (
	"sync/atomic"

	"github.com/tiercache/tiercache/device"
)

// front is what every model does the same way: check the range and the
// closed state, do the data I/O on the inner device while the model's clock
// runs, and return only when the model says the request is complete. A model
// embeds a front and supplies its scheduler: that is where HDD and SSD differ.
type front struct {
	inner  device.Device
	closed atomic.Bool
	sched  scheduler
}

// scheduler enters requests into a model at the current model time.
type scheduler interface {
	submit(op opKind, off, n int64) (completion, error)
	// submitZeroes charges a write-zeroes of length bytes at off.
	submitZeroes(off, length int64) (completion, error)
	countDiscard()
}

// completion is a request the model has accepted: wait blocks until the
// model completes it, either on a channel the model's loop closes (HDD,
// whose order is decided later) or at a model time fixed on arrival (SSD).
type completion struct {
	done <-chan struct{}
	tl   *timeline
	at   int64
}

func (c completion) wait() {
	if c.done != nil {
		<-c.done
		return
	}
	if c.tl != nil {
		c.tl.waitUntil(c.at)
	}
}

func (f *front) check(op string, off, n int64) error {
	if f.closed.Load() {
		return device.ErrClosed
	}
	if device.CheckRange(off, n, f.inner.Size()) != nil {
		return device.RangeError(op, off, n, f.inner.Size())
	}
	return nil
}

// Size is the inner device's size.
func (f *front) Size() int64 { return f.inner.Size() }

// Unwrap returns the device that holds the data.
func (f *front) Unwrap() device.Device { return f.inner }

// ReadAt reads from the inner device and returns when the model's read
// completes.
func (f *front) ReadAt(p []byte, off int64) (int, error) {
	if err := f.check("read", off, int64(len(p))); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		return f.inner.ReadAt(p, off)
	}
	c, err := f.sched.submit(opRead, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	n, err := f.inner.ReadAt(p, off)
	c.wait()
	return n, err
}

// WriteAt writes to the inner device and returns when the model's write
// completes (in the drive's write cache, if it has one).
func (f *front) WriteAt(p []byte, off int64) (int, error) {
	if err := f.check("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		return f.inner.WriteAt(p, off)
	}
	c, err := f.sched.submit(opWrite, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	n, err := f.inner.WriteAt(p, off)
	c.wait()
	return n, err
}

// Sync waits until the model's write cache has drained, then syncs the
// inner device.
func (f *front) Sync() error {
	if f.closed.Load() {
		return device.ErrClosed
	}
	c, err := f.sched.submit(opSync, 0, 0)
	if err != nil {
		return err
	}
	c.wait()
	return f.inner.Sync()
}

// Discard costs one command without data; the inner device discards if it
// can (otherwise the range keeps its old data, as the contract allows).
func (f *front) Discard(off, length int64) error {
	if err := f.check("discard", off, length); err != nil {
		return err
	}
	c, err := f.sched.submit(opNop, off, 0)
	if err != nil {
		return err
	}
	c.wait()
	f.sched.countDiscard()
	if dd, ok := f.inner.(device.Discarder); ok {
		return dd.Discard(off, length)
	}
	_, err = f.inner.WriteAt(nil, off) // closed or read-only, as a real discard would report
	return err
}

// WriteZeroes costs what the model charges for zeroing (see submitZeroes).
func (f *front) WriteZeroes(off, length int64) error {
	if err := f.check("write-zeroes", off, length); err != nil {
		return err
	}
	c, err := f.sched.submitZeroes(off, length)
	if err != nil {
		return err
	}
	err = writeZeroes(f.inner, off, length)
	c.wait()
	return err
}
