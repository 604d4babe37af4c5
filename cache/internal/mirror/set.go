package mirror

import (
	"fmt"
	"log/slog"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// A set's mirror from its superblock: the layout, a new mirror at
// format, the mirror of a set at open.

// LayoutOf is the mirror layout of the set sb describes.
func LayoutOf(sb *ondisk.Superblock) Layout {
	return Layout{Nonce: sb.Nonce(), BucketsOff: sb.BucketsOff, BucketSize: sb.BucketSize, NBuckets: sb.NBuckets}
}

// Format writes the labels of a new mirror of sb's set on a and b and
// returns the mirror, every slot free.
func Format(a, b device.Device, sb *ondisk.Superblock) (*Mirror, error) {
	l, err := NewLabel(sb.Nonce())
	if err != nil {
		return nil, err
	}
	if err := WriteNew(a, b, l); err != nil {
		return nil, err
	}
	m, err := Assemble(a, b, false, nil)
	if err != nil {
		return nil, err
	}
	return m, m.Init(LayoutOf(sb))
}

// Open assembles the mirror of the set on a and b (either may be nil when
// missing) and returns it with the set's superblock, read from its
// primary member.
func Open(a, b device.Device, allowMissing bool, log *slog.Logger) (*Mirror, *ondisk.Superblock, error) {
	m, err := Assemble(a, b, allowMissing, log)
	if err != nil {
		return nil, nil, fmt.Errorf("open: %w", err)
	}
	// Through the mirror, so that a read error on A is served from B's
	// copy (and A repaired or failed) rather than failing the open.
	var sbDev device.Device = m
	if m.Primary() == B {
		// B is smaller than the layout its superblock describes (A's).
		sbDev = LayoutSized{m.Device(B)}
	}
	sb, _, err := ondisk.ReadSuperblock(sbDev)
	if err != nil {
		return nil, nil, err
	}
	if !sb.HasFeature(ondisk.FeatureMirror) {
		return nil, nil, fmt.Errorf("open: %w: the set on the mirror's members is not mirrored (an attach-mirror that stopped before its first step was durable leaves it so: open the set on its cache device alone, and attach the mirror again)", ondisk.ErrInvalid)
	}
	if err := m.Init(LayoutOf(sb)); err != nil {
		return nil, nil, fmt.Errorf("open: %w", err)
	}
	return m, sb, nil
}

// LayoutSized is member B read for its superblock, which describes A's
// layout: the size check against the device is A's to pass.
type LayoutSized struct{ device.Device }

// Size is larger than any layout.
func (LayoutSized) Size() int64 { return 1 << 62 }
