package cache

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// TestFaultInjection fails operation i of the cache or the backing device,
// for i = 0, 1, ... until a run finishes without the fault firing (pebble's
// error_test pattern). Whatever fails, a read that succeeds must return the
// data of the latest completed write: an injected error may only surface as
// an error, never as wrong data. Bit flips on cache reads must be caught by
// the checksums. After each run the set must reopen cleanly on the
// fault-free devices and pass Check.
func TestFaultInjection(t *testing.T) {
	limit := 600
	if testing.Short() || raceEnabled {
		limit = 150
	}
	for _, tc := range []struct {
		name   string
		target string
		fault  func(i uint64) faultdev.Injector
	}{
		{"cache-error", "cache", func(i uint64) faultdev.Injector { return faultdev.OnIndex(i, faultdev.Error(nil)) }},
		{"backing-error", "backing", func(i uint64) faultdev.Injector { return faultdev.OnIndex(i, faultdev.Error(nil)) }},
		{"cache-bitflip", "cache", func(i uint64) faultdev.Injector {
			// Flip a bit in the i-th read of the cache device.
			var reads atomic.Uint64
			return faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
				if op.Kind == faultdev.Read && reads.Add(1)-1 == i {
					return faultdev.BitFlip(int64(i*8191) % (op.Len * 8))
				}
				return faultdev.Fault{}
			})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fired := 0
			for i := 0; i < limit; i++ {
				if !runFaultWorkload(t, uint64(i), tc.target, tc.fault(uint64(i))) {
					break
				}
				fired++
			}
			t.Logf("%d runs with a fault", fired)
		})
	}
}

// runFaultWorkload reports whether the fault fired.
func runFaultWorkload(t *testing.T, i uint64, target string, inj faultdev.Injector) bool {
	t.Helper()
	const bs = 4 * blockSize
	cacheMem := device.NewMem(cacheSizeFor(6, bs, minJournalLen, 1))
	backMem := device.NewMem(40 * blockSize)
	var cacheDev, backDev device.Device = cacheMem, backMem
	var fd *faultdev.Device
	if target == "cache" {
		fd = faultdev.Wrap(cacheMem, inj)
		cacheDev = fd
	} else {
		fd = faultdev.Wrap(backMem, inj)
		backDev = fd
	}
	if _, err := Format(cacheMem, []BackingSpec{{Name: "a", Dev: backMem}}, FormatOptions{BucketSize: bs, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cacheDev, []BackingSpec{{Name: "a", Dev: backDev}}, OpenOptions{})
	if err != nil {
		if fd.Injected() == 0 {
			t.Fatalf("fault %d: open failed without a fault: %v", i, err)
		}
		return true
	}
	v := s.vols[0]
	model := make([]byte, v.Size())
	known := make([]bool, v.Size())
	for k := range known {
		known[k] = true
	}
	rng := rand.New(rand.NewPCG(i, 5))
	for op := 0; op < 40; op++ {
		off := rng.Int64N(v.Size()/512) * 512
		n := min(int64(1+rng.IntN(16))*512, v.Size()-off)
		switch rng.IntN(8) {
		case 0, 1, 2:
			p := make([]byte, n)
			stamp(p, uint64(op+1), 0, off)
			if err := v.WriteAt(p, off, rng.IntN(6) == 0); err != nil {
				for k := off; k < off+n; k++ {
					known[k] = false
				}
			}
			// Even a failed write may have landed: compare only known bytes.
			copy(model[off:], p)
		case 3:
			if err := v.WriteZeroes(off, n, false, true, false); err != nil {
				for k := off; k < off+n; k++ {
					known[k] = false
				}
			}
			clear(model[off : off+n])
		case 4:
			_ = v.Flush()
		case 5:
			_ = v.SetMode(Mode(rng.IntN(4)))
		default:
			got := make([]byte, n)
			if err := v.ReadAt(got, off); err != nil {
				continue
			}
			for k := int64(0); k < n; k++ {
				if known[off+k] && got[k] != model[off+k] {
					t.Fatalf("fault %d (%s, fired %d): op %d: read at %d+%d returned wrong data at byte %d: %s",
						i, target, fd.Injected(), op, off, n, off+k, describeSector(got[k/512*512:]))
				}
			}
		}
	}
	s.crashStop()
	// The data on the devices must still make a consistent set.
	s2, err := Open(cacheMem, []BackingSpec{{Name: "a", Dev: backMem}}, OpenOptions{})
	if err != nil {
		t.Fatalf("fault %d (%s): reopen without faults: %v", i, target, err)
	}
	if err := s2.Check(); err != nil {
		t.Fatalf("fault %d (%s): %v", i, target, err)
	}
	got := make([]byte, v.Size())
	if err := s2.vols[0].ReadAt(got, 0); err != nil && !IsCorruption(err) {
		t.Fatalf("fault %d (%s): read after reopen: %v", i, target, err)
	}
	s2.crashStop()
	return fd.Injected() > 0
}
