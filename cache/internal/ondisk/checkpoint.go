package ondisk

import (
	"cmp"
	"fmt"
	"hash/crc32"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/device"
)

// A checkpoint is a full image of the index and the bucket generations,
// written to the slot gen%2. The journal of generation gen starts at the
// checkpoint's journal position; nothing of generation gen is written to the
// journal before the checkpoint is durable, so the previous checkpoint and
// its journal stay intact until then.

const (
	ckptMagic     = "TIERCCK\x01"
	ckptVersion   = 2 // the checkpoint header's own version (the set's format version is the superblock's)
	CkptHdrLen    = 64
	CkptEntrySize = 16
	ckptVolHdr    = 2 + 8 + 8
)

// CkptSlotLen is the size of a checkpoint slot that holds a full cache of
// nbuckets buckets of bpb blocks with nvols volume slots: the header block,
// the generations, the entries (16 bytes each) and the epoch section (a
// dirty live entry costs 12 more bytes, a superseded version 24 instead of
// an entry's 16, so at most 28 bytes per cache block).
func CkptSlotLen(nbuckets, bpb int64, nvols int) int64 {
	n := BlockSize + 4 + 4*nbuckets + 2 + int64(nvols)*ckptVolHdr + nbuckets*bpb*CkptEntrySize +
		4 + int64(nvols)*16 + nbuckets*bpb*CkptEpochExtra
	return (n + BlockSize - 1) / BlockSize * BlockSize
}

const (
	ckptEpochTag   = 0x48435045 // "EPCH": the epoch section follows the volumes
	CkptEpochExtra = 12         // worst-case bytes per cache block for the epoch section
)

type CkptHeader struct {
	Nonce   uint64
	Gen     uint64
	JPos    JournalPos
	BodyLen uint64
	BodyCRC uint32
}

func (h *CkptHeader) Encode() []byte {
	b := make([]byte, BlockSize)
	copy(b, ckptMagic)
	le.PutUint32(b[8:], ckptVersion)
	le.PutUint64(b[16:], h.Nonce)
	le.PutUint64(b[24:], h.Gen)
	le.PutUint64(b[32:], uint64(h.JPos.Blk))
	le.PutUint64(b[40:], h.JPos.Seq)
	le.PutUint64(b[48:], h.BodyLen)
	le.PutUint32(b[56:], h.BodyCRC)
	le.PutUint32(b[12:], CRC32C(b[:CkptHdrLen]))
	return b
}

// DecodeCkptHeader validates a checkpoint header block. ok is false for a
// slot that was never written or belongs to another set (not an error).
func DecodeCkptHeader(b []byte, off int64) (h CkptHeader, err error) {
	if len(b) < CkptHdrLen || string(b[:8]) != ckptMagic {
		return h, Corruptf("checkpoint header", off, BlockSize, "no checkpoint magic")
	}
	want := le.Uint32(b[12:])
	tmp := make([]byte, CkptHdrLen)
	copy(tmp, b)
	le.PutUint32(tmp[12:], 0)
	if got := CRC32C(tmp); got != want {
		return h, &CorruptionError{Err: ErrCorrupt, Device: "cache", What: "checkpoint header", Offset: off,
			Length: CkptHdrLen, Expected: want, Actual: got, HaveSums: true}
	}
	if v := le.Uint32(b[8:]); v != ckptVersion {
		return h, Corruptf("checkpoint header", off, BlockSize, "version %d", v)
	}
	h.Nonce = le.Uint64(b[16:])
	h.Gen = le.Uint64(b[24:])
	h.JPos.Blk = int64(le.Uint64(b[32:]))
	h.JPos.Seq = le.Uint64(b[40:])
	h.BodyLen = le.Uint64(b[48:])
	h.BodyCRC = le.Uint32(b[56:])
	return h, nil
}

// VerSnap is a snapshot of a volume's dirty versions for a checkpoint,
// beside its index tree's clone: the flush epochs of the dirty entries'
// and superseded versions' cache blocks (epochOf reads a snapshot of the
// bucket epoch tables, which are copied on write after it) and the
// superseded versions (a clone of idx.Sup; nil: none).
type VerSnap struct {
	EpochOf func(loc uint32) uint64
	Sup     *index.Stree
	Dirty   int // the live dirty entries (a capacity hint)
}

// CkptVol is one volume's part of a checkpoint.
type CkptVol struct {
	Epoch uint64
	Ents  []index.Ent
	// EpochOf[loc] is the flush epoch of the dirty entry at cache block loc.
	// One slice indexed by cache block,
	// shared by all volumes (no block is named twice), is much cheaper to
	// build and read than a map for a million dirty blocks.
	EpochOf []uint64
	Sup     []index.Ver // superseded versions (epoch order)
}

// CkptData is a decoded checkpoint body.
type CkptData struct {
	Gens []uint32
	Vols []CkptVol
}

// EncodeCkptBody streams the body to w in chunks (the index of a large
// cache is tens of MiB; it is never held twice in memory), with the epoch
// section from vers (per volume, every dirty version; nil, or a VerSnap
// without EpochOf: no epochs and no superseded versions): for each volume
// the epoch of each live dirty entry's cache block, then the superseded
// versions.
//
//	"EPCH" u32 | { n u64 | { loc u32 | epoch u64 } × n | m u64 | { lba u64 | loc u32 | crc u32 | epoch u64 } × m } per volume
func EncodeCkptBody(gens []uint32, epochs []uint64, trees []*index.Ptree, vers []VerSnap, w func([]byte) error) error {
	const chunk = 1 << 20
	e := enc{b: make([]byte, 0, 64<<10)}
	flush := func(force bool) error {
		if len(e.b) >= chunk || (force && len(e.b) > 0) {
			if err := w(e.b); err != nil {
				return err
			}
			e.b = e.b[:0]
		}
		return nil
	}
	e.u32(uint32(len(gens)))
	for _, g := range gens {
		e.u32(g)
		if err := flush(false); err != nil {
			return err
		}
	}
	e.u16(uint16(len(trees)))
	for i, t := range trees {
		e.u64(epochs[i])
		e.u64(uint64(t.Len()))
		var err error
		t.Ascend(func(x index.Ent) bool {
			e.u64(x.LBA)
			e.u32(x.Loc)
			e.u32(x.CRC)
			err = flush(false)
			return err == nil
		})
		if err != nil {
			return err
		}
	}
	e.u32(ckptEpochTag)
	type locEpoch struct {
		loc   uint32
		epoch uint64
	}
	for i := range trees {
		var vs VerSnap
		if vers != nil {
			vs = vers[i]
		}
		// The live dirty entries in LBA order (decoding does not depend on
		// the order), sized up front (a large checkpoint has millions).
		live := make([]locEpoch, 0, vs.Dirty)
		var sup []index.Ver
		if vs.EpochOf != nil {
			trees[i].Ascend(func(x index.Ent) bool {
				if x.Dirty() {
					live = append(live, locEpoch{x.Block(), vs.EpochOf(x.Block())})
				}
				return true
			})
			if vs.Sup != nil {
				vs.Sup.Ascend(func(x index.Ent) bool {
					sup = append(sup, index.Ver{Epoch: vs.EpochOf(x.Loc), LBA: x.LBA, Loc: x.Loc, CRC: x.CRC})
					return true
				})
			}
		}
		slices.SortFunc(sup, index.CmpVer) // decoding wants them by (epoch, lba)
		e.u64(uint64(len(live)))
		for _, x := range live {
			e.u32(x.loc)
			e.u64(x.epoch)
			if err := flush(false); err != nil {
				return err
			}
		}
		e.u64(uint64(len(sup)))
		for _, x := range sup {
			e.u64(x.LBA)
			e.u32(x.Loc)
			e.u32(x.CRC)
			e.u64(x.Epoch)
			if err := flush(false); err != nil {
				return err
			}
		}
	}
	return flush(true)
}

// DecodeCkptBody parses and validates a checkpoint body against the layout:
// every entry must name a cache block inside the bucket area and an LBA inside
// its volume, in strictly increasing LBA order, and no cache block may be
// named twice. It never panics.
func DecodeCkptBody(b []byte, nbuckets int64, bpb int64, volBlocks []uint64) (*CkptData, error) {
	d := dec{b: b}
	nb := int64(d.u32())
	if d.bad || nb != nbuckets {
		return nil, Badf("checkpoint body", "checkpoint has %d buckets, superblock %d", nb, nbuckets)
	}
	cd := &CkptData{Gens: make([]uint32, nb)}
	for i := range cd.Gens {
		cd.Gens[i] = d.u32()
	}
	// The volume count may differ from the superblock's: attach and detach
	// change the slot list with one superblock write, and the checkpoint
	// written before it may hold fewer slots (a volume attached since is
	// empty) or more (a detached last slot, empty when the checkpoint was
	// written). A slot the superblock does not list, or lists as free, has
	// no blocks, so any entry in it fails the range check below.
	nv := int(d.u16())
	if d.bad || nv > MaxBackings {
		return nil, Badf("checkpoint body", "checkpoint has %d volumes (at most %d)", nv, MaxBackings)
	}
	blocksOf := func(v int) uint64 {
		if v < len(volBlocks) {
			return volBlocks[v]
		}
		return 0
	}
	total := uint64(nbuckets * bpb)
	seen := index.NewBitset(int(total))
	for v := 0; v < nv; v++ {
		var cv CkptVol
		cv.Epoch = d.u64()
		n := d.u64()
		if d.bad || n > total || n*CkptEntrySize > uint64(d.remaining()) {
			return nil, Badf("checkpoint body", "volume %d: %d entries", v, n)
		}
		cv.Ents = make([]index.Ent, n)
		for i := range cv.Ents {
			x := index.Ent{LBA: d.u64(), Loc: d.u32(), CRC: d.u32()}
			if x.LBA >= blocksOf(v) || uint64(x.Block()) >= total || (i > 0 && x.LBA <= cv.Ents[i-1].LBA) || seen.Get(int(x.Block())) {
				return nil, Badf("checkpoint body", "volume %d entry %d (lba %d loc %d) out of order or out of range", v, i, x.LBA, x.Block())
			}
			seen.Set(int(x.Block()))
			cv.Ents[i] = x
		}
		cd.Vols = append(cd.Vols, cv)
	}
	if tag := d.u32(); d.bad || tag != ckptEpochTag {
		return nil, Badf("checkpoint body", "epoch section tag %#x, expected %#x", tag, ckptEpochTag)
	}
	epochOf := make([]uint64, total)
	dirtyAt := index.NewBitset(int(total)) // the dirty entries of the volume at hand
	for vi := range cd.Vols {
		cv := &cd.Vols[vi]
		nd := 0
		for _, x := range cv.Ents {
			if x.Dirty() {
				dirtyAt.Set(int(x.Block()))
				nd++
			}
		}
		n := d.u64()
		if d.bad || n > uint64(nd) || n*12 > uint64(d.remaining()) {
			return nil, Badf("checkpoint body", "volume %d: %d dirty epochs", vi, n)
		}
		cv.EpochOf = epochOf
		for range n {
			loc, ep := d.u32(), d.u64()
			if uint64(loc) >= total || !dirtyAt.Get(int(loc)) || ep > cv.Epoch {
				return nil, Badf("checkpoint body", "volume %d: epoch %d for cache block %d (not a dirty entry, or beyond the volume's epoch %d)", vi, ep, loc, cv.Epoch)
			}
			epochOf[loc] = ep
		}
		for _, x := range cv.Ents {
			dirtyAt.Clear(int(x.Block()))
		}
		m := d.u64()
		if d.bad || m > total || m*24 > uint64(d.remaining()) {
			return nil, Badf("checkpoint body", "volume %d: %d superseded versions", vi, m)
		}
		for range m {
			x := index.Ver{LBA: d.u64(), Loc: d.u32(), CRC: d.u32(), Epoch: d.u64()}
			if d.bad || x.LBA >= blocksOf(vi) || uint64(x.Loc) >= total || seen.Get(int(x.Loc)) || x.Epoch > cv.Epoch {
				return nil, Badf("checkpoint body", "volume %d: superseded version %+v out of range or owned twice", vi, x)
			}
			// In (epoch, lba) order, each older than the live dirty
			// entry of its LBA (invariant 13): (epoch, lba) names
			// one version.
			i, found := slices.BinarySearchFunc(cv.Ents, x.LBA, func(e index.Ent, lba uint64) int { return cmp.Compare(e.LBA, lba) })
			if (len(cv.Sup) > 0 && !index.VerLess(cv.Sup[len(cv.Sup)-1], x)) || !found || !cv.Ents[i].Dirty() || epochOf[cv.Ents[i].Block()] <= x.Epoch {
				return nil, Badf("checkpoint body", "volume %d: superseded version %+v out of order or not older than a dirty entry", vi, x)
			}
			seen.Set(int(x.Loc))
			cv.Sup = append(cv.Sup, x)
		}
	}
	if d.bad || d.remaining() != 0 {
		return nil, Badf("checkpoint body", "malformed checkpoint body")
	}
	return cd, nil
}

// WriteCheckpoint writes a checkpoint into slot h.Gen%2 and syncs. The
// caller has already made everything the snapshot depends on durable.
func WriteCheckpoint(dev device.Device, sb *Superblock, h CkptHeader, gens []uint32, epochs []uint64, trees []*index.Ptree, vers []VerSnap) error {
	slot := sb.CkptOff[h.Gen%2]
	off := slot + BlockSize
	crc := uint32(0)
	var n int64
	err := EncodeCkptBody(gens, epochs, trees, vers, func(p []byte) error {
		if n+int64(len(p)) > sb.CkptLen-BlockSize {
			return fmt.Errorf("%w: checkpoint larger than its slot (%d bytes)", ErrInvalid, sb.CkptLen)
		}
		if _, err := dev.WriteAt(p, off+n); err != nil {
			return fmt.Errorf("writing checkpoint at %d: %w", off+n, err)
		}
		crc = crc32.Update(crc, castagnoli, p)
		n += int64(len(p))
		return nil
	})
	if err != nil {
		return err
	}
	// Body durable before the header that vouches for it: a valid header
	// with a bad body is then corruption, not a crash.
	if err := dev.Sync(); err != nil {
		return fmt.Errorf("syncing checkpoint body: %w", err)
	}
	h.BodyLen, h.BodyCRC = uint64(n), crc
	if _, err := dev.WriteAt(h.Encode(), slot); err != nil {
		return fmt.Errorf("writing checkpoint header at %d: %w", slot, err)
	}
	if err := dev.Sync(); err != nil {
		return fmt.Errorf("syncing checkpoint: %w", err)
	}
	return nil
}

// ReadCheckpoint loads the newest valid checkpoint. A slot that fails its
// checksums is skipped (a crash while writing it is expected); it is
// corruption only if neither slot is valid.
//
// warn is checkpointFallback's warning: "" unless the other slot's header
// is invalid although it held a checkpoint once.
func ReadCheckpoint(dev device.Device, sb *Superblock, volBlocks []uint64) (h CkptHeader, cd *CkptData, warn string, err error) {
	h, body, warn, err := ReadCheckpointBody(dev, sb)
	if err != nil {
		return CkptHeader{}, nil, "", err
	}
	cd, err = DecodeCheckpoint(sb, h, body, volBlocks)
	if err != nil {
		return CkptHeader{}, nil, "", err
	}
	return h, cd, warn, nil
}

// ReadCheckpointBody reads the newest valid checkpoint header and its body
// (ReadCheckpoint's device reads; DecodeCheckpoint does the rest), and
// checkpointFallback's warning about the other slot.
func ReadCheckpointBody(dev device.Device, sb *Superblock) (CkptHeader, []byte, string, error) {
	var best *CkptHeader
	var errs [2]error
	var raw [2][]byte
	for i := 0; i < 2; i++ {
		buf := make([]byte, BlockSize)
		raw[i] = buf
		if _, err := dev.ReadAt(buf, sb.CkptOff[i]); err != nil {
			// An unreadable slot may hold the newest checkpoint: falling
			// back to the other would recover an older index and serve
			// stale data. Only a damaged (torn) header is skipped.
			return CkptHeader{}, nil, "", fmt.Errorf("reading checkpoint slot %d at %d: %w", i, sb.CkptOff[i], err)
		}
		decode := func(b []byte) (CkptHeader, error) {
			h, err := DecodeCkptHeader(b, sb.CkptOff[i])
			if err == nil && (h.Nonce != sb.Nonce() || h.Gen%2 != uint64(i)) {
				err = Corruptf("checkpoint header", sb.CkptOff[i], BlockSize, "slot %d holds generation %d of another set", i, h.Gen)
			}
			if err == nil && (h.BodyLen > uint64(sb.CkptLen-BlockSize) || h.JPos.Blk < 0 || h.JPos.Blk >= sb.JournalLen/BlockSize) {
				err = Corruptf("checkpoint header", sb.CkptOff[i], BlockSize, "body length %d, journal block %d", h.BodyLen, h.JPos.Blk)
			}
			return h, err
		}
		h, err := decode(buf)
		if err != nil && !IsZero(buf) && repair(dev, buf, sb.CkptOff[i], func(b []byte) bool { _, err := decode(b); return err == nil }) {
			h, err = decode(buf)
		}
		if err != nil {
			errs[i] = err
			continue
		}
		if best == nil || h.Gen > best.Gen {
			hh := h
			best = &hh
		}
	}
	if best == nil {
		return CkptHeader{}, nil, "", fmt.Errorf("no valid checkpoint: slot 0: %v; slot 1: %w", errs[0], errs[1])
	}
	// Only the newest is read. If its body is bad, that is reported rather
	// than silently falling back to an older generation whose journal may
	// have been overwritten: the header is written only after the body is
	// durable, so a crash cannot explain it.
	slot := sb.CkptOff[best.Gen%2]
	body := make([]byte, best.BodyLen)
	if _, err := dev.ReadAt(body, slot+BlockSize); err != nil {
		return CkptHeader{}, nil, "", fmt.Errorf("reading checkpoint body: %w", err)
	}
	if _, ok := dev.(Repairer); ok && CRC32C(body) != best.BodyCRC {
		// Damaged: the other member of a mirror may hold it intact
		// (DecodeCheckpoint reports it otherwise).
		repair(dev, body, slot+BlockSize, func(b []byte) bool { return CRC32C(b) == best.BodyCRC })
	}
	other := int((best.Gen + 1) % 2)
	return *best, body, checkpointFallback(raw[other], sb.CkptOff[other], other, errs[other], best.Gen), nil
}

// DecodeCheckpoint verifies the checksum of the body of checkpoint h and
// decodes it. It does no I/O (Open runs it beside the journal reads).
func DecodeCheckpoint(sb *Superblock, h CkptHeader, body []byte, volBlocks []uint64) (*CkptData, error) {
	slot := sb.CkptOff[h.Gen%2]
	if got := CRC32C(body); got != h.BodyCRC {
		return nil, &CorruptionError{Err: ErrCorrupt, Device: "cache", What: "checkpoint body", Offset: slot + BlockSize,
			Length: int64(h.BodyLen), Expected: h.BodyCRC, Actual: got, HaveSums: true}
	}
	cd, err := DecodeCkptBody(body, sb.NBuckets, sb.BlocksPerBucket(), volBlocks)
	if err != nil {
		return nil, Placed(err, slot+BlockSize, int64(h.BodyLen))
	}
	return cd, nil
}

// checkpointFallback describes why recovery from checkpoint generation gen
// may have passed over a newer one: the other slot's header (b, at off) is
// invalid although it held a checkpoint once (it is not the never-written
// slot of a freshly formatted set). It returns "" when there is nothing to
// say. A torn header write at a crash explains an invalid header; so does
// damage, which the journal head record then reports (JournalLossError).
func checkpointFallback(b []byte, off int64, other int, hdrErr error, gen uint64) string {
	if hdrErr == nil {
		return "" // valid and older
	}
	zero := IsZero(b)
	if zero && gen <= 1 {
		return "" // Format leaves the slot of generation 0 empty
	}
	what := fmt.Sprintf("invalid (%v)", hdrErr)
	if zero {
		what = "zeroed"
	}
	return fmt.Sprintf("the header of checkpoint slot %d at offset %d is %s (a checkpoint write torn by a crash, or damage): recovered from the older generation %d in slot %d",
		other, off, what, gen, gen%2)
}
