package model

import (
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/tiercache/tiercache/device"
)

// HDDParams are the parameters of the HDD model. A zero field takes the
// default given in its comment (the values of DefaultHDD, a Seagate
// ST3000DM001-class 3.5" 7200 rpm disk; docs/MODELS.md gives the sources).
type HDDParams struct {
	// RPM is the spindle speed. Default 7200 (8.33 ms a revolution).
	RPM float64
	// OuterRate and InnerRate are the sustained sequential rates (bytes/s,
	// track switches included) of the outermost and innermost zones; the
	// zones between fall linearly. Defaults 140e6 and 70e6.
	OuterRate, InnerRate float64
	// Zones is the number of recording zones, each with the same number of
	// tracks. Default 16.
	Zones int
	// Capacity is the size of the modelled disk; the inner device occupies
	// its first bytes (the outer edge). Default (0): the inner device's size,
	// so the file is the whole disk and a random request seeks across all of
	// it. Set it larger (3e12, say) to model a file at the start of a big
	// disk, whose seeks are short. It must not be smaller than the inner
	// device.
	Capacity int64
	// TrackToTrack, AvgSeek and FullStroke define the seek curve (settle
	// included). Defaults 1 ms, 8.5 ms, 17 ms.
	TrackToTrack, AvgSeek, FullStroke time.Duration
	// QueueDepth is how many queued requests the drive reorders by
	// positioning time (NCQ). Default 32; 1 is FIFO.
	QueueDepth int
	// AgeLimit bounds reordering: a request queued longer is served next.
	// Default 1 s.
	AgeLimit time.Duration
	// ReadAhead is how far the drive keeps reading past a read while idle,
	// into its buffer. Default 2 MiB; negative disables read-ahead.
	ReadAhead int64
	// WriteThrough turns the write cache off: a write completes when it is
	// on the platter. By default (false) writes complete once in the cache.
	WriteThrough bool
	// WriteCacheSize bounds the dirty data in the write cache. Default 16 MiB.
	WriteCacheSize int64
	// DestageQueue is how many of the oldest cached writes the drive
	// orders by positioning time when it destages. Default 64.
	DestageQueue int
	// CommandOverhead is the controller's time per command: a command
	// served from the buffer (a read-ahead hit, a cached write, a flush)
	// takes this plus its transfer, and one for the platter reaches the
	// actuator's queue this long after it arrives. Default 20 µs.
	CommandOverhead time.Duration
	// InterfaceRate is the host link's rate (bytes/s) for buffer hits and
	// cached writes. Default 600e6 (SATA 6 Gb/s).
	InterfaceRate float64
	// TimeScale is wall-clock time per model time: 1 (the default) is real
	// time, 0.001 runs the model 1000 times faster (for tests and quick
	// benchmarks); 1e-4 to 1e4. Stats are in model time.
	TimeScale float64

	virtual bool                 // tests: wait with Go timers only, which testing/synctest fakes
	late    func() time.Duration // tests: make the loop wake this late
}

// DefaultHDD returns the default HDD parameters, every field filled in.
func DefaultHDD() HDDParams {
	return HDDParams{
		RPM:             7200,
		OuterRate:       140e6,
		InnerRate:       70e6,
		Zones:           16,
		TrackToTrack:    time.Millisecond,
		AvgSeek:         8500 * time.Microsecond,
		FullStroke:      17 * time.Millisecond,
		QueueDepth:      32,
		AgeLimit:        time.Second,
		ReadAhead:       2 << 20,
		WriteCacheSize:  16 << 20,
		DestageQueue:    64,
		CommandOverhead: 20 * time.Microsecond,
		InterfaceRate:   600e6,
		TimeScale:       1,
	}
}

// withDefaults returns p with every zero field set to its default.
func (p HDDParams) withDefaults() HDDParams {
	d := DefaultHDD()
	orDefault(&p.RPM, d.RPM)
	orDefault(&p.OuterRate, d.OuterRate)
	orDefault(&p.InnerRate, d.InnerRate)
	orDefault(&p.InterfaceRate, d.InterfaceRate)
	orDefault(&p.TimeScale, d.TimeScale)
	orDefault(&p.TrackToTrack, d.TrackToTrack)
	orDefault(&p.AvgSeek, d.AvgSeek)
	orDefault(&p.FullStroke, d.FullStroke)
	orDefault(&p.AgeLimit, d.AgeLimit)
	orDefault(&p.CommandOverhead, d.CommandOverhead)
	orDefault(&p.Zones, d.Zones)
	orDefault(&p.QueueDepth, d.QueueDepth)
	orDefault(&p.ReadAhead, d.ReadAhead)
	orDefault(&p.WriteCacheSize, d.WriteCacheSize)
	orDefault(&p.DestageQueue, d.DestageQueue)
	return p
}

// orDefault sets a zero parameter to its default.
func orDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// HDD is a device.Device that stores data on an inner device and completes
// each request when the modelled disk would (see the package comment).
// It is safe for concurrent use; concurrent requests queue in the drive.
//
// Invariants (h.mu held):
//
//  1. The actuator serves one request at a time: each decision starts at
//     Td = max(busyUntil, the chosen request's arrival) and sets busyUntil
//     to its end, so service intervals never overlap and model time only
//     moves forward.
//  2. A decision at Td considers only requests that had arrived by Td, and
//     is taken only once the wall clock has passed Td: a late loop delays
//     notifications, never the model.
//  3. dirty is sorted by offset and fifo holds the same extents (plus gone
//     ones) in write order; dirtyBytes is the sum of the live extents'
//     lengths and never exceeds WriteCacheSize.
//  4. A Sync completes only after every extent that was dirty when it
//     arrived has been destaged.
//  5. Every request's channel is closed exactly once (by the timeline, or by
//     Close).
type HDD struct {
	front
	p  HDDParams
	g  *geometry
	tl *timeline

	closeOnce sync.Once
	closeErr  error

	// mu guards the drive's state below and the timeline's waiters.
	mu struct {
		sync.Mutex
		closed     bool
		queue      []*hreq   // host requests waiting for the actuator, in arrival order
		admit      []*hreq   // writes waiting for room in the write cache, in arrival order
		dirty      []*extent // write cache, sorted by offset
		fifo       []*extent // write cache in write order; gone extents are skipped
		dirtyBytes int64
		syncs      []*syncReq // flushes waiting for the write cache to drain
		wseq       uint64     // sequence number of the last cached write
		head       int64      // track under the head once busyUntil has passed
		headOff    int64      // byte after the last access
		busyUntil  int64      // model time the actuator becomes free
		destageEnd int64      // end of the latest destage
		iface      int64      // model time the host link becomes free
		ra         readAhead
		stats      Stats
	}
}

var (
	_ device.Device    = (*HDD)(nil)
	_ device.Discarder = (*HDD)(nil)
	_ device.Zeroer    = (*HDD)(nil)
)

type hreq struct {
	write   bool
	off, n  int64
	arrival int64
	done    chan struct{}
}

type extent struct {
	off, n int64
	ready  int64 // model time the data is in the cache
	seq    uint64
	gone   bool // destaged (still in fifo until it reaches the front)
}

type syncReq struct {
	seq  uint64
	done chan struct{}
}

// readAhead is the drive's read buffer: [lo, hi) holds data; while active,
// the head keeps streaming from e (reached at model time te) towards limit,
// so the buffer grows at the zone's rate.
type readAhead struct {
	active       bool
	lo, hi       int64
	e, te, limit int64
}

// NewHDD returns inner behind a model of an HDD with parameters p (zero
// fields take their defaults). The model starts a goroutine; Close stops it
// and closes inner.
func NewHDD(inner device.Device, p HDDParams) (*HDD, error) {
	if inner == nil {
		return nil, fmt.Errorf("model: nil inner device")
	}
	p = p.withDefaults()
	size := inner.Size()
	capacity := p.Capacity
	if capacity == 0 {
		capacity = size
	}
	switch {
	case size <= 0:
		return nil, fmt.Errorf("model: inner device has size %d", size)
	case capacity < size:
		return nil, fmt.Errorf("model: capacity %d is smaller than the inner device (%d bytes)", capacity, size)
	case p.QueueDepth < 1 || p.QueueDepth > 1024 || p.DestageQueue < 1 || p.DestageQueue > 1<<16:
		return nil, fmt.Errorf("model: queue depth %d, destage queue %d: want 1..1024 and 1..65536", p.QueueDepth, p.DestageQueue)
	case p.AgeLimit < 0 || p.CommandOverhead < 0:
		return nil, fmt.Errorf("model: negative age limit or command overhead")
	case !(p.InterfaceRate > 0):
		return nil, fmt.Errorf("model: interface rate %v is not positive", p.InterfaceRate)
	case !(p.TimeScale >= minTimeScale && p.TimeScale <= maxTimeScale):
		return nil, fmt.Errorf("model: time scale %v out of range [%v, %v]", p.TimeScale, minTimeScale, maxTimeScale)
	}
	g, err := newGeometry(capacity, p.RPM, p.Zones, p.OuterRate, p.InnerRate, p.TrackToTrack, p.AvgSeek, p.FullStroke)
	if err != nil {
		return nil, err
	}
	h := &HDD{p: p, g: g}
	h.inner, h.sched = inner, h
	h.tl = newTimeline(&h.mu.Mutex, h, p.TimeScale, p.virtual)
	h.tl.late = p.late
	go h.tl.run()
	return h, nil
}

// Params returns the model's parameters, defaults filled in.
func (h *HDD) Params() HDDParams { p := h.p; p.virtual, p.late = false, nil; return p }

// Stats returns the counters so far (times in model time).
func (h *HDD) Stats() Stats {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.mu.stats
	s.DirtyBytes = h.mu.dirtyBytes
	return s
}

// String describes the model.
func (h *HDD) String() string {
	return fmt.Sprintf("hdd model (%.0f rpm, %.0f-%.0f MB/s, seek %v/%v/%v, QD %d, write cache %v) over %v",
		h.p.RPM, h.p.OuterRate/1e6, h.p.InnerRate/1e6, h.p.TrackToTrack, h.p.AvgSeek, h.p.FullStroke,
		h.p.QueueDepth, !h.p.WriteThrough, h.inner)
}

// Close stops the model (releasing any waiting request) and closes the
// inner device. A second Close returns the first's result.
func (h *HDD) Close() error {
	h.closeOnce.Do(func() {
		h.closed.Store(true)
		h.mu.Lock()
		h.mu.closed = true
		for _, r := range h.mu.queue {
			close(r.done)
		}
		for _, r := range h.mu.admit {
			close(r.done)
		}
		for _, s := range h.mu.syncs {
			close(s.done)
		}
		h.mu.queue, h.mu.admit, h.mu.syncs = nil, nil, nil
		h.mu.Unlock()
		h.tl.shutdown()
		h.closeErr = h.inner.Close()
	})
	return h.closeErr
}

func (h *HDD) count(f func(*Stats)) {
	h.mu.Lock()
	f(&h.mu.stats)
	h.mu.Unlock()
}

type opKind int

const (
	opRead opKind = iota
	opWrite
	opSync
	opNop // a command with no data: discard
)

// submit enters a request into the drive (scheduler).
func (h *HDD) submit(op opKind, off, n int64) (completion, error) {
	done, err := h.enter(op, off, n)
	return completion{done: done}, err
}

// submitZeroes costs what writing length bytes costs: the modelled disk
// has no fast zeroing.
func (h *HDD) submitZeroes(off, length int64) (completion, error) {
	if length == 0 {
		return completion{done: closedCh}, nil
	}
	return h.submit(opWrite, off, length)
}

func (h *HDD) countDiscard() { h.count(func(s *Stats) { s.Discards++ }) }

// enter enters a request into the drive at the current model time and
// returns a channel closed when it completes.
func (h *HDD) enter(op opKind, off, n int64) (<-chan struct{}, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mu.closed {
		return nil, device.ErrClosed
	}
	now := h.tl.now()
	st := &h.mu.stats
	switch op {
	case opRead:
		st.Reads++
		st.BytesRead += uint64(n)
		if h.hitLocked(off, n, now) {
			st.BufferHits++
			return h.tl.addLocked(h.ifaceLocked(now, n)), nil
		}
	case opWrite:
		st.Writes++
		st.BytesWritten += uint64(n)
		h.invalidateLocked(off, n)
		if !h.p.WriteThrough && n <= h.p.WriteCacheSize {
			r := &hreq{write: true, off: off, n: n, arrival: now, done: make(chan struct{})}
			if len(h.mu.admit) == 0 && h.mu.dirtyBytes+n <= h.p.WriteCacheSize {
				h.admitLocked(r, now)
			} else {
				h.mu.admit = append(h.mu.admit, r)
			}
			h.tl.poke()
			return r.done, nil
		}
	case opSync:
		st.Syncs++
		s := &syncReq{seq: h.mu.wseq, done: make(chan struct{})}
		h.mu.syncs = append(h.mu.syncs, s)
		h.syncsLocked(now)
		h.tl.poke()
		return s.done, nil
	case opNop:
		return h.tl.addLocked(h.ifaceLocked(now, 0)), nil
	}
	// The command reaches the actuator's queue once the drive has decoded
	// it: at QD1 a sequential request that follows a completed one misses
	// its sector (a lost revolution), while a queued one does not.
	r := &hreq{write: op == opWrite, off: off, n: n, arrival: now + int64(h.p.CommandOverhead), done: make(chan struct{})}
	h.mu.queue = append(h.mu.queue, r)
	st.MaxQueue = max(st.MaxQueue, len(h.mu.queue))
	h.tl.poke()
	return r.done, nil
}

// ifaceLocked reserves the host link for a command moving n bytes from or
// to the drive's buffer starting at model time t, and returns its end.
func (h *HDD) ifaceLocked(t, n int64) int64 {
	start := max(t, h.mu.iface)
	h.mu.iface = start + int64(h.p.CommandOverhead) + int64(float64(n)*1e9/h.p.InterfaceRate)
	return h.mu.iface
}

// admitLocked puts write r into the write cache at model time t; it
// completes once transferred over the link.
func (h *HDD) admitLocked(r *hreq, t int64) {
	h.mu.wseq++
	ack := h.ifaceLocked(t, r.n)
	e := &extent{off: r.off, n: r.n, ready: ack, seq: h.mu.wseq}
	i := sort.Search(len(h.mu.dirty), func(i int) bool { return h.mu.dirty[i].off >= r.off })
	h.mu.dirty = append(h.mu.dirty, nil)
	copy(h.mu.dirty[i+1:], h.mu.dirty[i:])
	h.mu.dirty[i] = e
	h.mu.fifo = append(h.mu.fifo, e)
	h.mu.dirtyBytes += r.n
	h.mu.stats.CachedWrites++
	h.tl.releaseAtLocked(ack, r.done)
}

// raHiLocked is the end of the valid read-ahead data at model time t.
func (h *HDD) raHiLocked(t int64) int64 {
	ra := &h.mu.ra
	if !ra.active || t < ra.te {
		return ra.hi
	}
	streamed := int64(float64(t-ra.te) * h.g.sustained(ra.e) / 1e9)
	return min(ra.e+streamed, ra.limit)
}

// hitLocked reports whether a read of [off, off+n) at model time t is
// served from the drive's memory: the read-ahead buffer or the write cache.
func (h *HDD) hitLocked(off, n, t int64) bool {
	ra := &h.mu.ra
	if (ra.active || ra.hi > ra.lo) && off >= ra.lo && off+n <= h.raHiLocked(t) && (!ra.active || t >= ra.te) {
		return true
	}
	d := h.mu.dirty
	i := sort.Search(len(d), func(i int) bool { return d[i].off > off })
	for j := i - 1; j >= 0 && j >= i-4; j-- {
		if e := d[j]; e.off <= off && off+n <= e.off+e.n && e.ready <= t {
			return true
		}
	}
	return false
}

// invalidateLocked drops read-ahead data that a write to [off, off+n)
// makes stale.
func (h *HDD) invalidateLocked(off, n int64) {
	ra := &h.mu.ra
	if off < max(ra.limit, ra.hi) && off+n > ra.lo {
		*ra = readAhead{}
	}
}

// stopReadAheadLocked ends streaming at model time t: the buffer keeps what
// was read, and the head stays over the track where it stopped.
func (h *HDD) stopReadAheadLocked(t int64) {
	ra := &h.mu.ra
	if !ra.active {
		return
	}
	hi := h.raHiLocked(t)
	if t < ra.te {
		hi = ra.e
	}
	ra.hi, ra.active = hi, false
	if hi > ra.e {
		h.mu.head = h.g.track(hi - 1)
		h.mu.headOff = hi
	}
}

// continuesLocked reports whether a read at off, decided at model time t,
// continues the read-ahead stream: the head is already reading towards it.
func (h *HDD) continuesLocked(r *hreq, t int64) bool {
	ra := &h.mu.ra
	if !ra.active || r.write || t < ra.te || r.off < ra.lo {
		return false
	}
	hi := h.raHiLocked(t)
	return r.off <= hi && hi < ra.limit
}

// syncsLocked completes the flushes whose writes have all been destaged,
// at model time t or when the last destage ends.
func (h *HDD) syncsLocked(t int64) {
	if len(h.mu.syncs) == 0 {
		return
	}
	oldest := ^uint64(0)
	if e := h.oldestDirtyLocked(); e != nil {
		oldest = e.seq
	}
	keep := h.mu.syncs[:0]
	for _, s := range h.mu.syncs {
		if s.seq < oldest {
			at := max(t, h.mu.destageEnd) + int64(h.p.CommandOverhead)
			h.tl.releaseAtLocked(at, s.done)
			continue
		}
		keep = append(keep, s)
	}
	clear(h.mu.syncs[len(keep):])
	h.mu.syncs = keep
}

// advanceLocked makes the actuator's decisions due by model time now and
// returns the time of the next one (the engine interface).
func (h *HDD) advanceLocked(now int64) int64 {
	for {
		if h.mu.closed {
			return never
		}
		// The earliest time some work is available to the actuator.
		avail := never
		if len(h.mu.queue) > 0 {
			avail = h.mu.queue[0].arrival
		}
		// Cached writes become ready in write order.
		if e := h.oldestDirtyLocked(); e != nil && e.seq <= h.destageLimitLocked() {
			avail = min(avail, e.ready)
		}
		if avail == never {
			return never
		}
		td := max(h.mu.busyUntil, avail)
		if td > now {
			return td
		}
		if !h.decideLocked(td) {
			// Unreachable: some request had arrived by td. Stop rather
			// than spin; the next submission pokes the loop again.
			return never
		}
	}
}

// maxDestage bounds a destage write coalesced from contiguous extents.
const maxDestage = 1 << 20

// destageLimitLocked is the highest write sequence number that may be
// destaged: while a flush waits, only the writes it waits for, so that a
// stream of new writes cannot starve it.
func (h *HDD) destageLimitLocked() uint64 {
	if len(h.mu.syncs) > 0 {
		return h.mu.syncs[0].seq
	}
	return ^uint64(0)
}

// decideLocked chooses and schedules the actuator's next operation at model
// time td (the actuator is free and some work has arrived by td). It
// reports whether it made progress.
func (h *HDD) decideLocked(td int64) bool {
	st := &h.mu.stats
	// Reads that the buffer can now serve need no actuator.
	hits := false
	q := h.mu.queue[:0]
	for _, r := range h.mu.queue {
		if !r.write && r.arrival <= td && h.hitLocked(r.off, r.n, td) {
			st.BufferHits++
			h.tl.releaseAtLocked(h.ifaceLocked(td, r.n), r.done)
			hits = true
			continue
		}
		q = append(q, r)
	}
	clear(h.mu.queue[len(q):])
	h.mu.queue = q

	// Candidates: the oldest QueueDepth host requests and the oldest
	// DestageQueue cached writes, by shortest positioning time. The oldest
	// host request goes first once it is older than AgeLimit (starvation
	// protection).
	var (
		best      *hreq
		bestDirty = -1
		bestPos   = never
		bestCont  bool
	)
	n := min(len(h.mu.queue), h.p.QueueDepth)
	if n > 0 && td-h.mu.queue[0].arrival > int64(h.p.AgeLimit) {
		best = h.mu.queue[0]
		bestCont = h.continuesLocked(best, td)
		st.AgeForced++
	} else {
		for _, r := range h.mu.queue[:n] {
			if r.arrival > td {
				break
			}
			var pos int64
			cont := h.continuesLocked(r, td)
			if !cont {
				pos = h.g.position(h.headAtLocked(td), td, r.off)
			}
			if pos < bestPos {
				best, bestPos, bestCont = r, pos, cont
			}
		}
		for _, i := range h.dirtyCandidatesLocked(td) {
			e := h.mu.dirty[i]
			pos := h.g.position(h.headAtLocked(td), td, e.off)
			if pos < bestPos {
				best, bestDirty, bestPos, bestCont = nil, i, pos, false
			}
		}
	}
	if best == nil && bestDirty < 0 {
		return hits
	}

	var a access
	var off, n64 int64
	merged := 0 // extents coalesced after bestDirty
	if bestCont {
		// The head is already streaming towards the data: no positioning.
		ra := h.mu.ra
		off, n64 = best.off, best.n
		a = h.g.access(h.g.track(ra.e-1), ra.te, ra.e, best.off+best.n-ra.e)
	} else {
		h.stopReadAheadLocked(td)
		if best != nil {
			off, n64 = best.off, best.n
		} else {
			e := h.mu.dirty[bestDirty]
			off, n64 = e.off, e.n
			// Coalesce the contiguous extents that follow into one write.
			limit := h.destageLimitLocked()
			for j := bestDirty + 1; j < len(h.mu.dirty) && n64 < maxDestage; j++ {
				f := h.mu.dirty[j]
				if f.off != off+n64 || f.ready > td || f.seq > limit {
					break
				}
				n64 += f.n
				merged++
			}
		}
		a = h.g.access(h.mu.head, td, off, n64)
	}
	h.mu.busyUntil = a.end
	h.mu.head = a.track
	h.mu.headOff = off + n64
	st.BusyTime += time.Duration(a.end - td)
	st.Seeks += uint64(a.seeks)
	st.SeekTracks += uint64(a.seekTracks)
	st.SeekTime += time.Duration(a.seekTime)
	st.RotationalWait += time.Duration(a.rotTime)
	st.TransferTime += time.Duration(a.xf)

	if best != nil {
		h.removeQueuedLocked(best)
		h.tl.releaseAtLocked(a.end, best.done)
		h.mu.ra = readAhead{}
		if !best.write && h.p.ReadAhead > 0 {
			h.mu.ra = readAhead{active: true, lo: off, hi: off + n64, e: off + n64, te: a.end,
				limit: min(off+n64+h.p.ReadAhead, h.inner.Size())}
		}
		return true
	}
	// A destage: the extents leave the cache, making room for waiting writes.
	for _, e := range h.mu.dirty[bestDirty : bestDirty+1+merged] {
		e.gone = true
	}
	h.mu.dirty = append(h.mu.dirty[:bestDirty], h.mu.dirty[bestDirty+1+merged:]...)
	h.mu.dirtyBytes -= n64
	h.mu.destageEnd = a.end
	h.mu.ra = readAhead{}
	st.Destages += uint64(1 + merged)
	for len(h.mu.admit) > 0 && h.mu.dirtyBytes+h.mu.admit[0].n <= h.p.WriteCacheSize {
		r := h.mu.admit[0]
		h.mu.admit = h.mu.admit[1:]
		h.admitLocked(r, max(td, r.arrival))
	}
	h.syncsLocked(td)
	return true
}

// headAtLocked is the head's track for a decision at td. (While streaming
// read-ahead the head has moved on from where the last read ended.)
func (h *HDD) headAtLocked(td int64) int64 {
	ra := &h.mu.ra
	if ra.active && td >= ra.te {
		if hi := h.raHiLocked(td); hi > ra.e {
			return h.g.track(hi - 1)
		}
	}
	return h.mu.head
}

func (h *HDD) removeQueuedLocked(r *hreq) {
	for i, x := range h.mu.queue {
		if x == r {
			h.mu.queue = append(h.mu.queue[:i], h.mu.queue[i+1:]...)
			h.mu.queue = h.mu.queue[:len(h.mu.queue):len(h.mu.queue)]
			return
		}
	}
}

// oldestDirtyLocked returns the oldest extent in the write cache, or nil.
func (h *HDD) oldestDirtyLocked() *extent {
	f := h.mu.fifo
	for len(f) > 0 && f[0].gone {
		f[0] = nil
		f = f[1:]
	}
	h.mu.fifo = f
	if len(f) == 0 {
		return nil
	}
	return f[0]
}

// dirtyIndexLocked returns e's index in h.mu.dirty.
func (h *HDD) dirtyIndexLocked(e *extent) int {
	d := h.mu.dirty
	for i := sort.Search(len(d), func(i int) bool { return d[i].off >= e.off }); i < len(d); i++ {
		if d[i] == e {
			return i
		}
	}
	return -1 // unreachable (invariant 3)
}

// dirtyCandidatesLocked returns the indices in h.mu.dirty of the extents the
// actuator may destage at td: the oldest DestageQueue live extents that are
// ready by td and below destageLimitLocked.
func (h *HDD) dirtyCandidatesLocked(td int64) []int {
	h.oldestDirtyLocked()
	limit := h.destageLimitLocked()
	var out []int
	for _, e := range h.mu.fifo {
		if len(out) >= h.p.DestageQueue || e.seq > limit || e.ready > td {
			break
		}
		if !e.gone {
			if i := h.dirtyIndexLocked(e); i >= 0 {
				out = append(out, i)
			}
		}
	}
	return out
}
