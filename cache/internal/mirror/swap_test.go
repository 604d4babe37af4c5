package mirror

import (
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// plugMem is a memory device that counts Plugs and Unplugs.
type plugMem struct {
	*device.Mem
	plugs, unplugs atomic.Int64
}

func (d *plugMem) Plug()   { d.plugs.Add(1) }
func (d *plugMem) Unplug() { d.unplugs.Add(1) }

// TestSwappablePlugAcrossSwap: a Plug made before the set's cache device is
// swapped (an attach) is unplugged on the device it plugged, not on the
// new one.
func TestSwappablePlugAcrossSwap(t *testing.T) {
	old := &plugMem{Mem: device.NewMem(1 << 20)}
	d := NewSwappable(old)
	d.Plug()
	d.Plug()
	d.Unplug()
	d.Swap(&plugMem{Mem: device.NewMem(1 << 20)})
	nw := d.Get().(*plugMem)
	d.Plug()
	d.Unplug() // the Plug before the swap, first
	d.Unplug()
	d.Unplug() // unmatched: nothing
	if old.plugs.Load() != 2 || old.unplugs.Load() != 2 || nw.plugs.Load() != 1 || nw.unplugs.Load() != 1 {
		t.Fatalf("old device %d plugs %d unplugs, new %d and %d; want 2/2 and 1/1", old.plugs.Load(), old.unplugs.Load(), nw.plugs.Load(), nw.unplugs.Load())
	}
}
