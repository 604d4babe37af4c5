// Package faultdev wraps a device.Device to inject faults: errors, latency,
// bit flips in read data and torn writes, chosen per operation by a
// composable Injector.
//
// It exists so that tests can make any operation fail, one at a time ("inject
// at op i, for i = 0, 1, ... until the workload finishes with no injection"),
// and check that every injected error surfaces (as an NBD error reply, say)
// and never turns into silence or wrong data. Every operation gets a global
// index, so a failing run names the op that broke it, and with seeded
// injectors the run replays.
//
//	dev := faultdev.Wrap(device.NewMem(size), faultdev.OnIndex(7, faultdev.Error(nil)))
//	died := faultdev.After(100, faultdev.Always(faultdev.Error(nil))) // device died at op 100
package faultdev

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/device"
)

// OpKind is the kind of a device operation.
type OpKind uint8

// The operation kinds. Close is not an operation: it is never faulted.
const (
	Read OpKind = iota
	Write
	Sync
	Discard
	Zero
)

func (k OpKind) String() string {
	switch k {
	case Read:
		return "read"
	case Write:
		return "write"
	case Sync:
		return "sync"
	case Discard:
		return "discard"
	case Zero:
		return "write-zeroes"
	}
	return fmt.Sprintf("OpKind(%d)", uint8(k))
}

// Op describes one operation, as seen by an Injector.
type Op struct {
	Kind   OpKind
	Offset int64  // 0 for Sync
	Len    int64  // 0 for Sync
	Index  uint64 // 0 for the wrapper's first operation, counting every kind
}

func (o Op) String() string {
	return fmt.Sprintf("op %d %s off=%d len=%d", o.Index, o.Kind, o.Offset, o.Len)
}

// ErrInjected is wrapped by every error this package injects by default, so
// a test can tell an injected failure from a real one.
var ErrInjected = errors.New("faultdev: injected fault")

// InjectedError is the default injected error. It matches both ErrInjected
// and syscall.EIO with errors.Is, so code that maps errno sees an I/O error.
type InjectedError struct{ Op Op }

func (e *InjectedError) Error() string {
	return fmt.Sprintf("faultdev: injected I/O error at %v", e.Op)
}

// Unwrap returns ErrInjected and syscall.EIO.
func (e *InjectedError) Unwrap() []error { return []error{ErrInjected, syscall.EIO} }

// Fault is what happens to one operation. The zero value is no fault.
// Latency combines with any other field; Fail, FlipBit and Tear are
// exclusive in effect (Tear implies failure; FlipBit only applies to reads,
// Tear only to writes, and either is ignored for other kinds).
type Fault struct {
	// Latency delays the operation by this much before it runs.
	Latency time.Duration
	// Fail makes the operation fail without reaching the inner device,
	// with Err or, if Err is nil, an *InjectedError.
	Fail bool
	Err  error
	// FlipBit makes a read succeed with bit Bit (modulo the bits read;
	// bit 0 is the low bit of the first byte) of the returned data
	// inverted.
	FlipBit bool
	Bit     int64
	// Tear makes a write reach the inner device only for its first
	// Sectors 512-byte sectors (counted at device sector boundaries; 0
	// writes nothing), then fail with Err or an *InjectedError.
	Tear    bool
	Sectors int64
}

// IsNone reports whether f does nothing.
func (f Fault) IsNone() bool {
	return f.Latency == 0 && !f.Fail && !f.FlipBit && !f.Tear
}

// Error returns a Fault failing with err (nil: an *InjectedError).
func Error(err error) Fault { return Fault{Fail: true, Err: err} }

// Delay returns a Fault adding latency d.
func Delay(d time.Duration) Fault { return Fault{Latency: d} }

// BitFlip returns a Fault inverting bit of a read's data.
func BitFlip(bit int64) Fault { return Fault{FlipBit: true, Bit: bit} }

// TornWrite returns a Fault letting only the first sectors sectors of a write
// land before it fails.
func TornWrite(sectors int64) Fault { return Fault{Tear: true, Sectors: sectors} }

// Injector chooses the fault for each operation. It must be safe for
// concurrent use.
type Injector interface {
	Inject(op Op) Fault
}

// InjectorFunc adapts a function to Injector.
type InjectorFunc func(op Op) Fault

// Inject calls fn(op).
func (fn InjectorFunc) Inject(op Op) Fault { return fn(op) }

// None injects nothing.
func None() Injector { return InjectorFunc(func(Op) Fault { return Fault{} }) }

// Always injects f into every operation.
func Always(f Fault) Injector { return InjectorFunc(func(Op) Fault { return f }) }

// OnIndex injects f into operation i only.
func OnIndex(i uint64, f Fault) Injector {
	return InjectorFunc(func(op Op) Fault {
		if op.Index == i {
			return f
		}
		return Fault{}
	})
}

// OnKind consults inj for operations of the given kind only.
func OnKind(kind OpKind, inj Injector) Injector {
	return InjectorFunc(func(op Op) Fault {
		if op.Kind == kind {
			return inj.Inject(op)
		}
		return Fault{}
	})
}

// After consults inj for operations with index n and later, and injects
// nothing before. After(n, Always(Error(nil))) is a device that died at op
// n.
func After(n uint64, inj Injector) Injector {
	return InjectorFunc(func(op Op) Fault {
		if op.Index >= n {
			return inj.Inject(op)
		}
		return Fault{}
	})
}

// Randomly injects f into each operation with probability p, drawing from
// rng (under a lock: rand.Rand is not safe for concurrent use). With
// concurrent callers the order of draws, and so the choice of victims,
// depends on scheduling; a single-threaded workload replays from a seed.
func Randomly(p float64, rng *rand.Rand, f Fault) Injector {
	var mu sync.Mutex
	return InjectorFunc(func(Op) Fault {
		mu.Lock()
		hit := rng.Float64() < p
		mu.Unlock()
		if hit {
			return f
		}
		return Fault{}
	})
}

// Any returns the first fault that is not none among injs, consulted in
// order (later injectors are not consulted once one fires).
func Any(injs ...Injector) Injector {
	return InjectorFunc(func(op Op) Fault {
		for _, inj := range injs {
			if f := inj.Inject(op); !f.IsNone() {
				return f
			}
		}
		return Fault{}
	})
}

// Device is a device.Device that asks an Injector about every operation
// before passing it to the inner device. It implements device.Discarder and
// device.Zeroer whatever the inner device: Discard passes through when the
// inner device is a Discarder and otherwise does nothing (a valid discard);
// WriteZeroes passes through to a Zeroer and otherwise writes zero buffers.
// It is safe for concurrent use if the inner device is.
type Device struct {
	inner device.Device
	inj   Injector
	next  atomic.Uint64 // index of the next operation
	// injected counts operations that got a non-none fault.
	injected atomic.Uint64
}

var (
	_ device.Device    = (*Device)(nil)
	_ device.Discarder = (*Device)(nil)
	_ device.Zeroer    = (*Device)(nil)
)

// Wrap returns dev with faults from inj (nil: none).
func Wrap(dev device.Device, inj Injector) *Device {
	if inj == nil {
		inj = None()
	}
	return &Device{inner: dev, inj: inj}
}

// Unwrap returns the inner device.
func (d *Device) Unwrap() device.Device { return d.inner }

// Ops returns the number of operations seen so far: the index the next one
// will get. A test injecting at op i knows it is done when Ops() <= i after
// a full run.
func (d *Device) Ops() uint64 { return d.next.Load() }

// Injected returns the number of operations that got a fault.
func (d *Device) Injected() uint64 { return d.injected.Load() }

// begin numbers an operation, asks the injector and applies its latency.
func (d *Device) begin(kind OpKind, off, n int64) (Op, Fault) {
	op := Op{Kind: kind, Offset: off, Len: n, Index: d.next.Add(1) - 1}
	f := d.inj.Inject(op)
	if !f.IsNone() {
		d.injected.Add(1)
	}
	if f.Latency > 0 {
		time.Sleep(f.Latency)
	}
	return op, f
}

func faultErr(op Op, f Fault) error {
	if f.Err != nil {
		return f.Err
	}
	return &InjectedError{Op: op}
}

// Size returns the inner device's size.
func (d *Device) Size() int64 { return d.inner.Size() }

// ReadAt reads from the inner device, unless the fault says otherwise.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	op, f := d.begin(Read, off, int64(len(p)))
	if f.Fail {
		return 0, faultErr(op, f)
	}
	n, err := d.inner.ReadAt(p, off)
	if err == nil && f.FlipBit && n > 0 {
		bit := f.Bit % (int64(n) * 8)
		if bit < 0 {
			bit += int64(n) * 8
		}
		p[bit/8] ^= 1 << (bit % 8)
	}
	return n, err
}

// WriteAt writes to the inner device, unless the fault says otherwise.
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	op, f := d.begin(Write, off, int64(len(p)))
	if f.Fail {
		return 0, faultErr(op, f)
	}
	if f.Tear {
		end := (off/device.SectorSize + max(f.Sectors, 0)) * device.SectorSize
		keep := min(max(end-off, 0), int64(len(p)))
		n := 0
		if keep > 0 {
			var err error
			n, err = d.inner.WriteAt(p[:keep], off)
			if err != nil {
				return n, err
			}
		}
		return n, faultErr(op, f)
	}
	return d.inner.WriteAt(p, off)
}

// Sync syncs the inner device, unless the fault says otherwise.
func (d *Device) Sync() error {
	op, f := d.begin(Sync, 0, 0)
	if f.Fail || f.Tear {
		return faultErr(op, f)
	}
	return d.inner.Sync()
}

// Discard discards on the inner device if it is a Discarder, else does
// nothing.
func (d *Device) Discard(off, length int64) error {
	op, f := d.begin(Discard, off, length)
	if f.Fail || f.Tear {
		return faultErr(op, f)
	}
	if dd, ok := d.inner.(device.Discarder); ok {
		return dd.Discard(off, length)
	}
	// Still validate, so the wrapper's contract matches a real device's:
	// the range, then (with a zero-length write) closed or read-only.
	if device.CheckRange(off, length, d.inner.Size()) != nil {
		return device.RangeError("discard", off, length, d.inner.Size())
	}
	_, err := d.inner.WriteAt(nil, off)
	return err
}

// WriteZeroes zeroes on the inner device: through its Zeroer if it has one,
// else by writing zero buffers.
func (d *Device) WriteZeroes(off, length int64) error {
	op, f := d.begin(Zero, off, length)
	if f.Fail || f.Tear {
		return faultErr(op, f)
	}
	if z, ok := d.inner.(device.Zeroer); ok {
		return z.WriteZeroes(off, length)
	}
	if device.CheckRange(off, length, d.inner.Size()) != nil {
		return device.RangeError("write-zeroes", off, length, d.inner.Size())
	}
	if _, err := d.inner.WriteAt(nil, off); err != nil {
		return err
	}
	zero := make([]byte, min(length, 1<<20))
	for length > 0 {
		n := min(length, int64(len(zero)))
		if _, err := d.inner.WriteAt(zero[:n], off); err != nil {
			return err
		}
		off, length = off+n, length-n
	}
	return nil
}

// Close closes the inner device. It is never faulted.
func (d *Device) Close() error { return d.inner.Close() }
