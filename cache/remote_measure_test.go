package cache

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/model"
	"github.com/tiercache/tiercache/device/nbddev"
	"github.com/tiercache/tiercache/nbd"
)

// TestMeasureRemoteDrain measures writeback to a remote backing device:
// a device model (real time) served by tiercache's NBD server over a unix
// socket, each request delayed by a round trip, reached through
// device/nbddev. Random 4 KiB blocks over 1 GiB: written straight to the
// remote in arrival order (QD1 for the HDD cases, and QD32), and drained
// from the cache with writeback's depth fixed at writeback.QueueDepth and adapting
// (wbdepth.go). Figures only, nothing asserted:
//
//	go test ./cache -run TestMeasureRemoteDrain -measure -v
func TestMeasureRemoteDrain(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	const span = 1 << 30
	hdd := func(t *testing.T) device.Device { return wrapHDD(t, device.NewMem(span), 1) }
	ssd := func(t *testing.T) device.Device {
		d, err := model.NewSSD(device.NewMem(span), model.SATASSD())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	for _, tc := range []struct {
		name string
		dev  func(t *testing.T) device.Device
		rtt  time.Duration
		mib  int
		qd1  bool
	}{
		{"HDD", hdd, 0, 8, true},
		{"HDD", hdd, 10 * time.Millisecond, 8, true},
		{"SATA SSD", ssd, 10 * time.Millisecond, 32, false},
	} {
		nblk := tc.mib << 20 / blockSize
		lbas := randomLBAs(nblk, span/blockSize, 42)
		what := fmt.Sprintf("%s remote, rtt %v, %d MiB", tc.name, tc.rtt, tc.mib)
		var direct1 time.Duration
		if tc.qd1 {
			direct1 = writeDirect(t, remote(t, tc.dev(t), tc.rtt), lbas, 1)
		}
		direct32 := writeDirect(t, remote(t, tc.dev(t), tc.rtt), lbas, writeback.QueueDepth)
		if tc.qd1 {
			t.Logf("%s: straight to the remote, arrival order QD1: %v", what, direct1.Round(time.Millisecond))
		}
		t.Logf("%s: straight to the remote, arrival order QD%d: %v", what, writeback.QueueDepth, direct32.Round(time.Millisecond))
		for _, fixed := range []bool{true, false} {
			quiet := DefaultSettings()
			quiet.WritebackPercent = 100 // no background writeback while filling
			s := measureSetKnobs(t, 64, remote(t, tc.dev(t), tc.rtt), quiet, testingKnobs{fixedDepth: fixed})
			v, _ := s.Volume("hdd")
			buf := make([]byte, blockSize)
			for _, l := range lbas {
				if err := v.WriteAt(buf, int64(l)*blockSize, false); err != nil {
					t.Fatal(err)
				}
			}
			start := time.Now()
			if err := s.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			d := time.Since(start)
			wst := v.wb.Stats()
			t.Logf("%s: drain, depth fixed=%t: %v (depth at the end %d, %d changes): %.2fx QD%d arrival order",
				what, fixed, d.Round(time.Millisecond), wst.Depth, wst.Adjusts, direct32.Seconds()/d.Seconds(), writeback.QueueDepth)
		}
	}
}

// remote serves dev over NBD with every request delayed by rtt, and
// returns the nbddev device on it.
func remote(t *testing.T, dev device.Device, rtt time.Duration) device.Device {
	t.Helper()
	dir, err := os.MkdirTemp("", "wbremote") // short: a unix socket path
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := nbd.NewServer(nbd.Config{})
	if err := srv.AddExport(nbd.Export{Name: "hdd", Backend: delayBackend{dev, rtt}}); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := nbddev.Open(ctx, "nbd+unix:///hdd?socket="+sock, nbddev.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// delayBackend serves dev with every request delayed by rtt before it
// runs (a link's round trip; requests in flight overlap their delays).
type delayBackend struct {
	dev device.Device
	rtt time.Duration
}

func (b delayBackend) Size() int64 { return b.dev.Size() }

func (b delayBackend) ReadAt(p []byte, off int64) error {
	time.Sleep(b.rtt)
	_, err := b.dev.ReadAt(p, off)
	return err
}

func (b delayBackend) WriteAt(p []byte, off int64, fua bool) error {
	time.Sleep(b.rtt)
	if _, err := b.dev.WriteAt(p, off); err != nil {
		return err
	}
	if fua {
		return b.dev.Sync()
	}
	return nil
}

func (b delayBackend) Flush() error {
	time.Sleep(b.rtt)
	return b.dev.Sync()
}
