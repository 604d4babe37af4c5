package crashtest

import "testing"

func TestStampDecode(t *testing.T) {
	b := make([]byte, BlockSize)
	if d := Decode(b, 7, 3); d.Kind != KindZero {
		t.Fatalf("zero block decodes as %v", d)
	}
	Stamp(b, 7, 3, 42)
	if d := Decode(b, 7, 3); d.Kind != KindWrite || d.ID != 42 {
		t.Fatalf("stamp decodes as %v, want w42", d)
	}
	if d := Decode(b, 7, 4); d.Kind != KindMisdirected || d.LBA != 3 {
		t.Fatalf("block of lba 3 read at lba 4 decodes as %v, want misdirected", d)
	}
	if d := Decode(b, 8, 3); d.Kind != KindForeign {
		t.Fatalf("block of seed 7 in run 8 decodes as %v, want foreign", d)
	}
	for _, at := range []int{9, 100, BlockSize - 5, BlockSize - 1} {
		c := append([]byte(nil), b...)
		c[at] ^= 1
		if d := Decode(c, 7, 3); d.Kind != KindTorn {
			t.Fatalf("bit flip at %d decodes as %v, want torn", at, d)
		}
	}
	// Half old, half new: a torn 4 KiB write.
	c := make([]byte, BlockSize)
	Stamp(c, 7, 3, 43)
	copy(c[BlockSize/2:], b[BlockSize/2:])
	if d := Decode(c, 7, 3); d.Kind != KindTorn {
		t.Fatalf("torn block decodes as %v", d)
	}
	g := make([]byte, BlockSize)
	g[100] = 1
	if d := Decode(g, 7, 3); d.Kind != KindGarbage {
		t.Fatalf("garbage decodes as %v", d)
	}
	// Different writes differ in their filler, not only the header.
	Stamp(c, 7, 3, 43)
	same := 0
	for i := 32; i < crcOff; i++ {
		if b[i] == c[i] {
			same++
		}
	}
	if same > 100 {
		t.Fatalf("fillers of w42 and w43 share %d bytes", same)
	}
}
