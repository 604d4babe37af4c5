package ondisk

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestLostWritesRoundTrip(t *testing.T) {
	l := LostWrites{N: 3, NextID: 3, Nonce: 77, Events: []LostEvent{
		{ID: 1, Time: 1e18, Cause: "journal write failed", Vols: []LostVolume{{Name: "a", Blocks: 256, Ranges: []LostRange{{256, 256}}}}},
		{ID: 2, Time: 2e18, Cause: "sync failed", Vols: []LostVolume{{Name: "b", Blocks: 3, Ranges: []LostRange{{0, 1}, {9, 2}}, More: true}, {Name: "c", Blocks: 1}}},
	}}
	b := l.Encode()
	if len(b) != BlockSize {
		t.Fatalf("encoded %d bytes", len(b))
	}
	got, ok, err := DecodeLostWrites(b, 77, 0)
	if err != nil || !ok {
		t.Fatalf("decode: ok %v, %v", ok, err)
	}
	// Decoded empty range lists are nil.
	l.Events[1].Vols[1].Ranges = nil
	if !reflect.DeepEqual(got, l) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, l)
	}
	if _, ok, _ := DecodeLostWrites(b, 78, 0); ok {
		t.Errorf("a record of another set (nonce) was accepted")
	}
	torn := append([]byte(nil), b...)
	torn[40] ^= 1
	if _, ok, err := DecodeLostWrites(torn, 77, 0); ok || err != nil {
		t.Errorf("a damaged record: ok %v, err %v (want ignored: the other slot holds the older one)", ok, err)
	}
	if _, ok, err := DecodeLostWrites(make([]byte, BlockSize), 77, 0); ok || err != nil {
		t.Errorf("zeros: ok %v, err %v", ok, err)
	}
}

// TestLostWritesFits: a record too large for its block keeps every volume's
// name and count and leaves out ranges (More), then volumes (Dropped).
func TestLostWritesFits(t *testing.T) {
	var vols []LostVolume
	for i := 0; i < 64; i++ {
		v := LostVolume{Name: strings.Repeat(string(rune('a'+i%26)), 20), Blocks: 1000}
		for j := 0; j < LostMaxRanges; j++ {
			v.Ranges = append(v.Ranges, LostRange{uint64(j * 10), 1})
		}
		vols = append(vols, v)
	}
	l := LostWrites{N: 1, Nonce: 5, Events: []LostEvent{{ID: 1, Cause: strings.Repeat("x", 1000), Vols: vols}}}
	got, ok, err := DecodeLostWrites(l.Encode(), 5, 0)
	if err != nil || !ok {
		t.Fatalf("decode: ok %v, %v", ok, err)
	}
	ev := got.Events[0]
	if len(ev.Cause) != lostMaxCause {
		t.Errorf("cause of %d bytes, want cut to %d", len(ev.Cause), lostMaxCause)
	}
	if len(ev.Vols) != 64 || ev.Dropped != 0 {
		t.Errorf("%d volumes kept, %d dropped; want all 64 kept (with fewer ranges)", len(ev.Vols), ev.Dropped)
	}
	for _, v := range ev.Vols {
		if !v.More || v.Blocks != 1000 || len(v.Ranges) >= LostMaxRanges {
			t.Fatalf("volume %s: %d ranges, more %v, blocks %d", v.Name, len(v.Ranges), v.More, v.Blocks)
		}
	}
	// Names of 255 bytes: not all volumes fit even without ranges.
	for i := range vols {
		vols[i].Name = strings.Repeat("n", MaxNameLen)
	}
	got, ok, err = DecodeLostWrites(l.Encode(), 5, 0)
	if err != nil || !ok {
		t.Fatalf("decode: ok %v, %v", ok, err)
	}
	ev = got.Events[0]
	if ev.Dropped == 0 || uint64(len(ev.Vols))+ev.Dropped != 64 {
		t.Errorf("%d volumes kept, %d dropped; want 64 in all, some dropped", len(ev.Vols), ev.Dropped)
	}
}

// FuzzDecodeLostWrites: no input panics, and a decoded record encodes to a
// block that decodes to the same record.
func FuzzDecodeLostWrites(f *testing.F) {
	f.Add(LostWrites{N: 1, Nonce: 9, Events: []LostEvent{{ID: 1, Cause: "c", Vols: []LostVolume{{Name: "v", Blocks: 1, Ranges: []LostRange{{1, 1}}}}}}}.Encode())
	f.Add(make([]byte, BlockSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		l, ok, err := DecodeLostWrites(b, 9, 0)
		if !ok || err != nil {
			return
		}
		again, ok, err := DecodeLostWrites(l.Encode(), 9, 0)
		if !ok || err != nil || !reflect.DeepEqual(again, l) {
			t.Fatalf("re-encoded record: ok %v, %v\n got %+v\nwant %+v", ok, err, again, l)
		}
	})
}

// TestLostWritesAckDescribe: Ack drops the failovers named and advances
// the write counter, and refuses (changing nothing) when one is not in
// the record; Describe names each volume's lost bytes and ranges.
func TestLostWritesAckDescribe(t *testing.T) {
	l := LostWrites{N: 4, NextID: 3, Nonce: 7, Events: []LostEvent{
		{ID: 1, Time: 0, Vols: []LostVolume{{Name: "a", Blocks: 3, Ranges: []LostRange{{0, 1}, {9, 2}}, More: true}}, Dropped: 2},
		{ID: 2, Time: 0, Vols: []LostVolume{{Name: "b", Blocks: 1, Ranges: []LostRange{{5, 1}}}}},
	}}
	if got, err := l.Ack([]uint64{2, 9}); !errors.Is(err, ErrNoSuchLostEvent) || !reflect.DeepEqual(got, l) {
		t.Fatalf("ack of 2 and 9: %v, %+v; want ErrNoSuchLostEvent and the record unchanged", err, got)
	}
	next, err := l.Ack([]uint64{2})
	if err != nil || next.N != 5 || len(next.Events) != 1 || next.Events[0].ID != 1 || len(l.Events) != 2 {
		t.Fatalf("ack of 2: %v, %+v (record before: %+v)", err, next, l)
	}
	lines := l.Events[0].Describe()
	want := []string{
		`cache device failover 1 at 1970-01-01T00:00:00Z lost 12288 bytes of acknowledged writes to volume "a" (never made durable; not on the backing device): [0,+4096) [36864,+8192) ...`,
		`cache device failover 1 at 1970-01-01T00:00:00Z lost writes to 2 more volume(s) (left out of the record for want of room)`,
	}
	if !reflect.DeepEqual(lines, want) {
		t.Fatalf("Describe:\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
}
