package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// writeDuring runs do while a writer writes random blocks of [0, nblocks)
// with ids after *id, recorded in want, and flushes every 50 writes; wrote
// receives once per write completed (and is closed when the writer
// stops), so that do's progress reports can wait for one and writes
// interleave with every step of a copy. It returns the writes made; want
// and *id are the writer's until it does.
func (r *mirrorRig) writeDuring(rng *rand.Rand, nblocks uint64, want map[uint64]uint64, id *uint64, do func(wrote <-chan struct{})) int64 {
	stop := make(chan struct{})
	done := make(chan struct{})
	wrote := make(chan struct{})
	var written int64
	go func() {
		defer close(done)
		defer close(wrote)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			*id++
			lba := rng.Uint64N(nblocks)
			if err := r.vol.WriteAt(mstamp(lba, *id), int64(lba)*blockSize, false); err != nil {
				r.t.Errorf("write during the copy: %v", err)
				return
			}
			want[lba] = *id
			written++
			select {
			case wrote <- struct{}{}:
			default:
			}
			if i%50 == 49 {
				if err := r.vol.Flush(); err != nil {
					r.t.Errorf("flush during the copy: %v", err)
					return
				}
			}
		}
	}()
	do(wrote)
	close(stop)
	<-done
	return written
}

// crashPoints records the crash points of a resilver (or an attach): a
// crash clone of devs before each label write on a hooked member, and
// before the first write of the new member's metadata copy and of its
// bucket copy (after copyLabels label writes).
type crashPoints struct {
	seed       uint64 // of each clone's random choices, with its index
	devs       []*device.Mem
	copyLabels int
	bucketsOff int64

	mu                sync.Mutex
	labels            int
	inMeta, inBuckets bool
	points            []crashPoint
}

type crashPoint struct {
	name string
	devs []*device.Mem // clones of crashPoints.devs
}

// REQUIRES: c.mu
func (c *crashPoints) clone(name string) {
	cl := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 0.5, TornProb: 0.1, Rand: rand.New(rand.NewPCG(uint64(len(c.points)), c.seed))}, c.devs...)
	c.points = append(c.points, crashPoint{name, cl})
}

// end takes the last point, named name, and returns the label writes
// seen, whether the two copies were, and the points.
func (c *crashPoints) end(name string) (labels int, inMeta, inBuckets bool, points []crashPoint) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clone(name)
	return c.labels, c.inMeta, c.inBuckets, c.points
}

// hook returns the hook of member who (isNew: the one being brought in).
// extra, if set, sees every operation too (with the label writes so far)
// and names a point to take before it, or "".
func (c *crashPoints) hook(who string, isNew bool, extra func(op faultdev.Op, labels int) string) *func(faultdev.Op) {
	f := func(op faultdev.Op) {
		c.mu.Lock()
		defer c.mu.Unlock()
		write := op.Kind == faultdev.Write
		switch {
		case write && op.Len == blockSize && (op.Offset == mirror.LabelOff(0) || op.Offset == mirror.LabelOff(1)):
			c.labels++
			c.clone(fmt.Sprintf("before label write %d (%s)", c.labels, who))
		case isNew && write && c.labels == c.copyLabels && !c.inMeta && op.Offset < c.bucketsOff:
			c.inMeta = true
			c.clone("in the metadata copy")
		case isNew && write && c.labels == c.copyLabels && c.inMeta && !c.inBuckets && op.Offset >= c.bucketsOff && op.Len > blockSize:
			c.inBuckets = true
			c.clone("in the bucket copy")
		case extra != nil:
			if name := extra(op, c.labels); name != "" {
				c.clone(name)
			}
		}
	}
	return &f
}

// replacement returns a new empty device the size of the member lost.
func (r *mirrorRig) replacement(lost mirror.Member) *member {
	if lost == mirror.A {
		return newMember(device.NewMem(r.a.mem.Size()))
	}
	return newMember(device.NewMem(r.b.mem.Size()))
}

// TestResilverUnderWrites: a set that lost a member takes a new one while
// a writer keeps writing (dirty data in writeback mode, some flushed);
// then the old survivor is pulled and every block reads back from the new
// member alone, in the running set and after reopening it alone.
func TestResilverUnderWrites(t *testing.T) {
	for _, lost := range []mirror.Member{mirror.A, mirror.B} {
		t.Run("lost="+lost.String(), func(t *testing.T) {
			r := newMirrorRig(t, 32, 64<<10, 32, 2048)
			rng := rand.New(rand.NewPCG(5, uint64(lost)))
			want := map[uint64]uint64{}
			id := uint64(0)
			for range 300 {
				id++
				lba := rng.Uint64N(2048)
				r.write(lba, id)
				want[lba] = id
			}
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			old, survivor := r.a, r.b
			if lost == mirror.B {
				old, survivor = r.b, r.a
			}
			old.pulled.Store(true)
			for range 100 { // degraded: dirty data on the survivor only
				id++
				lba := rng.Uint64N(2048)
				r.write(lba, id)
				want[lba] = id
			}
			nw := r.replacement(lost)
			var got string
			var err error
			var progress []ResilverProgress
			written := r.writeDuring(rand.New(rand.NewPCG(6, uint64(lost))), 2048, want, &id, func(wrote <-chan struct{}) {
				// Each progress report waits for a write to complete, so
				// that writes interleave with every step of the copy.
				got, err = r.set.ReplaceMirrorMember(context.Background(), nw, ResilverOptions{Progress: func(p ResilverProgress) {
					progress = append(progress, p)
					<-wrote
				}})
			})
			if err != nil {
				t.Fatal(err)
			}
			if got != lost.String() {
				t.Fatalf("replaced member %s, want %v", got, lost)
			}
			if st := r.set.Stats().Mirror; st.Degraded || st.Resilver != nil {
				t.Fatalf("after the resilver: %+v", st)
			}
			if len(progress) == 0 || progress[len(progress)-1].Done != progress[len(progress)-1].Total || progress[0].Total == 0 {
				t.Fatalf("progress reports %+v", progress)
			}
			t.Logf("%d writes during the resilver, %d progress reports, total %d bytes", written, len(progress), progress[len(progress)-1].Total)
			for range 50 { // after: redundant again
				id++
				lba := rng.Uint64N(2048)
				r.write(lba, id)
				want[lba] = id
			}
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			if d := r.set.Stats().DirtyBlocks; d == 0 {
				t.Log("no dirty data left at the survivor's failure (writeback caught up)")
			}
			survivor.pulled.Store(true)
			r.verify(want)
			id++
			r.write(2047, id) // a write notices the survivor gone
			want[2047] = id
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			r.verify(want)
			if st := r.set.Stats().Mirror; !st.Degraded || st.Failed == lost.String() {
				t.Fatalf("after pulling the old survivor: %+v", st)
			}
			if err := r.set.Close(); err != nil {
				t.Fatal(err)
			}
			if lost == mirror.A {
				r.open(nw, nil, false)
			} else {
				r.open(nil, nw, false)
			}
			r.verify(want)
		})
	}
}

// TestResilverCrash: a crash before each label write of a resilver, in the
// metadata copy and in the bucket copy, and after its end: the set opens
// on both members with nothing flushed lost, the new member failed (not
// trusted) until its in-sync label is durable, and the new member alone
// refuses to open until then.
func TestResilverCrash(t *testing.T) {
	for _, lost := range []mirror.Member{mirror.A, mirror.B} {
		t.Run("lost="+lost.String(), func(t *testing.T) { resilverCrash(t, lost) })
	}
}

func resilverCrash(t *testing.T, lost mirror.Member) {
	r := newMirrorRig(t, 16, 64<<10, 12, 1024)
	rng := rand.New(rand.NewPCG(9, uint64(lost)))
	want := map[uint64]uint64{}
	id := uint64(0)
	write := func(k int) {
		for range k {
			id++
			lba := rng.Uint64N(1024)
			r.write(lba, id)
			want[lba] = id
		}
		if err := r.vol.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	write(200)
	old, survivor := r.a, r.b
	if lost == mirror.B {
		old, survivor = r.b, r.a
	}
	old.pulled.Store(true)
	write(100)
	nw := r.replacement(lost)
	if lost == mirror.B {
		// One slot per bucket: a replace refused for too few slots (the
		// survivor's dirty data in more buckets than the lost B had
		// slots, when writeback lags) would test nothing here.
		nw = newMember(device.NewMem(r.set.lay.BucketsOff + 16*(r.set.lay.BucketSize+blockSize)))
	}
	// Devices: survivor, new member, backing.
	c := &crashPoints{seed: 10, devs: []*device.Mem{survivor.mem, nw.mem, r.back}, copyLabels: 2, bucketsOff: r.set.lay.BucketsOff}
	nw.hook.Store(c.hook("new", true, nil))
	survivor.hook.Store(c.hook("survivor", false, nil))
	if _, err := r.set.ReplaceMirrorMember(context.Background(), nw, ResilverOptions{}); err != nil {
		t.Fatal(err)
	}
	labels, inMeta, inBuckets, points := c.end("after the resilver")
	survivor.hook.Store(nil)
	nw.hook.Store(nil)
	if labels != 4 || !inMeta || !inBuckets || len(points) != 7 {
		t.Fatalf("%d label writes, metadata copy seen %v, bucket copy seen %v, %d crash points: the test misses steps", labels, inMeta, inBuckets, len(points))
	}
	r.set.crashStop()
	for i, p := range points {
		t.Run(fmt.Sprintf("%d", i), func(t *testing.T) {
			r.t = t
			trusted := i == len(points)-1
			sv, nm := newMember(p.devs[0]), newMember(p.devs[1])
			r.specs = []BackingSpec{{Name: "a", Dev: p.devs[2]}}
			a, b := device.Device(sv), device.Device(nm)
			if lost == mirror.A {
				a, b = nm, sv
			}
			if i == 0 {
				// The new device holds no label yet: it is refused as
				// a member, and the survivor opens alone.
				if _, err := Open(a, r.specs, OpenOptions{Mirror: b}); err == nil || !strings.Contains(err.Error(), "no mirror label") {
					t.Fatalf("%s: opened on both: %v, want a refusal of the unlabelled new member", p.name, err)
				}
				if lost == mirror.A {
					r.open(nil, sv, false)
				} else {
					r.open(sv, nil, false)
				}
				r.verify(want)
				r.set.crashStop()
				return
			}
			if trusted {
				// The new member alone first (a copy of the point):
				// opened on both, it would be resynced from the other.
				c := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 1}, p.devs...)
				specs := r.specs
				r.specs = []BackingSpec{{Name: "a", Dev: c[2]}}
				if lost == mirror.A {
					r.open(newMember(c[1]), nil, true)
				} else {
					r.open(nil, newMember(c[1]), true)
				}
				r.verify(want)
				r.set.crashStop()
				r.specs = specs
			}
			r.open(a, b, false)
			st := r.set.Stats().Mirror
			if st.Degraded == trusted || (!trusted && st.Failed != lost.String()) {
				t.Fatalf("%s: opened on both: mirror %+v, want the new member %v trusted: %v", p.name, st, lost, trusted)
			}
			r.verify(want)
			if trusted {
				// The new member holds it all: the survivor pulled.
				sv.pulled.Store(true)
				r.verify(want)
			}
			r.set.crashStop()
			// The new member alone opens only once trusted.
			na, nb := device.Device(nil), device.Device(nil)
			if lost == mirror.A {
				na = nm
			} else {
				nb = nm
			}
			s, err := Open(na, r.specs, OpenOptions{Mirror: nb, MirrorMissing: true})
			if trusted != (err == nil) {
				t.Fatalf("%s: the new member alone: open error %v, want an error: %v", p.name, err, !trusted)
			}
			if err == nil {
				s.crashStop()
			} else {
				t.Logf("%s: the new member alone: %v", p.name, err)
			}
		})
	}
}

// TestResilverRefusals: replace refuses, saying what it expected and
// found, a mirror that is not degraded, a
// device too small, the survivor itself or a copy of it, another set's
// member and a device holding data (the last two are taken with Force).
func TestResilverRefusals(t *testing.T) {
	ctx := context.Background()
	refused := func(t *testing.T, s *Set, dev device.Device, force bool, want string) {
		t.Helper()
		_, err := s.ReplaceMirrorMember(ctx, dev, ResilverOptions{Force: force})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Fatalf("replace: %v; want a refusal (ErrInvalid) saying %q", err, want)
		}
		t.Logf("refused: %v", err)
	}
	r := newMirrorRig(t, 16, 64<<10, 8, 1024)
	r.write(1, 1)
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	refused(t, r.set, r.replacement(mirror.B), false, "not degraded")
	r.b.pulled.Store(true)
	r.write(2, 2)
	refused(t, r.set, device.NewMem(r.set.lay.BucketsOff+2*(64<<10+blockSize)), false, "at least")
	refused(t, r.set, r.a, false, "survivor")
	cp := device.NewMem(r.b.mem.Size())
	buf := make([]byte, 2*64<<10)
	if _, err := r.a.mem.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.WriteAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	refused(t, r.set, cp, false, "label of the survivor")
	other := newMirrorRig(t, 16, 64<<10, 8, 1024)
	refused(t, r.set, other.b.mem, false, "another mirrored cache set")
	junk := device.NewMem(r.b.mem.Size())
	if _, err := junk.WriteAt(bytes.Repeat([]byte{0xab}, blockSize), 8192); err != nil {
		t.Fatal(err)
	}
	refused(t, r.set, junk, false, "force to overwrite")
	if st := r.set.Stats().Mirror; !st.Degraded || st.Resilver != nil {
		t.Fatalf("after the refusals: %+v", st)
	}
	if _, err := r.set.ReplaceMirrorMember(ctx, junk, ResilverOptions{Force: true}); err != nil {
		t.Fatalf("forced over a device holding data: %v", err)
	}
	if st := r.set.Stats().Mirror; st.Degraded {
		t.Fatalf("after the forced replace: %+v", st)
	}
	r.a.pulled.Store(true)
	r.verify(map[uint64]uint64{1: 1, 2: 2})
}

// TestResilverTooFewSlots: a new B with fewer slots than the buckets
// holding dirty data is refused (it could not hold a copy of each), says
// how many it has and needs and what to do, leaves the set degraded and
// serving, and B's failure not repaired; once the dirty data is written
// back (Drain, as the refusal says), the same device is taken.
func TestResilverTooFewSlots(t *testing.T) {
	ctx := context.Background()
	r := newMirrorRig(t, 16, 64<<10, 8, 1024)
	// Writeback fails until the backing device works again: the dirty
	// data stays.
	var backFails atomic.Bool
	backFails.Store(true)
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	r.specs = []BackingSpec{{Name: "a", Dev: faultdev.Wrap(r.back, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if backFails.Load() && op.Kind == faultdev.Write {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))}}
	r.open(r.a, r.b, false)
	r.b.pulled.Store(true)
	want := map[uint64]uint64{}
	const blocks = 6 * 16 // six buckets of 16 blocks
	for lba := range uint64(blocks) {
		r.write(lba, lba+1)
		want[lba] = lba + 1
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	if st := r.set.Stats(); st.DirtyBlocks < blocks || !st.Mirror.Degraded {
		t.Fatalf("before the replace: %d dirty blocks, mirror %+v; want %d dirty, degraded", st.DirtyBlocks, st.Mirror, blocks)
	}
	small := device.NewMem(r.set.lay.BucketsOff + mirror.MinSlots*(64<<10+blockSize))
	_, err := r.set.ReplaceMirrorMember(ctx, small, ResilverOptions{})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("has %d slots, fewer than the", mirror.MinSlots)) || !strings.Contains(err.Error(), "write the dirty data back first") {
		t.Fatalf("replace with %d slots for 6 dirty buckets: %v; want a refusal naming the slots", mirror.MinSlots, err)
	}
	t.Logf("refused: %v", err)
	if st := r.set.Stats().Mirror; !st.Degraded || st.Failed != "B" || st.Resilver != nil {
		t.Fatalf("after the refusal: %+v", st)
	}
	r.write(blocks, 1000) // still serving, degraded
	want[blocks] = 1000
	r.verify(want)

	backFails.Store(false)
	if err := r.set.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := r.set.ReplaceMirrorMember(ctx, small, ResilverOptions{Force: true}); err != nil {
		t.Fatalf("replace after the dirty data was written back: %v", err)
	}
	if st := r.set.Stats().Mirror; st.Degraded {
		t.Fatalf("after the replace: %+v", st)
	}
	r.a.pulled.Store(true)
	r.verify(want)
}

// TestResilverAOpenBucketUncovered: A fails while the open bucket holds
// clean blocks B has no copy of (it opened with every slot of B holding
// dirty data); the set then idles. Replacing A seals that bucket and
// evicts it (its blocks are on the backing device) instead of failing
// ("bucket 4 (open) holds entries whose data only the failed A held and
// cannot be evicted now: retry the replace", for ever on an idle set);
// then B is pulled and every block reads back from the new A alone.
func TestResilverAOpenBucketUncovered(t *testing.T) {
	ctx := context.Background()
	r := newMirrorRig(t, 16, 64<<10, 4, 4096)
	var backFails atomic.Bool
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	r.specs = []BackingSpec{{Name: "a", Dev: faultdev.Wrap(r.back, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if backFails.Load() && op.Kind == faultdev.Write {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))}}
	for lba := range uint64(4096) {
		if _, err := r.back.WriteAt(mstamp(lba, 0), int64(lba)*blockSize); err != nil {
			t.Fatal(err)
		}
	}
	r.open(r.a, r.b, false)
	backFails.Store(true)
	want := map[uint64]uint64{}
	id := uint64(1)
	for lba := uint64(0); r.set.Stats().Mirror.SlotsUsed < 4 || lba < 64; lba++ {
		r.write(lba, id)
		want[lba] = id
		id++
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	// Clean blocks (read misses, promoted) into the open bucket, for
	// which B has no slot.
	clean := map[uint64]uint64{}
	for lba := uint64(1000); lba < 1010; lba++ {
		clean[lba], want[lba] = 0, 0
	}
	r.verify(clean)
	if st := r.set.Stats(); st.CachedBlocks <= st.DirtyBlocks || st.Mirror.SlotsUsed != st.Mirror.Slots {
		t.Fatalf("before the failure: %d blocks cached, %d dirty, mirror %+v: want clean blocks cached and every slot used", st.CachedBlocks, st.DirtyBlocks, st.Mirror)
	}
	r.a.pulled.Store(true)
	r.verify(want)
	if st := r.set.Stats().Mirror; !st.Degraded || st.Failed != "A" {
		t.Fatalf("after pulling A: %+v", st)
	}
	nw := r.replacement(mirror.A)
	if _, err := r.set.ReplaceMirrorMember(ctx, nw, ResilverOptions{}); err != nil {
		t.Fatalf("replace A: %v", err)
	}
	r.b.pulled.Store(true)
	r.verify(want)
}

// TestResilverRateChange: the rate limit of a running resilver changes
// (SetResilverRate, what `replace --rate` without a device calls): the
// progress reports the new limit and the copy goes on at it; with no
// resilver running, or a negative rate, it is refused.
func TestResilverRateChange(t *testing.T) {
	r := newMirrorRig(t, 16, 64<<10, 8, 1024)
	r.write(1, 1)
	if err := r.set.SetResilverRate(1 << 20); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no resilver is running") {
		t.Fatalf("SetResilverRate with no resilver: %v", err)
	}
	r.b.pulled.Store(true)
	r.write(2, 2)
	var rates []int64
	_, err := r.set.ReplaceMirrorMember(context.Background(), r.replacement(mirror.B), ResilverOptions{Rate: 64 << 10, Progress: func(p ResilverProgress) {
		rates = append(rates, p.Rate)
		if len(rates) == 1 {
			if err := r.set.SetResilverRate(-1); !errors.Is(err, ErrInvalid) {
				t.Errorf("SetResilverRate(-1): %v", err)
			}
			if err := r.set.SetResilverRate(0); err != nil {
				t.Errorf("SetResilverRate(0) while resilvering: %v", err)
			}
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rates) < 2 || rates[0] != 64<<10 || rates[len(rates)-1] != 0 {
		t.Fatalf("progress reported rate limits %v; want 65536 first, then 0", rates)
	}
	r.a.pulled.Store(true)
	r.verify(map[uint64]uint64{1: 1, 2: 2})
}
