package pages

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// TestPagedPayloadCounts: a root's payload decodes with its epochs and
// the volumes' dirty counts; a payload without the flags or the counts
// (the layouts of roots written before the bucket table held counts and
// before the payload held the volumes' dirty counts), with other flags,
// or cut short, is corruption; a bucket table whose counts differ from
// the trees' is corruption.
//
// Until format version 4 Open read those older payloads and, for a root
// without FlagCounts, put the trees' counts into the table; no format
// was ever released, so version 4 dropped that path (issue 15, item 5).
func TestPagedPayloadCounts(t *testing.T) {
	sb := &ondisk.Superblock{JournalLen: 1 << 20}
	b := EncodePayload(5, []uint64{7, 8}, []int64{3, 4})
	if j, eps, flags, err := DecodePayload(b, sb); err != nil || j != 5 || !slices.Equal(eps, []uint64{7, 8}) || flags != Flags || !slices.Equal(decodeDirty(b, len(eps)), []int64{3, 4}) {
		t.Fatalf("payload: %d %v %#x %v", j, eps, flags, err)
	}
	withFlags := func(f uint64) []byte {
		c := slices.Clone(b)
		binary.LittleEndian.PutUint64(c[10+16:], f)
		return c
	}
	for what, p := range map[string][]byte{
		"without flags":                   b[:10+16],
		"with FlagCounts and no counts":   withFlags(FlagCounts)[:18+16],
		"with the flags and no counts":    b[:18+16],
		"with the flags and too few":      b[:len(b)-8],
		"with FlagCounts only":            withFlags(FlagCounts),
		"with an unknown flag":            withFlags(Flags | 1<<9),
		"with more bytes than the counts": append(slices.Clone(b), 0, 0, 0, 0, 0, 0, 0, 0),
	} {
		if _, _, _, err := DecodePayload(p, sb); !errors.Is(err, ondisk.ErrCorrupt) {
			t.Errorf("payload %s: %v, want corruption", what, err)
		}
	}
	lay := Layout{Off: 0, Pages: 64, Nonce: 1}
	dev := device.NewMem(lay.Len())
	if err := Format(dev, lay, nil); err != nil {
		t.Fatal(err)
	}
	st, _, err := Open(dev, lay, 4)
	if err != nil {
		t.Fatal(err)
	}
	tab, err := st.Table(3)
	if err != nil {
		t.Fatal(err)
	}
	cd := &ondisk.CkptData{Vols: []ondisk.CkptVol{
		{Ents: []index.Ent{{LBA: 1, Loc: 0}, {LBA: 2, Loc: 5 | index.DirtyBit}}, Sup: []index.Ver{{Loc: 6}}},
		{Ents: []index.Ent{{LBA: 1, Loc: 9 | index.DirtyBit}}},
	}}
	if err := CountsOf(cd, 4, tab); !errors.Is(err, ondisk.ErrCorrupt) {
		t.Fatalf("a table of zeroes checked against entries: %v", err)
	}
	for i, c := range [][2]uint16{{1, 0}, {2, 2}, {1, 1}} {
		r := tab.Get(i)
		r.Live, r.Dirty = c[0], c[1]
		tab.Set(i, r)
	}
	if err := CountsOf(cd, 4, tab); err != nil {
		t.Fatal(err)
	}
	r := tab.Get(1)
	r.Dirty--
	tab.Set(1, r)
	if err := CountsOf(cd, 4, tab); !errors.Is(err, ondisk.ErrCorrupt) {
		t.Fatalf("a table one dirty block short in bucket 1: %v", err)
	}
}
