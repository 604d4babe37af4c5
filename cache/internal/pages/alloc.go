package pages

import (
	"errors"
	"fmt"
	"slices"
)

// ErrFull is returned when the page area has no free page.
var ErrFull = errors.New("pages: page area full")

func errorf(format string, args ...any) error { return fmt.Errorf("pages: "+format, args...) }

// Alloc hands out the page numbers of the page area. A page is free, in
// use (named by the durable root or written since for the next one),
// released (named by the durable root but no longer by the trees in
// memory) or kept (named by the previous root, in the other root slot, and
// by neither the durable root nor the trees).
//
// The rule: a page is free only when no root either slot can hold names
// it. A page released while root g+1 is built (named by root g) is kept
// when g+1 is durable and free when g+2 is durable, which overwrites g's
// slot (Durable). So whatever a crash interrupts, and whichever root's
// slot is later found damaged, the root in the other slot has every page
// it names intact: Open may fall back to it, and can never fall back
// further (there are two slots). The page area holds the pages of the
// durable root, those the previous root alone names (the pages changed in
// the interval before the durable root) and those written for the next
// root (the pages changed since). Open rebuilds the allocation from the
// pages both roots name (MarkUsed, MarkKept); nothing about it is stored.
type Alloc struct {
	n        uint32
	used     []uint64 // bit per page: in use, released or kept
	released []uint32
	kept     []uint32
	cursor   uint32
	nused    int
}

// NewAlloc returns an allocator of n pages, all free.
func NewAlloc(n uint32) *Alloc {
	return &Alloc{n: n, used: make([]uint64, (n+63)/64)}
}

func (a *Alloc) isUsed(p uint32) bool { return a.used[p/64]&(1<<(p%64)) != 0 }

// MarkUsed records that the durable root names page p (Open). A page
// named twice, or out of the area, is corruption.
func (a *Alloc) MarkUsed(p uint32) error {
	if p >= a.n {
		return fmt.Errorf("%w: page %d beyond the page area (%d pages)", ErrCorrupt, p, a.n)
	}
	if a.isUsed(p) {
		return fmt.Errorf("%w: page %d named twice", ErrCorrupt, p)
	}
	a.used[p/64] |= 1 << (p % 64)
	a.nused++
	return nil
}

// Alloc returns a free page, now in use (next fit from the last one).
func (a *Alloc) Alloc() (uint32, error) {
	if a.nused >= int(a.n) {
		return 0, ErrFull
	}
	for range a.n {
		p := a.cursor
		a.cursor++
		if a.cursor == a.n {
			a.cursor = 0
		}
		if !a.isUsed(p) {
			a.used[p/64] |= 1 << (p % 64)
			a.nused++
			return p, nil
		}
	}
	return 0, ErrFull
}

// Release records that the trees no longer name page p; it is free once
// the next root is durable.
func (a *Alloc) Release(p uint32) { a.released = append(a.released, p) }

// MarkKept records that the previous root names page p (Open, after the
// durable root's pages are marked): a page not in use is kept until the
// next root is durable. It reports whether p was marked (false: the
// durable root names it too, or another page of the previous root did).
func (a *Alloc) MarkKept(p uint32) (bool, error) {
	if p >= a.n {
		return false, fmt.Errorf("%w: page %d beyond the page area (%d pages)", ErrCorrupt, p, a.n)
	}
	if a.isUsed(p) {
		return false, nil
	}
	a.used[p/64] |= 1 << (p % 64)
	a.nused++
	a.kept = append(a.kept, p)
	return true, nil
}

// Durable records that a new root is durable: the pages kept for the
// root its slot held are free, and the pages released before the new
// root was built (upto, counted when it was) are kept for it, now the
// previous root.
func (a *Alloc) Durable(upto int) {
	for _, p := range a.kept {
		a.used[p/64] &^= 1 << (p % 64)
		a.nused--
	}
	a.kept = append(a.kept[:0], a.released[:upto]...)
	a.released = append(a.released[:0], a.released[upto:]...)
}

// InUse reports whether page p is in use, released or kept (not free).
func (a *Alloc) InUse(p uint32) bool { return a.isUsed(p) }

// ReleasedPages returns the pages waiting for a durable root, in the
// order they were released (the caller must not change it).
func (a *Alloc) ReleasedPages() []uint32 { return a.released }

// Kept returns how many pages only the previous root names.
func (a *Alloc) Kept() int { return len(a.kept) }

// Released returns how many pages wait for a durable root.
func (a *Alloc) Released() int { return len(a.released) }

// Used returns the pages in use, released or kept.
func (a *Alloc) Used() int { return a.nused }

// Pages returns the size of the page area in pages.
func (a *Alloc) Pages() uint32 { return a.n }

// AreaPages is the page area a set of blocks cache blocks in buckets
// buckets needs, with trees trees (a volume slot's live entries and its
// superseded versions are two): whatever the order of changes, every page
// fits. The trees hold at most blocks slots together (a cache block is
// named once), in leaves at least minFill(LeafCap) full but one a tree,
// under inner pages at least minFill(InnerCap) full; the table is fixed.
// A checkpoint writes at most every page anew while the pages the durable
// root names and those the previous one named stay (Alloc): three times
// the pages in use.
func AreaPages(blocks, buckets int64, trees int) int64 {
	leaves := blocks/int64(minFill(LeafCap)) + int64(trees)
	inner := leaves/int64(minFill(InnerCap)) + int64(trees)*4
	table := buckets/TableCap + 1
	table += table/InnerCap + 3
	return 3*(leaves+inner+table) + 16
}

// TreeIDs returns the numbers of the trees the store holds, in order.
func (st *Store) TreeIDs() []uint16 {
	ids := make([]uint16, 0, len(st.trees))
	for id := range st.trees {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}
