package cache

// The set's side of writeback (package writeback is the mechanism, the
// loop and Drain): wbHost is a volume seen as a writeback.Volume, taking
// dirty versions from the index, claiming, pinning and marking them clean
// under Set.mu; and the set-wide pressure writeback and the write
// throttle read.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/writeback"
)

// lockChunk bounds the index lookups done per hold of Set.mu by background
// work (about 100 µs), so foreground requests never wait long for it.
const lockChunk = 512

// wbHost is a Volume as writeback sees it (writeback.Volume).
type wbHost Volume

var _ writeback.Volume = (*wbHost)(nil)

func (h *wbHost) vol() *Volume { return (*Volume)(h) }

// wbSet is the Set as Drain sees it (writeback.Set).
type wbSet Set

func (w *wbSet) Err() error { return (*Set)(w).err() }

// Commit makes every record appended so far durable.
func (w *wbSet) Commit() error {
	s := (*Set)(w)
	s.mu.Lock()
	target := s.mu.seq
	s.mu.Unlock()
	return s.commit(target)
}

// initWriteback readies v's writeback (runWriteback starts its loop).
func (s *Set) initWriteback(v *Volume) {
	v.wb.Init((*wbHost)(v), s.log, v.name, s.stop, writeback.Knobs{NoYield: s.knobs.noYield, FixedDepth: s.knobs.fixedDepth})
}

// runWriteback runs v's writeback loop in a goroutine of the set (spawn);
// where the set runs none, Stop then waits for no loop.
func (s *Set) runWriteback(v *Volume) {
	if !s.spawn(v.wb.Run) {
		v.wb.NoLoop()
	}
}

func (h *wbHost) Name() string { return h.name }

func (h *wbHost) EpochOrder() bool { return h.s.keepSuperseded(h.vi) }

func (h *wbHost) ScanDirty(from uint64, limit, maxVisit int) ([]uint64, uint64, bool) {
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dirtyScanLocked(h.vi, from, limit, maxVisit)
}

// dirtyScanLocked lists up to limit dirty blocks of volume vi from lba on,
// visiting at most maxVisit entries so that mu is held briefly even when
// the index is mostly clean. It skips the leaves whose epoch bound says
// they hold no dirty entry (a bound of +inf: clean since it was built or
// last raised). next is where to continue; done says the end of the index
// was reached.
// REQUIRES: s.mu
func (s *Set) dirtyScanLocked(vi int, from uint64, limit, maxVisit int) (out []uint64, next uint64, done bool) {
	done, next = true, from
	visited := 0
	s.vols[vi].idx.Tree.AscendAggAtMost(index.Ent{LBA: from}, math.MaxUint64-1, func(e index.Ent) bool {
		if visited >= maxVisit || len(out) >= limit {
			done, next = false, e.LBA
			return false
		}
		visited++
		if e.Dirty() {
			out = append(out, e.LBA)
		}
		return true
	})
	return out, next, done
}

// TakeLBAs takes the dirty live versions of lbas no batch holds (into
// wbInflight). In epoch order it takes only those of the oldest epoch
// (within one epoch any order is allowed, so eviction can free its
// victim's blocks). In lba order it takes them in chunks: mu is never
// held for more than lockChunk lookups.
func (h *wbHost) TakeLBAs(lbas []uint64) ([]writeback.Item, bool) {
	s, v := h.s, h.vol()
	var items []writeback.Item
	take := func(e index.Ent) {
		v.idx.wbInflight[e.Block()] = struct{}{}
		items = append(items, writeback.Item{LBA: e.LBA, Loc: e.Block(), CRC: e.CRC, Gen: s.mu.Buckets[int64(e.Block())/s.bpb].Gen})
	}
	if s.keepSuperseded(v.vi) {
		s.mu.Lock()
		defer s.mu.Unlock()
		oldest, ok := s.mu.OldestEpoch(v.vi)
		if !ok {
			return nil, true
		}
		hi := v.epochBatchLimit(oldest)
		for _, lba := range lbas {
			e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
			if !ok || !e.Dirty() || s.mu.BlockEpoch(e.Block()) > hi {
				continue
			}
			if _, busy := v.idx.wbInflight[e.Block()]; busy {
				continue
			}
			take(e)
		}
		return items, true
	}
	for at := 0; at < len(lbas); at += lockChunk {
		s.mu.Lock()
		for _, lba := range lbas[at:min(at+lockChunk, len(lbas))] {
			e, ok := v.idx.Tree.Get(index.Ent{LBA: lba})
			if !ok || !e.Dirty() {
				continue
			}
			if _, ok := v.idx.wbInflight[e.Block()]; ok {
				continue // written by another batch, not yet marked clean
			}
			take(e)
		}
		s.mu.Unlock()
	}
	return items, false
}

// TakeEpoch takes (into wbInflight) up to n versions of the volume's
// oldest epoch, LBA-sorted. It sweeps from the cursor, wrapping at the
// end, as lba order does: within one epoch any order is allowed, and
// resuming where the last batch stopped reaches the blocks that have been
// dirty longest (densest, so the longest runs and shortest seeks) instead
// of going back to LBA 0 each batch to the blocks just cleaned and dirtied
// again. With no client flushes the whole workload is one epoch, so this
// is all of epoch order's writeback.
func (h *wbHost) TakeEpoch(n int, cursor *atomic.Uint64) []writeback.Item {
	return h.s.takeEpochBatchFrom(h.vi, n, cursor)
}

func (s *Set) takeEpochBatchFrom(vi, n int, cursor *atomic.Uint64) []writeback.Item {
	v := s.vol(vi)
	s.mu.Lock()
	oldest, ok := v.oldestEpochLocked()
	if !ok {
		s.mu.Unlock()
		return nil
	}
	hi := v.epochBatchLimit(oldest)
	start := cursor.Load()
	items, next, more := s.takeEpochRangeLocked(vi, hi, start, math.MaxUint64, n, nil)
	if !more && start > 0 && len(items) < n {
		items, next, more = s.takeEpochRangeLocked(vi, hi, 0, start, n, items)
	}
	if more {
		cursor.Store(next)
	} else {
		cursor.Store(0)
	}
	s.mu.Unlock()
	slices.SortFunc(items, func(a, b writeback.Item) int { return cmp.Compare(a.LBA, b.LBA) })
	return items
}

// takeEpochRangeLocked appends to items versions of epochs up to hi with
// LBAs in [from, limit), in LBA order, until it holds n (hi is the oldest
// dirty epoch, or during a catch-up the last epoch before the cut: one
// version per LBA either way). more reports that it stopped early at LBA
// next. It scans in chunks of at most lockChunk entries per hold of mu
// (dropping it in between): the live entries of those epochs (in the
// leaves whose summary admits them), merged in LBA order with the
// superseded versions of those epochs in the LBA range the chunk covered.
// The oldest epoch cannot get older between chunks (new versions take the
// current epoch, GC moves keep theirs). Each chunk first reads the index
// leaves it will visit without mu (loadLeavesAtMostLocked: mu is dropped
// there too).
// REQUIRES: s.mu (dropped and retaken between chunks and before each)
func (s *Set) takeEpochRangeLocked(vi int, hi, from, limit uint64, n int, items []writeback.Item) (_ []writeback.Item, next uint64, more bool) {
	v := s.vols[vi]
	var cand []index.Ver
	for {
		// The leaves the chunk will visit, read without s.mu.
		v.loadLeavesAtMostLocked(from, limit, hi)
		cand = cand[:0]
		visited := 0
		next, more = 0, false
		v.idx.Tree.AscendAggAtMost(index.Ent{LBA: from}, hi, func(e index.Ent) bool {
			if e.LBA >= limit {
				return false
			}
			if visited >= lockChunk || len(cand) >= n-len(items) {
				next, more = e.LBA, true
				return false
			}
			visited++
			if ep := s.mu.BlockEpoch(e.Block()); e.Dirty() && ep <= hi {
				cand = append(cand, index.Ver{Epoch: ep, LBA: e.LBA, Loc: e.Block(), CRC: e.CRC})
			}
			return true
		})
		end := limit
		if more {
			end = next
		}
		nlive := len(cand)
		v.idx.Sup.AscendAggAtMost(index.Ent{LBA: from}, hi, func(e index.Ent) bool {
			if e.LBA >= end {
				return false
			}
			if ep := s.mu.BlockEpoch(e.Loc); ep <= hi {
				cand = append(cand, index.Ver{Epoch: ep, LBA: e.LBA, Loc: e.Loc, CRC: e.CRC})
			}
			return true
		})
		if len(cand) > nlive {
			// LBA order (a catch-up's versions are of several epochs,
			// one per LBA).
			slices.SortFunc(cand, func(a, b index.Ver) int { return cmp.Or(cmp.Compare(a.LBA, b.LBA), cmp.Compare(a.Epoch, b.Epoch)) })
		}
		for _, x := range cand {
			if len(items) >= n {
				// Resume at the first version not taken.
				next, more = x.LBA, true
				break
			}
			if _, busy := v.idx.wbInflight[x.Loc]; busy {
				continue
			}
			v.idx.wbInflight[x.Loc] = struct{}{}
			b := &s.mu.Buckets[int64(x.Loc)/s.bpb]
			items = append(items, writeback.Item{LBA: x.LBA, Loc: x.Loc, CRC: x.CRC, Gen: b.Gen})
		}
		if !more || len(items) >= n {
			return items, next, more
		}
		from = next
		s.mu.Unlock()
		s.mu.Lock()
	}
}

func (h *wbHost) Release(items []writeback.Item) {
	s := h.s
	s.mu.Lock()
	for _, it := range items {
		delete(h.idx.wbInflight, it.Loc)
	}
	s.notifyReleasedLocked()
	s.mu.Unlock()
}

func (h *wbHost) BeforeBacking() error { return h.s.commitBeforeWriteback(h.s.appended()) }

func (h *wbHost) Claim(run []writeback.Item, valid []bool) bool {
	s, v := h.s, h.vol()
	s.mu.Lock()
	defer s.mu.Unlock()
	r := blockRange{run[0].LBA, uint64(len(run))}
	if v.busyLocked(r.lba, r.n) {
		return false
	}
	v.idx.busy = append(v.idx.busy, r)
	for i, it := range run {
		bi := int64(it.Loc) / s.bpb
		valid[i] = s.mu.Buckets[bi].Gen == it.Gen && s.hasVersionLocked(v.vi, it.LBA, it.Loc, it.CRC)
		if valid[i] {
			s.mu.alloc[bi].pins++
		}
	}
	return true
}

func (h *wbHost) Unclaim(run []writeback.Item) {
	h.s.mu.Lock()
	h.vol().releaseLocked([]blockRange{{run[0].LBA, uint64(len(run))}})
	h.s.mu.Unlock()
}

func (h *wbHost) ReadCache(p []byte, loc uint32) error {
	s := h.s
	if _, err := s.dev.ReadAt(p, s.cacheOff(loc)); err != nil {
		s.cacheIOError("writeback read", err)
		return err
	}
	s.cacheIOOK()
	return nil
}

func (h *wbHost) Unpin(run []writeback.Item, valid []bool) {
	s := h.s
	s.mu.Lock()
	for i, it := range run {
		if valid[i] {
			s.unpinLocked(it.Loc)
		}
	}
	s.mu.Unlock()
}

func (h *wbHost) Corrupt(it writeback.Item, p []byte, got uint32) bool {
	h.st.checksumErrors.Add(1)
	if h.s.mirrorRepair(p, it.Loc, it.CRC) {
		h.st.checksumRepairs.Add(1)
		return true
	}
	h.s.log.Error("dirty block fails its checksum; not written back", "volume", h.name,
		"lba", it.LBA, "cache_offset", h.s.cacheOff(it.Loc), "expected", it.CRC, "actual", got)
	return false
}

func (h *wbHost) WriteBacking(p []byte, lba uint64) error { return h.vol().writeBackingNoMark(p, lba) }

func (h *wbHost) SyncBacking() error { return h.back.Sync() }

// MarkClean marks the written items clean where the entry still points at
// the cache block written back and its bucket's generation is unchanged
// (so a bucket reused meanwhile can never have a new write marked clean),
// and journals each mark.
func (h *wbHost) MarkClean(items []writeback.Item) int {
	s, vi := h.s, h.vi
	n := 0
	for at := 0; at < len(items); at += lockChunk {
		s.mu.Lock()
		for _, it := range items[at:min(at+lockChunk, len(items))] {
			if it.Written() && s.mu.Buckets[int64(it.Loc)/s.bpb].Gen == it.Gen && s.mu.MarkClean(vi, it.LBA, it.Loc) {
				s.appendLocked(&ondisk.Rec{Type: ondisk.RecClean, Vol: uint16(vi), LBA: it.LBA, Loc: it.Loc})
				n++
			}
		}
		s.mu.Unlock()
	}
	h.st.writebackBytes.Add(uint64(n) * blockSize)
	s.stats.writebackBlocks.Add(uint64(n))
	return n
}

func (h *wbHost) HasVersion(lba uint64, loc, crc uint32) bool {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return h.s.hasVersionLocked(h.vi, lba, loc, crc)
}

// hasVersionLocked reports whether the dirty version of lba at loc is still
// there (the live entry or a superseded one).
// REQUIRES: s.mu
func (s *Set) hasVersionLocked(vi int, lba uint64, loc uint32, crc uint32) bool {
	v := s.vols[vi]
	if e, ok := v.idx.Tree.Get(index.Ent{LBA: lba}); ok && e.Dirty() && e.Block() == loc && e.CRC == crc {
		return true
	}
	x, ok := v.idx.Sup.Get(index.Ent{LBA: lba, Loc: loc})
	return ok && x.CRC == crc
}

func (h *wbHost) Dirty() int64 {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return h.idx.Dirty
}

func (h *wbHost) DirtyVersions() int64 {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return h.idx.Dirty + h.idx.NSup
}

// Released returns a channel closed when a writeback batch or a
// passthrough write releases its claim, and whether the volume has any
// now.
func (h *wbHost) Released() (<-chan struct{}, bool) {
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.released == nil {
		s.mu.released = make(chan struct{})
	}
	return s.mu.released, len(h.idx.wbInflight) > 0 || len(h.idx.busy) > 0
}

// notifyReleasedLocked wakes Released's waiters.
// REQUIRES: s.mu
func (s *Set) notifyReleasedLocked() {
	if s.mu.released != nil {
		close(s.mu.released)
		s.mu.released = nil
	}
}

func (h *wbHost) RestoreOrder() { h.vol().restoreOrder() }

// CheckOrder degrades the volume when epoch-order writeback is behind,
// returns it to epoch order once it has caught up or, with no dirty data
// left, once no write stream has gone around the cache for catchUpAfter,
// and starts a catch-up when it has been degraded long enough (order.go).
// It returns how soon to look again for a return that waits for streams.
func (h *wbHost) CheckOrder() time.Duration {
	s, v := h.s, h.vol()
	s.mu.Lock()
	behind := s.keepSuperseded(v.vi) && s.behindLocked(v)
	caught := v.caughtUpLocked()
	s.mu.Unlock()
	switch {
	case behind:
		v.degrade(degradeSuperseded)
	case caught:
		if d := v.restoreWait(); d > 0 {
			return d
		}
		v.restoreOrder()
	default:
		v.catchUp()
	}
	return 0
}

func (h *wbHost) Rate() int64 { return h.s.wbRate(h.vol()) }

// wbRate decides v's background writeback rate (writeback.Rate) and sets
// the wake level with it, under mu.
func (s *Set) wbRate(v *Volume) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	in := writeback.RateIn{Dirty: v.idx.Dirty + v.idx.NSup, Draining: s.draining.Load() > 0}
	if in.Dirty > 0 && !in.Draining {
		in.Urgent = len(s.mu.free) < s.lowWater() || v.Mode() != Writeback || nowNanos()-v.lastIO.Load() > int64(writeback.IdleAfter) ||
			v.ord.cut.Load() != 0 || // catching up with epoch order (order.go): the sooner the better
			s.mirrorDegraded() // one copy of the dirty data left (mirror.go)
		in.CacheBlocks, in.Percent = s.mu.CacheBlocks(), v.cfg.Load().WritebackPercent
		in.Stream = v.streamBypassing()
	}
	rate, wake := writeback.Rate(in)
	v.wb.SetWake(wake)
	return rate
}

func (h *wbHost) WakeAbove() int64 {
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	cur := h.idx.Dirty + h.idx.NSup
	h.wb.SetWake(cur + 1)
	return cur
}

func (h *wbHost) RateMax() int64 { return h.cfg.Load().WritebackRateMax }

func (h *wbHost) LastIO() int64 { return h.lastIO.Load() }

func (h *wbHost) Streaming() bool { return h.vol().streamBypassing() }

// Short reports whether free buckets are short, and returns a channel
// closed when an allocation next finds them short (allocLocked); none
// while a write stream of the volume bypasses the cache: the rate does
// not depend on free buckets then (RateIn.Stream), and the loop looks
// again within IdleAfter.
func (h *wbHost) Short() (bool, <-chan struct{}) {
	s := h.s
	stream := h.vol().streamBypassing()
	s.mu.Lock()
	defer s.mu.Unlock()
	short := len(s.mu.free) < s.lowWater()
	if stream {
		return short, nil
	}
	if s.mu.short == nil {
		s.mu.short = make(chan struct{})
	}
	return short, s.mu.short
}

func (h *wbHost) Draining() bool { return h.s.draining.Load() > 0 }

func (h *wbHost) Failed() bool { return h.s.isFailed() }

func nowNanos() int64 { return time.Now().UnixNano() }

// noteDirtyLocked kicks v's writeback loop when a write has brought the
// volume's dirty versions to the level it waits for.
// REQUIRES: s.mu
func (v *Volume) noteDirtyLocked() { v.wb.NoteDirty(v.idx.Dirty + v.idx.NSup) }

// kickWB wakes every volume's writeback loop.
func (s *Set) kickWB() {
	for _, v := range s.volList() {
		v.wb.Kick()
	}
}

// pressure returns the set's dirty share of the cache (superseded versions
// included), whether free buckets are short, the cache size in blocks, and
// how far the free list is below the low-water mark (0..1).
func (s *Set) pressure() (dirtyShare float64, short bool, total int64, freeLack float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d int64
	for _, v := range s.vols {
		d += v.idx.Dirty + v.idx.NSup
	}
	total = s.mu.CacheBlocks()
	lw := s.lowWater()
	if f := len(s.mu.free); f < lw {
		freeLack = float64(lw-f) / float64(lw)
	}
	return float64(d) / float64(total), len(s.mu.free) < lw, total, freeLack
}

// throttle delays a foreground write in writeback mode when dirty data
// nears the cache size, or when GC is behind (the free list below its
// low-water mark), so writeback and eviction keep up without the cache
// running out of buckets (writeback.ThrottleDelay, Writer.Accrue).
func (v *Volume) throttle() {
	if v.s.knobs.noThrottle {
		return
	}
	share, _, _, lack := v.s.pressure()
	d := writeback.ThrottleDelay(share, lack)
	if d <= 0 {
		return
	}
	v.s.kickWB()
	v.s.kick()
	if d = v.wb.Accrue(d); d > 0 {
		time.Sleep(d)
		v.st.throttleNanos.Add(uint64(d))
	}
}

// Drain writes every dirty block of every volume back to its backing device
// and commits (drain). Background writeback pauses meanwhile.
func (s *Set) Drain(ctx context.Context) error {
	s.draining.Add(1)
	defer func() {
		s.draining.Add(-1)
		s.kickWB()
	}()
	if err := s.drain(ctx, s.volList(), writeback.DrainFull, nil); err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	return nil
}

// drain is writeback.Drain over vols, its *StuckError made an
// *UnwritableError.
func (s *Set) drain(ctx context.Context, vols []*Volume, first int, progress func(dirtyBlocks int64)) error {
	ws := make([]*writeback.Writer, len(vols))
	for i, v := range vols {
		ws[i] = &v.wb
	}
	err := writeback.Drain(ctx, (*wbSet)(s), ws, first, progress)
	var stuck *writeback.StuckError
	if errors.As(err, &stuck) {
		e := &UnwritableError{N: len(stuck.Bad), Dirty: stuck.Dirty, Tries: writeback.DrainChecksumTries}
		for _, x := range stuck.Bad[:min(len(stuck.Bad), maxUnwritableNamed)] {
			e.Blocks = append(e.Blocks, UnwritableBlock{Volume: vols[x.Vol].name, LBA: x.LBA, CacheOffset: s.cacheOff(x.Loc)})
		}
		return e
	}
	return err
}
