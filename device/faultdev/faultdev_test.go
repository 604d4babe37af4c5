package faultdev_test

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
	"github.com/tiercache/tiercache/device/faultdev"
)

func TestConformanceNoFaults(t *testing.T) {
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		d := faultdev.Wrap(device.NewMem(size), faultdev.None())
		t.Cleanup(func() { d.Close() })
		return d
	})
}

// plain hides Mem's Discard and WriteZeroes, to test the wrapper's fallbacks.
type plain struct{ device.Device }

func TestConformanceNoCapabilities(t *testing.T) {
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		d := faultdev.Wrap(plain{device.NewMem(size)}, nil)
		t.Cleanup(func() { d.Close() })
		return d
	})
}

func newDev(inj faultdev.Injector) (*faultdev.Device, *device.Mem) {
	m := device.NewMem(1 << 20)
	return faultdev.Wrap(m, inj), m
}

func TestOnIndex(t *testing.T) {
	d, _ := newDev(faultdev.OnIndex(2, faultdev.Error(nil)))
	p := make([]byte, 512)
	ops := []func() error{
		func() error { _, err := d.WriteAt(p, 0); return err },
		func() error { _, err := d.ReadAt(p, 0); return err },
		func() error { return d.Sync() },
		func() error { _, err := d.WriteAt(p, 512); return err },
		func() error { return d.WriteZeroes(0, 512) },
	}
	for i, op := range ops {
		err := op()
		if i == 2 {
			if !errors.Is(err, faultdev.ErrInjected) || !errors.Is(err, syscall.EIO) {
				t.Errorf("op 2: %v; want an injected EIO", err)
			}
			var ie *faultdev.InjectedError
			if !errors.As(err, &ie) || ie.Op.Index != 2 || ie.Op.Kind != faultdev.Sync {
				t.Errorf("op 2: error %v does not name the op", err)
			}
		} else if err != nil {
			t.Errorf("op %d: %v; want success", i, err)
		}
	}
	if d.Ops() != 5 || d.Injected() != 1 {
		t.Errorf("Ops() = %d, Injected() = %d; want 5, 1", d.Ops(), d.Injected())
	}
}

// TestInjectEachOp is the "inject at op i, for i = 0.. until clean" loop in
// miniature: every injected error must surface from the workload.
func TestInjectEachOp(t *testing.T) {
	workload := func(d device.Device) error {
		p := make([]byte, 4096)
		for i := range int64(4) {
			if _, err := d.WriteAt(p, i*4096); err != nil {
				return err
			}
		}
		if err := d.Sync(); err != nil {
			return err
		}
		_, err := d.ReadAt(p, 0)
		return err
	}
	for i := uint64(0); ; i++ {
		d, _ := newDev(faultdev.OnIndex(i, faultdev.Error(nil)))
		err := workload(d)
		if d.Ops() <= i {
			if err != nil {
				t.Fatalf("clean run failed: %v", err)
			}
			if i != 6 {
				t.Fatalf("workload has %d ops, want 6", i)
			}
			return
		}
		if !errors.Is(err, faultdev.ErrInjected) {
			t.Fatalf("error injected at op %d went unreported: %v", i, err)
		}
	}
}

func TestCustomErrorAndOnKind(t *testing.T) {
	boom := errors.New("boom")
	d, _ := newDev(faultdev.OnKind(faultdev.Write, faultdev.Always(faultdev.Error(boom))))
	p := make([]byte, 512)
	if _, err := d.WriteAt(p, 0); !errors.Is(err, boom) {
		t.Errorf("write: %v; want boom", err)
	}
	if _, err := d.ReadAt(p, 0); err != nil {
		t.Errorf("read: %v", err)
	}
	if err := d.Sync(); err != nil {
		t.Errorf("sync: %v", err)
	}
}

func TestAfterDeviceDied(t *testing.T) {
	d, _ := newDev(faultdev.After(3, faultdev.Always(faultdev.Error(nil))))
	p := make([]byte, 512)
	for i := range 10 {
		_, err := d.ReadAt(p, 0)
		if (i >= 3) != (err != nil) {
			t.Errorf("op %d: %v", i, err)
		}
	}
}

func TestBitFlip(t *testing.T) {
	d, m := newDev(faultdev.OnIndex(1, faultdev.BitFlip(8*100+3)))
	p := make([]byte, 4096)
	devicetest.Fill(p, 1)
	if _, err := d.WriteAt(p, 8192); err != nil {
		t.Fatal(err)
	}
	q := make([]byte, 4096)
	if _, err := d.ReadAt(q, 8192); err != nil {
		t.Fatalf("a bit flip must not fail the read: %v", err)
	}
	want := bytes.Clone(p)
	want[100] ^= 1 << 3
	if !bytes.Equal(q, want) {
		t.Fatal("read data does not differ by exactly the flipped bit")
	}
	// The stored data is intact: the next read is clean.
	if _, err := m.ReadAt(q, 8192); err != nil || !bytes.Equal(q, p) {
		t.Fatal("bit flip reached the stored data")
	}
}

func TestTornWrite(t *testing.T) {
	for _, tc := range []struct {
		off      int64
		sectors  int64
		wantKept int
	}{
		{0, 2, 1024},
		{256, 2, 768},  // the first sector is partial
		{0, 0, 0},      // nothing lands
		{0, 100, 4096}, // more sectors than the write: all lands, still an error
	} {
		d, m := newDev(faultdev.Always(faultdev.TornWrite(tc.sectors)))
		old := make([]byte, 8192)
		devicetest.Fill(old, 1)
		if _, err := m.WriteAt(old, 0); err != nil {
			t.Fatal(err)
		}
		p := make([]byte, 4096)
		devicetest.Fill(p, 2)
		n, err := d.WriteAt(p, tc.off)
		if !errors.Is(err, faultdev.ErrInjected) || n != tc.wantKept {
			t.Errorf("off %d sectors %d: WriteAt = %d, %v; want %d, injected error", tc.off, tc.sectors, n, err, tc.wantKept)
		}
		want := bytes.Clone(old)
		copy(want[tc.off:], p[:tc.wantKept])
		got := make([]byte, 8192)
		if _, err := m.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("off %d sectors %d: stored data is not the torn prefix over the old data", tc.off, tc.sectors)
		}
	}
}

func TestRandomlyReplays(t *testing.T) {
	run := func(seed uint64) []bool {
		d, _ := newDev(faultdev.Randomly(0.3, rand.New(rand.NewPCG(seed, 0)), faultdev.Error(nil)))
		var fails []bool
		p := make([]byte, 512)
		for range 200 {
			_, err := d.ReadAt(p, 0)
			fails = append(fails, err != nil)
		}
		return fails
	}
	a, b := run(9), run(9)
	n := 0
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("op %d: same seed, different fault", i)
		}
		if a[i] {
			n++
		}
	}
	if n < 30 || n > 90 {
		t.Errorf("p=0.3 injected %d of 200", n)
	}
}

func TestAnyAndLatency(t *testing.T) {
	d, _ := newDev(faultdev.Any(
		faultdev.OnIndex(0, faultdev.Delay(20*time.Millisecond)),
		faultdev.OnIndex(0, faultdev.Error(nil)), // shadowed by the delay
		faultdev.OnIndex(1, faultdev.Error(nil)),
	))
	p := make([]byte, 512)
	start := time.Now()
	if _, err := d.ReadAt(p, 0); err != nil {
		t.Errorf("op 0: %v; the first matching injector (a delay) wins", err)
	}
	if el := time.Since(start); el < 20*time.Millisecond {
		t.Errorf("op 0 took %v, want >= 20ms", el)
	}
	if _, err := d.ReadAt(p, 0); !errors.Is(err, faultdev.ErrInjected) {
		t.Errorf("op 1: %v; want injected", err)
	}
}

func TestPassThroughCapabilities(t *testing.T) {
	d, m := newDev(nil)
	p := make([]byte, 8192)
	devicetest.Fill(p, 3)
	if _, err := d.WriteAt(p, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteZeroes(100, 1000); err != nil {
		t.Fatal(err)
	}
	if err := d.Discard(4096, 4096); err != nil {
		t.Fatal(err)
	}
	if s := m.Stats(); s.Zeroes != 1 || s.Discards != 1 {
		t.Errorf("inner Mem saw %d zeroes, %d discards; want 1, 1", s.Zeroes, s.Discards)
	}
	if d.Unwrap() != device.Device(m) {
		t.Error("Unwrap does not return the inner device")
	}
}
