//go:build invariants

package invariants

// Enabled reports whether the binary was built with the invariants tag.
const Enabled = true
