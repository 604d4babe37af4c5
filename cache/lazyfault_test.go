package cache

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// leafFailDev fails every read overlapping [lo, hi) while armed (an index
// leaf's page).
type leafFailDev struct {
	*device.Mem
	lo, hi int64
	armed  atomic.Bool
	failed atomic.Int64
}

var errLeafRead = errors.New("injected read error of an index leaf's page")

func (d *leafFailDev) ReadAt(p []byte, off int64) (int, error) {
	if d.armed.Load() && off < d.hi && off+int64(len(p)) > d.lo {
		d.failed.Add(1)
		return 0, errLeafRead
	}
	return d.Mem.ReadAt(p, off)
}

// memCopy returns a new memory device holding what m holds.
func memCopy(t *testing.T, m *device.Mem) *device.Mem {
	t.Helper()
	p := make([]byte, m.Size())
	if _, err := m.ReadAt(p, 0); err != nil {
		t.Fatal(err)
	}
	c := device.NewMem(m.Size())
	if _, err := c.WriteAt(p, 0); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestLazyLeafFaultFailsOver: a lazily opened set one of whose leaves
// cannot be read (an I/O error, or a page that fails its checksum) fails
// over when any index walk meets that leaf, and none panics: a lookup (a
// client read), the dirty-range walk of a failover with another cause,
// eviction's walk, writeback's victim scan, Check, and a write into the
// leaf. After it the leaf's whole range is fenced (reads of its clean and
// dirty blocks are I/O errors, writes refused), blocks of other leaves
// are served as after any failover (clean ones from the backing device,
// dirty ones unreachable), and a reopen on the repaired device recovers
// every block written before (the one write into the bad leaf lost).
func TestLazyLeafFaultFailsOver(t *testing.T) {
	const bs, nb, nblk = 32 << 10, 400, 2000
	back := int64(4 * nblk * blockSize)
	_, mem, specs := pagedSet(t, nb, bs, back)
	knobs := testingKnobs{noBackground: true, fixedJournal: true}
	s, err := Open(mem, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	v, _ := s.Volume("a")
	m := &lazyModel{t: t, want: map[int64]uint32{}}
	rng := rand.New(rand.NewPCG(11, 12))
	for _, blk := range rng.Perm(nblk) {
		m.write(v, 2*int64(blk))
	}
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	dirty := map[int64]bool{}
	for blk := range nblk {
		if blk%4 == 0 {
			m.write(v, 2*int64(blk))
			dirty[2*int64(blk)] = true
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	sb, err := ReadSuperblock(mem)
	if err != nil {
		t.Fatal(err)
	}
	backImg := specs[0].Dev.(*device.Mem)

	// The leaf to break: one in the middle of the tree, its page and its
	// LBAs; blocks in it and in a leaf far from it, clean and dirty.
	s, err = Open(memCopy(t, mem), []BackingSpec{{Name: "a", Dev: memCopy(t, backImg)}}, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	refs, err := s.pg.st.Tree(0).LeafRefs()
	if err != nil {
		t.Fatal(err)
	}
	s.crashStop()
	k := len(refs) / 2
	lo, hi := refs[k].Key.LBA, refs[k+1].Key.LBA
	pageOff := pages.SetLayout(sb).Off + int64(2+refs[k].Ptr.Page)*pages.PageSize
	pick := func(from, to uint64, wantDirty bool) int64 {
		for b := int64(from); b < int64(to); b++ {
			if seq, ok := m.want[b]; ok && seq != 0 && dirty[b] == wantDirty {
				return b
			}
		}
		t.Fatalf("no %v block in [%d,%d)", wantDirty, from, to)
		return 0
	}
	cleanIn, dirtyIn := pick(lo, hi, false), pick(lo, hi, true)
	o := k / 4
	cleanOut, dirtyOut := pick(refs[o].Key.LBA, refs[o+1].Key.LBA, false), pick(refs[o].Key.LBA, refs[o+1].Key.LBA, true)

	cases := []struct {
		name string
		// walk meets the bad leaf and returns the error an operation
		// returned (nil if none did); the set must have failed over
		// after it.
		walk func(s *Set, v *Volume) error
	}{
		{"lookup", func(s *Set, v *Volume) error {
			return v.ReadAt(make([]byte, blockSize), cleanIn*blockSize)
		}},
		{"dirty ranges", func(s *Set, v *Volume) error {
			return s.failover(errors.New("injected failover"))
		}},
		{"eviction", func(s *Set, v *Volume) error {
			s.evictOne()
			return s.err()
		}},
		{"writeback", func(s *Set, v *Volume) error {
			sweepLogged(s, v, 1<<20)
			return s.Flush()
		}},
		{"check", func(s *Set, v *Volume) error {
			err := s.Check()
			if fe := (*index.FaultError)(nil); !errors.As(err, &fe) {
				return fmt.Errorf("check returned %v, want the leaf's fault", err)
			}
			return s.Flush()
		}},
		{"write", func(s *Set, v *Volume) error {
			b := make([]byte, blockSize)
			b[0] = 0xee
			if err := v.WriteAt(b, (dirtyIn+1)*blockSize, false); err != nil {
				return err
			}
			return s.Flush()
		}},
	}
	for _, kind := range []string{"io", "checksum"} {
		for _, c := range cases {
			t.Run(kind+"/"+c.name, func(t *testing.T) {
				img := memCopy(t, mem)
				dev := &leafFailDev{Mem: img, lo: pageOff, hi: pageOff + pages.PageSize}
				saved := make([]byte, pages.PageSize)
				if _, err := img.ReadAt(saved, pageOff); err != nil {
					t.Fatal(err)
				}
				if kind == "io" {
					dev.armed.Store(true)
				} else {
					junk := make([]byte, pages.PageSize)
					junk[100] = 1
					if _, err := img.WriteAt(junk, pageOff); err != nil {
						t.Fatal(err)
					}
				}
				bdev := memCopy(t, backImg)
				s, err := Open(dev, []BackingSpec{{Name: "a", Dev: bdev}}, OpenOptions{testing: knobs})
				if err != nil {
					t.Fatal(err)
				}
				if s.pg.lazy == nil {
					t.Fatal("the clean Open was not lazy")
				}
				v, _ := s.Volume("a")
				err = c.walk(s, v)
				failed := s.Failed()
				if failed == nil {
					t.Fatalf("%s over an unreadable leaf: the set did not fail over (the walk returned %v)", c.name, err)
				}
				var fe *index.FaultError
				if c.name != "dirty ranges" && !errors.As(failed, &fe) {
					t.Fatalf("the set failed over with %v, not the leaf's fault", failed)
				}
				buf := make([]byte, blockSize)
				for _, b := range []int64{cleanIn, dirtyIn} {
					if err := v.ReadAt(buf, b*blockSize); !errors.Is(err, ErrDirtyUnreachable) {
						t.Errorf("read of block %d (bad leaf [%d,%d), dirty %t) after failover: %v, want ErrDirtyUnreachable", b, lo, hi, dirty[b], err)
					}
				}
				if kind == "io" && dev.failed.Load() == 0 {
					t.Fatal("the leaf's page was never read")
				}
				// Dirty unless writeback wrote it back before the set
				// failed over.
				if err := v.ReadAt(buf, dirtyOut*blockSize); err != nil && !errors.Is(err, ErrDirtyUnreachable) {
					t.Errorf("read of dirty block %d of another leaf: %v", dirtyOut, err)
				} else if seq := m.want[dirtyOut]; err == nil && (buf[0] != byte(seq) || buf[1] != byte(seq>>8)) {
					t.Errorf("read of dirty block %d of another leaf: %x, want seq %d", dirtyOut, buf[:4], seq)
				}
				if err := v.WriteAt(buf, cleanIn*blockSize, false); !errors.Is(err, ErrDirtyUnreachable) {
					t.Errorf("write of clean block %d of the bad leaf after failover: %v, want it refused", cleanIn, err)
				}
				if err := v.ReadAt(buf, cleanOut*blockSize); err != nil {
					t.Errorf("read of clean block %d of another leaf: %v", cleanOut, err)
				} else if seq := m.want[cleanOut]; buf[0] != byte(seq) || buf[1] != byte(seq>>8) {
					t.Errorf("read of clean block %d of another leaf: %x, want seq %d", cleanOut, buf[:4], seq)
				}
				if err := s.Close(); err == nil {
					t.Error("Close of a failed set returned no error")
				}
				// Repaired: every block written before reads back.
				dev.armed.Store(false)
				if _, err := img.WriteAt(saved, pageOff); err != nil {
					t.Fatal(err)
				}
				s, err = Open(img, []BackingSpec{{Name: "a", Dev: bdev}}, OpenOptions{testing: knobs})
				if err != nil {
					t.Fatal(err)
				}
				defer s.crashStop()
				v, _ = s.Volume("a")
				m.verify(v)
				if err := s.Check(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}
