package cache

// Cache device failure: the policy (which errors fail the set over), the
// passthrough service after failover, fencing, lost writes and the
// lost-writes record, described once in docs/CACHE.md, "Device failures".
// Here: cacheIOError and cacheErrLimit (the policy), failLocked (the
// failover: fences, lost counts and the record, in one hold of Set.mu),
// readFailed and fenceErr (requests after it), recordLostLocked and
// recordLostAtClose (the lost-writes record), LostWrites and
// AckLostWrites (reading and acknowledging it).

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// cacheErrLimit is how many cache data I/O errors in a row (no successful
// cache I/O in between) fail the set over to passthrough.
const cacheErrLimit = 3

// ErrCacheFailed marks I/O refused or failed because the cache device
// failed and the set runs in passthrough mode.
var ErrCacheFailed = errors.New("cache: cache device failed")

// ErrDirtyUnreachable is returned for a read of a block whose only current
// copy is dirty data in a cache that cannot be read, and for a write to a
// block whose dirty copy on the failed cache device would otherwise become
// stale. It is an I/O error to the client (EIO).
var ErrDirtyUnreachable = errors.New("cache: dirty data on the cache device is unreachable")

// ErrLostWrites is returned by Flush on a volume whose writes since its last
// durable commit were only in the cache when the cache device failed.
var ErrLostWrites = errors.New("cache: writes lost with the failed cache device")

// FailedError is the set's failure: it wraps ErrCacheFailed and the cause.
type FailedError struct{ Cause error }

func (e *FailedError) Error() string { return fmt.Sprintf("%v: %v", ErrCacheFailed, e.Cause) }

// Unwrap returns ErrCacheFailed and the cause, whose errno is hidden: the
// errors a failed set returns are EIO to clients (an ENOSPC of the cache
// device's file system is not the client's device being full).
func (e *FailedError) Unwrap() []error { return []error{ErrCacheFailed, errnoHidden{e.Cause}} }

// errnoHidden is an error whose chain matches every target errors.Is and
// errors.As match in err, except errnos: as one, it is EIO.
type errnoHidden struct{ err error }

func (h errnoHidden) Error() string { return h.err.Error() }

func (h errnoHidden) Is(target error) bool {
	if en, ok := target.(syscall.Errno); ok {
		return en == syscall.EIO
	}
	return errors.Is(h.err, target)
}

func (h errnoHidden) As(target any) bool {
	if _, ok := target.(*syscall.Errno); ok {
		return false
	}
	return errors.As(h.err, target)
}

// foState is a volume's failover state, guarded by Set.mu.
type foState struct {
	// fence: ranges named by journal records that may not be durable
	// (sorted, merged). Writes to them are refused after failover.
	fence []blockRange
	// lost counts dirty blocks inserted by records that never became
	// durable: writes acknowledged only in the failed cache. lostR are
	// their ranges (sorted, merged).
	lost  int64
	lostR []blockRange
	// lastLog is when an unreachable read was last logged (rate limit).
	lastLog time.Time
}

// Failed returns the failure that put the set in passthrough mode, or nil.
func (s *Set) Failed() error { return s.err() }

func (s *Set) isFailed() bool { return s.failed.Load() != nil }

// cacheIOOK records a successful cache data I/O (resets the error run).
func (s *Set) cacheIOOK() {
	if s.errRun.Load() != 0 {
		s.errRun.Store(0)
	}
}

// cacheWriteOK is cacheIOOK for a write of client data: it also ends an
// ENOSPC state (reads succeed while writes fail for want of space).
func (s *Set) cacheWriteOK() {
	s.cacheIOOK()
	if s.noSpace != nil {
		s.noSpace.OK()
	}
}

// cacheIOError records a failed cache data I/O; cacheErrLimit in a row fail
// the set over. ENOSPC is not a device failure: the file system under a
// cache file is full (a file left sparse, a copy-on-write file system), the
// caller sends the data around the cache as it does when the cache is full,
// and the set goes on. REQUIRES: not commitMu, not s.mu.
func (s *Set) cacheIOError(what string, err error) {
	if errors.Is(err, mirror.ErrNoCopy) {
		// A mirrored set running on B alone: the block was clean and
		// only on the failed A; not a device error (mirror.go).
		return
	}
	if errors.Is(err, syscall.ENOSPC) && s.noSpace != nil {
		s.stats.cacheNoSpace.Add(1)
		s.noSpace.Failed(err) // logs the first one and a summary a minute
		return
	}
	s.stats.cacheErrors.Add(1)
	n := s.errRun.Add(1)
	s.log.Warn("cache device I/O error", "op", what, "err", err, "in_a_row", n, "limit", cacheErrLimit)
	if n >= cacheErrLimit {
		s.failover(fmt.Errorf("%d cache device errors in a row, last %s: %w", n, what, err))
	}
}

// failover puts the set in passthrough mode (see the top of this file).
// REQUIRES: not commitMu, not s.mu.
func (s *Set) failover(cause error) error {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	return s.failLocked(cause)
}

// failLocked is failover with commitMu held: no commit is running, so the
// records taken by the last one that did not finish (jr.taken) and those
// still pending are exactly the ones that may not be durable.
// REQUIRES: commitMu, not s.mu.
func (s *Set) failLocked(cause error) error {
	fe := error(&FailedError{Cause: cause})
	// The flag is set under mu, in the critical section that counts the
	// lost records: appendLocked (under mu) sees it set or puts its record
	// among those counted here, and a Flush or FUA that sees the set
	// failed and then reads a volume's lost count under mu sees every lost
	// write. Were the flag set before mu is taken, a Flush in between
	// could find the set failed with nothing lost yet and succeed,
	// claiming writes durable that the failover then counts lost.
	s.mu.Lock()
	first := s.failed.CompareAndSwap(nil, &fe)
	if first {
		s.stats.cacheErrors.Add(1)
	}
	lost := append(s.jr.taken, s.mu.pending...)
	s.jr.taken, s.mu.pending = nil, nil
	// The lost records are numbered durable+1, durable+2, ... (appendLocked
	// counts them in mu.seq; a commit makes a prefix durable).
	seq := s.durable.Load()
	cleaned := map[uint16]map[uint64]bool{} // lost clean marks: still dirty on the device
	for len(lost) > 0 {
		r, rest, err := ondisk.DecodeRec(lost)
		if err != nil {
			break // our own encoding: cannot happen
		}
		lost = rest
		seq++
		_, dropsDirty := s.mu.dirtyInval[seq]
		switch r.Type {
		case ondisk.RecClean:
			if cleaned[r.Vol] == nil {
				cleaned[r.Vol] = map[uint64]bool{}
			}
			cleaned[r.Vol][r.LBA] = true
		case ondisk.RecInvalidate:
			for l := range cleaned[r.Vol] {
				dropsDirty = dropsDirty || (l >= r.LBA && l-r.LBA < r.N)
			}
		case ondisk.RecInsert:
			if !r.Dirty {
				n := uint64(len(r.CRCs))
				for l := range cleaned[r.Vol] {
					dropsDirty = dropsDirty || (l >= r.LBA && l-r.LBA < n)
				}
			}
		}
		s.lostLocked(r, dropsDirty)
	}
	s.mu.dirtyInval = nil
	s.fenceBadLeavesLocked()
	type volReport struct {
		name                     string
		dirty, sup, lost, fences int64
		ranges                   []blockRange
	}
	var rec *ondisk.LostEvent
	if first {
		rec = s.lostEventLocked()
	}
	var reps []volReport
	if first {
		for _, v := range s.vols {
			r := volReport{name: v.name, dirty: v.idx.Dirty, sup: v.idx.NSup, lost: v.fo.lost}
			r.ranges = v.dirtyRangesLocked(16)
			r.fences = int64(len(v.fo.fence))
			reps = append(reps, r)
		}
	}
	// Wake writers waiting for space: they go around the cache now.
	s.wakeLocked()
	s.mu.Unlock()
	if !first {
		return s.err()
	}
	s.recordLostLocked(rec)
	s.log.Error("CACHE DEVICE FAILED: serving every volume from its backing device (passthrough); dirty data still in the cache is unreachable",
		"cause", cause)
	for _, r := range reps {
		if r.dirty+r.lost == 0 {
			s.log.Warn("cache device failed: volume has no dirty data in the cache; nothing lost", "volume", r.name)
			continue
		}
		s.log.Error("cache device failed: volume has dirty data that is now unreachable; reads of it return I/O errors and writes to it are refused until the cache device is repaired and the set reopened",
			"volume", r.name, "unreachable_dirty_bytes", r.dirty*blockSize, "superseded_versions", r.sup,
			"lost_unflushed_bytes", r.lost*blockSize, "first_dirty_ranges", fmtRanges(r.ranges))
	}
	return s.err()
}

// lostLocked applies a journal record that will never be written (taken or
// appended at or after failover) to the volume's fence. dropsDirty says an
// invalidation or a clean insert replaced data that may be dirty on the
// cache device: its backing write (passthrough, writethrough) would be
// rolled back by a reopen of the repaired device, so it counts as lost.
//
// A lost clean insert that replaced dirty data is fenced too: in memory the
// block is clean (not fenced as dirty), but the device may still hold the
// durable dirty version, which a reopen would replay over any later
// passthrough write. (Other lost clean inserts, promotions and GC moves,
// replaced nothing dirty: the device holds at most a clean entry there,
// which a reopen after failover drops.)
// REQUIRES: s.mu
func (s *Set) lostLocked(r *ondisk.Rec, dropsDirty bool) {
	if int(r.Vol) >= len(s.vols) {
		return
	}
	v := s.vols[r.Vol]
	switch r.Type {
	case ondisk.RecInsert:
		if n := uint64(len(r.CRCs)); r.Dirty || dropsDirty {
			v.addLostLocked(r.LBA, n)
			v.addFenceLocked(r.LBA, n)
		}
	case ondisk.RecClean:
		v.addFenceLocked(r.LBA, 1)
	case ondisk.RecInvalidate:
		v.addFenceLocked(r.LBA, r.N)
		if dropsDirty {
			v.addLostLocked(r.LBA, r.N)
		}
	}
}

// addFenceLocked adds [lba, lba+n) to the fence. REQUIRES: s.mu
func (v *Volume) addFenceLocked(lba, n uint64) { v.fo.fence = addRange(v.fo.fence, lba, n) }

// addLostLocked counts [lba, lba+n) lost (foState.lost, lostR).
// REQUIRES: s.mu
func (v *Volume) addLostLocked(lba, n uint64) {
	v.fo.lost += int64(n)
	v.fo.lostR = addRange(v.fo.lostR, lba, n)
}

// addRange adds [lba, lba+n) to f, keeping it sorted and merged.
func addRange(f []blockRange, lba, n uint64) []blockRange {
	if n == 0 {
		return f
	}
	f = append(f, blockRange{lba, n})
	slices.SortFunc(f, func(a, b blockRange) int {
		switch {
		case a.lba < b.lba:
			return -1
		case a.lba > b.lba:
			return 1
		}
		return 0
	})
	out := f[:1]
	for _, r := range f[1:] {
		last := &out[len(out)-1]
		if r.lba <= last.lba+last.n {
			last.n = max(last.n, r.lba+r.n-last.lba)
			continue
		}
		out = append(out, r)
	}
	return out
}

// fencedLocked reports whether a write to [lba, lba+n) must be refused
// after failover: part of it is dirty in the cache or fenced.
// REQUIRES: s.mu
func (v *Volume) fencedLocked(lba, n uint64) bool {
	return v.fenceOverlapsLocked(lba, n) || v.dirtyInLocked(lba, n)
}

// fenceOverlapsLocked reports whether [lba, lba+n) overlaps the fence.
// REQUIRES: s.mu
func (v *Volume) fenceOverlapsLocked(lba, n uint64) bool {
	f := v.fo.fence
	i, _ := slices.BinarySearchFunc(f, lba, func(r blockRange, t uint64) int {
		if r.lba+r.n <= t {
			return -1
		}
		if r.lba > t {
			return 1
		}
		return 0
	})
	return i < len(f) && f[i].overlaps(lba, n)
}

// dirtyInLocked reports whether a block of [lba, lba+n) is dirty in the
// index, or may be: in an index leaf that cannot be loaded.
// REQUIRES: s.mu
func (v *Volume) dirtyInLocked(lba, n uint64) bool {
	dirty := false
	v.idx.Tree.AscendRange(index.Ent{LBA: lba}, index.Ent{LBA: lba + n}, func(e index.Ent) bool {
		dirty = e.Dirty()
		return !dirty
	})
	if v.idx.Tree.TakeFault() != nil {
		return true
	}
	return dirty
}

// dirtyRangesLocked lists up to max ranges of dirty blocks of the
// resident index leaves (for the log): it reads no leaf from the cache
// device that has just failed.
// REQUIRES: s.mu
func (v *Volume) dirtyRangesLocked(limit int) []blockRange {
	var out []blockRange
	v.idx.Tree.AscendResident(func(e index.Ent) bool {
		if !e.Dirty() {
			return true
		}
		if k := len(out); k > 0 && out[k-1].lba+out[k-1].n == e.LBA {
			out[k-1].n++
			return true
		}
		if len(out) == limit {
			return false
		}
		out = append(out, blockRange{e.LBA, 1})
		return true
	})
	return out
}

func fmtRanges(rs []blockRange) string {
	s := ""
	for i, r := range rs {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("[%d,+%d)", r.lba*blockSize, r.n*blockSize)
	}
	return s
}

// readFailed serves a read after failover: from the backing device, unless a
// block of the range is dirty in the (unreachable) cache, or in an index
// leaf that cannot be loaded.
func (v *Volume) readFailed(buf []byte, lba uint64, n int) error {
	s := v.s
	s.mu.Lock()
	var bad index.Ent
	found := false
	v.idx.Tree.AscendRange(index.Ent{LBA: lba}, index.Ent{LBA: lba + uint64(n)}, func(e index.Ent) bool {
		if e.Dirty() {
			bad, found = e, true
		}
		return !found
	})
	var fe *index.FaultError
	cause := s.err()
	if err := v.idx.Tree.TakeFault(); errors.As(err, &fe) && !found {
		bad, found = index.Ent{LBA: max(lba, fe.Lo)}, true
		cause = fmt.Errorf("%w; %w", cause, fe) // this leaf's error, which may not be the failover's
	}
	logIt := false
	if found && time.Since(v.fo.lastLog) > time.Second {
		v.fo.lastLog, logIt = time.Now(), true
	}
	s.mu.Unlock()
	if found {
		v.st.unreachableReads.Add(1)
		err := fmt.Errorf("volume %s: reading %d bytes at %d: block at %d: %w (%w)", v.name, n*blockSize,
			int64(lba)*blockSize, int64(bad.LBA)*blockSize, ErrDirtyUnreachable, cause)
		if logIt {
			s.log.Error("read of dirty data on the failed cache device: I/O error to the client (logged at most once a second per volume)",
				"volume", v.name, "offset", int64(bad.LBA)*blockSize, "unreachable_reads_so_far", v.st.unreachableReads.Load())
		}
		return err
	}
	if err := v.readBacking(buf, lba); err != nil {
		return fmt.Errorf("volume %s: %w", v.name, err)
	}
	return nil
}

// fenceErr is the error of a write refused after failover.
func (v *Volume) fenceErr(lba, n uint64) error {
	v.st.fencedWrites.Add(1)
	v.s.log.Error("write to a block whose dirty data is on the failed cache device refused",
		"volume", v.name, "offset", int64(lba)*blockSize, "length", int64(n)*blockSize)
	return fmt.Errorf("volume %s: writing %d bytes at %d: %w (%w)", v.name, n*blockSize, int64(lba)*blockSize,
		ErrDirtyUnreachable, v.s.err())
}

// lostCount returns the volume's lost blocks (foState.lost). It is zero
// until the set fails over (only failover paths count), so the common case
// takes no lock.
func (v *Volume) lostCount() int64 {
	if !v.s.isFailed() {
		return 0
	}
	v.s.mu.Lock()
	defer v.s.mu.Unlock()
	return v.fo.lost
}

// noteInvalidateLocked remembers, until they are durable, that the records
// appended after sequence number from (an invalidation, or the clean
// inserts of one writethrough run of n blocks) replaced dirty data: if one
// is lost in a failover, its backing write counts as lost (a reopen of the
// repaired cache would replay the dirty data over it). A run split into
// several insert records marks all of them (a lost count too high makes
// Flush fail, never claim lost data durable). The records cover
// [lba, lba+n).
// REQUIRES: s.mu
func (s *Set) noteInvalidateLocked(v *Volume, from, lba, n uint64, dropsDirty bool) {
	if !dropsDirty {
		return
	}
	if s.isFailed() {
		// appendLocked fenced an invalidation, not a clean insert.
		v.addLostLocked(lba, n)
		v.addFenceLocked(lba, n)
		return
	}
	if s.mu.dirtyInval == nil {
		s.mu.dirtyInval = map[uint64]struct{}{}
	}
	for q := from + 1; q <= s.mu.seq; q++ {
		s.mu.dirtyInval[q] = struct{}{}
	}
}

// lostAny reports whether any volume lost writes with the failed cache.
func (s *Set) lostAny() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.vols {
		if v.fo.lost > 0 {
			return true
		}
	}
	return false
}

// Lost-writes record types (ondisk/lostwrites.go).
type (
	LostWrites = ondisk.LostWrites
	LostEvent  = ondisk.LostEvent
	LostVolume = ondisk.LostVolume
	LostRange  = ondisk.LostRange
)

// lostMaxEvents bounds the unacknowledged failovers recorded: beyond it
// the two oldest are merged into one (its volumes and causes kept).
const lostMaxEvents = 8

// lostState is the set's lost-writes record, guarded by mu.
type lostState struct {
	mu  sync.Mutex
	rec ondisk.LostWrites
	// id is the ID of this process's failover in rec (0: none), so that
	// Close records it again with what was lost after it.
	id uint64
	// recorded is the lost block count rec holds for this failover.
	// REQUIRES: Set.commitMu
	recorded int64
	// werr is the error of the last write of rec that failed: the record
	// is then only in memory (and the log).
	werr error
}

// loadLostWrites reads the lost-writes record at Open.
func (s *Set) loadLostWrites() error {
	rec, err := ondisk.ReadLostWrites(s.dev, s.sb)
	if err != nil {
		return err
	}
	s.lw.mu.Lock()
	s.lw.rec = rec
	s.lw.mu.Unlock()
	for _, ev := range rec.Events {
		for _, v := range ev.Vols {
			s.log.Error("ACKNOWLEDGED WRITES LOST in an earlier cache device failover (recorded on the cache device): they are not on the backing device; acknowledge with 'tiercache lost-writes --ack ID' once handled",
				"failover", ev.ID, "at", time.Unix(0, ev.Time).UTC().Format(time.RFC3339), "volume", v.Name,
				"lost_bytes", v.Blocks*blockSize, "ranges", v.FormatRanges())
		}
	}
	return nil
}

// lostEventLocked builds this failover's event from the volumes' lost
// counts (nil when nothing is lost). REQUIRES: s.mu
func (s *Set) lostEventLocked() *ondisk.LostEvent {
	ev := &ondisk.LostEvent{Time: time.Now().UnixNano()}
	var total int64
	for _, v := range s.vols {
		if v.fo.lost == 0 {
			continue
		}
		total += v.fo.lost
		lv := ondisk.LostVolume{Name: v.name, Blocks: uint64(v.fo.lost)}
		for i, r := range v.fo.lostR {
			if i == ondisk.LostMaxRanges {
				lv.More = true
				break
			}
			lv.Ranges = append(lv.Ranges, ondisk.LostRange{LBA: r.lba, N: r.n})
		}
		ev.Vols = append(ev.Vols, lv)
	}
	if total == 0 {
		return nil
	}
	if fe := s.err(); fe != nil {
		ev.Cause = fe.Error()
	}
	return ev
}

// recordLostLocked adds ev (this process's failover; it replaces the
// event recorded for it before) to the lost-writes record and writes the
// record. A failed write is logged and leaves the record in memory.
// REQUIRES: s.commitMu, not s.mu
func (s *Set) recordLostLocked(ev *ondisk.LostEvent) {
	if ev == nil {
		return
	}
	s.lw.mu.Lock()
	rec := s.lw.rec
	rec.Events = slices.Clone(rec.Events)
	if s.lw.id != 0 {
		rec.Events = slices.DeleteFunc(rec.Events, func(e ondisk.LostEvent) bool { return e.ID == s.lw.id })
	} else {
		rec.NextID = max(rec.NextID, 1)
		s.lw.id = rec.NextID
		rec.NextID++
	}
	ev.ID = s.lw.id
	s.lw.recorded = 0
	for _, v := range ev.Vols {
		s.lw.recorded += int64(v.Blocks)
	}
	rec.Events = append(rec.Events, *ev)
	for len(rec.Events) > lostMaxEvents {
		a, b := rec.Events[0], rec.Events[1]
		b.Cause = fmt.Sprintf("failover %d: %s; failover %d: %s", a.ID, a.Cause, b.ID, b.Cause)
		b.Vols = append(slices.Clone(a.Vols), b.Vols...)
		b.Dropped += a.Dropped
		rec.Events = append([]ondisk.LostEvent{b}, rec.Events[2:]...)
	}
	rec.N++
	err := ondisk.WriteLostWrites(s.dev, rec)
	s.lw.rec, s.lw.werr = rec, err
	s.lw.mu.Unlock()
	if err != nil {
		s.log.Error("the acknowledged writes lost in this failover could NOT be recorded on the cache device: only this log and the running server's status say so",
			"failover", ev.ID, "err", err)
		return
	}
	s.log.Error("acknowledged writes lost in this failover recorded on the cache device: 'tiercache check' and 'status' report them until acknowledged ('tiercache lost-writes --cache DEVICE --ack ID')",
		"failover", ev.ID)
}

// recordLostAtClose records the failover again if requests after it lost
// more writes. REQUIRES: not commitMu, not s.mu
func (s *Set) recordLostAtClose() {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.mu.Lock()
	var total int64
	for _, v := range s.vols {
		total += v.fo.lost
	}
	var ev *ondisk.LostEvent
	if total != s.lw.recorded {
		ev = s.lostEventLocked()
	}
	s.mu.Unlock()
	s.recordLostLocked(ev)
}

// LostWrites returns the unacknowledged failovers that lost acknowledged
// writes (the record on the cache device, with this process's failover),
// and the error of writing the record if it could not be (the record is
// then only in memory).
func (s *Set) LostWrites() ([]LostEvent, error) {
	s.lw.mu.Lock()
	defer s.lw.mu.Unlock()
	return slices.Clone(s.lw.rec.Events), s.lw.werr
}

// ReadLostWrites returns the lost-writes record of a cache device that is
// not open (check, inspect).
func ReadLostWrites(dev device.Device) (LostWrites, error) {
	sb, _, err := ondisk.ReadSuperblock(dev)
	if err != nil {
		return LostWrites{}, err
	}
	return ondisk.ReadLostWrites(dev, sb)
}

// ErrNoSuchLostEvent is returned by AckLostWrites for an ID the record
// does not hold.
var ErrNoSuchLostEvent = ondisk.ErrNoSuchLostEvent

// AckLostWrites removes the failovers ids from the lost-writes record of a
// cache device that is not open, after an operator has dealt with what
// they lost. Every id must be in the record (nothing is removed
// otherwise). It returns the record written.
func AckLostWrites(dev device.Device, ids []uint64) (LostWrites, error) {
	sb, _, err := ondisk.ReadSuperblock(dev)
	if err != nil {
		return LostWrites{}, err
	}
	if err := refuseMirrored(sb, "acknowledging lost writes"); err != nil {
		return LostWrites{}, err
	}
	rec, err := ondisk.ReadLostWrites(dev, sb)
	if err != nil {
		return rec, err
	}
	return ackRecord(dev, rec, ids)
}

// ackRecord writes rec without the failovers ids, all of which must be in
// it (nothing is written otherwise).
func ackRecord(dev device.Device, rec LostWrites, ids []uint64) (LostWrites, error) {
	next, err := rec.Ack(ids)
	if err != nil {
		return rec, err
	}
	if err := ondisk.WriteLostWrites(dev, next); err != nil {
		return rec, err
	}
	return next, nil
}

// AckLostWrites is the package-level AckLostWrites for an open set (the
// admin API): it refuses while the set is failed over (acknowledge after
// the server restarted on a working device) and returns the failovers
// left.
func (s *Set) AckLostWrites(ids []uint64) ([]LostEvent, error) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if err := s.err(); err != nil {
		return nil, fmt.Errorf("acknowledging lost writes: the cache device failed, and this server's own failover is not over: restart the server on a working cache device first: %w", err)
	}
	s.lw.mu.Lock()
	defer s.lw.mu.Unlock()
	rec, err := ackRecord(s.dev, s.lw.rec, ids)
	if err != nil {
		return slices.Clone(s.lw.rec.Events), err
	}
	s.lw.rec = rec
	return slices.Clone(rec.Events), nil
}

// DescribeLostEvent is one line per volume of a failover's lost writes,
// for check and status (ondisk.LostEvent.Describe).
func DescribeLostEvent(ev LostEvent) []string { return ev.Describe() }
