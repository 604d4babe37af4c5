package mirror

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// testLayout: 256 KiB of metadata, 16 buckets of 64 KiB.
var testLayout = Layout{Nonce: 0x5eed, BucketsOff: 256 << 10, BucketSize: 64 << 10, NBuckets: 16}

// switchable is a faultdev device whose every operation fails once dead
// is set.
type switchable struct {
	*faultdev.Device
	dead atomic.Bool
}

func newSwitchable(size int64) *switchable {
	s := &switchable{}
	s.Device = faultdev.Wrap(device.NewMem(size), faultdev.InjectorFunc(func(faultdev.Op) faultdev.Fault {
		if s.dead.Load() {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))
	return s
}

// newPair formats a pair: A the size of the layout, B with nslots slots.
func newPair(t *testing.T, nslots int64) (*switchable, *switchable, *Mirror) {
	t.Helper()
	a := newSwitchable(testLayout.BucketsOff + testLayout.NBuckets*testLayout.BucketSize)
	b := newSwitchable(testLayout.BucketsOff + nslots*testLayout.slotLen())
	l, err := NewLabel(testLayout.Nonce)
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteNew(a, b, l); err != nil {
		t.Fatal(err)
	}
	m := assemble(t, a, b, nil)
	return a, b, m
}

func assemble(t *testing.T, a, b device.Device, gens []uint32) *Mirror {
	t.Helper()
	var da, db device.Device
	if a != nil {
		da = a
	}
	if b != nil {
		db = b
	}
	m, err := Assemble(da, db, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Init(testLayout); err != nil {
		t.Fatal(err)
	}
	if gens != nil {
		if err := m.LoadSlots(gens); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

func fill(n int, c byte) []byte { return bytes.Repeat([]byte{c}, n) }

func bucketOff(b int64) int64 { return testLayout.BucketsOff + b*testLayout.BucketSize }

func readDev(t *testing.T, d device.Device, off int64, n int) []byte {
	t.Helper()
	p := make([]byte, n)
	if _, err := d.ReadAt(p, off); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPlacement: metadata on both at the same offset, a mapped bucket in
// its slot on B (from the block it was mapped at), an unmapped one on A
// only; the mapping is found again from the slot headers at its
// generation only.
func TestPlacement(t *testing.T) {
	a, b, m := newPair(t, 4)
	meta := fill(8192, 'm')
	if _, err := m.WriteAt(meta, 128<<10); err != nil {
		t.Fatal(err)
	}
	if !m.Map(3, 7, 2) {
		t.Fatal("Map failed with free slots")
	}
	d := fill(4*blockSize, 'd') // blocks 0..3 of bucket 3: 0,1 before the mapping
	if _, err := m.WriteAt(d, bucketOff(3)); err != nil {
		t.Fatal(err)
	}
	c := fill(blockSize, 'c')
	if _, err := m.WriteAt(c, bucketOff(5)); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	for _, dev := range []device.Device{a, b} {
		if !bytes.Equal(readDev(t, dev, 128<<10, 8192), meta) {
			t.Fatal("metadata not on both members")
		}
	}
	slot := m.slotOf[3]
	got := readDev(t, b, m.slotOff(slot)+blockSize+2*blockSize, 2*blockSize)
	if !bytes.Equal(got, d[:2*blockSize]) {
		t.Fatal("mapped bucket's blocks not in its slot on B")
	}
	if got := readDev(t, b, m.slotOff(slot)+blockSize, blockSize); bytes.Equal(got, d[:blockSize]) {
		t.Fatal("block before the mapping copied to B")
	}
	if st := m.Stats(); st.SlotsUsed != 1 || st.Slots != 4 {
		t.Fatalf("stats %+v", st)
	}

	gens := make([]uint32, testLayout.NBuckets)
	gens[3] = 7
	m2 := assemble(t, a, b, gens)
	if !m2.Mapped(3) || m2.Mapped(5) {
		t.Fatal("mapping not recovered from the slot headers")
	}
	gens[3] = 8
	if m3 := assemble(t, a, b, gens); m3.Mapped(3) {
		t.Fatal("slot of an older generation taken as a mapping")
	}
}

// TestSlotsRunOut: B with 4 slots maps 4 buckets; a release frees one.
func TestSlotsRunOut(t *testing.T) {
	_, _, m := newPair(t, 4)
	for i := range int64(4) {
		if !m.Map(i, 1, 0) {
			t.Fatalf("Map %d failed", i)
		}
	}
	if m.Map(4, 1, 0) {
		t.Fatal("Map succeeded with no free slot")
	}
	m.Release(1)
	if !m.Map(4, 1, 0) {
		t.Fatal("Map failed after a release")
	}
}

// TestFailB: a write error on B fails B; the write succeeds on A, A's
// label says B failed, and a reassembly does not use B.
func TestFailB(t *testing.T) {
	a, b, m := newPair(t, 4)
	m.Map(0, 1, 0)
	b.dead.Store(true)
	if _, err := m.WriteAt(fill(blockSize, 'x'), bucketOff(0)); err != nil {
		t.Fatalf("write with B dead: %v", err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	if m.Redundant() || !m.Failed(B) {
		t.Fatal("B not failed")
	}
	if m.Map(1, 1, 0) {
		t.Fatal("slot handed out on a failed B")
	}
	b.dead.Store(false)
	l, _, _ := ReadLabel(a)
	if !l.Failed[B] || l.Gen != 2 {
		t.Fatalf("A's label %+v", l)
	}
	m2 := assemble(t, a, b, nil)
	if !m2.Failed(B) || m2.Failed(A) {
		t.Fatal("reassembly uses the stale B")
	}
	// B alone cannot know it is stale: its label says both in sync, so
	// it is refused unless the operator allows a missing member.
	if _, err := Assemble(nil, b, false, nil); err == nil {
		t.Fatal("a stale B alone assembled")
	}
	if _, err := Assemble(a, nil, false, nil); err != nil {
		t.Fatalf("A alone (B marked failed): %v", err)
	}
}

// TestFailA: with A dead, mapped buckets and metadata are served by B,
// unmapped buckets are ErrNoCopy, and B's label says A failed.
func TestFailA(t *testing.T) {
	a, b, m := newPair(t, 4)
	m.Map(2, 1, 0)
	d := fill(blockSize, 'd')
	meta := fill(blockSize, 'm')
	for _, w := range []struct {
		p   []byte
		off int64
	}{{d, bucketOff(2)}, {meta, 200 << 10}, {d, bucketOff(6)}} {
		if _, err := m.WriteAt(w.p, w.off); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	a.dead.Store(true)
	if _, err := m.WriteAt(d, bucketOff(2)+blockSize); err != nil {
		t.Fatalf("write to a mapped bucket with A dead: %v", err)
	}
	if m.Primary() != B {
		t.Fatal("A not failed")
	}
	p := make([]byte, blockSize)
	if _, err := m.ReadAt(p, bucketOff(2)); err != nil || !bytes.Equal(p, d) {
		t.Fatalf("mapped block from B: %v", err)
	}
	if _, err := m.ReadAt(p, 200<<10); err != nil || !bytes.Equal(p, meta) {
		t.Fatalf("metadata from B: %v", err)
	}
	if _, err := m.ReadAt(p, bucketOff(6)); !errors.Is(err, ErrNoCopy) {
		t.Fatalf("unmapped block with A dead: %v, want ErrNoCopy", err)
	}
	if _, err := m.WriteAt(d, bucketOff(7)); !errors.Is(err, ErrNoCopy) {
		t.Fatalf("write to an unmapped bucket with A dead: %v, want ErrNoCopy", err)
	}
	l, _, _ := ReadLabel(b)
	if !l.Failed[A] {
		t.Fatalf("B's label %+v", l)
	}
	b.dead.Store(true)
	if _, err := m.WriteAt(d, bucketOff(2)); err == nil {
		t.Fatal("write succeeded with both members dead")
	}
}

// TestReadRetryAndRepair: a read error on A is served by B and A's copy
// rewritten; RepairFrom replaces a copy that fails its check, on either
// member.
func TestReadRetryAndRepair(t *testing.T) {
	a := device.NewMem(testLayout.BucketsOff + testLayout.NBuckets*testLayout.BucketSize)
	b := device.NewMem(testLayout.BucketsOff + 4*testLayout.slotLen())
	var failReads atomic.Bool
	fa := faultdev.Wrap(a, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if op.Kind == faultdev.Read && failReads.Load() {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))
	l, _ := NewLabel(testLayout.Nonce)
	if err := WriteNew(fa, b, l); err != nil {
		t.Fatal(err)
	}
	m := assemble(t, fa, b, nil)
	m.Map(1, 1, 0)
	d := fill(2*blockSize, 'd')
	if _, err := m.WriteAt(d, bucketOff(1)); err != nil {
		t.Fatal(err)
	}
	failReads.Store(true)
	p := make([]byte, 2*blockSize)
	for range 2 { // the members take turns: one of the two reads goes to A
		if _, err := m.ReadAt(p, bucketOff(1)); err != nil || !bytes.Equal(p, d) {
			t.Fatalf("read with A failing reads: %v", err)
		}
	}
	failReads.Store(false)
	if st := m.Stats(); st.ReadRetries != 1 || st.Repairs != 1 || st.Failed[A] {
		t.Fatalf("stats %+v", st)
	}
	good := func(q []byte) bool { return bytes.Equal(q, d) }
	for i, bad := range []*device.Mem{a, b} {
		off := bucketOff(1)
		if bad == b {
			off = m.slotOff(m.slotOf[1]) + blockSize
		}
		if err := bad.Corrupt(off, 16); err != nil {
			t.Fatal(err)
		}
		r := Member(i)
		if err := m.ReadMember(r, p, bucketOff(1)); err != nil || bytes.Equal(p, d) {
			t.Fatalf("%v's corrupt copy read back intact (%v): the test corrupts nothing", r, err)
		}
		if !m.RepairFrom(p, bucketOff(1), good) || !bytes.Equal(p, d) {
			t.Fatalf("RepairFrom with %v's copy bad failed", r)
		}
		if !bytes.Equal(readDev(t, bad, off, 2*blockSize), d) {
			t.Fatalf("%v's copy not repaired", r)
		}
		if st := m.Stats(); st.Repairs != uint64(2+i) {
			t.Fatalf("after repairing %v: %d repairs, want %d", r, st.Repairs, 2+i)
		}
	}
	if err := a.Corrupt(bucketOff(9), 16); err != nil {
		t.Fatal(err)
	}
	if m.RepairFrom(p, bucketOff(9), func([]byte) bool { return false }) {
		t.Fatal("RepairFrom of a block only A holds, whose copy fails")
	}
}

// TestReadsSpread: reads of what both members hold (a mapped bucket) go
// to each in turn, on the synchronous and the asynchronous path; the
// metadata region and a bucket only A holds are read from A; with a
// member failed every read goes to the survivor.
func TestReadsSpread(t *testing.T) {
	a := &asyncMem{Mem: device.NewMem(testLayout.BucketsOff + testLayout.NBuckets*testLayout.BucketSize)}
	b := &asyncMem{Mem: device.NewMem(testLayout.BucketsOff + 4*testLayout.slotLen())}
	l, _ := NewLabel(testLayout.Nonce)
	if err := WriteNew(a, b, l); err != nil {
		t.Fatal(err)
	}
	m := assemble(t, a, b, nil)
	m.Map(1, 1, 0)
	d, c, meta := fill(blockSize, 'd'), fill(blockSize, 'c'), fill(blockSize, 'm')
	if _, err := m.WriteAt(meta, 128<<10); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(d, bucketOff(1)); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(c, bucketOff(2)); err != nil {
		t.Fatal(err)
	}
	reads := func() [2]uint64 { return m.Stats().Reads }
	p := make([]byte, blockSize)
	read := func(off int64, want []byte) {
		t.Helper()
		if _, err := m.ReadAt(p, off); err != nil || !bytes.Equal(p, want) {
			t.Fatalf("read at %d: %v", off, err)
		}
	}
	startRead := func(off int64, want []byte) {
		t.Helper()
		done := make(chan error, 1)
		if !m.StartReadAt(p, off, func(_ int, err error, _ func(func())) { done <- err }) {
			t.Fatal("StartReadAt refused")
		}
		if err := <-done; err != nil || !bytes.Equal(p, want) {
			t.Fatalf("asynchronous read at %d: %v", off, err)
		}
	}
	base := reads()
	for range 10 {
		read(bucketOff(1), d)
	}
	for range 10 {
		startRead(bucketOff(1), d)
	}
	got := reads()
	if a, b := got[A]-base[A], got[B]-base[B]; a != 10 || b != 10 {
		t.Fatalf("20 reads of a block on both: %d from A, %d from B; want 10 each", a, b)
	}
	if ab := a.async.Load() + b.async.Load(); ab != 10 || b.async.Load() != 5 {
		t.Fatalf("10 asynchronous reads: %d started on A's device, %d on B's; want 5 each", a.async.Load(), b.async.Load())
	}
	base = got
	for range 5 {
		read(bucketOff(2), c)
		read(128<<10, meta)
		startRead(bucketOff(2), c)
	}
	if got := reads(); got[B] != base[B] {
		t.Fatalf("reads of the metadata region and of a bucket only A holds: %d went to B", got[B]-base[B])
	}
	b.dead.Store(true)
	if _, err := m.WriteAt(d, bucketOff(1)); err != nil { // fails B
		t.Fatal(err)
	}
	base = reads()
	for range 4 {
		read(bucketOff(1), d)
	}
	if got := reads(); got[A]-base[A] != 4 {
		t.Fatalf("with B failed: %d of 4 reads from A", got[A]-base[A])
	}
}

// asyncMem is a memory device that starts reads asynchronously (on a
// goroutine) and counts them; every operation fails once dead is set.
type asyncMem struct {
	*device.Mem
	dead  atomic.Bool
	async atomic.Int64
}

var errDead = errors.New("dead")

func (d *asyncMem) ReadAt(p []byte, off int64) (int, error) {
	if d.dead.Load() {
		return 0, errDead
	}
	return d.Mem.ReadAt(p, off)
}

func (d *asyncMem) WriteAt(p []byte, off int64) (int, error) {
	if d.dead.Load() {
		return 0, errDead
	}
	return d.Mem.WriteAt(p, off)
}

func (d *asyncMem) Sync() error {
	if d.dead.Load() {
		return errDead
	}
	return d.Mem.Sync()
}

func (d *asyncMem) StartReadAt(p []byte, off int64, done func(n int, err error, later func(func()))) bool {
	d.async.Add(1)
	go func() {
		n, err := d.ReadAt(p, off)
		device.WithLater(func(later func(func())) { done(n, err, later) })
	}()
	return true
}

// TestAssembleRefusals: a missing member is accepted only when the
// survivor's label says it failed, or when allowed; swapped roles and
// members of different sets are refused.
func TestAssembleRefusals(t *testing.T) {
	a, b, _ := newPair(t, 4)
	if _, err := Assemble(a, nil, false, nil); err == nil {
		t.Fatal("A alone assembled while its label says B is in sync")
	}
	if _, err := Assemble(b, a, false, nil); err == nil {
		t.Fatal("swapped members assembled")
	}
	a2, _, _ := newPair(t, 4)
	if _, err := Assemble(a2, b, false, nil); err == nil {
		t.Fatal("members of two sets assembled")
	}
	m, err := Assemble(nil, b, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !m.Failed(A) {
		t.Fatal("missing A not failed")
	}
	// B's label now says A failed: B alone needs no permission, and A
	// (stale) is not used beside it.
	if _, err := Assemble(nil, b, false, nil); err != nil {
		t.Fatal(err)
	}
	m2, err := Assemble(a, b, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !m2.Failed(A) || m2.Primary() != B {
		t.Fatal("stale A used")
	}
}

// TestResilverRate: a resilver limited to a rate waits, chunk by chunk,
// until the bytes copied took at least bytes/rate (in steps of at most
// paceStep, so that a new limit is seen within one), reports the limit in
// its stats, and stops waiting when the limit is lifted. The sleeps are
// counted, not timed.
func TestResilverRate(t *testing.T) {
	_, b, m := newPair(t, 4)
	for i := range int64(2) {
		m.Map(i, 1, 0)
		if _, err := m.WriteAt(fill(int(testLayout.BucketSize), 'x'), bucketOff(i)); err != nil {
			t.Fatal(err)
		}
	}
	b.dead.Store(true)
	if _, err := m.WriteAt(fill(blockSize, 'y'), bucketOff(0)); err != nil {
		t.Fatal(err)
	}
	if !m.Failed(B) {
		t.Fatal("B not failed")
	}
	nb := newSwitchable(b.Size())
	if _, err := m.BeginResilver(nb, false); err != nil {
		t.Fatal(err)
	}
	const rate = 64 << 10 // bytes a second
	m.SetResilverRate(rate)
	var slept time.Duration
	var steps int
	m.sleepHook = func(_ context.Context, d time.Duration) error {
		if d > paceStep {
			t.Errorf("one sleep of %v, more than paceStep", d)
		}
		slept += d
		steps++
		return nil
	}
	if st := m.Stats().Resilver; st == nil || st.Rate != rate {
		t.Fatalf("resilver stats %+v: want the rate limit %d", st, rate)
	}
	start := time.Now()
	if err := m.CopyMeta(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	m.Map(0, 1, 0)
	m.Map(1, 1, 0)
	if err := m.CopyBuckets(context.Background(), []BucketGen{{0, 1}, {1, 1}}, nil); err != nil {
		t.Fatal(err)
	}
	// Done counts the two label blocks, which are skipped, not copied.
	copied := m.Stats().Resilver.Done - 2*blockSize
	want := time.Duration(float64(copied)/rate*float64(time.Second)) - time.Since(start)
	if slept < want {
		t.Fatalf("copied %d bytes at a limit of %d B/s sleeping %v; want at least %v", copied, rate, slept, want)
	}
	t.Logf("copied %d bytes, slept %v in %d steps", copied, slept, steps)

	// Lifted while copying: no more waiting after the step that saw it.
	slept, steps = 0, 0
	m.sleepHook = func(_ context.Context, d time.Duration) error {
		steps++
		m.SetResilverRate(0)
		return nil
	}
	if err := m.CopyBuckets(context.Background(), []BucketGen{{0, 1}, {1, 1}}, nil); err != nil {
		t.Fatal(err)
	}
	if steps != 1 {
		t.Fatalf("%d sleeps after the limit was lifted at the first; want 1", steps)
	}
	if err := m.FinishResilver(); err != nil {
		t.Fatal(err)
	}
}

// TestNoAllocs: Covers (asked for every dirty write) and a read or a
// write on one member allocate nothing: the pieces of a request are
// placed in the caller's array. (Covers built a 4 KiB buffer each call.)
func TestNoAllocs(t *testing.T) {
	_, b, m := newPair(t, 4)
	m.Map(1, 1, 0)
	p := fill(blockSize, 'x')
	if n := testing.AllocsPerRun(100, func() { m.Covers(bucketOff(1)) }); n != 0 {
		t.Errorf("Covers: %v allocations", n)
	}
	if n := testing.AllocsPerRun(100, func() {
		if _, err := m.ReadAt(p, bucketOff(1)); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("ReadAt: %v allocations", n)
	}
	b.dead.Store(true)
	if _, err := m.WriteAt(p, bucketOff(1)); err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() {
		if _, err := m.WriteAt(p, bucketOff(1)); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("WriteAt on A alone: %v allocations", n)
	}
}
