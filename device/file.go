//go:build linux

package device

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tiercache/tiercache/internal/invariants"
)

// This file is the production Device: a regular file or a block device,
// normally opened with O_DIRECT so that the cache device's data does not
// also sit in the kernel's page cache (tiercache is the cache) and so that a
// completed write has left the host's memory.
//
// O_DIRECT requires the offset, the length and the buffer address to be
// aligned. Callers of a Device are not asked to know that, so each request
// takes one of three paths:
//
//  1. offset and length multiples of the direct alignment (see below) and an
//     aligned buffer: Linux native AIO on the O_DIRECT fd (aio_linux.go;
//     pread/pwrite if the kernel refuses an AIO context). No allocation,
//     no copy; this is the hot path of the cache engine, which does all
//     its I/O in aligned 4 KiB multiples into aligned buffers.
//  2. aligned offset and length but an unaligned buffer (a []byte from
//     make): the data is copied through a pooled, page-aligned bounce buffer
//     and then takes path 1.
//  3. anything else: pread/pwrite on a second, buffered fd of the same file.
//
// Path 3 relies on Linux keeping direct and buffered I/O on one file
// coherent: a direct read first writes back dirty page-cache pages in its
// range, and a direct write invalidates the cached pages it covers, before and
// after it. The kernel cannot keep that promise for a page that is dirtied by a
// buffered write while a direct write to another part of the same page is in
// flight (the invalidation fails and the stale page is later written back over
// the direct write). That is why "aligned" here means aligned to
// max(logical block size, page size), not just the logical block size: a
// direct request then covers whole pages only, so two concurrent requests to
// disjoint byte ranges never share a page across the two paths. Only
// overlapping concurrent writes (whose result the Device contract leaves
// undefined anyway) can meet in one page.
//
// Fdatasync is per inode, so Sync on either fd makes the writes of both
// durable.

// DirectMode selects whether a File uses O_DIRECT.
type DirectMode int

const (
	// DirectAuto uses O_DIRECT when the file system accepts it (probed at
	// open) and buffered I/O otherwise (tmpfs before Linux 6.6, some FUSE
	// file systems).
	DirectAuto DirectMode = iota
	// DirectOn requires O_DIRECT: OpenFile fails if it is unavailable.
	DirectOn
	// DirectOff uses buffered I/O only.
	DirectOff
)

func (m DirectMode) String() string {
	switch m {
	case DirectAuto:
		return "auto"
	case DirectOn:
		return "on"
	case DirectOff:
		return "off"
	}
	return fmt.Sprintf("DirectMode(%d)", int(m))
}

// FileOptions configures OpenFile. The zero value opens read-write with
// DirectAuto.
type FileOptions struct {
	// ReadOnly opens the file O_RDONLY; writes, discards and write-zeroes
	// then fail with ErrReadOnly (which wraps syscall.EPERM).
	ReadOnly bool
	// Direct selects O_DIRECT use.
	Direct DirectMode
}

// ErrDirectUnsupported is returned by OpenFile with DirectOn when the file
// cannot be used with O_DIRECT. It wraps errors.ErrUnsupported.
var ErrDirectUnsupported = fmt.Errorf("device: O_DIRECT not supported: %w", errors.ErrUnsupported)

// File is a Device over a regular file or a block device (Linux). It also
// implements Discarder and Zeroer. Its methods are safe for concurrent use;
// Close waits for I/O in flight.
type File struct {
	path     string
	size     int64
	lbs      int   // logical block size reported by LogicalBlockSize
	isBlock  bool  // a block device: ioctls instead of fallocate
	readOnly bool  //
	direct   bool  // fd is O_DIRECT
	dioAlign int64 // offset and length alignment of the direct path (path 1); 0 if !direct
	memAlign uintptr

	fd  int  // the I/O fd: O_DIRECT when direct
	bfd int  // buffered fd for unaligned requests; == fd when !direct
	aio *aio // native AIO for the direct fd (aio_linux.go); nil: pread/pwrite
	// plugAIO is aio as opened, kept after Close: Plug and Unplug use it
	// without f.mu (an Unplug must not wait behind a Close that waits for
	// the reads the plug holds).
	plugAIO *aio

	// mu orders I/O against Close: an operation holds the read lock while
	// it uses an fd, Close holds the write lock, so an fd number is never
	// used after close (when the kernel may have handed it to someone
	// else).
	mu     sync.RWMutex
	closed bool // guarded by mu
}

var (
	_ Device      = (*File)(nil)
	_ Discarder   = (*File)(nil)
	_ Zeroer      = (*File)(nil)
	_ AsyncReader = (*File)(nil)
	_ Plugger     = (*File)(nil)
)

// pageSize is the granularity of the page cache; see the file comment for why
// direct requests are aligned to it.
var pageSize = int64(os.Getpagesize())

// OpenFile opens a regular file or a block device as a Device. The size is
// fixed at open: the file's size from stat, or the block device's size from
// BLKGETSIZE64.
func OpenFile(path string, opts FileOptions) (*File, error) {
	switch opts.Direct {
	case DirectAuto, DirectOn, DirectOff:
	default:
		return nil, fmt.Errorf("device: open %s: invalid direct mode %v", path, opts.Direct)
	}
	flags := unix.O_CLOEXEC | unix.O_RDWR
	if opts.ReadOnly {
		flags = unix.O_CLOEXEC | unix.O_RDONLY
	}
	bfd, err := openRetry(path, flags)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := &File{path: path, fd: bfd, bfd: bfd, readOnly: opts.ReadOnly, lbs: 512}
	ok := false
	defer func() {
		if !ok {
			f.closeFDs()
		}
	}()

	var st unix.Stat_t
	if err := unix.Fstat(bfd, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		f.size = st.Size
	case unix.S_IFBLK:
		f.isBlock = true
		sz, err := ioctlGetUint64(bfd, unix.BLKGETSIZE64)
		if err != nil {
			return nil, &os.PathError{Op: "ioctl BLKGETSIZE64", Path: path, Err: err}
		}
		f.size = int64(sz)
		lbs, err := unix.IoctlGetInt(bfd, unix.BLKSSZGET)
		if err != nil {
			return nil, &os.PathError{Op: "ioctl BLKSSZGET", Path: path, Err: err}
		}
		f.lbs = lbs
	default:
		return nil, fmt.Errorf("device: open %s: not a regular file or block device (mode %#o)", path, st.Mode)
	}

	if opts.Direct != DirectOff {
		err := f.openDirect(flags, &st)
		if err != nil && opts.Direct == DirectOn {
			return nil, fmt.Errorf("device: open %s: %w: %v", path, ErrDirectUnsupported, err)
		}
	}
	ok = true
	return f, nil
}

// openDirect opens and probes the O_DIRECT fd. On success f.fd is the
// direct fd; on failure f is unchanged (buffered).
func (f *File) openDirect(flags int, st *unix.Stat_t) error {
	dfd, err := openRetry(f.path, flags|unix.O_DIRECT)
	if err != nil {
		return err
	}
	keep := false
	defer func() {
		if !keep {
			unix.Close(dfd)
		}
	}()
	// The path could have been replaced between the two opens.
	var st2 unix.Stat_t
	if err := unix.Fstat(dfd, &st2); err != nil {
		return err
	}
	if st2.Dev != st.Dev || st2.Ino != st.Ino || st2.Rdev != st.Rdev {
		return errors.New("file changed between opens")
	}

	// Alignment: statx(STATX_DIOALIGN) (Linux 6.1 for files, 6.11 for
	// block devices) is authoritative, including "not supported".
	// Without it, use the logical block size for block devices and a
	// conservative 4 KiB for files.
	offAlign, memAlign := int64(f.lbs), uintptr(f.lbs)
	if !f.isBlock {
		offAlign, memAlign = 4096, 4096
	}
	var sx unix.Statx_t
	if err := unix.Statx(dfd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &sx); err == nil &&
		sx.Mask&unix.STATX_DIOALIGN != 0 {
		if sx.Dio_offset_align == 0 {
			return errors.New("statx reports no direct I/O support")
		}
		offAlign, memAlign = int64(sx.Dio_offset_align), uintptr(sx.Dio_mem_align)
	}
	if memAlign == 0 || memAlign&(memAlign-1) != 0 || memAlign > uintptr(pageSize) {
		return fmt.Errorf("unusable direct I/O memory alignment %d", memAlign)
	}
	dioAlign := max(offAlign, pageSize)
	if offAlign <= 0 || dioAlign%offAlign != 0 || maxBounce%dioAlign != 0 {
		return fmt.Errorf("unusable direct I/O offset alignment %d", offAlign)
	}

	// Some file systems accept O_DIRECT at open and refuse it at I/O time.
	if f.size >= dioAlign {
		b := getBounce(int(dioAlign))
		_, err := preadFull(dfd, b.b[:dioAlign], 0)
		putBounce(b)
		if err != nil {
			return fmt.Errorf("direct read probe: %w", err)
		}
	}
	if !f.isBlock {
		f.lbs = int(offAlign)
	}
	f.fd, f.direct, f.dioAlign, f.memAlign = dfd, true, dioAlign, memAlign
	f.aio = newAIO()
	f.plugAIO = f.aio
	keep = true
	return nil
}

func openRetry(path string, flags int) (int, error) {
	for {
		fd, err := unix.Open(path, flags, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// CreateSparse creates path as a sparse regular file of size bytes, or
// extends an existing smaller file to size. It refuses to shrink a larger
// file: that would destroy data, and a size mismatch is better reported than
// silently repaired. The new size is fsync'd; the directory entry is not.
func CreateSparse(path string, size int64) error {
	if size < 0 {
		return fmt.Errorf("device: create %s: negative size %d", path, size)
	}
	fh, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("device: create: %w", err)
	}
	defer fh.Close()
	fi, err := fh.Stat()
	if err != nil {
		return fmt.Errorf("device: create: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("device: create %s: not a regular file", path)
	}
	if fi.Size() > size {
		return fmt.Errorf("device: create %s: existing file is %d bytes, larger than the requested %d; refusing to shrink it",
			path, fi.Size(), size)
	}
	if fi.Size() < size {
		if err := fh.Truncate(size); err != nil {
			return fmt.Errorf("device: create: %w", err)
		}
	}
	if err := fh.Sync(); err != nil {
		return fmt.Errorf("device: create: %w", err)
	}
	return fh.Close()
}

// Path returns the path the device was opened with.
func (f *File) Path() string { return f.path }

// Size returns the device size in bytes, fixed at open.
func (f *File) Size() int64 { return f.size }

// Direct reports whether the device uses O_DIRECT.
func (f *File) Direct() bool { return f.direct }

// LogicalBlockSize returns the smallest unit the device can write atomically
// with direct I/O: BLKSSZGET for a block device; for a regular file, the
// file system's direct I/O offset alignment when Direct, else 512. Requests
// need not be aligned to it; aligned requests (to it and to the page size) are
// the fast path.
func (f *File) LogicalBlockSize() int { return f.lbs }

func (f *File) ioErr(op string, off, n int64, err error) error {
	return &IOError{Op: op, Path: f.path, Off: off, Len: n, Err: err}
}

// isAligned reports whether a request may use the direct fd (given an
// aligned buffer).
func (f *File) isAligned(off int64, n int) bool {
	return f.direct && off%f.dioAlign == 0 && int64(n)%f.dioAlign == 0
}

func (f *File) bufAligned(p []byte) bool {
	return uintptr(unsafe.Pointer(unsafe.SliceData(p)))&(f.memAlign-1) == 0
}

// ReadAt reads len(p) bytes at off. It returns len(p), nil or an error
// (wrapping ErrOutOfRange, ErrClosed, a syscall.Errno or io.EOF if the file
// was truncated under the device). A direct read while the File has no
// other direct I/O in flight is one pread (aio_linux.go, invariant 9).
func (f *File) ReadAt(p []byte, off int64) (int, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return 0, f.ioErr("read", off, int64(len(p)), ErrClosed)
	}
	if CheckRange(off, int64(len(p)), f.size) != nil {
		return 0, f.ioErr("read", off, int64(len(p)), RangeError("read", off, int64(len(p)), f.size))
	}
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var err error
	switch {
	case !f.isAligned(off, len(p)):
		n, err = preadFull(f.bfd, p, off)
	case f.bufAligned(p):
		n, err = f.preadDirect(p, off)
	default:
		n, err = f.bounceRead(p, off)
	}
	if err != nil {
		return n, f.ioErr("read", off, int64(len(p)), err)
	}
	return n, nil
}

// WriteAt writes len(p) bytes at off. The data is durable only after Sync.
func (f *File) WriteAt(p []byte, off int64) (int, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if err := f.checkWriteLocked("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		return 0, nil
	}
	n, err := f.writeLocked(p, off)
	if err != nil {
		return n, f.ioErr("write", off, int64(len(p)), err)
	}
	return n, nil
}

// checkWriteLocked validates a modifying request. REQUIRES: f.mu held.
func (f *File) checkWriteLocked(op string, off, n int64) error {
	if f.closed {
		return f.ioErr(op, off, n, ErrClosed)
	}
	if f.readOnly {
		return f.ioErr(op, off, n, ErrReadOnly)
	}
	if CheckRange(off, n, f.size) != nil {
		return f.ioErr(op, off, n, RangeError(op, off, n, f.size))
	}
	return nil
}

// writeLocked writes p at off through the right path. REQUIRES: f.mu held.
func (f *File) writeLocked(p []byte, off int64) (int, error) {
	switch {
	case !f.isAligned(off, len(p)):
		return pwriteFull(f.bfd, p, off)
	case f.bufAligned(p):
		return f.pwriteDirect(p, off)
	default:
		return f.bounceWrite(p, off)
	}
}

// preadDirect is preadFull on the direct fd (p, off and len(p) aligned),
// through AIO when the File has it.
func (f *File) preadDirect(p []byte, off int64) (int, error) {
	if f.aio != nil {
		return f.aio.do(iocbCmdPread, f.fd, p, off)
	}
	return preadFull(f.fd, p, off)
}

// StartReadAt starts reading len(p) bytes at off and returns true; done is
// then called once with what ReadAt would have returned. It returns false,
// having done nothing, when the read cannot be started without waiting:
// the File has no AIO, the request is not aligned for the direct path
// (offset, length, buffer), every AIO slot is taken, or the File is
// closed. The caller then uses ReadAt.
//
// done runs on the goroutine that reaps completions, which serves every
// request of the File: it must not block, nor call the File's methods
// itself (it holds the File's read lock). p belongs to the read until done
// is called. Close waits for every started read's done to return.
func (f *File) StartReadAt(p []byte, off int64, done func(n int, err error, later func(func()))) bool {
	if len(p) == 0 || !f.isAligned(off, len(p)) || !f.bufAligned(p) {
		return false
	}
	if !f.mu.TryRLock() {
		return false // Close is running or waiting
	}
	if f.closed || f.aio == nil || CheckRange(off, int64(len(p)), f.size) != nil {
		f.mu.RUnlock()
		return false
	}
	fd := f.fd
	ok := f.aio.start(iocbCmdPread, fd, p, off, func(res int64, later func(func())) { f.finishRead(fd, p, off, res, later, done) })
	if !ok {
		f.mu.RUnlock()
	}
	return ok
}

// Plug holds back the submission of the reads StartReadAt starts, from
// any caller, until the matching Unplug (Plugger): reads started meanwhile
// go to the kernel in one io_submit. Synchronous I/O still submits at once,
// and everything held with it, as does a read that makes aioPlugMax held. Without AIO it
// does nothing.
func (f *File) Plug() {
	if f.plugAIO != nil {
		f.plugAIO.plug()
	}
}

// Unplug ends a Plug; the last one submits what was held back.
func (f *File) Unplug() {
	if f.plugAIO != nil {
		f.plugAIO.unplug()
	}
}

// finishRead completes a read StartReadAt started, whose AIO result is res
// (bytes, -errno or aioFallback): it calls done, then releases the read
// lock the read held (so Close returns after every done), at once if the
// read is complete or failed (passing later on), else (refused, or short)
// from a new goroutine that reads the rest with pread, which blocks, so
// not on the reaper.
func (f *File) finishRead(fd int, p []byte, off int64, res int64, later func(func()), done func(int, error, func(func()))) {
	if res == int64(len(p)) {
		done(len(p), nil, later)
		f.mu.RUnlock()
		return
	}
	if res < 0 && res != aioFallback || res > int64(len(p)) {
		err := error(unix.EIO)
		if res < 0 {
			err = unix.Errno(-res)
		}
		done(0, f.ioErr("read", off, int64(len(p)), err), later)
		f.mu.RUnlock()
		return
	}
	got := max(res, 0)
	go func() {
		defer f.mu.RUnlock()
		n, err := preadFull(fd, p[got:], off+got)
		if err != nil {
			err = f.ioErr("read", off, int64(len(p)), err)
		}
		WithLater(func(later func(func())) { done(int(got)+n, err, later) })
	}()
}

// pwriteDirect is pwriteFull on the direct fd, like preadDirect.
func (f *File) pwriteDirect(p []byte, off int64) (int, error) {
	if f.aio != nil {
		return f.aio.do(iocbCmdPwrite, f.fd, p, off)
	}
	return pwriteFull(f.fd, p, off)
}

func (f *File) bounceRead(p []byte, off int64) (int, error) {
	b := getBounce(min(len(p), maxBounce))
	defer putBounce(b)
	done := 0
	for done < len(p) {
		chunk := min(len(p)-done, maxBounce)
		n, err := f.preadDirect(b.b[:chunk], off+int64(done))
		done += copy(p[done:], b.b[:n])
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

func (f *File) bounceWrite(p []byte, off int64) (int, error) {
	b := getBounce(min(len(p), maxBounce))
	defer putBounce(b)
	done := 0
	for done < len(p) {
		chunk := copy(b.b[:min(len(p)-done, maxBounce)], p[done:])
		n, err := f.pwriteDirect(b.b[:chunk], off+int64(done))
		done += n
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// Sync makes every completed write durable (fdatasync, which covers both
// fds: it is per inode).
func (f *File) Sync() error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return f.ioErr("sync", 0, 0, ErrClosed)
	}
	for {
		err := unix.Fdatasync(f.fd)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return f.ioErr("sync", 0, 0, err)
		}
		return nil
	}
}

// Discard deallocates [off, off+length): a hole punched in a file
// (FALLOC_FL_PUNCH_HOLE, reads as zeroes), BLKDISCARD on the whole logical
// blocks inside the range of a block device (contents then unspecified). When
// the file system or device cannot discard, Discard does nothing and returns
// nil: leaving the data in place is a valid discard.
func (f *File) Discard(off, length int64) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if err := f.checkWriteLocked("discard", off, length); err != nil {
		return err
	}
	if length == 0 {
		return nil
	}
	var err error
	if f.isBlock {
		lbs := int64(f.lbs)
		start, end := roundUp(off, lbs), (off+length)/lbs*lbs
		if end > start {
			err = ioctlRange(f.bfd, unix.BLKDISCARD, start, end-start)
		}
	} else {
		err = fallocate(f.bfd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	}
	if isUnsupported(err) {
		err = nil
	}
	if err != nil {
		return f.ioErr("discard", off, length, err)
	}
	return nil
}

// WriteZeroes makes [off, off+length) read as zeroes: FALLOC_FL_ZERO_RANGE on
// a file, falling back to FALLOC_FL_PUNCH_HOLE and then to writing zeroes;
// BLKZEROOUT on a block device (for whole logical blocks; partial blocks at the
// edges, or a device without it, get written zeroes). Like a write, it is
// durable only after Sync.
func (f *File) WriteZeroes(off, length int64) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if err := f.checkWriteLocked("write-zeroes", off, length); err != nil {
		return err
	}
	if length == 0 {
		return nil
	}
	var err error
	if f.isBlock {
		err = f.zeroBlockLocked(off, length)
	} else {
		err = fallocate(f.bfd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, length)
		if isUnsupported(err) {
			err = fallocate(f.bfd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length)
		}
		if isUnsupported(err) {
			err = f.writeZeroBuffersLocked(off, length)
		}
	}
	if err != nil {
		return f.ioErr("write-zeroes", off, length, err)
	}
	return nil
}

// zeroBlockLocked zeroes a range of a block device. REQUIRES: f.mu held.
func (f *File) zeroBlockLocked(off, length int64) error {
	lbs := int64(f.lbs)
	end := off + length
	start, stop := roundUp(off, lbs), end/lbs*lbs
	if stop <= start {
		return f.writeZeroBuffersLocked(off, length)
	}
	err := ioctlRange(f.bfd, unix.BLKZEROOUT, start, stop-start)
	if isUnsupported(err) {
		return f.writeZeroBuffersLocked(off, length)
	}
	if err != nil {
		return err
	}
	if start > off {
		if err := f.writeZeroBuffersLocked(off, start-off); err != nil {
			return err
		}
	}
	if end > stop {
		return f.writeZeroBuffersLocked(stop, end-stop)
	}
	return nil
}

// writeZeroBuffersLocked writes zeroes over a range, in aligned pieces where
// possible. REQUIRES: f.mu held.
func (f *File) writeZeroBuffersLocked(off, length int64) error {
	zero := zeroBuf()
	end := off + length
	for off < end {
		n := min(end-off, int64(len(zero)))
		if a := pageSize; off%a != 0 && n > a-off%a {
			n = a - off%a // reach page alignment first so the rest goes direct
		}
		if _, err := f.writeLocked(zero[:n], off); err != nil {
			return err
		}
		off += n
	}
	return nil
}

// Close closes the device after waiting for I/O in flight. It does not
// Sync. Closing twice returns an error wrapping ErrClosed.
func (f *File) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return f.ioErr("close", 0, 0, ErrClosed)
	}
	f.closed = true
	if err := f.closeFDs(); err != nil {
		return f.ioErr("close", 0, 0, err)
	}
	return nil
}

func (f *File) closeFDs() error {
	if f.aio != nil {
		f.aio.close()
		f.aio = nil
	}
	var err error
	if f.fd != f.bfd {
		err = unix.Close(f.fd)
	}
	if e := unix.Close(f.bfd); err == nil {
		err = e
	}
	return err
}

// preadFull reads all of p unless an error occurs. A read of 0 bytes (end of
// file) gives io.EOF, so (n < len(p), nil) is never returned.
func preadFull(fd int, p []byte, off int64) (int, error) {
	done := 0
	for done < len(p) {
		n, err := unix.Pread(fd, p[done:], off+int64(done))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return done, err
		}
		if n == 0 {
			return done, io.EOF
		}
		done += n
	}
	return done, nil
}

func pwriteFull(fd int, p []byte, off int64) (int, error) {
	done := 0
	for done < len(p) {
		n, err := unix.Pwrite(fd, p[done:], off+int64(done))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return done, err
		}
		if n == 0 {
			return done, io.ErrShortWrite
		}
		done += n
	}
	return done, nil
}

func fallocate(fd int, mode uint32, off, length int64) error {
	for {
		err := unix.Fallocate(fd, mode, off, length)
		if err != unix.EINTR {
			return err
		}
	}
}

func ioctlGetUint64(fd int, req uint) (uint64, error) {
	var v uint64
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(&v)))
	if e != 0 {
		return 0, e
	}
	return v, nil
}

// ioctlRange issues BLKDISCARD or BLKZEROOUT, which take {start, length}.
func ioctlRange(fd int, req uint, start, length int64) error {
	r := [2]uint64{uint64(start), uint64(length)}
	for {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(&r[0])))
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return e
		}
		return nil
	}
}

// isUnsupported reports errors meaning "this device or file system cannot do
// that operation" as opposed to an I/O failure.
func isUnsupported(err error) bool {
	return err == unix.EOPNOTSUPP || err == unix.ENOTTY || err == unix.ENOSYS
}

func roundUp(x, a int64) int64 { return (x + a - 1) / a * a }

// Bounce buffers: page-aligned, pooled per power-of-two size class from 4 KiB
// to maxBounce, so path 2 allocates nothing in the steady state.
const (
	minBounceShift = 12
	maxBounce      = 1 << 20
	bounceClasses  = 20 - minBounceShift + 1
)

type bounceBuf struct{ b []byte }

var bouncePools [bounceClasses]sync.Pool

func bounceClass(n int) int {
	c := 0
	for (1<<(minBounceShift+c)) < n && c < bounceClasses-1 {
		c++
	}
	return c
}

// getBounce returns a page-aligned buffer of at least n bytes (n <= maxBounce).
func getBounce(n int) *bounceBuf {
	c := bounceClass(n)
	if b, ok := bouncePools[c].Get().(*bounceBuf); ok {
		return b
	}
	return &bounceBuf{b: alignedBytes(1<<(minBounceShift+c), int(pageSize))}
}

func putBounce(b *bounceBuf) {
	if invariants.Enabled {
		// Poison, so data from a buffer used after its return shows.
		for i := range b.b {
			b.b[i] = 0xde
		}
	}
	bouncePools[bounceClass(len(b.b))].Put(b)
}

var zeroBuf = sync.OnceValue(func() []byte { return alignedBytes(maxBounce, int(pageSize)) })

// alignedBytes returns n zeroed bytes whose first byte's address is a
// multiple of align (a power of two). It over-allocates and slices: the Go
// heap does not move objects, and the interior pointer keeps the whole
// allocation alive.
func alignedBytes(n, align int) []byte {
	b := make([]byte, n+align)
	skip := int(-uintptr(unsafe.Pointer(unsafe.SliceData(b))) & uintptr(align-1))
	return b[skip : skip+n : skip+n]
}
