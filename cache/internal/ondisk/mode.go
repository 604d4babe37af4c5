package ondisk

import (
	"fmt"
	"strings"
)

// Mode is a volume's cache mode. It can be changed at run time (SetMode);
// reads always consult the index first, so dirty data written in writeback
// mode stays readable in every mode until it has been written back.
type Mode int

const (
	// Writeback writes into the cache (dirty) and replies; the data reaches
	// the backing device later, in LBA order.
	Writeback Mode = iota
	// Writethrough writes the backing device and the cache (clean).
	Writethrough
	// Writearound writes the backing device and invalidates the cached
	// range; reads are still promoted into the cache.
	Writearound
	// None passes I/O through; writes invalidate the cached range and reads
	// are not promoted.
	None
)

var modeNames = [...]string{"writeback", "writethrough", "writearound", "none"}

func (m Mode) String() string {
	if m >= 0 && int(m) < len(modeNames) {
		return modeNames[m]
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

func (m Mode) Valid() bool { return m >= 0 && int(m) < len(modeNames) }

// ParseMode parses a mode name as printed by Mode.String.
func ParseMode(s string) (Mode, error) {
	for i, n := range modeNames {
		if strings.EqualFold(s, n) {
			return Mode(i), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown cache mode %q (want writeback, writethrough, writearound or none)", ErrInvalid, s)
}
