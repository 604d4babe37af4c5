package mirror

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// A resilver brings a new device in as the failed member of a degraded
// mirror while it serves. The label protocol makes a crash at any point
// open on the survivor and never trust the new member before it is
// complete:
//
//  1. the new device is labelled generation g+1, the failed member's
//     identity replaced by a new one, marking itself failed (a member
//     whose own label marks it failed is never current: Assemble);
//  2. the survivor is labelled the same (so the old failed member, if
//     it comes back, belongs to another membership and is refused);
//  3. the new member takes every write from here on (syncing), the
//     metadata region and the buckets are copied under copyMu, chunk by
//     chunk, and the new member is synced;
//  4. the survivor is labelled g+2 with both members in sync, then the
//     new member: a crash between the two leaves the new member one
//     generation behind, stale.
//
// The cache set decides which buckets to copy (Resilver's caller maps on
// B the buckets that need a copy there) and drops, before FinishResilver
// makes a new A serve reads, the clean entries of buckets A's copy of
// which only the dead A held.

// ErrRefused wraps the reasons BeginResilver refuses a device or a set.
var ErrRefused = errors.New("resilver refused")

// resilverState is the resilver in progress (zero: none).
type resilverState struct {
	// syncing[r]: member r is being brought in: it takes every write and
	// sync and serves no read (it stays failed until FinishResilver).
	syncing [2]atomic.Bool
	active  atomic.Bool
	member  atomic.Int32
	err     atomic.Pointer[error] // the first error on the new member
	done    atomic.Int64          // bytes copied
	total   atomic.Int64          // bytes to copy
	started atomic.Int64          // unix nanoseconds
	// rate limits the copy to this many bytes a second (0: as fast as
	// the members go); it may change while the copy runs.
	rate atomic.Int64
}

// ResilverStats is the progress of a resilver (Stats; nil when none runs).
type ResilverStats struct {
	Member      Member
	Done, Total int64 // bytes copied, to copy
	Started     time.Time
	Rate        int64 // the copy's limit in bytes a second (0: none)
}

func (m *Mirror) resilverStats() *ResilverStats {
	if !m.rs.active.Load() {
		return nil
	}
	return &ResilverStats{Member: Member(m.rs.member.Load()), Done: m.rs.done.Load(), Total: m.rs.total.Load(),
		Started: time.Unix(0, m.rs.started.Load()), Rate: m.rs.rate.Load()}
}

// SetResilverRate limits the copies of the resilver running, or of the
// next one, to bytesPerSec (0: no limit). Writes are never limited: the
// limit leaves the members' bandwidth to the set's own I/O.
func (m *Mirror) SetResilverRate(bytesPerSec int64) { m.rs.rate.Store(max(bytesPerSec, 0)) }

// paceStep is the longest a paced copy sleeps before it looks at the
// limit again (a limit raised or lifted takes effect within it).
const paceStep = 100 * time.Millisecond

// pace waits after a chunk of n bytes whose copy took took, until the
// chunk took n/rate in all. REQUIRES: not copyMu (writes go on meanwhile).
func (m *Mirror) pace(ctx context.Context, n int64, took time.Duration) error {
	waited := took
	for {
		rate := m.rs.rate.Load()
		if rate <= 0 {
			return nil
		}
		need := time.Duration(float64(n) / float64(rate) * float64(time.Second))
		if waited >= need {
			return nil
		}
		step := min(need-waited, paceStep)
		if err := m.sleep(ctx, step); err != nil {
			return err
		}
		waited += step
	}
}

// sleep waits d or until ctx is done (a test replaces it: sleepHook).
func (m *Mirror) sleep(ctx context.Context, d time.Duration) error {
	if h := m.sleepHook; h != nil {
		return h(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// rsSettle ends the resilver on an error of the member being brought in
// and returns the errors with that member's cleared: the write or sync it
// took part in succeeds or fails on the live members alone.
func (m *Mirror) rsSettle(rsA bool, errA error, rsB bool, errB error) (error, error) {
	if rsA && errA != nil {
		m.rsFail(A, errA)
		errA = nil
	}
	if rsB && errB != nil {
		m.rsFail(B, errB)
		errB = nil
	}
	return errA, errB
}

func (m *Mirror) rsFail(r Member, err error) {
	err = fmt.Errorf("mirror: resilver of member %v: the new device failed: %w", r, err)
	if m.rs.err.CompareAndSwap(nil, &err) {
		m.log.Error("mirror: resilver failed: the set stays degraded", "member", r.String(), "err", err)
	}
	m.rs.syncing[r].Store(false)
}

func (m *Mirror) rsErr() error {
	if p := m.rs.err.Load(); p != nil {
		return *p
	}
	return nil
}

// metaCheckLen is how much of a device's start BeginResilver reads for
// signs of other data: the superblock copies (with the mirror labels).
const metaCheckLen = 2 * ondisk.SBCopySize

// BeginResilver checks dev as the replacement of the failed member and
// starts bringing it in (steps 1 to 3 of the protocol above, up to the
// copy): from its return on, dev takes every write. It refuses a mirror
// that is not degraded, a device too small for the member's role, the
// survivor itself and, unless force, a device carrying another set's
// label or any data in its first 128 KiB. A former member of this set is
// accepted. It returns the member being replaced.
func (m *Mirror) BeginResilver(dev device.Device, force bool) (Member, error) {
	m.lmu.Lock()
	defer m.lmu.Unlock()
	if !m.rs.active.CompareAndSwap(false, true) {
		return 0, fmt.Errorf("%w: a resilver of member %v is already running (see status)", ErrRefused, Member(m.rs.member.Load()))
	}
	r, err := m.beginLocked(dev, force)
	if err != nil {
		m.rs.active.Store(false)
		return 0, err
	}
	return r, nil
}

func (m *Mirror) beginLocked(dev device.Device, force bool) (Member, error) {
	var r Member
	switch {
	case m.live(A) && m.live(B):
		return 0, fmt.Errorf("%w: the mirror is not degraded: both members are in sync (replace a member only after it failed: status shows the mirror DEGRADED)", ErrRefused)
	case m.live(A):
		r = B
	case m.live(B):
		r = A
	default:
		return 0, fmt.Errorf("%w: both members failed: the set failed over; there is no survivor to copy from", ErrRefused)
	}
	o := r.other()
	if dev == m.d(o) {
		return 0, fmt.Errorf("%w: the device given is the survivor, member %v, itself: give the new device that replaces failed member %v", ErrRefused, o, r)
	}
	if err := m.checkNewSize(r, dev.Size()); err != nil {
		return 0, err
	}
	old, labelled, err := ReadLabel(dev)
	if err != nil {
		return 0, fmt.Errorf("mirror: reading the new device: %w", err)
	}
	switch {
	case labelled && old.Nonce == m.label.Nonce && old.IDs[o] == m.label.IDs[o] && old.Role == o && !old.Failed[o]:
		return 0, fmt.Errorf("%w: the device given carries the label of the survivor, member %v, of this set (a copy of it?): give the new device that replaces failed member %v", ErrRefused, o, r)
	case labelled && old.Nonce == m.label.Nonce:
		// A former member of this set (the failed one back, or an
		// earlier replacement): its content is stale and overwritten.
	default:
		if err := checkUnused(dev, old, labelled, m.label.Nonce, force); err != nil {
			return 0, err
		}
	}

	// Steps 1 and 2: the new member, then the survivor, labelled g+1
	// with the new member marked failed and a new identity for it.
	l := m.label
	l.Gen++
	l.Failed[r] = true
	if _, err := rand.Read(l.IDs[r][:]); err != nil {
		return 0, err
	}
	if err := writeLabel(dev, l, r, old.Counter); err != nil {
		return 0, fmt.Errorf("mirror: labelling the new member %v: %w", r, err)
	}
	if err := writeLabel(m.d(o), l, o, m.counter[o]); err != nil {
		ferr := m.failSurvivorLocked(o, err)
		return 0, ferr
	}
	m.counter[o]++
	m.counter[r] = old.Counter + 1
	m.label = l

	// Step 3 begins: the new device takes every write from here on. No
	// write is in flight while it is put in place (copyMu), so none
	// placed its pieces on the old device's slots.
	m.copyMu.Lock()
	m.setDev(r, dev)
	m.rs.err.Store(nil)
	m.rs.done.Store(0)
	m.rs.total.Store(0)
	m.rs.member.Store(int32(r))
	m.rs.started.Store(time.Now().UnixNano())
	if r == B {
		m.mu.Lock()
		n := Slots(m.lay, dev.Size())
		m.slots = make([]slot, n)
		for i := range m.slotOf {
			m.slotOf[i] = -1
		}
		m.free = m.free[:0]
		for i := n - 1; i >= 0; i-- {
			m.slots[i].bucket = -1
			m.free = append(m.free, int32(i))
		}
		m.mu.Unlock()
	}
	m.rs.syncing[r].Store(true)
	m.copyMu.Unlock()
	m.log.Warn("mirror: resilver started", "member", r.String(), "gen", l.Gen)
	return r, nil
}

// checkUnused refuses, unless force, a device that carries another set's
// mirror label (old, when labelled) or, unlabelled, any data in its first
// 128 KiB. A label of the set with the given nonce is accepted: a former
// member, stale.
func checkUnused(dev device.Device, old Label, labelled bool, nonce uint64, force bool) error {
	switch {
	case force || labelled && old.Nonce == nonce:
		return nil
	case labelled:
		return fmt.Errorf("%w: the device given is member %v of another mirrored cache set (its mirror label names set nonce %#x, this set is %#x): if that set is gone for good, force to overwrite it", ErrRefused, old.Role, old.Nonce, nonce)
	}
	buf := make([]byte, min(metaCheckLen, dev.Size()))
	if _, err := dev.ReadAt(buf, 0); err != nil {
		return fmt.Errorf("mirror: reading the new device: %w", err)
	}
	if i := bytes.IndexFunc(buf, func(c rune) bool { return c != 0 }); i >= 0 {
		what := "data"
		if string(buf[:len(ondisk.SBMagic)]) == ondisk.SBMagic {
			what = "a tiercache superblock (another cache set's device)"
		}
		return fmt.Errorf("%w: the device given holds %s in its first %d KiB (byte %d is not zero): a cache set's member must be a device nothing else uses; if its content is not needed, force to overwrite it (or zero its start)", ErrRefused, what, metaCheckLen>>10, i)
	}
	return nil
}

// CheckAttach checks dev as the mirror (member B) about to be attached to
// the set of layout lay on its one cache device a: what BeginResilver
// would refuse, checked before a is labelled (AttachLabel).
func CheckAttach(a, dev device.Device, lay Layout, force bool) error {
	if dev == a {
		return fmt.Errorf("%w: the device given is the set's cache device itself: give a second device for the mirror", ErrRefused)
	}
	if err := CheckSize(lay, dev.Size()); err != nil {
		return fmt.Errorf("%w: %v", ErrRefused, err)
	}
	old, labelled, err := ReadLabel(dev)
	if err != nil {
		return fmt.Errorf("mirror: reading the new device: %w", err)
	}
	return checkUnused(dev, old, labelled, lay.Nonce, force)
}

// AttachLabel makes a, the one cache device of the set with the given
// nonce, member A of a new mirror whose member B is failed (not in sync
// yet): Assemble(a, nil) then opens the degraded mirror a resilver of B
// completes. The set's superblock must not say FeatureMirror before this
// label is durable; a label on a device whose superblock does not say it
// is a leftover of an attach that stopped, and means nothing.
func AttachLabel(a device.Device, nonce uint64) error {
	l, err := NewLabel(nonce)
	if err != nil {
		return err
	}
	l.Failed[B] = true
	old, _, err := ReadLabel(a)
	if err != nil {
		return err
	}
	if err := writeLabel(a, l, A, old.Counter); err != nil {
		return fmt.Errorf("mirror: writing the label of member A: %w", err)
	}
	return nil
}

// failSurvivorLocked: writing the survivor's label failed: the survivor
// is failed, and with it the set (the new member holds nothing yet).
func (m *Mirror) failSurvivorLocked(o Member, err error) error {
	m.failed[o].Store(true)
	return fmt.Errorf("%w: writing the label of the survivor %v: %v", ErrBothFailed, o, err)
}

// checkNewSize refuses a device too small to be member r.
func (m *Mirror) checkNewSize(r Member, size int64) error {
	if r == B {
		if err := CheckSize(m.lay, size); err != nil {
			return fmt.Errorf("%w: %v", ErrRefused, err)
		}
		return nil
	}
	need := m.lay.BucketsOff + m.lay.NBuckets*m.lay.BucketSize
	if size < need {
		return fmt.Errorf("%w: the device given has %d bytes; member A holds the whole set's layout: at least %d bytes (%d buckets of %d bytes after the %d-byte metadata region)",
			ErrRefused, size, need, m.lay.NBuckets, m.lay.BucketSize, m.lay.BucketsOff)
	}
	return nil
}

// AddResilverTotal adds n bytes to the resilver's total (its progress).
func (m *Mirror) AddResilverTotal(n int64) { m.rs.total.Add(n) }

// copyChunk is the most a resilver copies under copyMu at once.
const copyChunk = 256 << 10

// CopyMeta copies the metadata region (superblocks, journal, checkpoints;
// not the mirror labels) from the survivor to the member being brought
// in, chunk by chunk, each chunk read and written with no write in
// flight. progress, if set, is called after each chunk.
func (m *Mirror) CopyMeta(ctx context.Context, progress func()) error {
	r := Member(m.rs.member.Load())
	o := r.other()
	buf := make([]byte, copyChunk)
	for off := int64(0); off < m.lay.BucketsOff; {
		if err := m.copyStop(ctx); err != nil {
			return err
		}
		n := min(int64(len(buf)), m.lay.BucketsOff-off)
		for i := range 2 {
			// A chunk ends before a label block, which it skips.
			if lo := LabelOff(i); off <= lo && lo < off+n {
				n = lo - off
				if n == 0 {
					off += blockSize
					m.rs.done.Add(blockSize)
					continue
				}
			}
		}
		if n == 0 {
			continue
		}
		p := buf[:n]
		t0 := time.Now()
		m.copyMu.Lock()
		_, err := m.d(o).ReadAt(p, off)
		if err == nil {
			if _, werr := m.d(r).WriteAt(p, off); werr != nil {
				m.rsFail(r, werr)
			}
		}
		m.copyMu.Unlock()
		if err != nil {
			return m.readFailed(o, err)
		}
		off += n
		m.rs.done.Add(n)
		if progress != nil {
			progress()
		}
		if err := m.pace(ctx, n, time.Since(t0)); err != nil {
			return err
		}
	}
	return m.copyStop(ctx)
}

// readFailed: a read of the survivor failed during a copy: the survivor
// is failed (the set with it: the new member is not complete).
func (m *Mirror) readFailed(o Member, err error) error {
	if ferr := m.fail(o, err); ferr != nil {
		return ferr
	}
	return err
}

func (m *Mirror) copyStop(ctx context.Context) error {
	if err := m.rsErr(); err != nil {
		return err
	}
	return ctx.Err()
}

// BucketGen names a bucket at a generation.
type BucketGen struct {
	Bucket int64
	Gen    uint32
}

// MappedGens returns the buckets mapped on B with the generations they
// are mapped at.
func (m *Mirror) MappedGens() []BucketGen {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []BucketGen
	for _, sl := range m.slots {
		if sl.bucket >= 0 {
			out = append(out, BucketGen{sl.bucket, sl.gen})
		}
	}
	return out
}

// CopyBuckets copies the given buckets' part on B (from the slot's first
// block on) between the survivor and the member being brought in, chunk
// by chunk with no write in flight. Each chunk re-checks that the bucket
// is still mapped at the same generation: a bucket released or reused
// since holds nothing of before, and what was written to it since went
// to both members.
func (m *Mirror) CopyBuckets(ctx context.Context, buckets []BucketGen, progress func()) error {
	r := Member(m.rs.member.Load())
	o := r.other()
	buf := make([]byte, copyChunk)
	for _, bg := range buckets {
		base := m.lay.BucketsOff + bg.Bucket*m.lay.BucketSize
		for in := int64(0); in < m.lay.BucketSize; {
			if err := m.copyStop(ctx); err != nil {
				return err
			}
			n := min(int64(len(buf)), m.lay.BucketSize-in)
			t0 := time.Now()
			m.copyMu.Lock()
			var (
				e      extent
				ok     bool
				skip   bool
				hdrErr error
			)
			m.mu.Lock()
			j := m.slotOf[bg.Bucket]
			if j < 0 || m.slots[j].gen != bg.Gen {
				skip = true
			} else if from := int64(m.slots[j].from) * blockSize; in < from {
				n = from - in // no copy on B before the slot's first block
			} else {
				e = extent{off: base + in, p: buf[:n], bOff: m.slotOff(j) + blockSize + in, sl: j}
				ok = true
			}
			m.mu.Unlock()
			var rerr error
			if ok {
				if _, rerr = m.d(o).ReadAt(e.p, m.memberOff(o, e)); rerr == nil {
					if r == B {
						hdrErr = m.rewriteHeader(e.sl)
					}
					if hdrErr != nil {
						m.rsFail(r, hdrErr)
					} else if _, werr := m.d(r).WriteAt(e.p, m.memberOff(r, e)); werr != nil {
						m.rsFail(r, werr)
					}
				}
			}
			m.copyMu.Unlock()
			if rerr != nil {
				return m.readFailed(o, rerr)
			}
			if skip {
				m.rs.done.Add(m.lay.BucketSize - in)
				break
			}
			in += n
			m.rs.done.Add(n)
			if progress != nil {
				progress()
			}
			if ok {
				if err := m.pace(ctx, n, time.Since(t0)); err != nil {
					return err
				}
			}
		}
	}
	return m.copyStop(ctx)
}

// ClearSlotHeaders overwrites the headers of B's slots that hold no
// mapping written in this resilver, so that a former member's headers
// are never taken for mappings at the next open. Only for a resilver of
// B; each header is cleared with no write in flight.
func (m *Mirror) ClearSlotHeaders(ctx context.Context) error {
	if Member(m.rs.member.Load()) != B {
		return nil
	}
	zero := make([]byte, blockSize)
	m.mu.Lock()
	n := int32(len(m.slots))
	m.mu.Unlock()
	for j := int32(0); j < n; j++ {
		if j%64 == 0 {
			if err := m.copyStop(ctx); err != nil {
				return err
			}
		}
		m.copyMu.Lock()
		m.mu.Lock()
		clear := m.slots[j].hdr == nil
		m.mu.Unlock()
		if clear {
			if _, err := m.d(B).WriteAt(zero, m.slotOff(j)); err != nil {
				m.rsFail(B, err)
			}
		}
		m.copyMu.Unlock()
	}
	return m.copyStop(ctx)
}

// FinishResilver syncs the new member and labels both in sync (step 4):
// from its return on the mirror is redundant again.
func (m *Mirror) FinishResilver() error {
	r := Member(m.rs.member.Load())
	o := r.other()
	if err := m.Sync(); err != nil {
		return err
	}
	if err := m.rsErr(); err != nil {
		return err
	}
	m.lmu.Lock()
	defer m.lmu.Unlock()
	if !m.live(o) {
		return ErrBothFailed
	}
	l := m.label
	l.Gen++
	l.Failed[r] = false
	if err := writeLabel(m.d(o), l, o, m.counter[o]); err != nil {
		return m.failSurvivorLocked(o, err)
	}
	m.counter[o]++
	m.label = l
	if err := writeLabel(m.d(r), l, r, m.counter[r]); err != nil {
		// The survivor says both are in sync, the new member's label is
		// a generation behind: it opens stale. Here it is failed again.
		m.rsFail(r, err)
		m.label.Failed[r] = true
		m.label.Gen++
		if werr := m.writeLabelLocked(o); werr != nil {
			return m.failSurvivorLocked(o, werr)
		}
		return m.rsErr()
	}
	m.counter[r]++
	m.copyMu.Lock()
	m.failed[r].Store(false)
	m.rs.syncing[r].Store(false)
	m.copyMu.Unlock()
	m.rs.active.Store(false)
	m.log.Warn("mirror: resilver finished: both members in sync", "member", r.String(), "gen", l.Gen)
	return nil
}

// AbortResilver ends a resilver that did not finish: the new member stops
// taking writes and stays failed (its own label says so). err is why.
func (m *Mirror) AbortResilver(err error) {
	r := Member(m.rs.member.Load())
	m.copyMu.Lock()
	m.rs.syncing[r].Store(false)
	m.copyMu.Unlock()
	if r == B {
		m.mu.Lock()
		m.free = nil
		m.mu.Unlock()
	}
	m.rs.active.Store(false)
	m.log.Error("mirror: resilver stopped: the set stays degraded", "member", r.String(), "err", err)
}

// Resilvering returns the member being brought in, if any.
func (m *Mirror) Resilvering() (Member, bool) {
	return Member(m.rs.member.Load()), m.rs.active.Load()
}

// WritesBoth reports whether every write reaches both members: both are
// live or one is being resilvered.
func (m *Mirror) WritesBoth() bool {
	w := func(r Member) bool { return m.live(r) || m.rs.syncing[r].Load() }
	return w(A) && w(B)
}
