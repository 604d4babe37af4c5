package cache

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// leafGateDev is an asyncMem whose synchronous reads of [lo, hi) (the
// page area) wait, while armed, until release is closed; started is
// closed when the first such read begins waiting. Each such read is
// counted, and counted in locked if free (set by the test) says the
// set's mutex is held as it begins.
type leafGateDev struct {
	*asyncMem
	lo, hi        int64
	armed         atomic.Bool
	free          func() bool
	reads, locked atomic.Int64
	once          sync.Once
	started       chan struct{}
	release       chan struct{}
}

func (d *leafGateDev) ReadAt(p []byte, off int64) (int, error) {
	if d.armed.Load() && off < d.hi && off+int64(len(p)) > d.lo {
		d.reads.Add(1)
		if !d.free() {
			d.locked.Add(1)
		}
		d.once.Do(func() { close(d.started) })
		<-d.release
	}
	return d.asyncMem.ReadAt(p, off)
}

// TestLeafLoadWithoutSetMu: in a lazily opened set, a client read, a
// write into the cache, a write of zeroes, eviction's index walk (of a
// set written back) and a batch of epoch-order writeback that need index
// leaves not resident read them from the cache device without holding
// Set.mu. While
// that read is held at the device, Set.mu is free and a read of a block
// whose leaf is resident is served (synchronously and by StartReadAt);
// once released, the held operation completes having read the leaf once
// (the load under Set.mu takes the page read without it), and the set
// holds what was written. StartReadAt declines a block whose leaf is not
// resident without reading anything.
func TestLeafLoadWithoutSetMu(t *testing.T) {
	const bs, nb, nblk = 32 << 10, 400, 3000
	knobs := testingKnobs{noBackground: true, fixedJournal: true}
	mem, specs, m := writtenLazySet(t, nb, bs, nblk, 21, knobs)
	sb, err := ReadSuperblock(mem)
	if err != nil {
		t.Fatal(err)
	}
	backImg := specs[0].Dev.(*device.Mem)
	// The same set written back (for eviction, which takes clean buckets).
	cleanMem, cleanBack := memCopy(t, mem), memCopy(t, backImg)
	s, err := Open(cleanMem, []BackingSpec{{Name: "a", Dev: cleanBack}}, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	for _, op := range []string{"read", "write", "zeroes", "eviction", "writeback"} {
		t.Run(op, func(t *testing.T) {
			img, back := memCopy(t, mem), memCopy(t, backImg)
			if op == "eviction" {
				img, back = memCopy(t, cleanMem), memCopy(t, cleanBack)
			}
			dev := &leafGateDev{asyncMem: &asyncMem{Mem: img}, lo: sb.CkptOff[0], hi: sb.CkptOff[0] + 2*sb.CkptLen,
				started: make(chan struct{}), release: make(chan struct{})}
			s, err := Open(dev, []BackingSpec{{Name: "a", Dev: back}}, OpenOptions{testing: knobs})
			if err != nil {
				t.Fatal(err)
			}
			var releaseOnce sync.Once
			release := func() { releaseOnce.Do(func() { close(dev.release) }) }
			defer func() {
				release()
				s.crashStop()
			}()
			if s.pg.lazy == nil {
				t.Fatal("the clean Open was not lazy")
			}
			// No background goroutine runs (noBackground), and the
			// test takes s.mu only while no gated read can begin: if
			// anyone holds s.mu as a leaf's read begins, it is the
			// operation reading it.
			dev.free = func() bool {
				if !s.mu.TryLock() {
					return false
				}
				s.mu.Unlock()
				return true
			}
			lm := &lazyModel{t: t, want: map[int64]uint32{}, seq: m.seq}
			for b, seq := range m.want {
				lm.want[b] = seq
			}
			v, _ := s.Volume("a")
			refs, err := s.pg.st.Tree(0).LeafRefs()
			if err != nil {
				t.Fatal(err)
			}
			if len(refs) < 8 {
				t.Fatalf("%d leaves: too few for the test", len(refs))
			}
			// A block of the second leaf (made resident) and one of a
			// leaf in the middle (not resident).
			in := func(k int) int64 {
				for b := int64(refs[k].Key.LBA); b < int64(refs[k+1].Key.LBA); b++ {
					if _, ok := lm.want[b]; ok {
						return b
					}
				}
				t.Fatalf("no block written in leaf %d", k)
				return 0
			}
			res, cold := in(1), in(len(refs)/2)
			buf := make([]byte, blockSize)
			if err := v.ReadAt(buf, res*blockSize); err != nil {
				t.Fatal(err)
			}
			reads, loads := s.pg.lazy.reads.Load(), v.idx.Tree.Faults()
			if started, _ := startRead(v, buf, cold*blockSize); started {
				t.Fatal("StartReadAt started a read of a block whose index leaf is not resident")
			}
			if n := s.pg.lazy.reads.Load() - reads; n != 0 {
				t.Fatalf("StartReadAt of a block whose leaf is not resident read %d leaves", n)
			}

			dev.armed.Store(true)
			var wrote uint32
			done := make(chan error, 1)
			go func() {
				switch op {
				case "read":
					done <- v.ReadAt(make([]byte, blockSize), cold*blockSize)
				case "write":
					b := make([]byte, blockSize)
					wrote = lm.seq + 1
					b[0], b[1], b[2], b[3] = byte(wrote), byte(wrote>>8), byte(wrote>>16), 1
					done <- v.WriteAt(b, cold*blockSize, false)
				case "zeroes":
					done <- v.WriteZeroes(cold*blockSize, blockSize, false, false, false)
				case "writeback":
					// One batch of the background loop: the oldest
					// epoch, then a scan from the cursor.
					if _, err := s.writebackSweep(v, 1<<20); err != nil {
						done <- err
						return
					}
					done <- s.Flush()
				case "eviction":
					if !s.evictOne() {
						done <- errors.New("eviction freed no bucket")
						return
					}
					done <- s.err()
				}
			}()
			<-dev.started
			// The operation is waiting for a leaf's page at the device.
			if !dev.free() {
				t.Fatalf("%s of a block whose index leaf is not resident holds Set.mu while it reads the leaf", op)
			}
			if err := v.ReadAt(buf, res*blockSize); err != nil {
				t.Fatal(err)
			}
			if seq := lm.want[res]; !bytes.Equal(buf[:4], []byte{byte(seq), byte(seq >> 8), byte(seq >> 16), 1}) {
				t.Fatalf("block %d read while a leaf load was held: %x, want write %d", res, buf[:4], seq)
			}
			if started, err := startRead(v, buf, res*blockSize); !started || err != nil {
				t.Fatalf("StartReadAt of a resident hit while a leaf load was held: started %v, %v", started, err)
			}
			release()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			// Every leaf read once, without s.mu: the load under it
			// took the page read before. (The page area's reads can
			// be more than the leaves': eviction's own.)
			n, loaded, leafReads := dev.reads.Load(), v.idx.Tree.Faults()-loads, s.pg.lazy.reads.Load()-reads
			t.Logf("%s: %d leaves loaded, %d leaf reads, %d pages read (%d with Set.mu held)", op, loaded, leafReads, n, dev.locked.Load())
			if dev.locked.Load() != 0 || leafReads != loaded || n < int64(leafReads) || loaded == 0 {
				t.Fatalf("the %s loaded %d leaves, read %d leaves and %d pages, %d of them with Set.mu held; want each leaf read once, without it",
					op, loaded, leafReads, n, dev.locked.Load())
			}
			switch op {
			case "write":
				lm.seq = wrote
				lm.want[cold] = wrote
			case "zeroes":
				lm.want[cold] = 0
			}
			if s.Failed() != nil {
				t.Fatal(errors.Join(errors.New("the set failed over"), s.Failed()))
			}
			lm.verify(v)
			if err := s.Check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
