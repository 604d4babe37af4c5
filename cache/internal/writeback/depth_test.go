package writeback

import (
	"testing"
	"time"
)

// feed reports windows of writes to c, each write's latency given by lat
// from the depth then and the write's place in the window.
func feed(c *depthCtl, windows int, lat func(depth, i int) time.Duration) {
	for range windows {
		d := c.depth()
		for i := range max(depthWindow, d) {
			c.done(lat(d, i), 0)
		}
	}
}

// TestDepthCtl: the depth grows on a path that holds writes without
// queueing them (a link's round trip), stays near what a disk needs on a
// device that queues them, shrinks when the queue grows past that, and
// ignores windows in which writeback yielded to reads.
func TestDepthCtl(t *testing.T) {
	t.Run("link", func(t *testing.T) {
		// 10 ms round trip, whatever the depth: all of it path.
		c := newDepthCtl(false)
		feed(c, 100, func(int, int) time.Duration { return 10 * time.Millisecond })
		if got := c.depth(); got != wbDepthMax {
			t.Fatalf("depth %d on a link that queues nothing, want the bound %d", got, wbDepthMax)
		}
	})
	t.Run("disk", func(t *testing.T) {
		// A device serving one write per 100 µs in queue order: the i-th
		// write of a window waited for the others (mean depth/2 x 100 µs
		// beyond its own 100 µs).
		c := newDepthCtl(false)
		disk := func(d, i int) time.Duration { return time.Duration(1+i%d) * 100 * time.Microsecond }
		for range 50 {
			feed(c, 1, disk)
			if got := c.depth(); got < wbDepthMin || got > 2*depthQueueHigh+depthStep {
				t.Fatalf("depth %d on a queueing device, want at most about twice the queue a disk needs", got)
			}
		}
	})
	t.Run("backoff", func(t *testing.T) {
		// The link at first, then the device behind it saturates: every
		// write waits behind the others.
		c := newDepthCtl(false)
		feed(c, 100, func(int, int) time.Duration { return 10 * time.Millisecond })
		feed(c, 20, func(d, _ int) time.Duration { return 10*time.Millisecond + time.Duration(d)*time.Millisecond })
		if got := c.depth(); got > wbDepthMax/2 {
			t.Fatalf("depth %d after latency grew with the depth, want it shrunk", got)
		}
	})
	t.Run("yield", func(t *testing.T) {
		c := newDepthCtl(false)
		c.begin(0)
		for i := range 10 * depthWindow {
			c.done(10*time.Millisecond, uint64(i)) // a yield during every window
		}
		if got := c.depth(); got != wbQueueDepth {
			t.Fatalf("depth %d after windows with yields, want it unchanged (%d)", got, wbQueueDepth)
		}
	})
	t.Run("fixed", func(t *testing.T) {
		c := newDepthCtl(true)
		feed(c, 100, func(int, int) time.Duration { return 10 * time.Millisecond })
		if got := c.depth(); got != wbQueueDepth {
			t.Fatalf("fixed depth %d, want %d", got, wbQueueDepth)
		}
	})
}
