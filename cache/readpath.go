package cache

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// The device reads of one client read (readBlocks).
//
// A read that is partly cached needs pieces from two devices: runs of
// cached blocks from the cache device and the gaps between them from the
// backing device. readPieces issues every piece at once, and it coalesces
// backing gaps separated by at most coalesceGap cached bytes into one
// backing read of the whole span, overlaying the dirty cached blocks when
// both are done. Clean cached blocks inside such a span are not read from
// the cache at all: clean means the backing device holds the same bytes
// (written through, written back and synced, or promoted from it), which
// is also why a clean block failing its checksum is re-read from there.
// On an HDD a short skip costs as much rotation as reading through it, and
// one command instead of several keeps the drive streaming; on an SSD the
// extra bytes are cheap.

// coalesceGap is the largest run of cached bytes a backing read reads
// through (and discards) to join the gaps on either side of it. 128 KiB is
// under 1 ms of transfer on the HDD model, less than any repositioning
// (a revolution is 8.3 ms), and a small fraction of an SSD's bandwidth.
const coalesceGap = 128 << 10

// maxReadFanout bounds the goroutines one read uses for its pieces: enough
// to keep an SSD's channels busy, few enough that a fragmented read does not
// spawn one goroutine per block.
const maxReadFanout = 8

// piece is one device read of a client read.
type piece struct {
	dst     []byte
	lba     uint64 // backing: first block; cache: unused
	off     int64  // cache: device offset
	backing bool
	hits    []index.Ent // cache: the entries read
}

// readPieces fills buf (n blocks from lba) from the cached entries hits
// (sorted by lba, pinned by the caller) and the backing device, and returns
// the blocks not cached and, in fromBacking, the clean hits it served from
// the backing device instead (in a coalesced read, or because the cache
// device failed to read them: readAroundCache). It does not verify
// checksums: readBlocks does, for the hits read from the cache, after
// every piece is in buf.
func (v *Volume) readPieces(buf []byte, lba uint64, n int, hits []index.Ent) (misses []blockRange, fromBacking map[uint64]bool, err error) {
	s := v.s
	if len(hits) == n && cacheContiguous(hits) {
		// A cache hit stored in one run on the cache device (every 4 KiB
		// hit): one device read, as the general path below makes of it,
		// without building pieces.
		_, err := s.dev.ReadAt(buf, s.cacheOff(hits[0].Block()))
		fromBacking, err = v.runRead(buf, hits, err)
		return nil, fromBacking, err
	}
	next := lba
	for k := 0; k <= len(hits); k++ {
		end := lba + uint64(n)
		if k < len(hits) {
			end = hits[k].LBA
		}
		if end > next {
			misses = append(misses, blockRange{next, end - next})
		}
		if k < len(hits) {
			next = hits[k].LBA + 1
		}
	}
	// Backing reads: the gaps, joined across short cached runs.
	runs := misses
	if len(misses) > 1 {
		runs = nil
		cur := misses[0]
		for _, m := range misses[1:] {
			if (m.lba-(cur.lba+cur.n))*blockSize <= coalesceGap {
				cur.n = m.lba + m.n - cur.lba
				continue
			}
			runs = append(runs, cur)
			cur = m
		}
		runs = append(runs, cur)
	}
	ps := make([]piece, 0, len(runs)+len(hits))
	for _, r := range runs {
		at := int(r.lba-lba) * blockSize
		ps = append(ps, piece{dst: buf[at : at+int(r.n)*blockSize], lba: r.lba, backing: true})
	}
	// Cache reads, merging runs that are consecutive in both spaces. A run
	// inside a backing read goes to scratch and is copied over the backing
	// data once both are done.
	var scratch []byte
	type overlay struct{ dst, src []byte }
	var overlays []overlay
	covered := func(l uint64) bool {
		for _, r := range runs {
			if r.overlaps(l, 1) {
				return true
			}
		}
		return false
	}
	for i := 0; i < len(hits); {
		if !hits[i].Dirty() && covered(hits[i].LBA) {
			if fromBacking == nil {
				fromBacking = map[uint64]bool{}
			}
			fromBacking[hits[i].LBA] = true
			i++
			continue
		}
		j := i + 1
		for j < len(hits) && hits[j].LBA == hits[j-1].LBA+1 && hits[j].Block() == hits[j-1].Block()+1 &&
			covered(hits[j].LBA) == covered(hits[i].LBA) && (hits[j].Dirty() || !covered(hits[j].LBA)) {
			j++
		}
		at := int(hits[i].LBA-lba) * blockSize
		dst := buf[at : at+(j-i)*blockSize]
		if covered(hits[i].LBA) {
			if scratch == nil {
				scratch = make([]byte, 0, len(hits)*blockSize)
			}
			o := overlay{dst: dst, src: scratch[len(scratch) : len(scratch)+len(dst)]}
			scratch = scratch[:len(scratch)+len(dst)]
			overlays = append(overlays, o)
			dst = o.src
		}
		ps = append(ps, piece{dst: dst, off: s.cacheOff(hits[i].Block()), hits: hits[i:j]})
		i = j
	}
	var fbMu sync.Mutex // guards fromBacking
	do := func(p piece) error {
		if p.backing {
			v.wb.ReadStart()
			err := v.readBacking(p.dst, p.lba)
			v.wb.ReadEnd()
			if err != nil {
				return fmt.Errorf("volume %s: %w", v.name, err)
			}
			return nil
		}
		if _, err := s.dev.ReadAt(p.dst, p.off); err != nil {
			s.cacheIOError("read", err)
			backed, err := v.readAroundCache(p.dst, p.hits)
			if len(backed) > 0 {
				fbMu.Lock()
				if fromBacking == nil {
					fromBacking = map[uint64]bool{}
				}
				for _, l := range backed {
					fromBacking[l] = true
				}
				fbMu.Unlock()
			}
			return err
		}
		s.cacheIOOK()
		return nil
	}
	if err = runPieces(ps, do); err != nil {
		return nil, nil, err
	}
	for _, o := range overlays {
		copy(o.dst, o.src)
	}
	return misses, fromBacking, nil
}

// cacheContiguous reports whether hits (sorted by lba) are consecutive
// blocks both in the volume and on the cache device.
func cacheContiguous(hits []index.Ent) bool {
	for i := 1; i < len(hits); i++ {
		if hits[i].LBA != hits[i-1].LBA+1 || hits[i].Block() != hits[i-1].Block()+1 {
			return false
		}
	}
	return true
}

// runPieces runs do for every piece, at most maxReadFanout at a time, the
// calling goroutine taking its share, and returns every error joined. The
// backing pieces come first in ps, so the slowest device starts first.
func runPieces(ps []piece, do func(piece) error) error {
	if len(ps) == 1 {
		return do(ps[0])
	}
	var next atomic.Int64
	var mu sync.Mutex
	var errs []error
	work := func() {
		for {
			i := int(next.Add(1) - 1)
			if i >= len(ps) {
				return
			}
			if err := do(ps[i]); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}
	}
	var wg sync.WaitGroup
	for range min(len(ps), maxReadFanout) - 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			work()
		}()
	}
	work()
	wg.Wait()
	return errors.Join(errs...)
}

// ReadAtTier is ReadAt, and reports where the data came from: TierCache
// when every block was a cache hit, else TierBacking. The admin API's
// latency-by-tier histograms use it, so that telling a hit from a miss
// costs no second index lookup.
func (v *Volume) ReadAtTier(p []byte, off int64) (Tier, error) {
	if err := v.enter(); err != nil {
		return TierBacking, err
	}
	defer v.exit()
	if err := v.checkIO(off, int64(len(p))); err != nil {
		return TierBacking, err
	}
	if len(p) == 0 {
		return TierCache, nil
	}
	v.st.readOps.Add(1)
	v.st.readBytes.Add(uint64(len(p)))
	v.touch()
	pm := promotePolicy
	if v.seqRead(off, int64(len(p))) {
		pm = promoteSeqBypass
	}
	first, n := blockSpan(off, int64(len(p)))
	buf := p
	if off%blockSize != 0 || len(p)%blockSize != 0 {
		buf = make([]byte, n*blockSize)
	}
	hit, err := v.readBlocksHit(buf, first, n, pm)
	if err != nil {
		return TierBacking, err
	}
	if len(buf) != len(p) {
		copy(p, buf[off-int64(first)<<blockShift:])
	}
	if hit {
		return TierCache, nil
	}
	return TierBacking, nil
}

// readAroundCache fills dst with the blocks of hs (a run of cached entries
// whose cache read failed): clean ones from the backing device (which holds
// the same data), dirty ones by reading the cache once more, block by
// block; a dirty block that still cannot be read fails the read. It
// returns the LBAs read from the backing device (not to be verified against
// the cache checksum).
func (v *Volume) readAroundCache(dst []byte, hs []index.Ent) (fromBacking []uint64, err error) {
	s := v.s
	for i, e := range hs {
		p := dst[i*blockSize : (i+1)*blockSize]
		if !e.Dirty() {
			if err := v.readBacking(p, e.LBA); err != nil {
				return fromBacking, fmt.Errorf("volume %s: %w", v.name, err)
			}
			fromBacking = append(fromBacking, e.LBA)
			continue
		}
		if _, err := s.dev.ReadAt(p, s.cacheOff(e.Block())); err != nil {
			s.cacheIOError("read retry", err)
			v.st.unreachableReads.Add(1)
			s.log.Error("dirty block cannot be read from the cache device: I/O error to the client",
				"volume", v.name, "offset", int64(e.LBA)*blockSize, "err", err)
			return fromBacking, fmt.Errorf("volume %s: reading dirty block at %d: %w: %w", v.name, int64(e.LBA)*blockSize, ErrDirtyUnreachable, err)
		}
		s.cacheIOOK()
	}
	return fromBacking, nil
}

// runRead records the outcome err of reading the cached run hits (one run
// on the cache device) into buf, and on a failure reads around the cache
// (readAroundCache). It returns the LBAs then served from the backing
// device.
func (v *Volume) runRead(buf []byte, hits []index.Ent, err error) (fromBacking map[uint64]bool, _ error) {
	s := v.s
	if err == nil {
		s.cacheIOOK()
		return nil, nil
	}
	s.cacheIOError("read", err)
	backed, err := v.readAroundCache(buf, hits)
	if err != nil {
		return nil, err
	}
	if len(backed) > 0 {
		fromBacking = make(map[uint64]bool, len(backed))
		for _, l := range backed {
			fromBacking[l] = true
		}
	}
	return fromBacking, nil
}

// verifyHits checks every block of hits read from the cache into buf
// (buf's first block is lba; those in fromBacking came from the backing
// device) against its checksum (invariant 4). A mismatch is repaired from
// the mirror's other copy, else a clean block is re-read from the backing
// device and returned in drop (its cache copy is to be dropped: the caller
// does it with releaseHitsLocked, also when err is set), and a dirty one
// fails the read with a *CorruptionError.
func (v *Volume) verifyHits(buf []byte, lba uint64, hits []index.Ent, fromBacking map[uint64]bool) (drop []index.Ent, err error) {
	s := v.s
	for _, e := range hits {
		if fromBacking[e.LBA] {
			continue
		}
		at := int(e.LBA-lba) * blockSize
		p := buf[at : at+blockSize]
		got := ondisk.CRC32C(p)
		if got == e.CRC {
			continue
		}
		v.st.checksumErrors.Add(1)
		if s.mirrorRepair(p, e.Block(), e.CRC) {
			v.st.checksumRepairs.Add(1)
			continue
		}
		cerr := &CorruptionError{Err: ErrChecksum, Device: "cache", What: fmt.Sprintf("data block of %s lba %d", v.name, e.LBA),
			Offset: s.cacheOff(e.Block()), Length: blockSize, Expected: e.CRC, Actual: got, HaveSums: true}
		if e.Dirty() {
			s.log.Error("dirty cached block fails its checksum", "err", cerr)
			return drop, cerr
		}
		s.log.Warn("clean cached block fails its checksum; re-reading backing device", "err", cerr)
		if err := v.readBacking(p, e.LBA); err != nil {
			return drop, fmt.Errorf("volume %s: %w", v.name, err)
		}
		v.st.checksumRepairs.Add(1)
		drop = append(drop, e)
	}
	return drop, nil
}

// releaseHitsLocked unpins the entries a read pinned, and removes from the
// index those of drop that are still current (clean copies that failed
// their checksum).
// REQUIRES: s.mu
func (v *Volume) releaseHitsLocked(hits, drop []index.Ent) {
	s := v.s
	for _, e := range hits {
		s.unpinLocked(e.Block())
	}
	for _, e := range drop {
		if cur, ok := v.idx.Tree.Get(e); ok && cur == e {
			v.idx.Tree.Delete(e)
			s.mu.Unaccount(v.vi, e)
		}
	}
}

// A whole-block read that the cache holds in one run on the cache device
// (every 4 KiB hit) can be served without a goroutine waiting for it
// (StartReadAt): the lookup and pin run on the caller's goroutine, the
// device read is started asynchronously (device.AsyncReader), and its
// completion, on the device's reaping goroutine, verifies the checksums,
// unpins and calls the caller's done. Everything that may block (a device
// error and the read around the cache, a checksum mismatch and its repair,
// a contended set mutex) moves to a new goroutine, which finishes exactly
// as readBlocksHit does: the reaper serves every read of the device and
// must not wait, least of all for s.mu, whose holders may wait for a
// device I/O the reaper delivers. A caller with nothing else to do can
// have the same reads served on its own goroutine instead (ReadHitAt).

// maxAsyncHit is the longest read StartReadAt (and ReadHitAt) serves: its checksums are
// computed on the reaper, which delays every other completion meanwhile
// (128 KiB: about 10 µs of crc32c).
const maxAsyncHit = 128 << 10

// StartReadAt starts reading len(p) bytes at off if they are wholly cached
// in one run on the cache device, and reports whether it did. done is then
// called exactly once with what ReadAt would have returned (a nil error
// means p is filled and verified), from a goroutine other than the
// caller's; it must not block. It does not wait for anything but s.mu, and
// that only briefly. It returns false, having changed nothing
// but the blocks' recency, when the read is not such a hit (or an index
// leaf of it is not resident), is not
// block-aligned, is longer than maxAsyncHit, or the cache device cannot
// start reads asynchronously, or a detach is waiting: the caller then
// uses ReadAt. The volume
// stays entered (a detach waits) until done returns. done's later is
// device.AsyncReader's: what done gives it runs after the other
// completions of the device's batch (a completion finished off the
// device's goroutine is a batch of one).
func (v *Volume) StartReadAt(p []byte, off int64, done func(err error, later func(func()))) bool {
	s := v.s
	ar, ok := s.dev.AsyncReader()
	if !ok {
		return false
	}
	hits, ok := v.pinHit(p, off)
	if !ok {
		return false
	}
	lba := uint64(off >> blockShift)
	coff := s.cacheOff(hits[0].Block())
	finish := func(_ int, err error, later func(func())) { v.finishHit(p, lba, hits, err, later, done) }
	if !ar.StartReadAt(p, coff, finish) {
		// The device has no room for it now: read on a goroutine of its
		// own rather than unwind (the pins and counters are taken).
		go func() {
			_, err := s.dev.ReadAt(p, coff)
			device.WithLater(func(later func(func())) { finish(0, err, later) })
		}()
	}
	return true
}

// ReadHitAt reads len(p) bytes at off, waiting for the device, if
// StartReadAt would start them (but on any cache device), and reports
// whether it did; err is then what ReadAt would have returned. It returns
// false, having changed nothing but the blocks' recency, otherwise: the
// caller then uses StartReadAt or ReadAt. A caller with nothing else to do
// meanwhile (an NBD connection with one request in flight) saves the
// hand-offs between goroutines that an asynchronous read costs, and the
// cache device, idle, serves the read with one pread (device.File).
func (v *Volume) ReadHitAt(p []byte, off int64) (bool, error) {
	hits, ok := v.pinHit(p, off)
	if !ok {
		return false, nil
	}
	_, err := v.s.dev.ReadAt(p, v.s.cacheOff(hits[0].Block()))
	return true, v.endHit(p, uint64(off>>blockShift), hits, err)
}

// pinHit enters the volume and pins the blocks of a read StartReadAt or
// ReadHitAt serves (see there), counting the read, and returns them; or
// returns false having changed nothing but the blocks' recency. The caller
// ends the read with finishHit or endHit.
func (v *Volume) pinHit(p []byte, off int64) ([]index.Ent, bool) {
	s := v.s
	if len(p) == 0 || len(p) > maxAsyncHit || off%blockSize != 0 || len(p)%blockSize != 0 || s.isFailed() {
		return nil, false
	}
	// Not enter: StartReadAt must not wait, not even for a detach that
	// waits for the reads a plug (Plug) holds back.
	if !v.gate.TryRLock() {
		return nil, false // ReadAt waits for the detach
	}
	if v.gone {
		v.exit()
		return nil, false // ReadAt reports it
	}
	if v.checkIO(off, int64(len(p))) != nil {
		v.exit()
		return nil, false
	}
	lba, n := uint64(off>>blockShift), len(p)/blockSize
	hits := make([]index.Ent, 0, n)
	s.mu.Lock()
	s.mu.tick++
	// Resident leaves only: a leaf to load is read by ReadAt, without
	// s.mu (loadLeavesLocked), not on this goroutine under it.
	v.idx.Tree.AscendRangeResident(index.Ent{LBA: lba}, index.Ent{LBA: lba + uint64(n)}, func(e index.Ent) bool {
		if e.LBA != lba+uint64(len(hits)) || len(hits) > 0 && e.Block() != hits[len(hits)-1].Block()+1 {
			return false
		}
		hits = append(hits, e)
		return true
	})
	if len(hits) != n {
		// Not such a hit, or an index leaf of it is not resident
		// (ReadAt loads it, or meets a leaf that cannot be loaded and
		// fails the set over).
		s.mu.Unlock()
		v.exit()
		return nil, false
	}
	for _, e := range hits {
		a := &s.mu.alloc[int64(e.Block())/s.bpb]
		a.pins++
		a.atime = s.mu.tick // recency for eviction
	}
	s.mu.Unlock()
	v.st.readOps.Add(1)
	v.st.readBytes.Add(uint64(len(p)))
	v.touch()
	v.seqRead(off, int64(len(p))) // the stream detector sees every read
	return hits, true
}

// Plug holds back the device submission of the reads StartReadAt starts
// until Unplug (device.Plugger, when the cache device is one): a caller
// with several reads at hand starts them all, then Unplug sends them to the
// device together. Between the two the caller must not wait for one of
// them.
func (v *Volume) Plug() { v.s.dev.Plug() }

// Unplug ends a Plug.
func (v *Volume) Unplug() { v.s.dev.Unplug() }

// finishHit completes a read StartReadAt started, whose device read ended
// with readErr: it verifies and releases here when the read succeeded,
// every checksum matches and s.mu is free, else it finishes on a new
// goroutine (see above).
func (v *Volume) finishHit(p []byte, lba uint64, hits []index.Ent, readErr error, later func(func()), done func(error, func(func()))) {
	s := v.s
	ok := readErr == nil
	for i := 0; ok && i < len(hits); i++ {
		e := hits[i]
		at := int(e.LBA-lba) * blockSize
		ok = ondisk.CRC32C(p[at:at+blockSize]) == e.CRC
	}
	if !ok || !s.mu.TryLock() {
		go v.finishHitSlow(p, lba, hits, readErr, done)
		return
	}
	s.cacheIOOK()
	v.releaseHitsLocked(hits, nil)
	s.mu.Unlock()
	v.countHit(len(hits))
	v.exit()
	done(nil, later)
}

// finishHitSlow is finishHit's path for what may block (endHit).
func (v *Volume) finishHitSlow(p []byte, lba uint64, hits []index.Ent, readErr error, done func(error, func(func()))) {
	err := v.endHit(p, lba, hits, readErr)
	device.WithLater(func(later func(func())) { done(err, later) })
}

// endHit ends a read pinHit pinned, whose device read ended with readErr,
// as readBlocksHit does, and returns its outcome: after a device error it
// reads around the cache, then verifies and repairs every block read from
// the cache, unpins and leaves the volume.
func (v *Volume) endHit(p []byte, lba uint64, hits []index.Ent, readErr error) error {
	s := v.s
	fromBacking, err := v.runRead(p, hits, readErr)
	var drop []index.Ent
	if err == nil {
		drop, err = v.verifyHits(p, lba, hits, fromBacking)
	}
	s.mu.Lock()
	v.releaseHitsLocked(hits, drop)
	s.mu.Unlock()
	if err == nil {
		v.countHit(len(hits))
	}
	v.exit()
	return err
}

// countHit counts a client read of n blocks served wholly by the cache.
func (v *Volume) countHit(n int) {
	v.st.hitBytes.Add(uint64(n) * blockSize)
	v.st.readHitOps.Add(1)
}
