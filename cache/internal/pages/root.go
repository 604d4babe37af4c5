package pages

import (
	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// A root, one 4 KiB block in root slot gen%2:
//
//	off  len
//	0    4    magic "TCRT"
//	4    4    crc32c of the block with this field zero
//	8    4    version (1)
//	12   2    tree count
//	14   2    payload length
//	16   8    the set's nonce
//	24   8    generation
//	32   4    pages in the area
//	36   4    0
//	40        trees: { id u16 | level u8 | 0 u8 | page u32 | gen u64 | crc u32 | 0 u32 | count u64 | agg u64 } (40 bytes each)
//	          then the payload
//
// A tree of level 0 is empty (its pointer is zero). The tree numbered
// TableTree is the bucket table (table.go): its count is the number of
// buckets, its level that of its directory's top page.
const (
	rootMagic   = 0x54524354 // "TCRT"
	rootVersion = 1
	rootHdr     = 40
	rootTree    = 40
)

// Root is a decoded root.
type Root struct {
	Gen     uint64
	Nonce   uint64
	Pages   uint32
	Trees   []RootTree
	Payload []byte
}

// RootTree is one tree of a root.
type RootTree struct {
	ID    uint16
	Level uint8 // of the root page; 0: empty
	Root  Ptr
	Count uint64
	Agg   uint64
}

// MaxPayload is the largest payload a root with ntrees trees can carry.
func MaxPayload(ntrees int) int { return PageSize - rootHdr - ntrees*rootTree }

func encodeRoot(r Root) ([]byte, error) {
	if len(r.Payload) > MaxPayload(len(r.Trees)) || len(r.Trees) > (PageSize-rootHdr)/rootTree {
		return nil, errorf("root with %d trees and %d bytes of payload does not fit a block", len(r.Trees), len(r.Payload))
	}
	b := make([]byte, PageSize)
	le.PutUint32(b[0:], rootMagic)
	le.PutUint32(b[8:], rootVersion)
	le.PutUint16(b[12:], uint16(len(r.Trees)))
	le.PutUint16(b[14:], uint16(len(r.Payload)))
	le.PutUint64(b[16:], r.Nonce)
	le.PutUint64(b[24:], r.Gen)
	le.PutUint32(b[32:], r.Pages)
	o := rootHdr
	for _, t := range r.Trees {
		x := b[o : o+rootTree]
		le.PutUint16(x[0:], t.ID)
		x[2] = t.Level
		le.PutUint32(x[4:], t.Root.Page)
		le.PutUint64(x[8:], t.Root.Gen)
		le.PutUint32(x[16:], t.Root.CRC)
		le.PutUint64(x[24:], t.Count)
		le.PutUint64(x[32:], t.Agg)
		o += rootTree
	}
	copy(b[o:], r.Payload)
	le.PutUint32(b[4:], ondisk.CRC32C(b))
	return b, nil
}

// decodeRoot validates a root block read at off for the area lay. It
// never panics.
func decodeRoot(b []byte, off int64, lay Layout) (Root, error) {
	bad := func(format string, args ...any) (Root, error) {
		return Root{}, ondisk.Corruptf("index root", off, PageSize, format, args...)
	}
	if len(b) != PageSize || le.Uint32(b[0:]) != rootMagic {
		return bad("no root magic")
	}
	want := le.Uint32(b[4:])
	c := make([]byte, PageSize)
	copy(c, b)
	le.PutUint32(c[4:], 0)
	if got := ondisk.CRC32C(c); got != want {
		return Root{}, &ondisk.CorruptionError{Err: ErrCorrupt, Device: "cache", What: "index root", Offset: off,
			Length: PageSize, Expected: want, Actual: got, HaveSums: true}
	}
	r := Root{Nonce: le.Uint64(b[16:]), Gen: le.Uint64(b[24:]), Pages: le.Uint32(b[32:])}
	nt, np := int(le.Uint16(b[12:])), int(le.Uint16(b[14:]))
	switch {
	case le.Uint32(b[8:]) != rootVersion:
		return bad("root version %d", le.Uint32(b[8:]))
	case r.Nonce != lay.Nonce:
		return bad("root of another set (nonce %#x)", r.Nonce)
	case r.Pages != lay.Pages:
		return bad("root of an area of %d pages, the area has %d", r.Pages, lay.Pages)
	case r.Gen == 0:
		return bad("root generation 0")
	case nt > (PageSize-rootHdr)/rootTree || np > MaxPayload(nt) || le.Uint32(b[36:]) != 0:
		return bad("%d trees and %d bytes of payload", nt, np)
	}
	o := rootHdr
	seen := map[uint16]bool{}
	for range nt {
		x := b[o : o+rootTree]
		t := RootTree{ID: le.Uint16(x[0:]), Level: x[2],
			Root:  Ptr{Page: le.Uint32(x[4:]), Gen: le.Uint64(x[8:]), CRC: le.Uint32(x[16:])},
			Count: le.Uint64(x[24:]), Agg: le.Uint64(x[32:])}
		switch {
		case seen[t.ID]:
			return bad("tree %d named twice", t.ID)
		case x[3] != 0 || le.Uint32(x[20:]) != 0:
			return bad("tree %d: reserved bytes set", t.ID)
		case t.Level == 0 && (t.Root != Ptr{} || t.Count != 0):
			return bad("empty tree %d with a root page or slots", t.ID)
		case t.Level > 0 && (t.Root.Page >= lay.Pages || t.Root.Gen == 0 || t.Root.Gen > r.Gen || t.Count == 0):
			return bad("tree %d: root page %d of generation %d, %d slots", t.ID, t.Root.Page, t.Root.Gen, t.Count)
		}
		seen[t.ID] = true
		r.Trees = append(r.Trees, t)
		o += rootTree
	}
	r.Payload = append([]byte(nil), b[o:o+np]...)
	return r, nil
}
