package writeback

// Writeback's queue depth: how many backing writes a batch keeps in flight.
//
// What depth a backing device needs depends on the device: a local disk
// sorts 32 queued writes into one sweep; a remote export over a link with
// a round trip of milliseconds delivers at most depth/RTT writes a second,
// however fast its disk; a device that serializes gains nothing from a
// deep queue but latency. So the depth is searched for, per volume, as TCP
// congestion control searches for a window (AIMD, with TCP Vegas's
// congestion signal):
//
//   - writeback measures each window of completed writes (at least
//     depthWindow, and at least one depth's worth): their mean latency,
//     and the lowest latency of one write in the last depthHistory
//     windows, the latency of the path without a queue (a link's round
//     trip plus the device's own time: some write finds no queue ahead of
//     it);
//   - by Little's law, depth x (1 - lowest/mean) of the writes in flight
//     are waiting in a queue at the bottleneck rather than on the path. A
//     disk needs about wbQueueDepth queued to sort them (NCQ, the
//     elevator): fewer than depthQueueLow and the depth grows by depthStep
//     (additive increase); more than depthQueueHigh and the deeper queue
//     only adds latency, so it shrinks to 3/4 (multiplicative decrease).
//
// On a local disk the path holds almost nothing and the depth stays near
// the queue a disk needs; on a remote it grows by what the link holds in
// flight (its bandwidth-delay product). It stays in [wbDepthMin,
// wbDepthMax] and starts at wbQueueDepth. A window during which client
// reads went to the backing device, or writeback yielded to them, is
// dropped (its latencies are the reads' too), as is the partial window at
// the end of a batch. While client reads go to the backing device
// (within wbIdle) a batch keeps at most wbQueueDepth writes in flight
// (Writer.write): a read waits behind every write queued ahead of it. The
// in-flight byte bound grows with the depth (inflightBytes).

import (
	"sync"
	"time"
)

const (
	wbDepthMin     = 4
	wbDepthMax     = 256
	depthWindow    = 32                   // writes per measurement window, at least
	depthHistory   = 16                   // windows the lowest latency is taken over
	depthStep      = 4                    // additive increase
	depthQueueLow  = wbQueueDepth         // queued at the bottleneck: fewer, grow
	depthQueueHigh = 3 * wbQueueDepth / 2 // more, shrink
)

// depthCtl is a volume's writeback queue depth (see the file comment).
// Safe for concurrent use: every writeback batch of the volume reports to
// it.
type depthCtl struct {
	fixed bool // testingKnobs.fixedDepth: always wbQueueDepth
	mu    struct {
		sync.Mutex
		depth int
		// The window being measured: writes, their summed and lowest
		// latency, and the volume's disturbance count when it started.
		n      int
		lat    time.Duration
		low    time.Duration
		yields uint64
		// lows are the lowest latencies of the last depthHistory windows
		// (a ring; next is the oldest).
		lows    [depthHistory]time.Duration
		next    int
		adjusts uint64 // depth changes (the measurement reports them)
	}
}

func newDepthCtl(fixed bool) *depthCtl {
	c := &depthCtl{fixed: fixed}
	c.mu.depth = wbQueueDepth
	return c
}

// depth returns the current depth.
func (c *depthCtl) depth() int {
	if c.fixed {
		return wbQueueDepth
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mu.depth
}

// inflightBytes bounds the backing bytes in flight at the current depth:
// wbInflightBytes up to wbQueueDepth, in proportion above.
func (c *depthCtl) inflightBytes() int {
	return wbInflightBytes * max(c.depth(), wbQueueDepth) / wbQueueDepth
}

// begin starts a window (at a batch's start); yields is the volume's
// disturbance count now (Writer.disturbances).
func (c *depthCtl) begin(yields uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.restartLocked(yields)
}

// REQUIRES: c.mu
func (c *depthCtl) restartLocked(yields uint64) {
	c.mu.n, c.mu.lat, c.mu.low, c.mu.yields = 0, 0, 0, yields
}

// done records a completed backing write that took lat; yields is the
// volume's disturbance count now.
func (c *depthCtl) done(lat time.Duration, yields uint64) {
	if c.fixed {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.mu.n++
	c.mu.lat += lat
	if c.mu.low == 0 || lat < c.mu.low {
		c.mu.low = max(lat, 1)
	}
	if c.mu.n < max(depthWindow, c.mu.depth) {
		return
	}
	if yields == c.mu.yields {
		c.decideLocked(c.mu.lat/time.Duration(c.mu.n), c.mu.low)
	}
	c.restartLocked(yields)
}

// decideLocked adjusts the depth after a window of mean latency lat whose
// fastest write took low.
// REQUIRES: c.mu
func (c *depthCtl) decideLocked(lat, low time.Duration) {
	m := &c.mu
	m.lows[m.next] = low
	m.next = (m.next + 1) % depthHistory
	lowest := low
	for _, l := range m.lows {
		if l > 0 {
			lowest = min(lowest, l)
		}
	}
	d := m.depth
	queued := float64(d) * (1 - float64(lowest)/float64(max(lat, lowest)))
	switch {
	case queued < depthQueueLow:
		d += depthStep
	case queued > depthQueueHigh:
		d = d * 3 / 4
	}
	d = min(max(d, wbDepthMin), wbDepthMax)
	if d != m.depth {
		m.adjusts++
	}
	m.depth = d
}
