//go:build !invariants

// Package invariants holds assertions that are checked only in builds with
// the "invariants" tag (make test uses it). Production builds pay nothing:
// Enabled is a constant, so guarded checks compile away.
package invariants

// Enabled reports whether the binary was built with the invariants tag.
const Enabled = false
