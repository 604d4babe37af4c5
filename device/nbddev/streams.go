package nbddev

// Which connection a request goes on.
//
// Requests that continue an ascending stream (each starting at or a little
// after where the stream's previous one ended: a sequential read, or
// writeback's sweep of sorted dirty blocks) go on the connection the stream
// is on; other requests take the connections in turn. Spread over several
// connections, a stream reaches the server out of order (each connection
// has its own socket, reader and scheduling), and a disk behind it turns
// the stragglers that arrive after the head has passed into seeks back:
// writeback of 64 MiB of random blocks over an HDD model served by
// tiercache drained with ~50 % more seeks over four connections than over
// one. A stream leaves its connection when that one already has
// streamDepth requests in flight, so that a deep queue to a fast remote
// still spreads over the connections (a server may execute only so many
// requests per connection at once).

import "sync"

const (
	// streamGap is how far past a stream's end a request may start and
	// still continue it (sorted dirty blocks at 1/256 density over the
	// disk are 1 MiB apart).
	streamGap = 16 << 20
	// streamSlots is how many streams are tracked; the least recently
	// continued is forgotten for a new one.
	streamSlots = 8
	// streamDepth is the most requests in flight on a stream's connection
	// before the stream moves to the next one.
	streamDepth = 64
)

// chooser picks connections (see the file comment). Safe for concurrent
// use.
type chooser struct {
	mu struct {
		sync.Mutex
		gen      uint64 // the generation inflight counts
		rr       int
		tick     uint64
		streams  [streamSlots]stream
		inflight []int // per connection of the current generation
	}
}

type stream struct {
	end  int64 // where its last request ended; 0: unused slot
	conn int
	used uint64 // tick of its last request
}

// pick returns the connection (of n, in generation gen) for a request of
// [off, end) and counts it in flight there until done is called.
func (c *chooser) pick(gen uint64, off, end int64, n int) int {
	m := &c.mu
	m.Lock()
	defer m.Unlock()
	if gen != m.gen || len(m.inflight) != n {
		// A new generation: its connections start empty.
		m.gen = gen
		m.inflight = make([]int, n)
		m.streams = [streamSlots]stream{}
	}
	m.tick++
	lru := 0
	for i := range m.streams {
		s := &m.streams[i]
		if s.end > 0 && off >= s.end && off-s.end <= streamGap {
			if m.inflight[s.conn] >= streamDepth {
				s.conn = c.nextLocked(n)
			}
			s.end, s.used = end, m.tick
			m.inflight[s.conn]++
			return s.conn
		}
		if s.used < m.streams[lru].used {
			lru = i
		}
	}
	k := c.nextLocked(n)
	m.streams[lru] = stream{end: end, conn: k, used: m.tick}
	m.inflight[k]++
	return k
}

// REQUIRES: c.mu
func (c *chooser) nextLocked(n int) int {
	c.mu.rr = (c.mu.rr + 1) % n
	return c.mu.rr
}

// done ends a request picked on conn in generation gen.
func (c *chooser) done(gen uint64, conn int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen == c.mu.gen && c.mu.inflight[conn] > 0 {
		c.mu.inflight[conn]--
	}
}
