package objstore

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/device/devicetest"
)

// TestGC: a 50 % overwrite workload (the whole image written, then random
// halves of it rewritten, a Sync every 64 writes) with a garbage
// collection round after every eighth Sync, then a last round. The image
// must read back exactly, before and after a reopen, and the bucket must
// hold at most twice the live data.
func TestGC(t *testing.T) {
	_, base := testEnv(t)
	const size = 4 << 20
	const blocks = size / 4096
	l := newImage(t, base, size, 4096)
	d := mustOpen(t, l, Options{CheckpointEvery: 8, SegmentBytes: 256 << 10, GCThreshold: -1})
	want := make([]byte, size)
	rng := rand.New(rand.NewPCG(3, 3))
	n := 0
	write := func(b int64) {
		p := want[b*4096 : (b+1)*4096]
		devicetest.Fill(p, uint64(n))
		if _, err := d.WriteAt(p, b*4096); err != nil {
			t.Fatal(err)
		}
		if n++; n%64 == 0 {
			if err := d.Sync(); err != nil {
				t.Fatal(err)
			}
		}
		if n%(8*64) == 0 {
			if _, err := d.GC(0.5, 1<<30); err != nil {
				t.Fatal(err)
			}
		}
	}
	for b := range int64(blocks) {
		write(b)
	}
	for range 4 {
		for _, b := range rng.Perm(blocks)[:blocks/2] {
			write(int64(b))
		}
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	res, err := d.GC(0.5, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	st := d.Stats()
	amp := float64(res.StoredBytes) / float64(res.LiveBytes)
	t.Logf("%d rounds, %d blocks rewritten (%d bytes PUT by GC per %d by writeback: GC write amplification %.2f), %d segments deleted; stored %d for %d live: space amplification %.2f",
		st.GCRuns, st.GCBlocks, st.GCBytesPut, st.BytesPut, float64(st.GCBytesPut)/float64(st.BytesPut), st.GCDeleted, res.StoredBytes, res.LiveBytes, amp)
	if st.GCDeleted == 0 || amp > 2 {
		t.Fatalf("garbage collection deleted %d segments, space amplification %.2f (want <= 2)", st.GCDeleted, amp)
	}
	check := func(d *Device, what string) {
		got := make([]byte, size)
		if _, err := d.ReadAt(got, 0); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: the image differs from what was written", what)
		}
	}
	check(d, "after GC")
	d.Close()
	in, err := Stat(l)
	if err != nil {
		t.Fatal(err)
	}
	if in.StoredBytes != res.StoredBytes {
		t.Fatalf("bucket holds %d segment bytes, GC counted %d", in.StoredBytes, res.StoredBytes)
	}
	d2 := mustOpen(t, l, Options{})
	check(d2, "reopened after GC")
}

// TestGCUnderLoad: the background loop collects while a 50 % overwrite
// workload goes on (writes, Syncs, reads checked against the model after
// every Sync), unbounded in rate; the workload runs until the loop has
// rewritten blocks and deleted segments in several rounds. The image must
// then read back exactly, before and after a reopen.
func TestGCUnderLoad(t *testing.T) {
	_, base := testEnv(t)
	const size = 2 << 20
	const blocks = size / 4096
	l := newImage(t, base, size, 4096)
	d := mustOpen(t, l, Options{CheckpointEvery: 4, SegmentBytes: 128 << 10, GCRate: -1})
	want := make([]byte, size)
	rng := rand.New(rand.NewPCG(5, 5))
	got := make([]byte, 4096)
	n := 0
	for round := 0; ; round++ {
		st := d.Stats()
		if st.GCRuns >= 3 && st.GCBlocks > 0 && st.GCDeleted > 0 {
			t.Logf("%d rounds of 64 writes: %d GC rounds, %d blocks rewritten, %d segments deleted; stored %d for %d live",
				round, st.GCRuns, st.GCBlocks, st.GCDeleted, st.StoredBytes, st.LiveBytes)
			break
		}
		if round == 5000 {
			t.Fatalf("after %d rounds the background loop ran %d GC rounds (%d blocks, %d deletions)", round, st.GCRuns, st.GCBlocks, st.GCDeleted)
		}
		for range 64 {
			b := rng.Int64N(blocks)
			if round == 0 || rng.IntN(2) == 0 {
				b = int64(n % blocks)
			}
			p := want[b*4096 : (b+1)*4096]
			devicetest.Fill(p, uint64(n))
			n++
			if _, err := d.WriteAt(p, b*4096); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
		for range 16 {
			b := rng.Int64N(blocks)
			if _, err := d.ReadAt(got, b*4096); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want[b*4096:(b+1)*4096]) {
				t.Fatalf("round %d: block %d reads back wrong during garbage collection", round, b)
			}
		}
	}
	check := func(d *Device, what string) {
		all := make([]byte, size)
		if _, err := d.ReadAt(all, 0); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !bytes.Equal(all, want) {
			t.Fatalf("%s: the image differs from what was written", what)
		}
	}
	check(d, "after the workload")
	d.Close()
	d2 := mustOpen(t, l, Options{GCThreshold: -1})
	check(d2, "reopened")
}
