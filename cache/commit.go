package cache

import (
	"errors"
	"fmt"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/invariants"
)

// The commit protocol (docs/CACHE.md, "Flush protocol"): records appended
// under Set.mu are made durable by a group commit (commitLocked) that syncs
// the backing devices the records depend on, then the cache device, then
// writes the journal blocks (or a checkpoint when the journal is full).
// Flush and FUA wait for it; commitLoop runs it periodically.

const (
	commitInterval = time.Second // bound on unflushed work lost in a crash
	pendingKick    = 256 << 10   // journal bytes that wake the committer
)

// appendLocked queues a journal record; it becomes durable at the next
// commit (Flush, FUA, a full buffer, or the periodic commit).
// REQUIRES: s.mu
func (s *Set) appendLocked(r *ondisk.Rec) {
	if s.isFailed() {
		// Nothing reaches the journal any more.
		s.lostLocked(r, false)
		s.mu.seq++
		return
	}
	s.mu.pending = ondisk.AppendRec(s.mu.pending, r)
	s.mu.seq++
	s.noteCommitDue()
	if len(s.mu.pending) >= pendingKick {
		select {
		case s.kickCommit <- struct{}{}:
		default:
		}
	}
}

// appendInsertLocked journals a run written in flush epoch epoch, split
// into records of at most ondisk.MaxInsertRun blocks.
// REQUIRES: s.mu
func (s *Set) appendInsertLocked(vi int, lba uint64, loc uint32, dirty bool, crcs []uint32, epoch uint64) {
	gen := s.mu.Buckets[int64(loc)/s.bpb].Gen
	for len(crcs) > 0 {
		k := min(len(crcs), ondisk.MaxInsertRun)
		s.appendLocked(&ondisk.Rec{Type: ondisk.RecInsert, Vol: uint16(vi), LBA: lba, Loc: loc, Gen: gen, Dirty: dirty,
			Epoch: epoch, CRCs: crcs[:k]})
		lba += uint64(k)
		loc += uint32(k)
		crcs = crcs[k:]
	}
	v := s.vols[vi]
	v.idx.Replayable = true
	v.idx.insertSeq = s.mu.seq
}

// commit makes durable every record appended up to target and every backing
// write completed so far (invariant 2). Concurrent callers share one journal
// write and one device sync: whoever holds commitMu writes everything
// pending, and the callers queued behind it usually find their records
// already durable.
func (s *Set) commit(target uint64) error {
	if s.isFailed() {
		// Passthrough: what is durable is what the backing devices hold.
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.backingsSynced() && s.leafFaulted() == nil {
		return nil
	}
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if s.isFailed() {
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.backingsSynced() && s.leafFaulted() == nil {
		return nil
	}
	return s.commitLocked(false)
}

// commitRecords makes every record appended up to target durable. Unlike
// commit it does not also wait for the backing writes completed since: a
// caller that needs only its own records durable (a region's mark before
// its backing write) returns as soon as a commit has covered them, instead
// of running one more commit, with its backing sync, for every backing
// write that other writers completed while it queued on commitMu.
func (s *Set) commitRecords(target uint64) error {
	if s.isFailed() {
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.leafFaulted() == nil {
		return nil
	}
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if s.isFailed() {
		return s.syncBackings()
	}
	if s.durable.Load() >= target && s.leafFaulted() == nil {
		return nil
	}
	return s.commitLocked(false)
}

// backingsSynced reports whether every backing write completed before the
// call is durable, as far as commit is concerned (a failed sync is left to
// durableErr). A clear flag may have been taken by a syncBackings whose
// sync is still running: waiting for syncMu waits for it. Without the wait
// a flush that found no record to commit (a passthrough write whose
// invalidation was skipped, idx.Replayable) could return while another
// commit's backing sync covering its write is in flight, and a crash would
// then lose the write.
// REQUIRES: not s.mu
func (s *Set) backingsSynced() bool {
	if s.backingsUnsynced() {
		return false
	}
	s.syncMu.Lock()
	//lint:ignore SA2001 taking the lock is the wait for a sync in flight
	s.syncMu.Unlock()
	return !s.backingsUnsynced()
}

func (s *Set) backingsUnsynced() bool {
	for _, v := range s.volList() {
		if v.backingUnsynced.Load() {
			return true
		}
	}
	return false
}

// commitLocked is the flush protocol:
//
//  1. take the pending records (under mu);
//  2. sync every backing device written since its last sync, so that a
//     record that depends on backing data (a clean insert, an invalidation)
//     is never durable before that data;
//  3. sync the cache device, making the data of every taken record durable;
//  4. write the records as journal blocks (or a checkpoint when the journal
//     is full), and sync again.
//
// REQUIRES: s.commitMu
func (s *Set) commitLocked(forceCkpt bool) error {
	if s.isFailed() {
		return s.syncBackings()
	}
	s.mu.Lock()
	if err := s.leafFaulted(); err != nil {
		// A write whose index leaf could not be loaded is not in the
		// index: no commit may claim its record durable.
		s.mu.Unlock()
		return s.failLocked(err)
	}
	stream := s.mu.pending
	s.mu.pending = nil
	s.jr.taken = append(s.jr.taken, stream...)
	upto := s.mu.seq
	blocks := ondisk.PackRecords(stream)
	jblocks := s.lay.JournalLen / blockSize
	// In invariants builds, checkpoint at random to exercise generation
	// switches and slot alternation far more often than a full journal does.
	if forceCkpt || int64(len(blocks)) > jblocks-s.jr.used || (invariants.Sometimes(3) && !s.knobs.fixedJournal) {
		s.mu.Unlock()
		// A checkpoint covers the taken records (it snapshots the index,
		// which already reflects them).
		return s.checkpointLocked(upto)
	}
	s.mu.Unlock()
	if err := s.syncBackingsForCommit(); err != nil {
		return err
	}
	if len(blocks) == 0 {
		s.setDurable(upto)
		return nil
	}
	if err := s.dev.Sync(); err != nil {
		return s.failLocked(fmt.Errorf("syncing cache device: %w", err))
	}
	mb := int(ondisk.MaxBatchBlocks(jblocks))
	for len(blocks) > 0 {
		k := min(len(blocks), mb)
		batch := blocks[:k]
		blocks = blocks[k:]
		batchStart := s.jr.pos.Seq
		buf := make([]byte, 0, k*blockSize)
		for i, p := range batch {
			buf = append(buf, ondisk.EncodeJournalBlock(ondisk.BlockHeader{Nonce: s.nonce, Gen: s.jr.gen, Seq: batchStart + uint64(i), BatchStart: batchStart}, p)...)
		}
		// The region is circular: at most two writes.
		first := min(int64(k), jblocks-s.jr.pos.Blk)
		off := s.lay.JournalOff + s.jr.pos.Blk*blockSize
		if _, err := s.dev.WriteAt(buf[:first*blockSize], off); err != nil {
			return s.failLocked(fmt.Errorf("writing journal at %d: %w", off, err))
		}
		if first < int64(k) {
			if _, err := s.dev.WriteAt(buf[first*blockSize:], s.lay.JournalOff); err != nil {
				return s.failLocked(fmt.Errorf("writing journal at %d: %w", s.lay.JournalOff, err))
			}
		}
		if err := s.dev.Sync(); err != nil {
			return s.failLocked(fmt.Errorf("syncing journal: %w", err))
		}
		s.jr.pos = ondisk.JournalPos{Blk: (s.jr.pos.Blk + int64(k)) % jblocks, Seq: s.jr.pos.Seq + uint64(k)}
		s.jr.used += int64(k)
		s.stats.journalBlocks.Add(uint64(k))
	}
	if err := s.writeJournalHeadLocked(s.jr.gen, s.jr.pos); err != nil {
		return s.failLocked(err)
	}
	s.stats.commits.Add(1)
	s.setDurable(upto)
	return nil
}

func (s *Set) setDurable(upto uint64) {
	s.jr.taken = nil
	s.mu.Lock()
	for q := range s.mu.dirtyInval {
		if q <= upto {
			delete(s.mu.dirtyInval, q)
		}
	}
	s.mu.Unlock()
	if upto > s.durable.Load() {
		s.durable.Store(upto)
	}
}

// checkpointLocked writes a checkpoint of the current state, covering every
// record appended so far and the records up to taken that the caller's
// commit took (0: none): it snapshots the index (B-tree clones are
// copy-on-write, so this is cheap under mu), makes every dependency
// durable, writes the checkpoint into the other slot and starts a new
// journal generation at the current journal position. A paged set
// (FeaturePagedIndex) writes the index pages that changed since the
// durable root, then the next root, instead (pagedckpt.go).
// REQUIRES: s.commitMu, not s.mu
func (s *Set) checkpointLocked(taken uint64) error {
	s.mu.Lock()
	// Records appended between taking them and now are also reflected in
	// the snapshot; taking them again keeps them out of the new journal.
	s.jr.taken = append(s.jr.taken, s.mu.pending...)
	s.mu.pending = nil
	upto := max(taken, s.mu.seq)
	gens := make([]uint32, len(s.mu.Buckets))
	for i := range s.mu.Buckets {
		gens[i] = s.mu.Buckets[i].Gen
	}
	trees := make([]*index.Ptree, len(s.vols))
	epochs := make([]uint64, len(s.vols))
	vers := make([]ondisk.VerSnap, len(s.vols))
	epochOf := s.mu.SnapshotEpochs()
	// The volumes this checkpoint holds no entry of: once it is durable,
	// a recovery starts from it and finds none of theirs unless an insert
	// is appended after this snapshot (idx.Replayable).
	vols := s.vols
	empty := make([]bool, len(vols))
	for i, v := range s.vols {
		empty[i] = v.idx.Tree.Len() == 0 && v.idx.NSup == 0
		trees[i] = s.snapshotCleanExcluding(v, v.idx.Tree.Clone())
		epochs[i] = v.idx.epoch
		// The trees and the epoch tables are copy-on-write.
		vers[i] = ondisk.VerSnap{EpochOf: epochOf, Sup: v.idx.Sup.Clone(), Dirty: int(v.idx.Dirty)}
	}
	if err := s.leafFaulted(); err != nil {
		// Checked after the snapshot, in the same hold of mu: a change
		// an index leaf that could not be loaded kept out of the
		// snapshot was found before any record of it was taken.
		s.mu.Unlock()
		return s.failLocked(err)
	}
	s.resetMarksLocked()
	s.mu.Unlock()
	if err := s.syncBackingsForCommit(); err != nil {
		return err
	}
	if err := s.dev.Sync(); err != nil {
		return s.failLocked(fmt.Errorf("syncing cache device: %w", err))
	}
	h := ondisk.CkptHeader{Nonce: s.nonce, Gen: s.jr.gen + 1, JPos: ondisk.JournalPos{Blk: s.jr.pos.Blk}}
	var err error
	if s.pg != nil {
		err = s.writePagedCheckpoint(h, gens, epochs, trees, vers)
	} else {
		err = ondisk.WriteCheckpoint(s.dev, s.lay, h, gens, epochs, trees, vers)
	}
	if err != nil {
		return s.failLocked(err)
	}
	s.jr.gen, s.jr.pos, s.jr.used = h.Gen, h.JPos, 0
	if err := s.writeJournalHeadLocked(s.jr.gen, s.jr.pos); err != nil {
		return s.failLocked(err)
	}
	s.stats.checkpoints.Add(1)
	s.setDurable(upto)
	s.mu.Lock()
	for i, v := range vols {
		// The slot list changes only under commitMu (held), but compare
		// anyway: the flag belongs to the volume the snapshot saw.
		if empty[i] && i < len(s.vols) && s.vols[i] == v && v.idx.insertSeq <= upto {
			v.idx.Replayable = false
		}
	}
	s.mu.Unlock()
	return nil
}

// commitLoop commits commitInterval after records are appended or a
// backing device is written (a crash loses at most that much unflushed
// work even without FLUSH), at once when enough records are pending
// (kickCommit), and waits for a signal (noteCommitDue) while nothing is.
func (s *Set) commitLoop() {
	t := time.NewTimer(commitInterval)
	defer t.Stop()
	for {
		now, ok := s.waitCommitDue()
		if !ok {
			return
		}
		if !now {
			t.Reset(commitInterval)
			select {
			case <-s.stop:
				return
			case <-t.C:
			case <-s.kickCommit:
			}
			t.Stop()
		}
		if err := s.leafFaulted(); err != nil && !s.isFailed() {
			// onLeafFault kicked: fail over even with nothing to commit.
			_ = s.failover(err)
			continue
		}
		s.mu.Lock()
		s.lapseMarksLocked(nowNanos())
		target := s.mu.seq
		s.mu.Unlock()
		_ = s.commit(target) // a failure is sticky and reported to clients
	}
}

// waitCommitDue returns once something waits for commitLoop (commitDue):
// at once if something does, else at the signal of noteCommitDue or a
// kick (now: commit without waiting). ok is false if the set stops first.
func (s *Set) waitCommitDue() (now, ok bool) {
	if s.commitDueNow() {
		return false, true
	}
	s.commitIdle.Store(true)
	// Checked again after announcing idle: a change made before the
	// store is seen here, one made after it signals.
	if s.commitDueNow() {
		s.commitIdle.Store(false)
		return false, true
	}
	select {
	case <-s.stop:
		return false, false
	case <-s.commitDue:
		return false, true
	case <-s.kickCommit:
		s.commitIdle.Store(false)
		return true, true
	}
}

// commitDueNow reports whether commitLoop has work: records not yet
// durable, a backing device written since its last sync, or marked regions
// to lapse (lapseMarksLocked). After a failover only backing syncs remain.
func (s *Set) commitDueNow() bool {
	if s.backingsUnsynced() {
		return true
	}
	if s.isFailed() {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.seq > s.durable.Load() {
		return true
	}
	for _, v := range s.vols {
		if len(v.idx.marks) > 0 {
			return true
		}
	}
	return false
}

// noteCommitDue wakes commitLoop if it waits for work (waitCommitDue):
// called after appending a record or writing a backing device.
func (s *Set) noteCommitDue() {
	if s.commitIdle.Load() && s.commitIdle.CompareAndSwap(true, false) {
		select {
		case s.commitDue <- struct{}{}:
		default:
		}
	}
}

// Flush makes every write completed so far, on every volume, durable (one
// group commit for the whole set).
func (s *Set) Flush() error {
	if err := s.commit(s.appended()); err != nil {
		return err
	}
	var errs []error
	for _, v := range s.volList() {
		errs = append(errs, v.durableErr())
	}
	return errors.Join(errs...)
}

// syncBackings syncs every backing device written since its last sync:
// step 2 of the flush protocol, and all of a commit after failover (there
// is no journal any more).
//
// A failed backing sync fails the commit (see syncBackingsForCommit) and is
// remembered: the kernel may have dropped the data it could not write, so
// a later sync that succeeds proves nothing. The error is logged, counted
// and kept (durableErr): every later Flush or FUA request of the volume
// returns it, so its client learns that acknowledged writes may be lost;
// reads and writes go on.
//
// A device that keeps what a failed sync did not make durable
// (device.SyncKeeper, an object-store image) fails only the commits made
// while its sync fails: nothing is remembered, and once a sync succeeds
// flushes succeed again.
//
// Callers are serialized (syncMu): a caller that finds a flag clear
// returns only after the sync that cleared it has finished, so a failure
// of that sync is in backSyncErr (durableErr) by then.
// REQUIRES: not s.mu
func (s *Set) syncBackings() error {
	s.syncMu.Lock()
	defer s.syncMu.Unlock()
	var first error
	for _, v := range s.volList() {
		if v.backingUnsynced.Swap(false) {
			if err := v.back.Sync(); err != nil {
				err = fmt.Errorf("syncing backing %s: %w", v.name, err)
				if k, ok := v.back.(device.SyncKeeper); ok && k.KeepsUnsynced() {
					// Nothing was dropped: this commit fails, and the
					// next sync that succeeds covers the same writes.
					s.log.Warn("backing device sync failed; the writes stay with the device and the next sync retries them",
						"volume", v.name, "err", err)
				} else if v.backSyncErr.CompareAndSwap(nil, &err) {
					s.log.Error("backing device sync failed: writes to it since its last sync may be lost; every later flush of this volume returns an I/O error until the server restarts",
						"volume", v.name, "err", err)
				} else {
					// Later flushes return the first failure; each
					// later one is its own event and is logged too
					// (at most one a commit: a second a second while
					// the device stays broken).
					s.log.Warn("backing device sync failed again", "volume", v.name, "err", err,
						"failures", v.st.backingSyncErrors.Load()+1)
				}
				v.st.backingSyncErrors.Add(1)
				v.markBackingUnsynced()
				if first == nil {
					first = err
				}
			}
		}
	}
	return first
}

// syncBackingsForCommit is step 2 of the flush protocol. A backing device
// that fails to sync fails this commit (its caller gets the error; the set
// keeps working, and the next commit syncs again): the taken records, some
// of which may depend on that device's data (an invalidation made durable
// before the write it stands for would expose older data), go back to the
// front of the pending stream. While a backing device cannot sync, no
// commit succeeds, for any volume: records of different volumes share the
// journal stream and a bucket reuse may depend on any of them.
// REQUIRES: commitMu, not s.mu
func (s *Set) syncBackingsForCommit() error {
	err := s.syncBackings()
	if err == nil {
		return nil
	}
	s.mu.Lock()
	s.mu.pending = append(s.jr.taken, s.mu.pending...)
	s.jr.taken = nil
	s.mu.Unlock()
	return err
}

// durableErr is the error a Flush or FUA request of the volume returns
// after a failed backing sync (see syncBackings), or nil.
func (v *Volume) durableErr() error {
	if p := v.backSyncErr.Load(); p != nil {
		return fmt.Errorf("volume %s: an earlier backing device sync failed, acknowledged writes may be lost: %w", v.name, *p)
	}
	return nil
}

// commitFUA makes the volume's completed writes durable (FUA). lost0 is
// the volume's lostCount when the request began: if the set failed over
// meanwhile (another commit, the periodic one, losing the records of this
// write), commit finds it failed and only syncs the backing devices, so
// the lost count is what says the write did not survive.
func (v *Volume) commitFUA(lost0 int64) error {
	if err := v.s.commit(v.s.appended()); err != nil {
		return err
	}
	if lost := v.lostCount(); lost > lost0 {
		return fmt.Errorf("volume %s: FUA: %d bytes written before the cache device failed were only in the cache: %w (%w)",
			v.name, (lost-lost0)*blockSize, ErrLostWrites, v.s.err())
	}
	return v.durableErr()
}
