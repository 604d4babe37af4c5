package objstore

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/tiercache/tiercache/device/devicetest"
	"github.com/tiercache/tiercache/internal/s3test"
)

// crashWorkload writes rounds of random block writes and write-zeroes to d,
// each round ended by a Sync, until a Sync fails. states[i] is the image
// after round i's writes (states[0]: all zero); acked is the number of
// rounds whose Sync returned nil. With gcEvery > 0 a garbage-collection
// round follows every gcEvery-th Sync (the workload stops when it fails).
func crashWorkload(d *Device, size int64, rounds int, seed uint64, gcEvery int, beforeSync func(round int)) (states [][]byte, acked int) {
	rng := rand.New(rand.NewPCG(seed, 1))
	cur := make([]byte, size)
	states = append(states, slices.Clone(cur))
	const bs = 4096
	for r := range rounds {
		for w := range 1 + rng.IntN(6) {
			n := int64(bs * (1 + rng.IntN(3)))
			off := rng.Int64N(size/bs-3) * bs
			if rng.IntN(5) == 0 {
				if d.WriteZeroes(off, n) != nil {
					return states, acked
				}
				clear(cur[off : off+n])
				continue
			}
			p := make([]byte, n)
			devicetest.Fill(p, seed<<20|uint64(r)<<8|uint64(w))
			if _, err := d.WriteAt(p, off); err != nil {
				return states, acked
			}
			copy(cur[off:], p)
		}
		states = append(states, slices.Clone(cur))
		if beforeSync != nil {
			beforeSync(r)
		}
		if d.Sync() != nil {
			return states, acked
		}
		acked++
		if gcEvery > 0 && acked%gcEvery == 0 {
			if _, err := d.GC(DefaultGCThreshold, 1<<30); err != nil {
				return states, acked
			}
		}
	}
	return states, acked
}

// TestCrashBetweenPuts cuts the link to the store after every possible
// number of PUTs of a workload (segment parts, checkpoints, head updates)
// and recovers from the bucket alone: the image must be exactly the state
// after the last acknowledged Sync, or after the Sync in progress at the
// cut (its last segment may have landed before the acknowledgement was
// lost), never a mix and never anything older. Garbage collection runs in
// the workload, after every third Sync (not in the background: the PUTs
// must come in the same order in every run), so the cuts fall inside its
// rounds too.
func TestCrashBetweenPuts(t *testing.T) {
	srv, direct := testEnv(t)
	proxy := s3test.NewProxy(t, srv)
	viaProxy := direct
	viaProxy.Endpoint = proxy.Endpoint()
	const size, rounds = 128 << 10, 10
	// Small segments (multi-part epochs) and frequent checkpoints, so
	// that the cuts fall between parts and around head updates too.
	o := Options{SegmentBytes: 16 << 10, CheckpointEvery: 3, Tries: 1, GCThreshold: -1}

	// A clean run counts the workload's PUTs.
	l := newImage(t, direct, size, 4096)
	l.Endpoint = proxy.Endpoint()
	d := mustOpen(t, l, o)
	proxy.CutAfter(-1)
	if _, acked := crashWorkload(d, size, rounds, 1, 3, nil); acked != rounds {
		t.Fatalf("clean run acknowledged %d of %d rounds", acked, rounds)
	}
	total := proxy.Puts()
	st := d.Stats()
	d.Close()
	t.Logf("%d PUTs in a clean run (%d segments, %d checkpoints, %d GC rounds rewriting %d blocks and deleting %d segments)",
		total, st.SegmentsPut, st.Checkpoints, st.GCRuns, st.GCBlocks, st.GCDeleted)
	if st.GCBlocks == 0 || st.GCDeleted == 0 {
		t.Fatal("the workload does not exercise garbage collection: the cuts would miss it")
	}

	for cut := 0; cut < total; cut++ {
		l := newImage(t, direct, size, 4096)
		l.Endpoint = viaProxy.Endpoint
		proxy.CutAfter(-1)
		d, err := Open(l, o)
		if err != nil {
			t.Fatal(err)
		}
		proxy.CutAfter(cut)
		states, acked := crashWorkload(d, size, rounds, 1, 3, nil)
		// d is abandoned, as by a crash: not closed, its lease left live.
		l.Endpoint = direct.Endpoint
		r, err := Open(l, Options{Force: true})
		if err != nil {
			t.Fatalf("cut after %d PUTs: open after the crash: %v", cut, err)
		}
		got := make([]byte, size)
		if _, err := r.ReadAt(got, 0); err != nil {
			t.Fatalf("cut after %d PUTs: %v", cut, err)
		}
		r.Close()
		switch {
		case bytes.Equal(got, states[acked]):
		case acked+1 < len(states) && bytes.Equal(got, states[acked+1]):
		default:
			which := -1
			for i, s := range states {
				if bytes.Equal(got, s) {
					which = i
				}
			}
			t.Fatalf("cut after %d PUTs: %d rounds acknowledged, the recovered image is round %d's state (-1: no round's)", cut, acked, which)
		}
	}
}

// TestServerKilled kills the store (SIGKILL) concurrently with a Sync,
// after a few acknowledged rounds, restarts it, and checks the same promise
// as TestCrashBetweenPuts.
func TestServerKilled(t *testing.T) {
	srv, base := testEnv(t)
	const size = 512 << 10
	for seed := range uint64(3) {
		l := newImage(t, base, size, 4096)
		d, err := Open(l, Options{SegmentBytes: 16 << 10, CheckpointEvery: 2, Tries: 1})
		if err != nil {
			t.Fatal(err)
		}
		killAt := int(2 + seed)
		var killed chan struct{}
		states, acked := crashWorkload(d, size, 1000, seed, 0, func(round int) {
			if round == killAt {
				killed = make(chan struct{})
				go func() { srv.Kill(); close(killed) }()
			}
		})
		<-killed
		res := struct {
			states [][]byte
			acked  int
		}{states, acked}
		srv.Restart()
		r, err := Open(l, Options{Force: true})
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, size)
		if _, err := r.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		r.Close()
		d.Close()
		if !bytes.Equal(got, res.states[res.acked]) && !(res.acked+1 < len(res.states) && bytes.Equal(got, res.states[res.acked+1])) {
			t.Fatalf("seed %d: %d rounds acknowledged; the recovered image is neither that state nor the next", seed, res.acked)
		}
		t.Logf("seed %d: killed after %d acknowledged rounds", seed, res.acked)
	}
}
