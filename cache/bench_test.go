package cache

import (
	"bytes"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

var (
	flagMeasure         = flagBool("measure", false, "run TestMeasure* (index memory, recovery time with 1M extents)")
	flagRecoveryProfile = flag.String("recoveryprofile", "", "TestMeasureRecovery: write a CPU profile of Open to this file")
)

// TestMeasureIndexMemory fills a cache with 4 KiB random writes and reports
// the heap bytes the index costs per cached block and per GiB of cache.
// Figures only; nothing is asserted. Run with -measure.
func TestMeasureIndexMemory(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	// Half of the blocks dirty (the figure docs/CACHE.md reports), then
	// all clean and all dirty.
	for _, nblocks := range []int{1 << 16, 1 << 20} {
		heapIndexFigure(t, nblocks, false, 2)
	}
	heapIndexFigure(t, 1<<20, false, 0)
	heapIndexFigure(t, 1<<20, false, 1)
	// Inserting in LBA order (appends) fills leaves completely.
	heapIndexFigure(t, 1<<20, true, 2)
	// Random dirty writes that overwrite (a flush every 50 writes): in
	// epoch order an overwrite of an earlier epoch keeps the old version.
	for _, order := range []string{"epoch", "lba"} {
		heapIndexOverwrites(t, 1<<20, order, 50)
	}
}

// heapIndexOverwrites measures the index after random 4 KiB dirty writes
// (with repeats) over a volume 4x the cache, a flush every flushEvery
// writes, until every cache block has been written once (the log is full;
// nothing is written back or evicted).
func heapIndexOverwrites(t *testing.T, nblocks int, order string, flushEvery int) {
	const bs = 1 << 20
	bpb := int64(bs / blockSize)
	nb := int64(nblocks) / bpb
	s := &Set{bpb: bpb}
	s.mu.BPB = s.bpb
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s.mu.Buckets = make([]index.Bucket, nb)
	v := &Volume{s: s, nblocks: 1 << 30}
	st := DefaultSettings()
	st.WritebackOrder = orderOf(order)
	v.cfg.Store(&st)
	v.idx.Tree = index.NewPtree()
	s.setVols([]*Volume{v})
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < nblocks; i++ {
		v.idx.epoch = uint64(i / flushEvery)
		s.mu.Insert(0, rng.Uint64N(uint64(nblocks)*4), uint32(i), uint32(i), true, s.vols[0].idx.epoch, s.keepSuperseded(0))
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	used := float64(after.HeapAlloc - before.HeapAlloc)
	t.Logf("order=%s, random dirty writes with repeats, a flush every %d: %d cache blocks written: index %.1f MiB = %.1f B per cache block = %.2f%% of cache (%d live entries, %d superseded versions)",
		order, flushEvery, nblocks, used/(1<<20), used/float64(nblocks), 100*used/(float64(nblocks)*blockSize), v.idx.Tree.Len(), v.idx.NSup)
	runtime.KeepAlive(s)
}

// heapIndexFigure measures the index of a set as it serves (bucket table,
// trees, epochs; no reverse map, which only recovery has) after nblocks
// random inserts. dirtyEvery: every dirtyEvery-th block is dirty (0: none).
func heapIndexFigure(t *testing.T, nblocks int, sorted bool, dirtyEvery int) {
	const bs = 1 << 20
	bpb := int64(bs / blockSize)
	nb := int64(nblocks) / bpb
	s := &Set{bpb: bpb}
	s.mu.BPB = s.bpb
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s.mu.Buckets = make([]index.Bucket, nb)
	v := &Volume{s: s, nblocks: 1 << 30}
	v.idx.Tree = index.NewPtree()
	s.setVols([]*Volume{v})
	rng := rand.New(rand.NewPCG(1, 2))
	perm := rng.Perm(nblocks * 4)[:nblocks] // random LBAs in a 4x larger volume
	if sorted {
		slices.Sort(perm)
	}
	for i := 0; i < nblocks; i++ {
		s.mu.Insert(0, uint64(perm[i]), uint32(i), uint32(i), dirtyEvery > 0 && i%dirtyEvery == 0, s.vols[0].idx.epoch, s.keepSuperseded(0))
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	used := float64(after.HeapAlloc - before.HeapAlloc)
	perBlock := used / float64(nblocks)
	cacheBytes := float64(nblocks) * blockSize
	st := v.idx.Tree.Stats()
	t.Logf("sorted=%t dirty=1/%d: %d cached 4 KiB blocks (%.0f MiB cache): index %.1f MiB = %.1f B/block = %.2f%% of cache = %.1f MiB per GiB of cache (%d entries, leaves %.0f%% full, %d dirty)",
		sorted, dirtyEvery, nblocks, cacheBytes/(1<<20), used/(1<<20), perBlock, 100*used/cacheBytes, perBlock*(1<<30)/blockSize/(1<<20),
		v.idx.Tree.Len(), 100*float64(v.idx.Tree.Len())/float64(st.Leaves*index.LeafCap), v.idx.Dirty)
	if err := v.idx.Tree.Check(); err != nil {
		t.Fatal(err)
	}
	// Eviction's index walk over this index (no reverse map), for a batch
	// of 1/evictBatchMin of the buckets: its total time, and the mean time
	// Set.mu is held per chunk of walkChunk entries.
	start := time.Now()
	found, err := s.entriesIn(func(loc int64) bool { return loc/bpb < max(nb/evictBatchMin, 1) })
	if err != nil {
		t.Fatal(err)
	}
	walk := time.Since(start)
	chunks := (nblocks + walkChunk - 1) / walkChunk
	t.Logf("  eviction walk: %d entries found in %v (%d chunks of %d entries, %v per hold of mu on average)",
		len(found), walk.Round(time.Microsecond), chunks, walkChunk, (walk / time.Duration(chunks)).Round(time.Microsecond))
	runtime.KeepAlive(s)
}

// TestMeasureRecovery builds a set whose index holds about 1M extents (4 KiB
// random writes, half of them after the last checkpoint so they replay from
// the journal), crashes it and times Open.
func TestMeasureRecovery(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	const (
		bs      = 1 << 20
		nblocks = 1 << 20 // 4 GiB of cache
	)
	nb := int64(nblocks*blockSize/bs) + 8
	jl := int64(64 << 20)
	cache := device.NewMem(cacheSizeFor(nb, bs, jl, 1))
	back := device.NewMem(int64(nblocks) * 8 * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bs, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Index changes are made directly (with their journal records) rather
	// than through WriteAt: recovery never reads cached data, and a memory
	// device holding 4 GiB of data would not fit a CI machine.
	rng := rand.New(rand.NewPCG(3, 4))
	lbas := rng.Perm(nblocks * 8)[:nblocks]
	start := time.Now()
	crcs := make([]uint32, 1)
	for i := 0; i < nblocks; i++ {
		s.mu.Lock()
		s.mu.Insert(0, uint64(lbas[i]), uint32(i), uint32(i), true, s.vols[0].idx.epoch, s.keepSuperseded(0))
		crcs[0] = uint32(i)
		s.appendInsertLocked(0, uint64(lbas[i]), uint32(i), true, crcs, s.vols[0].idx.epoch)
		s.mu.Unlock()
		if i == nblocks/2 {
			s.commitMu.Lock()
			if err := s.checkpointLocked(0); err != nil {
				t.Fatal(err)
			}
			s.commitMu.Unlock()
		}
		if i%4096 == 4095 {
			if err := s.commit(s.appended()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.commit(s.appended()); err != nil {
		t.Fatal(err)
	}
	fill := time.Since(start)
	st := s.Stats()
	s.crashStop()
	start = time.Now()
	var logBuf bytes.Buffer
	var ru0, ru1 syscall.Rusage
	if *flagRecoveryProfile != "" {
		f, err := os.Create(*flagRecoveryProfile)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
	}
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	s2, err := Open(cache, specs, OpenOptions{Logger: slog.New(slog.NewTextHandler(&logBuf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if *flagRecoveryProfile != "" {
		pprof.StopCPUProfile()
	}
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	cpu := time.Duration(ru1.Utime.Nano()+ru1.Stime.Nano()-ru0.Utime.Nano()-ru0.Stime.Nano()) * time.Nanosecond
	t.Logf("recovery CPU time (all threads, incl. GC): %v", cpu)
	// Only Open's line: background writeback starts after Open and logs
	// checksum errors for these blocks (their data was never written).
	for _, l := range strings.Split(logBuf.String(), "\n") {
		if strings.Contains(l, "cache set recovered") {
			t.Log(l)
		}
	}
	took := time.Since(start)
	st2 := s2.Stats()
	t.Logf("filled %d dirty extents in %v (%d checkpoints, %d journal blocks); recovery of %d extents took %v",
		st.DirtyBlocks, fill, st.Checkpoints, st.JournalBlocks, st2.DirtyBlocks, took)
	s2.crashStop()
}

func flagBool(name string, def bool, usage string) *bool {
	return flag.Bool(name, def, usage)
}

var _ = fmt.Sprint

// cpuPerOp locks the benchmark's goroutine to its thread and returns a
// function that reports the CPU time per op of that thread (the request
// path itself; a goroutine locked to a thread runs alone on it) and of the
// whole process (background writeback, eviction and commits too), wall
// time being a poor measure on a shared machine. Linux (RUSAGE_THREAD).
func cpuPerOp(b *testing.B) func() {
	const rusageThread = 1
	cpu := func(who int) int64 {
		var ru syscall.Rusage
		_ = syscall.Getrusage(who, &ru)
		return ru.Utime.Nano() + ru.Stime.Nano()
	}
	runtime.LockOSThread()
	t0, p0 := cpu(rusageThread), cpu(syscall.RUSAGE_SELF)
	return func() {
		t1, p1 := cpu(rusageThread), cpu(syscall.RUSAGE_SELF)
		runtime.UnlockOSThread()
		b.ReportMetric(float64(t1-t0)/float64(b.N), "thread-cpu-ns/op")
		b.ReportMetric(float64(p1-p0)/float64(b.N), "proc-cpu-ns/op")
	}
}

// BenchmarkWrite4K: random 4 KiB writes (no flush) into a 64 MiB cache over
// a 1 GiB volume, per mode; eviction and writeback included.
func BenchmarkWrite4K(b *testing.B) {
	for _, m := range []Mode{Writeback, Writethrough, Writearound} {
		b.Run(m.String(), func(b *testing.B) {
			s, _, _ := newTestSet(b, 64, 1<<20, 1<<30)
			v := s.vols[0]
			if err := v.SetMode(m); err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 1))
			p := make([]byte, blockSize)
			b.SetBytes(blockSize)
			b.ResetTimer()
			defer cpuPerOp(b)()
			for i := 0; i < b.N; i++ {
				if err := v.WriteAt(p, rng.Int64N(1<<18)*blockSize, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkReadHit4K: random 4 KiB reads of cached blocks (checksummed).
func BenchmarkReadHit4K(b *testing.B) {
	s, _, _ := newTestSet(b, 16, 1<<20, 64<<20)
	v := s.vols[0]
	p := make([]byte, blockSize)
	const n = 2048 // 8 MiB working set
	for i := int64(0); i < n; i++ {
		if err := v.WriteAt(p, i*blockSize, false); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 1))
	b.SetBytes(blockSize)
	b.ResetTimer()
	defer cpuPerOp(b)()
	for i := 0; i < b.N; i++ {
		if err := v.ReadAt(p, rng.Int64N(n)*blockSize); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFlushParallel: concurrent 4 KiB write+flush pairs share group
// commits.
func BenchmarkFlushParallel(b *testing.B) {
	s, _, _ := newTestSet(b, 64, 1<<20, 1<<30)
	v := s.vols[0]
	var next atomic.Int64
	b.SetBytes(blockSize)
	b.RunParallel(func(pb *testing.PB) {
		p := make([]byte, blockSize)
		for pb.Next() {
			if err := v.WriteAt(p, (next.Add(1)%(1<<18))*blockSize, false); err != nil {
				b.Error(err)
				return
			}
			if err := v.Flush(); err != nil {
				b.Error(err)
				return
			}
		}
	})
	st := s.Stats()
	b.ReportMetric(float64(b.N)/float64(max(st.Commits, 1)), "flushes/commit")
}
