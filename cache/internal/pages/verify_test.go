package pages

import (
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestVerify: Verify reads every page the durable root names and counts
// them as Counts does from memory, with progress up to the total; a byte
// damaged in any page it names (inner, leaf, table, directory) makes it
// fail with a corruption error, even where Open does not read the page
// (a leaf), and a byte damaged in a free page does not.
func TestVerify(t *testing.T) {
	lay := testLayout(2048)
	dev := device.NewMem(lay.Off + lay.Len())
	st := newTestStore(t, dev, lay, 8)
	rng := rand.New(rand.NewPCG(5, 6))
	for id := range uint16(3) {
		tr := st.Tree(id)
		for range 9000 {
			l := rng.Uint64N(50000)
			if _, _, err := tr.Put(Slot{LBA: l, Loc: uint32(l), Epoch: l % 7}); err != nil {
				t.Fatal(err)
			}
		}
	}
	sup := st.Tree(1 | SupTree)
	for i := range 300 {
		if _, _, err := sup.Put(Slot{LBA: uint64(i / 3), Loc: uint32(i), Epoch: 1}); err != nil {
			t.Fatal(err)
		}
	}
	tb, err := st.Table(40000)
	if err != nil {
		t.Fatal(err)
	}
	tb.Set(3, Bucket{Gen: 2})
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	// A second checkpoint changing some leaves: pages of the previous
	// root are kept, not named, and not verified.
	for range 50 {
		if _, _, err := st.Tree(0).Put(Slot{LBA: rng.Uint64N(50000), Loc: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	st, _, err = Open(dev, lay, 8)
	if err != nil {
		t.Fatal(err)
	}
	want := st.Counts()
	var last, lastTotal int64
	got, err := st.Verify(func(done, total int64) {
		if done < last || done > total {
			t.Fatalf("progress %d of %d after %d", done, total, last)
		}
		last, lastTotal = done, total
	})
	if err != nil {
		t.Fatal(err)
	}
	if got != want || want.Trees != 4 || want.Leaves < 100 || want.Inner < 4 || want.Table != 239+3+1 {
		t.Fatalf("Verify counted %+v, Counts %+v", got, want)
	}
	if last != want.Pages() || lastTotal != want.Pages() || int64(st.alloc.Used()-st.alloc.Kept()) != want.Pages() {
		t.Fatalf("progress ended at %d of %d; %d pages in use, %d counted", last, lastTotal, st.alloc.Used(), want.Pages())
	}
	t.Logf("%+v", got)

	named := map[uint32]bool{}
	var pick []uint32
	var walk func(n *node)
	walk = func(n *node) {
		named[n.ptr.Page] = true
		pick = append(pick, n.ptr.Page)
		for i, k := range n.kids {
			if n.level > 1 {
				walk(k.node)
				continue
			}
			named[k.ptr.Page] = true
			if i%17 == 0 {
				pick = append(pick, k.ptr.Page)
			}
		}
	}
	for _, id := range st.TreeIDs() {
		walk(st.trees[id].root)
	}
	for l, lv := range st.table.levels {
		for j, n := range lv {
			named[n.ptr.Page] = true
			if l > 0 || j%50 == 0 {
				pick = append(pick, n.ptr.Page)
			}
		}
	}
	for _, p := range pick {
		img := dev.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
		if err := img.Corrupt(lay.pageOff(p)+HdrSize+int64(rng.IntN(PageSize-HdrSize-64)), 1); err != nil {
			t.Fatal(err)
		}
		vs, _, err := Open(img, lay, 8)
		if err != nil {
			if !IsCorruption(err) {
				t.Fatalf("page %d damaged: Open: %v", p, err)
			}
			continue // an inner or table page: Open reads it
		}
		if _, err := vs.Verify(nil); !IsCorruption(err) {
			t.Fatalf("page %d damaged: Verify: %v", p, err)
		}
	}
	free := uint32(0)
	for named[free] {
		free++
	}
	img := dev.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
	if err := img.Corrupt(lay.pageOff(free)+100, 1); err != nil {
		t.Fatal(err)
	}
	vs, _, err := Open(img, lay, 8)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vs.Verify(nil); err != nil {
		t.Fatalf("free page %d damaged: %v", free, err)
	}
	t.Logf("%d damaged pages refused", len(pick))
}

// TestReadLeaves: ReadLeaves hands over every leaf once, at its place in
// key order, the same slots Ascend reads, with leaves held changed, cached
// and on the device (scattered by churn over several checkpoints), in
// fewer reads than leaves; a damaged leaf is a corruption error.
func TestReadLeaves(t *testing.T) {
	lay := testLayout(4096)
	mem := device.NewMem(lay.Off + lay.Len())
	dev := &countReads{Device: mem}
	st := newTestStore(t, dev, lay, 8)
	tr := st.Tree(2)
	rng := rand.New(rand.NewPCG(8, 9))
	for round := range 4 {
		for range 20000 {
			l := rng.Uint64N(60000)
			if rng.IntN(4) == 0 && round > 0 {
				if _, _, err := tr.Delete(l); err != nil {
					t.Fatal(err)
				}
				continue
			}
			if _, _, err := tr.Put(Slot{LBA: l, Loc: uint32(l), CRC: uint32(round), Epoch: uint64(round)}); err != nil {
				t.Fatal(err)
			}
		}
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
	}
	st, _, err := Open(dev, lay, 8)
	if err != nil {
		t.Fatal(err)
	}
	tr = st.Tree(2)
	for range 30 { // some leaves held changed, some cached
		if _, _, err := tr.Put(Slot{LBA: rng.Uint64N(60000), Loc: 1}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := tr.Get(rng.Uint64N(60000)); err != nil {
			t.Fatal(err)
		}
	}
	var want []Slot
	if err := tr.Ascend(0, func(s Slot) bool { want = append(want, s); return true }); err != nil {
		t.Fatal(err)
	}
	n := tr.Leaves()
	got := make([][]Slot, n)
	r0 := dev.n
	err = tr.ReadLeaves(func(i int, p *Page) error {
		if got[i] != nil {
			t.Fatalf("leaf %d twice", i)
		}
		got[i] = []Slot{}
		for j := range p.Count() {
			got[i] = append(got[i], p.Slot(j))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	reads := dev.n - r0
	var all []Slot
	for i, g := range got {
		if g == nil {
			t.Fatalf("leaf %d of %d not read", i, n)
		}
		all = append(all, g...)
	}
	if len(all) != len(want) {
		t.Fatalf("%d slots, Ascend %d", len(all), len(want))
	}
	for i := range all {
		if all[i] != want[i] {
			t.Fatalf("slot %d: %+v, Ascend %+v", i, all[i], want[i])
		}
	}
	if reads*4 > int64(n) {
		t.Fatalf("%d reads for %d leaves", reads, n)
	}
	t.Logf("%d leaves, %d slots, %d reads", n, len(all), reads)

	st, _, err = Open(dev, lay, 8)
	if err != nil {
		t.Fatal(err)
	}
	tr = st.Tree(2)
	k := tr.root.kids[len(tr.root.kids)/2]
	if k.node != nil {
		k = k.node.kids[0]
	}
	if err := mem.Corrupt(lay.pageOff(k.ptr.Page)+300, 1); err != nil {
		t.Fatal(err)
	}
	if err := tr.ReadLeaves(func(int, *Page) error { return nil }); !IsCorruption(err) {
		t.Fatalf("a damaged leaf: %v", err)
	}
}

type countReads struct {
	device.Device
	n int64
}

func (c *countReads) ReadAt(p []byte, off int64) (int, error) {
	c.n++
	return c.Device.ReadAt(p, off)
}

// TestHold: Hold reads the leaves of a batch of keys in few reads, after
// which putting the batch reads nothing; the batch's deletes stay
// correct; the trees after a checkpoint and a re-open are the oracle's;
// a damaged leaf is corruption.
func TestHold(t *testing.T) {
	lay := testLayout(4096)
	mem := device.NewMem(lay.Off + lay.Len())
	dev := &countReads{Device: mem}
	st := newTestStore(t, dev, lay, 8)
	tr := st.Tree(2)
	rng := rand.New(rand.NewPCG(3, 4))
	want := map[uint64]Slot{}
	put := func(s Slot) {
		t.Helper()
		if _, _, err := tr.Put(s); err != nil {
			t.Fatal(err)
		}
		want[s.LBA] = s
	}
	for range 30000 {
		l := rng.Uint64N(60000)
		put(Slot{LBA: l, Loc: uint32(l), CRC: 1})
	}
	if err := st.Checkpoint(nil); err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		st, _, err := Open(dev, lay, 8)
		if err != nil {
			t.Fatal(err)
		}
		tr = st.Tree(2)
		for range 20 { // some leaves held, some cached
			put(Slot{LBA: rng.Uint64N(60000), Loc: 2})
			if _, _, err := tr.Get(rng.Uint64N(60000)); err != nil {
				t.Fatal(err)
			}
		}
		n := tr.Leaves()
		keys := make([]Key, 0, 3000)
		var batch []Slot
		for range 3000 {
			l := rng.Uint64N(60000)
			batch = append(batch, Slot{LBA: l, Loc: uint32(l) + 3, CRC: uint32(round), Epoch: uint64(round)})
			keys = append(keys, Key{LBA: l})
		}
		r0 := dev.n
		if err := tr.Hold(keys); err != nil {
			t.Fatal(err)
		}
		held := dev.n - r0
		if held*4 > int64(n) {
			t.Fatalf("Hold: %d reads for the leaves of %d keys (%d leaves)", held, len(keys), n)
		}
		r0 = dev.n
		for _, s := range batch {
			put(s)
		}
		if d := dev.n - r0; d != 0 {
			t.Fatalf("putting a held batch read %d pages", d)
		}
		// Deletes of a held batch (rebalancing may read siblings).
		keys = keys[:0]
		var dels []uint64
		for l := range want {
			if rng.IntN(6) == 0 {
				dels = append(dels, l)
				keys = append(keys, Key{LBA: l})
			}
		}
		if err := tr.Hold(keys); err != nil {
			t.Fatal(err)
		}
		for _, l := range dels {
			if _, ok, err := tr.Delete(l); err != nil || !ok {
				t.Fatalf("delete %d: %t %v", l, ok, err)
			}
			delete(want, l)
		}
		if err := tr.Check(); err != nil {
			t.Fatal(err)
		}
		if err := st.Checkpoint(nil); err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: %d leaves, Hold read %d times for 3,000 keys", round, n, held)
	}
	st, _, err := Open(dev, lay, 8)
	if err != nil {
		t.Fatal(err)
	}
	tr = st.Tree(2)
	if err := tr.Check(); err != nil {
		t.Fatal(err)
	}
	got := 0
	err = tr.Ascend(0, func(s Slot) bool {
		if w, ok := want[s.LBA]; !ok || w != s {
			t.Fatalf("slot %+v, want %+v (%t)", s, w, ok)
		}
		got++
		return true
	})
	if err != nil || got != len(want) {
		t.Fatalf("%d slots of %d: %v", got, len(want), err)
	}

	k := tr.root.kids[len(tr.root.kids)/2]
	if k.node != nil {
		k = k.node.kids[0]
	}
	if err := mem.Corrupt(lay.pageOff(k.ptr.Page)+300, 1); err != nil {
		t.Fatal(err)
	}
	if err := tr.Hold([]Key{k.key}); !IsCorruption(err) {
		t.Fatalf("Hold of a damaged leaf: %v", err)
	}
}
