package ondisk

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
)

func testSuperblock() *Superblock {
	bs := int64(16 << 10)
	sb := &Superblock{Version: FormatVersion, Seq: 7, BlockSize: BlockSize, BucketSize: bs, NBuckets: 8,
		JournalOff: 2 * SBCopySize, JournalLen: MinJournalLen,
		Backings: []BackingInfo{{Name: "a", ID: "uuid-a", Size: 1 << 20, Settings: Settings{Mode: Writeback}, Path: "/dev/disk/by-id/a"}, {Name: "b", Size: 5<<20 + 512, Settings: Settings{Mode: None}}}}
	sb.SetUUID[3] = 9
	sb.CkptOff[0] = sb.JournalOff + sb.JournalLen
	sb.CkptLen = CkptSlotLen(8, bs/BlockSize, 2)
	sb.CkptOff[1] = sb.CkptOff[0] + sb.CkptLen
	sb.BucketsOff = (sb.CkptOff[1] + sb.CkptLen + bs - 1) / bs * bs
	return sb
}

// encodeDecode encodes sb and decodes the result.
func encodeDecode(t *testing.T, sb *Superblock) ([]byte, *Superblock) {
	t.Helper()
	b, err := sb.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeSuperblock(b, 0)
	if err != nil {
		t.Fatal(err)
	}
	return b, got
}

func TestSuperblockRoundTrip(t *testing.T) {
	b, got := encodeDecode(t, testSuperblock())
	b2, _ := got.Encode()
	if string(b) != string(b2) {
		t.Fatal("round trip changed the encoding")
	}
	// Every single-bit flip is detected.
	for i := 0; i < len(b); i += 7 {
		c := append([]byte(nil), b...)
		c[i] ^= 0x10
		if _, err := DecodeSuperblock(c, 0); err == nil {
			t.Fatalf("flip at byte %d not detected", i)
		}
	}
}

func TestSuperblockTooLarge(t *testing.T) {
	sb := testSuperblock()
	long := string(make([]byte, MaxPathLen))
	for i := 0; i < 20; i++ {
		sb.Backings = append(sb.Backings, BackingInfo{Name: fmt.Sprint("b", i), Size: 1 << 20, Path: long})
	}
	if _, err := sb.Encode(); !errors.Is(err, ErrInvalid) {
		t.Fatalf("oversized superblock: %v", err)
	}
}

func TestParseMode(t *testing.T) {
	for m := Writeback; m <= None; m++ {
		got, err := ParseMode(m.String())
		if err != nil || got != m {
			t.Errorf("%v: %v %v", m, got, err)
		}
	}
	if _, err := ParseMode("sometimes"); !errors.Is(err, ErrInvalid) {
		t.Errorf("bad mode: %v", err)
	}
}

// TestSuperblockFreeSlots: a free slot (left by Detach) round-trips; a free
// slot that carries anything, or comes last, is corruption.
func TestSuperblockFreeSlots(t *testing.T) {
	sb := testSuperblock()
	sb.Backings = append([]BackingInfo{{}}, sb.Backings...)
	sb.CkptLen = CkptSlotLen(8, sb.BlocksPerBucket(), 3)
	sb.CkptOff[1] = sb.CkptOff[0] + sb.CkptLen
	sb.BucketsOff = (sb.CkptOff[1] + sb.CkptLen + sb.BucketSize - 1) / sb.BucketSize * sb.BucketSize
	_, got := encodeDecode(t, sb)
	if !got.Backings[0].Free() || got.Backings[1].Name != "a" || got.LiveBackings() != 2 {
		t.Fatalf("decoded %+v", got.Backings)
	}
	for name, mut := range map[string]func(*Superblock){
		"free slot with a size": func(s *Superblock) { s.Backings[0].Size = 4096 },
		"free slot with an id":  func(s *Superblock) { s.Backings[0].ID = "x" },
		"free slot last":        func(s *Superblock) { s.Backings = append(s.Backings, BackingInfo{}) },
	} {
		c := sb.Clone()
		mut(c)
		if err := c.Validate(-1); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: validate = %v, want corruption", name, err)
		}
	}
	// No backing device at all is a valid (empty) set.
	e := sb.Clone()
	e.Backings = nil
	if err := e.Validate(-1); err != nil {
		t.Errorf("empty set: %v", err)
	}
}

func sampleRecs() []*Rec {
	return []*Rec{
		{Type: RecInsert, Vol: 1, LBA: 77, Loc: 12, Gen: 3, Dirty: true, Epoch: 9, CRCs: []uint32{1, 2, 3}},
		{Type: RecClean, Vol: 0, LBA: 5, Loc: 6},
		{Type: RecInvalidate, Vol: 1, LBA: 100, N: 1000},
		{Type: RecReuse, Bucket: 2, Gen: 4},
		{Type: RecInsert, Vol: 0, LBA: 1, Loc: 8, Gen: 0, CRCs: []uint32{0xdeadbeef}},
		{Type: RecMark, Vol: 1, Region: 3},
		{Type: RecUnmark, Vol: 0, Region: 1 << 40},
	}
}

// TestSuperblockFeatures: features round-trip in the features section,
// which every superblock has; unknown feature bits and flags, a region
// too large and a superblock without the section are refused as
// corruption; another version (2: a pre-release build's, 4) is refused
// with a FormatVersionError that names both versions.
func TestSuperblockFeatures(t *testing.T) {
	sb := testSuperblock()
	b, got := encodeDecode(t, sb)
	if v := le.Uint32(b[8:]); v != FormatVersion || got.Features != 0 || got.CleanUntrusted {
		t.Fatalf("no features: version %d, features %#x, untrusted %t", v, got.Features, got.CleanUntrusted)
	}
	for _, untrusted := range []bool{false, true} {
		sb.CacheID = "cache-1"
		sb.Features, sb.CleanUntrusted, sb.MarkShift = FeatureWarmClean, untrusted, DefaultMarkShift
		b, got = encodeDecode(t, sb)
		if v := le.Uint32(b[8:]); v != FormatVersion || got.Features != FeatureWarmClean || got.CleanUntrusted != untrusted || got.MarkShift != DefaultMarkShift ||
			!got.HasFeature(FeatureWarmClean) || got.CacheID != "cache-1" {
			t.Fatalf("features: version %d, %+v", v, got)
		}
	}
	// forge re-encodes b with the version and the features section's
	// words changed, and a valid checksum.
	forge := func(version uint32, features, flags uint64, shift uint8) []byte {
		c := append([]byte(nil), b...)
		le.PutUint32(c[8:], version)
		le.PutUint64(c[len(c)-17:], features)
		le.PutUint64(c[len(c)-9:], flags)
		c[len(c)-1] = shift
		le.PutUint32(c[16:], 0)
		le.PutUint32(c[16:], CRC32C(c))
		return c
	}
	if _, err := DecodeSuperblock(forge(FormatVersion, FeatureWarmClean, 1, 5), 0); err != nil {
		t.Fatalf("forge: %v", err)
	}
	for what, c := range map[string][]byte{
		"unknown feature":  forge(FormatVersion, FeatureWarmClean|1<<7, 0, 18),
		"unknown flag":     forge(FormatVersion, FeatureWarmClean, 1<<5, 18),
		"region too large": forge(FormatVersion, FeatureWarmClean, 0, MaxMarkShift+1),
	} {
		if _, err := DecodeSuperblock(c, 0); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: %v, want a corruption error", what, err)
		}
	}
	for _, v := range []uint32{2, 3, 5} {
		_, err := DecodeSuperblock(forge(v, FeatureWarmClean, 0, 18), 0)
		var ve *FormatVersionError
		if !errors.As(err, &ve) || ve.Found != v || errors.Is(err, ErrCorrupt) ||
			!strings.Contains(err.Error(), fmt.Sprintf("version %d, this build reads only version %d", v, FormatVersion)) {
			t.Errorf("version %d: %v, want a FormatVersionError", v, err)
		}
	}
	sb.Features = 1 << 9
	if _, err := sb.Encode(); !errors.Is(err, ErrInvalid) {
		t.Fatalf("unknown feature encoded: %v", err)
	}
	// A superblock without its features section (cut off, checksum fixed).
	sb.Features, sb.CleanUntrusted = 0, false
	c, _ := sb.Encode()
	c = c[:len(c)-(4+8+8+1)]
	le.PutUint32(c[12:], uint32(len(c)-SBHeaderSize))
	le.PutUint32(c[16:], 0)
	le.PutUint32(c[16:], CRC32C(c))
	if _, err := DecodeSuperblock(c, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("no features section: %v", err)
	}
}

func TestJournalBlockRoundTrip(t *testing.T) {
	var stream []byte
	for _, r := range sampleRecs() {
		stream = AppendRec(stream, r)
	}
	blocks := PackRecords(stream)
	if len(blocks) != 1 {
		t.Fatalf("%d blocks", len(blocks))
	}
	b := EncodeJournalBlock(BlockHeader{Nonce: 5, Gen: 2, Seq: 10, BatchStart: 9}, blocks[0])
	h, recs, st, _, _, err := DecodeJournalBlock(b, 5, 2)
	if err != nil || st != BlockOK || h.Seq != 10 || !reflect.DeepEqual(recs, sampleRecs()) {
		t.Fatalf("decode: %v %v %+v %v", st, err, h, recs)
	}
	if _, _, st, _, _, _ := DecodeJournalBlock(b, 5, 3); st != BlockForeign {
		t.Fatalf("other generation: %v", st)
	}
	if _, _, st, _, _, _ := DecodeJournalBlock(make([]byte, BlockSize), 5, 2); st != BlockZero {
		t.Fatalf("zero block: %v", st)
	}
	b[100] ^= 1
	if _, _, st, _, _, _ := DecodeJournalBlock(b, 5, 2); st != BlockBad {
		t.Fatalf("flipped bit: %v", st)
	}
}

// Fuzz targets: each decoder must never panic, and whatever it accepts must
// survive a round trip.

func FuzzDecodeSuperblock(f *testing.F) {
	b, _ := testSuperblock().Encode()
	f.Add(b)
	sb := testSuperblock()
	sb.Features, sb.CleanUntrusted, sb.MarkShift = FeatureWarmClean, true, DefaultMarkShift
	b, _ = sb.Encode()
	f.Add(b)
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, data []byte) {
		sb, err := DecodeSuperblock(data, 0)
		requireTyped(t, err)
		if err != nil {
			return
		}
		enc, err := sb.Encode()
		if err != nil {
			t.Fatalf("accepted superblock does not encode: %v", err)
		}
		if !bytes.Equal(enc, data[:len(enc)]) {
			t.Fatal("round trip changed the superblock")
		}
	})
}

func FuzzDecodeJournalBlock(f *testing.F) {
	var stream []byte
	for _, r := range sampleRecs() {
		stream = AppendRec(stream, r)
	}
	f.Add(EncodeJournalBlock(BlockHeader{Nonce: 5, Gen: 2, Seq: 10, BatchStart: 9}, stream))
	f.Add(EncodeJournalBlock(BlockHeader{Nonce: 5, Gen: 2, Seq: 0}, nil))
	f.Fuzz(func(t *testing.T, data []byte) {
		b := make([]byte, BlockSize)
		copy(b, data)
		h, recs, st, _, _, err := DecodeJournalBlock(b, 5, 2)
		requireTyped(t, err)
		if st != BlockOK {
			return
		}
		var s []byte
		for _, r := range recs {
			s = AppendRec(s, r)
		}
		if len(s) > JPayload {
			t.Fatal("records re-encode larger than a block")
		}
		_, recs2, st2, _, _, err := DecodeJournalBlock(EncodeJournalBlock(h, s), 5, 2)
		if st2 != BlockOK || err != nil || !reflect.DeepEqual(recs, recs2) {
			t.Fatalf("round trip: %v %v", st2, err)
		}
	})
}

func FuzzDecodeCheckpoint(f *testing.F) {
	vb := []uint64{64, 64}
	seed := func(ents ...index.Ent) []byte {
		tr := []*index.Ptree{index.NewPtree(), index.NewPtree()}
		for _, e := range ents {
			tr[0].ReplaceOrInsert(e)
		}
		var out []byte
		_ = EncodeCkptBody([]uint32{1, 2, 3, 4}, []uint64{7, 8}, tr, nil, func(p []byte) error {
			out = append(out, p...)
			return nil
		})
		return out
	}
	f.Add(seed())
	f.Add(seed(index.Ent{LBA: 3, Loc: 2 | index.DirtyBit, CRC: 9}, index.Ent{LBA: 9, Loc: 15, CRC: 1}))
	// With the epoch section: a dirty entry of epoch 5 and a superseded
	// version of the same block from epoch 2.
	{
		tr := []*index.Ptree{index.NewPtree(), index.NewPtree()}
		tr[0].ReplaceOrInsert(index.Ent{LBA: 3, Loc: 2 | index.DirtyBit, CRC: 9})
		epochOf := func(loc uint32) uint64 {
			if loc == 7 {
				return 2 // the superseded version's block
			}
			return 5
		}
		sup := index.NewStree()
		sup.ReplaceOrInsert(index.Ent{LBA: 3, Loc: 7, CRC: 4})
		vt := []VerSnap{{EpochOf: epochOf, Sup: sup}, {EpochOf: epochOf}}
		var out []byte
		_ = EncodeCkptBody([]uint32{1, 2, 3, 4}, []uint64{7, 8}, tr, vt, func(p []byte) error {
			out = append(out, p...)
			return nil
		})
		f.Add(out)
	}
	reencode := func(cd *CkptData) []byte {
		tr := make([]*index.Ptree, len(cd.Vols))
		epochs := make([]uint64, len(cd.Vols))
		var vt []VerSnap
		for i, cv := range cd.Vols {
			tr[i] = index.NewPtree()
			for _, e := range cv.Ents {
				tr[i].ReplaceOrInsert(e)
			}
			epochs[i] = cv.Epoch
			if cv.EpochOf != nil {
				if vt == nil {
					vt = make([]VerSnap, len(cd.Vols))
				}
				epochOf, supEpoch := cv.EpochOf, map[uint32]uint64{}
				sup := index.NewStree()
				for _, x := range cv.Sup {
					sup.ReplaceOrInsert(index.Ent{LBA: x.LBA, Loc: x.Loc, CRC: x.CRC})
					supEpoch[x.Loc] = x.Epoch
				}
				vt[i] = VerSnap{EpochOf: func(loc uint32) uint64 {
					if e, ok := supEpoch[loc]; ok {
						return e
					}
					return epochOf[loc]
				}, Sup: sup}
			}
		}
		var out []byte
		_ = EncodeCkptBody(cd.Gens, epochs, tr, vt, func(p []byte) error {
			out = append(out, p...)
			return nil
		})
		return out
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cd, err := DecodeCkptBody(data, 4, 4, vb)
		requireTyped(t, err)
		if err != nil {
			return
		}
		out := reencode(cd)
		// The encoding orders versions by epoch (and gives every dirty
		// entry an epoch), so the round trip is checked for stability.
		cd2, err := DecodeCkptBody(out, 4, 4, vb)
		if err != nil {
			t.Fatalf("re-encoded checkpoint does not decode: %v", err)
		}
		if !bytes.Equal(reencode(cd2), out) {
			t.Fatal("round trip is not stable")
		}
	})
}

// requireTyped fails unless err is nil or a typed decoding error.
func requireTyped(t *testing.T, err error) {
	t.Helper()
	if err != nil && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrChecksum) && !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("untyped error from on-disk data: %v", err)
	}
}

func FuzzDecodeCheckpointHeader(f *testing.F) {
	h := CkptHeader{Nonce: 0x1234, Gen: 7, JPos: JournalPos{Blk: 3, Seq: 9}, BodyLen: 4096, BodyCRC: 0xabcdef}
	f.Add(h.Encode())
	f.Add(make([]byte, CkptHdrLen))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := DecodeCkptHeader(data, 0)
		requireTyped(t, err)
		if err != nil {
			return
		}
		enc := got.Encode()
		if len(data) < CkptHdrLen || string(enc[:CkptHdrLen]) != string(data[:CkptHdrLen]) {
			t.Fatalf("round trip changed the header: %+v", got)
		}
	})
}
