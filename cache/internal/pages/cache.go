package pages

// Cache is the bounded cache of clean leaf pages, by page number: at most
// Cap pages resident, replaced by CLOCK (a page found is marked
// referenced; the hand clears marks and takes the first page without one).
// Dirty pages are not in it: the tree holds them until the checkpoint that
// writes them hands them over, so the cache's bound is on what can be
// dropped and read again, and dirty pages count against the tree's own
// bound (Tree.Dirty). It does no I/O and is guarded by the caller's lock.
//
// Invariants (Check): len(slots) <= Cap; byPage maps exactly the slots'
// pages, each once.
type Cache struct {
	Cap    int
	slots  []cslot
	byPage map[uint32]int // page -> index in slots
	hand   int

	Hits, Misses, Evictions uint64
}

type cslot struct {
	page uint32
	buf  *Page
	ref  bool
}

// NewCache returns a cache of at most capPages pages (at least 1).
func NewCache(capPages int) *Cache {
	return &Cache{Cap: max(capPages, 1), byPage: make(map[uint32]int)}
}

// Get returns the resident page, marking it referenced.
func (c *Cache) Get(page uint32) (*Page, bool) {
	i, ok := c.byPage[page]
	if !ok {
		c.Misses++
		return nil, false
	}
	c.Hits++
	c.slots[i].ref = true
	return c.slots[i].buf, true
}

// Put makes buf the resident copy of page, evicting another page when the
// cache is full. The caller no longer changes buf (it is the page as on
// the device) unless it takes it back with Take. Buffers are never
// reused: a page returned by Get stays valid for its holder after it is
// evicted.
func (c *Cache) Put(page uint32, buf *Page) {
	if i, ok := c.byPage[page]; ok {
		c.slots[i].buf, c.slots[i].ref = buf, true
		return
	}
	if len(c.slots) < c.Cap {
		c.byPage[page] = len(c.slots)
		c.slots = append(c.slots, cslot{page: page, buf: buf})
		return
	}
	for {
		s := &c.slots[c.hand]
		if s.ref {
			s.ref = false
			c.hand = (c.hand + 1) % len(c.slots)
			continue
		}
		delete(c.byPage, s.page)
		c.Evictions++
		*s = cslot{page: page, buf: buf}
		c.byPage[page] = c.hand
		c.hand = (c.hand + 1) % len(c.slots)
		return
	}
}

// Take removes page from the cache and returns its buffer, for a change
// (copy-on-write: the changed page gets a new number at the next
// checkpoint).
func (c *Cache) Take(page uint32) (*Page, bool) {
	i, ok := c.byPage[page]
	if !ok {
		return nil, false
	}
	buf := c.slots[i].buf
	c.drop(i)
	return buf, true
}

// Drop forgets page (its page number is being freed).
func (c *Cache) Drop(page uint32) {
	if i, ok := c.byPage[page]; ok {
		c.drop(i)
	}
}

func (c *Cache) drop(i int) {
	delete(c.byPage, c.slots[i].page)
	last := len(c.slots) - 1
	if i != last {
		c.slots[i] = c.slots[last]
		c.byPage[c.slots[i].page] = i
	}
	c.slots = c.slots[:last]
	if c.hand >= len(c.slots) {
		c.hand = 0
	}
}

// Len returns the number of resident pages.
func (c *Cache) Len() int { return len(c.slots) }

// Check verifies the cache's invariants.
func (c *Cache) Check() error {
	if len(c.slots) > c.Cap || len(c.byPage) != len(c.slots) {
		return errorf("page cache: %d slots, %d mapped, cap %d", len(c.slots), len(c.byPage), c.Cap)
	}
	for i, s := range c.slots {
		if j, ok := c.byPage[s.page]; !ok || j != i || s.buf == nil {
			return errorf("page cache: slot %d (page %d) mapped to %d (%t)", i, s.page, j, ok)
		}
	}
	return nil
}
