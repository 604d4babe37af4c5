package model

import (
	"fmt"
	"strings"
	"time"

	"github.com/tiercache/tiercache/device"
)

// Kinds of model, as named in a device spec ("hdd:PATH").
const (
	KindHDD  = "hdd"  // DefaultHDD: a 7200 rpm 3.5" SATA disk
	KindSSD  = "ssd"  // SATASSD: a SATA SSD
	KindNVMe = "nvme" // NVMeSSD: an NVMe SSD
)

// Model is a device.Device whose requests complete when a modelled disk
// would complete them. *HDD and *SSD implement it.
type Model interface {
	device.Device
	device.Discarder
	device.Zeroer
	// Stats returns the counters so far; times are model times.
	Stats() Stats
	// Unwrap returns the device that holds the data.
	Unwrap() device.Device
}

var (
	_ Model = (*HDD)(nil)
	_ Model = (*SSD)(nil)
)

// Stats counts what a model has served. Times are model time (wall time
// divided by TimeScale). Fields a model does not have stay zero.
type Stats struct {
	Reads, Writes, Syncs, Discards uint64
	BytesRead, BytesWritten        uint64

	// BufferHits counts reads served from the HDD's read-ahead buffer or
	// write cache, without the actuator.
	BufferHits uint64
	// CachedWrites counts writes the HDD acknowledged from its write
	// cache; Destages counts cache extents written to the platter.
	CachedWrites, Destages uint64
	// DirtyBytes is the data in the HDD's write cache now.
	DirtyBytes int64
	// Seeks counts head movements to another track, except the one-track
	// switches of a sequential transfer; SeekTracks is their total
	// distance in tracks.
	Seeks, SeekTracks uint64
	// AgeForced counts requests served out of positioning order because
	// they had waited longer than AgeLimit.
	AgeForced uint64
	// MaxQueue is the deepest the HDD's queue for the actuator has been.
	MaxQueue int

	// SeekTime, RotationalWait and TransferTime split the HDD's mechanical
	// time; BusyTime is the time the actuator (HDD) or at least one
	// channel (SSD) was busy.
	SeekTime, RotationalWait, TransferTime, BusyTime time.Duration
}

// Parse splits a device spec "KIND:PATH" with KIND one of hdd, ssd, nvme.
// ok is false for anything else (a plain path, an unknown kind, an empty
// path), so a caller can fall back to opening spec as a path.
func Parse(spec string) (kind, path string, ok bool) {
	kind, path, found := strings.Cut(spec, ":")
	if !found || path == "" {
		return "", "", false
	}
	switch kind {
	case KindHDD, KindSSD, KindNVMe:
		return kind, path, true
	}
	return "", "", false
}

// Params adjusts the models Wrap builds. Zero fields take the kind's
// defaults: DefaultHDD for hdd, SATASSD for ssd, NVMeSSD for nvme.
type Params struct {
	HDD HDDParams // for kind hdd
	SSD SSDParams // for kinds ssd and nvme
	// TimeScale, if not zero, overrides the chosen parameters' TimeScale:
	// 0.1 runs the model ten times faster than real time.
	TimeScale float64
}

// Wrap returns inner behind the model named by kind (see Parse). Zero
// fields of p take the kind's defaults. On error, inner is not closed.
func Wrap(kind string, inner device.Device, p Params) (Model, error) {
	switch kind {
	case KindHDD:
		hp := p.HDD
		if p.TimeScale != 0 {
			hp.TimeScale = p.TimeScale
		}
		return NewHDD(inner, hp)
	case KindSSD, KindNVMe:
		base := SATASSD()
		if kind == KindNVMe {
			base = NVMeSSD()
		}
		sp := p.SSD.withDefaults(base)
		if p.TimeScale != 0 {
			sp.TimeScale = p.TimeScale
		}
		return NewSSD(inner, sp)
	}
	return nil, fmt.Errorf("model: unknown kind %q (want %s, %s or %s)", kind, KindHDD, KindSSD, KindNVMe)
}

// Open opens a device spec for the CLI: "KIND:PATH" (see Parse) opens PATH
// with device.OpenFile and wraps it in the model, with parameters p. For
// any other spec it returns ok=false and opens nothing, so the caller can
// treat spec as a plain path. Closing the model closes the file.
func Open(spec string, fo device.FileOptions, p Params) (m Model, ok bool, err error) {
	kind, path, ok := Parse(spec)
	if !ok {
		return nil, false, nil
	}
	f, err := device.OpenFile(path, fo)
	if err != nil {
		return nil, true, err
	}
	m, err = Wrap(kind, f, p)
	if err != nil {
		f.Close()
		return nil, true, err
	}
	return m, true, nil
}

// writeZeroes zeroes [off, off+length) of d, through its Zeroer if it has
// one.
func writeZeroes(d device.Device, off, length int64) error {
	if z, ok := d.(device.Zeroer); ok {
		return z.WriteZeroes(off, length)
	}
	if _, err := d.WriteAt(nil, off); err != nil {
		return err
	}
	zero := make([]byte, min(length, 1<<20))
	for length > 0 {
		n := min(length, int64(len(zero)))
		if _, err := d.WriteAt(zero[:n], off); err != nil {
			return err
		}
		off, length = off+n, length-n
	}
	return nil
}
