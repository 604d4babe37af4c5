package devicetest

import (
	"testing"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// Openers returns an Opener for each Device implementation in this module,
// by name, so that tests of code above the device layer (the cache engine)
// can run against every one of them as easily as against one:
//
//	for name, open := range devicetest.Openers() {
//		t.Run(name, func(t *testing.T) { testEngine(t, open(t, 64<<20)) })
//	}
//
// The devices read as zeroes and are closed by t.Cleanup; Mem devices are
// also checked (Mem.Check) then.
func Openers() map[string]Opener {
	m := map[string]Opener{
		"mem": func(t *testing.T, size int64) device.Device {
			return openMem(t, size)
		},
		"faultdev-mem": func(t *testing.T, size int64) device.Device {
			d := faultdev.Wrap(openMem(t, size), nil)
			return d
		},
	}
	addFileOpeners(m)
	return m
}

func openMem(t *testing.T, size int64) *device.Mem {
	m := device.NewMem(size)
	t.Cleanup(func() {
		m.Close()
		if err := m.Check(); err != nil {
			t.Error(err)
		}
	})
	return m
}
