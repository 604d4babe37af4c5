package cache

import (
	"encoding/binary"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/cache/internal/writeback"
	"github.com/tiercache/tiercache/device"
)

// cacheSizeFor returns a cache device size that formats to n buckets of bs.
func cacheSizeFor(n, bs, journal int64, nvols int) int64 {
	return cacheSizeForPaged(n, bs, journal, nvols, false)
}

// cacheSizeForPaged is cacheSizeFor for a set formatted with IndexPages
// (paged) or without.
func cacheSizeForPaged(n, bs, journal int64, nvols int, paged bool) int64 {
	bpb := bs / blockSize
	ckpt := ondisk.CkptSlotLen(n, bpb, ondisk.MaxBackings) // Format sizes slots for every slot; nvols kept for callers
	if paged {
		ckpt = pages.SlotLen(n, bpb)
	}
	off := 2*ondisk.SBCopySize + journal + 2*ckpt
	align := min(bs, 1<<20)
	off = (off + align - 1) / align * align
	return off + n*bs + 2*bs
}

// testIndexPages says whether the crash models' seed formats its set with
// index pages (FormatOptions.IndexPages): seeds 2, 3, 6, 7, ... do, so
// that any four consecutive seeds cover both with either writeback order.
func testIndexPages(seed uint64) bool { return seed/2%2 == 1 }

// checkAfter runs Set.Check when the test ends (bbolt's btesting pattern).
func checkAfter(t testing.TB, s *Set) {
	t.Cleanup(func() {
		if err := s.Check(); err != nil {
			t.Errorf("Set.Check after test: %v", err)
		}
	})
}

// newTestSet formats and opens a set over fresh memory devices.
func newTestSet(t testing.TB, nBuckets, bucketSize int64, backSizes ...int64) (*Set, *device.Mem, []*device.Mem) {
	t.Helper()
	return newTestSetKnobs(t, testingKnobs{}, nBuckets, bucketSize, backSizes...)
}

// newTestSetKnobs is newTestSet with the set opened with knobs.
func newTestSetKnobs(t testing.TB, knobs testingKnobs, nBuckets, bucketSize int64, backSizes ...int64) (*Set, *device.Mem, []*device.Mem) {
	t.Helper()
	jl := int64(minJournalLen)
	cache := device.NewMem(cacheSizeFor(nBuckets, bucketSize, jl, len(backSizes)))
	var backs []*device.Mem
	var specs []BackingSpec
	for i, sz := range backSizes {
		b := device.NewMem(sz)
		backs = append(backs, b)
		specs = append(specs, BackingSpec{Name: string(rune('a' + i)), Dev: b})
	}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: bucketSize, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: knobs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.crashStop() })
	checkAfter(t, s)
	return s, cache, backs
}

var le = binary.LittleEndian

// orderOf parses a writeback order name of a test table.
func orderOf(s string) WritebackOrder {
	o, err := ondisk.ParseWritebackOrder(s)
	if err != nil {
		panic(err)
	}
	return o
}

// sweepLogged is one background writeback sweep as the writeback goroutine
// runs it, with a failure logged (the goroutine's backoff logs the first
// failure of a run): tests drive the sweeps themselves.
func sweepLogged(s *Set, v *Volume, n int) int {
	done, err := s.writebackSweep(v, n)
	if err != nil {
		s.log.Warn("background writeback failed", "volume", v.name, "err", err)
	}
	return done
}

// The writeback entry points by slot, for tests that drive writeback
// themselves.

// writeback writes back the given dirty blocks (sorted LBAs) of volume vi,
// as eviction does (writeback.Writer.Evict).
func (s *Set) writeback(vi int, lbas []uint64) (int, error) { return s.vol(vi).wb.Evict(lbas) }

// writebackEpoch writes back up to n versions of volume vi's oldest epoch
// (writeback.Writer.Help).
func (s *Set) writebackEpoch(vi, n int) (int, error) { return s.vol(vi).wb.Help(n) }

// writebackSweep is one batch of v's background loop.
func (s *Set) writebackSweep(v *Volume, n int) (int, error) { return v.wb.Sweep(n) }

// takeEpochBatch is TakeEpoch from the volume's writeback cursor, whatever
// its order.
func (s *Set) takeEpochBatch(vi, n int) []writeback.Item {
	return s.takeEpochBatchFrom(vi, n, s.vol(vi).wb.Cursor())
}

// crashStop stops the background goroutines without writing anything, as if
// the process died. Tests use it after cloning the devices for a crash.
func (s *Set) crashStop() {
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return
	}
	s.mu.closed = true
	s.wakeLocked()
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
}
