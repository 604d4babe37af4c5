package layout

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
	"time"
)

func sampleSegment(t testing.TB) ([]byte, SegmentHeader, []byte) {
	h := SegmentHeader{Seq: 7, Gen: 3, Epoch: 5, UUID: UUID{1, 2, 3}, Final: true, BlockSize: 512,
		Extents: []Extent{{LBA: 2, Count: 2}, {LBA: 10, Count: 3, Zero: true}, {LBA: 13, Count: 1}}}
	data := make([]byte, 3*512)
	for i := range data {
		data[i] = byte(i*7 + 1)
	}
	p, err := EncodeSegment(h, data)
	if err != nil {
		t.Fatal(err)
	}
	return p, h, data
}

func TestSegmentRoundTrip(t *testing.T) {
	p, h, data := sampleSegment(t)
	got, gd, err := DecodeSegment(p)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gd, data) || got.Seq != h.Seq || got.Gen != h.Gen || got.Epoch != h.Epoch || !got.Final ||
		!reflect.DeepEqual(got.Extents, h.Extents) || got.UUID != h.UUID || len(got.CRCs) != 3 {
		t.Fatalf("decoded %+v", got)
	}
	if got.BlockOffset(1) != got.Len()+512 || int64(len(p)) != got.Len()+3*512 {
		t.Fatal("offsets")
	}
	// A prefix: ShortError naming the whole header's length.
	for _, n := range []int{0, 5, 63, 64, 70, int(got.Len()) - 1} {
		_, err := DecodeSegmentHeader(p[:n])
		var short *ShortError
		if !errors.As(err, &short) || short.Need <= int64(n) || short.Need > got.Len() {
			t.Fatalf("prefix %d: %v", n, err)
		}
	}
	if _, _, err := DecodeSegment(p[:len(p)-1]); !IsCorruption(err) {
		t.Fatalf("truncated data: %v", err)
	}
}

// TestSegmentCorruption flips every byte of a segment: each must be caught
// as corruption (the header by its CRC, the data by the block CRCs).
func TestSegmentCorruption(t *testing.T) {
	p, _, _ := sampleSegment(t)
	for i := range p {
		q := bytes.Clone(p)
		q[i] ^= 0x40
		_, _, err := DecodeSegment(q)
		var ce *CorruptError
		if !errors.As(err, &ce) || !IsCorruption(err) {
			t.Fatalf("byte %d flipped: %v; want a CorruptError", i, err)
		}
	}
}

func TestSegmentEncodeRefuses(t *testing.T) {
	for name, h := range map[string]SegmentHeader{
		"unsorted":   {Seq: 1, BlockSize: 512, Extents: []Extent{{LBA: 5, Count: 1}, {LBA: 1, Count: 1}}},
		"overlap":    {Seq: 1, BlockSize: 512, Extents: []Extent{{LBA: 1, Count: 3}, {LBA: 2, Count: 1}}},
		"empty":      {Seq: 1, BlockSize: 512, Extents: []Extent{{LBA: 1, Count: 0}}},
		"seq 0":      {Seq: 0, BlockSize: 512, Extents: []Extent{{LBA: 1, Count: 2}}},
		"block size": {Seq: 1, BlockSize: 100, Extents: []Extent{{LBA: 1, Count: 2}}},
		"data count": {Seq: 1, BlockSize: 512, Extents: []Extent{{LBA: 1, Count: 1}}},
	} {
		if _, err := EncodeSegment(h, make([]byte, 1024)); err == nil {
			t.Errorf("%s: encoded", name)
		}
	}
}

func sampleCheckpoint() *Checkpoint {
	return &Checkpoint{UUID: UUID{9}, BlockSize: 4096, Gen: 2, Seq: 40,
		Segs:    []SegRef{{Seq: 3, Gen: 1}, {Seq: 39, Gen: 2}},
		Extents: []MapExtent{{LBA: 0, Count: 2, Seg: 0, Off: 4}, {LBA: 100, Count: 1, Seg: 1, Off: 0}},
		CRCs:    []uint32{1, 2, 3}}
}

func TestCheckpointRoundTrip(t *testing.T) {
	c := sampleCheckpoint()
	p, err := EncodeCheckpoint(c)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeCheckpoint(p)
	if err != nil || !reflect.DeepEqual(got, c) {
		t.Fatalf("decoded %+v, %v", got, err)
	}
	for i := range p {
		q := bytes.Clone(p)
		q[i] ^= 1
		if _, err := DecodeCheckpoint(q); !IsCorruption(err) {
			t.Fatalf("byte %d flipped: %v", i, err)
		}
	}
	bad := sampleCheckpoint()
	bad.Extents[1].Seg = 5
	if _, err := EncodeCheckpoint(bad); !IsCorruption(err) {
		t.Fatalf("dangling segment index encoded: %v", err)
	}
}

func sampleHead() *Head {
	now := time.Date(2026, 12, 2, 19, 0, 0, 0, time.UTC)
	return &Head{Format: Format, UUID: UUID{1, 2}.String(), Size: 1 << 30, BlockSize: 4096, Created: now, Updated: now,
		Gen: 3, Gens: []GenStart{{Gen: 1, Start: 1}, {Gen: 2, Start: 9}, {Gen: 3}}, Checkpoint: &SegRef{Seq: 4, Gen: 1}}
}

func TestHead(t *testing.T) {
	h := sampleHead()
	p, err := EncodeHead(h)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeHead(p)
	if err != nil || !reflect.DeepEqual(got, h) {
		t.Fatalf("decoded %+v, %v", got, err)
	}
	for seq, want := range map[uint64]uint64{1: 1, 8: 1, 9: 2, 100: 2} {
		if g, ok := h.OwnerOf(seq); !ok || g != want {
			t.Errorf("OwnerOf(%d) = %d, %v; want %d", seq, g, ok, want)
		}
	}
	if _, ok := (&Head{}).OwnerOf(1); ok {
		t.Error("OwnerOf on a head without generations")
	}
	q := bytes.Replace(p, []byte(`"size": 1073741824`), []byte(`"size": 1073741825`), 1)
	if _, err := DecodeHead(q); !IsCorruption(err) {
		t.Fatalf("edited head: %v", err)
	}
	h.Gens[1].Gen = 5
	if _, err := EncodeHead(h); !IsCorruption(err) {
		t.Fatalf("generation newer than the head's encoded: %v", err)
	}
}

func TestNames(t *testing.T) {
	n := SegName(0x1234, 7)
	if n != "seg/0000000000001234-00000007" {
		t.Fatal(n)
	}
	s, g, err := ParseSeqGen(n[len(SegDir):])
	if err != nil || s != 0x1234 || g != 7 {
		t.Fatal(s, g, err)
	}
	if _, _, err := ParseSeqGen("zz"); !IsCorruption(err) {
		t.Fatal(err)
	}
	u := UUID{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	if v, err := ParseUUID(u.String()); err != nil || v != u {
		t.Fatal(v, err)
	}
}

// FuzzDecoders is the one fuzz target of the format (one keeps make
// fuzz short): the first byte picks the decoder (segment, checkpoint,
// head, lease), the rest is its input. No input may panic a decoder, every
// error must be a corruption, and whatever decodes must encode back (the
// binary formats to the same bytes).
func FuzzDecoders(f *testing.F) {
	seg, _, _ := sampleSegment(f)
	ck, _ := EncodeCheckpoint(sampleCheckpoint())
	hd, _ := EncodeHead(sampleHead())
	ls, _ := EncodeLease(&Lease{Host: "h", PID: 1, TTL: time.Second})
	f.Add(append([]byte{0}, seg...))
	f.Add(append([]byte{0}, seg[:64]...))
	f.Add(append([]byte{1}, ck...))
	f.Add(append([]byte{2}, hd...))
	f.Add(append([]byte{3}, ls...))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		p := in[1:]
		var err error
		switch in[0] % 4 {
		case 0:
			var h SegmentHeader
			var data []byte
			if h, data, err = DecodeSegment(p); err == nil {
				q, err := EncodeSegment(h, data)
				if err != nil || !bytes.Equal(p, q) {
					t.Fatalf("segment re-encoding differs: %v", err)
				}
			}
		case 1:
			var c *Checkpoint
			if c, err = DecodeCheckpoint(p); err == nil {
				q, err := EncodeCheckpoint(c)
				if err != nil || !bytes.Equal(p, q) {
					t.Fatalf("checkpoint re-encoding differs: %v", err)
				}
			}
		case 2:
			var h *Head
			if h, err = DecodeHead(p); err == nil {
				if _, err := EncodeHead(h); err != nil {
					t.Fatalf("decoded head does not encode: %v", err)
				}
			}
		case 3:
			_, err = DecodeLease(p)
		}
		if err != nil && !IsCorruption(err) {
			t.Fatalf("error not a corruption: %v", err)
		}
	})
}
