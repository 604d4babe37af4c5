package cache

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
)

// countingDev counts the bytes written into [lo, hi).
type countingDev struct {
	*device.Mem
	lo, hi int64
	n      int64
}

func (d *countingDev) WriteAt(p []byte, off int64) (int, error) {
	if off < d.hi && off+int64(len(p)) > d.lo {
		d.n += min(off+int64(len(p)), d.hi) - max(off, d.lo)
	}
	return d.Mem.WriteAt(p, off)
}

// pagedSet formats and opens a set with index pages over memory devices:
// nb buckets of bs, one volume of back bytes.
func pagedSet(t *testing.T, nb, bs, back int64) (*Set, *device.Mem, []BackingSpec) {
	t.Helper()
	mem := device.NewMem(cacheSizeForPaged(nb, bs, minJournalLen, 1, true))
	specs := []BackingSpec{{Name: "a", Dev: device.NewMem(back)}}
	if _, err := Format(mem, specs, FormatOptions{BucketSize: bs, JournalSize: minJournalLen, IndexPages: true}); err != nil {
		t.Fatal(err)
	}
	return nil, mem, specs
}

func forceCheckpoint(t *testing.T, s *Set) {
	t.Helper()
	s.commitMu.Lock()
	err := s.commitLocked(true)
	s.commitMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
}

// TestPagedCheckpointWritesWhatChanged: with 6,000 blocks cached, a
// checkpoint after k random 4 KiB overwrites writes O(k) pages of the
// page area (counted at the device), not the index.
func TestPagedCheckpointWritesWhatChanged(t *testing.T) {
	const bs, nb, nblk = 32 << 10, 1000, 6000
	_, mem, specs := pagedSet(t, nb, bs, nblk*blockSize)
	sb, err := ReadSuperblock(mem)
	if err != nil {
		t.Fatal(err)
	}
	dev := &countingDev{Mem: mem, lo: sb.CkptOff[0], hi: sb.CkptOff[0] + 2*sb.CkptLen}
	s, err := Open(dev, specs, OpenOptions{testing: testingKnobs{noBackground: true, fixedJournal: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.crashStop()
	v, _ := s.Volume("a")
	// 4 KiB writes in random order (sequential runs may bypass the
	// cache).
	b := make([]byte, blockSize)
	for _, blk := range rand.New(rand.NewPCG(5, 6)).Perm(nblk) {
		b[0], b[1] = byte(blk), byte(blk>>8)
		if err := v.WriteAt(b, int64(blk)*blockSize, false); err != nil {
			t.Fatal(err)
		}
	}
	forceCheckpoint(t, s)
	al := s.pg.st.Alloc()
	full := int64(al.Used() - al.Kept() - al.Released())
	t.Logf("%d cached blocks: the durable root names %d pages", nblk, full)
	if full < nblk/176 {
		t.Fatalf("the root names %d pages, fewer than the %d leaves %d entries need", full, nblk/176, nblk)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, k := range []int{0, 1, 10, 100} {
		for range k {
			b[0] = byte(rng.Uint32())
			if err := v.WriteAt(b, int64(rng.IntN(nblk))*blockSize, false); err != nil {
				t.Fatal(err)
			}
		}
		dev.n = 0
		forceCheckpoint(t, s)
		got := dev.n / blockSize
		t.Logf("after %d overwrites: %d pages (root included)", k, got)
		// A changed leaf of the live tree and of the superseded
		// versions, the inner pages above them, the table pages of
		// buckets opened, and the root.
		if limit := 3*int64(k) + 6; got > limit {
			t.Fatalf("after %d overwrites the checkpoint wrote %d pages, more than %d", k, got, limit)
		}
		if k == 0 && got != 1 {
			t.Fatalf("a checkpoint with nothing changed wrote %d pages, want the root only", got)
		}
	}
	// What the pages hold is what recovery finds.
	if err := s.Flush(); err != nil {
		t.Fatal(err)
	}
	s.crashStop()
	s2, err := Open(mem, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.crashStop()
	if err := s2.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestPagedCorruptRoot: damage to the index roots or pages of a paged set
// is a corruption error at Open, never a panic, and a set with one root
// slot destroyed opens from the other.
func TestPagedCorruptRoot(t *testing.T) {
	_, mem, specs := pagedSet(t, 64, 16<<10, 512*blockSize)
	s, err := Open(mem, specs, OpenOptions{testing: testingKnobs{noBackground: true, fixedJournal: true}})
	if err != nil {
		t.Fatal(err)
	}
	v, _ := s.Volume("a")
	rng := rand.New(rand.NewPCG(3, 4))
	b := make([]byte, 8*blockSize)
	for range 40 {
		b[0] = byte(rng.Uint32())
		if err := v.WriteAt(b, int64(rng.IntN(500))*blockSize, false); err != nil {
			t.Fatal(err)
		}
		if rng.IntN(4) == 0 {
			forceCheckpoint(t, s)
		}
	}
	forceCheckpoint(t, s)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	sb, err := ReadSuperblock(mem)
	if err != nil {
		t.Fatal(err)
	}
	lay := pages.SetLayout(sb)
	img := make([]byte, mem.Size())
	if _, err := mem.ReadAt(img, 0); err != nil {
		t.Fatal(err)
	}
	area := img[lay.Off : lay.Off+lay.Len()]
	open := func(what string, d []byte) error {
		m := device.NewMem(int64(len(d)))
		if _, err := m.WriteAt(d, 0); err != nil {
			t.Fatal(err)
		}
		s, err := Open(m, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err == nil {
			s.crashStop()
		} else if !IsCorruption(err) {
			t.Fatalf("%s: untyped error %v", what, err)
		}
		return err
	}
	if err := open("intact", img); err != nil {
		t.Fatalf("intact image: %v", err)
	}
	// Both roots destroyed: corruption.
	d := append([]byte(nil), img...)
	for i := range 2 * 4096 {
		d[lay.Off+int64(i)] = byte(rng.Uint32())
	}
	if err := open("both roots", d); err == nil {
		t.Fatal("opened with both roots destroyed")
	}
	// Either root destroyed: the other opens (its pages are intact).
	opened := 0
	for slot := range int64(2) {
		d := append([]byte(nil), img...)
		clear(d[lay.Off+slot*4096 : lay.Off+(slot+1)*4096])
		if open("one root", d) == nil {
			opened++
		}
	}
	if opened != 2 {
		t.Fatalf("with one root slot zeroed, %d of 2 images opened", opened)
	}
	// Random damage. (a) A byte run of a written page (not zero): the
	// newest root's pages are refused, the previous root's only lose
	// the fallback, unused ones change nothing. (b) One root slot
	// damaged and the other zeroed: no valid root, always refused.
	var written []int64
	for p := int64(2); p < int64(lay.Pages)+2; p++ {
		pg := area[p*4096 : (p+1)*4096]
		for _, c := range pg {
			if c != 0 {
				written = append(written, p)
				break
			}
		}
	}
	refused := 0
	for i := range 200 {
		d := append([]byte(nil), img...)
		a := d[lay.Off : lay.Off+lay.Len()]
		var at int
		if i%2 == 0 {
			p := written[rng.IntN(len(written))]
			at = int(p*4096) + rng.IntN(4096-8)
		} else {
			slot := rng.IntN(2)
			at = slot*4096 + rng.IntN(4096-8)
			clear(a[(1-slot)*4096 : (2-slot)*4096])
		}
		for j := range 1 + rng.IntN(8) {
			a[at+j] ^= byte(1 + rng.IntN(255))
		}
		err := open("damaged", d)
		if err != nil {
			refused++
			var ce *CorruptionError
			if !errors.As(err, &ce) {
				t.Fatalf("damage at %d: %v is not a CorruptionError", at, err)
			}
		} else if i%2 == 1 {
			t.Fatalf("damage at %d of one root, the other zeroed: opened", at)
		}
	}
	t.Logf("200 damaged images (%d written pages): %d refused as corrupt", len(written), refused)
	if refused <= 100 {
		t.Fatal("no damaged page was refused")
	}
}
