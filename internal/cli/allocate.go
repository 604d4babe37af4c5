package cli

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// allocateCache allocates every block of a cache file (a block device has
// nothing to allocate), so that a full file system never surfaces as
// ENOSPC on cache writes later. Where fallocate is not supported it checks
// that the file system has room for the file's holes, and refuses if not.
func allocateCache(path string, size int64) error {
	fi, err := os.Stat(path)
	if err != nil || !fi.Mode().IsRegular() {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("cache device: %w", err)
	}
	defer f.Close()
	err = unix.Fallocate(int(f.Fd()), 0, 0, size)
	if err == nil {
		return nil
	}
	var st unix.Stat_t
	var fs unix.Statfs_t
	if unix.Fstat(int(f.Fd()), &st) != nil || unix.Fstatfs(int(f.Fd()), &fs) != nil {
		return fmt.Errorf("allocating the cache file %s: %w", path, err)
	}
	holes := size - st.Blocks*512
	free := int64(fs.Bavail) * fs.Bsize
	switch {
	case errors.Is(err, unix.ENOSPC):
	case errors.Is(err, unix.EOPNOTSUPP) && (free >= holes || fs.Blocks == 0):
		// Cannot allocate here, but it fits, or the file system does not
		// say (a FUSE file system reporting no blocks).
		return nil
	case errors.Is(err, unix.EOPNOTSUPP):
	default:
		return fmt.Errorf("allocating the cache file %s: %w", path, err)
	}
	return fmt.Errorf("the cache file %s is %s, of which %s is not allocated (sparse), and its file system has %s free: the cache would fail with ENOSPC when it fills; free space, or make the cache file smaller (truncate -s)",
		path, human(size), human(holes), human(free))
}
