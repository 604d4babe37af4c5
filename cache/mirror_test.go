package cache

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// member is a mirror member for tests: a memory device that fails every
// operation once pulled.
type member struct {
	*faultdev.Device
	mem    *device.Mem
	pulled atomic.Bool
	// hook, if set, sees every operation first; fail, if set, fails
	// those it returns true for.
	hook atomic.Pointer[func(faultdev.Op)]
	fail atomic.Pointer[func(faultdev.Op) bool]
}

func newMember(mem *device.Mem) *member {
	m := &member{mem: mem}
	m.Device = faultdev.Wrap(mem, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		if h := m.hook.Load(); h != nil {
			(*h)(op)
		}
		if f := m.fail.Load(); m.pulled.Load() || (f != nil && (*f)(op)) {
			return faultdev.Error(nil)
		}
		return faultdev.Fault{}
	}))
	return m
}

// mirrorRig is a mirrored set on memory devices: A with nBuckets buckets,
// B with slots slots, one backing device of backBlocks blocks.
type mirrorRig struct {
	t     *testing.T
	a, b  *member
	back  *device.Mem
	specs []BackingSpec
	set   *Set
	vol   *Volume
}

func newMirrorRig(t *testing.T, nBuckets, bucketSize, slots, backBlocks int64) *mirrorRig {
	t.Helper()
	jl := int64(minJournalLen)
	aMem := device.NewMem(cacheSizeFor(nBuckets, bucketSize, jl, 1))
	back := device.NewMem(backBlocks * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	sb, err := Format(aMem, specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	bMem := device.NewMem(sb.BucketsOff + slots*(bucketSize+blockSize))
	r := &mirrorRig{t: t, a: newMember(aMem), b: newMember(bMem), back: back, specs: specs}
	if _, err := Format(r.a, specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl, Mirror: r.b}); err != nil {
		t.Fatal(err)
	}
	r.open(r.a, r.b, false)
	return r
}

func (r *mirrorRig) open(a, b device.Device, missing bool) {
	r.t.Helper()
	s, err := Open(a, r.specs, OpenOptions{Mirror: b, MirrorMissing: missing})
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { s.crashStop() })
	r.set = s
	r.vol, _ = s.Volume("a")
}

// mstamp is block lba's content for write id: both in its first 16 bytes.
func mstamp(lba, id uint64) []byte {
	p := make([]byte, blockSize)
	binary.LittleEndian.PutUint64(p, lba)
	binary.LittleEndian.PutUint64(p[8:], id)
	for i := 16; i < len(p); i++ {
		p[i] = byte(id + uint64(i))
	}
	return p
}

func (r *mirrorRig) write(lba, id uint64) {
	r.t.Helper()
	if err := r.vol.WriteAt(mstamp(lba, id), int64(lba)*blockSize, false); err != nil {
		r.t.Fatalf("write lba %d: %v", lba, err)
	}
}

// verify reads every block in want and compares.
func (r *mirrorRig) verify(want map[uint64]uint64) {
	r.t.Helper()
	p := make([]byte, blockSize)
	for lba, id := range want {
		if err := r.vol.ReadAt(p, int64(lba)*blockSize); err != nil {
			r.t.Fatalf("read lba %d: %v", lba, err)
		}
		if !bytes.Equal(p, mstamp(lba, id)) {
			r.t.Fatalf("lba %d: read write %d of lba %d, want write %d", lba,
				binary.LittleEndian.Uint64(p[8:]), binary.LittleEndian.Uint64(p), id)
		}
	}
}

// TestMirrorSurvivesEitherMember: with either member pulled after a
// flush, every block reads back, the set keeps taking writes in writeback
// mode and says it is degraded; the survivor alone reopens with it all.
func TestMirrorSurvivesEitherMember(t *testing.T) {
	for _, lost := range []mirror.Member{mirror.A, mirror.B} {
		t.Run("lost="+lost.String(), func(t *testing.T) {
			r := newMirrorRig(t, 16, 64<<10, 16, 1024)
			rng := rand.New(rand.NewPCG(1, uint64(lost)))
			want := map[uint64]uint64{}
			id := uint64(0)
			for range 200 {
				lba := rng.Uint64N(1024)
				id++
				r.write(lba, id)
				want[lba] = id
			}
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			pulled, survivor := r.a, r.b
			if lost == mirror.B {
				pulled, survivor = r.b, r.a
			}
			pulled.pulled.Store(true)
			r.verify(want)
			cached := 0
			for range 100 {
				lba := rng.Uint64N(1024)
				id++
				tier, err := r.vol.WriteAtTier(mstamp(lba, id), int64(lba)*blockSize, false)
				if err != nil {
					t.Fatal(err)
				}
				if tier == TierCache {
					cached++
				}
				want[lba] = id
			}
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			r.verify(want)
			st := r.set.Stats()
			if st.Failed || st.Mirror == nil || !st.Mirror.Degraded || st.Mirror.Failed != lost.String() {
				t.Fatalf("stats after losing %v: failed %v, mirror %+v", lost, st.Failed, st.Mirror)
			}
			if r.vol.Mode() != Writeback || cached == 0 {
				t.Fatalf("mode %v, %d of 100 writes taken by the cache: not serving in writeback", r.vol.Mode(), cached)
			}
			if err := r.set.Close(); err != nil {
				t.Fatal(err)
			}
			if lost == mirror.A {
				r.open(nil, survivor, false)
			} else {
				r.open(survivor, nil, false)
			}
			r.verify(want)
		})
	}
}

// TestMirrorSmallB: a B with a quarter of A's buckets as slots loses
// nothing when A is pulled: dirty data that B had no room for went to the
// backing device too (writethrough for that piece), and clean data only
// on A is read from the backing device.
func TestMirrorSmallB(t *testing.T) {
	r := newMirrorRig(t, 32, 64<<10, mirror.MinSlots+4, 4096)
	rng := rand.New(rand.NewPCG(2, 2))
	want := map[uint64]uint64{}
	for id := uint64(1); id <= 1500; id++ {
		lba := rng.Uint64N(4096)
		r.write(lba, id)
		want[lba] = id
		if id%100 == 0 {
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	st := r.set.Stats()
	t.Logf("B: %d slots, %d used; %d dirty blocks; %d written through for want of a slot", st.Mirror.Slots, st.Mirror.SlotsUsed, st.DirtyBlocks, st.Mirror.WritethroughBlocks)
	if st.Mirror.WritethroughBlocks == 0 {
		t.Fatal("no write went to the backing device: B never ran out of slots, the test tests nothing")
	}
	r.a.pulled.Store(true)
	r.verify(want)
	if st := r.set.Stats(); st.Failed || !st.Mirror.Degraded {
		t.Fatalf("after pulling A: failed %v (%s), mirror %+v", st.Failed, st.Cause, st.Mirror)
	}
}

// TestMirrorChecksumRepair: a dirty block whose copy fails its checksum
// on the member a read or a writeback reads it from is served from the
// other member's copy, and the bad copy rewritten and counted. The copy
// damaged is the first one read; the members take turns, and a read of
// another block first makes it the other member's. A scrub reads both
// copies: the damaged one, A's in one run and B's in the other, is found
// and rewritten.
func TestMirrorChecksumRepair(t *testing.T) {
	for _, path := range []string{"read", "writeback", "scrub"} {
		var seen [2]bool
		ran := 0
		for _, before := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s/reads-before=%d", path, before), func(t *testing.T) {
				ran++
				seen[mirrorChecksumRepair(t, path, before)] = true
			})
		}
		if !t.Failed() && ran == 2 && seen != [2]bool{true, true} {
			t.Fatalf("%s: damaged on A %v, on B %v: one member's copy was never the one read", path, seen[0], seen[1])
		}
	}
}

func mirrorChecksumRepair(t *testing.T, path string, before int) mirror.Member {
	r := newMirrorRig(t, 16, 64<<10, 16, 1024)
	r.write(7, 1)
	r.write(8, 1)
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	for range before {
		r.verify(map[uint64]uint64{8: 1})
	}
	r.set.mu.Lock()
	e, ok := r.vol.idx.Tree.Get(index.Ent{LBA: 7})
	r.set.mu.Unlock()
	if !ok || !e.Dirty() {
		t.Fatal("lba 7 not dirty in the cache")
	}
	want := mstamp(7, 1)
	offs := [2]int64{r.set.cacheOff(e.Block()), memOffset(t, r.b.mem, want)}
	var damaged atomic.Int32
	damaged.Store(-1)
	if path == "scrub" {
		// A scrub reads both copies: the damage is on member `before`.
		if err := []*member{r.a, r.b}[before].mem.Corrupt(offs[before]+100, 8); err != nil {
			t.Fatal(err)
		}
		damaged.Store(int32(before))
	}
	for i, m := range []*member{r.a, r.b} {
		if path == "scrub" {
			break
		}
		f := func(op faultdev.Op) {
			if op.Kind == faultdev.Read && op.Offset <= offs[i] && offs[i] < op.Offset+op.Len && damaged.CompareAndSwap(-1, int32(i)) {
				if err := m.mem.Corrupt(offs[i]+100, 8); err != nil {
					t.Error(err)
				}
			}
		}
		m.hook.Store(&f)
	}
	switch path {
	case "read":
		r.verify(map[uint64]uint64{7: 1})
	case "writeback":
		if err := r.vol.DrainDirty(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, blockSize)
		if _, err := r.back.ReadAt(got, 7*blockSize); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("lba 7 not written back intact (%v)", err)
		}
	case "scrub":
		rep, err := r.set.Scrub(context.Background(), nil)
		if err != nil || !rep.OK() || rep.Repaired != 1 {
			t.Fatalf("scrub: %v, report %+v; want OK with 1 repaired", err, rep)
		}
	}
	d := damaged.Load()
	if d < 0 {
		t.Fatal("lba 7 was never read from the cache: the test damages nothing")
	}
	vs, ms := r.vol.Stats(), r.set.Stats().Mirror
	t.Logf("damaged on %v; reads A %d, B %d", mirror.Member(d), ms.Reads[0], ms.Reads[1])
	if vs.ChecksumErrors != 1 || vs.ChecksumRepairs != 1 || ms.Repairs != 1 || ms.Degraded {
		t.Fatalf("checksum errors %d, repairs %d, mirror %+v; want 1 each, not degraded", vs.ChecksumErrors, vs.ChecksumRepairs, ms)
	}
	for i, m := range []*member{r.a, r.b} {
		got := make([]byte, blockSize)
		if _, err := m.mem.ReadAt(got, offs[i]); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%v's copy not intact after the repair (%v)", mirror.Member(i), err)
		}
	}
	return mirror.Member(d)
}

// TestMirrorMetadataRepair: Open of a mirrored set after a crash, with
// A's newest superblock copy, newest checkpoint (header and body) and
// first journal block after it damaged, or failing to read, recovers
// every flushed write from B's copies, rewrites A's and counts each
// (mirror repairs; read retries for the read errors); the set is not
// degraded.
func TestMirrorMetadataRepair(t *testing.T) {
	for _, how := range []string{"damaged", "read-errors"} {
		t.Run(how, func(t *testing.T) {
			r := newMirrorRig(t, 16, 64<<10, 16, 1024)
			want := map[uint64]uint64{}
			for lba := range uint64(40) {
				r.write(lba, lba+1)
				want[lba] = lba + 1
			}
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			r.set.crashStop()
			sb, idx, err := ondisk.ReadSuperblock(r.a.mem)
			if err != nil {
				t.Fatal(err)
			}
			h, _, _, err := ondisk.ReadCheckpointBody(r.a.mem, sb)
			if err != nil {
				t.Fatal(err)
			}
			slot := sb.CkptOff[h.Gen%2]
			places := []struct {
				what    string
				off, n  int64
				damaged int64 // an offset in it
			}{
				{"superblock copy", int64(idx) * ondisk.SBCopySize, blockSize, int64(idx)*ondisk.SBCopySize + 40},
				{"checkpoint header", slot, blockSize, slot + 40},
				{"checkpoint body", slot + blockSize, int64(h.BodyLen), slot + blockSize + int64(h.BodyLen)/2},
				{"journal block", sb.JournalOff + h.JPos.Blk*blockSize, blockSize, sb.JournalOff + h.JPos.Blk*blockSize + 100},
			}
			var failed [4]atomic.Bool
			if how == "damaged" {
				for _, p := range places {
					if err := r.a.mem.Corrupt(p.damaged, 8); err != nil {
						t.Fatal(err)
					}
				}
			} else {
				f := func(op faultdev.Op) bool {
					for i, p := range places {
						if op.Kind == faultdev.Read && op.Offset <= p.damaged && p.damaged < op.Offset+op.Len && failed[i].CompareAndSwap(false, true) {
							return true
						}
					}
					return false
				}
				r.a.fail.Store(&f)
			}
			r.open(r.a, r.b, false)
			r.a.fail.Store(nil)
			r.verify(want)
			st := r.set.Stats().Mirror
			t.Logf("mirror after the open: %+v", st)
			if st.Degraded || st.Repairs != uint64(len(places)) || (how == "read-errors") != (st.ReadRetries == uint64(len(places))) {
				t.Fatalf("mirror %+v: want not degraded, %d repairs (and as many read retries for read errors)", st, len(places))
			}
			for i, p := range places {
				if how == "read-errors" && !failed[i].Load() {
					t.Fatalf("the %s was never read", p.what)
				}
				ga, gb := make([]byte, p.n), make([]byte, p.n)
				if _, err := r.a.mem.ReadAt(ga, p.off); err != nil {
					t.Fatal(err)
				}
				if _, err := r.b.mem.ReadAt(gb, p.off); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(ga, gb) {
					t.Fatalf("A's %s at %d not repaired from B's", p.what, p.off)
				}
			}
		})
	}
}

// memOffset returns the offset of the 4 KiB block of dev that holds want.
func memOffset(t *testing.T, dev *device.Mem, want []byte) int64 {
	t.Helper()
	p := make([]byte, blockSize)
	for off := int64(0); off < dev.Size(); off += blockSize {
		if _, err := dev.ReadAt(p, off); err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(p, want) {
			return off
		}
	}
	t.Fatal("block not found on the device")
	return 0
}

// TestMirrorRefusesHalf: a member alone whose label says the other is in
// sync is refused (it could be stale) unless the operator allows it.
func TestMirrorRefusesHalf(t *testing.T) {
	r := newMirrorRig(t, 16, 64<<10, 16, 1024)
	r.write(1, 1)
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(r.a, r.specs, OpenOptions{}); err == nil {
		t.Fatal("A alone opened")
	}
	if _, err := Open(nil, r.specs, OpenOptions{Mirror: r.b}); err == nil {
		t.Fatal("B alone opened")
	}
	r.open(nil, r.b, true)
	r.verify(map[uint64]uint64{1: 1})
}

// TestMirrorCrash: a power cut of both members at a random moment of a
// writeback workload loses no flushed write, whether the set reopens on
// both, on B alone, or on both and then loses A (the resync after the
// crash copied to B what the journal tail on A made dirty).
//
// Replay one case: go test ./cache -run 'TestMirrorCrash/seed=N'; run
// long with TIERCACHE_MIRRORCRASH_SEEDS (and _START).
func TestMirrorCrash(t *testing.T) {
	def := 30
	if testing.Short() || raceEnabled {
		def = 10
	}
	first, seeds := stressSeeds(t, "MIRRORCRASH", def)
	for seed := first + 1; seed <= first+seeds; seed++ {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { mirrorCrashSeed(t, seed) })
	}
}

func mirrorCrashSeed(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 77))
	r := newMirrorRig(t, 16, 64<<10, 8+rng.Int64N(8), 2048)
	// allowed[lba]: the ids a read after the crash may return: the last
	// flushed one (0: never written) and every one written since.
	allowed := map[uint64][]uint64{} // id 0: never written (zeroes)
	n := 100 + rng.IntN(400)
	for id := uint64(1); id <= uint64(n); id++ {
		lba := rng.Uint64N(2048)
		r.write(lba, id)
		if allowed[lba] == nil {
			allowed[lba] = []uint64{0}
		}
		allowed[lba] = append(allowed[lba], id)
		if rng.IntN(20) == 0 {
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
			for l, ids := range allowed {
				allowed[l] = ids[len(ids)-1:]
			}
		}
	}
	clones := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 0.5, TornProb: 0.1, Rand: rand.New(rand.NewPCG(seed, 78))}, r.a.mem, r.b.mem, r.back)
	r.set.crashStop()
	r.specs = []BackingSpec{{Name: "a", Dev: clones[2]}}
	check := func(how string) {
		t.Helper()
		p := make([]byte, blockSize)
		for lba, ids := range allowed {
			if err := r.vol.ReadAt(p, int64(lba)*blockSize); err != nil {
				t.Fatalf("%s: read lba %d: %v", how, lba, err)
			}
			// Per 512-byte sector (a power cut tears unsynced writes
			// so): one of the allowed versions.
			for sec := 0; sec < blockSize; sec += 512 {
				ok := false
				for _, id := range ids {
					want := make([]byte, blockSize)
					if id != 0 {
						want = mstamp(lba, id)
					}
					ok = ok || bytes.Equal(p[sec:sec+512], want[sec:sec+512])
				}
				if !ok {
					t.Fatalf("%s: lba %d sector %d holds none of writes %v (first sector: write %d)", how, lba, sec/512, ids, binary.LittleEndian.Uint64(p[8:]))
				}
			}
		}
	}
	a, b := newMember(clones[0]), newMember(clones[1])
	switch seed % 3 {
	case 0:
		r.open(a, b, false)
		check("reopened on both")
	case 1:
		r.open(nil, b, true)
		check("reopened on B alone")
	case 2:
		r.open(a, b, false)
		a.pulled.Store(true)
		check("reopened on both, then A pulled")
	}
}

// TestMirrorMemberAlone: a member given alone as the cache device opens
// in its role (B is recognised by its label, although smaller than the
// layout) once the other's failure is recorded.
func TestMirrorMemberAlone(t *testing.T) {
	r := newMirrorRig(t, 16, 64<<10, 8, 1024)
	r.write(3, 1)
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	r.a.pulled.Store(true)
	r.verify(map[uint64]uint64{3: 1})
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	r.open(r.b, nil, false)
	r.verify(map[uint64]uint64{3: 1})
	if st := r.set.Stats().Mirror; st == nil || !st.Degraded || st.Failed != "A" {
		t.Fatalf("mirror stats %+v", st)
	}
}

// TestMirrorDegradedWritebackFullSpeed: a mirrored set that loses a
// member writes its dirty data back at full speed at once, though the
// client is busy and the dirty data is under the writeback target (where
// a redundant set writes nothing back): a second failure would lose it.
func TestMirrorDegradedWritebackFullSpeed(t *testing.T) {
	r := newMirrorRig(t, 16, 64<<10, 16, 1024)
	busy := func() { r.vol.lastIO.Store(nowNanos() + int64(time.Hour)) } // never idle
	for lba := range uint64(8) {
		r.write(lba, lba+1)
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	busy()
	if rate := r.set.wbRate(r.vol); rate != 0 {
		t.Fatalf("redundant set, busy client, dirty under the target: writeback rate %d, want 0 (the test shows nothing)", rate)
	}
	if d := r.set.Stats().DirtyBlocks; d == 0 {
		t.Fatal("no dirty data before the failure")
	}
	r.b.pulled.Store(true)
	r.write(100, 1)
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	busy()
	if st := r.set.Stats().Mirror; st == nil || !st.Degraded {
		t.Fatalf("not degraded after pulling B: %+v", st)
	}
	deadline := time.Now().Add(60 * time.Second) // a hang guard, not a timing assertion
	for r.set.Stats().DirtyBlocks > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("degraded set, busy client: %d dirty blocks still not written back after 60 s", r.set.Stats().DirtyBlocks)
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.verify(map[uint64]uint64{0: 1, 1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8, 100: 1})
}

// TestMirrorBothLost: losing both members is the single device's
// failover. With no background writeback every block written stays dirty
// on the cache devices; A is pulled (the set degrades to B), then B: the
// set fails over, a read of a dirty block fails as unreachable instead of
// returning the backing device's older data, a write over one is fenced,
// Flush reports the writes since the last flush as lost, and blocks never
// cached go to the backing device and read back.
func TestMirrorBothLost(t *testing.T) {
	r := newMirrorRig(t, 16, 64<<10, 16, 1024)
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	s, err := Open(r.a, r.specs, OpenOptions{Mirror: r.b, testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	r.set = s
	r.vol, _ = s.Volume("a")
	for lba := uint64(0); lba < 100; lba++ {
		r.write(lba, 1)
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	for lba := uint64(100); lba < 150; lba++ {
		r.write(lba, 2)
	}
	r.a.pulled.Store(true)
	want := map[uint64]uint64{}
	for lba := uint64(0); lba < 150; lba++ {
		want[lba] = 1 + lba/100
	}
	r.verify(want)
	if st := r.set.Stats(); st.Failed || st.Mirror == nil || !st.Mirror.Degraded {
		t.Fatalf("after pulling A: failed %v, mirror %+v; want degraded on B", st.Failed, st.Mirror)
	}
	r.b.pulled.Store(true)
	p := make([]byte, blockSize)
	for lba := uint64(0); lba < 150; lba++ {
		err := r.vol.ReadAt(p, int64(lba)*blockSize)
		if !errors.Is(err, ErrDirtyUnreachable) {
			t.Fatalf("read of dirty lba %d with both members lost: %v, want ErrDirtyUnreachable", lba, err)
		}
	}
	if st := r.set.Stats(); !st.Failed {
		t.Fatalf("both members lost: the set did not fail over (stats %+v)", st)
	}
	if err := r.vol.WriteAt(mstamp(7, 3), 7*blockSize, false); !errors.Is(err, ErrDirtyUnreachable) {
		t.Fatalf("write over an unreachable dirty block: %v, want it fenced (ErrDirtyUnreachable)", err)
	}
	if err := r.vol.Flush(); !errors.Is(err, ErrLostWrites) {
		t.Fatalf("flush after losing the writes since the last flush: %v, want ErrLostWrites", err)
	}
	for lba := uint64(500); lba < 510; lba++ {
		r.write(lba, 4)
		want := map[uint64]uint64{lba: 4}
		r.verify(want)
	}
	if _, err := r.back.ReadAt(p, 500*blockSize); err != nil || !bytes.Equal(p, mstamp(500, 4)) {
		t.Fatalf("a write after failover to a block never cached is not on the backing device (%v)", err)
	}
}
