package pages

import (
	"fmt"
	"math"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// The bucket table: one summary per bucket of the cache device, resident,
// stored as table pages of the page area under a directory of inner pages
// and written copy-on-write like the trees, so a checkpoint writes the
// table pages holding a bucket that changed since the last one (and the
// directory pages above them), not the table.
//
// A table page (kind 3, level 0, tree TableTree) holds records
// [i*TableCap, (i+1)*TableCap) of the table (the last page fewer), 24
// bytes each:
//
//	gen u32 | live u16 | dirty u16 | fill u16 | 0 u16 | atime u32 | oldest dirty epoch u64
//
// The directory is inner pages of the same format as the trees' (tree
// TableTree): a child's key is the first bucket under it, its bound the
// oldest dirty epoch of its buckets (MaxUint64: none). Its shape follows
// from the bucket count, which the root records (RootTree.Count), so Open
// verifies every child is the page it expects.
const (
	KindTable = 3

	TableRec = 24
	TableCap = (PageSize - HdrSize) / TableRec // 168

	// TableTree is the tree number of the bucket table in a root and in
	// its pages; no volume has it.
	TableTree = math.MaxUint16
)

// Bucket is one bucket's summary.
type Bucket struct {
	Gen    uint32 // the bucket's generation: entries naming another are dead
	Live   uint16 // blocks named by an entry
	Dirty  uint16 // of them dirty
	Fill   uint16 // blocks handed out
	Atime  uint32 // last access, in the engine's coarse clock
	Oldest uint64 // flush epoch of the oldest dirty block; 0 when none
}

func recOff(i int) int { return HdrSize + i*TableRec }

func (p *Page) rec(i int) Bucket {
	b := p[recOff(i) : recOff(i)+TableRec : recOff(i)+TableRec]
	return Bucket{Gen: le.Uint32(b[0:]), Live: le.Uint16(b[4:]), Dirty: le.Uint16(b[6:]), Fill: le.Uint16(b[8:]),
		Atime: le.Uint32(b[12:]), Oldest: le.Uint64(b[16:])}
}

func (p *Page) setRec(i int, r Bucket) {
	b := p[recOff(i) : recOff(i)+TableRec : recOff(i)+TableRec]
	le.PutUint32(b[0:], r.Gen)
	le.PutUint16(b[4:], r.Live)
	le.PutUint16(b[6:], r.Dirty)
	le.PutUint16(b[8:], r.Fill)
	le.PutUint16(b[10:], 0)
	le.PutUint32(b[12:], r.Atime)
	le.PutUint64(b[16:], r.Oldest)
}

func (b Bucket) agg() uint64 {
	if b.Dirty == 0 {
		return math.MaxUint64
	}
	return b.Oldest
}

// Table is the resident bucket table and where its pages are. Guarded by
// the caller's lock, as the Store.
type Table struct {
	st   *Store
	recs []Bucket
	// levels[0] are the table pages, levels[l] the directory pages of
	// level l; the last level has one page, the root.
	levels [][]tnode
	ndirty int // table pages changed since the last checkpoint
}

type tnode struct {
	ptr   Ptr // Gen 0: not written since it changed
	agg   uint64
	dirty bool
}

// tableShape returns the page count of each level of a table of n
// buckets: table pages, then directory levels up to a single root.
func tableShape(n int) []int {
	w := []int{(n + TableCap - 1) / TableCap}
	for {
		up := (w[len(w)-1] + InnerCap - 1) / InnerCap
		w = append(w, up)
		if up == 1 {
			return w
		}
	}
}

func newTable(st *Store, n int) *Table {
	t := &Table{st: st, recs: make([]Bucket, n)}
	for _, w := range tableShape(n) {
		lv := make([]tnode, w)
		for i := range lv {
			lv[i] = tnode{dirty: true, agg: math.MaxUint64}
		}
		t.levels = append(t.levels, lv)
	}
	t.ndirty = len(t.levels[0])
	return t
}

// Table returns the bucket table, creating one of n buckets (all zero,
// every page to be written at the next checkpoint) if the store has none.
// A table of another size is an error (its size is fixed at format).
func (st *Store) Table(n int) (*Table, error) {
	if st.table != nil {
		if len(st.table.recs) != n {
			return nil, errorf("bucket table of %d buckets, asked for %d", len(st.table.recs), n)
		}
		return st.table, nil
	}
	if n <= 0 || n > math.MaxUint32 {
		return nil, errorf("bucket table of %d buckets", n)
	}
	st.table = newTable(st, n)
	return st.table, nil
}

// Len returns the number of buckets.
func (t *Table) Len() int { return len(t.recs) }

// Get returns bucket i's summary.
func (t *Table) Get(i int) Bucket { return t.recs[i] }

// Dirty returns the number of table pages changed since the last
// checkpoint.
func (t *Table) Dirty() int { return t.ndirty }

// Set changes bucket i's summary. The first change of a table page since
// the last checkpoint releases its page and the directory pages above it.
func (t *Table) Set(i int, b Bucket) {
	if t.recs[i] == b {
		return
	}
	t.recs[i] = b
	j := i / TableCap
	for l := range t.levels {
		n := &t.levels[l][j]
		if n.dirty {
			break // and so is every page above it
		}
		n.dirty = true
		t.st.alloc.Release(n.ptr.Page)
		n.ptr = Ptr{}
		if l == 0 {
			t.ndirty++
		}
		j /= InnerCap
	}
}

// flush writes the changed table and directory pages through w and
// returns the root's entry.
func (t *Table) flush(w *pageWriter) (RootTree, error) {
	gen, nonce := w.gen, w.st.lay.Nonce
	for l, lv := range t.levels {
		for j := range lv {
			n := &lv[j]
			if !n.dirty {
				continue
			}
			pg := new(Page)
			if l == 0 {
				pg.Init(KindTable, 0, TableTree)
				lo, hi := j*TableCap, min((j+1)*TableCap, len(t.recs))
				n.agg = math.MaxUint64
				for i := lo; i < hi; i++ {
					pg.setRec(i-lo, t.recs[i])
					n.agg = min(n.agg, t.recs[i].agg())
				}
				pg.setCount(hi - lo)
				t.ndirty--
			} else {
				pg.Init(KindInner, uint8(l), TableTree)
				below := t.levels[l-1]
				lo, hi := j*InnerCap, min((j+1)*InnerCap, len(below))
				n.agg = math.MaxUint64
				for c := lo; c < hi; c++ {
					pg.AppendChild(Child{Key: Key{LBA: t.firstBucket(l-1, c)}, Ptr: below[c].ptr, Agg: below[c].agg})
					n.agg = min(n.agg, below[c].agg)
				}
			}
			p, err := w.st.alloc.Alloc()
			if err != nil {
				return RootTree{}, err
			}
			n.ptr = Ptr{Page: p, Gen: gen, CRC: pg.Seal(p, gen, nonce)}
			n.dirty = false
			w.pending = append(w.pending, pendingPage{p, pg})
		}
	}
	top := len(t.levels) - 1
	r := t.levels[top][0]
	return RootTree{ID: TableTree, Level: uint8(top), Root: r.ptr, Count: uint64(len(t.recs)), Agg: r.agg}, nil
}

// firstBucket returns the first bucket under page j of level l.
func (t *Table) firstBucket(l, j int) uint64 {
	for range l {
		j *= InnerCap
	}
	return uint64(j) * TableCap
}

// loadTable reads the table a root names: its directory and every table
// page (the table is resident), each verified against its parent and its
// place in the shape the bucket count gives, every page marked in use and
// the directory pages' generations recorded in inner.
func (st *Store) loadTable(rt RootTree, inner map[uint32]uint64) (*Table, error) {
	if rt.Count == 0 || rt.Count > math.MaxUint32 {
		return nil, ondisk.Corruptf("index root", -1, PageSize, "bucket table of %d buckets", rt.Count)
	}
	t := &Table{st: st, recs: make([]Bucket, rt.Count)}
	shape := tableShape(int(rt.Count))
	if int(rt.Level) != len(shape)-1 {
		return nil, ondisk.Corruptf("index root", -1, PageSize, "bucket table of %d buckets with a directory of %d levels, not %d", rt.Count, rt.Level, len(shape)-1)
	}
	t.levels = make([][]tnode, len(shape))
	for l, w := range shape {
		t.levels[l] = make([]tnode, w)
	}
	top := len(shape) - 1
	t.levels[top][0] = tnode{ptr: rt.Root, agg: rt.Agg}
	for l := top; l >= 0; l-- {
		for j := range t.levels[l] {
			n := &t.levels[l][j]
			if err := st.alloc.MarkUsed(n.ptr.Page); err != nil {
				return nil, err
			}
			kind := uint8(KindInner)
			if l == 0 {
				kind = KindTable
			}
			pg, err := st.readPage(n.ptr, kind, uint8(l), TableTree)
			if err != nil {
				return nil, err
			}
			if l > 0 {
				inner[n.ptr.Page] = n.ptr.Gen
			}
			off := st.lay.pageOff(n.ptr.Page)
			if l == 0 {
				lo, hi := j*TableCap, min((j+1)*TableCap, len(t.recs))
				if pg.Count() != hi-lo {
					return nil, tableCorrupt(off, n.ptr.Page, "table page %d holds %d buckets, expected %d", j, pg.Count(), hi-lo)
				}
				for i := lo; i < hi; i++ {
					t.recs[i] = pg.rec(i - lo)
				}
				continue
			}
			below := t.levels[l-1]
			lo, hi := j*InnerCap, min((j+1)*InnerCap, len(below))
			if pg.Count() != hi-lo {
				return nil, tableCorrupt(off, n.ptr.Page, "directory page of level %d holds %d children, expected %d", l, pg.Count(), hi-lo)
			}
			for c := lo; c < hi; c++ {
				ch := pg.Child(c - lo)
				if ch.Key != (Key{LBA: t.firstBucket(l-1, c)}) {
					return nil, tableCorrupt(off, n.ptr.Page, "directory child %d keyed %d, expected %d", c-lo, ch.Key.LBA, t.firstBucket(l-1, c))
				}
				below[c] = tnode{ptr: ch.Ptr, agg: ch.Agg}
			}
		}
	}
	return t, nil
}

func tableCorrupt(off int64, page uint32, format string, args ...any) error {
	return ondisk.Corruptf("index page", off, PageSize, "bucket table page %d: %s", page, fmt.Sprintf(format, args...))
}
