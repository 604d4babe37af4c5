package device

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
)

// Mem is an in-memory Device that remembers what a power cut would keep, so
// crash tests can check the cache's durability promises without a machine to
// unplug.
//
// Invariants:
//
//  1. Every 4 KiB block has a synced content (what survives any crash) and a
//     current content (what reads return). A block that was never written
//     is absent and reads as zeroes, so a large Mem costs only what is
//     written.
//  2. Sync makes current the synced content of every block written before
//     the call.
//  3. A synced array is never modified in place: writes after a Sync copy
//     it first, so CrashClone and Sync can share arrays safely.
//  4. Mem never retains a caller's slice: data is copied in and out.
//
// A crash (CrashClone) keeps all synced data. Each unsynced block is, as an
// independent draw, torn with probability TornProb (each 512-byte sector
// independently new or old, as a disk that writes sector by sector would
// leave it), else kept with probability UnsyncedKeep, else lost (old content).
// The draws come from CrashConfig.Rand in block order, so a seed replays.
//
// Mem is safe for concurrent use. Blocks are spread over sharded locks, so
// I/O to different blocks rarely contends.
type Mem struct {
	size   int64
	closed atomic.Bool
	shards [memShards]memShard
	stats  memCounters
}

var (
	_ Device    = (*Mem)(nil)
	_ Discarder = (*Mem)(nil)
	_ Zeroer    = (*Mem)(nil)
)

const (
	// MemBlockSize is the unit in which Mem tracks synced state and in which
	// CrashClone keeps or drops unsynced data.
	MemBlockSize = 4096
	// SectorSize is the unit of a torn write: a sector is written entirely
	// or not at all.
	SectorSize = 512

	memShards = 64
)

type memShard struct {
	// mu guards blocks and dirty, and the contents of every non-synced
	// array reachable from blocks.
	mu     sync.Mutex
	blocks map[int64]*memBlock // block index -> state; absent = zeroes, synced
	dirty  []int64             // indices of blocks with dirty set
}

type memBlock struct {
	cur    *[MemBlockSize]byte // what reads return; nil = zeroes
	synced *[MemBlockSize]byte // what survives a crash; nil = zeroes; never modified in place
	dirty  bool                // written since the last Sync (listed in memShard.dirty)
}

type memCounters struct {
	reads, writes, syncs, discards, zeroes atomic.Uint64
	bytesRead, bytesWritten                atomic.Uint64
}

// MemStats counts the operations a Mem has served (successful or not, but
// not those rejected because the device was closed).
type MemStats struct {
	Reads, Writes, Syncs, Discards, Zeroes uint64
	BytesRead, BytesWritten                uint64
}

// CrashConfig describes a power cut for CrashClone.
type CrashConfig struct {
	// UnsyncedKeep is the probability (0..1) that an unsynced block keeps
	// its new content.
	UnsyncedKeep float64
	// TornProb is the probability (0..1) that an unsynced block is torn:
	// a random subset of its sectors new, the rest old. It is drawn first;
	// a block that is not torn is then kept or lost per UnsyncedKeep.
	TornProb float64
	// Rand drives every choice. Nil means a fixed seed (0, 0).
	Rand *rand.Rand
}

// NewMem returns an empty (all-zero, all-synced) memory device of size
// bytes. A negative size is treated as 0.
func NewMem(size int64) *Mem {
	m := &Mem{size: max(size, 0)}
	for i := range m.shards {
		m.shards[i].blocks = make(map[int64]*memBlock)
	}
	return m
}

func (m *Mem) shard(idx int64) *memShard { return &m.shards[uint64(idx)%memShards] }

// Size returns the device size.
func (m *Mem) Size() int64 { return m.size }

func (m *Mem) check(op string, off, n int64) error {
	if m.closed.Load() {
		return &IOError{Op: op, Path: "mem", Off: off, Len: n, Err: ErrClosed}
	}
	if CheckRange(off, n, m.size) != nil {
		return &IOError{Op: op, Path: "mem", Off: off, Len: n, Err: RangeError(op, off, n, m.size)}
	}
	return nil
}

// ReadAt copies the current content of [off, off+len(p)) into p.
func (m *Mem) ReadAt(p []byte, off int64) (int, error) {
	if err := m.check("read", off, int64(len(p))); err != nil {
		return 0, err
	}
	m.stats.reads.Add(1)
	m.stats.bytesRead.Add(uint64(len(p)))
	done := 0
	for done < len(p) {
		pos := off + int64(done)
		idx, boff := pos/MemBlockSize, int(pos%MemBlockSize)
		n := min(len(p)-done, MemBlockSize-boff)
		s := m.shard(idx)
		s.mu.Lock()
		if b := s.blocks[idx]; b != nil && b.cur != nil {
			copy(p[done:done+n], b.cur[boff:])
		} else {
			clear(p[done : done+n])
		}
		s.mu.Unlock()
		done += n
	}
	return done, nil
}

// WriteAt copies p into [off, off+len(p)). It is durable after Sync.
func (m *Mem) WriteAt(p []byte, off int64) (int, error) {
	if err := m.check("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	m.stats.writes.Add(1)
	m.stats.bytesWritten.Add(uint64(len(p)))
	m.modify(off, int64(len(p)), p)
	return len(p), nil
}

// modify writes src (or zeroes if src is nil) over [off, off+n). The range
// has been checked.
func (m *Mem) modify(off, n int64, src []byte) {
	var done int64
	for done < n {
		pos := off + done
		idx, boff := pos/MemBlockSize, int(pos%MemBlockSize)
		k := min(n-done, int64(MemBlockSize-boff))
		s := m.shard(idx)
		s.mu.Lock()
		b := s.blocks[idx]
		if b == nil {
			b = &memBlock{}
			s.blocks[idx] = b
		}
		if !b.dirty {
			b.dirty = true
			s.dirty = append(s.dirty, idx)
		}
		switch {
		case src == nil && k == MemBlockSize:
			b.cur = nil
		case src == nil && b.cur == nil:
			// Zeroing part of a zero block: nothing to do.
		default:
			if b.cur == nil || b.cur == b.synced {
				nb := new([MemBlockSize]byte)
				if b.cur != nil {
					*nb = *b.cur
				}
				b.cur = nb
			}
			if src == nil {
				clear(b.cur[boff : boff+int(k)])
			} else {
				copy(b.cur[boff:boff+int(k)], src[done:done+k])
			}
		}
		s.mu.Unlock()
		done += k
	}
}

// Discard zeroes the range (a valid discard: its contents are unspecified).
func (m *Mem) Discard(off, length int64) error {
	if err := m.check("discard", off, length); err != nil {
		return err
	}
	m.stats.discards.Add(1)
	m.modify(off, length, nil)
	return nil
}

// WriteZeroes zeroes the range. Like a write, it is durable after Sync.
func (m *Mem) WriteZeroes(off, length int64) error {
	if err := m.check("write-zeroes", off, length); err != nil {
		return err
	}
	m.stats.zeroes.Add(1)
	m.modify(off, length, nil)
	return nil
}

// Sync makes every completed write durable.
func (m *Mem) Sync() error {
	if m.closed.Load() {
		return &IOError{Op: "sync", Path: "mem", Err: ErrClosed}
	}
	m.stats.syncs.Add(1)
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		for _, idx := range s.dirty {
			b := s.blocks[idx]
			b.synced, b.dirty = b.cur, false
			if b.cur == nil {
				delete(s.blocks, idx)
			}
		}
		s.dirty = s.dirty[:0]
		s.mu.Unlock()
	}
	return nil
}

// Close makes later operations fail with ErrClosed. The content is kept, so
// a closed Mem can still be CrashCloned (the crash may come after close).
func (m *Mem) Close() error {
	if m.closed.Swap(true) {
		return &IOError{Op: "close", Path: "mem", Err: ErrClosed}
	}
	return nil
}

// Stats returns the operation counters.
func (m *Mem) Stats() MemStats {
	return MemStats{
		Reads:        m.stats.reads.Load(),
		Writes:       m.stats.writes.Load(),
		Syncs:        m.stats.syncs.Load(),
		Discards:     m.stats.discards.Load(),
		Zeroes:       m.stats.zeroes.Load(),
		BytesRead:    m.stats.bytesRead.Load(),
		BytesWritten: m.stats.bytesWritten.Load(),
	}
}

// Unsynced returns the number of 4 KiB blocks written since the last Sync.
func (m *Mem) Unsynced() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		n += len(s.dirty)
		s.mu.Unlock()
	}
	return n
}

// Corrupt inverts every bit of [off, off+n), in both the current and the
// synced content: it models media corruption, which a crash does not undo.
// It works on a closed device too.
func (m *Mem) Corrupt(off int64, n int) error {
	if CheckRange(off, int64(n), m.size) != nil {
		return &IOError{Op: "corrupt", Path: "mem", Off: off, Len: int64(n), Err: RangeError("corrupt", off, int64(n), m.size)}
	}
	done := 0
	for done < n {
		pos := off + int64(done)
		idx, boff := pos/MemBlockSize, int(pos%MemBlockSize)
		k := min(n-done, MemBlockSize-boff)
		s := m.shard(idx)
		s.mu.Lock()
		b := s.blocks[idx]
		if b == nil {
			b = &memBlock{}
			s.blocks[idx] = b
		}
		shared := b.cur == b.synced
		b.synced = flipped(b.synced, boff, k)
		if shared {
			b.cur = b.synced
		} else {
			b.cur = flipped(b.cur, boff, k)
		}
		s.mu.Unlock()
		done += k
	}
	return nil
}

// flipped returns a new array: a copy of a (nil = zeroes) with bytes
// [off, off+n) inverted.
func flipped(a *[MemBlockSize]byte, off, n int) *[MemBlockSize]byte {
	nb := new([MemBlockSize]byte)
	if a != nil {
		*nb = *a
	}
	for i := off; i < off+n; i++ {
		nb[i] ^= 0xff
	}
	return nb
}

// CrashClone returns a new, open, fully synced Mem holding what the device
// would hold after a power cut now (see the type comment). m itself is not
// changed. Writes in flight during the call land in the clone or not, per
// block.
func (m *Mem) CrashClone(cfg CrashConfig) *Mem { return CrashCloneAll(cfg, m)[0] }

// CrashCloneAll is CrashClone of several devices at one instant: a power
// cut of the whole machine. Cloning them one after the other lets writes
// reach the later ones after the earlier were cloned, which no power cut
// does. The clones draw from cfg.Rand in the order of ms.
func CrashCloneAll(cfg CrashConfig, ms ...*Mem) []*Mem {
	if cfg.Rand == nil {
		cfg.Rand = rand.New(rand.NewPCG(0, 0))
	}
	// Lock every shard of every device so the clones are one instant's
	// state.
	for _, m := range ms {
		for i := range m.shards {
			m.shards[i].mu.Lock()
		}
	}
	defer func() {
		for _, m := range ms {
			for i := range m.shards {
				m.shards[i].mu.Unlock()
			}
		}
	}()
	out := make([]*Mem, len(ms))
	for i, m := range ms {
		out[i] = m.crashCloneLocked(cfg)
	}
	return out
}

// crashCloneLocked is CrashClone with every shard of m locked.
func (m *Mem) crashCloneLocked(cfg CrashConfig) *Mem {
	rng := cfg.Rand
	c := NewMem(m.size)
	var dirty []int64
	for i := range m.shards {
		s := &m.shards[i]
		for idx, b := range s.blocks {
			if b.synced != nil {
				// Synced arrays are immutable: share them.
				c.shard(idx).blocks[idx] = &memBlock{cur: b.synced, synced: b.synced}
			}
		}
		dirty = append(dirty, s.dirty...)
	}
	slices.Sort(dirty) // map order is random; draws must not be
	for _, idx := range dirty {
		b := m.shard(idx).blocks[idx]
		var res *[MemBlockSize]byte
		switch {
		case rng.Float64() < cfg.TornProb:
			res = tear(b.synced, b.cur, rng)
		case rng.Float64() < cfg.UnsyncedKeep:
			if b.cur != nil {
				res = new([MemBlockSize]byte)
				*res = *b.cur
			}
		default:
			res = b.synced
		}
		cs := c.shard(idx)
		if res == nil {
			delete(cs.blocks, idx)
		} else {
			cs.blocks[idx] = &memBlock{cur: res, synced: res}
		}
	}
	return c
}

// tear returns a block whose sectors are each, independently, from cur or
// from old (nil = zeroes).
func tear(old, cur *[MemBlockSize]byte, rng *rand.Rand) *[MemBlockSize]byte {
	res := new([MemBlockSize]byte)
	for s := 0; s < MemBlockSize; s += SectorSize {
		from := old
		if rng.IntN(2) == 1 {
			from = cur
		}
		if from != nil {
			copy(res[s:s+SectorSize], from[s:s+SectorSize])
		}
	}
	return res
}

// Check verifies the invariants of the type comment and of the bookkeeping
// behind them, for tests to run after a workload (t.Cleanup). It returns the
// first violation found.
func (m *Mem) Check() error {
	nblocks := (m.size + MemBlockSize - 1) / MemBlockSize
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		err := m.checkShardLocked(s, nblocks)
		s.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// checkShardLocked checks one shard. REQUIRES: s.mu held.
func (m *Mem) checkShardLocked(s *memShard, nblocks int64) error {
	listed := make(map[int64]bool, len(s.dirty))
	for _, idx := range s.dirty {
		b := s.blocks[idx]
		switch {
		case listed[idx]:
			return fmt.Errorf("device: mem: block %d listed dirty twice", idx)
		case b == nil:
			return fmt.Errorf("device: mem: dirty block %d has no state", idx)
		case !b.dirty:
			return fmt.Errorf("device: mem: block %d listed dirty but not marked", idx)
		}
		listed[idx] = true
	}
	for idx, b := range s.blocks {
		switch {
		case idx < 0 || idx >= nblocks:
			return fmt.Errorf("device: mem: block %d outside the device (%d blocks)", idx, nblocks)
		case m.shard(idx) != s:
			return fmt.Errorf("device: mem: block %d in the wrong shard", idx)
		case b.dirty && !listed[idx]:
			return fmt.Errorf("device: mem: block %d marked dirty but not listed", idx)
		case !b.dirty && b.cur != b.synced:
			return fmt.Errorf("device: mem: clean block %d has current content apart from its synced content", idx)
		case !b.dirty && b.cur == nil:
			return fmt.Errorf("device: mem: clean zero block %d kept (should be absent)", idx)
		}
	}
	return nil
}

// String describes the device for test logs.
func (m *Mem) String() string {
	return fmt.Sprintf("mem(%d bytes, %d unsynced blocks)", m.size, m.Unsynced())
}
