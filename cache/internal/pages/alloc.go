package pages

import (
	"errors"
	"fmt"
)

// ErrFull is returned when the page area has no free page.
var ErrFull = errors.New("pages: page area full")

func errorf(format string, args ...any) error { return fmt.Errorf("pages: "+format, args...) }

// Alloc hands out the page numbers of the page area. A page is free, in
// use (named by the durable root or written since for the next one), or
// released: named by the durable root but no longer by the trees in
// memory. A released page becomes free only when a root that does not
// name it is durable (Durable): until then a crash recovers the durable
// root, which needs it. So the page area holds the pages of two roots at
// most, the durable one and the one being built. Open rebuilds it from the
// pages the durable root names (MarkUsed); nothing about it is stored.
type Alloc struct {
	n        uint32
	used     []uint64 // bit per page: in use or released
	released []uint32
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

// Durable frees the pages released before the root just made durable
// was built (they are named by no root a recovery could use).
func (a *Alloc) Durable(upto int) {
	for _, p := range a.released[:upto] {
		a.used[p/64] &^= 1 << (p % 64)
		a.nused--
	}
	a.released = append(a.released[:0], a.released[upto:]...)
}

// Released returns how many pages wait for a durable root.
func (a *Alloc) Released() int { return len(a.released) }

// Used returns the pages in use or released.
func (a *Alloc) Used() int { return a.nused }

// Pages returns the size of the page area in pages.
func (a *Alloc) Pages() uint32 { return a.n }
