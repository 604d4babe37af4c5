package cache

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

var flagEpochSeed = flag.Int64("epoch-seed", -1, "run TestEpochPrefix for this seed only")

// TestEpochPrefix drops the cache device at random points in epoch order and
// checks the backing device alone: it must hold, for some flush epoch E, the
// image after E flushes, except that any block may instead hold a version
// written in epoch E (between flush E and flush E+1) — a flushed prefix plus
// a subset of the next epoch's writes, what a real disk may hold after a
// power cut. Writes are whole blocks stamped with their write id; the cache
// is small, so superseded versions, waits for space, eviction and GC moves
// all happen; background writeback runs with a random target while the test
// also steps writeback batches itself. The backing device is crash-cloned
// (unsynced writes kept or lost), as the cache device dying with the
// machine would leave it. Replay a failure with
//
//	go test ./cache -run TestEpochPrefix -epoch-seed N -v
func TestEpochPrefix(t *testing.T) {
	if *flagEpochSeed >= 0 {
		runEpochSeed(t, uint64(*flagEpochSeed))
		return
	}
	n := 300
	if testing.Short() || raceEnabled {
		n = 40
	}
	for seed := range uint64(n) {
		if !t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runEpochSeed(t, seed) }) {
			return
		}
	}
}

func runEpochSeed(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0xe7))
	const nblk = 48
	bs := int64(blockSize) * int64(2+rng.IntN(4))
	s, _, backs := newTestSet(t, int64(6+rng.IntN(6)), bs, nblk*blockSize)
	back := backs[0]
	v := s.vols[0]
	st := v.Settings()
	st.WritebackOrder = OrderEpoch
	st.WritebackPercent = []int{0, 10, 100}[rng.IntN(3)]
	st.SequentialCutoff = []int64{0, 16 << 10}[rng.IntN(2)] // no write bypass in epoch order either way
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	var log []string
	fail := func(f string, a ...any) {
		t.Helper()
		if len(log) > 80 {
			log = log[len(log)-80:]
		}
		t.Fatalf("seed %d: %s\nreplay: go test ./cache -run TestEpochPrefix -epoch-seed %d -v\nlast ops:\n  %s",
			seed, fmt.Sprintf(f, a...), seed, fmt.Sprint(log))
	}
	cur := make([]uint64, nblk)                         // write id per block now (0: never written)
	states := [][]uint64{append([]uint64(nil), cur...)} // states[k]: after k flushes
	var inEpoch []map[int]map[uint64]bool               // inEpoch[k][block]: ids written in epoch k
	inEpoch = append(inEpoch, map[int]map[uint64]bool{})
	wid := uint64(0)
	maxSup := int64(0)
	var degrades, returns, skipped int
	check := func() {
		if !v.Stats().BackingConsistent {
			// Degraded to lba order (order.go): no promise until the
			// next full drain.
			skipped++
			log = append(log, "check skipped: degraded")
			return
		}
		keep := []float64{0, 0.5, 1}[rng.IntN(3)]
		clone := back.CrashClone(device.CrashConfig{UnsyncedKeep: keep, Rand: rng})
		got := make([]uint64, nblk)
		p := make([]byte, blockSize)
		for b := range got {
			if _, err := clone.ReadAt(p, int64(b)*blockSize); err != nil {
				t.Fatal(err)
			}
			if !ondisk.IsZero(p) {
				got[b] = le.Uint64(p)
				want := make([]byte, blockSize)
				stamp(want, got[b], 0, int64(b)*blockSize)
				if !bytes.Equal(p, want) {
					fail("backing block %d holds a torn or foreign block (%s)", b, describeSectors(p))
				}
			}
		}
		for e := len(states) - 1; e >= 0; e-- {
			ok := true
			for b := range got {
				if got[b] != states[e][b] && !inEpoch[e][b][got[b]] {
					ok = false
					break
				}
			}
			if ok {
				log = append(log, fmt.Sprintf("check ok: prefix of %d epochs (of %d)", e, len(states)-1))
				return
			}
		}
		fail("backing device %v is no flushed prefix plus part of the next epoch; states %v", got, states)
	}
	for range 60 + rng.IntN(60) {
		switch k := rng.IntN(100); {
		case k < 50:
			b := rng.IntN(nblk)
			n := min(1+rng.IntN(4), nblk-b)
			// Sometimes through the backing device (writethrough) or as
			// zeroes (passed down): both must wait for older epochs.
			how := []string{"wb", "wb", "wb", "wb", "wt", "zero"}[rng.IntN(6)]
			p := make([]byte, n*blockSize)
			ids := make([]uint64, n)
			for i := range n {
				wid++
				ids[i] = wid
				stamp(p[i*blockSize:(i+1)*blockSize], wid, 0, int64(b+i)*blockSize)
			}
			log = append(log, fmt.Sprintf("write(%s) %d+%d ids %v", how, b, n, ids))
			var err error
			switch how {
			case "wb":
				err = v.WriteAt(p, int64(b)*blockSize, false)
			case "wt":
				if err = v.SetMode(Writethrough); err == nil {
					err = v.WriteAt(p, int64(b)*blockSize, false)
				}
				if err == nil {
					err = v.SetMode(Writeback)
				}
			case "zero":
				err = v.WriteZeroes(int64(b)*blockSize, int64(n)*blockSize, false, true, false)
				clear(ids)
			}
			if err != nil {
				fail("write: %v", err)
			}
			e := len(states) - 1
			for i, id := range ids {
				cur[b+i] = id
				if inEpoch[e][b+i] == nil {
					inEpoch[e][b+i] = map[uint64]bool{}
				}
				inEpoch[e][b+i][id] = true
			}
		case k < 65:
			log = append(log, "flush")
			if err := v.Flush(); err != nil {
				fail("flush: %v", err)
			}
			states = append(states, append([]uint64(nil), cur...))
			inEpoch = append(inEpoch, map[int]map[uint64]bool{})
		case k < 80:
			n := 1 + rng.IntN(8)
			log = append(log, fmt.Sprintf("writeback %d", n))
			if _, err := s.writebackEpoch(0, n); err != nil {
				fail("writeback: %v", err)
			}
		case k < 85:
			log = append(log, "gc")
			s.evictOne()
		case k < 90:
			b := rng.IntN(nblk)
			p := make([]byte, blockSize)
			if err := v.ReadAt(p, int64(b)*blockSize); err != nil {
				fail("read: %v", err)
			}
			if g := le.Uint64(p); (ondisk.IsZero(p) && cur[b] != 0) || (!ondisk.IsZero(p) && g != cur[b]) {
				fail("read block %d: id %d, want %d", b, g, cur[b])
			}
		case k < 92:
			// Writeback falls behind: the volume leaves epoch order.
			log = append(log, "degrade")
			before := v.Stats().WritebackDegrades
			v.degrade(degradeSpace)
			// Background writeback may have drained the volume and
			// brought it back since (no write came in between).
			if st := v.Stats(); st.BackingConsistent && st.DirtyBlocks != 0 || st.SupersededBlocks != 0 {
				fail("after degrade: consistent %v with %d dirty, %d superseded", st.BackingConsistent, st.DirtyBlocks, st.SupersededBlocks)
			}
			degrades += int(v.Stats().WritebackDegrades - before)
		case k < 94:
			// A full drain returns a degraded volume to epoch order.
			was := v.Stats().BackingConsistent
			log = append(log, "drain")
			if err := s.Drain(context.Background()); err != nil {
				fail("drain: %v", err)
			}
			if !v.Stats().BackingConsistent {
				fail("after a full drain the backing device is not consistent again")
			}
			if !was {
				returns++
			}
			check()
		default:
			check()
		}
		maxSup = max(maxSup, v.Stats().SupersededBlocks)
		if err := s.Check(); err != nil {
			fail("Check: %v", err)
		}
	}
	check()
	was := v.Stats().BackingConsistent
	if err := s.Drain(context.Background()); err != nil {
		fail("drain: %v", err)
	}
	if !was {
		returns++
	}
	if st := v.Stats(); st.DirtyBlocks != 0 || st.SupersededBlocks != 0 || !st.BackingConsistent {
		fail("after drain: %d dirty, %d superseded, consistent %v", st.DirtyBlocks, st.SupersededBlocks, st.BackingConsistent)
	}
	check()
	p := make([]byte, blockSize)
	for b := range cur {
		if _, err := back.ReadAt(p, int64(b)*blockSize); err != nil {
			t.Fatal(err)
		}
		if g := le.Uint64(p); (ondisk.IsZero(p) && cur[b] != 0) || (!ondisk.IsZero(p) && g != cur[b]) {
			fail("after drain, backing block %d holds id %d, want %d", b, g, cur[b])
		}
	}
	t.Logf("%d epochs, %d writes, up to %d superseded versions; %d degrades (%d by the engine), %d returns by a drain, %d checks skipped while degraded",
		len(states)-1, wid, maxSup, v.Stats().WritebackDegrades, int(v.Stats().WritebackDegrades)-degrades, returns, skipped)
}

// TestEpochBatchResumesAtCursor checks that epoch order's writeback sweeps
// the oldest epoch from where its last batch stopped, wrapping at the end
// of the volume, as lba order does: blocks cleaned and dirtied again
// behind the cursor wait for the next lap instead of being taken again
// before blocks dirty longer (with no client flush, all of a workload is
// one epoch).
func TestEpochBatchResumesAtCursor(t *testing.T) {
	const nblk = 64
	s, v := newEpochSetNoBackground(t, 16, nblk)
	p := make([]byte, blockSize)
	write := func(lbas ...int) {
		t.Helper()
		for _, b := range lbas {
			stamp(p, uint64(b)+1, 0, int64(b)*blockSize)
			if err := v.WriteAt(p, int64(b)*blockSize, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	batch := func(n int, want ...uint64) {
		t.Helper()
		items := s.takeEpochBatch(0, n)
		var got []uint64
		for _, it := range items {
			got = append(got, it.LBA)
		}
		s.mu.Lock()
		for _, it := range items {
			delete(v.idx.wbInflight, it.Loc)
		}
		s.mu.Unlock()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("batch of %d: LBAs %v, want %v", n, got, want)
		}
	}
	write(2, 5, 9, 20, 33, 40, 41, 60)
	batch(3, 2, 5, 9)
	batch(3, 20, 33, 40)
	// The next batch reaches the end of the volume and wraps to its start
	// (LBA-sorted, in one epoch any order is allowed).
	batch(3, 2, 41, 60)
	batch(2, 5, 9)
	// Written back for real: the cursor moves on past the blocks cleaned.
	if n, err := s.writebackEpoch(0, 3); err != nil || n != 3 {
		t.Fatalf("writeback: %d, %v", n, err)
	}
	// 20, 33, 40 are clean; 33 dirty again is behind the cursor (41): the
	// lap ends first.
	write(33)
	batch(2, 41, 60)
	batch(8, 2, 5, 9, 33, 41, 60)
	// A flush starts a new epoch: only the oldest one is taken.
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	write(21)
	batch(8, 2, 5, 9, 33, 41, 60)
}

// TestEpochSpaceWaitWithoutWritebackGoroutine checks that an epoch-order
// write waiting for space on a set with no writeback goroutine
// (testingKnobs.noBackground, as the crash-point tests run) writes back
// itself instead of waiting for ever: TestCrashPoints/gc hung at 40 seeds
// in a Trim's zero blocks.
func TestEpochSpaceWaitWithoutWritebackGoroutine(t *testing.T) {
	const nblk = 512
	_, v := newEpochSetNoBackground(t, 8, nblk)
	done := make(chan error, 1)
	go func() {
		p := make([]byte, blockSize)
		// Three times the cache's blocks, a flush every 16 writes: the
		// cache fills with older epochs' dirty data many times over.
		for i := range 3 * 8 * 16 {
			b := (i * 37) % nblk
			stamp(p, uint64(i+1), 0, int64(b)*blockSize)
			if err := v.WriteAt(p, int64(b)*blockSize, false); err != nil {
				done <- err
				return
			}
			if i%16 == 15 {
				if err := v.Flush(); err != nil {
					done <- err
					return
				}
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("writes waiting for space did not finish in 30 s")
	}
	if got := v.Stats().WritebackBytes; got == 0 {
		t.Fatal("nothing was written back")
	}
}

// newEpochSetNoBackground opens a one-volume set of nBuckets buckets of 16
// blocks over an nblk-block memory backing device, in epoch order, with no
// background goroutine: the test steps writeback itself.
func newEpochSetNoBackground(t *testing.T, nBuckets, nblk int64) (*Set, *Volume) {
	t.Helper()
	cache := device.NewMem(cacheSizeFor(nBuckets, 16*blockSize, minJournalLen, 1))
	specs := []BackingSpec{{Name: "a", Dev: device.NewMem(nblk * blockSize)}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 16 * blockSize, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	v := s.vols[0]
	setWritebackOrder(t, v, "epoch")
	return s, v
}

// setWritebackOrder sets v's writeback_order.
func setWritebackOrder(t *testing.T, v *Volume, order string) {
	t.Helper()
	st := v.Settings()
	st.WritebackOrder = orderOf(order)
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
}
