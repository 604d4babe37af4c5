// Package objstore is a device.Device on an S3-compatible object store: a
// log-structured image in a bucket, crash-consistent at every moment.
//
// Layout (package layout has the formats). Writes since the last Sync are
// kept in memory, one copy per block (an overwrite replaces it). Sync seals
// them into one immutable segment object: the blocks LBA-sorted after a
// header of extents and per-block CRC32Cs, named by its sequence number and
// the owner generation. So random small writes cost one PUT per epoch,
// never a read-modify-write of a large object. An epoch larger than
// Options.SegmentBytes is written as several parts, the last marked final.
// A map (LBA -> segment, block, CRC) in memory locates every written block;
// a checkpoint of it is stored every Options.CheckpointEvery segments and
// named by the head object, which changes only by conditional writes.
//
// Invariants:
//
//  1. The image in the bucket is at every moment the state after some
//     Sync: recovery (head -> checkpoint -> later segments in sequence
//     order, a whole epoch at a time, up to the first sequence number
//     with no segment of its owning generation) applies whole epochs only,
//     and a segment is stored before anything that makes it count.
//  2. One writer: opening for writing takes the lease object (created
//     with If-None-Match: *), then a new generation in the head (If-Match):
//     from the sequence number it starts at, only that generation's
//     segments count. A Sync is acknowledged only after its segments are
//     stored, the head's ETag is still the one this device wrote last, and
//     the lease was renewed less than its TTL ago (or is renewed then);
//     a changed head or lease fails it with ErrFenced, and the device
//     refuses further writes.
//  3. Never-written blocks read as zeroes without a request; every block
//     read from the store is checked against the CRC32C in the map (an
//     error wrapping layout.ErrCorrupt otherwise).
//
// Concurrency: ReadAt, WriteAt, Sync, Discard and WriteZeroes may be called
// from many goroutines. Syncs are serialized; writes go to memory and do
// not wait for one (a write of part of a block whose older content is in
// the store reads it first).
package objstore

import (
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/objstore/layout"
)

var _ device.Device = (*Device)(nil)
var _ device.Zeroer = (*Device)(nil)
var _ device.Discarder = (*Device)(nil)

// ErrLeaseLost: the lease is older than its TTL (the store was
// unreachable) and renewing it failed; another host may take the image.
var ErrLeaseLost = errors.New("objstore: the lease was not renewed within its TTL and cannot be renewed now")

// Defaults of Options.
const (
	DefaultSegmentBytes    = 32 << 20
	DefaultCheckpointEvery = 256
	DefaultGCThreshold     = 0.5
	DefaultGCBytes         = 8 << 20
	DefaultGCRate          = 16 << 20
)

// Options configures Open.
type Options struct {
	ReadOnly bool
	// Force takes the lease over even if its holder's is still live.
	Force bool
	// LeaseTTL; 0 means DefaultLeaseTTL.
	LeaseTTL time.Duration
	// SegmentBytes bounds the data of one segment object and the memory
	// held by writes not yet stored; 0 means DefaultSegmentBytes.
	SegmentBytes int64
	// CheckpointEvery is how many segments are written between
	// checkpoints; 0 means DefaultCheckpointEvery.
	CheckpointEvery int
	// GCThreshold: after each checkpoint, a background loop rewrites the
	// live blocks of segments less than this fraction live (at most
	// GCBytes per round, rounds until none is left) and deletes the
	// segments once a checkpoint no longer needs them; 0 means
	// DefaultGCThreshold, negative disables the loop (GC still runs a
	// round when called).
	GCThreshold float64
	// GCBytes bounds the live data one round rewrites, and so the time a
	// Sync may wait for a round's PUT; 0 means DefaultGCBytes.
	GCBytes int64
	// GCRate bounds the live data the background loop reads and rewrites,
	// in bytes per second; 0 means DefaultGCRate, negative unbounded.
	GCRate int64
	// Tries bounds the attempts of one store call (5xx, throttling and
	// network errors are retried with backoff); 0 means 10.
	Tries int
	// Timeout bounds one store call, its retries included: a store that
	// stops answering (a dead peer) fails the call after it; 0 means
	// DefaultTimeout.
	Timeout time.Duration
	// Log receives lease and fencing events; nil discards them.
	Log *slog.Logger
}

// blk is a block written since the last stored segment.
type blk struct {
	data []byte // nil when zero
}

// Device is an open image. Create one with Open.
type Device struct {
	s    *store
	loc  Location
	opts Options
	size int64
	bs   int64
	gen  uint64
	ls   *lease // nil when read-only

	// syncMu serializes segment writes, which must be stored in sequence
	// order, and head updates.
	syncMu sync.Mutex
	// REQUIRES syncMu.
	head     *layout.Head
	headETag string
	nextSeq  uint64
	epoch    uint64
	parts    int // parts of the current epoch stored (not yet final)
	// ckptFresh: the head's checkpoint is of the map as it is (no
	// segment stored since).
	ckptFresh bool

	// mu guards the map and the blocks not yet stored.
	mu struct {
		sync.Mutex
		closed   bool
		fenced   error // set once: every later write or Sync fails with it
		st       *state
		pending  map[uint64]*blk // written since the last Sync began
		flushing map[uint64]*blk // being stored by the Sync in progress
		bytes    int64           // data bytes in pending
	}

	stopRenew chan struct{}
	renewDone chan struct{}
	// Background garbage collection (nil when it does not run): kicked
	// after each checkpoint, stopped by Close.
	gcKick  chan struct{}
	gcStop  chan struct{}
	gcDone  chan struct{}
	stats   Stats
	statsMu sync.Mutex
	// ra: segment ranges fetched ahead of a sequential reader.
	ra readahead
}

// Stats counts the device's traffic to the store (since Open) and
// describes the image as this device sees it now.
type Stats struct {
	SegmentsPut   int64
	BytesPut      int64 // segment and checkpoint bytes
	BlocksWritten int64 // data blocks stored in segments
	Checkpoints   int64
	Gets          int64
	BytesGot      int64
	// Garbage collection.
	GCRuns        int64
	GCBlocks      int64 // live blocks rewritten
	GCBytesPut    int64 // bytes of the segments it wrote
	GCDeleted     int64 // segments deleted
	GCDeletedByte int64 // their bytes

	// The image now: segments the map knows and not deleted, their
	// bytes, and the bytes of the blocks the map refers to.
	Segments    int64
	StoredBytes int64
	LiveBytes   int64
	// Epoch is the newest epoch stored (0: none since the image was
	// created), of generation EpochGen, at EpochTime (zero when
	// unknown: recovered from a checkpoint alone).
	Epoch     uint64
	EpochGen  uint64
	EpochTime time.Time
	// Generation is this opener's owner generation; Fenced why the device
	// no longer writes ("" while it does).
	Generation uint64
	Fenced     string
}

// Open opens the image at loc. For writing it takes the lease and a new
// owner generation, refusing with an *OwnedError while another holder's
// lease is live (unless opts.Force).
func Open(loc Location, opts Options) (*Device, error) {
	if opts.LeaseTTL == 0 {
		opts.LeaseTTL = DefaultLeaseTTL
	}
	if opts.SegmentBytes == 0 {
		opts.SegmentBytes = DefaultSegmentBytes
	}
	if opts.CheckpointEvery == 0 {
		opts.CheckpointEvery = DefaultCheckpointEvery
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.GCThreshold == 0 {
		opts.GCThreshold = DefaultGCThreshold
	}
	if opts.GCBytes == 0 {
		opts.GCBytes = DefaultGCBytes
	}
	if opts.GCRate == 0 {
		opts.GCRate = DefaultGCRate
	}
	s, err := newStore(loc, opts.Tries)
	if err != nil {
		return nil, err
	}
	if opts.Timeout > 0 {
		s.timeout = opts.Timeout
	}
	d := &Device{s: s, loc: loc, opts: opts}
	if !opts.ReadOnly {
		if d.ls, err = acquireLease(s, opts.LeaseTTL, opts.Force); err != nil {
			if errors.Is(err, ErrOwned) {
				return nil, err
			}
			// Without the lease this server cannot know that no other
			// host has taken the image, so it does not serve at all.
			return nil, fmt.Errorf("objstore: %s: expected to take the image's lease (one writer per image), but the store did not grant it: %w; nothing was written and the cache keeps its data: start again once the store answers", loc, err)
		}
	}
	if err := d.open(); err != nil {
		if d.ls != nil {
			d.ls.release()
		}
		return nil, err
	}
	if d.ls != nil {
		d.stopRenew, d.renewDone = make(chan struct{}), make(chan struct{})
		go d.renewLoop()
		if opts.GCThreshold > 0 {
			d.gcKick, d.gcStop, d.gcDone = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
			go d.gcLoop()
		}
	}
	return d, nil
}

func (d *Device) open() error {
	h, etag, err := d.s.readHead()
	if err != nil {
		return err
	}
	if !d.opts.ReadOnly {
		// Fence first: from this write on, an older owner's Sync fails its
		// head check, so every segment it acknowledged is already stored
		// when recovery below lists them.
		h.Gen++
		h.Gens = append(h.Gens, layout.GenStart{Gen: h.Gen})
		if etag, err = d.putHead(h, etag); err != nil {
			return err
		}
	}
	st, err := recoverImage(d.s, h)
	if err != nil {
		return err
	}
	d.size, d.bs, d.gen = h.Size, int64(h.BlockSize), h.Gen
	d.head, d.headETag, d.nextSeq = h, etag, st.lastSeq+1
	d.mu.st, d.mu.pending, d.mu.flushing = st, map[uint64]*blk{}, map[uint64]*blk{}
	if d.opts.ReadOnly {
		return nil
	}
	h.Gens[len(h.Gens)-1].Start = d.nextSeq
	pruneGens(h)
	d.headETag, err = d.putHead(h, etag)
	if err == nil {
		err = d.ls.renew(d.gen)
	}
	return err
}

// pruneGens drops the generations whose ranges lie wholly at or before the
// checkpoint (replay never consults them).
func pruneGens(h *layout.Head) {
	if h.Checkpoint == nil {
		return
	}
	first := 0
	for i, g := range h.Gens {
		if g.Start != 0 && g.Start <= h.Checkpoint.Seq+1 {
			first = i
		}
	}
	h.Gens = h.Gens[first:]
}

// putHead writes h if the head's ETag is still etag, returning the new
// ETag; a changed head is ErrFenced.
func (d *Device) putHead(h *layout.Head, etag string) (string, error) {
	h.Updated = time.Now().UTC().Truncate(time.Millisecond)
	p, err := layout.EncodeHead(h)
	if err != nil {
		return "", err
	}
	n, err := d.s.put(layout.HeadName, p, putIfMatch, etag)
	if errors.Is(err, errPrecondition) {
		// Our own earlier attempt may have landed (a retried PUT whose
		// answer was lost): then the head is exactly what we wrote, or
		// an earlier head of this device's generation.
		cur, curETag, rerr := d.s.getETag(layout.HeadName)
		if rerr != nil {
			return "", rerr
		}
		if string(cur) == string(p) {
			return curETag, nil
		}
		if ch, derr := layout.DecodeHead(cur); derr == nil && d.ownsHead(ch) {
			return d.s.put(layout.HeadName, p, putIfMatch, curETag)
		}
		return "", fmt.Errorf("%s: %w", d.loc.Name(), ErrFenced)
	}
	return n, err
}

// ownsHead reports whether h was written by this device: once its first
// head write (the fence) succeeded, no other opener can write a head of
// its generation (a newer owner writes a newer one).
func (d *Device) ownsHead(h *layout.Head) bool { return d.gen != 0 && h.Gen == d.gen }

// adoptHead re-reads the head after its ETag was found changed: a head
// of this device's generation is one it wrote whose answer was lost
// (adopted, with a checkpoint to be rewritten before garbage collection
// relies on one); another means another owner. REQUIRES d.syncMu.
func (d *Device) adoptHead() (bool, error) {
	h, etag, err := d.s.readHead()
	if err != nil {
		return false, err
	}
	if !d.ownsHead(h) {
		return false, nil
	}
	d.head, d.headETag, d.ckptFresh = h, etag, false
	return true, nil
}

func (d *Device) renewLoop() {
	defer close(d.renewDone)
	t := time.NewTicker(d.opts.LeaseTTL / 3)
	defer t.Stop()
	for {
		select {
		case <-d.stopRenew:
			return
		case <-t.C:
		}
		if err := d.ls.renew(d.gen); err != nil {
			d.opts.Log.Warn("object-store lease renewal failed", "image", d.loc.Name(), "err", err)
			if errors.Is(err, errPrecondition) {
				d.fence(fmt.Errorf("%s: the lease was taken over: %w", d.loc.Name(), ErrFenced))
				return
			}
		}
	}
}

func (d *Device) fence(err error) {
	d.mu.Lock()
	if d.mu.fenced == nil {
		d.mu.fenced = err
		d.opts.Log.Error("object-store image fenced", "image", d.loc.Name(), "err", err)
	}
	d.mu.Unlock()
}

// Size is the image size.
func (d *Device) Size() int64 { return d.size }

// BlockSize is the image block size.
func (d *Device) BlockSize() int64 { return d.bs }

// Location is where the image is.
func (d *Device) Location() Location { return d.loc }

// UUID is the image's identity.
func (d *Device) UUID() string { return d.mu.st.uuid.String() }

// Generation is this opener's owner generation.
func (d *Device) Generation() uint64 { return d.gen }

// Stats returns the traffic counters.
func (d *Device) Stats() Stats {
	d.statsMu.Lock()
	st := d.stats
	d.statsMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, si := range d.mu.st.segs {
		if !si.deleted {
			st.Segments++
			st.StoredBytes += si.size
		}
	}
	st.LiveBytes = int64(len(d.mu.st.index)) * d.bs
	st.Epoch, st.EpochGen, st.EpochTime = d.mu.st.lastEpoch, d.mu.st.lastGen, d.mu.st.lastTime
	st.Generation = d.gen
	if d.mu.fenced != nil {
		st.Fenced = d.mu.fenced.Error()
	}
	return st
}

func (d *Device) ioErr(op string, off, n int64, err error) error {
	return &device.IOError{Op: op, Path: d.loc.Name(), Off: off, Len: n, Err: err}
}

// checkWritableLocked returns the error a modifying request fails with.
// REQUIRES d.mu.
func (d *Device) checkWritableLocked(op string, off, n int64) error {
	if d.mu.closed {
		return d.ioErr(op, off, n, device.ErrClosed)
	}
	if d.opts.ReadOnly {
		return d.ioErr(op, off, n, device.ErrReadOnly)
	}
	if err := device.CheckRange(off, n, d.size); err != nil {
		return device.RangeError(op, off, n, d.size)
	}
	if d.mu.fenced != nil {
		return d.ioErr(op, off, n, errors.Join(syscall.EIO, d.mu.fenced))
	}
	return nil
}

// blockLocked returns the current content of block lba (nil: zeroes),
// reading it from the store if needed. REQUIRES d.mu.
func (d *Device) blockLocked(lba uint64) ([]byte, error) {
	if b, ok := d.mu.pending[lba]; ok {
		return b.data, nil
	}
	if b, ok := d.mu.flushing[lba]; ok {
		return b.data, nil
	}
	l, ok := d.mu.st.index[lba]
	if !ok {
		return nil, nil
	}
	return d.fetch(d.mu.st.segs[l.seg], []loc{l}, false)
}

// fetch reads consecutive data blocks ls (of one segment, consecutive
// offsets) with one ranged GET, or from what readahead fetched when ahead
// is set (a client read; garbage collection reads without), and checks
// each block's CRC.
func (d *Device) fetch(si segInfo, ls []loc, ahead bool) ([]byte, error) {
	name := layout.SegName(si.ref.Seq, si.ref.Gen)
	off := si.hlen + int64(ls[0].off)*d.bs
	var p []byte
	if ahead {
		p = d.take(si, int64(ls[0].off), int64(len(ls)))
	}
	if p == nil {
		var err error
		p, err = d.s.get(name, off, int64(len(ls))*d.bs)
		d.statsMu.Lock()
		d.stats.Gets++
		d.stats.BytesGot += int64(len(p))
		d.statsMu.Unlock()
		if err != nil {
			return nil, err
		}
	}
	for i, l := range ls {
		if got := layout.CRC(p[int64(i)*d.bs : int64(i+1)*d.bs]); got != l.crc {
			return nil, &layout.CorruptError{Object: "segment " + name, Off: off + int64(i)*d.bs,
				Reason: fmt.Sprintf("block %d checksum %08x, the map says %08x", l.off, got, l.crc)}
		}
	}
	return p, nil
}

// ReadAt reads from the newest write of each block: memory, else the
// segment the map names, else zeroes.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	for try := 0; ; try++ {
		n, err := d.readAt(p, off)
		// Garbage collection may have moved a block and deleted its old
		// segment after the read looked it up: look it up again.
		if errors.Is(err, errNoObject) && try < 3 {
			continue
		}
		return n, err
	}
}

func (d *Device) readAt(p []byte, off int64) (int, error) {
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return 0, d.ioErr("read", off, int64(len(p)), device.ErrClosed)
	}
	if err := device.CheckRange(off, int64(len(p)), d.size); err != nil {
		d.mu.Unlock()
		return 0, device.RangeError("read", off, int64(len(p)), d.size)
	}
	// Plan under the lock: copy what is in memory, collect runs to fetch.
	type run struct {
		si  segInfo
		ls  []loc
		dst int64 // byte offset in the image of the run's first block
	}
	var runs []run
	for pos := off; pos < off+int64(len(p)); {
		lba := uint64(pos / d.bs)
		bstart := int64(lba) * d.bs
		lo, hi := pos-bstart, min(d.bs, off+int64(len(p))-bstart)
		dst := p[pos-off : pos-off+(hi-lo)]
		var mem *blk
		if b, ok := d.mu.pending[lba]; ok {
			mem = b
		} else if b, ok := d.mu.flushing[lba]; ok {
			mem = b
		}
		switch l, ok := d.mu.st.index[lba]; {
		case mem != nil:
			if mem.data == nil {
				clear(dst)
			} else {
				copy(dst, mem.data[lo:hi])
			}
		case ok:
			si := d.mu.st.segs[l.seg]
			if n := len(runs); n > 0 {
				r := &runs[n-1]
				last := r.ls[len(r.ls)-1]
				if r.si.ref == si.ref && last.off+1 == l.off && r.dst+int64(len(r.ls))*d.bs == bstart {
					r.ls = append(r.ls, l)
					break
				}
			}
			runs = append(runs, run{si: si, ls: []loc{l}, dst: bstart})
		default:
			clear(dst)
		}
		pos = bstart + hi
	}
	var next segInfo
	var nextFrom int64
	ahead := false
	if n := len(runs); n > 0 {
		r := runs[n-1]
		next, nextFrom, ahead = d.aheadTarget(uint64(off/d.bs), uint64((off+int64(len(p))+d.bs-1)/d.bs), r.si, int64(r.ls[len(r.ls)-1].off))
	}
	d.mu.Unlock()
	if ahead {
		d.aheadNext(next, nextFrom)
	}
	for _, r := range runs {
		q, err := d.fetch(r.si, r.ls, true)
		if err != nil {
			return 0, d.ioErr("read", off, int64(len(p)), err)
		}
		// Copy the overlap of [r.dst, r.dst+len(q)) and [off, off+len(p)).
		lo, hi := max(r.dst, off), min(r.dst+int64(len(q)), off+int64(len(p)))
		copy(p[lo-off:hi-off], q[lo-r.dst:hi-r.dst])
	}
	return len(p), nil
}

// WriteAt keeps the data in memory until the next Sync stores it.
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := d.modify("write", off, int64(len(p)), p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteZeroes records the range as zeroes (zero extents carry no data).
func (d *Device) WriteZeroes(off, n int64) error { return d.modify("write-zeroes", off, n, nil) }

// Discard is WriteZeroes: an image has no cheaper way to forget a range.
func (d *Device) Discard(off, n int64) error { return d.modify("discard", off, n, nil) }

// modify writes p (nil: zeroes) at off.
func (d *Device) modify(op string, off, n int64, p []byte) error {
	d.mu.Lock()
	if err := d.checkWritableLocked(op, off, n); err != nil {
		d.mu.Unlock()
		return err
	}
	for pos := off; pos < off+n; {
		lba := uint64(pos / d.bs)
		bstart := int64(lba) * d.bs
		lo, hi := pos-bstart, min(d.bs, off+n-bstart)
		var nb []byte
		if lo != 0 || hi != d.bs {
			cur, err := d.blockLocked(lba)
			if err != nil {
				d.mu.Unlock()
				return d.ioErr(op, off, n, err)
			}
			nb = make([]byte, d.bs)
			copy(nb, cur)
			if p == nil {
				clear(nb[lo:hi])
			} else {
				copy(nb[lo:hi], p[pos-off:])
			}
		} else if p != nil {
			nb = make([]byte, d.bs)
			copy(nb, p[pos-off:])
		}
		if nb != nil && allZero(nb) {
			nb = nil
		}
		if old, ok := d.mu.pending[lba]; ok && old.data != nil {
			d.mu.bytes -= d.bs
		}
		if nb != nil {
			d.mu.bytes += d.bs
		}
		d.mu.pending[lba] = &blk{data: nb}
		pos = bstart + hi
	}
	full := d.mu.bytes >= d.opts.SegmentBytes
	d.mu.Unlock()
	if full {
		// Bound the memory: store a non-final part of the epoch now.
		if err := d.flush(false); err != nil {
			return d.ioErr(op, off, n, err)
		}
	}
	return nil
}

func allZero(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}

// Sync stores every completed write as the final part of an epoch: after it
// returns nil, recovery from the bucket alone sees them.
func (d *Device) Sync() error { return d.flush(true) }

// KeepsUnsynced is true (device.SyncKeeper): a failed Sync puts the blocks
// it did not store back among the pending ones, and the next Sync that
// succeeds stores them.
func (d *Device) KeepsUnsynced() bool { return true }

// flush stores the pending blocks as segments; final marks the last one as
// the end of an epoch and then checks the head and lease (invariant 2).
func (d *Device) flush(final bool) error {
	d.syncMu.Lock()
	defer d.syncMu.Unlock()
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return d.ioErr("sync", 0, 0, device.ErrClosed)
	}
	if d.opts.ReadOnly {
		d.mu.Unlock()
		return nil
	}
	if d.mu.fenced != nil {
		err := d.mu.fenced
		d.mu.Unlock()
		return d.ioErr("sync", 0, 0, errors.Join(syscall.EIO, err))
	}
	if len(d.mu.pending) == 0 && (!final || d.parts == 0) {
		d.mu.Unlock()
		return nil
	}
	d.mu.flushing, d.mu.pending = d.mu.pending, map[uint64]*blk{}
	d.mu.bytes = 0
	lbas := make([]uint64, 0, len(d.mu.flushing))
	for lba := range d.mu.flushing {
		lbas = append(lbas, lba)
	}
	flushing := d.mu.flushing
	d.mu.Unlock()
	sortU64(lbas)

	err := d.storeParts(lbas, flushing, final)
	if err != nil {
		// Whatever was not stored is pending again, under newer writes.
		d.mu.Lock()
		for lba, b := range d.mu.flushing {
			if _, ok := d.mu.pending[lba]; !ok {
				d.mu.pending[lba] = b
				if b.data != nil {
					d.mu.bytes += d.bs
				}
			}
		}
		d.mu.flushing = map[uint64]*blk{}
		d.mu.Unlock()
		return d.ioErr("sync", 0, 0, err)
	}
	if !final {
		return nil
	}
	d.epoch++
	d.parts = 0
	if err := d.checkOwner(); err != nil {
		return d.ioErr("sync", 0, 0, err)
	}
	d.mu.Lock()
	due := d.mu.st.sinceCkpt >= d.opts.CheckpointEvery
	d.mu.Unlock()
	if due {
		if err := d.writeCheckpoint(); err != nil {
			// The segments are stored and count; a failed checkpoint
			// only makes the next recovery longer.
			d.opts.Log.Warn("object-store checkpoint failed", "image", d.loc.Name(), "err", err)
		} else {
			d.kickGC()
		}
	}
	return nil
}

// storeParts writes lbas (their blocks in flushing) as one or more
// segments of at most SegmentBytes of data. REQUIRES d.syncMu.
func (d *Device) storeParts(lbas []uint64, flushing map[uint64]*blk, final bool) error {
	maxBlocks := max(int(d.opts.SegmentBytes/d.bs), 1)
	maxBlocks = min(maxBlocks, layout.MaxSegmentBlocks)
	for len(lbas) > 0 || final {
		var h layout.SegmentHeader
		var data []byte
		nData, i := 0, 0
		for ; i < len(lbas) && nData < maxBlocks; i++ {
			b := flushing[lbas[i]]
			zero := b.data == nil
			if n := len(h.Extents); n > 0 {
				e := &h.Extents[n-1]
				if e.LBA+uint64(e.Count) == lbas[i] && e.Zero == zero {
					e.Count++
					goto added
				}
			}
			h.Extents = append(h.Extents, layout.Extent{LBA: lbas[i], Count: 1, Zero: zero})
		added:
			if !zero {
				data = append(data, b.data...)
				nData++
			}
		}
		part := lbas[:i]
		lbas = lbas[i:]
		h.Seq, h.Gen, h.Epoch, h.UUID = d.nextSeq, d.gen, d.epoch+1, d.mu.st.uuid
		h.BlockSize, h.Final = uint32(d.bs), final && len(lbas) == 0
		obj, err := layout.EncodeSegment(h, data)
		if err != nil {
			return err
		}
		hdr, err := layout.DecodeSegmentHeader(obj)
		if err != nil {
			return err
		}
		if _, err := d.s.put(layout.SegName(h.Seq, h.Gen), obj, putAny, ""); err != nil {
			return err
		}
		d.ckptFresh = false
		d.statsMu.Lock()
		d.stats.SegmentsPut++
		d.stats.BytesPut += int64(len(obj))
		d.stats.BlocksWritten += int64(nData)
		d.statsMu.Unlock()
		d.nextSeq++
		d.mu.Lock()
		si := d.mu.st.addSeg(layout.SegRef{Seq: hdr.Seq, Gen: hdr.Gen}, &hdr)
		di := 0
		for _, lba := range part {
			b := flushing[lba]
			if b.data == nil {
				d.mu.st.set(lba, loc{}, true)
			} else {
				d.mu.st.set(lba, loc{seg: si, off: uint32(di), crc: hdr.CRCs[di]}, false)
				di++
			}
			delete(d.mu.flushing, lba)
		}
		d.mu.st.sinceCkpt++
		if h.Final {
			d.mu.st.lastSeq, d.mu.st.lastEpoch, d.mu.st.lastGen = h.Seq, h.Epoch, h.Gen
			d.mu.st.lastTime = time.Now()
		}
		d.mu.Unlock()
		if h.Final {
			return nil
		}
		d.parts++
	}
	return nil
}

// checkOwner is the acknowledgement check of invariant 2. REQUIRES d.syncMu.
//
// The head's ETag is what makes an acknowledgement safe: a new owner
// fences the head before it recovers, so a segment stored before this
// check saw the old head is in its recovery. A lease older than its TTL
// (the store was unreachable) is renewed here first: if nobody took it
// meanwhile the renewal succeeds and the device goes on; if someone did,
// the device is fenced.
func (d *Device) checkOwner() error {
	if !d.ls.valid() {
		if err := d.ls.renew(d.gen); err != nil {
			if errors.Is(err, errPrecondition) {
				err := fmt.Errorf("%s: the lease was taken over: %w", d.loc.Name(), ErrFenced)
				d.fence(err)
				return err
			}
			return fmt.Errorf("%s: %w: %v", d.loc.Name(), ErrLeaseLost, err)
		}
	}
	etag, _, _, err := d.s.stat(layout.HeadName)
	if err != nil {
		return err
	}
	if etag != d.headETag {
		own, err := d.adoptHead()
		if err != nil {
			return err
		}
		if !own {
			err := fmt.Errorf("%s: %w", d.loc.Name(), ErrFenced)
			d.fence(err)
			return err
		}
	}
	return nil
}

// writeCheckpoint stores the map and points the head at it. REQUIRES d.syncMu.
func (d *Device) writeCheckpoint() error {
	d.mu.Lock()
	ck := d.mu.st.checkpoint(d.gen)
	d.mu.Unlock()
	p, err := layout.EncodeCheckpoint(ck)
	if err != nil {
		return err
	}
	if _, err := d.s.put(layout.CkptName(ck.Seq, ck.Gen), p, putAny, ""); err != nil {
		return err
	}
	d.statsMu.Lock()
	d.stats.Checkpoints++
	d.stats.BytesPut += int64(len(p))
	d.statsMu.Unlock()
	h := *d.head
	h.Gens = append([]layout.GenStart(nil), d.head.Gens...)
	old := h.Checkpoint
	h.Checkpoint = &layout.SegRef{Seq: ck.Seq, Gen: ck.Gen}
	pruneGens(&h)
	etag, err := d.putHead(&h, d.headETag)
	if err != nil {
		if errors.Is(err, ErrFenced) {
			d.fence(err)
		}
		return err
	}
	d.head, d.headETag = &h, etag
	d.ckptFresh = true
	d.mu.Lock()
	d.mu.st.sinceCkpt = 0
	d.mu.Unlock()
	if old != nil {
		// The head no longer names it.
		d.s.remove(layout.CkptName(old.Seq, old.Gen))
	}
	return nil
}

// Close releases the lease. It does not Sync: writes since the last Sync
// are dropped, as a crash would.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return nil
	}
	d.mu.closed = true
	d.mu.Unlock()
	if d.ls == nil {
		return nil
	}
	close(d.stopRenew)
	<-d.renewDone
	if d.gcStop != nil {
		close(d.gcStop)
		<-d.gcDone
	}
	d.syncMu.Lock()
	defer d.syncMu.Unlock()
	return d.ls.release()
}

func sortU64(s []uint64) { sort.Slice(s, func(i, j int) bool { return s[i] < s[j] }) }
func sortU32(s []uint32) { sort.Slice(s, func(i, j int) bool { return s[i] < s[j] }) }
