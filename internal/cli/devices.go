package cli

import (
	"path/filepath"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/model"
)

// openDevice opens a device spec: a path to a file or block device, or a
// performance model over one (hdd:PATH, ssd:PATH, nvme:PATH; see
// docs/MODELS.md), so that benchmarks run on machines without such disks.
func openDevice(spec string, fo device.FileOptions) (device.Device, error) {
	m, ok, err := model.Open(spec, fo, model.Params{})
	if ok {
		return m, err
	}
	return device.OpenFile(spec, fo)
}

// devicePath is the file behind a device spec.
func devicePath(spec string) string {
	if _, path, ok := model.Parse(spec); ok {
		return path
	}
	return spec
}

// absSpec makes the path of a device spec absolute, keeping a model prefix;
// an NBD URI is put in its canonical form.
func absSpec(spec string) string {
	if isRemote(spec) {
		return remoteSpec(spec)
	}
	if isObjImage(spec) {
		return objImageSpec(spec)
	}
	kind, path, ok := model.Parse(spec)
	if !ok {
		path = spec
	}
	if a, err := filepath.Abs(path); err == nil {
		path = a
	}
	if ok {
		return kind + ":" + path
	}
	return path
}
