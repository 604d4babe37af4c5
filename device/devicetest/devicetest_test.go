package devicetest_test

import (
	"testing"

	"github.com/tiercache/tiercache/device/devicetest"
)

// TestOpeners runs the conformance suite on every registered implementation,
// so a new Opener cannot be added without passing it.
func TestOpeners(t *testing.T) {
	for name, open := range devicetest.Openers() {
		t.Run(name, func(t *testing.T) { devicetest.RunConformance(t, open) })
	}
}
