// Package names holds the rule for export (and volume) names, which every
// entry point applies: serve --export and --backing, the config file,
// format --backing, attach (offline and over the admin API).
//
// A name is 1..255 bytes of ASCII letters, digits and . _ - + : @, and
// starts with a letter or a digit. Names appear in NBD URIs, URL paths of
// the admin API, log lines, metric labels and terminal output, so nothing
// that could traverse a path ("../"), break a line or start a terminal
// escape sequence may be part of one.
package names

import (
	"errors"
	"fmt"
)

// MaxLen is the longest name, in bytes (the superblock's limit).
const MaxLen = 255

// ErrInvalid is wrapped by Check's errors.
var ErrInvalid = errors.New("invalid export name")

// Allowed describes the rule for error messages and docs.
const Allowed = "1..255 ASCII letters, digits and . _ - + : @, starting with a letter or digit"

// Check returns nil if name follows the rule, else an error that says what
// is wrong with it (the name is quoted with %q, so control bytes are shown
// escaped, never printed).
func Check(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty (want %s)", ErrInvalid, Allowed)
	case len(name) > MaxLen:
		return fmt.Errorf("%w: %d bytes (want %s)", ErrInvalid, len(name), Allowed)
	case !alnum(name[0]):
		return fmt.Errorf("%w %q: starts with %q (want %s)", ErrInvalid, name, name[:1], Allowed)
	}
	for i := 0; i < len(name); i++ {
		if b := name[i]; !alnum(b) && !punct(b) {
			return fmt.Errorf("%w %q: byte %d is %q (want %s)", ErrInvalid, name, i, name[i:i+1], Allowed)
		}
	}
	return nil
}

func alnum(b byte) bool {
	return 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' || '0' <= b && b <= '9'
}

func punct(b byte) bool {
	switch b {
	case '.', '_', '-', '+', ':', '@':
		return true
	}
	return false
}
