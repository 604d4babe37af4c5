package backingid

import (
	"crypto/sha256"
	"fmt"
	"strings"
)

// maxIDLen is the longest identity a cache set records (its superblock's
// limit for a backing's ID).
const maxIDLen = 255

// NBDID is the identity of a remote export: "nbd:URI#MARKER", where URI
// names the export (scheme, address, export name: nbddev.Target.Name) and
// MARKER is the description the server gives it (qemu-nbd --description,
// nbdkit's exportname filter exportdesc=), which the operator sets and can
// read back with nbdinfo. An empty marker (--trust-path on an export
// without a description) identifies the export by its URI alone. When the
// whole would be longer than a set can record, the URI is replaced by its
// SHA-256 ("nbd:sha256=HEX#MARKER"); the set's recorded path still names
// it in full.
func NBDID(uri, marker string) string {
	id := "nbd:" + uri + "#" + marker
	if len(id) <= maxIDLen {
		return id
	}
	return fmt.Sprintf("nbd:sha256=%x#%s", sha256.Sum256([]byte(uri)), marker)
}

// IsNBDID reports whether id is the identity of a remote export.
func IsNBDID(id string) bool { return strings.HasPrefix(id, "nbd:") }

// CheckNBD compares a recorded identity with the one a remote export at
// uri presents now: nil if they are equal, a *MismatchError otherwise.
func CheckNBD(recorded, uri, found string) error {
	if recorded != found {
		return &MismatchError{Path: uri, Expected: recorded, Found: found}
	}
	return nil
}
