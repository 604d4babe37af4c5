package logwrites

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// buildLog lays out a log as dm-log-writes.c writes it (sector size ss).
type logBuilder struct {
	ss  int64
	buf []byte
	n   uint64
}

func newBuilder(ss int64) *logBuilder { return &logBuilder{ss: ss, buf: make([]byte, ss)} }

func (b *logBuilder) add(sector, nr, flags uint64, mark string, data []byte) {
	h := make([]byte, b.ss)
	binary.LittleEndian.PutUint64(h[0:], sector)
	binary.LittleEndian.PutUint64(h[8:], nr)
	binary.LittleEndian.PutUint64(h[16:], flags)
	binary.LittleEndian.PutUint64(h[24:], uint64(len(mark)))
	copy(h[32:], mark)
	b.buf = append(b.buf, h...)
	b.buf = append(b.buf, data...)
	b.n++
}

func (b *logBuilder) bytes() []byte {
	binary.LittleEndian.PutUint64(b.buf[0:], magic)
	binary.LittleEndian.PutUint64(b.buf[8:], version)
	binary.LittleEndian.PutUint64(b.buf[16:], b.n)
	binary.LittleEndian.PutUint32(b.buf[24:], uint32(b.ss))
	return b.buf
}

type memImage struct{ b []byte }

func (m *memImage) WriteAt(p []byte, off int64) (int, error) {
	copy(m.b[off:], p)
	return len(p), nil
}

// TestReplay parses a log of writes, a flush, a FUA write, a discard and a
// mark, and replays prefixes and a torn write.
func TestReplay(t *testing.T) {
	b := newBuilder(512)
	a := bytes.Repeat([]byte{'a'}, 1024)
	c := bytes.Repeat([]byte{'c'}, 512)
	b.add(2, 2, 0, "", a)                     // #0 write sectors 2-3
	b.add(0, 0, FlagFlush, "", nil)           // #1 flush
	b.add(4, 1, FlagFUA, "", c)               // #2 fua write sector 4
	b.add(0, 0, FlagMark, "m1", nil)          // #3 mark
	b.add(2, 1, FlagDiscard, "", nil)         // #4 discard sector 2
	b.add(6, 2, 0, "", append(c, a[:512]...)) // #5 write 6-7
	raw := b.bytes()
	l, err := Open(bytes.NewReader(raw), int64(len(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Entries) != 6 || !l.Entries[1].IsFlush() || !l.Entries[2].IsFUA() || l.Entries[3].Mark != "m1" || !l.Entries[4].IsDiscard() {
		t.Fatalf("entries %v", l.Entries)
	}
	img := &memImage{make([]byte, 8*512)}
	if err := l.Replay(img, 4); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 8*512)
	copy(want[1024:], a)
	copy(want[2048:], c)
	if !bytes.Equal(img.b, want) {
		t.Fatal("replay to the mark: wrong image")
	}
	if err := l.Apply(img, l.Entries[4], -1); err != nil {
		t.Fatal(err)
	}
	if err := l.Apply(img, l.Entries[5], 1); err != nil { // torn: first sector only
		t.Fatal(err)
	}
	copy(want[1024:1536], make([]byte, 512))
	copy(want[3072:], c)
	if !bytes.Equal(img.b, want) {
		t.Fatal("discard and torn write: wrong image")
	}
	if err := l.Replay(img, 7); err == nil {
		t.Fatal("replay past the end accepted")
	}
}

// TestCorrupt: a log that is not one, and one cut short, are refused with
// ErrCorrupt.
func TestCorrupt(t *testing.T) {
	if _, err := Open(bytes.NewReader(make([]byte, 4096)), 4096); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("zeroes: %v", err)
	}
	b := newBuilder(512)
	b.add(0, 4, 0, "", make([]byte, 4*512))
	raw := b.bytes()
	if _, err := Open(bytes.NewReader(raw[:len(raw)-512]), int64(len(raw)-512)); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("cut short: %v", err)
	}
}

// TestFileImage replays onto an *os.File, as the power-cut tests do.
func TestFileImage(t *testing.T) {
	b := newBuilder(4096)
	b.add(1, 1, FlagFUA, "", bytes.Repeat([]byte{'x'}, 4096))
	raw := b.bytes()
	l, err := Open(bytes.NewReader(raw), int64(len(raw)))
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := l.Replay(f, 1); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := f.ReadAt(got, 4096); err != nil || got[0] != 'x' || got[4095] != 'x' {
		t.Fatalf("read back %v %q", err, got[:4])
	}
}

// TestReplayerFUAOverlap: a plain write that completed before an
// overlapping FUA write was issued is logged after it, with the next FLUSH.
// The Replayer keeps the FUA write's sectors (the older plain write lands
// only where the FUA write did not write); after the FLUSH a plain write
// overwrites them as usual. Log.Apply in log order would leave the older
// data on top.
func TestReplayerFUAOverlap(t *testing.T) {
	b := newBuilder(512)
	old := bytes.Repeat([]byte{'o'}, 4*512)
	fua := bytes.Repeat([]byte{'F'}, 2*512)
	later := bytes.Repeat([]byte{'L'}, 512)
	b.add(4, 2, FlagFUA, "", fua)         // #0 FUA write of sectors 4-5
	b.add(0, 0, FlagMark, "m", nil)       // #1
	b.add(2, 4, 0, "", old)               // #2 the older write of 2-5, logged with the FLUSH
	b.add(5, 1, FlagDiscard, "", nil)     // #3 a discard of 5 from before the FUA write
	b.add(0, 0, FlagFlush, "", nil)       // #4
	b.add(4, 1, 0, "", later)             // #5 next interval: overwrites 4
	b.add(0, 0, FlagFlush, "", nil)       // #6
	b.add(6, 1, FlagFUA, "", later[:512]) // #7 FUA write of 6, torn to 0 sectors below
	b.add(6, 1, 0, "", old[:512])         // #8 plain write of 6 in its interval
	raw := b.bytes()
	l, err := Open(bytes.NewReader(raw), int64(len(raw)))
	if err != nil {
		t.Fatal(err)
	}
	img := &memImage{make([]byte, 8*512)}
	r := l.NewReplayer(img)
	for _, e := range l.Entries[:5] {
		if err := r.Apply(e, -1); err != nil {
			t.Fatal(err)
		}
	}
	want := make([]byte, 8*512)
	copy(want[2*512:], old[:2*512])
	copy(want[4*512:], fua)
	if !bytes.Equal(img.b, want) {
		t.Fatalf("after the FLUSH: %q, want %q", img.b, want)
	}
	if r.Kept != 3 {
		t.Errorf("Kept %d sectors, want 3 (two of the write, one of the discard)", r.Kept)
	}
	if err := r.Apply(l.Entries[5], -1); err != nil {
		t.Fatal(err)
	}
	copy(want[4*512:], later)
	if !bytes.Equal(img.b, want) {
		t.Fatalf("after the next interval's write: %q", img.b)
	}
	// A torn FUA write that wrote nothing protects nothing.
	for i, e := range l.Entries[6:] {
		sectors := int64(-1)
		if i == 1 {
			sectors = 0
		}
		if err := r.Apply(e, sectors); err != nil {
			t.Fatal(err)
		}
	}
	copy(want[6*512:], old[:512])
	if !bytes.Equal(img.b, want) {
		t.Fatalf("after a torn FUA write and a plain write: %q", img.b)
	}
}
