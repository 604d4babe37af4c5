package cache

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// newSingleRig is a mirrorRig whose set is on one cache device (r.a; r.b
// nil until an attach): nBuckets buckets of bucketSize, one backing
// device of backBlocks blocks.
func newSingleRig(t *testing.T, nBuckets, bucketSize, backBlocks int64) *mirrorRig {
	t.Helper()
	jl := int64(minJournalLen)
	aMem := device.NewMem(cacheSizeFor(nBuckets, bucketSize, jl, 1))
	back := device.NewMem(backBlocks * blockSize)
	r := &mirrorRig{t: t, a: newMember(aMem), back: back, specs: []BackingSpec{{Name: "a", Dev: back}}}
	if _, err := Format(r.a, r.specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	r.open(r.a, nil, false)
	return r
}

// newB returns an empty device for member B with slots slots.
func (r *mirrorRig) newB(slots int64) *member {
	return newMember(device.NewMem(r.set.lay.BucketsOff + slots*(r.set.lay.BucketSize+blockSize)))
}

// TestAttachMirrorUnderWrites: a set on one cache device takes a mirror
// while a writer keeps writing (dirty data in writeback mode, some
// flushed); status says DEGRADED (B failed, resilvering) during the copy,
// without the full-speed writeback of a degraded set, and redundant after
// it; then A is pulled and every block reads back
// from B alone, in the running set and after reopening B alone.
func TestAttachMirrorUnderWrites(t *testing.T) {
	r := newSingleRig(t, 32, 64<<10, 2048)
	rng := rand.New(rand.NewPCG(21, 1))
	want := map[uint64]uint64{}
	id := uint64(0)
	for range 300 {
		id++
		lba := rng.Uint64N(2048)
		r.write(lba, id)
		want[lba] = id
		if id == 200 {
			if err := r.vol.Flush(); err != nil {
				t.Fatal(err)
			}
		}
	}
	if st := r.set.Stats(); st.Mirror != nil || st.DirtyBlocks == 0 {
		t.Fatalf("before the attach: mirror %+v, %d dirty blocks; want no mirror and dirty data", st.Mirror, st.DirtyBlocks)
	}
	b := r.newB(32)
	var got string
	var err error
	var progress []ResilverProgress
	var during []*MirrorStats
	written := r.writeDuring(rand.New(rand.NewPCG(22, 1)), 2048, want, &id, func(wrote <-chan struct{}) {
		got, err = r.set.ReplaceMirrorMember(context.Background(), b, ResilverOptions{Progress: func(p ResilverProgress) {
			progress = append(progress, p)
			during = append(during, r.set.Stats().Mirror)
			if r.set.mirrorDegraded() {
				t.Error("writeback runs at the full speed of a degraded set during an attach")
			}
			<-wrote // writes interleave with every step of the copy
		}})
	})
	if err != nil {
		t.Fatal(err)
	}
	if got != "B" {
		t.Fatalf("attached member %s, want B", got)
	}
	if len(progress) == 0 || progress[0].Total == 0 || progress[len(progress)-1].Done != progress[len(progress)-1].Total {
		t.Fatalf("progress reports %+v", progress)
	}
	for i, st := range during {
		if st == nil || !st.Degraded || st.Failed != "B" || st.Resilver == nil || st.Resilver.Member != "B" {
			t.Fatalf("status during the attach (report %d): %+v; want DEGRADED, B failed and resilvering", i, st)
		}
	}
	if st := r.set.Stats().Mirror; st == nil || st.Degraded || st.Resilver != nil || st.SlotsUsed == 0 {
		t.Fatalf("after the attach: %+v", st)
	}
	sb, _, err := ondisk.ReadSuperblock(r.a.mem)
	if err != nil || !sb.HasFeature(ondisk.FeatureMirror) {
		t.Fatalf("A's superblock after the attach: %v, mirrored %v", err, err == nil && sb.HasFeature(ondisk.FeatureMirror))
	}
	t.Logf("%d writes during the attach, %d progress reports, total %d bytes", written, len(progress), progress[len(progress)-1].Total)
	for range 50 {
		id++
		lba := rng.Uint64N(2048)
		r.write(lba, id)
		want[lba] = id
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	if r.set.Stats().DirtyBlocks == 0 {
		t.Fatal("no dirty data left when A is pulled: the test proves nothing")
	}
	r.a.pulled.Store(true)
	r.verify(want)
	if err := r.set.Close(); err != nil {
		t.Fatal(err)
	}
	r.open(nil, b, false)
	r.verify(want)
}

// TestAttachMirrorCrash: a crash before each step of an attach (A's
// label, the superblock's FeatureMirror, each label write of the
// resilver), in the metadata copy, in the bucket copy and after the end:
// nothing flushed is lost. Until FeatureMirror is durable the set opens
// on A as a set on one device (A's label ignored); then as a mirror
// degraded on A, B refused alone (not trusted) until its in-sync label is
// durable; after the end on both, and on B alone with every block.
func TestAttachMirrorCrash(t *testing.T) {
	r := newSingleRig(t, 16, 64<<10, 1024)
	rng := rand.New(rand.NewPCG(23, 1))
	want := map[uint64]uint64{}
	id := uint64(0)
	// More blocks than the cache holds: buckets are written back,
	// evicted and reused while the attach runs.
	for range 300 {
		id++
		lba := rng.Uint64N(1024)
		r.write(lba, id)
		want[lba] = id
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	b := r.newB(16) // one slot per bucket: no attach refused for too few
	// Devices: A, B, backing.
	c := &crashPoints{seed: 24, devs: []*device.Mem{r.a.mem, b.mem, r.back}, copyLabels: 3, bucketsOff: r.set.lay.BucketsOff}
	sbSeen := false
	r.a.hook.Store(c.hook("A", false, func(op faultdev.Op, labels int) string {
		if op.Kind == faultdev.Write && labels == 1 && !sbSeen && (op.Offset == 0 || op.Offset == ondisk.SBCopySize) {
			sbSeen = true
			return "before the superblock says FeatureMirror"
		}
		return ""
	}))
	b.hook.Store(c.hook("B", true, nil))
	if _, err := r.set.ReplaceMirrorMember(context.Background(), b, ResilverOptions{}); err != nil {
		t.Fatal(err)
	}
	labels, inMeta, inBuckets, points := c.end("after the attach")
	r.a.hook.Store(nil)
	b.hook.Store(nil)
	// Labels: A's attach label, then the resilver's four (B, A, A, B).
	if labels != 5 || !sbSeen || !inMeta || !inBuckets || len(points) != 9 {
		t.Fatalf("%d label writes, superblock seen %v, metadata copy seen %v, bucket copy seen %v, %d crash points: the test misses steps", labels, sbSeen, inMeta, inBuckets, len(points))
	}
	r.set.crashStop()
	for i, p := range points {
		t.Run(fmt.Sprintf("%d", i), func(t *testing.T) {
			r.t = t
			a, nb := newMember(p.devs[0]), newMember(p.devs[1])
			r.specs = []BackingSpec{{Name: "a", Dev: p.devs[2]}}
			switch {
			case i <= 1: // no FeatureMirror: a set on one device
				// A's label, written before the crash at point 1, is a
				// leftover that says nothing about A.
				if _, ok, err := mirror.ReadLabel(a); err != nil || ok != (i == 1) {
					t.Fatalf("%s: A's label: present %v (%v), want %v", p.name, ok, err, i == 1)
				}
				if got := MirrorMember(a); got != "" {
					t.Fatalf("%s: MirrorMember(A) = %q on a set on one device, want \"\"", p.name, got)
				}
				r.open(a, nil, false)
				if st := r.set.Stats().Mirror; st != nil {
					t.Fatalf("%s: opened A alone: mirror %+v, want a set on one device", p.name, st)
				}
				r.verify(want)
				r.set.crashStop()
				if _, err := Open(a, r.specs, OpenOptions{Mirror: nb}); err == nil {
					t.Fatalf("%s: opened with a mirror that was never attached", p.name)
				} else {
					t.Logf("%s: A with B: %v", p.name, err)
				}
			case i == 2: // FeatureMirror durable, B not labelled yet
				if got := MirrorMember(a); got != "A" {
					t.Fatalf("%s: MirrorMember(A) = %q, want \"A\"", p.name, got)
				}
				if _, err := Open(a, r.specs, OpenOptions{Mirror: nb}); err == nil || !strings.Contains(err.Error(), "no mirror label") {
					t.Fatalf("%s: opened on both: %v, want a refusal of the unlabelled B", p.name, err)
				}
				r.open(a, nil, false)
				if st := r.set.Stats().Mirror; st == nil || !st.Degraded || st.Failed != "B" {
					t.Fatalf("%s: opened A alone: mirror %+v, want degraded, B failed", p.name, st)
				}
				r.verify(want)
				r.set.crashStop()
			default:
				trusted := i == len(points)-1
				if trusted {
					// B alone first (a copy of the point): opened on
					// both, B would be resynced from A.
					c := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 1}, p.devs...)
					specs := r.specs
					r.specs = []BackingSpec{{Name: "a", Dev: c[2]}}
					r.open(nil, newMember(c[1]), true)
					r.verify(want)
					r.set.crashStop()
					r.specs = specs
				}
				r.open(a, nb, false)
				st := r.set.Stats().Mirror
				if st == nil || st.Degraded == trusted || (!trusted && st.Failed != "B") {
					t.Fatalf("%s: opened on both: mirror %+v, want B trusted: %v", p.name, st, trusted)
				}
				r.verify(want)
				if trusted {
					a.pulled.Store(true)
					r.verify(want)
				}
				r.set.crashStop()
				s, err := Open(nil, r.specs, OpenOptions{Mirror: nb, MirrorMissing: true})
				if trusted != (err == nil) {
					t.Fatalf("%s: B alone: open error %v, want an error: %v", p.name, err, !trusted)
				}
				if err == nil {
					r.set = s
					r.vol, _ = s.Volume("a")
					r.verify(want)
					s.crashStop()
				} else {
					t.Logf("%s: B alone: %v", p.name, err)
				}
			}
		})
	}
}

// TestAttachMirrorPagedIndex: a set formatted with index pages on one
// device takes a mirror, then writes, flushes and checkpoints three times;
// after a crash B alone (and both) recover every write. The page store
// held the device the set was opened on, so every index page and root
// written after the attach went to A only: B alone failed with "open:
// replaying journal: cache: corrupt metadata: acknowledged metadata lost:
// the journal head record names checkpoint generation 5, but the newest
// valid checkpoint is generation 2 (the slot at offset 3325952 holds a
// zeroed header)".
func TestAttachMirrorPagedIndex(t *testing.T) {
	back := device.NewMem(1024 * blockSize)
	r := &mirrorRig{t: t, a: newMember(device.NewMem(32 << 20)), back: back, specs: []BackingSpec{{Name: "a", Dev: back}}}
	if _, err := Format(r.a, r.specs, FormatOptions{BucketSize: 64 << 10, JournalSize: minJournalLen, IndexPages: true}); err != nil {
		t.Fatal(err)
	}
	r.open(r.a, nil, false)
	want := map[uint64]uint64{}
	for lba := range uint64(20) {
		r.write(lba, 1)
		want[lba] = 1
	}
	if err := r.vol.Flush(); err != nil {
		t.Fatal(err)
	}
	b := r.newB(16)
	if _, err := r.set.ReplaceMirrorMember(context.Background(), b, ResilverOptions{}); err != nil {
		t.Fatal(err)
	}
	for round := range uint64(3) {
		for lba := range uint64(60) {
			r.write(round*100+lba, round+2)
			want[round*100+lba] = round + 2
		}
		if err := r.vol.Flush(); err != nil {
			t.Fatal(err)
		}
		r.set.commitMu.Lock()
		err := r.set.checkpointLocked(0)
		r.set.commitMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
	}
	if st := r.set.Stats().Mirror; st == nil || st.Degraded {
		t.Fatalf("after the attach: %+v", st)
	}
	r.set.crashStop()
	c := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 1}, r.a.mem, b.mem, back)
	r.open(nil, b, true)
	r.verify(want)
	r.set.crashStop()
	r.specs = []BackingSpec{{Name: "a", Dev: c[2]}}
	r.open(newMember(c[0]), newMember(c[1]), false)
	r.verify(want)
}

// TestAttachMirrorRefusals: an attach refuses, before it changes anything
// (the set stays on one device, A carries no label), a mirror device too
// small, the cache device itself and a device holding data (taken with
// Force).
func TestAttachMirrorRefusals(t *testing.T) {
	ctx := context.Background()
	r := newSingleRig(t, 16, 64<<10, 1024)
	r.write(1, 1)
	refused := func(dev device.Device, force bool, want string) {
		t.Helper()
		_, err := r.set.ReplaceMirrorMember(ctx, dev, ResilverOptions{Force: force})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("attach: %v; want a refusal saying %q", err, want)
		}
		if st := r.set.Stats().Mirror; st != nil {
			t.Fatalf("after a refusal: mirror %+v", st)
		}
		if _, ok, _ := mirror.ReadLabel(r.a.mem); ok {
			t.Fatal("after a refusal: A carries a mirror label")
		}
		t.Logf("refused: %v", err)
	}
	refused(r.newB(2), false, "at least")
	refused(r.set.dev.Get(), false, "cache device itself")
	junk := r.newB(8)
	if _, err := junk.WriteAt([]byte{0xab}, 8192); err != nil {
		t.Fatal(err)
	}
	refused(junk, false, "force to overwrite")
	if _, err := r.set.ReplaceMirrorMember(ctx, junk, ResilverOptions{Force: true}); err != nil {
		t.Fatalf("forced over a device holding data: %v", err)
	}
	if st := r.set.Stats().Mirror; st == nil || st.Degraded {
		t.Fatalf("after the forced attach: %+v", st)
	}
	r.a.pulled.Store(true)
	r.verify(map[uint64]uint64{1: 1})
}
