package objstore

import (
	"bytes"
	"errors"
	"flag"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/tiercache/tiercache/device/devicetest"
	"github.com/tiercache/tiercache/internal/s3test"
)

var faultSeed = flag.Uint64("fault-seed", 1, "seed of TestFaults")

// TestFaults runs writes, Syncs, reads and garbage collection rounds through a
// proxy that gives one request in six a fault: 503, 500, a connection
// reset before the request reaches the store or after it did (a PUT
// stored, its answer lost), a response body cut in half, a body
// trickling in 4 KiB pieces, a delay, or no answer at all until the call
// times out (a dead peer; at most four). Each store call is tried twice
// within a 3 s timeout, so some calls fail and some retries meet the
// effect of the attempt before them. Every read that succeeds must return
// the data last written; every Sync that fails must fail retryably (never
// fenced: no fault may look like another owner); the device must never
// return corrupt data as good. Once the faults stop, one Sync stores
// everything and a fresh opener, straight to the store, reads exactly
// what was written.
//
// Seeds 3 and 4 fenced the device before a head or lease write whose
// answer was lost was recognised on the retry (a head of the device's
// own generation, a lease with its nonce).
//
// Repro: go test ./device/objstore -run TestFaults -fault-seed N
func TestFaults(t *testing.T) {
	t.Logf("seed %d", *faultSeed)
	srv, direct := testEnv(t)
	proxy := s3test.NewProxy(t, srv)
	const size = 1 << 20
	const blocks = size / 4096
	l := newImage(t, direct, size, 4096)
	l.Endpoint = proxy.Endpoint()
	// Garbage collection in the workload and no lease renewal during it,
	// so that a seed gives the same sequence of requests every run.
	d := mustOpen(t, l, Options{Tries: 2, Timeout: 3 * time.Second, SegmentBytes: 64 << 10, CheckpointEvery: 4, GCThreshold: -1, LeaseTTL: time.Hour})

	frng := rand.New(rand.NewPCG(*faultSeed, 2))
	all := s3test.AllFaults()
	hangs := 0
	proxy.SetFaults(func(*http.Request) s3test.Fault {
		if frng.IntN(6) != 0 {
			return s3test.Pass
		}
		f := all[frng.IntN(len(all))]
		if f == s3test.Hang {
			if hangs == 4 {
				return s3test.Pass
			}
			hangs++
		}
		return f
	})

	rng := rand.New(rand.NewPCG(*faultSeed, 1))
	want := make([]byte, size)
	got := make([]byte, 4096)
	var syncs, failedSyncs, reads, failedReads, failedWrites int
	for round := range 60 {
		for w := range 8 {
			b := rng.Int64N(blocks)
			p := want[b*4096 : (b+1)*4096]
			devicetest.Fill(p, uint64(round<<8|w))
			// A write goes to memory; it fails only when it filled a
			// segment whose store failed. Then it is written again, as
			// writeback does.
			for try := 0; ; try++ {
				_, err := d.WriteAt(p, b*4096)
				if err == nil {
					break
				}
				failedWrites++
				if errors.Is(err, ErrFenced) || try == 5 {
					t.Fatalf("round %d: write: %v", round, err)
				}
			}
		}
		syncs++
		if err := d.Sync(); err != nil {
			failedSyncs++
			if errors.Is(err, ErrFenced) {
				t.Fatalf("round %d: Sync fenced by a fault: %v", round, err)
			}
		}
		if round%5 == 4 {
			if _, err := d.GC(DefaultGCThreshold, DefaultGCBytes); errors.Is(err, ErrFenced) {
				t.Fatalf("round %d: GC fenced by a fault: %v", round, err)
			}
		}
		for range 4 {
			b := rng.Int64N(blocks)
			reads++
			if _, err := d.ReadAt(got, b*4096); err != nil {
				failedReads++
				continue
			}
			if !bytes.Equal(got, want[b*4096:(b+1)*4096]) {
				t.Fatalf("round %d: block %d read back wrong through the faults", round, b)
			}
		}
	}
	proxy.SetFaults(nil)
	if err := d.Sync(); err != nil {
		t.Fatalf("Sync after the faults stopped: %v", err)
	}
	st := d.Stats()
	t.Logf("faults by kind: %v; %d of %d Syncs, %d of %d reads and %d writes failed; %d GC rounds", proxy.Counts(), failedSyncs, syncs, failedReads, reads, failedWrites, st.GCRuns)
	if failedSyncs+failedReads+failedWrites == 0 {
		t.Error("no Sync or read failed: the faults did not reach past the retries")
	}
	for _, f := range all {
		if proxy.Counts()[f] == 0 {
			t.Errorf("no request met fault %v", f)
		}
	}
	d.Close()
	l.Endpoint = direct.Endpoint
	r := mustOpen(t, l, Options{ReadOnly: true})
	all2 := make([]byte, size)
	if _, err := r.ReadAt(all2, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(all2, want) {
		t.Fatal("after the faults the image differs from what was written")
	}
}
