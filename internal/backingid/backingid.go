// Package backingid gives a backing device a stable identity without writing
// a byte of it, so that a cache set can refuse the wrong disk (design
// invariant 6) while the disk itself stays a plain image that can be used
// alone after a clean detach.
//
// For a regular file the identity is a random UUID kept in the extended
// attribute user.tiercache.id, and the cache set that owns the file is
// recorded in user.tiercache.set. Extended attributes travel with the inode
// (not the path), survive renames, and are not part of the file's data.
//
// For a block device the identity is what the kernel reports for the
// hardware (WWID or serial under /sys/dev/block); "attached elsewhere"
// cannot be recorded on a block device without writing to it, so only the
// size and that hardware identity are checked.
package backingid

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
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
	id, err := getxattr(path, xattrID)
	if err != nil {
		return Identity{}, err
	}
	set, err := getxattr(path, xattrSet)
	if err != nil {
		return Identity{}, err
	}
	return Identity{ID: id, Set: set}, nil
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
		cur.ID = NewUUID()
		if err := setxattr(path, xattrID, cur.ID); err != nil {
			return cur, err
		}
	}
	if err := setxattr(path, xattrSet, setUUID); err != nil {
		return cur, err
	}
	cur.Set = setUUID
	return cur, syncInode(path)
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

// blockID reads a hardware identity for a block device from sysfs.
func blockID(fi os.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	maj, mnr := unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev))
	base := fmt.Sprintf("/sys/dev/block/%d:%d/", maj, mnr)
	for _, f := range []string{"wwid", "device/wwid", "serial", "device/serial"} {
		if b, err := os.ReadFile(base + f); err == nil {
			if s := strings.TrimSpace(string(b)); s != "" {
				return "hw:" + s
			}
		}
	}
	return ""
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
		return cur, nil
	}
	id := NewUUID()
	if err := setxattr(path, xattrID, id); err != nil {
		return cur, err
	}
	// Read back: on a file system without xattrs the ID stays empty.
	return Read(path)
}
