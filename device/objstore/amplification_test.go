package objstore

import (
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/device/devicetest"
)

// TestPutAmplification: 4 KiB random writes, a Sync every 64 of them (an
// engine epoch of scattered dirty blocks), cost at most 1.3 bytes PUT per
// byte written, checkpoints included, and one PUT per epoch (plus the
// checkpoints).
func TestPutAmplification(t *testing.T) {
	_, base := testEnv(t)
	const size = 64 << 20
	l := newImage(t, base, size, 4096)
	d := mustOpen(t, l, Options{CheckpointEvery: 16})
	rng := rand.New(rand.NewPCG(7, 7))
	p := make([]byte, 4096)
	const epochs, per = 64, 64
	for e := range epochs {
		for w := range per {
			devicetest.Fill(p, uint64(e*per+w))
			if _, err := d.WriteAt(p, rng.Int64N(size/4096)*4096); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	st := d.Stats()
	written := int64(epochs * per * 4096)
	amp := float64(st.BytesPut) / float64(written)
	t.Logf("%d bytes written, %d PUT in %d segments and %d checkpoints: %.3f bytes PUT per byte written", written, st.BytesPut, st.SegmentsPut, st.Checkpoints, amp)
	if amp > 1.3 || st.SegmentsPut != epochs {
		t.Fatalf("amplification %.3f (want <= 1.3), %d segments (want %d)", amp, st.SegmentsPut, epochs)
	}
}
