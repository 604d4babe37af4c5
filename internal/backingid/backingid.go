// Package backingid gives a device a stable identity without writing a
// byte of its data, so that a cache set can refuse the wrong disk (design
// invariant 6) while the disk itself stays a plain image that can be used
// alone after a clean detach.
//
// An identity is a string "SCHEME:VALUE"; the scheme says what it was
// derived from, and two identities match only when equal:
//
//   - a regular file: "UUID/ino:N/born:SECONDS.NANOS", a random UUID kept
//     in the extended attribute user.tiercache.id, then the file's inode
//     number and birth time (statx; "/born:" is left out where the file
//     system keeps none). Both survive renames and reboots and are not
//     part of the file's data. A copy made without the attribute (cp,
//     rsync without -X, most restores) has no UUID; a copy made with it
//     (cp -a, rsync -X, a restore that keeps xattrs) carries the UUID but
//     is another inode, born later: no copy carries all three.
//   - a block device, by what survives reboots and re-plugging, in this
//     order: the hardware WWID or serial under /sys/dev/block ("hw:"), a
//     device-mapper or md UUID ("dm:", "md:"), for a partition its disk's
//     identity (hardware, or a loop device's backing file) plus the
//     partition number AND the partition's UUID ("hw:...-partN/partuuid:U":
//     a dd clone of the whole disk copies the UUID, so the UUID alone would
//     pass it; either alone where only one exists), a loop device's
//     backing file ("loop:" plus that file's identity, so a loop device
//     over a copy is not the disk either), a /dev/disk/by-id link
//     ("by-id:").
//   - "path:ABSPATH": nothing identifies the device and the operator said
//     its path does (--trust-path). A different disk appearing at that
//     path is not caught.
//   - a remote export (an NBD URI): "nbd:URI#MARKER", the export's URI
//     and the description the server gives it (NBDID); the size is checked
//     beside it as for every backing device.
//
// The cache set that owns a file is recorded in user.tiercache.set;
// "attached elsewhere" cannot be recorded on a block device without
// writing to it, so there only the identity and the size are checked.
package backingid

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

const (
	xattrID  = "user.tiercache.id"
	xattrSet = "user.tiercache.set"
)

// ErrAttachedElsewhere means the backing device already belongs to another
// cache set.
var ErrAttachedElsewhere = errors.New("backing device belongs to another cache set")

// NewUUID returns a random RFC 4122 version 4 UUID string.
func NewUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on Linux; a failure is unrecoverable.
		panic(fmt.Sprintf("crypto/rand: %v", err))
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Identity is what is known of a backing device's identity.
type Identity struct {
	ID  string // stable identity; empty if none could be found
	Set string // UUID of the cache set that claimed it; files only
}

// Read returns the identity of the device at path without changing it.
func Read(path string) (Identity, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return Identity{}, err
	}
	if fi.Mode()&os.ModeDevice != 0 {
		return Identity{ID: blockID(fi)}, nil
	}
	id, err := fileID(path)
	if err != nil {
		return Identity{}, err
	}
	set, err := getxattr(path, xattrSet)
	if err != nil {
		return Identity{}, err
	}
	return Identity{ID: id, Set: set}, nil
}

// fileID is the identity of the regular file at path: its UUID attribute
// and its inode's fingerprint, or "" if it has no UUID attribute.
func fileID(path string) (string, error) {
	u, err := getxattr(path, xattrID)
	if err != nil || u == "" {
		return "", err
	}
	fp, err := fingerprint(path)
	if err != nil {
		return "", err
	}
	return u + fp, nil
}

// fingerprint is "/ino:N/born:SECONDS.NANOS" for the file at path: what a
// copy of the file, attributes and all, cannot carry.
func fingerprint(path string) (string, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_INO|unix.STATX_BTIME, &st); err != nil {
		return "", fmt.Errorf("%s: statx: %w", path, err)
	}
	fp := fmt.Sprintf("/ino:%d", st.Ino)
	if st.Mask&unix.STATX_BTIME != 0 {
		fp += fmt.Sprintf("/born:%d.%09d", st.Btime.Sec, st.Btime.Nsec)
	}
	return fp, nil
}

// uuidOf is the UUID part of a file identity ("" for other schemes).
func uuidOf(id string) string {
	u, _, ok := strings.Cut(id, "/ino:")
	if !ok {
		return ""
	}
	return u
}

// Claim marks the device at path as belonging to cache set setUUID and
// returns its identity, creating an ID if it had none. A file claimed by a
// different set is refused with ErrAttachedElsewhere unless force.
func Claim(path, setUUID string, force bool) (Identity, error) {
	cur, err := Read(path)
	if err != nil {
		return Identity{}, err
	}
	fi, _ := os.Stat(path)
	if fi.Mode()&os.ModeDevice != 0 {
		return cur, nil
	}
	if cur.Set != "" && cur.Set != setUUID && !force {
		return cur, fmt.Errorf("%s: %w %s (use --force to take it over)", path, ErrAttachedElsewhere, cur.Set)
	}
	if cur.ID == "" {
		if err := setxattr(path, xattrID, NewUUID()); err != nil {
			return cur, err
		}
	}
	if err := setxattr(path, xattrSet, setUUID); err != nil {
		return cur, err
	}
	if err := syncInode(path); err != nil {
		return cur, err
	}
	// Read back: on a file system without xattrs the ID stays empty.
	return Read(path)
}

// syncInode makes the file's attributes durable (fsync of the inode), so
// that attach and detach can order the claim against the cache set's
// superblock write.
func syncInode(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("%s: syncing attributes: %w", path, err)
	}
	return nil
}

// Release forgets the cache set that claimed the file at path (detach). The
// ID stays, so a later attach recognises the same file.
func Release(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeDevice != 0 {
		return nil
	}
	err = unix.Removexattr(path, xattrSet)
	switch {
	case errors.Is(err, unix.ENODATA), errors.Is(err, unix.ENOTSUP):
		return nil
	case err != nil:
		return fmt.Errorf("%s: removing %s: %w", path, xattrSet, err)
	}
	return syncInode(path)
}

func getxattr(path, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Getxattr(path, name, buf)
	switch {
	case errors.Is(err, unix.ENODATA):
		return "", nil
	case errors.Is(err, unix.ENOTSUP):
		// The file system keeps no xattrs: identity checks fall back to size.
		return "", nil
	case err != nil:
		return "", fmt.Errorf("%s: reading %s: %w", path, name, err)
	}
	return string(buf[:n]), nil
}

func setxattr(path, name, value string) error {
	err := unix.Setxattr(path, name, []byte(value), 0)
	if errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: writing %s: %w", path, name, err)
	}
	return nil
}

// blockID derives a block device's identity from what the kernel and udev
// report (see the package comment for the order). It is "" when nothing
// identifies the device.
func blockID(fi os.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	return hostRoots.blockID(unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev)))
}

// roots are where blockID reads what the kernel and udev say about block
// devices: the host's in production, a made-up tree in unit tests (the
// partition cases need partitioned disks, which a test machine may not
// be able to make).
type roots struct{ sys, udev, dev string }

var hostRoots = roots{sys: "/sys", udev: "/run/udev/data", dev: "/dev"}

func (r roots) blockID(maj, mnr uint32) string {
	base := fmt.Sprintf("%s/dev/block/%d:%d/", r.sys, maj, mnr)
	if id := hwID(base); id != "" {
		return id
	}
	for _, f := range []struct{ file, scheme string }{{"dm/uuid", "dm:"}, {"md/uuid", "md:"}} {
		if s := readTrim(base + f.file); s != "" {
			return f.scheme + s
		}
	}
	if part := readTrim(base + "partition"); part != "" {
		return r.partitionID(base, maj, mnr, part)
	}
	if bf := readTrim(base + "loop/backing_file"); bf != "" {
		if id, _ := fileID(bf); id != "" {
			return "loop:" + id
		}
		return ""
	}
	return r.byIDLink(maj, mnr)
}

// partitionID identifies partition part of a disk by the disk's identity
// plus the partition number AND the partition's UUID, both where both
// exist: a partition UUID alone is copied with the disk by dd (a clone of
// the whole disk, an image restored onto another disk), and the disk's
// identity alone does not see the partition table rewritten. Either alone
// where only one exists.
func (r roots) partitionID(base string, maj, mnr uint32, part string) string {
	disk := hwID(base + "../")
	if disk == "" {
		if bf := readTrim(base + "../loop/backing_file"); bf != "" {
			if id, _ := fileID(bf); id != "" {
				disk = "loop:" + id
			}
		}
	}
	if disk != "" {
		disk += "-part" + part
	}
	pu := r.udevProp(maj, mnr, "ID_PART_ENTRY_UUID")
	if pu == "" {
		pu = r.partUUIDFromTable(base, part)
	}
	switch {
	case disk != "" && pu != "":
		return disk + "/partuuid:" + pu
	case pu != "":
		return "partuuid:" + pu
	}
	return disk
}

// partUUIDFromTable reads partition part's UUID from its disk's partition
// table (GPT: the partition's unique GUID; MBR: the disk signature and the
// partition number, as the kernel's PARTUUID), for hosts without udev. It
// reads the disk node udev or devtmpfs made (DEVNAME in the disk's
// uevent); "" if there is none or no table says.
func (r roots) partUUIDFromTable(base, part string) string {
	n, err := strconv.Atoi(part)
	if err != nil || n < 1 {
		return ""
	}
	var devname string
	for _, l := range strings.Split(readTrim(base+"../uevent"), "\n") {
		if v, ok := strings.CutPrefix(l, "DEVNAME="); ok {
			devname = v
		}
	}
	if devname == "" {
		return ""
	}
	f, err := os.Open(filepath.Join(r.dev, devname))
	if err != nil {
		return ""
	}
	defer f.Close()
	lbs, err := strconv.Atoi(readTrim(base + "../queue/logical_block_size"))
	if err != nil || lbs < 512 || lbs > 64<<10 {
		lbs = 512
	}
	hdr := make([]byte, 512)
	if _, err := f.ReadAt(hdr, int64(lbs)); err == nil && string(hdr[:8]) == "EFI PART" {
		entLBA := binary.LittleEndian.Uint64(hdr[72:])
		count := binary.LittleEndian.Uint32(hdr[80:])
		esize := binary.LittleEndian.Uint32(hdr[84:])
		if uint32(n) > count || esize < 128 || esize > 4096 || entLBA > 1<<40 {
			return ""
		}
		e := make([]byte, 32)
		if _, err := f.ReadAt(e, int64(entLBA)*int64(lbs)+int64(n-1)*int64(esize)); err != nil {
			return ""
		}
		g := e[16:32]
		if allZero(g) {
			return ""
		}
		return fmt.Sprintf("%08x-%04x-%04x-%x-%x", binary.LittleEndian.Uint32(g[0:4]), binary.LittleEndian.Uint16(g[4:6]),
			binary.LittleEndian.Uint16(g[6:8]), g[8:10], g[10:16])
	}
	mbr := make([]byte, 512)
	if _, err := f.ReadAt(mbr, 0); err != nil || mbr[510] != 0x55 || mbr[511] != 0xaa {
		return ""
	}
	sig := binary.LittleEndian.Uint32(mbr[440:])
	if sig == 0 {
		return ""
	}
	return fmt.Sprintf("%08x-%02x", sig, n)
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func hwID(base string) string {
	for _, f := range []string{"wwid", "device/wwid", "serial", "device/serial"} {
		if s := readTrim(base + f); s != "" {
			return "hw:" + s
		}
	}
	return ""
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// udevProp reads a property udev recorded for the block device.
func (r roots) udevProp(maj, mnr uint32, key string) string {
	b, err := os.ReadFile(fmt.Sprintf("%s/b%d:%d", r.udev, maj, mnr))
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "E:"+key+"="); ok {
			return v
		}
	}
	return ""
}

// byIDLink returns the first /dev/disk/by-id link to the device, in name
// order (udev's names are derived from the device's model and serial).
func (r roots) byIDLink(maj, mnr uint32) string {
	dir := filepath.Join(r.dev, "disk/by-id")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return ""
	}
	for _, e := range ents {
		var st unix.Stat_t
		if unix.Stat(filepath.Join(dir, e.Name()), &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
			continue
		}
		if unix.Major(uint64(st.Rdev)) == maj && unix.Minor(uint64(st.Rdev)) == mnr {
			return "by-id:" + e.Name()
		}
	}
	return ""
}

// loopBackingFile returns the backing file of a loop device, or of the
// loop device a partition is on, or "".
func loopBackingFile(fi os.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	base := fmt.Sprintf("%s/dev/block/%d:%d/", hostRoots.sys, unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev)))
	if bf := readTrim(base + "loop/backing_file"); bf != "" {
		return bf
	}
	if readTrim(base+"partition") != "" {
		return readTrim(base + "../loop/backing_file")
	}
	return ""
}

// PathID is the identity of a device known only by its path (--trust-path).
func PathID(path string) string {
	if a, err := filepath.Abs(path); err == nil {
		path = a
	}
	return "path:" + path
}

// MismatchError says that the device at a path is not the one recorded.
type MismatchError struct {
	Path     string
	Expected string // the recorded identity; "" if none was recorded
	Found    string // the device's identity now; "" if it has none
}

func (e *MismatchError) Error() string {
	found := e.Found
	if found == "" {
		found = "none (a copy made without its extended attributes, a different file, or a device nothing identifies)"
	}
	if e.Expected == "" {
		return fmt.Sprintf("%s: no identity was recorded for this device, so it cannot be told from another one (found %s)", e.Path, found)
	}
	copied := ""
	if u := uuidOf(strings.TrimPrefix(e.Expected, "loop:")); u != "" && u == uuidOf(strings.TrimPrefix(e.Found, "loop:")) {
		copied = " (the same identity attribute on another inode, or one born later: a copy made with its extended attributes, cp -a, rsync -X, or a restored backup)"
	}
	return fmt.Sprintf("%s: identity mismatch: expected %s (recorded when it joined the set), found %s%s", e.Path, e.Expected, found, copied)
}

// Check reports whether the device at path is the one whose identity was
// recorded: nil if it is, a *MismatchError if it is not or cannot be told.
func Check(recorded, path string) error {
	if strings.HasPrefix(recorded, "path:") {
		if got := PathID(path); got != recorded {
			return &MismatchError{Path: path, Expected: recorded, Found: got}
		}
		return nil
	}
	cur, err := Read(path)
	if err != nil {
		return err
	}
	if recorded == "" || cur.ID != recorded {
		return &MismatchError{Path: path, Expected: recorded, Found: cur.ID}
	}
	return nil
}

// EnsureID returns the device's identity, giving a file a new ID if it had
// none. It does not claim the file for a set.
func EnsureID(path string) (Identity, error) {
	cur, err := Read(path)
	if err != nil || cur.ID != "" {
		return cur, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return cur, err
	}
	if fi.Mode()&os.ModeDevice != 0 {
		// A loop device is identified by its backing file: give the file
		// an ID (an attribute of the file, not a byte of its data).
		if bf := loopBackingFile(fi); bf != "" {
			if _, err := EnsureID(bf); err != nil {
				return cur, err
			}
			return Read(path)
		}
		return cur, nil
	}
	if err := setxattr(path, xattrID, NewUUID()); err != nil {
		return cur, err
	}
	// Read back: on a file system without xattrs the ID stays empty.
	return Read(path)
}

// Settable reports whether EnsureID can give the device at path an
// identity attribute: a regular file on a file system that keeps user
// extended attributes, or a loop device over one. It writes nothing, so
// a command can refuse a device nothing would identify before it changes
// anything.
func Settable(path string) bool {
	fi, err := os.Stat(path)
	if err != nil {
		return false
	}
	if fi.Mode()&os.ModeDevice != 0 {
		bf := loopBackingFile(fi)
		return bf != "" && Settable(bf)
	}
	if !fi.Mode().IsRegular() {
		return false
	}
	_, err = unix.Getxattr(path, xattrID, nil)
	return !errors.Is(err, unix.ENOTSUP)
}

// Restore puts the identity attributes of the file at path back as prev
// (what Read returned before a Claim): the set's claim, and no ID if it
// had none. A command that fails after it claimed a file leaves the file
// as it found it.
func Restore(path string, prev Identity) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeDevice != 0 {
		return nil
	}
	if prev.Set == "" {
		if err := removexattr(path, xattrSet); err != nil {
			return err
		}
	} else if err := setxattr(path, xattrSet, prev.Set); err != nil {
		return err
	}
	if prev.ID == "" {
		if err := removexattr(path, xattrID); err != nil {
			return err
		}
	}
	return syncInode(path)
}

func removexattr(path, name string) error {
	err := unix.Removexattr(path, name)
	switch {
	case errors.Is(err, unix.ENODATA), errors.Is(err, unix.ENOTSUP):
		return nil
	case err != nil:
		return fmt.Errorf("%s: removing %s: %w", path, name, err)
	}
	return nil
}
