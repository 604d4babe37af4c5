//go:build linux

package device_test

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
)

// openTempFile creates a sparse file of size bytes in a fresh temporary
// directory and opens it with opts.
func openTempFile(t testing.TB, size int64, opts device.FileOptions) *device.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "dev.img")
	if err := device.CreateSparse(path, size); err != nil {
		t.Fatal(err)
	}
	f, err := device.OpenFile(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestFileConformance(t *testing.T) {
	for _, tc := range []struct {
		name string
		mode device.DirectMode
	}{
		{"DirectOff", device.DirectOff},
		{"DirectAuto", device.DirectAuto},
	} {
		t.Run(tc.name, func(t *testing.T) {
			devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
				f := openTempFile(t, size, device.FileOptions{Direct: tc.mode})
				if tc.mode == device.DirectOff && f.Direct() {
					t.Fatal("DirectOff gave a direct device")
				}
				t.Logf("%s: direct=%v logical block size %d", f.Path(), f.Direct(), f.LogicalBlockSize())
				return f
			})
		})
	}
}

// TestFileDirectOn checks that DirectOn either gives a direct device or fails
// with ErrDirectUnsupported, and that the temporary directory's file system is
// one the other tests expect.
func TestFileDirectOn(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "dev.img")
	if err := device.CreateSparse(path, 1<<20); err != nil {
		t.Fatal(err)
	}
	var sfs syscall.Statfs_t
	if err := syscall.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	f, err := device.OpenFile(path, device.FileOptions{Direct: device.DirectOn})
	if err != nil {
		if !errors.Is(err, device.ErrDirectUnsupported) || !errors.Is(err, errors.ErrUnsupported) {
			t.Fatalf("DirectOn failed with %v; want ErrDirectUnsupported", err)
		}
		t.Logf("file system %#x of %s refuses O_DIRECT: %v", sfs.Type, dir, err)
		auto, err := device.OpenFile(path, device.FileOptions{})
		if err != nil {
			t.Fatalf("DirectAuto did not fall back to buffered I/O: %v", err)
		}
		defer auto.Close()
		if auto.Direct() {
			t.Fatal("DirectAuto claims O_DIRECT where DirectOn was refused")
		}
		return
	}
	defer f.Close()
	if !f.Direct() {
		t.Fatal("DirectOn gave a buffered device")
	}
	t.Logf("file system %#x of %s: O_DIRECT, logical block size %d", sfs.Type, dir, f.LogicalBlockSize())
}

func TestFileReadOnly(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ro.img")
	if err := device.CreateSparse(path, 1<<20); err != nil {
		t.Fatal(err)
	}
	f, err := device.OpenFile(path, device.FileOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := make([]byte, 4096)
	if _, err := f.ReadAt(p, 0); err != nil {
		t.Fatalf("read of a read-only device: %v", err)
	}
	_, err = f.WriteAt(p, 0)
	if !errors.Is(err, syscall.EPERM) || !errors.Is(err, device.ErrReadOnly) {
		t.Errorf("WriteAt on read-only device: %v; want EPERM", err)
	}
	if err := f.Discard(0, 4096); !errors.Is(err, syscall.EPERM) {
		t.Errorf("Discard on read-only device: %v; want EPERM", err)
	}
	if err := f.WriteZeroes(0, 4096); !errors.Is(err, syscall.EPERM) {
		t.Errorf("WriteZeroes on read-only device: %v; want EPERM", err)
	}
	if err := f.Sync(); err != nil {
		t.Errorf("Sync of a read-only device: %v", err)
	}
}

func TestCreateSparse(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sparse.img")
	const size = 1 << 30
	if err := device.CreateSparse(path, size); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != size {
		t.Fatalf("size %d, want %d", fi.Size(), size)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Blocks*512 > 1<<20 {
		t.Errorf("a fresh 1 GiB file uses %d bytes: not sparse", st.Blocks*512)
	}
	// Idempotent, extends, refuses to shrink.
	if err := device.CreateSparse(path, size); err != nil {
		t.Fatalf("CreateSparse of the same size: %v", err)
	}
	if err := device.CreateSparse(path, 2*size); err != nil {
		t.Fatalf("extend: %v", err)
	}
	err = device.CreateSparse(path, size)
	if err == nil || !strings.Contains(err.Error(), "shrink") {
		t.Fatalf("shrink: %v; want a refusal", err)
	}
	if fi, _ := os.Stat(path); fi.Size() != 2*size {
		t.Fatalf("refused shrink changed the size to %d", fi.Size())
	}
	if err := device.CreateSparse(path, -1); err == nil {
		t.Fatal("negative size accepted")
	}
}

func TestOpenFileErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := device.OpenFile(filepath.Join(dir, "missing"), device.FileOptions{}); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v; want ErrNotExist", err)
	}
	if _, err := device.OpenFile(dir, device.FileOptions{ReadOnly: true}); err == nil {
		t.Error("a directory was accepted as a device")
	}
	path := filepath.Join(dir, "f")
	if err := device.CreateSparse(path, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := device.OpenFile(path, device.FileOptions{Direct: 42}); err == nil {
		t.Error("invalid DirectMode accepted")
	}
}

// TestFileTruncatedUnderneath: if the file shrinks behind the device's back,
// reads past the new end fail with io.EOF instead of returning short counts
// with a nil error.
func TestFileTruncatedUnderneath(t *testing.T) {
	for _, mode := range []device.DirectMode{device.DirectOff, device.DirectAuto} {
		f := openTempFile(t, 1<<20, device.FileOptions{Direct: mode})
		if err := os.Truncate(f.Path(), 6000); err != nil {
			t.Fatal(err)
		}
		for _, c := range [][2]int{{4096, 4096}, {5000, 3000}, {8192, 4096}} {
			p := devicetest.AlignedBuf(c[1])
			n, err := f.ReadAt(p, int64(c[0]))
			if err == nil || n == len(p) {
				t.Errorf("direct=%v: read [%d, +%d) of a truncated file = %d, %v; want a short read with an error",
					f.Direct(), c[0], c[1], n, err)
			} else if !errors.Is(err, io.EOF) {
				t.Errorf("direct=%v: read past the truncated end: %v; want io.EOF", f.Direct(), err)
			}
		}
	}
}

func TestFileErrorContext(t *testing.T) {
	f := openTempFile(t, 1<<20, device.FileOptions{})
	_, err := f.WriteAt(make([]byte, 10), 1<<20-5)
	var ioe *device.IOError
	if !errors.As(err, &ioe) || ioe.Path != f.Path() || ioe.Off != 1<<20-5 || ioe.Len != 10 {
		t.Fatalf("error %v lacks path/offset/length", err)
	}
	for _, want := range []string{f.Path(), "1048571", "1048576"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// TestFileAlignedIONoAlloc checks that the hot paths (aligned I/O into an
// aligned buffer, and the bounce path for an unaligned buffer once the pool is
// warm) do not allocate.
func TestFileAlignedIONoAlloc(t *testing.T) {
	f := openTempFile(t, 1<<20, device.FileOptions{})
	aligned := devicetest.AlignedBuf(4096)
	unaligned := devicetest.UnalignedBuf(4096)
	for name, p := range map[string][]byte{"aligned": aligned, "unaligned": unaligned} {
		if allocs := testing.AllocsPerRun(100, func() {
			if _, err := f.WriteAt(p, 8192); err != nil {
				t.Fatal(err)
			}
			if _, err := f.ReadAt(p, 8192); err != nil {
				t.Fatal(err)
			}
		}); allocs != 0 && !raceEnabled {
			t.Errorf("%s buffer (direct=%v): %v allocations per write+read", name, f.Direct(), allocs)
		}
	}
}

// TestBlockDevice runs the conformance suite on a loop device, which
// exercises BLKGETSIZE64, BLKSSZGET, BLKDISCARD and BLKZEROOUT. It needs
// root; it is skipped otherwise unless CI is set, when it must run.
func TestBlockDevice(t *testing.T) {
	if _, err := exec.LookPath("losetup"); err != nil || os.Geteuid() != 0 {
		if os.Getenv("CI") == "" {
			t.Skipf("needs root and losetup (euid %d, losetup: %v)", os.Geteuid(), err)
		}
		t.Fatalf("CI is set but the loop-device test cannot run: euid %d, losetup: %v", os.Geteuid(), err)
	}
	open := func(t *testing.T, size int64, opts device.FileOptions) *device.File {
		img := filepath.Join(t.TempDir(), "loop.img")
		if err := device.CreateSparse(img, size); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
		if err != nil {
			t.Fatalf("losetup --find --show %s: %v: %s", img, err, out)
		}
		loop := strings.TrimSpace(string(out))
		t.Cleanup(func() {
			if out, err := exec.Command("losetup", "-d", loop).CombinedOutput(); err != nil {
				t.Errorf("losetup -d %s: %v: %s", loop, err, out)
			}
		})
		f, err := device.OpenFile(loop, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	for _, tc := range []struct {
		name string
		mode device.DirectMode
	}{
		{"DirectOn", device.DirectOn},
		{"DirectOff", device.DirectOff},
	} {
		t.Run(tc.name, func(t *testing.T) {
			devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
				f := open(t, size, device.FileOptions{Direct: tc.mode})
				t.Logf("%s: direct=%v logical block size %d", f.Path(), f.Direct(), f.LogicalBlockSize())
				return f
			})
		})
	}
	t.Run("DiscardReadsZeroOnLoop", func(t *testing.T) {
		// A loop device punches a hole in its backing file: the
		// discarded blocks read as zeroes (not promised by the Device
		// contract, but it shows BLKDISCARD reached the device).
		f := open(t, 4<<20, device.FileOptions{Direct: device.DirectOn})
		p := devicetest.AlignedBuf(1 << 20)
		devicetest.Fill(p, 5)
		if _, err := f.WriteAt(p, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Discard(4096, 65536); err != nil {
			t.Fatal(err)
		}
		if _, err := f.ReadAt(p[:65536], 4096); err != nil {
			t.Fatal(err)
		}
		for i, b := range p[:65536] {
			if b != 0 {
				t.Fatalf("byte %d after BLKDISCARD on a loop device is %#x, want 0", 4096+i, b)
			}
		}
	})
}

// BenchmarkFileRead4K measures aligned 4 KiB random reads of a 64 MiB file
// into an aligned buffer: "direct" (O_DIRECT, so the device's latency) and
// "buffered" (page cache hits, so the syscall's cost), and "direct-bounce"
// with an unaligned buffer; one goroutine, so ns/op is the latency, and with
// "-parallel" GOMAXPROCS goroutines, so ns/op is the inverse of throughput.
func BenchmarkFileRead4K(b *testing.B) {
	const size = 64 << 20
	for _, bc := range []struct {
		name      string
		mode      device.DirectMode
		unaligned bool
		parallel  bool
	}{
		{"direct", device.DirectOn, false, false},
		{"direct-bounce", device.DirectOn, true, false},
		{"buffered", device.DirectOff, false, false},
		{"direct-parallel", device.DirectOn, false, true},
		{"buffered-parallel", device.DirectOff, false, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			f := openTempFile(b, size, device.FileOptions{Direct: bc.mode})
			chunk := devicetest.AlignedBuf(1 << 20)
			for off := int64(0); off < size; off += int64(len(chunk)) {
				devicetest.Fill(chunk, uint64(off))
				if _, err := f.WriteAt(chunk, off); err != nil {
					b.Fatal(err)
				}
			}
			if err := f.Sync(); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(4096)
			b.ReportAllocs()
			newBuf := func() []byte {
				if bc.unaligned {
					return devicetest.UnalignedBuf(4096)
				}
				return devicetest.AlignedBuf(4096)
			}
			if !bc.parallel {
				p := newBuf()
				rng := rand.New(rand.NewPCG(1, 2))
				for b.Loop() {
					if _, err := f.ReadAt(p, rng.Int64N(size/4096)*4096); err != nil {
						b.Fatal(err)
					}
				}
				return
			}
			b.RunParallel(func(pb *testing.PB) {
				p := newBuf()
				rng := rand.New(rand.NewPCG(rand.Uint64(), 0))
				for pb.Next() {
					if _, err := f.ReadAt(p, rng.Int64N(size/4096)*4096); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// TestFileSubPageMixedIO hammers one page with sector-aligned writes to its
// first half and unaligned writes to its second half from two goroutines. If
// the aligned writes went O_DIRECT while the others dirtied the same page
// through the page cache, the kernel could write the stale cached page back
// over a direct write. File avoids that by sending only page-aligned requests
// down the direct path; this test checks the outcome. (With that rule
// disabled the loss did not reproduce here, on Linux 6.18 ext4: the window is
// narrow. The test guards the outcome, not proof of the hazard.)
func TestFileSubPageMixedIO(t *testing.T) {
	f := openTempFile(t, 1<<20, device.FileOptions{})
	const rounds = 2000
	for page := int64(0); page < 4; page++ {
		base := page * 4096
		done := make(chan error, 2)
		a := devicetest.AlignedBuf(2048)
		b := make([]byte, 2000)
		go func() {
			for r := range rounds {
				devicetest.Fill(a, uint64(r))
				if _, err := f.WriteAt(a, base); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		go func() {
			for r := range rounds {
				devicetest.Fill(b, uint64(r)+1e6)
				if _, err := f.WriteAt(b, base+2048+48); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		for range 2 {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		got := devicetest.AlignedBuf(4096)
		if _, err := f.ReadAt(got, base); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[:2048], a) || !bytes.Equal(got[2048+48:2048+48+2000], b) {
			t.Fatalf("page %d (direct=%v): a concurrent write to one half of the page was lost", page, f.Direct())
		}
	}
}

// TestFileConformanceTmpfs runs the suite on tmpfs (/dev/shm) with
// DirectAuto: tmpfs refuses O_DIRECT before Linux 6.6 (then File must fall
// back to buffered I/O) and accepts it after.
func TestFileConformanceTmpfs(t *testing.T) {
	var sfs syscall.Statfs_t
	const tmpfsMagic = 0x01021994
	if err := syscall.Statfs("/dev/shm", &sfs); err != nil || sfs.Type != tmpfsMagic {
		t.Skip("/dev/shm is not tmpfs")
	}
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		dir, err := os.MkdirTemp("/dev/shm", "tiercache-device-test-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		path := filepath.Join(dir, "dev.img")
		if err := device.CreateSparse(path, size); err != nil {
			t.Fatal(err)
		}
		f, err := device.OpenFile(path, device.FileOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		t.Logf("tmpfs: direct=%v logical block size %d", f.Direct(), f.LogicalBlockSize())
		return f
	})
}
