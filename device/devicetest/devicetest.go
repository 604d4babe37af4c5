// Package devicetest is the conformance suite every device.Device must pass:
// the file and block-device implementation, the memory device, fault
// wrappers with no faults, and later the HDD/SSD models and remote devices.
// One suite keeps them interchangeable, which is the point of the small
// Device interface: a cache engine test that passes on Mem means something
// for a real disk only if both honour the same contract.
//
// Usage, in a _test.go file:
//
//	func TestConformance(t *testing.T) {
//		devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
//			d := device.NewMem(size)
//			t.Cleanup(func() { d.Close() })
//			return d
//		})
//	}
package devicetest

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"unsafe"

	"github.com/tiercache/tiercache/device"
)

// DefaultSize is the size of the devices the suite opens (except where a
// subtest asks for an odd size). It is a multiple of 512 so that a loop
// device can have it.
const DefaultSize = 8 << 20

// Opener opens a fresh device of the given size, whose contents read as
// zeroes. It registers the device's cleanup with t (Close may already have
// been called by the suite; a second Close must not panic).
type Opener = func(t *testing.T, size int64) device.Device

// RunConformance runs the conformance suite as subtests of t.
func RunConformance(t *testing.T, open Opener) {
	t.Run("Size", func(t *testing.T) { testSize(t, open) })
	t.Run("FreshReadsZero", func(t *testing.T) { testFreshZero(t, open) })
	t.Run("RoundTrip", func(t *testing.T) { testRoundTrip(t, open) })
	t.Run("OutOfRange", func(t *testing.T) { testOutOfRange(t, open) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, open) })
	t.Run("Sync", func(t *testing.T) { testSync(t, open) })
	t.Run("Discard", func(t *testing.T) { testDiscard(t, open) })
	t.Run("WriteZeroes", func(t *testing.T) { testWriteZeroes(t, open) })
	t.Run("Closed", func(t *testing.T) { testClosed(t, open) })
}

// AlignedBuf returns n zeroed bytes aligned to 4096 in memory, the
// alignment O_DIRECT needs, for tests that want the fast path.
func AlignedBuf(n int) []byte {
	const align = 4096
	b := make([]byte, n+align)
	skip := int(-uintptr(unsafe.Pointer(unsafe.SliceData(b))) & (align - 1))
	return b[skip : skip+n : skip+n]
}

// UnalignedBuf returns n zeroed bytes starting one byte past a 4096
// boundary: never usable for O_DIRECT as is.
func UnalignedBuf(n int) []byte { return AlignedBuf(n + 1)[1:] }

// Fill fills p with a pattern determined by seed, distinct for each seed and
// each position, with no zero bytes (so a lost write cannot pass for a zero
// region).
func Fill(p []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 + 1
	for i := range p {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b := byte(x)
		if b == 0 {
			b = 1
		}
		p[i] = b
	}
}

// model is the expected content of a device under test.
type model struct{ b []byte }

func newModel(size int64) *model { return &model{b: make([]byte, size)} }

func (m *model) write(p []byte, off int64) { copy(m.b[off:], p) }

func (m *model) zero(off, n int64) { clear(m.b[off : off+n]) }

// verify reads the whole device and compares it with the model, reporting
// the first mismatching bytes.
func (m *model) verify(t *testing.T, d device.Device, what string) {
	t.Helper()
	const chunk = 1 << 20
	buf := AlignedBuf(chunk)
	for off := int64(0); off < int64(len(m.b)); off += chunk {
		n := min(chunk, int64(len(m.b))-off)
		if _, err := d.ReadAt(buf[:n], off); err != nil {
			t.Fatalf("%s: read at %d: %v", what, off, err)
		}
		if i := firstDiff(buf[:n], m.b[off:off+n]); i >= 0 {
			t.Fatalf("%s: byte %d reads %#02x, want %#02x", what, off+int64(i), buf[i], m.b[off+int64(i)])
		}
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

func mustWrite(t *testing.T, d device.Device, p []byte, off int64) {
	t.Helper()
	n, err := d.WriteAt(p, off)
	if err != nil || n != len(p) {
		t.Fatalf("WriteAt(len %d, off %d) = %d, %v; want %d, nil", len(p), off, n, err, len(p))
	}
}

func mustRead(t *testing.T, d device.Device, p []byte, off int64) {
	t.Helper()
	n, err := d.ReadAt(p, off)
	if err != nil || n != len(p) {
		t.Fatalf("ReadAt(len %d, off %d) = %d, %v; want %d, nil", len(p), off, n, err, len(p))
	}
}

func testSize(t *testing.T, open Opener) {
	for _, size := range []int64{DefaultSize, 1<<20 + 3*512} {
		d := open(t, size)
		if got := d.Size(); got != size {
			t.Errorf("Size() = %d, want %d", got, size)
		}
	}
}

func testFreshZero(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	newModel(DefaultSize).verify(t, d, "fresh device")
	// Small unaligned reads of a fresh device too.
	p := UnalignedBuf(777)
	Fill(p, 1)
	mustRead(t, d, p, 12345)
	if !bytes.Equal(p, make([]byte, len(p))) {
		t.Fatalf("fresh device: unaligned read is not zero")
	}
}

// ioCases are the offsets and lengths of RoundTrip: aligned and not, from 1
// byte to 1 MiB, at the start, middle and end of the device.
func ioCases(size int64) (offs []int64, lens []int) {
	offs = []int64{0, 1, 511, 512, 4095, 4096, 4097, 65536 + 13, 3 << 20, size - 1<<20, size - 4096, size - 513, size - 1}
	lens = []int{1, 7, 512, 513, 4096, 4097, 8192, 12345, 65536, 1 << 20}
	return offs, lens
}

func testRoundTrip(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	m := newModel(DefaultSize)
	offs, lens := ioCases(DefaultSize)
	seed := uint64(100)
	for _, off := range offs {
		for _, n := range lens {
			if off+int64(n) > DefaultSize {
				continue
			}
			for _, alignedBuf := range []bool{true, false} {
				seed++
				var w, r []byte
				if alignedBuf {
					w, r = AlignedBuf(n), AlignedBuf(n)
				} else {
					w, r = UnalignedBuf(n), UnalignedBuf(n)
				}
				Fill(w, seed)
				mustWrite(t, d, w, off)
				m.write(w, off)
				mustRead(t, d, r, off)
				if i := firstDiff(r, w); i >= 0 {
					t.Fatalf("write then read (off %d, len %d, aligned buffer %v): byte %d differs",
						off, n, alignedBuf, off+int64(i))
				}
				// Each write must also leave its neighbours alone.
				lo, hi := max(off-4096, 0), min(off+int64(n)+4096, DefaultSize)
				around := make([]byte, hi-lo)
				mustRead(t, d, around, lo)
				if i := firstDiff(around, m.b[lo:hi]); i >= 0 {
					t.Fatalf("after write (off %d, len %d): byte %d reads %#02x, want %#02x",
						off, n, lo+int64(i), around[i], m.b[lo+int64(i)])
				}
			}
		}
	}
	// Zero-length I/O is valid anywhere in [0, size].
	for _, off := range []int64{0, 4096, DefaultSize} {
		if n, err := d.WriteAt(nil, off); n != 0 || err != nil {
			t.Errorf("WriteAt(nil, %d) = %d, %v; want 0, nil", off, n, err)
		}
		if n, err := d.ReadAt(nil, off); n != 0 || err != nil {
			t.Errorf("ReadAt(nil, %d) = %d, %v; want 0, nil", off, n, err)
		}
	}
	m.verify(t, d, "after round trips")
}

// badRanges are requests that do not lie inside a device of the given size.
func badRanges(size int64) [][2]int64 {
	return [][2]int64{
		{-1, 1}, {-4096, 4096}, {-1, 0},
		{size, 1}, {size + 1, 0}, {size + 4096, 4096},
		{size - 10, 20}, {size - 4096, 8192}, {size - 1, 2},
		{math.MaxInt64 - 10, 20}, {math.MaxInt64, 1}, {math.MinInt64, 1},
	}
}

func testOutOfRange(t *testing.T, open Opener) {
	size := int64(DefaultSize)
	d := open(t, size)
	m := newModel(size)
	tail := make([]byte, 16384)
	Fill(tail, 7)
	mustWrite(t, d, tail, size-int64(len(tail)))
	m.write(tail, size-int64(len(tail)))
	head := make([]byte, 8192)
	Fill(head, 8)
	mustWrite(t, d, head, 0)
	m.write(head, 0)

	for _, r := range badRanges(size) {
		off, n := r[0], r[1]
		p := make([]byte, max(n, 0)) // every bad range is short
		Fill(p, 9)
		if got, err := d.WriteAt(p, off); !errors.Is(err, device.ErrOutOfRange) || got != 0 {
			t.Errorf("WriteAt(len %d, off %d) = %d, %v; want 0, ErrOutOfRange", len(p), off, got, err)
		}
		if got, err := d.ReadAt(p, off); !errors.Is(err, device.ErrOutOfRange) || got != 0 {
			t.Errorf("ReadAt(len %d, off %d) = %d, %v; want 0, ErrOutOfRange", len(p), off, got, err)
		}
		if dd, ok := d.(device.Discarder); ok {
			if err := dd.Discard(off, n); !errors.Is(err, device.ErrOutOfRange) {
				t.Errorf("Discard(%d, %d) = %v; want ErrOutOfRange", off, n, err)
			}
		}
		if z, ok := d.(device.Zeroer); ok {
			if err := z.WriteZeroes(off, n); !errors.Is(err, device.ErrOutOfRange) {
				t.Errorf("WriteZeroes(%d, %d) = %v; want ErrOutOfRange", off, n, err)
			}
		}
	}
	m.verify(t, d, "after rejected out-of-range requests")
}

func testConcurrent(t *testing.T, open Opener) {
	const (
		workers = 16
		rounds  = 4
		span    = 4 << 20
	)
	d := open(t, DefaultSize)
	m := newModel(DefaultSize)
	// Disjoint ranges of assorted sizes, packed back to back so that
	// neighbours share sectors and pages: the case where a device that
	// read-modify-writes whole blocks, or mixes direct and buffered I/O on
	// one page, loses data.
	lens := []int64{1, 511, 4096, 3 * 4096, 700, 8192 + 5, 65536, 4096, 3, 4096 * 16}
	type rng struct{ off, n int64 }
	var ranges []rng
	for off, i := int64(0), 0; off < span; i++ {
		n := min(lens[i%len(lens)], span-off)
		ranges = append(ranges, rng{off, n})
		off += n
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				for i := w; i < len(ranges); i += workers {
					rg := ranges[i]
					var p []byte
					if i%2 == 0 {
						p = AlignedBuf(int(rg.n))
					} else {
						p = UnalignedBuf(int(rg.n))
					}
					Fill(p, uint64(i*rounds+r))
					if _, err := d.WriteAt(p, rg.off); err != nil {
						errs <- err
						return
					}
					q := make([]byte, rg.n)
					if _, err := d.ReadAt(q, rg.off); err != nil {
						errs <- err
						return
					}
					if !bytes.Equal(p, q) {
						errs <- fmt.Errorf("range [%d, +%d) did not read back its own write", rg.off, rg.n)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i, rg := range ranges {
		p := make([]byte, rg.n)
		Fill(p, uint64(i*rounds+rounds-1))
		m.write(p, rg.off)
	}
	m.verify(t, d, "after concurrent disjoint writes")
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	m.verify(t, d, "after concurrent disjoint writes and Sync")
}

func testSync(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync of a fresh device: %v", err)
	}
	m := newModel(DefaultSize)
	p := make([]byte, 3*4096+5)
	Fill(p, 3)
	mustWrite(t, d, p, 4096*5+1)
	m.write(p, 4096*5+1)
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("second Sync: %v", err)
	}
	m.verify(t, d, "after Sync")
}

// zeroCases are the ranges Discard and WriteZeroes are tried on.
var zeroCases = [][2]int64{
	{65536, 65536},             // aligned
	{200001, 10000},            // unaligned both ends
	{300000, 1},                // one byte
	{4096*100 - 1, 4096*2 + 2}, // straddling whole blocks
	{1 << 20, 1 << 20},         // large, aligned
	{DefaultSize - 4097, 4097},
	{12345, 0},
}

func patterned(t *testing.T, d device.Device) *model {
	t.Helper()
	m := newModel(d.Size())
	p := make([]byte, 1<<20)
	for off := int64(0); off < d.Size(); off += int64(len(p)) {
		q := p[:min(int64(len(p)), d.Size()-off)]
		Fill(q, uint64(off))
		mustWrite(t, d, q, off)
		m.write(q, off)
	}
	return m
}

func testDiscard(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	dd, ok := d.(device.Discarder)
	if !ok {
		t.Skip("not a device.Discarder")
	}
	m := patterned(t, d)
	for _, c := range zeroCases {
		if err := dd.Discard(c[0], c[1]); err != nil {
			t.Fatalf("Discard(%d, %d): %v", c[0], c[1], err)
		}
		// The contract leaves the discarded range unspecified (old data
		// or zeroes, per byte): accept what is there, then check that
		// nothing outside it changed.
		got := make([]byte, c[1])
		mustRead(t, d, got, c[0])
		for i, b := range got {
			if b != 0 && b != m.b[c[0]+int64(i)] {
				t.Fatalf("Discard(%d, %d): byte %d reads %#02x, neither old data nor zero", c[0], c[1], c[0]+int64(i), b)
			}
		}
		m.write(got, c[0])
		m.verify(t, d, fmt.Sprintf("after Discard(%d, %d)", c[0], c[1]))
	}
	// A discarded range can be written again.
	p := make([]byte, 65536)
	Fill(p, 77)
	mustWrite(t, d, p, 65536)
	m.write(p, 65536)
	m.verify(t, d, "after rewriting a discarded range")
}

func testWriteZeroes(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	z, ok := d.(device.Zeroer)
	if !ok {
		t.Skip("not a device.Zeroer")
	}
	m := patterned(t, d)
	for _, c := range zeroCases {
		if err := z.WriteZeroes(c[0], c[1]); err != nil {
			t.Fatalf("WriteZeroes(%d, %d): %v", c[0], c[1], err)
		}
		m.zero(c[0], c[1])
		m.verify(t, d, fmt.Sprintf("after WriteZeroes(%d, %d)", c[0], c[1]))
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	p := make([]byte, 4096)
	Fill(p, 78)
	mustWrite(t, d, p, 65536+4096)
	m.write(p, 65536+4096)
	m.verify(t, d, "after writing into a zeroed range")
}

func testClosed(t *testing.T, open Opener) {
	d := open(t, DefaultSize)
	if err := d.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	p := make([]byte, 4096)
	if _, err := d.ReadAt(p, 0); !errors.Is(err, device.ErrClosed) {
		t.Errorf("ReadAt after Close: %v; want ErrClosed", err)
	}
	if _, err := d.WriteAt(p, 0); !errors.Is(err, device.ErrClosed) {
		t.Errorf("WriteAt after Close: %v; want ErrClosed", err)
	}
	if err := d.Sync(); !errors.Is(err, device.ErrClosed) {
		t.Errorf("Sync after Close: %v; want ErrClosed", err)
	}
	if dd, ok := d.(device.Discarder); ok {
		if err := dd.Discard(0, 4096); !errors.Is(err, device.ErrClosed) {
			t.Errorf("Discard after Close: %v; want ErrClosed", err)
		}
	}
	if z, ok := d.(device.Zeroer); ok {
		if err := z.WriteZeroes(0, 4096); !errors.Is(err, device.ErrClosed) {
			t.Errorf("WriteZeroes after Close: %v; want ErrClosed", err)
		}
	}
	_ = d.Close() // must not panic; the result is the device's to choose
}
