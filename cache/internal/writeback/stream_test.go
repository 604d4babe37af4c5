package writeback

import (
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// streamVol is a Volume of dirty blocks (cache block = LBA, every block
// zeros) whose backing writes the test holds at a gate, and whose client
// starts and stops a bypassing write stream when the test says.
type streamVol struct {
	epoch     bool
	streaming atomic.Bool
	busy      atomic.Bool   // the client is busy and dirty data under the target: Rate 0
	entered   chan struct{} // closed when the first backing write arrives
	gate      chan struct{} // backing writes wait for it to close
	cleaned   chan int      // MarkClean sends how many it marked
	looped    chan struct{} // closed when the loop comes round after the first MarkClean

	mu      sync.Mutex
	dirty   map[uint64]bool
	inBatch map[uint64]bool
	froms   []uint64 // where each batch's ScanDirty or TakeEpoch started
	writes  int      // backing writes
	blocks  int      // blocks written to the backing device
	clean   bool     // MarkClean was called
	once    sync.Once
	loopOne sync.Once

	// again is what CheckOrder returns (ns), as it is when the call
	// begins; checks, if set, is sent to on each CheckOrder.
	again  atomic.Int64
	checks chan struct{}
}

var zeroCRC = ondisk.CRC32C(make([]byte, blockSize))

func (v *streamVol) Name() string { return "vol" }

func (v *streamVol) sortedDirty(from uint64) []uint64 {
	var l []uint64
	for lba := range v.dirty {
		if lba >= from && !v.inBatch[lba] {
			l = append(l, lba)
		}
	}
	slices.Sort(l)
	return l
}

func (v *streamVol) take(lbas []uint64) []Item {
	var items []Item
	for _, lba := range lbas {
		if v.dirty[lba] && !v.inBatch[lba] {
			v.inBatch[lba] = true
			items = append(items, Item{LBA: lba, Loc: uint32(lba), CRC: zeroCRC})
		}
	}
	return items
}

func (v *streamVol) ScanDirty(from uint64, limit, _ int) ([]uint64, uint64, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.froms = append(v.froms, from)
	l := v.sortedDirty(from)
	if len(l) > limit {
		return l[:limit], l[limit], false
	}
	return l, 0, true
}

func (v *streamVol) TakeLBAs(lbas []uint64) ([]Item, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.take(lbas), v.epoch
}

func (v *streamVol) TakeEpoch(n int, cursor *atomic.Uint64) []Item {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.froms = append(v.froms, cursor.Load())
	l := v.sortedDirty(cursor.Load())
	if len(l) == 0 {
		l = v.sortedDirty(0)
	}
	if len(l) > n {
		cursor.Store(l[n])
		l = l[:n]
	} else {
		cursor.Store(0)
	}
	return v.take(l)
}

func (v *streamVol) EpochOrder() bool { return v.epoch }

func (v *streamVol) Release(items []Item) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, it := range items {
		delete(v.inBatch, it.LBA)
	}
}

func (v *streamVol) BeforeBacking() error { return nil }

func (v *streamVol) Claim(run []Item, valid []bool) bool {
	for i := range valid {
		valid[i] = true
	}
	return true
}

func (v *streamVol) Unclaim([]Item) {}

func (v *streamVol) ReadCache(p []byte, _ uint32) error {
	clear(p)
	return nil
}

func (v *streamVol) Unpin([]Item, []bool)              {}
func (v *streamVol) Corrupt(Item, []byte, uint32) bool { return false }

func (v *streamVol) WriteBacking(p []byte, lba uint64) error {
	v.once.Do(func() { close(v.entered) })
	<-v.gate
	v.mu.Lock()
	defer v.mu.Unlock()
	v.writes++
	v.blocks += len(p) / blockSize
	return nil
}

func (v *streamVol) SyncBacking() error { return nil }

func (v *streamVol) MarkClean(items []Item) int {
	v.mu.Lock()
	v.clean = true
	n := 0
	for _, it := range items {
		if it.Written() {
			delete(v.dirty, it.LBA)
			n++
		}
	}
	v.mu.Unlock()
	v.cleaned <- n
	return n
}

func (v *streamVol) HasVersion(lba uint64, _, _ uint32) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.dirty[lba]
}

func (v *streamVol) Dirty() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return int64(len(v.dirty))
}

func (v *streamVol) DirtyVersions() int64 { return v.Dirty() }

func (v *streamVol) Released() (<-chan struct{}, bool) { return nil, false }
func (v *streamVol) RestoreOrder()                     {}

// CheckOrder: the loop's first call of a round, so after a batch's
// MarkClean it means the batch has returned.
func (v *streamVol) CheckOrder() time.Duration {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.clean {
		v.loopOne.Do(func() { close(v.looped) })
	}
	// again is read before the send: a test that changes it once it has
	// received a call's signal changes what later calls return, never
	// the call it received from.
	d := time.Duration(v.again.Load())
	if v.checks != nil {
		v.checks <- struct{}{}
	}
	return d
}

// Rate: full speed (an idle client) while anything is dirty, nothing while
// the stream bypasses (as Rate with RateIn.Stream below the full level) or
// the client is busy (as Rate under the target without Urgent).
func (v *streamVol) Rate() int64 {
	if v.Dirty() == 0 || v.streaming.Load() || v.busy.Load() {
		return 0
	}
	return -1
}

func (v *streamVol) WakeAbove() int64               { return v.Dirty() }
func (v *streamVol) RateMax() int64                 { return 0 }
func (v *streamVol) LastIO() int64                  { return nowNanos() }
func (v *streamVol) Streaming() bool                { return v.streaming.Load() }
func (v *streamVol) Short() (bool, <-chan struct{}) { return false, nil }
func (v *streamVol) Draining() bool                 { return false }
func (v *streamVol) Failed() bool                   { return false }

// TestBatchYields: a background batch started at full speed (the client
// idle) stops issuing backing writes once the rate decision says to write
// nothing (a write stream of the volume starts bypassing the cache, or the
// client is busy again with dirty data under the target), syncs and marks
// clean what it wrote, and leaves the rest dirty; the loop resumes where
// the batch stopped once the cause ends. The batch: 20 runs of 2 MiB (512
// blocks, 1024 blocks apart), so its queue depth is 2 runs
// (wbInflightBytes), and of them at most the 2 in flight when the cause
// starts are written.
// Before the batch checked for a stream it wrote all 20 runs while the
// stream ran (10,240 blocks); before it checked for a busy client it went
// on under the client's requests as well (in the kernel guest, the dirty
// blocks of a random-write job written back through the whole fsync job
// after it: 1,961 HDD writes and 2,870 cache-device reads in it).
func TestBatchYields(t *testing.T) {
	for _, tc := range []struct {
		cause, what string
		epoch       bool
	}{{"stream", "stream", false}, {"stream", "stream", true}, {"client", "client's requests", false}, {"client", "client's requests", true}} {
		name := tc.cause + "/lba"
		if tc.epoch {
			name = tc.cause + "/epoch"
		}
		epoch := tc.epoch
		t.Run(name, func(t *testing.T) {
			const runs, runBlocks = 20, wbMaxRun
			v := &streamVol{
				epoch:   epoch,
				entered: make(chan struct{}),
				gate:    make(chan struct{}),
				cleaned: make(chan int, 16),
				looped:  make(chan struct{}),
				dirty:   map[uint64]bool{},
				inBatch: map[uint64]bool{},
			}
			for r := range runs {
				for b := range runBlocks {
					v.dirty[uint64(r*2*runBlocks+b)] = true
				}
			}
			stop := make(chan struct{})
			var w Writer
			w.Init(v, slog.New(slog.DiscardHandler), "vol", stop, Knobs{})
			go w.Run()
			defer func() {
				close(stop)
				<-w.done
			}()

			cause := &v.streaming
			if tc.cause == "client" {
				cause = &v.busy
			}
			<-v.entered // the batch's first backing write is on its way
			cause.Store(true)
			close(v.gate)
			got := <-v.cleaned
			if got == 0 || got > 2*runBlocks {
				t.Fatalf("the batch marked %d blocks clean, want 1..%d (at most the %d runs in flight when the %s started)", got, 2*runBlocks, 2, tc.what)
			}
			if left := v.Dirty(); left != int64(runs*runBlocks-got) {
				t.Fatalf("%d blocks dirty after the batch, want %d", left, runs*runBlocks-got)
			}
			<-v.looped // the batch has returned
			v.mu.Lock()
			issued, batches := v.writes, len(v.froms)
			v.mu.Unlock()
			if got != issued*runBlocks {
				t.Fatalf("%d blocks marked clean, %d runs written", got, issued)
			}
			resume := uint64(issued * 2 * runBlocks)
			if c := w.cursor.Load(); c != resume {
				t.Errorf("cursor %d after the cut, want %d (the first run not issued)", c, resume)
			}

			// The cause ends: the loop takes up where the batch stopped
			// and writes everything back.
			cause.Store(false)
			w.Kick()
			for v.Dirty() > 0 {
				select {
				case <-v.cleaned:
				case <-time.After(time.Minute):
					t.Fatalf("%d blocks still dirty a minute after the %s ended", v.Dirty(), tc.what)
				}
			}
			v.mu.Lock()
			defer v.mu.Unlock()
			if v.froms[batches] != resume {
				t.Errorf("first batch after the %s from LBA %d, want %d", tc.what, v.froms[batches], resume)
			}
			if v.blocks != runs*runBlocks {
				t.Errorf("%d blocks written in all, want %d", v.blocks, runs*runBlocks)
			}
		})
	}
}

// TestLoopLooksAgain: a loop with nothing to write back sleeps until a
// kick, except that CheckOrder's d > 0 (a return to epoch order waiting
// for write streams to pause) has it call CheckOrder again after d with
// no kick at all: a clean degraded volume returns to epoch order by itself.
func TestLoopLooksAgain(t *testing.T) {
	v := &streamVol{dirty: map[uint64]bool{}, inBatch: map[uint64]bool{}, looped: make(chan struct{}), checks: make(chan struct{})}
	v.again.Store(int64(10 * time.Millisecond))
	stop := make(chan struct{})
	var w Writer
	w.Init(v, slog.New(slog.DiscardHandler), "vol", stop, Knobs{})
	go w.Run()
	defer func() {
		close(stop)
		go func() {
			for range v.checks {
			}
		}()
		<-w.done
	}()
	<-v.checks // the first round
	v.again.Store(0)
	guard := time.NewTimer(time.Minute) // a loop that never looks again would hang here
	defer guard.Stop()
	select {
	case <-v.checks:
	case <-guard.C:
		t.Fatal("the loop did not call CheckOrder again after the d it returned")
	}
	// With d 0 and nothing dirty it sleeps until a kick.
	w.Kick()
	<-v.checks
}
