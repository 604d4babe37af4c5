package cache

import (
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// RecordIdentity records, in the superblock of the cache set on dev (which
// must not be open: the caller holds its lock), a new identity for the
// volume name, with path as where it is now, or for the cache device
// itself when name is "". It is for a device the operator says is the
// set's own whose identity changed (restored in place, moved to another
// file system): the set then refuses every other device, the one
// recorded before included. Only the superblock changes (its next copy,
// with the next sequence number); the journal, the checkpoints and the
// clean flag stay as they are.
func RecordIdentity(dev device.Device, name, id, path string) (*Superblock, error) {
	sb, _, err := ondisk.ReadSuperblock(dev)
	if err != nil {
		return nil, err
	}
	if err := refuseMirrored(sb, "recording an identity"); err != nil {
		return nil, err
	}
	return updateSuperblock(dev, sb, func(nsb *Superblock) error {
		if name == "" {
			nsb.CacheID = id
			return nil
		}
		i := -1
		for j, b := range nsb.Backings {
			if !b.Free() && b.Name == name {
				i = j
			}
		}
		if i < 0 {
			return fmt.Errorf("%w: the cache set has no volume %q", ErrInvalid, name)
		}
		nsb.Backings[i].ID = id
		if path != "" {
			nsb.Backings[i].Path = path
		}
		return nil
	})
}
