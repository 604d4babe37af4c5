package cache

import (
	"bytes"
	"testing"
)

// TestWriteTier: WriteAtTier names the device each write went to, as the
// routing did it: the cache alone for writeback, the backing device for
// writethrough, writearound and none, and for a writeback write that is
// part of a sequential stream past the cutoff and the cache's room for it
// (bypassed).
func TestWriteTier(t *testing.T) {
	const bs = 64 << 10
	s, _, _ := newTestSet(t, 64, bs, 8<<20, 8<<20, 8<<20, 8<<20)
	data := bytes.Repeat([]byte{0xa5}, blockSize)
	for i, tc := range []struct {
		mode Mode
		want Tier
	}{{Writeback, TierCache}, {Writethrough, TierBacking}, {Writearound, TierBacking}, {None, TierBacking}} {
		v := s.Volumes()[i]
		if err := v.SetMode(tc.mode); err != nil {
			t.Fatal(err)
		}
		got, err := v.WriteAtTier(data, 8*blockSize, false)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("%v write: tier %v, want %v", tc.mode, got, tc.want)
		}
	}
	// A sequential stream in writeback, 3 MiB into a 4 MiB cache: the writes
	// past the cutoff and the cache's room for the stream bypass.
	v := s.Volumes()[0]
	st := v.Settings()
	st.SequentialCutoff = 64 << 10
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	var last Tier
	for off := int64(1 << 20); off < 4<<20; off += 16 << 10 {
		tier, err := v.WriteAtTier(bytes.Repeat([]byte{1}, 16<<10), off, false)
		if err != nil {
			t.Fatal(err)
		}
		last = tier
	}
	if bypassed := v.Stats().BypassSequentialBytes; last != TierBacking || bypassed == 0 {
		t.Errorf("sequential stream in writeback: last write tier %v, %d bytes bypassed; want backing", last, bypassed)
	}
}
