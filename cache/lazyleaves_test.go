package cache

import (
	"bytes"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// readCountingDev counts the bytes read from [lo, hi) (the page area).
type readCountingDev struct {
	*device.Mem
	lo, hi int64
	n      atomic.Int64
}

func (d *readCountingDev) ReadAt(p []byte, off int64) (int, error) {
	if off < d.hi && off+int64(len(p)) > d.lo {
		d.n.Add(min(off+int64(len(p)), d.hi) - max(off, d.lo))
	}
	return d.Mem.ReadAt(p, off)
}

// lazyModel writes and reads back a volume's blocks, each block's first
// bytes naming what was last written there.
type lazyModel struct {
	t    *testing.T
	want map[int64]uint32
	seq  uint32
}

func (m *lazyModel) write(v *Volume, blk int64) {
	m.t.Helper()
	m.seq++
	b := make([]byte, blockSize)
	b[0], b[1], b[2], b[3] = byte(m.seq), byte(m.seq>>8), byte(m.seq>>16), 1
	if err := v.WriteAt(b, blk*blockSize, false); err != nil {
		m.t.Fatal(err)
	}
	m.want[blk] = m.seq
}

// zero zeroes n blocks from blk (dropping them from the cache: the
// page trees remove their slots and rebalance their leaves).
func (m *lazyModel) zero(v *Volume, blk, n int64) {
	m.t.Helper()
	if err := v.WriteZeroes(blk*blockSize, n*blockSize, false, false, false); err != nil {
		m.t.Fatal(err)
	}
	for b := blk; b < blk+n; b++ {
		if _, ok := m.want[b]; ok {
			m.want[b] = 0
		}
	}
}

func (m *lazyModel) verify(v *Volume) {
	m.t.Helper()
	b := make([]byte, blockSize)
	for blk, seq := range m.want {
		if err := v.ReadAt(b, blk*blockSize); err != nil {
			m.t.Fatal(err)
		}
		w := []byte{byte(seq), byte(seq >> 8), byte(seq >> 16), 1}
		if seq == 0 {
			w = []byte{0, 0, 0, 0}
		}
		if !bytes.Equal(b[:4], w) {
			m.t.Fatalf("block %d: %x, want %x", blk, b[:4], w)
		}
	}
}

// writtenLazySet is a paged set of nb buckets of bs bytes whose volume
// "a" had every even block below 2*nblk written once, in the order
// rand.NewPCG(seed, seed+1) gives, through a set opened with knobs, and
// was closed cleanly; m holds what was written.
func writtenLazySet(t *testing.T, nb, bs, nblk int64, seed uint64, knobs testingKnobs) (*device.Mem, []BackingSpec, *lazyModel) {
	t.Helper()
	_, mem, specs := pagedSet(t, nb, bs, 4*nblk*blockSize)
	s, err := Open(mem, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	v, _ := s.Volume("a")
	m := &lazyModel{t: t, want: map[int64]uint32{}}
	for _, blk := range rand.New(rand.NewPCG(seed, seed+1)).Perm(int(nblk)) {
		m.write(v, 2*int64(blk))
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return mem, specs, m
}

// TestLazyOpenReadsNoLeaf: a paged set opened after a clean shutdown
// reads its root, inner pages and bucket table and no leaf of its
// volume's tree (counted at the device and by the loader); the leaves
// load as reads need them, the data read is what was written, and the
// index checks out once every leaf is loaded. Then, with a cache of two
// loaded leaves, overwrites and checkpoints change the page trees under
// stubs not loaded since (their pages released and reused: the
// checkpoint pins them), and the set still reads back what was written,
// after another clean restart too.
func TestLazyOpenReadsNoLeaf(t *testing.T) {
	const bs, nb, nblk = 32 << 10, 1000, 6000
	knobs := testingKnobs{noBackground: true, fixedJournal: true}
	mem, specs, m := writtenLazySet(t, nb, bs, nblk, 5, knobs)
	sb, err := ReadSuperblock(mem)
	if err != nil {
		t.Fatal(err)
	}

	dev := &readCountingDev{Mem: mem, lo: sb.CkptOff[0], hi: sb.CkptOff[0] + 2*sb.CkptLen}
	knobs.lazyLeafCap = 2
	s, err := Open(dev, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("panic: %v", p) // (s.mu may be held: no crashStop)
		}
		s.crashStop()
	}()
	if s.pg.lazy == nil {
		t.Fatal("the Open after a clean shutdown read every leaf")
	}
	tr := s.pg.st.Tree(0)
	leaves, read := tr.Leaves(), dev.n.Load()/blockSize
	t.Logf("%d cached blocks in %d leaves: Open read %d pages of the page area, loaded %d leaves", tr.Len(), leaves, read, s.pg.lazy.reads.Load())
	if s.pg.lazy.reads.Load() != 0 || read >= int64(leaves)/2 {
		t.Fatalf("Open read %d pages of the page area and loaded %d leaves, of %d leaves", read, s.pg.lazy.reads.Load(), leaves)
	}
	v, _ := s.Volume("a")
	m.verify(v)
	if n := s.pg.lazy.reads.Load(); n < uint64(leaves) {
		t.Fatalf("reading every block loaded %d leaves of %d (with a cache of 2)", n, leaves)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for range 8 {
		// 38 entries of a leaf (about 88 each) dropped: the page tree's
		// leaf falls under its fill bound (70) and merges with a
		// neighbour, whose stub the index tree (which merges under 45)
		// still has, not loaded since; its page is released.
		at := 2 * int64(rng.IntN(nblk-40))
		for b := at; b < at+76; b += 2 {
			m.zero(v, b, 1)
		}
		forceCheckpoint(t, s)
		// A few writes past the blocks written so far (into the last
		// leaves: no stub of the others is touched), each checkpoint
		// freeing what the one before last released.
		for range 3 {
			for range 10 {
				m.write(v, 2*nblk+int64(rng.IntN(2*nblk)))
			}
			forceCheckpoint(t, s)
		}
	}
	// As if every free page had been written since: a stub naming one
	// reads another page.
	al, lay := s.pg.st.Alloc(), pages.SetLayout(sb)
	for p := range al.Pages() {
		if !al.InUse(p) {
			if _, err := mem.WriteAt(make([]byte, blockSize), lay.Off+int64(2+p)*blockSize); err != nil {
				t.Fatal(err)
			}
		}
	}
	m.verify(v)
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(mem, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	if s.pg.lazy == nil {
		t.Fatal("the second clean Open read every leaf")
	}
	v, _ = s.Volume("a")
	m.verify(v)
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
}
