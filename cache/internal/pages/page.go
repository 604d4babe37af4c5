// Package pages is the index on the cache device: the index's leaves as
// 4 KiB pages in a page area of their own, read through a bounded page
// cache, with the inner nodes resident, written copy-on-write, so that a
// checkpoint writes the pages changed since the last one and then a root
// (docs/CACHE.md, "Index pages on the cache device"; docs/DESIGN.md).
//
// The package holds the page codec (this file), the page cache
// (cache.go), the page area's allocation (alloc.go), the copy-on-write
// tree of one volume's entries or superseded versions (tree.go), the
// bucket table (table.go), the root that names them and the Store that
// writes and reads them (root.go, store.go), reading every leaf in runs
// (readall.go) and verifying every page (verify.go); its tests check it
// against the in-memory index (index.Ptree) as the oracle. The engine
// (package cache) writes its checkpoints through a Store, under its own
// lock, and reads the root back at Open. It keeps its index in memory and
// looks nothing up through the page cache; the owner map (cache block to
// entry) is not paged. After a clean shutdown the engine reads a leaf
// only when an operation first needs it (LeafRefs, ReadLeaf; package
// cache, lazyleaves.go).
//
// # Page format
//
// Every page is 4 KiB, little endian:
//
//	off  len
//	0    4    magic "TCPG"
//	4    4    crc32c of the whole page with this field zero
//	8    1    kind: 1 leaf, 2 inner, 3 bucket table (table.go)
//	9    1    level: 0 for a leaf, the height above the leaves for an inner page
//	10   2    slot count
//	12   2    tree: the volume slot the page belongs to (| SupTree: its superseded versions; TableTree: the bucket table)
//	14   2    0
//	16   8    the page's own number in the page area (a page read from another address is misdirected)
//	24   8    the checkpoint generation that wrote it
//	32   8    the set's nonce (a page of another set is not this set's)
//	40   8    0
//	48        slots
//
// A leaf slot (23 bytes, 176 a page) is one cached 4 KiB block:
//
//	lba u40 | loc u32 (cache block, bit 31 dirty) | crc u32 (of the data) | bucket gen u32 | flush epoch u48
//
// in strictly increasing LBA order (in a tree of superseded versions,
// SupTree: by LBA, then cache block). The bucket generation is the one the
// entry's block was written in: an entry whose bucket has since been
// reused names another generation and is no longer live (so reusing a
// bucket needs no walk of the pages that name it). The epoch is the dirty
// block's flush epoch (0 when clean).
//
// An inner slot (36 bytes, 112 a page) names a child page:
//
//	key lba u64 | key sub u32 | page u32 | gen u64 | crc u32 | agg u64
//
// The key is the smallest key under the child (sub orders the superseded
// versions of one LBA; 0 in a tree of live entries); page, gen and crc are
// where the child is, the generation that wrote it and its checksum, all
// verified when the child is read, so a lost or misplaced write of the
// child is found; agg is a lower bound of the oldest dirty flush epoch
// under it (MaxUint64 when it holds none).
package pages

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

const (
	PageSize = 4096
	HdrSize  = 48

	KindLeaf  = 1
	KindInner = 2

	LeafSlot  = 23
	InnerSlot = 36
	LeafCap   = (PageSize - HdrSize) / LeafSlot  // 176
	InnerCap  = (PageSize - HdrSize) / InnerSlot // 112

	MaxLBA   = 1 << 40
	MaxEpoch = 1 << 48

	magic = 0x47504354 // "TCPG"
)

var le = binary.LittleEndian

// ErrCorrupt marks a page or root that fails its checks; it is
// ondisk.ErrCorrupt, so the engine's IsCorruption recognizes it.
var ErrCorrupt = ondisk.ErrCorrupt

// ErrRange is returned for a value the format cannot hold (an LBA of 2^40
// or more, an epoch of 2^48 or more).
var ErrRange = errors.New("pages: value out of range")

// Slot is one leaf slot: a cached 4 KiB block of a volume.
type Slot struct {
	LBA   uint64
	Loc   uint32 // cache block | index.DirtyBit
	CRC   uint32
	BGen  uint32 // the bucket generation the block was written in
	Epoch uint64 // flush epoch of a dirty block; 0 when clean
}

// Ptr names a child page: where it is, the generation that wrote it and
// its checksum.
type Ptr struct {
	Page uint32
	Gen  uint64
	CRC  uint32
}

// Hdr is a page's header.
type Hdr struct {
	Kind  uint8
	Level uint8
	Count uint16
	Tree  uint16
	Page  uint32
	Gen   uint64
	Nonce uint64
}

// Page is one 4 KiB page, the form it has on the device and in memory:
// lookups and changes work on the slots in place.
type Page [PageSize]byte

func (p *Page) Hdr() Hdr {
	return Hdr{Kind: p[8], Level: p[9], Count: le.Uint16(p[10:]), Tree: le.Uint16(p[12:]),
		Page: uint32(le.Uint64(p[16:])), Gen: le.Uint64(p[24:]), Nonce: le.Uint64(p[32:])}
}

func (p *Page) Count() int { return int(le.Uint16(p[10:])) }

func (p *Page) setCount(n int) { le.PutUint16(p[10:], uint16(n)) }

// Init makes p an empty page of the given kind.
func (p *Page) Init(kind, level uint8, tree uint16) {
	*p = Page{}
	le.PutUint32(p[0:], magic)
	p[8], p[9] = kind, level
	le.PutUint16(p[12:], tree)
}

// Seal stamps the page with its number, generation and nonce and its
// checksum, before it is written; it returns the checksum.
func (p *Page) Seal(page uint32, gen, nonce uint64) uint32 {
	le.PutUint64(p[16:], uint64(page))
	le.PutUint64(p[24:], gen)
	le.PutUint64(p[32:], nonce)
	le.PutUint32(p[4:], 0)
	c := ondisk.CRC32C(p[:])
	le.PutUint32(p[4:], c)
	return c
}

// Verify checks a page read from at.Page (at byte offset off of the
// device), expected to be of kind (and, for an inner page, level, unless
// 0) and tree, written by generation at.Gen with checksum at.CRC (0: not
// known), and the order of its slots. It never panics; a failure is a
// *ondisk.CorruptionError wrapping ErrCorrupt.
func (p *Page) Verify(at Ptr, off int64, kind, level uint8, tree uint16, nonce uint64) error {
	bad := func(format string, args ...any) error {
		return ondisk.Corruptf("index page", off, PageSize, format, args...)
	}
	if le.Uint32(p[0:]) != magic {
		return bad("page %d: no page magic", at.Page)
	}
	want := le.Uint32(p[4:])
	le.PutUint32(p[4:], 0)
	got := ondisk.CRC32C(p[:])
	le.PutUint32(p[4:], want)
	if got != want || (at.CRC != 0 && want != at.CRC) {
		exp := want
		if at.CRC != 0 {
			exp = at.CRC
		}
		return &ondisk.CorruptionError{Err: ErrCorrupt, Device: "cache", What: "index page", Offset: off,
			Length: PageSize, Expected: exp, Actual: got, HaveSums: true, Detail: fmt.Sprintf("page %d", at.Page)}
	}
	h := p.Hdr()
	switch {
	case h.Nonce != nonce:
		return bad("page %d belongs to another set (nonce %#x)", at.Page, h.Nonce)
	case h.Page != at.Page || le.Uint64(p[16:])>>32 != 0:
		return bad("page %d read at page %d (a misdirected write)", h.Page, at.Page)
	case at.Gen != 0 && h.Gen != at.Gen:
		return bad("page %d of generation %d, its parent names generation %d (a lost write)", at.Page, h.Gen, at.Gen)
	case h.Kind != kind || (kind != KindInner && h.Level != 0) || (kind == KindInner && (h.Level == 0 || (level != 0 && h.Level != level))):
		return bad("page %d is kind %d level %d, expected kind %d level %d", at.Page, h.Kind, h.Level, kind, level)
	case h.Tree != tree:
		return bad("page %d belongs to tree %d, expected %d", at.Page, h.Tree, tree)
	case le.Uint16(p[14:]) != 0 || le.Uint64(p[40:]) != 0:
		return bad("page %d: reserved header bytes set", at.Page)
	}
	switch kind {
	case KindLeaf:
		if h.Count == 0 || int(h.Count) > LeafCap {
			return bad("leaf page %d holds %d slots (1..%d)", at.Page, h.Count, LeafCap)
		}
		sup := h.Tree&SupTree != 0
		for i := 1; i < int(h.Count); i++ {
			if !keyLess(p.SlotKey(i-1, sup), p.SlotKey(i, sup)) {
				return bad("leaf page %d: slot %d (lba %d) out of order", at.Page, i, p.LBA(i))
			}
		}
	case KindTable:
		if h.Count == 0 || int(h.Count) > TableCap {
			return bad("table page %d holds %d buckets (1..%d)", at.Page, h.Count, TableCap)
		}
		for i := range int(h.Count) {
			if le.Uint16(p[recOff(i)+10:]) != 0 {
				return bad("table page %d: bucket %d: reserved bytes set", at.Page, i)
			}
		}
	case KindInner:
		if h.Count == 0 || int(h.Count) > InnerCap {
			return bad("inner page %d holds %d slots (1..%d)", at.Page, h.Count, InnerCap)
		}
		for i := 1; i < int(h.Count); i++ {
			a, b := p.Key(i-1), p.Key(i)
			if !keyLess(a, b) {
				return bad("inner page %d: slot %d out of order", at.Page, i)
			}
		}
	}
	return nil
}

// Leaf slots.

func leafOff(i int) int { return HdrSize + i*LeafSlot }

func (p *Page) LBA(i int) uint64 {
	o := leafOff(i)
	return uint64(le.Uint32(p[o:])) | uint64(p[o+4])<<32
}

func (p *Page) Slot(i int) Slot {
	o := leafOff(i)
	b := p[o : o+LeafSlot : o+LeafSlot]
	return Slot{
		LBA:   uint64(le.Uint32(b[0:])) | uint64(b[4])<<32,
		Loc:   le.Uint32(b[5:]),
		CRC:   le.Uint32(b[9:]),
		BGen:  le.Uint32(b[13:]),
		Epoch: uint64(le.Uint32(b[17:])) | uint64(le.Uint16(b[21:]))<<32,
	}
}

// CheckSlot reports whether the format can hold s.
func CheckSlot(s Slot) error {
	if s.LBA >= MaxLBA || s.Epoch >= MaxEpoch {
		return fmt.Errorf("%w: lba %d, epoch %d", ErrRange, s.LBA, s.Epoch)
	}
	return nil
}

func (p *Page) setSlot(i int, s Slot) {
	o := leafOff(i)
	b := p[o : o+LeafSlot : o+LeafSlot]
	le.PutUint32(b[0:], uint32(s.LBA))
	b[4] = uint8(s.LBA >> 32)
	le.PutUint32(b[5:], s.Loc)
	le.PutUint32(b[9:], s.CRC)
	le.PutUint32(b[13:], s.BGen)
	le.PutUint32(b[17:], uint32(s.Epoch))
	le.PutUint16(b[21:], uint16(s.Epoch>>32))
}

// Search returns the first leaf slot whose LBA is >= lba, and whether it
// is lba.
func (p *Page) Search(lba uint64) (int, bool) { return p.SearchKey(Key{LBA: lba}, false) }

// SlotKey returns the key of leaf slot i: its LBA, and in a tree of
// superseded versions (sup) its cache block as the sub-key.
func (p *Page) SlotKey(i int, sup bool) Key {
	if !sup {
		return Key{LBA: p.LBA(i)}
	}
	o := leafOff(i)
	return Key{LBA: p.LBA(i), Sub: le.Uint32(p[o+5:]) &^ dirtyBit}
}

// SearchKey returns the first leaf slot whose key is >= k, and whether it
// is k.
func (p *Page) SearchKey(k Key, sup bool) (int, bool) {
	lo, hi := 0, p.Count()
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if keyLess(p.SlotKey(m, sup), k) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < p.Count() && p.SlotKey(lo, sup) == k
}

// SupTree is the bit of a tree number that makes it a tree of superseded
// versions: slots ordered by (LBA, cache block), since an LBA can have
// several (of different epochs). Its slots carry the dirty bit (they are
// dirty versions), so the epoch bounds find them as they find live dirty
// entries.
const SupTree = 1 << 15

// SlotKeyOf returns the key of s in a tree (sup: of superseded versions).
func SlotKeyOf(s Slot, sup bool) Key {
	if sup {
		return Key{LBA: s.LBA, Sub: s.Loc &^ dirtyBit}
	}
	return Key{LBA: s.LBA}
}

// InsertSlot puts s at slot i, moving the later slots up (the caller
// keeps the order and the capacity).
func (p *Page) InsertSlot(i int, s Slot) {
	n := p.Count()
	copy(p[leafOff(i+1):leafOff(n+1)], p[leafOff(i):leafOff(n)])
	p.setSlot(i, s)
	p.setCount(n + 1)
}

// SetSlot replaces slot i.
func (p *Page) SetSlot(i int, s Slot) { p.setSlot(i, s) }

// RemoveSlot removes slot i.
func (p *Page) RemoveSlot(i int) {
	n := p.Count()
	copy(p[leafOff(i):leafOff(n-1)], p[leafOff(i+1):leafOff(n)])
	clear(p[leafOff(n-1):leafOff(n)])
	p.setCount(n - 1)
}

// MinEpoch returns the oldest flush epoch of the leaf's dirty slots
// (MaxUint64: none).
func (p *Page) MinEpoch() uint64 {
	m := uint64(math.MaxUint64)
	for i := range p.Count() {
		if s := p.Slot(i); s.Loc&dirtyBit != 0 {
			m = min(m, s.Epoch)
		}
	}
	return m
}

const dirtyBit = 1 << 31

// Inner slots.

// Key orders the trees' elements: by LBA, then by sub (the cache block of
// a superseded version; 0 in a tree of live entries).
type Key struct {
	LBA uint64
	Sub uint32
}

func keyLess(a, b Key) bool { return a.LBA < b.LBA || (a.LBA == b.LBA && a.Sub < b.Sub) }

// Child is one inner slot.
type Child struct {
	Key Key
	Ptr Ptr
	Agg uint64
}

func innerOff(i int) int { return HdrSize + i*InnerSlot }

func (p *Page) Key(i int) Key {
	o := innerOff(i)
	return Key{LBA: le.Uint64(p[o:]), Sub: le.Uint32(p[o+8:])}
}

func (p *Page) Child(i int) Child {
	o := innerOff(i)
	b := p[o : o+InnerSlot : o+InnerSlot]
	return Child{
		Key: Key{LBA: le.Uint64(b[0:]), Sub: le.Uint32(b[8:])},
		Ptr: Ptr{Page: le.Uint32(b[12:]), Gen: le.Uint64(b[16:]), CRC: le.Uint32(b[24:])},
		Agg: le.Uint64(b[28:]),
	}
}

// AppendChild adds c after the last inner slot (the caller keeps the
// order and the capacity).
func (p *Page) AppendChild(c Child) {
	n := p.Count()
	o := innerOff(n)
	b := p[o : o+InnerSlot : o+InnerSlot]
	le.PutUint64(b[0:], c.Key.LBA)
	le.PutUint32(b[8:], c.Key.Sub)
	le.PutUint32(b[12:], c.Ptr.Page)
	le.PutUint64(b[16:], c.Ptr.Gen)
	le.PutUint32(b[24:], c.Ptr.CRC)
	le.PutUint64(b[28:], c.Agg)
	p.setCount(n + 1)
}
