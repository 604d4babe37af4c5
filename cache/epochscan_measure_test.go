package cache

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/writeback"
)

// TestMeasureEpochBatchCPU measures the CPU that epoch-ordered writeback
// spends finding its batches (takeEpochBatch) and marking them clean, on a
// large, mostly clean index (1M entries, 16 K dirty) whose dirty blocks
// came in many small flush epochs (pgbench-like: 1, 16 or 256 dirty blocks
// an epoch). No device I/O: the index alone. Figures only; run with
// -measure.
func TestMeasureEpochBatchCPU(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	for _, perEpoch := range []int{1, 16, 256} {
		for _, batch := range []int{64, writeback.FullBatch} {
			measureEpochBatches(t, 1<<20, 1<<14, perEpoch, batch)
		}
	}
}

func measureEpochBatches(t *testing.T, nblocks, ndirty, perEpoch, batch int) {
	const bs = 1 << 20
	bpb := int64(bs / blockSize)
	s := &Set{bpb: bpb}
	s.mu.BPB = s.bpb
	s.mu.Buckets = make([]index.Bucket, int64(nblocks)/bpb)
	s.mu.alloc = make([]bucketAlloc, len(s.mu.Buckets))
	v := &Volume{s: s, nblocks: 1 << 30}
	v.idx.Tree = index.NewPtree()
	v.idx.wbInflight = map[uint32]struct{}{}
	s.setVols([]*Volume{v})
	rng := rand.New(rand.NewPCG(7, 8))
	perm := rng.Perm(nblocks * 4)[:nblocks]
	every := nblocks / ndirty
	start := time.Now()
	s.mu.Lock()
	dirty := 0
	for i := range nblocks {
		d := i%every == 0
		if d {
			v.idx.epoch = uint64(dirty / perEpoch)
			dirty++
		}
		s.mu.Insert(0, uint64(perm[i]), uint32(i), uint32(i), d, s.vols[0].idx.epoch, s.keepSuperseded(0))
	}
	s.mu.Unlock()
	fill := time.Since(start)
	start = time.Now()
	batches, blocks := 0, 0
	for {
		items := s.takeEpochBatch(0, batch)
		if len(items) == 0 {
			break
		}
		batches++
		blocks += len(items)
		s.mu.Lock()
		for _, it := range items {
			s.mu.MarkClean(0, it.LBA, it.Loc)
			delete(v.idx.wbInflight, it.Loc)
		}
		s.mu.Unlock()
	}
	took := time.Since(start)
	if blocks != dirty {
		t.Fatalf("wrote back %d of %d dirty blocks", blocks, dirty)
	}
	t.Logf("%d entries, %d dirty in epochs of %d, batches of up to %d: fill %v (%.2f µs/insert); writeback's batches and clean marks %v for %d batches = %.1f µs per block written back",
		nblocks, dirty, perEpoch, batch, fill.Round(time.Millisecond), float64(fill.Microseconds())/float64(nblocks),
		took.Round(time.Millisecond), batches, float64(took.Microseconds())/float64(blocks))
}
