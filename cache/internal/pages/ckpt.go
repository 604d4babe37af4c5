package pages

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// A set's checkpoint as index pages (ondisk.FeaturePagedIndex): the two
// checkpoint slots together are one page area, root slots 0 and 1, then
// the pages. Volume slot v's live entries are tree v, its superseded
// versions tree v|SupTree; the bucket table holds the bucket generations
// and each bucket's live and dirty counts. This file holds the set's
// layout of the area, the root's payload and reading a root back as the
// checkpoint it stands for; the engine (package cache, pagedckpt.go)
// writes checkpoints through the Store.

// OpenCachePages is the page cache of a set's store: the leaves a
// checkpoint changes are read through it (a leaf changed since the last
// checkpoint is held by its tree until written).
const OpenCachePages = 256

// MaxVolumes bounds the volume slots of a paged set: a root names two
// trees a slot and carries each slot's flush epoch in one 4 KiB block.
const MaxVolumes = 40

// MaxBucketBlocks bounds the blocks of a paged set's bucket: the bucket
// table counts a bucket's live and dirty blocks in 16 bits.
const MaxBucketBlocks = 1<<16 - 1

// SetLayout is the page area of a paged set: both checkpoint slots.
func SetLayout(sb *ondisk.Superblock) Layout {
	return Layout{Off: sb.CkptOff[0], Pages: uint32(2*sb.CkptLen/PageSize - 2), Nonce: sb.Nonce()}
}

// SlotLen is the checkpoint slot length of a paged set of nbuckets
// buckets of bpb blocks: half its page area (AreaPages), at least an
// ordinary slot's.
func SlotLen(nbuckets, bpb int64) int64 {
	area := (2 + AreaPages(nbuckets*bpb, nbuckets, 2*MaxVolumes)) * PageSize
	half := (area/2 + ondisk.BlockSize - 1) / ondisk.BlockSize * ondisk.BlockSize
	return max(half, ondisk.CkptSlotLen(nbuckets, bpb, ondisk.MaxBackings))
}

// FormatSet writes the first root (generation 1: no entries, the journal
// from block 0) of a paged set of nvols volume slots.
func FormatSet(dev device.Device, sb *ondisk.Superblock, nvols int) error {
	return Format(dev, SetLayout(sb), EncodePayload(0, make([]uint64, nvols), make([]int64, nvols)))
}

// The root's payload: the journal block the generation starts at, each
// volume slot's flush epoch, the flags (always Flags: a payload with
// other flags is corruption), then each volume slot's count of dirty live
// entries.
//
//	jblk u64 | nvols u16 | epoch u64 × nvols | flags u64 | dirty u64 × nvols
const (
	// FlagCounts: the bucket table's live and dirty counts are the
	// root's trees' (each bucket's entries and superseded versions, and
	// the dirty ones among them).
	FlagCounts = 1 << 0
	// FlagVolDirty: the payload ends with the dirty live entries of each
	// volume slot's tree, which an Open that loads leaves lazily takes
	// instead of counting them.
	FlagVolDirty = 1 << 1
	Flags        = FlagCounts | FlagVolDirty
)

// EncodePayload encodes a payload: dirty has one count a volume slot.
func EncodePayload(jblk int64, epochs []uint64, dirty []int64) []byte {
	b := make([]byte, 18+16*len(epochs))
	binary.LittleEndian.PutUint64(b, uint64(jblk))
	binary.LittleEndian.PutUint16(b[8:], uint16(len(epochs)))
	for i, e := range epochs {
		binary.LittleEndian.PutUint64(b[10+8*i:], e)
	}
	binary.LittleEndian.PutUint64(b[10+8*len(epochs):], Flags)
	for i := range epochs {
		binary.LittleEndian.PutUint64(b[18+8*len(epochs)+8*i:], uint64(dirty[i]))
	}
	return b
}

// decodeDirty returns the volume slots' dirty counts of a payload
// DecodePayload accepted.
func decodeDirty(b []byte, nvols int) []int64 {
	d := make([]int64, nvols)
	for i := range d {
		d[i] = int64(binary.LittleEndian.Uint64(b[18+8*nvols+8*i:]))
	}
	return d
}

func DecodePayload(b []byte, sb *ondisk.Superblock) (jblk int64, epochs []uint64, flags uint64, err error) {
	bad := func(format string, args ...any) (int64, []uint64, uint64, error) {
		return 0, nil, 0, ondisk.Corruptf("index root payload", sb.CkptOff[0], 2*PageSize, format, args...)
	}
	if len(b) < 10 {
		return bad("%d bytes", len(b))
	}
	j := binary.LittleEndian.Uint64(b)
	n := int(binary.LittleEndian.Uint16(b[8:]))
	if j >= uint64(sb.JournalLen/ondisk.BlockSize) || n > MaxVolumes || len(b) != 18+16*n {
		return bad("journal block %d, %d volume slots in %d bytes", j, n, len(b))
	}
	epochs = make([]uint64, n)
	for i := range epochs {
		epochs[i] = binary.LittleEndian.Uint64(b[10+8*i:])
	}
	if flags = binary.LittleEndian.Uint64(b[10+8*n:]); flags != Flags {
		return bad("flags %#x, want %#x", flags, Flags)
	}
	return int64(j), epochs, flags, nil
}

// SetRoot is what a paged Open reads first: the newest valid root, its
// inner pages and bucket table (Open), and its payload.
type SetRoot struct {
	Store  *Store
	Hdr    ondisk.CkptHeader
	Epochs []uint64 // each volume slot's flush epoch
	Dirty  []int64  // each volume slot's dirty live entries
	Flags  uint64
	Table  *Table
	Warn   string // the other root is not intact
}

// OpenSet opens the page area of a paged set at its newest valid root.
// Damage is a corruption error (ondisk.IsCorruption), never a panic.
func OpenSet(dev device.Device, sb *ondisk.Superblock) (*SetRoot, error) {
	st, payload, err := Open(dev, SetLayout(sb), OpenCachePages)
	if err != nil {
		return nil, err
	}
	jblk, epochs, flags, err := DecodePayload(payload, sb)
	if err != nil {
		return nil, err
	}
	tab, err := st.Table(int(sb.NBuckets))
	if err != nil {
		return nil, ondisk.Corruptf("index root", sb.CkptOff[0], 2*PageSize, "%v", err)
	}
	for _, id := range st.TreeIDs() {
		if vi := int(id &^ SupTree); vi >= len(epochs) {
			return nil, ondisk.Corruptf("index root", sb.CkptOff[0], 2*PageSize, "tree %#x beyond the root's %d volume slots", id, len(epochs))
		}
	}
	pr := &SetRoot{Store: st, Epochs: epochs, Dirty: decodeDirty(payload, len(epochs)), Flags: flags, Table: tab,
		Hdr: ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: st.Gen(), JPos: ondisk.JournalPos{Blk: jblk}}}
	if _, perr := st.Previous(); perr != nil {
		pr.Warn = fmt.Sprintf("the other index root is not intact (%v): recovered from root generation %d", perr, st.Gen())
	}
	return pr, nil
}

// ReadCheckpoint reads the leaves of the root pr as the checkpoint they
// stand for: in page order with few large reads (Tree.ReadLeaves),
// decoded straight into the checkpoint's entries, which pass the checks a
// checkpoint slot's body passes (checkData), and each volume slot's tree
// of superseded versions. With supOnly it reads only the trees of
// superseded versions (a lazy Open: package cache, lazyleaves.go), and
// the checks that need every entry are left to the leaves' loads and to
// the engine's check.
func (pr *SetRoot) ReadCheckpoint(sb *ondisk.Superblock, volBlocks []uint64, supOnly bool) (*ondisk.CkptData, []*index.Stree, error) {
	fail := func(err error) (*ondisk.CkptData, []*index.Stree, error) { return nil, nil, err }
	st, tab, epochs := pr.Store, pr.Table, pr.Epochs
	nv := len(epochs)
	total := uint32(sb.NBuckets * sb.BlocksPerBucket())
	cd := &ondisk.CkptData{Gens: make([]uint32, sb.NBuckets), Vols: make([]ondisk.CkptVol, nv)}
	for i := range cd.Gens {
		cd.Gens[i] = tab.Get(i).Gen
	}
	var epochOf []uint64
	if !supOnly {
		epochOf = make([]uint64, total)
	}
	sups := make([]*index.Stree, nv)
	for vi := range cd.Vols {
		cd.Vols[vi].Epoch, cd.Vols[vi].EpochOf = epochs[vi], epochOf
	}
	for _, id := range st.TreeIDs() {
		vi := int(id &^ SupTree)
		sup := id&SupTree != 0
		if supOnly && !sup {
			continue
		}
		t := st.Tree(id)
		leaves := make([][]index.Ent, t.Leaves())
		var eps [][]uint64 // superseded versions' epochs, by leaf
		if sup {
			eps = make([][]uint64, len(leaves))
		}
		err := t.ReadLeaves(func(i int, pg *Page) error {
			es := make([]index.Ent, pg.Count())
			for j := range es {
				sl := pg.Slot(j)
				b := sl.Loc &^ index.DirtyBit
				if b >= total || sl.BGen != 0 || (sup && sl.Loc&index.DirtyBit == 0) || (sl.Loc&index.DirtyBit == 0 && sl.Epoch != 0) {
					return ondisk.Corruptf("index page", -1, PageSize, "tree %#x: slot %+v names cache block %d of %d, a bucket generation, or an epoch for a clean block", id, sl, b, total)
				}
				es[j] = index.Ent{LBA: sl.LBA, Loc: sl.Loc, CRC: sl.CRC}
				if sup {
					es[j].Loc = b
					if j == 0 {
						eps[i] = make([]uint64, len(es))
					}
					eps[i][j] = sl.Epoch
				} else if sl.Loc&index.DirtyBit != 0 {
					epochOf[b] = sl.Epoch
				}
			}
			leaves[i] = es
			return nil
		})
		if err != nil {
			return fail(err)
		}
		n := 0
		for _, l := range leaves {
			n += len(l)
		}
		if n != t.Len() {
			return fail(ondisk.Corruptf("index root", sb.CkptOff[0], 2*PageSize, "tree %#x: the root says %d slots, its leaves hold %d", id, t.Len(), n))
		}
		ents := make([]index.Ent, 0, n)
		for i, l := range leaves {
			ents = append(ents, l...)
			leaves[i] = nil
		}
		cv := &cd.Vols[vi]
		if !sup {
			cv.Ents = ents
			continue
		}
		sp := index.NewStree()
		var vers []index.Ver
		k := 0
		for _, ep := range eps {
			for _, e := range ep {
				x := ents[k]
				vers = append(vers, index.Ver{Epoch: e, LBA: x.LBA, Loc: x.Loc, CRC: x.CRC})
				sp.ReplaceOrInsert(x)
				k++
			}
		}
		slices.SortFunc(vers, index.CmpVer)
		cv.Sup = vers
		sups[vi] = sp
	}
	if supOnly {
		return cd, sups, nil
	}
	if err := checkData(cd, sb, volBlocks); err != nil {
		return fail(ondisk.Placed(err, sb.CkptOff[0], 2*sb.CkptLen))
	}
	if err := CountsOf(cd, sb.BlocksPerBucket(), tab); err != nil {
		return fail(err)
	}
	return cd, sups, nil
}

// CountsOf counts each bucket's live blocks (entries and superseded
// versions) and dirty ones in cd: a bucket table that says otherwise is
// corruption.
func CountsOf(cd *ondisk.CkptData, bpb int64, tab *Table) error {
	live := make([]uint16, tab.Len())
	dirty := make([]uint16, tab.Len())
	for _, cv := range cd.Vols {
		for _, e := range cv.Ents {
			b := int64(e.Block()) / bpb
			live[b]++
			if e.Dirty() {
				dirty[b]++
			}
		}
		for _, x := range cv.Sup {
			b := int64(x.Loc) / bpb
			live[b]++
			dirty[b]++
		}
	}
	for i := range live {
		r := tab.Get(i)
		if r.Live != live[i] || r.Dirty != dirty[i] {
			return ondisk.Corruptf("index page", -1, PageSize, "bucket table: bucket %d counts %d live and %d dirty blocks, the trees name %d and %d", i, r.Live, r.Dirty, live[i], dirty[i])
		}
	}
	return nil
}

// checkData checks the checkpoint read from pages as
// ondisk.DecodeCkptBody checks a checkpoint slot's body: every entry of
// a volume slot the superblock lists, in strictly increasing LBA order,
// naming a cache block of the set that nothing else names; a dirty
// entry's epoch at most its volume's; superseded versions in (epoch, lba)
// order, each of a block nothing else names and older than the dirty
// live entry of its LBA (invariant 13).
func checkData(cd *ondisk.CkptData, sb *ondisk.Superblock, volBlocks []uint64) error {
	total := uint64(sb.NBuckets * sb.BlocksPerBucket())
	seen := index.NewBitset(int(total))
	blocksOf := func(v int) uint64 {
		if v < len(volBlocks) {
			return volBlocks[v]
		}
		return 0
	}
	for vi := range cd.Vols {
		cv := &cd.Vols[vi]
		for i, x := range cv.Ents {
			if x.LBA >= blocksOf(vi) || uint64(x.Block()) >= total || (i > 0 && x.LBA <= cv.Ents[i-1].LBA) || seen.Get(int(x.Block())) {
				return ondisk.Badf("index pages", "volume %d entry %d (lba %d loc %d) out of order or out of range", vi, i, x.LBA, x.Block())
			}
			if x.Dirty() && cv.EpochOf[x.Block()] > cv.Epoch {
				return ondisk.Badf("index pages", "volume %d: epoch %d for cache block %d beyond the volume's epoch %d", vi, cv.EpochOf[x.Block()], x.Block(), cv.Epoch)
			}
			seen.Set(int(x.Block()))
		}
	}
	for vi := range cd.Vols {
		cv := &cd.Vols[vi]
		for i, x := range cv.Sup {
			if x.LBA >= blocksOf(vi) || uint64(x.Loc) >= total || seen.Get(int(x.Loc)) || x.Epoch > cv.Epoch {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v out of range or owned twice", vi, x)
			}
			j, found := slices.BinarySearchFunc(cv.Ents, x.LBA, func(e index.Ent, lba uint64) int { return cmp.Compare(e.LBA, lba) })
			if (i > 0 && !index.VerLess(cv.Sup[i-1], x)) || !found || !cv.Ents[j].Dirty() || cv.EpochOf[cv.Ents[j].Block()] <= x.Epoch {
				return ondisk.Badf("index pages", "volume %d: superseded version %+v out of order or not older than a dirty entry", vi, x)
			}
			seen.Set(int(x.Loc))
		}
	}
	return nil
}

// ReadSetRootSlots reads both root slots of a paged set for inspection,
// as ondisk.ReadCheckpointSlots reads a set's checkpoint slots: each
// slot's generation, journal block and trees, or why it is not valid.
func ReadSetRootSlots(dev device.Device, sb *ondisk.Superblock) [2]ondisk.CheckpointSlot {
	var out [2]ondisk.CheckpointSlot
	lay := SetLayout(sb)
	rs, err := ReadRoots(dev, lay)
	for i := range out {
		out[i] = ondisk.CheckpointSlot{Index: i, Offset: lay.Off + int64(i)*PageSize, IndexRoot: true}
		if err != nil {
			out[i].Err = err
			continue
		}
		r := rs[i]
		if r.Err == nil {
			out[i].JournalBlock, _, _, r.Err = DecodePayload(r.Root.Payload, sb)
		}
		if r.Err != nil {
			out[i].Err = r.Err
			continue
		}
		out[i].Generation = r.Root.Gen
		for _, t := range r.Root.Trees {
			if t.ID != TableTree {
				out[i].Trees++
			}
		}
	}
	return out
}

// Summary describes the page area of a set formatted with index pages
// (ondisk.FeaturePagedIndex) as the store's root names it (inspection).
type Summary struct {
	AreaPages  uint32 // pages in the area, after the two root slots
	Generation uint64 // the newest valid root's
	Trees      int    // trees it names: a volume slot's entries, its superseded versions
	Inner      int64  // inner pages of the trees
	Leaves     int64  // leaf pages
	Table      int64  // bucket table pages and their directory
	Slots      int64  // leaf slots: entries and superseded versions
	// Kept: pages only the root before it names (kept until the next
	// root is durable); Free: the others.
	Kept, Free int64
	// Previous is the generation of the root in the other slot, 0 if there
	// is none intact (PreviousErr says why; nil: never written).
	Previous    uint64
	PreviousErr error
}

// Pages returns the pages the newest root names.
func (ip *Summary) Pages() int64 { return ip.Inner + ip.Leaves + ip.Table }

// Summary counts what the store's root names, from the resident inner
// nodes and the allocation (no reads).
func (st *Store) Summary() *Summary {
	c := st.Counts()
	a := st.Alloc()
	ip := &Summary{AreaPages: a.Pages(), Generation: st.Gen(), Trees: c.Trees, Inner: c.Inner, Leaves: c.Leaves,
		Table: c.Table, Slots: c.Slots, Kept: int64(a.Kept())}
	ip.Free = int64(a.Pages()) - int64(a.Used())
	ip.Previous, ip.PreviousErr = st.Previous()
	return ip
}
