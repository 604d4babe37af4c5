package cache

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tiercache/tiercache/cache/internal/index"
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
		if _, err := s.dev.ReadAt(buf, s.cacheOff(hits[0].Block())); err != nil {
			s.cacheIOError("read", err)
			backed, err := v.readAroundCache(buf, hits)
			if err != nil {
				return nil, nil, err
			}
			if len(backed) > 0 {
				fromBacking = make(map[uint64]bool, len(backed))
				for _, l := range backed {
					fromBacking[l] = true
				}
			}
			return nil, fromBacking, nil
		}
		s.cacheIOOK()
		return nil, nil, nil
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
