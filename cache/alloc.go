package cache

import (
	"errors"
	"fmt"
	"time"
)

// Allocation: buckets are filled append-only, one open bucket at a time,
// and sealed into the FIFO eviction takes victims from when full.

// bucketState is where a bucket is in the allocator's cycle.
type bucketState uint8

const (
	bucketFree    bucketState = iota // on the free list, ready to open
	bucketOpen                       // being filled append-only
	bucketSealed                     // full (or recovered with live data); in the FIFO
	bucketFreeing                    // emptied; its reuse record is being made durable
)

func (s bucketState) String() string {
	return [...]string{"free", "open", "sealed", "freeing"}[s]
}

// bucketAlloc is the allocator's part of a bucket (s.mu.alloc, by bucket
// number); the index's part is s.mu.Buckets.
type bucketAlloc struct {
	state bucketState
	fill  uint32 // blocks handed out (open bucket)
	pins  int32  // reads and unfinished writes in flight into the bucket
	atime uint64 // the recency clock at the last read hit or allocation (eviction recency)
}

// run is a contiguous piece of cache blocks inside one bucket.
type run struct {
	loc uint32
	n   int
}

func (s *Set) lowWater() int { return max(2, len(s.mu.Buckets)/8) }

func (s *Set) kick() {
	select {
	case s.kickGC <- struct{}{}:
	default:
	}
}

// allocHow says how alloc may take space.
type allocHow int

const (
	allocWait    allocHow = iota // wait until a bucket is free (GC moves never use it)
	allocNoWait                  // use the free reserve, but fail rather than wait
	allocPromote                 // fail rather than use the free reserve
)

// allocFor is alloc for foreground writes: it may use the free reserve, and
// when no bucket is free it waits at most writeWaitMax for GC to free one
// (wakeLocked) before giving up with errNoSpace (the caller then writes
// around the cache).
func (s *Set) allocFor(n int) (run, error) {
	var timer *time.Timer
	for {
		s.mu.Lock()
		r, err := s.allocLocked(n, allocNoWait)
		var woken <-chan struct{}
		if errors.Is(err, errNoSpace) {
			if s.mu.wake == nil {
				s.mu.wake = make(chan struct{})
			}
			woken = s.mu.wake
		}
		s.mu.Unlock()
		if woken == nil {
			return r, err
		}
		if timer == nil {
			timer = time.NewTimer(writeWaitMax)
			defer timer.Stop()
		}
		s.kick()
		select {
		case <-woken:
		case <-timer.C:
			return r, err
		}
	}
}

// wakeLocked wakes everything waiting for a free bucket or for the set to
// close or fail: alloc's waiters (s.mu.cond) and allocFor's (s.mu.wake).
// REQUIRES: s.mu
func (s *Set) wakeLocked() {
	s.mu.cond.Broadcast()
	if s.mu.wake != nil {
		close(s.mu.wake)
		s.mu.wake = nil
	}
}

// writeWaitMax bounds how long a foreground write waits for a free bucket.
const writeWaitMax = 5 * time.Millisecond

// alloc hands out up to n blocks in the open bucket and pins the bucket until
// the caller calls unpin. allocWait blocks until space is free; allocNoWait
// fails when no bucket is free; allocPromote fails rather than use the free
// reserve. It never holds a pin while waiting, so waiters cannot starve gc.
func (s *Set) alloc(n int, how allocHow) (run, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.allocLocked(n, how)
}

// allocLocked is alloc with s.mu held (allocWait releases it while waiting).
// REQUIRES: s.mu
func (s *Set) allocLocked(n int, how allocHow) (run, error) {
	wait := how == allocWait
	for {
		if s.mu.closed {
			return run{}, ErrClosed
		}
		if err := s.err(); err != nil {
			return run{}, err
		}
		if s.mu.open >= 0 {
			b := &s.mu.alloc[s.mu.open]
			if s.mir() != nil {
				s.mirrorRetryLocked(s.mu.open, b.fill)
			}
			if int64(b.fill) < s.bpb {
				k := min(n, int(s.bpb)-int(b.fill))
				r := run{loc: uint32(s.mu.open*s.bpb) + b.fill, n: k}
				b.fill += uint32(k)
				b.pins++
				s.mu.tick++
				b.atime = s.mu.tick
				return r, nil
			}
			b.state = bucketSealed
			s.mu.sealed = append(s.mu.sealed, uint32(s.mu.open))
			s.mu.open = -1
		}
		if len(s.mu.free) < s.lowWater() {
			s.kick()
			if s.mu.short != nil {
				close(s.mu.short)
				s.mu.short = nil
			}
		}
		if len(s.mu.free) == 0 || (how == allocPromote && len(s.mu.free) < s.lowWater()) {
			if !wait {
				return run{}, errNoSpace
			}
			s.mu.cond.Wait()
			continue
		}
		bi := s.mu.free[0]
		if !s.mirrorOpenLocked(int64(bi)) {
			// Only the mirror's B is live and it has no slot free.
			return run{}, errNoSpace
		}
		s.mu.free = s.mu.free[1:]
		if len(s.mu.free) < s.lowWater() {
			s.kick() // this allocation took the free list below the mark
		}
		b := &s.mu.alloc[bi]
		b.state, b.fill = bucketOpen, 0
		s.mu.open = int64(bi)
	}
}

// REQUIRES: s.mu
func (s *Set) unpinLocked(loc uint32) {
	s.mu.alloc[int64(loc)/s.bpb].pins--
	s.mu.cond.Broadcast()
}

func (s *Set) cacheOff(loc uint32) int64 { return s.lay.BucketsOff + int64(loc)*blockSize }

// allocWaitWriteback finds space for a write in epoch order that found no
// free bucket (a write may not go around the cache while older epochs of
// its volume are dirty in it). The writer helps: it writes back a small
// batch of its volume's oldest epoch itself, and kicks GC. If that frees
// no bucket, writeback in epoch order is behind the workload: the volume
// degrades to lba order (order.go), which drops its superseded versions,
// and the write goes around the cache (errNoSpace) or finds the space
// that frees. It fails, rather than wait, when writeback to the backing
// device is failing: the client gets an I/O error and the server keeps
// running. Once the volume has no dirty data left it returns errNoSpace,
// and the write goes around the cache: other volumes' dirty data can fill
// the cache while their backing device is dead.
func (v *Volume) allocWaitWriteback(n int) (run, error) {
	s := v.s
	for helped := false; ; helped = true {
		r, err := s.alloc(n, allocNoWait)
		if !errors.Is(err, errNoSpace) {
			return r, err
		}
		if berr := v.wb.BackingErr(); berr != nil {
			return run{}, fmt.Errorf("no free cache bucket, and writeback to the backing device is failing: %w", berr)
		}
		if !v.hasDirty() || !s.keepSuperseded(v.vi) {
			return run{}, err
		}
		if helped {
			v.degrade(degradeSpace)
			r, err := s.alloc(n, allocNoWait)
			if errors.Is(err, errNoSpace) {
				s.kick()
			}
			return r, err
		}
		s.kick()
		if _, werr := v.wb.Help(wbHelpBatch); werr != nil {
			return run{}, fmt.Errorf("no free cache bucket, and writeback failed: %w", werr)
		}
	}
}

// wbHelpBatch is how many blocks a write waiting for space writes back
// itself before the volume degrades (a few hundred milliseconds of random
// writes on a disk at most).
const wbHelpBatch = 64
