// Package mirror keeps a cache set's metadata and dirty data on two
// devices. A Mirror is a device.Device over members A and B that presents
// A's address space to the engine: below the bucket region (superblocks,
// journal, checkpoints) every write goes to both at the same offsets; in
// the bucket region a bucket is written to B only while the engine has
// mapped it to one of B's slots (Map), which it does for buckets that may
// hold dirty data. B can therefore be smaller than A. docs/DESIGN.md,
// "Mirrored cache devices", has the decisions; docs/CACHE.md the protocol.
//
// B's layout: the metadata region as on A ([0, BucketsOff)), then slots of
// one 4 KiB slot header and one bucket each:
//
//	slot header: magic "TCMIRSLT" | crc32c u32 | pad u32 | nonce u64 |
//	             bucket u64 | generation u32 | from u32
//
// A slot header names the bucket (and its generation) whose blocks from
// block `from` on the slot holds; a header of another set (nonce) or an
// older generation of its bucket is not a mapping.
//
// Reads: a piece in the bucket region that both live members hold a copy
// of is read from each member in turn; every other read goes to the
// primary (A unless A failed), the metadata region included: after a
// crash the members may differ in what was not synced, and recovery reads
// the primary's.
//
// Failure: a write or sync error on one member fails it (its flag in a new
// label, written and synced on the survivor before the failing call
// returns); the mirror then runs on the survivor alone. A read error on
// one member is served from the other and the bad copy rewritten; when
// the other holds no copy (a clean block only on A), or the rewrite
// fails, the member is failed too. A copy that fails the caller's check
// is replaced by the other's (RepairFrom).
// Concurrency: as device.Device; Map, Release and Mapped may be called
// under the caller's locks (they do no I/O).
package mirror

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// Member names a member of a mirror.
type Member int

// The members: A is the primary (--cache), B the mirror (--cache-mirror).
const (
	A Member = 0
	B Member = 1
)

func (m Member) String() string { return [...]string{"A", "B"}[m&1] }

func (m Member) other() Member { return 1 - m }

// ErrNoCopy is returned for I/O in the bucket region that the live
// members do not hold: with A failed, a bucket (or the part of one) B
// has no slot for. Such blocks were clean: the caller reads them from the
// backing device. It is not a device failure.
var ErrNoCopy = errors.New("mirror: no copy of this block on the surviving member")

// ErrBothFailed is returned when the last live member fails.
var ErrBothFailed = errors.New("mirror: both members failed")

// Layout is the part of the set's layout the mirror needs.
type Layout struct {
	Nonce      uint64
	BucketsOff int64 // start of the bucket region (metadata below)
	BucketSize int64
	NBuckets   int64
}

const blockSize = ondisk.BlockSize

func (l Layout) slotLen() int64 { return l.BucketSize + blockSize }

// Slots returns how many slots a B of bSize bytes has for layout l.
func Slots(l Layout, bSize int64) int64 {
	if bSize <= l.BucketsOff || l.BucketSize <= 0 {
		return 0
	}
	return min((bSize-l.BucketsOff)/l.slotLen(), l.NBuckets)
}

// MinSlots is the fewest slots a B may have: the open bucket and a few
// being written back.
const MinSlots = 4

// CheckSize reports an error unless a B of bSize bytes holds the metadata
// region and at least MinSlots slots.
func CheckSize(l Layout, bSize int64) error {
	if n := Slots(l, bSize); n < MinSlots {
		need := l.BucketsOff + MinSlots*l.slotLen()
		return fmt.Errorf("mirror device of %d bytes holds %d slots of %d bytes after the %d-byte metadata region; at least %d bytes (%d slots) are needed",
			bSize, n, l.slotLen(), l.BucketsOff, need, MinSlots)
	}
	return nil
}

type slot struct {
	bucket int64 // -1: free
	gen    uint32
	from   uint32 // first block of the bucket the slot holds
	// hdr is closed once the slot header is written (hdrErr its result);
	// nil until the first write into the slot starts writing it.
	hdr    chan struct{}
	hdrErr error
	// rehdr: the header on B names a later from than the slot's (CoverAll)
	rehdr bool
}

// Stats are the mirror's counters.
type Stats struct {
	Failed      [2]bool
	Gen         uint64
	Slots       int64 // B's slots
	SlotsUsed   int64
	Reads       [2]uint64      // pieces of reads each member served
	ReadRetries uint64         // reads that failed on one member and were served by the other
	Repairs     uint64         // copies rewritten from the other member
	Resilver    *ResilverStats // nil when no resilver runs
}

// Mirror is the two-member device. See the package comment.
type Mirror struct {
	dev [2]atomic.Pointer[devRef] // nil: missing
	lay Layout
	log *slog.Logger

	failed  [2]atomic.Bool
	retries atomic.Uint64
	repairs atomic.Uint64
	// turn picks the member of the next read that either may serve
	// (reader); reads counts the reads each member served.
	turn  atomic.Uint32
	reads [2]atomic.Uint64

	// lmu serializes label updates; labelWait is closed when the label
	// of the last member failure is durable (nil when none is pending).
	lmu   sync.Mutex
	label Label
	// counters of the newest label slot written on each member
	counter [2]uint64

	// onFail, if set (OnFail), is called once a member failure is
	// durable in the survivor's label.
	onFail atomic.Pointer[func(Member)]

	// rs is the resilver in progress (resilver.go); copyMu orders it
	// against writes: every write holds the read side from placing its
	// pieces to their completion, a resilver's copy chunk the write side.
	rs     resilverState
	copyMu sync.RWMutex
	// sleepHook, if set, replaces the resilver's pacing sleep (tests).
	sleepHook func(ctx context.Context, d time.Duration) error

	mu        sync.Mutex
	labelWait chan struct{}
	slots     []slot
	slotOf    []int32 // bucket -> slot, -1 when unmapped
	free      []int32
}

var (
	_ device.Device      = (*Mirror)(nil)
	_ device.AsyncReader = (*Mirror)(nil)
)

// Assemble decides, from their labels, which of a and b (either may be
// nil: missing) are current members, and returns a mirror that is not yet
// usable for the bucket region (Init). A missing member, or one that the
// other's newer label marks failed, makes the mirror degraded; a member
// whose label is missing, of another set or of the wrong role is refused.
// allowMissing accepts a missing member whose partner's label says both
// were in sync (the operator says the missing one is gone for good and
// the present one was not run alone since): the present one is then
// labelled sole survivor.
func Assemble(a, b device.Device, allowMissing bool, log *slog.Logger) (*Mirror, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Mirror{log: log}
	m.setDev(A, a)
	m.setDev(B, b)
	var labels [2]Label
	var have [2]bool
	for r, dev := range []device.Device{a, b} {
		if dev == nil {
			continue
		}
		l, ok, err := ReadLabel(dev)
		if err != nil {
			return nil, fmt.Errorf("mirror: member %v: %w", Member(r), err)
		}
		if !ok {
			return nil, fmt.Errorf("mirror: member %v holds no mirror label (not a member of a mirrored cache set)", Member(r))
		}
		if l.Role != Member(r) {
			return nil, fmt.Errorf("mirror: the device given as member %v is member %v of its set (swap --cache and --cache-mirror)", Member(r), l.Role)
		}
		labels[r], have[r] = l, true
		m.counter[r] = l.Counter
	}
	switch {
	case have[A] && have[B]:
		la, lb := labels[A], labels[B]
		if la.Nonce != lb.Nonce {
			return nil, fmt.Errorf("mirror: members A and B belong to different mirrored sets")
		}
		// A member whose own label marks it failed is one a resilver
		// was bringing in when it stopped (resilver.go): never current,
		// whatever its generation; the other's label is.
		selfA, selfB := la.Failed[A], lb.Failed[B]
		var cur Label
		switch {
		case selfA && selfB:
			return nil, fmt.Errorf("mirror: both members are marked failed")
		case selfB || (!selfA && la.Gen >= lb.Gen):
			cur = la
		default:
			cur = lb
		}
		if !selfA && !selfB && la.IDs != lb.IDs {
			return nil, fmt.Errorf("mirror: members A and B belong to different mirrored sets (or one was replaced since: give the current members)")
		}
		m.label = cur
		for r := range 2 {
			if cur.Failed[r] || labels[r].Gen < cur.Gen || labels[r].Failed[r] {
				m.failed[r].Store(true)
				m.label.Failed[r] = true
			}
		}
		if m.failed[A].Load() && m.failed[B].Load() {
			return nil, fmt.Errorf("mirror: both members are marked failed")
		}
	default:
		r := A
		if !have[A] {
			r = B
		}
		if !have[r] {
			return nil, fmt.Errorf("mirror: no member given")
		}
		l := labels[r]
		if l.Failed[r] {
			return nil, fmt.Errorf("mirror: the only member given (%v) is marked failed; the current data is on member %v", r, r.other())
		}
		m.label = l
		m.failed[r.other()].Store(true)
		if !l.Failed[r.other()] {
			if !allowMissing {
				return nil, fmt.Errorf("mirror: member %v is missing and member %v's label says both were in sync: if %v is gone for good and %v has not been used alone since, open it degraded (allow missing member)", r.other(), r, r.other(), r)
			}
			m.label.Failed[r.other()] = true
			m.label.Gen++
			if err := m.writeLabelLocked(r); err != nil {
				return nil, err
			}
			log.Warn("mirrored cache set opened without a member: degraded", "missing", r.other().String(), "survivor", r.String())
		}
	}
	return m, nil
}

// Init sets the layout (from the superblock read through Primary), with
// every slot free: what Format needs, and what Open needs until recovery
// has found the buckets' generations (LoadSlots).
func (m *Mirror) Init(lay Layout) error {
	if lay.Nonce != m.label.Nonce {
		return fmt.Errorf("mirror: the superblock's set (nonce %#x) is not the mirror label's (%#x)", lay.Nonce, m.label.Nonce)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.lay = lay
	var n int64
	if m.d(B) != nil {
		n = Slots(lay, m.d(B).Size())
	}
	m.slots = make([]slot, n)
	m.slotOf = make([]int32, lay.NBuckets)
	for i := range m.slotOf {
		m.slotOf[i] = -1
	}
	m.free = m.free[:0]
	for i := n - 1; i >= 0; i-- {
		m.slots[i].bucket = -1
		if m.live(B) {
			m.free = append(m.free, int32(i))
		}
	}
	return nil
}

// LoadSlots reads B's slot headers: a slot whose header names bucket k at
// generation gens[k] is k's mapping; every other slot is free. A read
// error fails B.
func (m *Mirror) LoadSlots(gens []uint32) error {
	if err := m.Init(m.lay); err != nil || !m.live(B) {
		return err
	}
	buf := make([]byte, blockSize)
	var slots []slot
	var rerr error
	for i := range int32(len(m.slots)) {
		sl := slot{bucket: -1}
		if _, err := m.d(B).ReadAt(buf, m.slotOff(i)); err != nil {
			rerr = fmt.Errorf("reading slot header %d: %w", i, err)
			break
		}
		h, ok := decodeSlot(buf)
		if ok && h.nonce == m.lay.Nonce && h.bucket < uint64(len(gens)) && h.gen == gens[h.bucket] && int64(h.from) < m.lay.BucketSize/blockSize {
			sl = slot{bucket: int64(h.bucket), gen: h.gen, from: h.from, hdr: closedChan}
		}
		slots = append(slots, sl)
	}
	if rerr != nil {
		return m.fail(B, rerr)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.free = m.free[:0]
	for i := int32(len(slots)) - 1; i >= 0; i-- {
		sl := slots[i]
		if sl.bucket >= 0 {
			j := m.slotOf[sl.bucket]
			if j < 0 || m.slots[j].from > sl.from {
				if j >= 0 {
					m.slots[j] = slot{bucket: -1}
					m.free = append(m.free, j)
				}
				m.slots[i] = sl
				m.slotOf[sl.bucket] = i
				continue
			}
		}
		m.slots[i] = slot{bucket: -1}
		m.free = append(m.free, i)
	}
	return nil
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

type slotHdr struct {
	nonce, bucket uint64
	gen, from     uint32
}

const slotMagic = "TCMIRSLT"

func (h slotHdr) encode() []byte {
	b := make([]byte, blockSize)
	copy(b, slotMagic)
	binary.LittleEndian.PutUint64(b[16:], h.nonce)
	binary.LittleEndian.PutUint64(b[24:], h.bucket)
	binary.LittleEndian.PutUint32(b[32:], h.gen)
	binary.LittleEndian.PutUint32(b[36:], h.from)
	binary.LittleEndian.PutUint32(b[8:], ondisk.CRC32C(b[16:40]))
	return b
}

func decodeSlot(b []byte) (h slotHdr, ok bool) {
	if string(b[:8]) != slotMagic || ondisk.CRC32C(b[16:40]) != binary.LittleEndian.Uint32(b[8:]) {
		return h, false
	}
	return slotHdr{binary.LittleEndian.Uint64(b[16:]), binary.LittleEndian.Uint64(b[24:]),
		binary.LittleEndian.Uint32(b[32:]), binary.LittleEndian.Uint32(b[36:])}, true
}

func (m *Mirror) slotOff(i int32) int64 { return m.lay.BucketsOff + int64(i)*m.lay.slotLen() }

func (m *Mirror) live(r Member) bool { return m.d(r) != nil && !m.failed[r].Load() }

// Redundant reports whether both members are live.
func (m *Mirror) Redundant() bool { return m.live(A) && m.live(B) }

// devRef holds a member's device (a resilver puts a new one in place).
type devRef struct{ device.Device }

// d returns member r's device, nil when missing.
func (m *Mirror) d(r Member) device.Device {
	if p := m.dev[r].Load(); p != nil {
		return p.Device
	}
	return nil
}

func (m *Mirror) setDev(r Member, dev device.Device) {
	if dev == nil {
		m.dev[r].Store(nil)
		return
	}
	m.dev[r].Store(&devRef{dev})
}

// Primary returns the member that reads of what only one member holds,
// and of the metadata region, go to: A unless A failed.
func (m *Mirror) Primary() Member {
	if m.live(A) {
		return A
	}
	return B
}

// Device returns member r's device (nil when missing).
func (m *Mirror) Device(r Member) device.Device { return m.d(r) }

// Failed reports whether member r failed (or is missing or stale).
func (m *Mirror) Failed(r Member) bool { return !m.live(r) }

// Map gives bucket (at generation gen) a slot on B, mirroring its blocks
// from block `from` on. It reports false when B has no free slot (or is
// not live). Mapping a mapped bucket is a no-op that reports true.
func (m *Mirror) Map(bucket int64, gen uint32, from uint32) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.live(B) && !m.rs.syncing[B].Load() {
		return false
	}
	if j := m.slotOf[bucket]; j >= 0 {
		if m.slots[j].gen == gen {
			return true
		}
		m.releaseLocked(bucket)
	}
	if len(m.free) == 0 {
		return false
	}
	i := m.free[len(m.free)-1]
	m.free = m.free[:len(m.free)-1]
	m.slots[i] = slot{bucket: bucket, gen: gen, from: from}
	m.slotOf[bucket] = i
	return true
}

// CoverAll makes the slot of bucket (mapped at generation gen) cover the
// whole bucket, from its first block (its header is written again by the
// resilver's copy of the bucket, CopyBuckets). It reports whether the slot covered less before.
// For a resilver, which copies the whole bucket after.
func (m *Mirror) CoverAll(bucket int64, gen uint32) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	j := m.slotOf[bucket]
	if j < 0 || m.slots[j].gen != gen || m.slots[j].from == 0 {
		return false
	}
	// A header written (or being written) says the old from: the copy
	// writes it again, with no write in flight (rewriteHeader).
	m.slots[j].from, m.slots[j].rehdr = 0, m.slots[j].hdr != nil
	return true
}

// Mapped reports whether bucket has a slot on B.
func (m *Mirror) Mapped(bucket int64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.slotOf[bucket] >= 0
}

// Covers reports whether B holds a copy of the block at off (in the
// bucket region: its bucket is mapped, from the slot's first block on).
func (m *Mirror) Covers(off int64) bool {
	if off < m.lay.BucketsOff || m.lay.BucketSize == 0 {
		return true // the metadata region is on both
	}
	rel := off - m.lay.BucketsOff
	bucket, in := rel/m.lay.BucketSize, rel%m.lay.BucketSize
	if bucket >= m.lay.NBuckets {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	j := m.slotOf[bucket]
	return j >= 0 && in >= int64(m.slots[j].from)*blockSize
}

// MappedBuckets calls f for each mapped bucket (under the mirror's lock:
// f must not call the mirror).
func (m *Mirror) MappedBuckets(f func(bucket int64)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, sl := range m.slots {
		if sl.bucket >= 0 {
			f(sl.bucket)
		}
	}
}

// Release frees bucket's slot. The caller guarantees that B's copy of it
// is no longer needed (nothing dirty in it, durably) and that no write
// into the bucket is in flight.
func (m *Mirror) Release(bucket int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.releaseLocked(bucket)
}

func (m *Mirror) releaseLocked(bucket int64) {
	j := m.slotOf[bucket]
	if j < 0 {
		return
	}
	m.slotOf[bucket] = -1
	m.slots[j] = slot{bucket: -1}
	m.free = append(m.free, j)
}

// Stats returns the mirror's counters.
func (m *Mirror) Stats() Stats {
	m.mu.Lock()
	st := Stats{Slots: int64(len(m.slots))}
	for _, sl := range m.slots {
		if sl.bucket >= 0 && m.live(B) {
			st.SlotsUsed++
		}
	}
	m.mu.Unlock()
	m.lmu.Lock()
	st.Gen = m.label.Gen
	m.lmu.Unlock()
	st.Failed = [2]bool{!m.live(A), !m.live(B)}
	st.ReadRetries, st.Repairs = m.retries.Load(), m.repairs.Load()
	st.Reads = [2]uint64{m.reads[A].Load(), m.reads[B].Load()}
	st.Resilver = m.resilverStats()
	return st
}

// fail marks member r failed: a new label saying so is written and synced
// on the survivor before fail returns. It returns an error when no member
// is left (the survivor failed too, or failing the label write).
func (m *Mirror) fail(r Member, cause error) error {
	m.lmu.Lock()
	defer m.lmu.Unlock()
	if m.failed[r].Load() {
		return m.survivorErr(r)
	}
	o := r.other()
	if !m.live(o) {
		return fmt.Errorf("%w: %v: %v", ErrBothFailed, r, cause)
	}
	wait := make(chan struct{})
	m.mu.Lock()
	m.failed[r].Store(true)
	m.labelWait = wait
	m.mu.Unlock()
	m.log.Error("MIRROR MEMBER FAILED: the cache set runs degraded on the survivor", "failed", r.String(), "survivor", o.String(), "cause", cause)
	m.label.Failed[r] = true
	m.label.Gen++
	err := m.writeLabelLocked(o)
	if err != nil {
		m.failed[o].Store(true)
	}
	m.mu.Lock()
	m.labelWait = nil
	m.mu.Unlock()
	close(wait)
	if err != nil {
		return fmt.Errorf("%w: %v failed (%v), then writing the label to %v: %v", ErrBothFailed, r, cause, o, err)
	}
	if r == B {
		m.mu.Lock()
		m.free = nil // no slot is handed out on a failed B
		m.mu.Unlock()
	}
	if f := m.onFail.Load(); f != nil {
		(*f)(r)
	}
	return nil
}

// OnFail sets f to be called after a member failure is durable in the
// survivor's label (under the mirror's label lock: f must not call the
// mirror, nor wait for anything that does).
func (m *Mirror) OnFail(f func(failed Member)) { m.onFail.Store(&f) }

// survivorErr is nil while the other member of r is live.
func (m *Mirror) survivorErr(r Member) error {
	if m.live(r.other()) {
		return nil
	}
	return ErrBothFailed
}

// writeLabelLocked writes m.label to member r. REQUIRES: lmu (or no
// concurrency: Assemble).
func (m *Mirror) writeLabelLocked(r Member) error {
	if err := writeLabel(m.d(r), m.label, r, m.counter[r]); err != nil {
		return fmt.Errorf("mirror: writing the label of member %v: %w", r, err)
	}
	m.counter[r]++
	return nil
}

// extent is the part of a request that lies in one place on each member.
type extent struct {
	off  int64 // on A (the mirror's address space)
	p    []byte
	bOff int64 // on B; -1 when B holds no copy
	sl   int32 // slot, -1 for the metadata region
}

// split cuts [off, off+len(p)) at bucket boundaries, places each piece
// on B and appends the pieces to out (a caller's array, so that a request
// in one or two pieces allocates nothing).
func (m *Mirror) split(out []extent, p []byte, off int64) []extent {
	if off+int64(len(p)) <= m.lay.BucketsOff || m.lay.BucketSize == 0 {
		return append(out, extent{off: off, p: p, bOff: off, sl: -1})
	}
	if off < m.lay.BucketsOff {
		k := m.lay.BucketsOff - off
		out = append(out, extent{off: off, p: p[:k], bOff: off, sl: -1})
		p, off = p[k:], m.lay.BucketsOff
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for len(p) > 0 {
		rel := off - m.lay.BucketsOff
		bucket := rel / m.lay.BucketSize
		in := rel % m.lay.BucketSize
		k := min(int64(len(p)), m.lay.BucketSize-in)
		e := extent{off: off, p: p[:k], bOff: -1, sl: -1}
		if bucket < m.lay.NBuckets {
			if j := m.slotOf[bucket]; j >= 0 {
				from := int64(m.slots[j].from) * blockSize
				switch {
				case in >= from:
					e.bOff, e.sl = m.slotOff(j)+blockSize+in, j
				case in+k > from:
					// A request straddling the slot's first block:
					// the part before it has no copy on B.
					e.p = p[:from-in]
					k = from - in
				}
			}
		}
		out = append(out, e)
		p, off = p[k:], off+k
	}
	return out
}

// slotHeader makes sure slot j's header is written (by this call or one
// before it) before data written into the slot can be made durable.
func (m *Mirror) slotHeader(j int32) error { return m.writeSlotHeader(j, false) }

// rewriteHeader writes slot j's header again if CoverAll changed it, else
// is slotHeader. REQUIRES: copyMu's write side (no write in flight, none
// writing the old header).
func (m *Mirror) rewriteHeader(j int32) error { return m.writeSlotHeader(j, true) }

// writeSlotHeader writes slot j's header, or waits for the write of it
// that started first and returns that write's result; again (rewriteHeader)
// drops a header written before CoverAll changed the slot.
func (m *Mirror) writeSlotHeader(j int32, again bool) error {
	m.mu.Lock()
	sl := &m.slots[j]
	if again && sl.rehdr {
		sl.rehdr, sl.hdr = false, nil
	}
	if ch := sl.hdr; ch != nil {
		m.mu.Unlock()
		<-ch
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.slots[j].hdrErr
	}
	ch := make(chan struct{})
	sl.hdr = ch
	h := slotHdr{nonce: m.lay.Nonce, bucket: uint64(sl.bucket), gen: sl.gen, from: sl.from}
	m.mu.Unlock()
	_, err := m.d(B).WriteAt(h.encode(), m.slotOff(j))
	m.mu.Lock()
	m.slots[j].hdrErr = err
	m.mu.Unlock()
	close(ch)
	return err
}

// ReadAt reads each piece from the member reader picks; an error there is
// served from the other member's copy (and that copy written over the
// failed one).
func (m *Mirror) ReadAt(p []byte, off int64) (int, error) {
	if err := device.CheckRange(off, int64(len(p)), m.Size()); err != nil {
		return 0, device.RangeError("read", off, int64(len(p)), m.Size())
	}
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if err := m.readExtent(e); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// ReadFrom is ReadAt with every piece read from member r first (ErrNoCopy
// when r holds none of a piece).
func (m *Mirror) ReadFrom(r Member, p []byte, off int64) (int, error) {
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if err := m.readExtentFrom(e, r); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// reader returns the member to read e from: in the bucket region, where
// both members are live and B holds a copy, each in turn; else the
// primary.
func (m *Mirror) reader(e extent) Member {
	if e.sl >= 0 && m.Redundant() {
		return Member(m.turn.Add(1) & 1)
	}
	return m.Primary()
}

func (m *Mirror) readExtent(e extent) error { return m.readExtentFrom(e, m.reader(e)) }

// readExtentFrom reads e from member r, and on an error there from the
// other member, rewriting r's copy with it (or failing r).
func (m *Mirror) readExtentFrom(e extent, r Member) error {
	if r == B && e.bOff < 0 {
		return ErrNoCopy
	}
	m.reads[r].Add(1)
	_, err := m.d(r).ReadAt(e.p, m.memberOff(r, e))
	if err == nil {
		return nil
	}
	o := r.other()
	if !m.live(o) {
		return err
	}
	if o == B && e.bOff < 0 {
		// No copy to serve it from or to repair A with: A is failed, as
		// for a write error, and the caller reads the (clean) block
		// elsewhere.
		if ferr := m.fail(r, err); ferr != nil {
			return ferr
		}
		return ErrNoCopy
	}
	if _, oerr := m.d(o).ReadAt(e.p, m.memberOff(o, e)); oerr != nil {
		return err
	}
	m.retries.Add(1)
	m.log.Warn("mirror: read failed on one member, served by the other", "failed_on", r.String(), "offset", e.off, "len", len(e.p), "err", err)
	if _, werr := m.d(r).WriteAt(e.p, m.memberOff(r, e)); werr != nil {
		if ferr := m.fail(r, werr); ferr != nil {
			return ferr
		}
		return nil
	}
	m.repairs.Add(1)
	return nil
}

// ReadsAsync reports whether A's device starts reads asynchronously
// (StartReadAt can start any).
func (m *Mirror) ReadsAsync() bool {
	_, ok := m.d(A).(device.AsyncReader)
	return ok
}

// StartReadAt is device.AsyncReader's: a read in one piece is started on
// the device of the member reader picks, when that device reads
// asynchronously (A at the mirror's offsets, B at its slot's), else on
// A's. An error there is handled as ReadAt handles one on that member
// (read again, then served from the other member, the copy repaired or
// the member failed), on a goroutine of its own. It returns false, having done nothing, when A is not live
// or no member can start the read.
func (m *Mirror) StartReadAt(p []byte, off int64, done func(n int, err error, later func(func()))) bool {
	if !m.live(A) || device.CheckRange(off, int64(len(p)), m.Size()) != nil {
		return false
	}
	r, at := A, off
	var one [2]extent
	if m.Redundant() {
		if es := m.split(one[:0], p, off); len(es) == 1 && m.reader(es[0]) == B {
			if _, ok := m.d(B).(device.AsyncReader); ok {
				r, at = B, es[0].bOff
			}
		}
	}
	ar, ok := m.d(r).(device.AsyncReader)
	if !ok {
		return false
	}
	m.reads[r].Add(1)
	started := ar.StartReadAt(p, at, func(n int, err error, later func(func())) {
		if err == nil {
			done(n, nil, later)
			return
		}
		go func() {
			n, err := m.ReadFrom(r, p, off)
			device.WithLater(func(later func(func())) { done(n, err, later) })
		}()
	})
	if !started {
		m.reads[r].Add(^uint64(0))
	}
	return started
}

func (m *Mirror) memberOff(r Member, e extent) int64 {
	if r == A {
		return e.off
	}
	return e.bOff
}

// RepairFrom is for a read of [off, off+len(p)) whose data failed the
// caller's check: the read may have come from either member (reader), so
// it reads each member's copy, and when good accepts one it reports true
// with p holding it, having written it over the other copy if good refused
// that one (CheckCopies). It reports false, p undefined, when no copy
// passes or the mirror is not redundant.
func (m *Mirror) RepairFrom(p []byte, off int64, good func([]byte) bool) bool {
	ok, _ := m.CheckCopies(p, off, good)
	return ok
}

// CheckCopies reads both members' copies of [off, off+len(p)); when good
// accepts one, p holds it (ok) and the other copy, if good refuses it, is
// rewritten with it (rewrote) and counted. Both are false when the mirror
// is not redundant. A copy that cannot be read is left to the next read
// (ReadAt serves and repairs it); a member whose rewrite fails is failed.
func (m *Mirror) CheckCopies(p []byte, off int64, good func([]byte) bool) (ok, rewrote bool) {
	if !m.Redundant() {
		return false, false
	}
	bufs := [2][]byte{p, make([]byte, len(p))}
	var read, pass [2]bool
	for r := range bufs {
		read[r] = m.ReadMember(Member(r), bufs[r], off) == nil
		pass[r] = read[r] && good(bufs[r])
	}
	from := A
	switch {
	case pass[A]:
	case pass[B]:
		from = B
		copy(p, bufs[B])
	default:
		return false, false
	}
	to := from.other()
	if !read[to] || pass[to] {
		return true, false
	}
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if _, err := m.d(to).WriteAt(e.p, m.memberOff(to, e)); err != nil {
			_ = m.fail(to, err)
			return true, false // p is good; the member is failed now
		}
	}
	m.repairs.Add(1)
	m.log.Warn("mirror: copy that failed its check repaired from the other member", "repaired", to.String(), "offset", off, "len", len(p))
	return true, true
}

// ReadMember reads [off, off+len(p)) of member r's copy; ErrNoCopy when r
// holds none of it.
func (m *Mirror) ReadMember(r Member, p []byte, off int64) error {
	if !m.live(r) {
		return ErrNoCopy
	}
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if r == B && e.bOff < 0 {
			return ErrNoCopy
		}
		if _, err := m.d(r).ReadAt(e.p, m.memberOff(r, e)); err != nil {
			return err
		}
	}
	return nil
}

// WriteMember writes p over member r's copy at off (a repair: the caller
// syncs).
func (m *Mirror) WriteMember(r Member, p []byte, off int64) error {
	if !m.live(r) {
		return ErrNoCopy
	}
	m.copyMu.RLock()
	defer m.copyMu.RUnlock()
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if r == B && e.bOff < 0 {
			return ErrNoCopy
		}
		if r == B && e.sl >= 0 {
			if err := m.slotHeader(e.sl); err != nil {
				if ferr := m.fail(B, err); ferr != nil {
					return ferr
				}
				return err
			}
		}
		if _, err := m.d(r).WriteAt(e.p, m.memberOff(r, e)); err != nil {
			if ferr := m.fail(r, err); ferr != nil {
				return ferr
			}
			return err
		}
	}
	m.repairs.Add(1)
	return nil
}

// WriteAt writes to both members (B only where it holds a copy) and
// returns when both completed. An error on one member fails it and the
// write succeeds on the other.
func (m *Mirror) WriteAt(p []byte, off int64) (int, error) {
	if err := device.CheckRange(off, int64(len(p)), m.Size()); err != nil {
		return 0, device.RangeError("write", off, int64(len(p)), m.Size())
	}
	m.copyMu.RLock()
	defer m.copyMu.RUnlock()
	for _, e := range m.split(make([]extent, 0, 2), p, off) {
		if err := m.writeExtent(e); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

func (m *Mirror) writeExtent(e extent) error {
	toA, toB := m.live(A), m.live(B) && e.bOff >= 0
	if !toA && !toB {
		if m.live(B) {
			return ErrNoCopy
		}
		return ErrBothFailed
	}
	// A member being resilvered takes every write too (its errors end
	// the resilver, not the write).
	rsA, rsB := m.rs.syncing[A].Load(), m.rs.syncing[B].Load() && e.bOff >= 0
	var errA, errB error
	switch doA, doB := toA || rsA, toB || rsB; {
	case doA && doB:
		errA, errB = m.writeBoth(e)
	case doA:
		_, errA = m.d(A).WriteAt(e.p, e.off)
	default:
		errB = m.writeB(e)
	}
	errA, errB = m.rsSettle(rsA, errA, rsB, errB)
	return m.settle(toA, errA, toB, errB)
}

// writeBoth writes e to A and B at the same time (B's on a goroutine of
// its own) and returns when both completed.
func (m *Mirror) writeBoth(e extent) (errA, errB error) {
	done := make(chan error, 1)
	go func() { done <- m.writeB(e) }()
	_, errA = m.d(A).WriteAt(e.p, e.off)
	return errA, <-done
}

// writeB writes e to B, its slot's header first if not yet written.
func (m *Mirror) writeB(e extent) error {
	if e.sl >= 0 {
		if err := m.slotHeader(e.sl); err != nil {
			return err
		}
	}
	_, err := m.d(B).WriteAt(e.p, e.bOff)
	return err
}

// settle fails the members whose part of an operation failed and returns
// the operation's error: nil when a member that took part succeeded (the
// failed one is failed, the survivor's label says so), the error when
// none did. A member whose error left the other without the data (a write
// to a bucket B has no slot for) is failed too when the other is live,
// and the error returned.
func (m *Mirror) settle(didA bool, errA error, didB bool, errB error) error {
	okA, okB := didA && errA == nil, didB && errB == nil
	if !okA && !okB {
		if didA && !didB && m.live(B) {
			if err := m.fail(A, errA); err != nil {
				return err
			}
		}
		if didA {
			return errA
		}
		return errB
	}
	if didA && errA != nil {
		if err := m.fail(A, errA); err != nil {
			return err
		}
	}
	if didB && errB != nil {
		if err := m.fail(B, errB); err != nil {
			return err
		}
	}
	return nil
}

// Sync syncs both members. It returns once every write completed before
// it is durable on every live member and any member failure it or an
// earlier call saw is durable in the survivor's label.
func (m *Mirror) Sync() error {
	doA, doB := m.live(A), m.live(B)
	rsA, rsB := m.rs.syncing[A].Load(), m.rs.syncing[B].Load()
	var errB error
	var wg sync.WaitGroup
	if doB || rsB {
		wg.Add(1)
		go func() { defer wg.Done(); errB = m.d(B).Sync() }()
	}
	var errA error
	if doA || rsA {
		errA = m.d(A).Sync()
	}
	wg.Wait()
	errA, errB = m.rsSettle(rsA, errA, rsB, errB)
	if !doA && !doB {
		return ErrBothFailed
	}
	if err := m.settle(doA, errA, doB, errB); err != nil {
		return err
	}
	m.mu.Lock()
	wait := m.labelWait
	m.mu.Unlock()
	if wait != nil {
		<-wait
	}
	if !m.live(A) && !m.live(B) {
		return ErrBothFailed
	}
	return nil
}

// Size is A's size: the mirror presents A's address space. With A
// missing it is B's size until Init and the end of the set's layout after.
func (m *Mirror) Size() int64 {
	if m.d(A) != nil {
		return m.d(A).Size()
	}
	if m.lay.BucketSize == 0 {
		return m.d(B).Size()
	}
	return m.lay.BucketsOff + m.lay.NBuckets*m.lay.BucketSize
}

// Close closes nothing: the members belong to the caller.
func (m *Mirror) Close() error { return nil }
