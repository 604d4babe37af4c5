package cache

// Scrub and check: verify every cached block's checksum, online (a served
// set) or offline (an Image rebuilt read-only from the cache device).
//
// Online, scrub pins the buckets of the blocks it reads, exactly like a
// client read, so a bucket cannot be reused under it; a mismatch is
// reported only if the entry is still the same after the read (otherwise
// the block was rewritten or evicted meanwhile and the mismatch is not
// real). A clean block that fails is dropped from the index, as a client
// read would do (the next read goes to the backing device); a dirty one is
// reported and kept (it exists nowhere else). On a mirrored set a block
// whose other copy passes is repaired from it instead (Repaired).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// scrubWindows: Scrub walks the index this many times (once per window of
// buckets).
const scrubWindows = 16

// maxReported bounds the problems listed in a report (all are counted).
const maxReported = 100

// ScrubReport is the result of a scrub.
type ScrubReport struct {
	Blocks      int64 // cached blocks verified
	DirtyBlocks int64 // of those, dirty
	Bad         int64 // blocks whose checksum did not match
	BadDirty    int64 // of those, dirty (data loss if the cache is dropped)
	ReadErrors  int64 // blocks the cache device failed to read
	// Repaired: blocks whose copy failed its checksum on one member of a
	// mirrored set and was rewritten from the other (not problems).
	Repaired      int64
	Problems      []string // the first maxReported problems
	ProblemsTotal int64
}

// OK reports whether the scrub found nothing wrong.
func (r *ScrubReport) OK() bool { return r.ProblemsTotal == 0 }

func (r *ScrubReport) problem(format string, args ...any) {
	r.ProblemsTotal++
	if len(r.Problems) < maxReported {
		r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
	}
}

// Scrub verifies the checksum of every cached block of every volume. It
// walks the cache device in block order (a sequential read of each chunk
// of it), so its speed is the device's sequential read rate whatever the
// order in which the blocks were written. progress, if set, is called with
// blocks done and the total (which may move while the set serves).
func (s *Set) Scrub(ctx context.Context, progress func(done, total int64)) (ScrubReport, error) {
	var rep ScrubReport
	s.mu.Lock()
	total := s.entries()
	nblocks := s.mu.CacheBlocks()
	s.mu.Unlock()
	const chunk = 256 // cache blocks per read (1 MiB)
	buf, bbuf := make([]byte, chunk*blockSize), make([]byte, chunk*blockSize)
	type bad struct {
		scrubItem
		got      uint32
		readFail error
	}
	// There is no reverse map: each window of buckets gets its entries from
	// one index walk (scrubWindows walks in all, each holding at most about
	// 1/scrubWindows of the entries), sorted by cache block.
	win := (nblocks/scrubWindows + chunk) / chunk * chunk // blocks per window, whole chunks
	var inWin []located
	for start := int64(0); start < nblocks; start += chunk {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		if start%win == 0 {
			lo, hi := start, start+win
			var err error
			if inWin, err = s.entriesIn(func(loc int64) bool { return loc >= lo && loc < hi }); err != nil {
				return rep, err
			}
			slices.SortFunc(inWin, func(a, b located) int { return cmp.Compare(a.e.Block(), b.e.Block()) })
		}
		end := min(start+chunk, nblocks)
		for len(inWin) > 0 && int64(inWin[0].e.Block()) < start {
			inWin = inWin[1:]
		}
		var items []scrubItem
		s.mu.Lock()
		for len(inWin) > 0 && int64(inWin[0].e.Block()) < end {
			it := inWin[0]
			inWin = inWin[1:]
			e, ok := s.vols[it.vi].idx.Tree.Get(it.e)
			if !ok || e != it.e {
				continue // changed since the walk
			}
			items = append(items, scrubItem{it.vi, e})
			s.mu.alloc[int64(e.Block())/s.bpb].pins++
		}
		s.mu.Unlock()
		if len(items) == 0 {
			continue
		}
		first := int64(items[0].e.Block())
		last := int64(items[len(items)-1].e.Block())
		run := buf[:(last-first+1)*blockSize]
		m := s.mir()
		both := m != nil && m.Redundant()
		var rerr error
		if both {
			// Reads take either copy: each member's is verified, A's
			// here and B's below.
			_, rerr = m.ReadFrom(mirror.A, run, s.cacheOff(uint32(first)))
		} else {
			_, rerr = s.dev.ReadAt(run, s.cacheOff(uint32(first)))
		}
		var bads []bad
		for _, it := range items {
			at := (int64(it.e.Block()) - first) * blockSize
			p := run[at : at+blockSize]
			if rerr != nil {
				// Find which blocks of the chunk fail, one by one.
				if _, err := s.dev.ReadAt(p, s.cacheOff(it.e.Block())); err != nil {
					bads = append(bads, bad{scrubItem: it, readFail: err})
					continue
				}
			}
			if got := ondisk.CRC32C(p); got != it.e.CRC {
				if s.mirrorRepair(p, it.e.Block(), it.e.CRC) {
					rep.Repaired++
					v := s.vols[it.vi]
					v.st.checksumErrors.Add(1)
					v.st.checksumRepairs.Add(1)
					continue
				}
				bads = append(bads, bad{scrubItem: it, got: got})
			}
		}
		if both {
			rep.Repaired += s.scrubMirrorB(bbuf, first, items)
		}
		s.mu.Lock()
		for _, it := range items {
			s.unpinLocked(it.e.Block())
		}
		for _, b := range bads {
			v := s.vols[b.vi]
			cur, ok := v.idx.Tree.Get(b.e)
			if !ok || cur != b.e {
				continue // rewritten or evicted while we read: not a finding
			}
			off := s.cacheOff(b.e.Block())
			kind := "clean"
			if b.e.Dirty() {
				kind = "dirty"
			}
			if b.readFail != nil {
				rep.ReadErrors++
				rep.problem("volume %s lba %d (%s): reading cache offset %d: %v", v.name, b.e.LBA, kind, off, b.readFail)
				continue
			}
			rep.Bad++
			cerr := &CorruptionError{Err: ErrChecksum, Device: "cache", What: fmt.Sprintf("%s data block of %s lba %d", kind, v.name, b.e.LBA),
				Offset: off, Length: blockSize, Expected: b.e.CRC, Actual: b.got, HaveSums: true}
			if b.e.Dirty() {
				rep.BadDirty++
			} else {
				// As a client read would: drop the clean copy (the next
				// read re-reads the backing device).
				v.idx.Tree.Delete(b.e)
				s.mu.Unaccount(b.vi, b.e)
				v.st.checksumRepairs.Add(1)
			}
			rep.problem("%v", cerr)
			v.st.checksumErrors.Add(1)
		}
		s.mu.Unlock()
		for _, it := range items {
			rep.Blocks++
			if it.e.Dirty() {
				rep.DirtyBlocks++
			}
		}
		if progress != nil {
			progress(rep.Blocks, max(total, rep.Blocks))
		}
	}
	if progress != nil {
		progress(rep.Blocks, rep.Blocks)
	}
	return rep, nil
}

// scrubItem is a cached block a scrub verifies: volume vi's entry e.
type scrubItem struct {
	vi int
	e  index.Ent
}

// scrubMirrorB verifies B's copies of the items (pinned, in cache block
// order from block first on, A's copies verified) that B holds, read into
// buf, and rewrites a copy that fails its checksum from the other member's
// (mirror.CheckCopies). It returns the copies rewritten.
func (s *Set) scrubMirrorB(buf []byte, first int64, items []scrubItem) int64 {
	m := s.mir()
	last := int64(items[len(items)-1].e.Block())
	run := buf[:(last-first+1)*blockSize]
	_, err := m.ReadFrom(mirror.B, run, s.cacheOff(uint32(first)))
	whole := err == nil // else block by block: B may hold part of the chunk
	var n int64
	for _, it := range items {
		off := s.cacheOff(it.e.Block())
		at := (int64(it.e.Block()) - first) * blockSize
		p := run[at : at+blockSize]
		if !whole {
			if !m.Covers(off) {
				continue
			}
			if _, err := m.ReadFrom(mirror.B, p, off); err != nil {
				continue // B failed, or A could not serve it either: its scrub reports it
			}
		}
		if ondisk.CRC32C(p) == it.e.CRC {
			continue
		}
		if _, rewrote := m.CheckCopies(p, off, func(q []byte) bool { return ondisk.CRC32C(q) == it.e.CRC }); rewrote {
			n++
			v := s.vols[it.vi]
			v.st.checksumErrors.Add(1)
			v.st.checksumRepairs.Add(1)
		}
	}
	return n
}

// CheckReport is the result of an offline check.
type CheckReport struct {
	Image    *Image
	Scrub    ScrubReport
	Problems []string // metadata problems (superblock, checkpoint, journal, index)
	// OpenErr is why the set could not be rebuilt (also in Problems), e.g.
	// a *JournalLossError; nil if it was.
	OpenErr error
	// LostWrites: the unacknowledged failovers of the lost-writes record
	// (each volume's lost writes are also in Problems).
	LostWrites []LostEvent
}

// OK reports whether the check found nothing wrong.
func (r *CheckReport) OK() bool { return len(r.Problems) == 0 && r.Scrub.OK() }

// CheckOptions: what CheckOffline reports while it runs.
type CheckOptions struct {
	// Progress sees the cached blocks verified and their total.
	Progress func(done, total int64)
	// PageProgress sees the index pages verified and their total (a set
	// formatted with index pages).
	PageProgress func(done, total int64)
}

// CheckOffline verifies a cache device that is not being served: both
// superblock copies, both checkpoint slots (with index pages: the newest
// root and every page it names, Image.VerifyPages), the journal (replayed
// into a rebuilt index, whose invariants are checked) and the checksum of
// every cached block. It writes nothing. An error is returned only when the check
// could not run at all (the device is not a cache set, or ctx ended);
// everything found is in the report.
func CheckOffline(ctx context.Context, dev device.Device, opts CheckOptions) (*CheckReport, error) {
	rep := &CheckReport{}
	im, err := OpenImage(dev, ImageOptions{})
	rep.Image = im
	if errors.Is(err, ErrNotFormatted) {
		return rep, err
	}
	for _, c := range im.Copies {
		if c.Err != nil {
			rep.Problems = append(rep.Problems, fmt.Sprintf("superblock copy %d at offset %d: %v", c.Index, c.Offset, c.Err))
		}
	}
	if im.SB != nil {
		lw, lerr := ondisk.ReadLostWrites(dev, im.SB)
		if lerr != nil {
			rep.Problems = append(rep.Problems, fmt.Sprintf("lost-writes record: %v", lerr))
		}
		rep.LostWrites = lw.Events
		for _, ev := range lw.Events {
			rep.Problems = append(rep.Problems, DescribeLostEvent(ev)...)
		}
	}
	// The slot that is not current may legitimately be empty or torn (a
	// crash while writing it), so only OpenImage's verdict on the current
	// one counts.
	if err != nil {
		rep.OpenErr = err
		rep.Problems = append(rep.Problems, err.Error())
		return rep, nil
	}
	if err := im.VerifyPages(opts.PageProgress); err != nil {
		rep.Problems = append(rep.Problems, fmt.Sprintf("index pages of root generation %d: %v", im.Generation, err))
	}
	sr, err := im.s.Scrub(ctx, opts.Progress)
	rep.Scrub = sr
	if err != nil {
		return rep, err
	}
	return rep, nil
}
