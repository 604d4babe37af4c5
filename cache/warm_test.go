package cache

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

// testMarkShift picks a mark region size for a seeded test from its seed:
// regions of 2, 4, 8 or 32 blocks, or the default 1 GiB (one region per
// test volume), so the crash models recover with clean entries both
// dropped and kept.
func testMarkShift(seed uint64) uint8 { return []uint8{1, 2, 3, 5, 0}[seed%5] }

// checkCleanCoherent is the crash models' check of a warm recovery: every
// clean entry's cached block equals the backing device's block. A clean
// entry that a lost invalidation left over a newer backing write reads the
// older data now and the newer one once evicted; recovery must drop it
// (marks.go). Dirty entries are left out (the backing device holds an
// older version until writeback).
func checkCleanCoherent(s *Set) error {
	// Set.mu is held throughout (device I/O under it is for this check
	// only): the background goroutines of a set opened with them could
	// otherwise evict an entry and reuse its block between the walk and
	// the reads. A range claimed for a backing write is skipped.
	s.mu.Lock()
	defer s.mu.Unlock()
	c, b := make([]byte, blockSize), make([]byte, blockSize)
	for vi, v := range s.vols {
		if v.free {
			continue
		}
		var err error
		v.idx.Tree.Ascend(func(e index.Ent) bool {
			if e.Dirty() || v.busyLocked(e.LBA, 1) {
				return true
			}
			if _, err = s.dev.ReadAt(c, s.cacheOff(e.Block())); err != nil {
				err = fmt.Errorf("vol%d lba %d: reading cache block %d: %w", vi, e.LBA, e.Block(), err)
				return false
			}
			if err = v.readBacking(b, e.LBA); err != nil {
				err = fmt.Errorf("vol%d lba %d: %w", vi, e.LBA, err)
				return false
			}
			if n := v.size - int64(e.LBA)*blockSize; n < blockSize {
				clear(c[n:]) // past the device's end: not data
			}
			if !bytes.Equal(c, b) {
				err = fmt.Errorf("vol%d lba %d: clean cache block %d holds %s (crc32c %#x, the entry's %#x), the backing device %s: a stale clean entry survived recovery",
					vi, e.LBA, e.Block(), describeSectors(c), ondisk.CRC32C(c), e.CRC, describeSectors(b))
				return false
			}
			return true
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// warmRig is one volume of nblk blocks in regions of 2^shift blocks on a
// cache that holds it all, with the background goroutines off and no
// random checkpoints, so each test decides what is durable when.
type warmRig struct {
	t           testing.TB
	cache, back *device.Mem
	s           *Set
	v           *Volume
	want        [][]byte // per block: the content last written
	id          uint64
}

func newWarmRig(t testing.TB, mode Mode, nblk int, shift uint8) *warmRig {
	t.Helper()
	r := &warmRig{t: t, cache: device.NewMem(cacheSizeFor(int64(nblk/16+4), 16*blockSize, minJournalLen, 1)),
		back: device.NewMem(int64(nblk) * blockSize), want: make([][]byte, nblk)}
	for b := range r.want {
		r.want[b] = make([]byte, blockSize)
	}
	if _, err := Format(r.cache, []BackingSpec{{Name: "a", Dev: r.back}}, FormatOptions{BucketSize: 16 * blockSize,
		JournalSize: minJournalLen, Mode: mode, markShift: shift}); err != nil {
		t.Fatal(err)
	}
	r.open()
	return r
}

func (r *warmRig) open() {
	r.t.Helper()
	s, err := Open(r.cache, []BackingSpec{{Name: "a", Dev: r.back}}, OpenOptions{testing: testingKnobs{noBackground: true, fixedJournal: true}})
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(s.crashStop)
	r.s, r.v = s, s.vols[0]
	if err := checkCleanCoherent(s); err != nil {
		r.t.Fatal(err)
	}
}

// crash replaces the devices by a power-cut clone (unsynced writes kept
// with probability keep) and reopens.
func (r *warmRig) crash(keep float64) {
	r.t.Helper()
	r.s.crashStop()
	cfg := device.CrashConfig{UnsyncedKeep: keep, Rand: rand.New(rand.NewPCG(uint64(r.id), 3))}
	r.cache, r.back = r.cache.CrashClone(cfg), r.back.CrashClone(cfg)
	r.open()
}

func (r *warmRig) write(b int) {
	r.t.Helper()
	r.id++
	p := make([]byte, blockSize)
	stamp(p, r.id, 0, int64(b)*blockSize)
	if err := r.v.WriteAt(p, int64(b)*blockSize, false); err != nil {
		r.t.Fatal(err)
	}
	r.want[b] = p
}

func (r *warmRig) flush() {
	r.t.Helper()
	if err := r.v.Flush(); err != nil {
		r.t.Fatal(err)
	}
}

// fill writes every block, flushes and reads them all back (promoting
// what is not cached), writes back, and commits: every block is cached
// clean and durable.
func (r *warmRig) fill() {
	r.t.Helper()
	for b := range r.want {
		r.write(b)
	}
	r.flush()
	r.readAll()
	if err := r.s.Drain(context.Background()); err != nil {
		r.t.Fatal(err)
	}
	r.lapse()
	r.flush()
	if c := r.v.Stats().CachedBlocks; c != int64(len(r.want)) {
		r.t.Fatalf("after fill: %d blocks cached, want %d", c, len(r.want))
	}
}

// lapse ends every mark as the commit loop does once the regions have
// been idle for markIdle (its clock moved on by markIdle), and commits.
func (r *warmRig) lapse() {
	r.t.Helper()
	r.s.mu.Lock()
	r.s.lapseMarksLocked(nowNanos() + int64(markIdle))
	r.s.mu.Unlock()
	r.flush()
}

func (r *warmRig) readAll() {
	r.t.Helper()
	got := make([]byte, len(r.want)*blockSize)
	if err := r.v.ReadAt(got, 0); err != nil {
		r.t.Fatal(err)
	}
	for b := range r.want {
		if !bytes.Equal(got[b*blockSize:(b+1)*blockSize], r.want[b]) {
			r.t.Fatalf("block %d holds %s, want %s", b, describeSectors(got[b*blockSize:(b+1)*blockSize]), describeSectors(r.want[b]))
		}
	}
}

// cached reports which blocks have an entry.
func (r *warmRig) cached() []bool {
	out := make([]bool, len(r.want))
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	r.v.idx.Tree.Ascend(func(e index.Ent) bool {
		out[e.LBA] = true
		return true
	})
	return out
}

// TestWarmAfterCrash: after a power cut, clean entries outside the
// regions marked since the checkpoint come back (in every mode); in a
// region with a passthrough write whose invalidation was lost, all but
// that write's block (verifyClean).
func TestWarmAfterCrash(t *testing.T) {
	for _, mode := range []Mode{Writeback, Writethrough, Writearound, None} {
		t.Run(mode.String(), func(t *testing.T) {
			r := newWarmRig(t, mode, 64, 3)
			if mode == None {
				// Nothing enters the cache in mode none; what is
				// there is still read from it.
				if err := r.v.SetMode(Writethrough); err != nil {
					t.Fatal(err)
				}
			}
			r.fill()
			if err := r.v.SetMode(mode); err != nil {
				t.Fatal(err)
			}
			r.crash(0)
			for b, c := range r.cached() {
				if !c {
					t.Fatalf("block %d not cached after the crash: the clean cache went cold", b)
				}
			}
			r.readAll()
			// A write around the cache into region 2 (blocks 16..23):
			// the mark is committed before it, its invalidation never.
			if err := r.v.SetMode(Writearound); err != nil {
				t.Fatal(err)
			}
			r.write(17)
			r.crash(1)
			// Recovery compares the marked region's clean blocks with
			// the backing device: only block 17 is stale.
			r.checkCachedExcept("after a lost invalidation in region 2", func(b int) bool { return b == 17 })
			r.readAll()
		})
	}
}

// checkCachedExcept fails unless exactly the blocks outside cold are
// cached.
func (r *warmRig) checkCachedExcept(what string, cold func(b int) bool) {
	r.t.Helper()
	for b, c := range r.cached() {
		if c == cold(b) {
			r.t.Fatalf("%s: block %d cached %t", what, b, c)
		}
	}
}

// TestWarmCheckpointInFlight: a checkpoint taken while a backing write is
// claimed (its region's mark in the old journal generation, which a
// recovery from the new checkpoint does not read) leaves that range's
// clean entries out of the checkpoint (marks.go, rule 2); the rest of the
// region stays warm.
func TestWarmCheckpointInFlight(t *testing.T) {
	r := newWarmRig(t, Writearound, 64, 3)
	r.fill()
	if err := r.v.claimBacking(9, 1); err != nil {
		t.Fatal(err)
	}
	r.s.commitMu.Lock()
	err := r.s.checkpointLocked(0)
	r.s.commitMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	// The claimed write reaches the backing device; its invalidation is
	// lost in the crash.
	r.id++
	stamp(r.want[9], r.id, 0, 9*blockSize)
	if _, err := r.back.WriteAt(r.want[9], 9*blockSize); err != nil {
		t.Fatal(err)
	}
	r.crash(1)
	r.checkCachedExcept("after a checkpoint during a claimed write", func(b int) bool { return b == 9 })
	r.readAll()
}

// TestWarmWritebackCommitsInsert: writeback writes a dirty version to the
// backing device only once its insert record is durable (rule 4): else a
// crash brings back the clean entry it replaced over the newer backing
// data.
func TestWarmWritebackCommitsInsert(t *testing.T) {
	r := newWarmRig(t, Writeback, 64, 3)
	r.fill()
	r.write(5)
	if n, err := r.s.writeback(0, []uint64{5}); err != nil || n != 1 {
		t.Fatalf("writeback: %d, %v", n, err)
	}
	r.crash(1)
	r.readAll()
	r.checkCachedExcept("after writeback of an unflushed write", func(int) bool { return false })
}

// TestWarmFailoverUntrusts: after failover, a write into a region the
// journal did not mark first sets the superblock's clean-untrusted flag
// (rule 5), so the next recovery is cold; that recovery clears the flag.
func TestWarmFailoverUntrusts(t *testing.T) {
	r := newWarmRig(t, Writearound, 64, 3)
	r.fill()
	r.s.commitMu.Lock()
	_ = r.s.failLocked(errors.New("test: cache device gone"))
	r.s.commitMu.Unlock()
	r.write(20)
	sb, err := ReadSuperblock(r.cache)
	if err != nil || !sb.CleanUntrusted {
		t.Fatalf("after a failed-over write: untrusted %t, %v", sb != nil && sb.CleanUntrusted, err)
	}
	r.crash(1)
	r.checkCachedExcept("reopen after failover", func(int) bool { return true })
	r.readAll()
	if sb, err := ReadSuperblock(r.cache); err != nil || sb.CleanUntrusted || !sb.HasFeature(ondisk.FeatureWarmClean) {
		t.Fatalf("after the cold recovery: %+v, %v", sb, err)
	}
	// Warm again from here on.
	r.fill()
	r.crash(0)
	r.checkCachedExcept("the next crash", func(int) bool { return false })
}

// TestOpenRefusesVersion2: a set whose superblock is format version 2 (a
// pre-release build's) is refused with a FormatVersionError that says
// what was found, what this build reads and what to do, and Open writes
// nothing: the cache device is byte for byte what it was.
func TestOpenRefusesVersion2(t *testing.T) {
	r := newWarmRig(t, Writeback, 64, 3)
	r.fill()
	r.s.crashStop()
	for i := 0; i < 2; i++ {
		// Both copies to version 2, each with a valid checksum.
		off := int64(i) * ondisk.SBCopySize
		b := make([]byte, ondisk.BlockSize)
		if _, err := r.cache.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		n := ondisk.SBHeaderSize + int(binary.LittleEndian.Uint32(b[12:]))
		b = make([]byte, (n+ondisk.BlockSize-1)/ondisk.BlockSize*ondisk.BlockSize)
		if _, err := r.cache.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		binary.LittleEndian.PutUint32(b[8:], 2)
		binary.LittleEndian.PutUint32(b[16:], 0)
		binary.LittleEndian.PutUint32(b[16:], ondisk.CRC32C(b[:n]))
		if _, err := r.cache.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	before := make([]byte, r.cache.Size())
	if _, err := r.cache.ReadAt(before, 0); err != nil {
		t.Fatal(err)
	}
	_, err := Open(r.cache, []BackingSpec{{Name: "a", Dev: r.back}}, OpenOptions{})
	var ve *FormatVersionError
	if !errors.As(err, &ve) || ve.Found != 2 {
		t.Fatalf("Open of a version 2 set: %v, want a FormatVersionError", err)
	}
	for _, w := range []string{"format version 2", "reads only version 4", "pre-release build", "format the device again"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not say %q", err, w)
		}
	}
	after := make([]byte, r.cache.Size())
	if _, err := r.cache.ReadAt(after, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("Open of a version 2 set wrote to the cache device")
	}
	// Format without force refuses too: the set may hold dirty data.
	_, err = Format(r.cache, []BackingSpec{{Name: "a", Dev: r.back}}, FormatOptions{Mode: Writeback})
	if !errors.Is(err, ErrAlreadyFormatted) || !strings.Contains(err.Error(), "format version 2") || !strings.Contains(err.Error(), "use force") {
		t.Fatalf("Format over a version 2 set without force: %v, want ErrAlreadyFormatted naming version 2 and force", err)
	}
	if _, err := r.cache.ReadAt(after, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("refused Format over a version 2 set wrote to the cache device")
	}
}
