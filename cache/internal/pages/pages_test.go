package pages

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

const testNonce = 0x5eed

func testLayout(pages uint32) Layout { return Layout{Off: 8192, Pages: pages, Nonce: testNonce} }

func newTestStore(t testing.TB, dev device.Device, lay Layout, cachePages int) *Store {
	t.Helper()
	if err := Format(dev, lay, []byte("p0")); err != nil {
		t.Fatal(err)
	}
	st, payload, err := Open(dev, lay, cachePages)
	if err != nil {
		t.Fatal(err)
	}
	if string(payload) != "p0" {
		t.Fatalf("payload %q", payload)
	}
	return st
}

func TestPageRoundTrip(t *testing.T) {
	var p Page
	p.Init(KindLeaf, 0, 3)
	slots := []Slot{
		{LBA: 0, Loc: 1, CRC: 2, BGen: 3, Epoch: 0},
		{LBA: 7, Loc: 5 | dirtyBit, CRC: math.MaxUint32, BGen: math.MaxUint32, Epoch: MaxEpoch - 1},
		{LBA: MaxLBA - 1, Loc: math.MaxUint32, CRC: 9, BGen: 1, Epoch: 1 << 40},
	}
	for i, s := range slots {
		p.InsertSlot(i, s)
	}
	crc := p.Seal(17, 4, testNonce)
	if err := p.Verify(Ptr{Page: 17, Gen: 4, CRC: crc}, 0, KindLeaf, 0, 3, testNonce); err != nil {
		t.Fatal(err)
	}
	for i, s := range slots {
		if got := p.Slot(i); got != s {
			t.Errorf("slot %d: %+v, want %+v", i, got, s)
		}
	}
	if got := p.MinEpoch(); got != 1<<40 {
		t.Errorf("MinEpoch %d, want %d", got, uint64(1<<40))
	}
	if i, ok := p.Search(7); i != 1 || !ok {
		t.Errorf("Search(7) = %d, %t", i, ok)
	}
	if i, ok := p.Search(8); i != 2 || ok {
		t.Errorf("Search(8) = %d, %t", i, ok)
	}
	p.RemoveSlot(1)
	if p.Count() != 2 || p.Slot(1) != slots[2] {
		t.Errorf("after RemoveSlot: %d slots, slot 1 %+v", p.Count(), p.Slot(1))
	}
	if CheckSlot(Slot{LBA: MaxLBA}) == nil || CheckSlot(Slot{Epoch: MaxEpoch}) == nil {
		t.Error("CheckSlot accepts a value the format cannot hold")
	}
}

// TestPageVerify: every way a page can be wrong is reported as corruption
// naming the page.
func TestPageVerify(t *testing.T) {
	var good Page
	good.Init(KindLeaf, 0, 1)
	good.InsertSlot(0, Slot{LBA: 5, Loc: 1})
	good.InsertSlot(1, Slot{LBA: 9, Loc: 2})
	crc := good.Seal(3, 2, testNonce)
	at := Ptr{Page: 3, Gen: 2, CRC: crc}
	resealed := func(f func(p *Page)) *Page {
		p := good
		f(&p)
		p.Seal(3, 2, testNonce)
		return &p
	}
	for _, c := range []struct {
		name string
		p    *Page
		at   Ptr
		kind uint8
		tree uint16
	}{
		{"byte flipped", func() *Page { p := good; p[100] ^= 1; return &p }(), at, KindLeaf, 1},
		{"checksum the parent does not name", resealed(func(p *Page) { p.SetSlot(0, Slot{LBA: 6}) }), at, KindLeaf, 1},
		{"misdirected", &good, Ptr{Page: 4}, KindLeaf, 1},
		{"older generation than the parent names", &good, Ptr{Page: 3, Gen: 3}, KindLeaf, 1},
		{"other kind", &good, at, KindInner, 1},
		{"other tree", &good, at, KindLeaf, 2},
		{"out of order", resealed(func(p *Page) { p.SetSlot(1, Slot{LBA: 5}) }), Ptr{Page: 3}, KindLeaf, 1},
		{"empty", resealed(func(p *Page) { p.setCount(0) }), Ptr{Page: 3}, KindLeaf, 1},
		{"overfull", resealed(func(p *Page) { p.setCount(LeafCap + 1) }), Ptr{Page: 3}, KindLeaf, 1},
		{"reserved bytes", resealed(func(p *Page) { p[14] = 1 }), Ptr{Page: 3}, KindLeaf, 1},
		{"no magic", &Page{}, Ptr{Page: 3}, KindLeaf, 1},
	} {
		err := c.p.Verify(c.at, 12345, c.kind, 0, c.tree, testNonce)
		if !IsCorruption(err) {
			t.Errorf("%s: %v, want corruption", c.name, err)
		}
	}
	if err := good.Verify(at, 0, KindLeaf, 0, 1, testNonce+1); !IsCorruption(err) {
		t.Errorf("other set's nonce: %v", err)
	}
}

// FuzzPages decodes any 4 KiB as a leaf page, an inner page and a root:
// never a panic, a refusal is a corruption error, and what is accepted
// encodes back to the same bytes.
func FuzzPages(f *testing.F) {
	var p Page
	p.Init(KindLeaf, 0, 0)
	p.InsertSlot(0, Slot{LBA: 1, Loc: 2 | dirtyBit, Epoch: 3})
	p.Seal(0, 1, testNonce)
	f.Add(p[:])
	var q Page
	q.Init(KindInner, 1, 0)
	q.AppendChild(Child{Key: Key{LBA: 0}, Ptr: Ptr{Page: 1, Gen: 1, CRC: 5}, Agg: 3})
	q.AppendChild(Child{Key: Key{LBA: 9}, Ptr: Ptr{Page: 2, Gen: 1, CRC: 6}, Agg: math.MaxUint64})
	q.Seal(0, 1, testNonce)
	f.Add(q[:])
	var tp Page
	tp.Init(KindTable, 0, TableTree)
	tp.setRec(0, Bucket{Gen: 1, Live: 2, Dirty: 1, Fill: 3, Atime: 4, Oldest: 5})
	tp.setRec(1, Bucket{Gen: math.MaxUint32})
	tp.setCount(2)
	tp.Seal(0, 1, testNonce)
	f.Add(tp[:])
	lay := testLayout(64)
	r, _ := encodeRoot(Root{Gen: 3, Nonce: testNonce, Pages: 64, Payload: []byte("x"),
		Trees: []RootTree{{ID: 0, Level: 1, Root: Ptr{Page: 5, Gen: 3, CRC: 1}, Count: 4, Agg: 2}, {ID: 4},
			{ID: TableTree, Level: 1, Root: Ptr{Page: 6, Gen: 2, CRC: 7}, Count: 100, Agg: math.MaxUint64}}})
	f.Add(r)
	f.Fuzz(func(t *testing.T, b []byte) {
		var p Page
		copy(p[:], b)
		for _, kind := range []uint8{KindLeaf, KindInner, KindTable} {
			orig := p
			tree := uint16(0)
			if kind == KindTable {
				tree = TableTree
			}
			if err := p.Verify(Ptr{Page: 0}, 0, kind, 0, tree, testNonce); err != nil {
				if !IsCorruption(err) {
					t.Fatalf("not a corruption error: %v", err)
				}
				continue
			}
			var r Page
			h := p.Hdr()
			r.Init(h.Kind, h.Level, h.Tree)
			for i := range p.Count() {
				switch kind {
				case KindLeaf:
					r.InsertSlot(i, p.Slot(i))
				case KindInner:
					r.AppendChild(p.Child(i))
				case KindTable:
					r.setRec(i, p.rec(i))
					r.setCount(i + 1)
				}
			}
			r.Seal(h.Page, h.Gen, h.Nonce)
			if r != orig {
				t.Fatalf("re-encoded page differs")
			}
			if kind == KindLeaf {
				for i := range p.Count() {
					j, ok := p.Search(p.LBA(i))
					if !ok || j != i {
						t.Fatalf("Search(slot %d) = %d, %t", i, j, ok)
					}
				}
			}
		}
		root, err := decodeRoot(p[:], 0, lay)
		if err != nil {
			if !IsCorruption(err) {
				t.Fatalf("not a corruption error: %v", err)
			}
			return
		}
		out, err := encodeRoot(root)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, p[:]) {
			t.Fatal("re-encoded root differs")
		}
	})
}

func TestRootSlots(t *testing.T) {
	lay := testLayout(16)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 4)
	for i := range 3 {
		if err := st.Checkpoint([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	// Generation 4 (slot 0) is the newest: a torn slot 0 falls back to 3.
	st1, p, err := Open(dev, lay, 4)
	if err != nil || !bytes.Equal(p, []byte{2}) {
		t.Fatalf("open: %q %v", p, err)
	}
	if g, err := st1.Previous(); g != 3 || err != nil {
		t.Fatalf("previous root %d (%v), want 3", g, err)
	}
	if err := dev.Corrupt(lay.Off+100, 1); err != nil {
		t.Fatal(err)
	}
	st2, p, err := Open(dev, lay, 4)
	if err != nil || !bytes.Equal(p, []byte{1}) || st2.Gen() != 3 {
		t.Fatalf("open with slot 0 damaged: %q %v", p, err)
	}
	if g, err := st2.Previous(); g != 0 || !IsCorruption(err) {
		t.Fatalf("previous root with slot 0 damaged: %d (%v)", g, err)
	}
	if err := dev.Corrupt(lay.Off+PageSize+100, 1); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Open(dev, lay, 4); !IsCorruption(err) {
		t.Fatalf("open with both slots damaged: %v", err)
	}
	other := lay
	other.Nonce++
	if _, _, err := Open(dev, other, 4); err == nil {
		t.Fatal("opened another set's area")
	}
}

func TestCacheClock(t *testing.T) {
	c := NewCache(3)
	pg := func(i byte) *Page { p := new(Page); p[0] = i; return p }
	for i := range uint32(3) {
		c.Put(i, pg(byte(i)))
	}
	c.Get(0) // referenced: survives the next eviction
	c.Put(3, pg(3))
	if _, ok := c.Get(1); ok {
		t.Error("page 1 (not referenced) should have been evicted first")
	}
	for _, p := range []uint32{0, 2, 3} {
		if _, ok := c.Get(p); !ok {
			t.Errorf("page %d evicted", p)
		}
	}
	if b, ok := c.Take(2); !ok || b[0] != 2 {
		t.Error("Take(2)")
	}
	c.Drop(3)
	if c.Len() != 1 || c.Evictions != 1 {
		t.Errorf("len %d, evictions %d", c.Len(), c.Evictions)
	}
	if err := c.Check(); err != nil {
		t.Fatal(err)
	}
}

// oracle is the in-memory index (index.Ptree: LBA, cache block, checksum)
// plus each LBA's bucket generation and epoch, which Ptree does not keep.
type oracle struct {
	tree  *index.Ptree
	extra map[uint64][2]uint64
}

func newOracle() *oracle { return &oracle{tree: index.NewPtree(), extra: map[uint64][2]uint64{}} }

func (o *oracle) clone() *oracle {
	c := &oracle{tree: o.tree.Clone(), extra: make(map[uint64][2]uint64, len(o.extra))}
	for k, v := range o.extra {
		c.extra[k] = v
	}
	return c
}

func (o *oracle) put(s Slot) {
	o.tree.ReplaceOrInsert(index.Ent{LBA: s.LBA, Loc: s.Loc, CRC: s.CRC})
	o.extra[s.LBA] = [2]uint64{uint64(s.BGen), s.Epoch}
}

func (o *oracle) del(lba uint64) bool {
	delete(o.extra, lba)
	_, ok := o.tree.Delete(index.Ent{LBA: lba})
	return ok
}

func (o *oracle) slot(e index.Ent) Slot {
	x := o.extra[e.LBA]
	return Slot{LBA: e.LBA, Loc: e.Loc, CRC: e.CRC, BGen: uint32(x[0]), Epoch: x[1]}
}

// same compares every slot of tr with the oracle, in order.
func (o *oracle) same(tr *Tree) error {
	var want []Slot
	o.tree.Ascend(func(e index.Ent) bool { want = append(want, o.slot(e)); return true })
	var got []Slot
	if err := tr.Ascend(0, func(s Slot) bool { got = append(got, s); return true }); err != nil {
		return err
	}
	if len(got) != len(want) || tr.Len() != len(want) {
		return fmt.Errorf("%d slots (Len %d), oracle %d", len(got), tr.Len(), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			return fmt.Errorf("slot %d: %+v, oracle %+v", i, got[i], want[i])
		}
	}
	return nil
}

func randSlot(rng *rand.Rand, span uint64) Slot {
	s := Slot{LBA: rng.Uint64N(span), Loc: rng.Uint32N(1 << 20), CRC: rng.Uint32(), BGen: rng.Uint32N(8)}
	if rng.IntN(2) == 0 {
		s.Loc |= dirtyBit
		s.Epoch = 1 + rng.Uint64N(1000)
	}
	return s
}

// workload runs n random operations on tr and o: puts (mostly), deletes,
// lookups and range scans, comparing each result with the oracle.
func workload(t *testing.T, rng *rand.Rand, tr *Tree, o *oracle, n int, span uint64) {
	t.Helper()
	for range n {
		switch r := rng.IntN(20); {
		case r < 12:
			s := randSlot(rng, span)
			old, replaced, err := tr.Put(s)
			if err != nil {
				t.Fatal(err)
			}
			want, had := o.tree.Get(index.Ent{LBA: s.LBA})
			if replaced != had || (had && old != o.slot(want)) {
				t.Fatalf("Put(%+v) replaced %+v (%t), oracle %+v (%t)", s, old, replaced, want, had)
			}
			o.put(s)
		case r < 17:
			lba := rng.Uint64N(span)
			want, had := o.tree.Get(index.Ent{LBA: lba})
			var wantSlot Slot
			if had {
				wantSlot = o.slot(want)
			}
			old, ok, err := tr.Delete(lba)
			if err != nil {
				t.Fatal(err)
			}
			if ok != o.del(lba) || (ok && old != wantSlot) {
				t.Fatalf("Delete(%d) = %+v %t, oracle %+v %t", lba, old, ok, wantSlot, had)
			}
		case r < 19:
			lba := rng.Uint64N(span)
			got, ok, err := tr.Get(lba)
			if err != nil {
				t.Fatal(err)
			}
			want, had := o.tree.Get(index.Ent{LBA: lba})
			if ok != had || (ok && got != o.slot(want)) {
				t.Fatalf("Get(%d) = %+v %t, oracle %+v %t", lba, got, ok, want, had)
			}
		default:
			from := rng.Uint64N(span)
			var got, want []Slot
			if err := tr.Ascend(from, func(s Slot) bool { got = append(got, s); return len(got) < 50 }); err != nil {
				t.Fatal(err)
			}
			o.tree.AscendGreaterOrEqual(index.Ent{LBA: from}, func(e index.Ent) bool {
				want = append(want, o.slot(e))
				return len(want) < 50
			})
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("Ascend(%d): %v, oracle %v", from, got, want)
			}
		}
	}
}

// reachable counts the pages the durable root names, reading the trees
// as stored.
func reachable(t *testing.T, dev device.Device, lay Layout) int {
	t.Helper()
	st, _, err := Open(dev, lay, 1)
	if err != nil {
		t.Fatal(err)
	}
	return st.alloc.Used()
}

// TestTreeOracle runs random operations on a tree and on the in-memory
// index, with checkpoints and re-opens (from the device, with a page
// cache of 4 pages) in between: every lookup, scan and the whole content
// agree with the oracle, Check holds, the page cache stays within its
// bound, and after each checkpoint exactly the pages the two roots name
// are in use (nothing leaks, nothing named is free).
func TestTreeOracle(t *testing.T) {
	seeds, rounds := uint64(3), 9
	if raceEnabled {
		seeds, rounds = 2, 6
	}
	for seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 20))
			lay := testLayout(4096)
			dev := device.NewMem(lay.Off + lay.Len())
			st := newTestStore(t, dev, lay, 4)
			span := uint64(2000 + seed*20000) // dense (replacements) to sparse (splits)
			trees := []*Tree{st.Tree(0), st.Tree(5)}
			oracles := []*oracle{newOracle(), newOracle()}
			for round := range rounds {
				for i, tr := range trees {
					workload(t, rng, tr, oracles[i], 1000, span)
				}
				if err := st.Checkpoint([]byte(fmt.Sprint(round))); err != nil {
					t.Fatal(err)
				}
				for i, tr := range trees {
					if err := tr.Check(); err != nil {
						t.Fatal(err)
					}
					if tr.Dirty() != 0 {
						t.Fatalf("%v after a checkpoint", tr)
					}
					if err := oracles[i].same(tr); err != nil {
						t.Fatalf("round %d tree %d: %v", round, i, err)
					}
				}
				if n := reachable(t, dev, lay); n != st.alloc.Used() {
					t.Fatalf("round %d: %d pages in use, the root names %d", round, st.alloc.Used(), n)
				}
				if st.cache.Len() > 4 {
					t.Fatalf("page cache holds %d pages, bound 4", st.cache.Len())
				}
				if round%3 == 2 {
					var payload []byte
					var err error
					st, payload, err = Open(dev, lay, 4)
					if err != nil {
						t.Fatal(err)
					}
					if string(payload) != fmt.Sprint(round) {
						t.Fatalf("payload %q after round %d", payload, round)
					}
					trees = []*Tree{st.Tree(0), st.Tree(5)}
					for i, tr := range trees {
						if err := oracles[i].same(tr); err != nil {
							t.Fatalf("reopened after round %d, tree %d: %v", round, i, err)
						}
					}
				}
			}
			// Everything deleted: the trees are empty, and so is the area
			// once a root says so.
			for i, tr := range trees {
				var lbas []uint64
				oracles[i].tree.Ascend(func(e index.Ent) bool { lbas = append(lbas, e.LBA); return true })
				for _, l := range lbas {
					if _, ok, err := tr.Delete(l); !ok || err != nil {
						t.Fatalf("Delete(%d): %t %v", l, ok, err)
					}
				}
				if err := tr.Check(); err != nil || tr.Len() != 0 {
					t.Fatalf("%v: %v", tr, err)
				}
			}
			// The first root naming no page keeps the previous root's,
			// the second frees them.
			for i := range 2 {
				if err := st.Checkpoint(nil); err != nil {
					t.Fatal(err)
				}
				if st.alloc.Used() != st.alloc.Kept() || (i == 1) != (st.alloc.Used() == 0) {
					t.Fatalf("checkpoint %d: %d pages in use with empty trees, %d kept", i, st.alloc.Used(), st.alloc.Kept())
				}
			}
		})
	}
}

// countDev counts reads and writes, and can crash: at write-or-sync
// operation cut it takes a crash image of the memory device as it is
// before that operation.
type countDev struct {
	*device.Mem
	reads, ops int
	cut        int
	crashed    *device.Mem
	rng        *rand.Rand
}

func (d *countDev) ReadAt(p []byte, off int64) (int, error) {
	d.reads++
	return d.Mem.ReadAt(p, off)
}

func (d *countDev) op() {
	if d.ops == d.cut && d.crashed == nil {
		d.crashed = d.Mem.CrashClone(device.CrashConfig{UnsyncedKeep: 0.5, TornProb: 0.2, Rand: d.rng})
	}
	d.ops++
}

func (d *countDev) WriteAt(p []byte, off int64) (int, error) {
	d.op()
	return d.Mem.WriteAt(p, off)
}

func (d *countDev) Sync() error {
	d.op()
	return d.Mem.Sync()
}

// TestLookupCost: with the leaves 10x the page cache, a lookup costs at
// most one device read (the inner nodes are resident), and only when its
// leaf is not resident.
func TestLookupCost(t *testing.T) {
	lay := testLayout(2048)
	dev := &countDev{Mem: device.NewMem(lay.Off + lay.Len()), cut: -1}
	st := newTestStore(t, dev, lay, 1000)
	tr := st.Tree(0)
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 50000
	for i := range n {
		if _, _, err := tr.Put(Slot{LBA: uint64(i) * 3, Loc: uint32(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	st, _, err := Open(dev, lay, 0)
	if err != nil {
		t.Fatal(err)
	}
	leaves := st.alloc.Used() // leaves and inner pages
	st.cache = NewCache(leaves / 10)
	tr = st.Tree(0)
	misses := st.cache.Misses
	const lookups = 5000
	for range lookups {
		i := rng.Uint64N(n)
		r0 := dev.reads
		s, ok, err := tr.Get(i * 3)
		if err != nil || !ok || s.Loc != uint32(i) {
			t.Fatalf("Get(%d): %+v %t %v", i*3, s, ok, err)
		}
		if d := dev.reads - r0; d > 1 {
			t.Fatalf("a lookup read %d pages", d)
		}
	}
	if got := st.cache.Misses - misses; int(got) > lookups || st.cache.Len() > leaves/10 {
		t.Fatalf("%d misses, %d resident of bound %d", got, st.cache.Len(), leaves/10)
	}
	t.Logf("%d pages, cache %d: %d of %d lookups read a page", leaves, leaves/10, st.cache.Misses-misses, lookups)
}

// TestCheckpointWritesWhatChanged: a checkpoint after k changes to a large
// tree writes at most the k leaves changed and the inner pages above them,
// not the tree.
func TestCheckpointWritesWhatChanged(t *testing.T) {
	lay := testLayout(8192)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 64)
	tr := st.Tree(0)
	const n = 100000
	for i := range n {
		if _, _, err := tr.Put(Slot{LBA: uint64(i), Loc: uint32(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	total := st.alloc.Used()
	height := tr.root.level
	rng := rand.New(rand.NewPCG(3, 4))
	for _, k := range []int{1, 10, 100} {
		w0 := st.PagesWritten
		for range k {
			l := rng.Uint64N(n)
			if _, _, err := tr.Put(Slot{LBA: l, Loc: 7}); err != nil {
				t.Fatal(err)
			}
		}
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
		w := int(st.PagesWritten - w0)
		if w > k*height+1 || w < 1 {
			t.Fatalf("%d changes: %d pages written (tree of %d pages, height %d)", k, w, total, height)
		}
		t.Logf("%d changes in a tree of %d pages: %d pages written", k, total, w)
	}
}

// TestCrashAtEveryWrite: a crash at any write or sync of a checkpoint
// (unsynced blocks kept, lost or torn at random) reopens either the
// previous root's trees and bucket table or the new one's, exactly; and the root in the
// other slot is then always the one before (Previous), intact: with the
// newest root's slot damaged on top of the crash, Open falls back to it
// and finds its trees exactly, every page verified (Check reads every
// leaf). The page area is small, so pages are reused within the run
// (asserted), and the store is re-opened after the second checkpoint (the
// previous root's pages are kept across an Open too).
func TestCrashAtEveryWrite(t *testing.T) {
	const crashBuckets = 2000 // 12 table pages under one directory page
	lay := testLayout(80)
	// One run without a crash counts the operations.
	run := func(cut int, seed uint64) (*countDev, []*oracle, [][]Bucket, int, uint64) {
		rng := rand.New(rand.NewPCG(seed, 9))
		dev := &countDev{Mem: device.NewMem(lay.Off + lay.Len()), cut: cut, rng: rand.New(rand.NewPCG(seed, uint64(cut)))}
		st := newTestStore(t, dev, lay, 8)
		o := newOracle()
		snaps := []*oracle{o.clone()} // the trees as of each root, from generation 1
		tabs := [][]Bucket{nil}       // the bucket table as of each root
		tr := st.Tree(1)
		tab := make([]Bucket, crashBuckets)
		start := dev.ops
		var written uint64
		for c := range 12 {
			workload(t, rng, tr, o, 400, 3000)
			tb, err := st.Table(crashBuckets)
			if err != nil {
				t.Fatal(err)
			}
			for range 20 {
				i := rng.IntN(crashBuckets)
				tab[i] = randBucket(rng)
				tb.Set(i, tab[i])
			}
			if err := st.Checkpoint(nil); err != nil {
				t.Fatal(err)
			}
			snaps = append(snaps, o.clone())
			tabs = append(tabs, slices.Clone(tab))
			if c == 1 {
				written += st.PagesWritten
				var err error
				if st, _, err = Open(dev, lay, 8); err != nil {
					t.Fatal(err)
				}
				tr = st.Tree(1)
			}
		}
		return dev, snaps, tabs, dev.ops - start, written + st.PagesWritten
	}
	sameTable := func(st *Store, want []Bucket) error {
		if want == nil {
			if st.table != nil {
				return fmt.Errorf("a bucket table at generation %d", st.Gen())
			}
			return nil
		}
		if st.table == nil {
			return fmt.Errorf("no bucket table at generation %d", st.Gen())
		}
		if !slices.Equal(st.table.recs, want) {
			return fmt.Errorf("bucket table at generation %d differs", st.Gen())
		}
		return nil
	}
	seeds, stride := uint64(2), 1
	if raceEnabled {
		seeds, stride = 1, 3 // every third crash point: -race is 10x slower
	}
	for seed := range seeds {
		_, _, _, nops, written := run(-1, seed)
		if written <= uint64(lay.Pages) {
			t.Fatalf("seed %d: %d pages written to an area of %d: none reused", seed, written, lay.Pages)
		}
		fallbacks := 0
		for cut := 0; cut < nops; cut += stride {
			dev, snaps, tabs, _, _ := run(cut+3, seed) // after Format's two writes and a sync
			if dev.crashed == nil {
				t.Fatalf("seed %d cut %d: no crash image", seed, cut)
			}
			st, _, err := Open(dev.crashed, lay, 8)
			if err != nil {
				t.Fatalf("seed %d cut %d: open after crash: %v", seed, cut, err)
			}
			g := int(st.Gen()) - 1
			if g < 0 || g >= len(snaps) {
				t.Fatalf("seed %d cut %d: generation %d", seed, cut, st.Gen())
			}
			if err := snaps[g].same(st.Tree(1)); err != nil {
				t.Fatalf("seed %d cut %d: generation %d: %v", seed, cut, st.Gen(), err)
			}
			if err := sameTable(st, tabs[g]); err != nil {
				t.Fatalf("seed %d cut %d: %v", seed, cut, err)
			}
			if err := st.Tree(1).Check(); err != nil {
				t.Fatalf("seed %d cut %d: %v", seed, cut, err)
			}
			prev, perr := st.Previous()
			if st.Gen() == 1 {
				continue // the other slot was never written
			}
			if prev != st.Gen()-1 {
				t.Fatalf("seed %d cut %d: generation %d, previous root %d (%v)", seed, cut, st.Gen(), prev, perr)
			}
			// The newest root's slot damaged: the previous root, whole.
			if err := dev.crashed.Corrupt(lay.Off+int64(st.Gen()%2)*PageSize+64, 8); err != nil {
				t.Fatal(err)
			}
			st, _, err = Open(dev.crashed, lay, 8)
			if err != nil || st.Gen() != prev {
				t.Fatalf("seed %d cut %d: open with the newest root damaged: generation %d, %v", seed, cut, st.Gen(), err)
			}
			if err := snaps[prev-1].same(st.Tree(1)); err != nil {
				t.Fatalf("seed %d cut %d: fallback to generation %d: %v", seed, cut, prev, err)
			}
			if err := sameTable(st, tabs[prev-1]); err != nil {
				t.Fatalf("seed %d cut %d: fallback: %v", seed, cut, err)
			}
			if err := st.Tree(1).Check(); err != nil {
				t.Fatalf("seed %d cut %d: fallback to generation %d: %v", seed, cut, prev, err)
			}
			fallbacks++
		}
		t.Logf("seed %d: %d crash points (one in %d run), %d fallbacks checked, %d pages written to an area of %d", seed, nops, stride, fallbacks, written, lay.Pages)
	}
}

// TestAllocKeepsTwoRoots: the allocation's rule as a property. A model
// names, for each root, the pages it names; a checkpoint releases some of
// the durable root's pages (a changed page is copied), allocates its new
// pages until the area is full or it has enough (so free pages are
// reused at once), and makes the new root durable. Alloc never hands out
// a page the durable root or the previous one names (the two roots the
// slots hold), fails only when the area is full, and Used counts exactly
// the pages the two roots and the one being built name.
func TestAllocKeepsTwoRoots(t *testing.T) {
	const n = 64
	rng := rand.New(rand.NewPCG(21, 22))
	a := NewAlloc(n)
	var durable, prev map[uint32]bool // pages the two roots in the slots name
	durable, prev = map[uint32]bool{}, map[uint32]bool{}
	full := 0
	for round := range 2000 {
		cur := map[uint32]bool{} // the root being built
		released := 0
		for p := range durable {
			if rng.IntN(3) == 0 {
				a.Release(p)
				released++
			} else {
				cur[p] = true
			}
		}
		want := released + rng.IntN(8)
		if len(durable) > n/2 {
			want = rng.IntN(released + 1) // removals: the tree shrinks
		}
		for range want {
			p, err := a.Alloc()
			if err != nil {
				if !errors.Is(err, ErrFull) || a.Used() != n {
					t.Fatalf("round %d: %v with %d of %d pages used", round, err, a.Used(), n)
				}
				full++
				break
			}
			if durable[p] || prev[p] || cur[p] {
				t.Fatalf("round %d: page %d handed out; durable root names it %t, the previous one %t", round, p, durable[p], prev[p])
			}
			cur[p] = true
		}
		union := map[uint32]bool{}
		for _, m := range []map[uint32]bool{durable, prev, cur} {
			for p := range m {
				union[p] = true
			}
		}
		if a.Used() != len(union) {
			t.Fatalf("round %d: %d pages used, the roots name %d", round, a.Used(), len(union))
		}
		a.Durable(released)
		prev, durable = durable, cur
	}
	if full == 0 {
		t.Fatal("the area was never full: no test of reuse")
	}
	t.Logf("2000 checkpoints in an area of %d pages, full at %d of them", n, full)
}

func randBucket(rng *rand.Rand) Bucket {
	b := Bucket{Gen: rng.Uint32(), Live: uint16(rng.IntN(257)), Fill: uint16(rng.IntN(257)), Atime: rng.Uint32()}
	if rng.IntN(2) == 0 {
		b.Dirty, b.Oldest = uint16(1+rng.IntN(256)), 1+rng.Uint64N(1<<40)
	}
	return b
}

// TestTableWritesWhatChanged: the bucket table of 100,000 buckets (596
// table pages under 6 directory pages and a root) against a resident
// model, beside a tree in the same store: after k summaries changed at
// random, a checkpoint writes exactly the table pages holding them, the
// directory pages above those and the top one (and the tree's changes),
// never the table; every re-open finds the model's table, and the pages
// in use are those the two roots name.
func TestTableWritesWhatChanged(t *testing.T) {
	const n = 100000
	lay := testLayout(4096)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 4)
	tb, err := st.Table(n)
	if err != nil {
		t.Fatal(err)
	}
	model := make([]Bucket, n)
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	if got, want := st.PagesWritten, uint64(596+6+1); got != want {
		t.Fatalf("the first checkpoint wrote %d pages, want %d (the whole table)", got, want)
	}
	rng := rand.New(rand.NewPCG(31, 32))
	for round, k := range []int{1, 10, 100, 1000, 10000, 1, 0} {
		pagesChanged, dirsChanged := map[int]bool{}, map[int]bool{}
		for range k {
			i := rng.IntN(n)
			b := randBucket(rng)
			if b != model[i] {
				pagesChanged[i/TableCap] = true
				dirsChanged[i/TableCap/InnerCap] = true
			}
			model[i] = b
			tb.Set(i, b)
		}
		tr := st.Tree(0)
		if _, _, err := tr.Put(Slot{LBA: uint64(round), Loc: uint32(round)}); err != nil {
			t.Fatal(err)
		}
		if tb.Dirty() != len(pagesChanged) {
			t.Fatalf("%d changes: %d table pages dirty, %d changed", k, tb.Dirty(), len(pagesChanged))
		}
		w0 := st.PagesWritten
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
		w := int(st.PagesWritten - w0)
		want := len(pagesChanged) + len(dirsChanged) + 1 + 2 // + the tree's leaf and inner page
		if k == 0 {
			want = 2 // the table is not written at all
		}
		if w != want {
			t.Fatalf("%d changes (%d table pages, %d directory pages): %d pages written, want %d", k, len(pagesChanged), len(dirsChanged), w, want)
		}
		t.Logf("%d bucket changes: %d pages written (table pages %d, directory pages %d, the tree's 2; the table is 603 pages)", k, w, len(pagesChanged), len(dirsChanged))
		if round%2 == 1 {
			if st, _, err = Open(dev, lay, 4); err != nil {
				t.Fatal(err)
			}
			if tb, err = st.Table(n); err != nil {
				t.Fatal(err)
			}
			if n := reachable(t, dev, lay); n != st.alloc.Used() {
				t.Fatalf("%d pages in use, the roots name %d", st.alloc.Used(), n)
			}
		}
		if !slices.Equal(tb.recs, model) {
			t.Fatalf("round %d: the table differs from the model", round)
		}
	}
	if _, err := st.Table(n + 1); err == nil {
		t.Fatal("a table of another size")
	}
}

// TestTableCorrupt: a damaged table or directory page fails Open as
// corruption, never a panic or a wrong table.
func TestTableCorrupt(t *testing.T) {
	lay := testLayout(256)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 4)
	tb, err := st.Table(30000) // 179 table pages, 2 directory pages, a root
	if err != nil {
		t.Fatal(err)
	}
	tb.Set(7, Bucket{Gen: 9})
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	pages := []uint32{tb.levels[0][0].ptr.Page, tb.levels[0][178].ptr.Page, tb.levels[1][1].ptr.Page, tb.levels[2][0].ptr.Page}
	for _, p := range pages {
		img := dev.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
		if err := img.Corrupt(lay.pageOff(p)+100, 1); err != nil {
			t.Fatal(err)
		}
		if _, _, err := Open(img, lay, 4); !IsCorruption(err) {
			t.Fatalf("page %d damaged: Open %v", p, err)
		}
	}
	st, _, err = Open(dev, lay, 4)
	if err != nil {
		t.Fatal(err)
	}
	if tb, err = st.Table(30000); err != nil || tb.Get(7) != (Bucket{Gen: 9}) {
		t.Fatalf("%+v %v", tb.Get(7), err)
	}
}

// TestCorruptLeaf: a damaged leaf is an error naming it, never a panic or
// wrong data, and the tree around it still answers.
func TestCorruptLeaf(t *testing.T) {
	lay := testLayout(256)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 2)
	tr := st.Tree(0)
	for i := range 2000 {
		if _, _, err := tr.Put(Slot{LBA: uint64(i), Loc: uint32(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	st, _, err := Open(dev, lay, 2)
	if err != nil {
		t.Fatal(err)
	}
	tr = st.Tree(0)
	k := tr.root.kids[0]
	if err := dev.Corrupt(lay.pageOff(k.ptr.Page)+200, 1); err != nil {
		t.Fatal(err)
	}
	_, _, err = tr.Get(0)
	var ce interface{ Unwrap() error }
	if !IsCorruption(err) || !errors.As(err, &ce) {
		t.Fatalf("Get of a damaged leaf: %v", err)
	}
	if s, ok, err := tr.Get(1999); err != nil || !ok || s.Loc != 1999 {
		t.Fatalf("Get(1999) beside the damaged leaf: %+v %t %v", s, ok, err)
	}
}

// TestWritebackScan walks a tree the way epoch-ordered writeback would:
// OldestEpoch, then AscendAggAtMost for that epoch, then clean marks of
// what it found, until nothing is dirty. Each step agrees with the oracle
// (the oldest dirty epoch and its slots), and after a re-open (bounds
// exact, cache empty) a scan reads only leaves holding a dirty slot of an
// epoch at most the one scanned for: clean leaves are never read.
func TestWritebackScan(t *testing.T) {
	lay := testLayout(2048)
	dev := &countDev{Mem: device.NewMem(lay.Off + lay.Len()), cut: -1}
	st := newTestStore(t, dev, lay, 16)
	tr := st.Tree(0)
	o := newOracle()
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 30000
	for i := range n {
		s := Slot{LBA: uint64(i), Loc: uint32(i), CRC: uint32(i)}
		if rng.IntN(100) == 0 {
			s.Loc |= dirtyBit
			s.Epoch = 1 + rng.Uint64N(20)
		}
		if _, _, err := tr.Put(s); err != nil {
			t.Fatal(err)
		}
		o.put(s)
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	st, _, err := Open(dev, lay, 16)
	if err != nil {
		t.Fatal(err)
	}
	tr = st.Tree(0)
	leafOf := map[uint64]int{} // lba -> leaf ordinal (slots in LBA order, leaves in order)
	nleaves := 0
	{
		ord := -1
		prevPage := uint32(math.MaxUint32)
		var walk func(n *node)
		walk = func(n *node) {
			for i := range n.kids {
				if n.level > 1 {
					walk(n.kids[i].node)
					continue
				}
				if n.kids[i].ptr.Page != prevPage {
					ord++
					prevPage = n.kids[i].ptr.Page
				}
				p, err := tr.leaf(&n.kids[i])
				if err != nil {
					t.Fatal(err)
				}
				for j := range p.Count() {
					leafOf[p.LBA(j)] = ord
				}
			}
		}
		walk(tr.root)
		nleaves = ord + 1
	}
	st.cache = NewCache(16) // forget what the walk read
	for steps := 0; ; steps++ {
		var want uint64 = math.MaxUint64
		wantLeaves := map[int]bool{}
		o.tree.Ascend(func(e index.Ent) bool {
			if e.Dirty() {
				want = min(want, o.extra[e.LBA][1])
			}
			return true
		})
		ep, ok, err := tr.OldestEpoch()
		if err != nil {
			t.Fatal(err)
		}
		if ok != (want != math.MaxUint64) || (ok && ep != want) {
			t.Fatalf("step %d: OldestEpoch %d %t, oracle %d", steps, ep, ok, want)
		}
		if !ok {
			break
		}
		o.tree.Ascend(func(e index.Ent) bool {
			if e.Dirty() && o.extra[e.LBA][1] <= ep {
				wantLeaves[leafOf[e.LBA]] = true
			}
			return true
		})
		r0 := dev.reads
		var batch []Slot
		err = tr.AscendAggAtMost(0, ep, func(s Slot) bool {
			if s.Loc&dirtyBit != 0 && s.Epoch == ep {
				batch = append(batch, s)
			}
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
		if steps == 0 {
			if dev.reads-r0 > len(wantLeaves) {
				t.Fatalf("the first scan read %d pages; %d leaves hold dirty slots of epoch <= %d", dev.reads-r0, len(wantLeaves), ep)
			}
			t.Logf("epoch %d: the scan read %d of %d leaves (%d hold a dirty slot of that epoch)", ep, dev.reads-r0, nleaves, len(wantLeaves))
		}
		var wantBatch []Slot
		o.tree.Ascend(func(e index.Ent) bool {
			if s := o.slot(e); e.Dirty() && s.Epoch == ep {
				wantBatch = append(wantBatch, s)
			}
			return true
		})
		if fmt.Sprint(batch) != fmt.Sprint(wantBatch) {
			t.Fatalf("step %d: epoch %d batch %d slots, oracle %d", steps, ep, len(batch), len(wantBatch))
		}
		for _, s := range batch {
			s.Loc &^= dirtyBit
			s.Epoch = 0
			if _, _, err := tr.Put(s); err != nil {
				t.Fatal(err)
			}
			o.put(s)
		}
		if steps%5 == 4 {
			if err := st.Checkpoint(nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tr.Check(); err != nil {
		t.Fatal(err)
	}
	if err := o.same(tr); err != nil {
		t.Fatal(err)
	}
}

// TestSupTreeOracle: a tree of superseded versions (SupTree: several
// slots per LBA, ordered by cache block) against index.Stree, the
// in-memory index's tree of superseded versions, with checkpoints and a
// re-open: inserts, deletes of one version, the versions of an LBA, the
// oldest epoch.
func TestSupTreeOracle(t *testing.T) {
	lay := testLayout(1024)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 4)
	id := uint16(2) | SupTree
	tr := st.Tree(id)
	ref := index.NewStree()
	epochs := map[[2]uint64]uint64{}
	rng := rand.New(rand.NewPCG(7, 8))
	const span = 800
	for round := range 6 {
		for range 1500 {
			lba, loc := rng.Uint64N(span), rng.Uint32N(64)
			if rng.IntN(3) > 0 {
				ep := 1 + rng.Uint64N(500)
				s := Slot{LBA: lba, Loc: loc | dirtyBit, CRC: uint32(lba), Epoch: ep}
				_, replaced, err := tr.Put(s)
				if err != nil {
					t.Fatal(err)
				}
				_, had := ref.ReplaceOrInsert(index.Ent{LBA: lba, Loc: loc, CRC: uint32(lba)})
				if replaced != had {
					t.Fatalf("Put(%d, %d): replaced %t, oracle %t", lba, loc, replaced, had)
				}
				epochs[[2]uint64{lba, uint64(loc)}] = ep
				continue
			}
			_, ok, err := tr.DeleteKey(Key{LBA: lba, Sub: loc})
			if err != nil {
				t.Fatal(err)
			}
			if _, had := ref.Delete(index.Ent{LBA: lba, Loc: loc}); ok != had {
				t.Fatalf("DeleteKey(%d, %d): %t, oracle %t", lba, loc, ok, had)
			}
			delete(epochs, [2]uint64{lba, uint64(loc)})
		}
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
		if round%2 == 1 {
			var err error
			if st, _, err = Open(dev, lay, 4); err != nil {
				t.Fatal(err)
			}
			tr = st.Tree(id)
		}
		if err := tr.Check(); err != nil {
			t.Fatal(err)
		}
		// The versions of some LBAs, and all of them in order.
		for range 50 {
			lba := rng.Uint64N(span)
			var got, want []uint32
			err := tr.AscendKey(Key{LBA: lba}, func(s Slot) bool {
				if s.LBA != lba {
					return false
				}
				got = append(got, s.Loc&^dirtyBit)
				return true
			})
			if err != nil {
				t.Fatal(err)
			}
			ref.AscendRange(index.Ent{LBA: lba}, index.Ent{LBA: lba + 1}, func(e index.Ent) bool {
				want = append(want, e.Loc)
				return true
			})
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("versions of %d: %v, oracle %v", lba, got, want)
			}
		}
		var got, want []string
		oldest := uint64(math.MaxUint64)
		if err := tr.Ascend(0, func(s Slot) bool { got = append(got, fmt.Sprint(s.LBA, s.Loc&^dirtyBit, s.Epoch)); return true }); err != nil {
			t.Fatal(err)
		}
		ref.Ascend(func(e index.Ent) bool {
			ep := epochs[[2]uint64{e.LBA, uint64(e.Loc)}]
			oldest = min(oldest, ep)
			want = append(want, fmt.Sprint(e.LBA, e.Loc, ep))
			return true
		})
		if fmt.Sprint(got) != fmt.Sprint(want) || tr.Len() != ref.Len() {
			t.Fatalf("round %d: %d versions, oracle %d", round, len(got), len(want))
		}
		if ep, ok, err := tr.OldestEpoch(); err != nil || ok != (oldest != math.MaxUint64) || (ok && ep != oldest) {
			t.Fatalf("OldestEpoch %d %t %v, oracle %d", ep, ok, err, oldest)
		}
	}
}

// treeShape counts a tree's leaves and inner nodes and the fewest slots
// of a leaf.
func treeShape(t *testing.T, tr *Tree) (leaves, inner, minSlots int) {
	t.Helper()
	minSlots = math.MaxInt
	var walk func(n *node)
	walk = func(n *node) {
		inner++
		for i := range n.kids {
			if n.level > 1 {
				walk(n.kids[i].node)
				continue
			}
			leaves++
			p, err := tr.leaf(&n.kids[i])
			if err != nil {
				t.Fatal(err)
			}
			minSlots = min(minSlots, p.Count())
		}
	}
	if tr.root != nil {
		walk(tr.root)
	}
	return leaves, inner, minSlots
}

// checkFill checks the fill bound through Check and counts: a tree of n
// slots has at most max(1, n/minLeaf) leaves and each inner level at most
// max(1, below/minInner) nodes, so at most pageBound(n) pages.
func checkFill(t *testing.T, tr *Tree) {
	t.Helper()
	if err := tr.Check(); err != nil {
		t.Fatal(err)
	}
	leaves, inner, _ := treeShape(t, tr)
	if n := tr.Len(); leaves+inner > pageBound(n) || leaves > max(1, n/minLeaf) {
		t.Fatalf("%d slots in %d leaves and %d inner pages, bound %d pages", n, leaves, inner, pageBound(n))
	}
}

// pageBound is the most pages a tree of n slots takes under the fill
// bounds.
func pageBound(n int) int {
	if n == 0 {
		return 0
	}
	total, level := 0, max(1, n/minLeaf)
	for {
		total += level
		if level == 1 && total > 1 {
			return total
		}
		level = max(1, level/minInner)
	}
}

// TestFillBound: whatever the order of inserts and removals, every leaf
// but a lone root leaf holds at least minLeaf (70 of 176) slots and every
// inner node but the root minInner (44 of 112) children, so the pages a
// tree takes are bounded by its slots (pageBound). Each pattern is one
// that a merge with a single neighbour left with leaves of a slot or
// two: removals from the right, from the left, keeping one slot in 176
// (one a former leaf), keeping the first and last of each run of 300,
// random, and churn of inserts and removals at random. Check (which
// verifies the bound) runs every 401 operations (3001 with -race) and at
// the end, after a checkpoint and a re-open.
func TestFillBound(t *testing.T) {
	const n = 40000 // 3 inner nodes under the root: inner merges too
	every, churn := 401, 8000
	if raceEnabled {
		every, churn = 3001, 3000
	}
	patterns := []struct {
		name string
		keep func(i int) bool // slots the removals leave
		perm bool             // remove in random order
	}{
		{"from the right", func(i int) bool { return i < 100 }, false},
		{"from the left", func(i int) bool { return i >= n-100 }, false},
		{"one in 176", func(i int) bool { return i%LeafCap == 0 }, false},
		{"ends of runs", func(i int) bool { return i%300 == 0 || i%300 == 299 }, false},
		{"one in 176 random order", func(i int) bool { return i%LeafCap == 0 }, true},
		{"random half", nil, true},
	}
	for _, pt := range patterns {
		t.Run(pt.name, func(t *testing.T) {
			lay := testLayout(4096)
			dev := device.NewMem(lay.Off + lay.Len())
			st := newTestStore(t, dev, lay, 16)
			tr := st.Tree(0)
			o := newOracle()
			rng := rand.New(rand.NewPCG(13, 14))
			for i := range n {
				s := Slot{LBA: uint64(i), Loc: uint32(i)}
				if _, _, err := tr.Put(s); err != nil {
					t.Fatal(err)
				}
				o.put(s)
			}
			if err := st.Checkpoint(nil); err != nil {
				t.Fatal(err)
			}
			if tr.root.level < 2 || len(tr.root.kids) < 3 {
				t.Fatalf("%v: no inner nodes below the root", tr)
			}
			order := make([]int, n)
			for i := range order {
				order[i] = n - 1 - i
			}
			if pt.perm {
				order = rng.Perm(n)
			} else if pt.name == "from the left" {
				slices.Reverse(order)
			}
			ops := 0
			for _, i := range order {
				if pt.keep == nil && rng.IntN(2) == 0 || pt.keep != nil && pt.keep(i) {
					continue
				}
				if _, ok, err := tr.Delete(uint64(i)); !ok || err != nil {
					t.Fatalf("Delete(%d): %t %v", i, ok, err)
				}
				o.del(uint64(i))
				if ops++; ops%every == 0 {
					checkFill(t, tr)
				}
			}
			checkFill(t, tr)
			// Churn: inserts and removals at random.
			for range churn {
				i := rng.Uint64N(n)
				if rng.IntN(2) == 0 {
					s := Slot{LBA: i, Loc: uint32(i) + 1}
					if _, _, err := tr.Put(s); err != nil {
						t.Fatal(err)
					}
					o.put(s)
				} else {
					if _, ok, err := tr.Delete(i); err != nil || ok != o.del(i) {
						t.Fatalf("Delete(%d): %t %v", i, ok, err)
					}
				}
				if ops++; ops%every == 0 {
					checkFill(t, tr)
				}
			}
			if err := st.Checkpoint(nil); err != nil {
				t.Fatal(err)
			}
			st, _, err := Open(dev, lay, 16)
			if err != nil {
				t.Fatal(err)
			}
			tr = st.Tree(0)
			checkFill(t, tr)
			if err := o.same(tr); err != nil {
				t.Fatal(err)
			}
			if used := st.alloc.Used() - st.alloc.Kept(); used > pageBound(tr.Len()) {
				t.Fatalf("%d pages in use for %d slots, bound %d", used, tr.Len(), pageBound(tr.Len()))
			}
			leaves, inner, least := treeShape(t, tr)
			t.Logf("%d slots: %d leaves (%.1f slots a leaf, fewest %d), %d inner pages; bound %d pages",
				tr.Len(), leaves, float64(tr.Len())/float64(leaves), least, inner, pageBound(tr.Len()))
		})
	}
}

// TestLeafMerge: removing 90 % of a tree's slots at random leaves every
// leaf at least minLeaf full (small leaves merge with a sibling or take
// slots from one), the content equal to the oracle's, and the pages the
// root names in proportion to what is left.
func TestLeafMerge(t *testing.T) {
	lay := testLayout(2048)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 8)
	tr := st.Tree(0)
	o := newOracle()
	rng := rand.New(rand.NewPCG(11, 12))
	const n = 40000
	for _, i := range rng.Perm(n) {
		s := Slot{LBA: uint64(i), Loc: uint32(i)}
		if _, _, err := tr.Put(s); err != nil {
			t.Fatal(err)
		}
		o.put(s)
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	before := st.alloc.Used()
	for _, i := range rng.Perm(n)[:n*9/10] {
		if _, ok, err := tr.Delete(uint64(i)); !ok || err != nil {
			t.Fatalf("Delete(%d): %t %v", i, ok, err)
		}
		o.del(uint64(i))
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	checkFill(t, tr)
	if err := o.same(tr); err != nil {
		t.Fatal(err)
	}
	leaves, _, least := treeShape(t, tr)
	left := tr.Len()
	t.Logf("%d pages before, %d after removing 90 %%: %d slots in %d leaves (%.1f a leaf, fewest %d)",
		before, st.alloc.Used(), left, leaves, float64(left)/float64(leaves), least)
}
