package model

import (
	"fmt"
	"sync"
	"time"

	"github.com/tiercache/tiercache/device"
)

// SSDParams are the parameters of the SSD model. A zero field takes the
// value of the preset (SATASSD for NewSSD).
type SSDParams struct {
	// ReadLatency is the flash read time of a request, before its data
	// crosses the host link. WriteLatency is the time to take a request's
	// data into the drive's (DRAM or SLC) write cache after the link.
	ReadLatency, WriteLatency time.Duration
	// ProgramTime is how long a write keeps its channel busy (programming
	// flash behind the cache), if longer than WriteLatency: it sets the
	// random write rate at depth, Channels/ProgramTime, without slowing a
	// write at QD1.
	ProgramTime time.Duration
	// Channels is how many requests the drive serves at once (its internal
	// parallelism: channels × dies, as far as a queue of requests can use
	// them).
	Channels int
	// ReadRate and WriteRate cap the host link's throughput (bytes/s); the
	// link carries one request's data at a time.
	ReadRate, WriteRate float64
	// FlushLatency is the time a flush takes once every completed write has
	// reached the write cache, if anything was written (or discarded) since
	// the previous flush arrived. CleanFlushLatency is what a flush costs
	// when nothing was: a volatile cache with nothing new to destage only
	// has the command to answer (it still completes no earlier than the
	// flush before it, which may be destaging what it must cover).
	FlushLatency, CleanFlushLatency time.Duration
	// TimeScale is wall-clock time per model time (1: real time; 1e-4 to
	// 1e4).
	TimeScale float64

	virtual bool // tests: wait with Go timers only, which testing/synctest fakes
}

// SATASSD returns the parameters of a SATA SSD of the Samsung 860 EVO
// class (550/520 MB/s, 98k/90k IOPS at QD32, 10k/42k IOPS at QD1).
func SATASSD() SSDParams {
	return SSDParams{
		ReadLatency:  80 * time.Microsecond,
		WriteLatency: 16 * time.Microsecond,
		ProgramTime:  89 * time.Microsecond,
		Channels:     8,
		ReadRate:     530e6,
		WriteRate:    500e6,
		FlushLatency: time.Millisecond,
		// Assumption: one command's round trip, as a 4 KiB write's
		// WriteLatency (16 µs) plus the link.
		CleanFlushLatency: 20 * time.Microsecond,
		TimeScale:         1,
	}
}

// NVMeSSD returns the parameters of an NVMe SSD of the Samsung 970 EVO Plus
// class (3,500/3,300 MB/s, 19k/60k IOPS at QD1, 600k/550k at depth).
func NVMeSSD() SSDParams {
	return SSDParams{
		ReadLatency:       50 * time.Microsecond,
		WriteLatency:      15 * time.Microsecond,
		ProgramTime:       58 * time.Microsecond,
		Channels:          32,
		ReadRate:          3500e6,
		WriteRate:         3300e6,
		FlushLatency:      300 * time.Microsecond,
		CleanFlushLatency: 15 * time.Microsecond,
		TimeScale:         1,
	}
}

// withDefaults returns p with its zero fields taken from base.
func (p SSDParams) withDefaults(base SSDParams) SSDParams {
	orDefault(&p.ReadLatency, base.ReadLatency)
	orDefault(&p.WriteLatency, base.WriteLatency)
	orDefault(&p.ProgramTime, base.ProgramTime)
	orDefault(&p.Channels, base.Channels)
	orDefault(&p.ReadRate, base.ReadRate)
	orDefault(&p.WriteRate, base.WriteRate)
	orDefault(&p.FlushLatency, base.FlushLatency)
	orDefault(&p.CleanFlushLatency, base.CleanFlushLatency)
	orDefault(&p.TimeScale, base.TimeScale)
	p.virtual = p.virtual || base.virtual
	return p
}

// SSD is a device.Device that stores data on an inner device and completes
// each request when the modelled SSD would (see the package comment). It is
// safe for concurrent use.
//
// Invariants (s.mu held):
//
//  1. At most Channels requests occupy channels at once: chans[i] is the model
//     time channel i becomes free, and a request starts on the channel that
//     frees first, no earlier than its arrival.
//  2. The host link carries one request's data at a time: link is the
//     model time it becomes free.
//  3. A flush completes no earlier than every write that completed before
//     it arrived (lastWrite), plus FlushLatency; if no write or discard
//     arrived since the previous flush (written false), CleanFlushLatency
//     after it arrived instead, and never before the previous flush
//     (lastFlush).
type SSD struct {
	front
	p  SSDParams
	tl *timeline

	closeOnce sync.Once
	closeErr  error

	// mu guards the drive's state and the timeline's waiters.
	mu struct {
		sync.Mutex
		closed    bool
		chans     []int64
		link      int64
		lastWrite int64 // completion of the latest write
		lastFlush int64 // completion of the latest flush
		written   bool  // a write or discard arrived since the latest flush
		lastEnd   int64 // latest completion, for BusyTime
		stats     Stats
	}
}

// NewSSD returns inner behind a model of an SSD with parameters p (zero
// fields take SATASSD's values). The model starts a goroutine; Close stops
// it and closes inner.
func NewSSD(inner device.Device, p SSDParams) (*SSD, error) {
	if inner == nil {
		return nil, fmt.Errorf("model: nil inner device")
	}
	p = p.withDefaults(SATASSD())
	switch {
	case p.ReadLatency < 0 || p.WriteLatency < 0 || p.ProgramTime < 0 || p.FlushLatency < 0 || p.CleanFlushLatency < 0:
		return nil, fmt.Errorf("model: negative SSD latency")
	case p.Channels < 1 || p.Channels > 4096:
		return nil, fmt.Errorf("model: %d channels, want 1..4096", p.Channels)
	case !(p.ReadRate > 0) || !(p.WriteRate > 0):
		return nil, fmt.Errorf("model: SSD rates must be positive")
	case !(p.TimeScale >= minTimeScale && p.TimeScale <= maxTimeScale):
		return nil, fmt.Errorf("model: time scale %v out of range [%v, %v]", p.TimeScale, minTimeScale, maxTimeScale)
	}
	s := &SSD{p: p}
	s.inner, s.sched = inner, s
	s.mu.chans = make([]int64, p.Channels)
	s.tl = newTimeline(&s.mu.Mutex, s, p.TimeScale, p.virtual)
	go s.tl.run()
	return s, nil
}

// Params returns the model's parameters, defaults filled in.
func (s *SSD) Params() SSDParams { p := s.p; p.virtual = false; return p }

// String describes the model.
func (s *SSD) String() string {
	return fmt.Sprintf("ssd model (read %v, write %v, %d channels, %.0f/%.0f MB/s) over %v",
		s.p.ReadLatency, s.p.WriteLatency, s.p.Channels, s.p.ReadRate/1e6, s.p.WriteRate/1e6, s.inner)
}

// Stats returns the counters so far (times in model time).
func (s *SSD) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.stats
}

// advanceLocked: the SSD computes each completion when the request
// arrives, so it has no decisions to make later.
func (s *SSD) advanceLocked(int64) int64 { return never }

// Close stops the model (releasing any waiting request) and closes the
// inner device. A second Close returns the first's result.
func (s *SSD) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		s.mu.Lock()
		s.mu.closed = true
		s.mu.Unlock()
		s.tl.shutdown()
		s.closeErr = s.inner.Close()
	})
	return s.closeErr
}

// submit enters a request (scheduler); its completion time is fixed now.
func (s *SSD) submit(op opKind, _, n int64) (completion, error) {
	at, err := s.at(op, n)
	return completion{tl: s.tl, at: at}, err
}

// submitZeroes costs a write command without data: SSDs zero by unmapping.
func (s *SSD) submitZeroes(off, _ int64) (completion, error) { return s.submit(opWrite, off, 0) }

func (s *SSD) countDiscard() {
	s.mu.Lock()
	s.mu.stats.Discards++
	s.mu.Unlock()
}

// at computes the model time at which a request of n bytes arriving
// now completes. The caller does the data I/O, then waits until then.
func (s *SSD) at(op opKind, n int64) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed {
		return 0, device.ErrClosed
	}
	now := s.tl.now()
	st := &s.mu.stats
	// The channel that frees first.
	c := 0
	for i, t := range s.mu.chans {
		if t < s.mu.chans[c] {
			c = i
		}
	}
	var start, end int64
	switch op {
	case opRead:
		st.Reads++
		st.BytesRead += uint64(n)
		start = max(now, s.mu.chans[c])
		s.mu.chans[c] = start + int64(s.p.ReadLatency)
		link := max(s.mu.chans[c], s.mu.link)
		end = link + int64(float64(n)*1e9/s.p.ReadRate)
		s.mu.link = end
	case opWrite:
		if n > 0 {
			st.Writes++
			st.BytesWritten += uint64(n)
		}
		start = max(now, s.mu.link)
		s.mu.link = start + int64(float64(n)*1e9/s.p.WriteRate)
		onChan := max(s.mu.link, s.mu.chans[c])
		end = onChan + int64(s.p.WriteLatency)
		s.mu.chans[c] = onChan + int64(max(s.p.WriteLatency, s.p.ProgramTime))
		s.mu.lastWrite = max(s.mu.lastWrite, end)
		s.mu.written = true
	case opSync:
		st.Syncs++
		if s.mu.written {
			start = max(now, s.mu.lastWrite)
			end = start + int64(s.p.FlushLatency)
		} else {
			start = now
			end = max(start+int64(s.p.CleanFlushLatency), s.mu.lastFlush)
		}
		s.mu.written = false
		s.mu.lastFlush = max(s.mu.lastFlush, end)
	case opNop:
		st.Discards++
		s.mu.written = true
		start = max(now, s.mu.chans[c])
		end = start + int64(s.p.WriteLatency)
		s.mu.chans[c] = end
	}
	st.BusyTime += time.Duration(max(0, end-max(start, s.mu.lastEnd)))
	s.mu.lastEnd = max(s.mu.lastEnd, end)
	return end, nil
}
