package mirror

import (
	"sync"
	"sync/atomic"

	"github.com/tiercache/tiercache/device"
)

// Swappable is a set's cache device, which an attach of a mirror replaces
// (with the mirror over it) while the set serves: Swap returns once every
// write that went to the old device has completed, so that every write
// after it goes through the mirror (which a resilver orders against its
// copy). Reads and syncs need no such order: the old device stays the
// mirror's member A.
type Swappable struct {
	cur atomic.Pointer[swapRef]
}

type swapRef struct {
	device.Device
	ar device.AsyncReader // nil when the device has no asynchronous reads
	pl device.Plugger     // nil when the device is none
	// plugs: Plugs not yet matched by an Unplug; prev: the device this
	// one replaced (Swap), for an Unplug of a Plug made before the swap
	plugs atomic.Int64
	prev  *swapRef
	// mu: writes hold the read side; Swap takes the write side once to
	// wait for the writes in flight and mark the device retired.
	mu      sync.RWMutex
	retired bool // REQUIRES: mu
}

// NewSwappable returns dev, to be swapped for a mirror over it.
func NewSwappable(dev device.Device) *Swappable {
	d := &Swappable{}
	d.cur.Store(newSwapRef(dev))
	return d
}

func newSwapRef(dev device.Device) *swapRef {
	r := &swapRef{Device: dev}
	r.ar, _ = dev.(device.AsyncReader)
	if m, ok := dev.(*Mirror); ok && !m.ReadsAsync() {
		r.ar = nil // the sync path, rather than a refused start
	}
	r.pl, _ = dev.(device.Plugger)
	return r
}

// Plug is device.Plugger's, on the device now (none for a mirror).
func (d *Swappable) Plug() {
	if r := d.cur.Load(); r.pl != nil {
		r.plugs.Add(1)
		r.pl.Plug()
	}
}

// Unplug matches a Plug: on the oldest device with Plugs outstanding, so
// that a device swapped out holds back nothing (each device gets as many
// Unplugs as Plugs, an Unplug of a caller's perhaps before its own Plug's
// device: early, which a Plugger allows).
func (d *Swappable) Unplug() {
	for {
		var oldest *swapRef
		for r := d.cur.Load(); r != nil; r = r.prev {
			if r.plugs.Load() > 0 {
				oldest = r
			}
		}
		if oldest == nil {
			return
		}
		if n := oldest.plugs.Load(); n > 0 && oldest.plugs.CompareAndSwap(n, n-1) {
			oldest.pl.Unplug()
			return
		}
	}
}

var _ device.Device = (*Swappable)(nil)

// Get returns the device under the set now.
func (d *Swappable) Get() device.Device { return d.cur.Load().Device }

// AsyncReader returns the device's asynchronous reads, if it has them.
func (d *Swappable) AsyncReader() (device.AsyncReader, bool) {
	ar := d.cur.Load().ar
	return ar, ar != nil
}

// Swap puts dev in the old device's place, and returns once no write is
// in flight on the old one.
func (d *Swappable) Swap(dev device.Device) {
	r := newSwapRef(dev)
	r.prev = d.cur.Load()
	old := d.cur.Swap(r)
	old.mu.Lock()
	old.retired = true
	old.mu.Unlock()
}

func (d *Swappable) ReadAt(p []byte, off int64) (int, error) { return d.cur.Load().ReadAt(p, off) }

func (d *Swappable) WriteAt(p []byte, off int64) (int, error) {
	for {
		r := d.cur.Load()
		r.mu.RLock()
		if !r.retired {
			n, err := r.Device.WriteAt(p, off)
			r.mu.RUnlock()
			return n, err
		}
		r.mu.RUnlock()
	}
}

func (d *Swappable) Sync() error  { return d.cur.Load().Sync() }
func (d *Swappable) Size() int64  { return d.cur.Load().Size() }
func (d *Swappable) Close() error { return d.cur.Load().Close() }
