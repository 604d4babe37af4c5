package cache

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// Fuzz targets for the on-disk formats beyond the single decoders in
// journal_test.go: the checkpoint header, and whole recoveries (Open) of a
// set whose journal or checkpoint holds forged contents with valid
// checksums, so the fuzzer gets past the CRCs into replay and index
// validation. Data from disk must never panic, and a refusal must be a
// typed error (IsCorruption or ErrNotFormatted); a recovery that succeeds
// must pass Check and serve reads or typed errors. `make fuzz` runs every
// target (scripts/fuzz.sh).

// fuzzHang is how long one recovery of the tiny fuzz image may take.
const fuzzHang = 10 * time.Second

// requireTyped fails unless err is nil or a typed decoding error.
func requireTyped(t *testing.T, err error) {
	t.Helper()
	if err != nil && !IsCorruption(err) && !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("untyped error from on-disk data: %v", err)
	}
}

// fuzzImage is a small set (two volumes, one writethrough) left as a crash
// would leave it, with where its next journal block goes.
type fuzzImage struct {
	cache *device.Mem
	backs []*device.Mem
	sb    *Superblock
	gen   uint64
	pos   ondisk.JournalPos
	ckpt  []byte        // body of its newest checkpoint
	recs  []*ondisk.Rec // records of its last journal block
}

func newFuzzImage(f testing.TB) *fuzzImage {
	const bs = 4 * blockSize
	im := &fuzzImage{cache: device.NewMem(cacheSizeFor(8, bs, minJournalLen, 2))}
	var specs []BackingSpec
	for i := 0; i < 2; i++ {
		b := device.NewMem(32 * blockSize)
		im.backs = append(im.backs, b)
		specs = append(specs, BackingSpec{Name: string(rune('a' + i)), Dev: b})
	}
	if _, err := Format(im.cache, specs, FormatOptions{BucketSize: bs, JournalSize: minJournalLen}); err != nil {
		f.Fatal(err)
	}
	s, err := Open(im.cache, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		f.Fatal(err)
	}
	defer s.crashStop()
	if err := s.vols[1].SetMode(Writethrough); err != nil {
		f.Fatal(err)
	}
	p := make([]byte, 3*blockSize)
	for i := 0; i < 8; i++ {
		vi := i % 2
		stamp(p, uint64(i+1), vi, int64(i)*2*blockSize)
		if err := s.vols[vi].WriteAt(p, int64(i)*2*blockSize, i%3 == 0); err != nil {
			f.Fatal(err)
		}
		if i == 4 {
			s.evictOne() // a reuse record
			if err := s.Drain(context.Background()); err != nil {
				f.Fatal(err)
			}
		}
	}
	if err := s.Flush(); err != nil {
		f.Fatal(err)
	}
	im.sb = s.Superblock()
	s.commitMu.Lock()
	im.gen, im.pos = s.jr.gen, s.jr.pos
	s.commitMu.Unlock()
	// The newest checkpoint's body, and the records of the last journal
	// block (if the last commit wrote one): seeds in the engine's own
	// encoding.
	hdr, _, _, err := ondisk.ReadCheckpoint(im.cache, im.sb, []uint64{32, 32})
	if err != nil {
		f.Fatal(err)
	}
	im.ckpt = make([]byte, hdr.BodyLen)
	if _, err := im.cache.ReadAt(im.ckpt, im.sb.CkptOff[hdr.Gen%2]+blockSize); err != nil {
		f.Fatal(err)
	}
	if im.pos.Seq > 0 {
		jb := im.sb.JournalLen / blockSize
		b := make([]byte, blockSize)
		if _, err := im.cache.ReadAt(b, im.sb.JournalOff+((im.pos.Blk+jb-1)%jb)*blockSize); err != nil {
			f.Fatal(err)
		}
		if _, recs, st, _, _, _ := ondisk.DecodeJournalBlock(b, im.sb.Nonce(), im.gen); st == ondisk.BlockOK {
			im.recs = recs
		}
	}
	return im
}

// open recovers a copy of the image after write has changed the copy's
// cache device, and checks what the recovery does with it.
func (im *fuzzImage) open(t *testing.T, write func(c *device.Mem)) {
	// The fuzzer does not report an input that never finishes (it stops
	// at -fuzztime and passes): a watchdog makes a hang a crash, which it
	// records.
	dog := time.AfterFunc(fuzzHang, func() { panic(fmt.Sprintf("recovery of forged metadata still running after %v", fuzzHang)) })
	defer dog.Stop()
	c := im.cache.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
	write(c)
	var specs []BackingSpec
	for i, b := range im.backs {
		specs = append(specs, BackingSpec{Name: string(rune('a' + i)), Dev: b.CrashClone(device.CrashConfig{UnsyncedKeep: 1})})
	}
	s, err := Open(c, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	requireTyped(t, err)
	if err != nil {
		return
	}
	defer s.crashStop()
	if err := s.Check(); err != nil {
		t.Fatalf("recovery accepted forged metadata and left an inconsistent index: %v", err)
	}
	for _, v := range s.vols {
		buf := make([]byte, v.Size())
		requireTyped(t, v.ReadAt(buf, 0))
	}
}

func FuzzOpenForgedJournal(f *testing.F) {
	im := newFuzzImage(f)
	var stream []byte
	for _, r := range im.recs {
		stream = ondisk.AppendRec(stream, r)
	}
	f.Add(stream)
	f.Add(ondisk.AppendRec(nil, &ondisk.Rec{Type: ondisk.RecReuse, Bucket: 1, Gen: 9}))
	f.Add(ondisk.AppendRec(ondisk.AppendRec(nil, &ondisk.Rec{Type: ondisk.RecInvalidate, Vol: 1, LBA: 0, N: 1 << 40}),
		&ondisk.Rec{Type: ondisk.RecClean, Vol: 0, LBA: 2, Loc: 5}))
	f.Add(ondisk.AppendRec(nil, &ondisk.Rec{Type: ondisk.RecInsert, Vol: 0, LBA: 30, Loc: 31, Gen: 0, Dirty: true, Epoch: 3, CRCs: []uint32{1}}))
	nonce := im.sb.Nonce()
	jb := im.sb.JournalLen / blockSize
	f.Fuzz(func(t *testing.T, payload []byte) {
		if len(payload) > ondisk.JPayload {
			payload = payload[:ondisk.JPayload]
		}
		im.open(t, func(c *device.Mem) {
			b := ondisk.EncodeJournalBlock(ondisk.BlockHeader{Nonce: nonce, Gen: im.gen, Seq: im.pos.Seq, BatchStart: im.pos.Seq}, payload)
			if _, err := c.WriteAt(b, im.sb.JournalOff+(im.pos.Blk%jb)*blockSize); err != nil {
				t.Fatal(err)
			}
		})
	})
}

func FuzzOpenForgedCheckpoint(f *testing.F) {
	im := newFuzzImage(f)
	f.Add(im.ckpt)
	f.Add([]byte{})
	nonce := im.sb.Nonce()
	f.Fuzz(func(t *testing.T, body []byte) {
		if int64(len(body)) > im.sb.CkptLen-blockSize {
			body = body[:im.sb.CkptLen-blockSize]
		}
		im.open(t, func(c *device.Mem) {
			// A newer checkpoint, with a valid header, vouching for body.
			h := ondisk.CkptHeader{Nonce: nonce, Gen: im.gen + 1, JPos: ondisk.JournalPos{Blk: im.pos.Blk}, BodyLen: uint64(len(body)), BodyCRC: ondisk.CRC32C(body)}
			slot := im.sb.CkptOff[h.Gen%2]
			if _, err := c.WriteAt(body, slot+blockSize); err != nil {
				t.Fatal(err)
			}
			if _, err := c.WriteAt(h.Encode(), slot); err != nil {
				t.Fatal(err)
			}
		})
	})
}

// TestForgedMetadataNamesThePlace: a journal block or checkpoint body whose
// checksum is right but whose contents are not is refused at Open with a
// corruption error naming what and where (issue 7, item 4).
func TestForgedMetadataNamesThePlace(t *testing.T) {
	im := newFuzzImage(t)
	jb := im.sb.JournalLen / blockSize
	jOff := im.sb.JournalOff + (im.pos.Blk%jb)*blockSize
	slot := im.sb.CkptOff[(im.gen+1)%2]
	for _, tc := range []struct {
		name  string
		write func(c *device.Mem)
		what  string
		off   int64
	}{
		{"journal record of unknown type", func(c *device.Mem) {
			b := ondisk.EncodeJournalBlock(ondisk.BlockHeader{Nonce: im.sb.Nonce(), Gen: im.gen, Seq: im.pos.Seq, BatchStart: im.pos.Seq}, []byte{99, 0, 0})
			if _, err := c.WriteAt(b, jOff); err != nil {
				t.Fatal(err)
			}
		}, "journal record", jOff},
		{"checkpoint body with another bucket count", func(c *device.Mem) {
			body := []byte{1, 0, 0, 0, 0, 0, 0, 0, 0, 0}
			h := ondisk.CkptHeader{Nonce: im.sb.Nonce(), Gen: im.gen + 1, JPos: ondisk.JournalPos{Blk: im.pos.Blk}, BodyLen: uint64(len(body)), BodyCRC: ondisk.CRC32C(body)}
			if _, err := c.WriteAt(body, slot+blockSize); err != nil {
				t.Fatal(err)
			}
			if _, err := c.WriteAt(h.Encode(), slot); err != nil {
				t.Fatal(err)
			}
		}, "checkpoint body", slot + blockSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := im.cache.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
			tc.write(c)
			var specs []BackingSpec
			for i, b := range im.backs {
				specs = append(specs, BackingSpec{Name: string(rune('a' + i)), Dev: b})
			}
			s, err := Open(c, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
			if err == nil {
				s.crashStop()
				t.Fatal("forged metadata accepted")
			}
			var ce *CorruptionError
			if !errors.As(err, &ce) || ce.What != tc.what || ce.Offset != tc.off {
				t.Fatalf("got %v (%+v), want a corruption error for %s at %d", err, ce, tc.what, tc.off)
			}
			t.Log(err)
		})
	}
}
