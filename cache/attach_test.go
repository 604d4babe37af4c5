package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// checkBlocks verifies the pattern opsWriteBlocks wrote (block 2i holds
// byte i+1) on r, a volume or a bare backing device.
func checkBlocks(t *testing.T, what string, r func(p []byte, off int64) error, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		p := make([]byte, blockSize)
		if err := r(p, int64(2*i)*blockSize); err != nil {
			t.Fatalf("%s: reading block %d: %v", what, 2*i, err)
		}
		if !bytes.Equal(p, bytes.Repeat([]byte{byte(i + 1)}, blockSize)) {
			t.Fatalf("%s: block %d holds %d, want %d", what, 2*i, p[0], i+1)
		}
	}
}

func devReader(d device.Device) func([]byte, int64) error {
	return func(p []byte, off int64) error { _, err := d.ReadAt(p, off); return err }
}

func TestDrainDirtyAndDetach(t *testing.T) {
	s, _, backs := newTestSet(t, 8, 64<<10, 4<<20, 4<<20)
	a, b := s.Volumes()[0], s.Volumes()[1]
	opsWriteBlocks(t, a, 20)
	opsWriteBlocks(t, b, 5)
	var seen []int64
	if err := a.DrainDirty(context.Background(), func(n int64) { seen = append(seen, n) }); err != nil {
		t.Fatal(err)
	}
	// Background writeback may have cleaned some blocks already.
	if a.DirtyBlocks() != 0 || b.DirtyBlocks() > 5 {
		t.Fatalf("after drain: a %d b %d dirty", a.DirtyBlocks(), b.DirtyBlocks())
	}
	if len(seen) < 2 || seen[0] > 20 || seen[len(seen)-1] != 0 {
		t.Errorf("progress: %v", seen)
	}
	removed := false
	if err := b.Detach(context.Background(), DetachOptions{BeforeRemove: func() error { removed = true; return nil }}); err != nil {
		t.Fatal(err)
	}
	if !removed {
		t.Error("BeforeRemove not called")
	}
	if _, ok := s.Volume("b"); ok || len(s.Volumes()) != 1 || len(s.Superblock().Backings) != 1 {
		t.Fatalf("b still in the set: %d volumes, superblock %+v", len(s.Volumes()), s.Superblock().Backings)
	}
	if err := b.WriteAt(make([]byte, blockSize), 0, false); !errors.Is(err, ErrDetached) {
		t.Fatalf("write after detach: %v, want ErrDetached", err)
	}
	if err := b.SetMode(Writeback); !errors.Is(err, ErrDetached) {
		t.Fatalf("set mode after detach: %v, want ErrDetached", err)
	}
	// The backing device alone holds every write.
	checkBlocks(t, "backing b", devReader(backs[1]), 5)
	checkBlocks(t, "volume a", a.ReadAt, 20)
}

func TestDrainDirtyCanceled(t *testing.T) {
	s, _, _ := newTestSet(t, 8, 64<<10, 4<<20)
	v := s.Volumes()[0]
	opsWriteBlocks(t, v, 3)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := v.DrainDirty(ctx, nil); err == nil {
		t.Fatal("drain with a canceled context succeeded")
	}
}

// TestAttachDetachReopen: attach, detach of a middle slot (free slot),
// reattach into it, with Close/Open in between; the data of every volume
// survives, and the checkpoint's volume count differs from the
// superblock's at several points.
func TestAttachDetachReopen(t *testing.T) {
	s, cdev, backs := newTestSet(t, 16, 64<<10, 4<<20, 4<<20)
	specs := []BackingSpec{{Name: "a", Dev: backs[0]}, {Name: "b", Dev: backs[1]}}
	opsWriteBlocks(t, s.Volumes()[0], 10)
	opsWriteBlocks(t, s.Volumes()[1], 6)
	c := device.NewMem(2 << 20)
	vc, err := s.Attach(BackingSpec{Name: "c", Dev: c, ID: "id-c", Path: "/dev/c"}, AttachOptions{Mode: Writethrough})
	if err != nil {
		t.Fatal(err)
	}
	if vc.Mode() != Writethrough || vc.Size() != 2<<20 {
		t.Fatalf("attached: mode %v size %d", vc.Mode(), vc.Size())
	}
	opsWriteBlocks(t, vc, 7)
	// Refusals: the name, the ID, a bad size.
	for _, sp := range []BackingSpec{{Name: "a", Dev: device.NewMem(1 << 20)}, {Name: "x", Dev: device.NewMem(1 << 20), ID: "id-c"}} {
		if _, err := s.Attach(sp, AttachOptions{}); !errors.Is(err, ErrExists) {
			t.Errorf("attach %s: %v, want ErrExists", sp.Name, err)
		}
	}
	if _, err := s.Attach(BackingSpec{Name: "z", Dev: device.NewMem(0)}, AttachOptions{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("attach of an empty device: %v, want ErrInvalid", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	specs = append(specs, BackingSpec{Name: "c", Dev: c, ID: "id-c"})
	s, err = Open(cdev, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vb, _ := s.Volume("b")
	if err := vb.Detach(context.Background(), DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	checkBlocks(t, "backing b", devReader(backs[1]), 6)
	sb := s.Superblock()
	if len(sb.Backings) != 3 || !sb.Backings[1].Free() {
		t.Fatalf("slot 1 not free: %+v", sb.Backings)
	}
	// Crash (no Close): the recovery reads a superblock with a free slot.
	s.crashStop()
	specs = []BackingSpec{specs[0], specs[2]}
	s, err = Open(cdev, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	va, _ := s.Volume("a")
	vc, _ = s.Volume("c")
	checkBlocks(t, "volume a", va.ReadAt, 10)
	checkBlocks(t, "volume c", vc.ReadAt, 7)
	// b again, into the free slot, then detach the last slot (trimmed).
	vb, err = s.Attach(BackingSpec{Name: "b", Dev: backs[1]}, AttachOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if vb.vi != 1 {
		t.Errorf("reattached into slot %d, want the free slot 1", vb.vi)
	}
	checkBlocks(t, "reattached b", vb.ReadAt, 6)
	if err := vc.Detach(context.Background(), DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	checkBlocks(t, "backing c", devReader(c), 7)
	if n := len(s.Superblock().Backings); n != 2 {
		t.Fatalf("after detaching the last slot: %d slots", n)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(cdev, []BackingSpec{specs[0], {Name: "b", Dev: backs[1]}}, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	va, _ = s.Volume("a")
	vb, _ = s.Volume("b")
	checkBlocks(t, "volume a", va.ReadAt, 10)
	checkBlocks(t, "volume b", vb.ReadAt, 6)
}

// TestAttachDetachUnderLoad attaches and detaches volumes while another
// volume serves writes, reads and flushes (run with -race: the slot list
// swap against the I/O, writeback and GC paths).
func TestAttachDetachUnderLoad(t *testing.T) {
	s, _, backs := newTestSet(t, 8, 64<<10, 4<<20)
	a := s.Volumes()[0]
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var ops atomic.Int64
	shadow := make([]byte, 256*blockSize) // a's first 256 blocks, as written
	var shMu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(1, 2))
		p := make([]byte, blockSize)
		for ctx.Err() == nil {
			b := rng.IntN(256)
			shMu.Lock()
			if rng.IntN(3) == 0 {
				if err := a.ReadAt(p, int64(b)*blockSize); err != nil {
					t.Error(err)
				} else if !bytes.Equal(p, shadow[b*blockSize:(b+1)*blockSize]) {
					t.Errorf("block %d: stale read", b)
				}
			} else {
				for i := range p {
					p[i] = byte(rng.Uint32())
				}
				copy(shadow[b*blockSize:], p)
				if err := a.WriteAt(p, int64(b)*blockSize, rng.IntN(8) == 0); err != nil {
					t.Error(err)
				}
			}
			shMu.Unlock()
			if rng.IntN(16) == 0 {
				if err := a.Flush(); err != nil {
					t.Error(err)
				}
			}
			ops.Add(1)
		}
	}()
	for round := 0; round < 6; round++ {
		name := fmt.Sprintf("v%d", round%3)
		dev := device.NewMem(1 << 20)
		v, err := s.Attach(BackingSpec{Name: name, Dev: dev}, AttachOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var vwg sync.WaitGroup
		vwg.Add(1)
		started := make(chan struct{})
		go func() { // I/O on the new volume until it is detached
			defer vwg.Done()
			p := bytes.Repeat([]byte{byte(round + 1)}, blockSize)
			for i := 0; ; i++ {
				if i == 300 {
					close(started)
				}
				if err := v.WriteAt(p, int64(i%256)*blockSize, false); err != nil {
					if !errors.Is(err, ErrDetached) {
						t.Errorf("write to %s: %v", name, err)
					}
					return
				}
			}
		}()
		<-started // a full pass over the 256 blocks done: every one was written
		if err := v.Detach(ctx, DetachOptions{}); err != nil {
			t.Fatal(err)
		}
		vwg.Wait()
		got := make([]byte, blockSize)
		if _, err := dev.ReadAt(got, 0); err != nil || got[0] != byte(round+1) {
			t.Fatalf("round %d: backing of %s holds %d at block 0 after detach (err %v)", round, name, got[0], err)
		}
	}
	cancel()
	wg.Wait()
	if ops.Load() == 0 {
		t.Fatal("no I/O ran on volume a")
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	_ = backs
}

// TestCheckpointVolumeCount: a checkpoint may name fewer volumes than the
// superblock (attached since: empty) or more (a trailing slot detached
// since), but an extra or free slot may hold nothing.
func TestCheckpointVolumeCount(t *testing.T) {
	body := func(nvols int, ents ...index.Ent) []byte {
		tr := make([]*index.Ptree, nvols)
		for i := range tr {
			tr[i] = index.NewPtree()
		}
		for _, e := range ents {
			tr[nvols-1].ReplaceOrInsert(e)
		}
		var out []byte
		if err := ondisk.EncodeCkptBody([]uint32{1, 2, 3, 4}, make([]uint64, nvols), tr, nil, func(p []byte) error {
			out = append(out, p...)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	const nb, bpb = 4, 4
	e := index.Ent{LBA: 3, Loc: 5, CRC: 9}
	if cd, err := ondisk.DecodeCkptBody(body(1, e), nb, bpb, []uint64{64, 64, 64}); err != nil || len(cd.Vols) != 1 {
		t.Fatalf("fewer volumes than the superblock: %v", err)
	}
	if _, err := ondisk.DecodeCkptBody(body(3), nb, bpb, []uint64{64}); err != nil {
		t.Fatalf("extra empty volumes: %v", err)
	}
	if _, err := ondisk.DecodeCkptBody(body(3, e), nb, bpb, []uint64{64}); err == nil {
		t.Fatal("an extra volume holding an entry was accepted")
	}
	if _, err := ondisk.DecodeCkptBody(body(2, e), nb, bpb, []uint64{64, 0}); err == nil {
		t.Fatal("a free slot (0 blocks) holding an entry was accepted")
	}
}
