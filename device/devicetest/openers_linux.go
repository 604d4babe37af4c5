//go:build linux

package devicetest

import (
	"path/filepath"
	"testing"

	"github.com/tiercache/tiercache/device"
)

func addFileOpeners(m map[string]Opener) {
	for name, mode := range map[string]device.DirectMode{
		"file-buffered": device.DirectOff,
		"file-direct":   device.DirectAuto, // buffered where O_DIRECT is refused
	} {
		m[name] = func(t *testing.T, size int64) device.Device {
			path := filepath.Join(t.TempDir(), "dev.img")
			if err := device.CreateSparse(path, size); err != nil {
				t.Fatal(err)
			}
			f, err := device.OpenFile(path, device.FileOptions{Direct: mode})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			return f
		}
	}
}
