package cache

import (
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// The on-disk types that are part of this package's API. Package ondisk
// holds them with their codecs.
type (
	Superblock  = ondisk.Superblock
	BackingInfo = ondisk.BackingInfo
	Mode        = ondisk.Mode
	Settings    = ondisk.Settings
)

// The cache modes (see Mode).
const (
	Writeback    = ondisk.Writeback
	Writethrough = ondisk.Writethrough
	Writearound  = ondisk.Writearound
	None         = ondisk.None
)

const (
	blockSize  = ondisk.BlockSize
	blockShift = ondisk.BlockShift
)

// SettingKeys lists the keys ParseSetting accepts, in display order.
var SettingKeys = ondisk.SettingKeys

// DefaultSettings are the settings of a freshly formatted volume.
func DefaultSettings() Settings { return ondisk.DefaultSettings() }

// ParseMode parses a mode name as printed by Mode.String.
func ParseMode(s string) (Mode, error) { return ondisk.ParseMode(s) }

// ParseSetting applies key=value to s. Sizes accept K, M, G suffixes.
func ParseSetting(s *Settings, key, value string) error { return ondisk.ParseSetting(s, key, value) }

// ReadSuperblock returns the newest valid superblock copy of cacheDev. It
// returns ErrNotFormatted (wrapped) when neither copy has the magic, and a
// corruption error when a copy has the magic but no copy is valid.
func ReadSuperblock(cacheDev device.Device) (*Superblock, error) {
	sb, _, err := ondisk.ReadSuperblock(cacheDev)
	return sb, err
}
