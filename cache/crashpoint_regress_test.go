package cache

import (
	"bytes"
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// Regression tests for what TestCrashPoints and TestErrorPoints found.

// closedSetWithDirtyData formats a set over a fresh cache and backing
// device, writes dirty data (writeback) and closes it cleanly, with its
// newest checkpoint in the given slot. It returns the devices and what the
// volume holds.
func closedSetWithDirtyData(t *testing.T, slot uint64) (*device.Mem, *device.Mem, []byte) {
	t.Helper()
	cache := device.NewMem(cacheSizeFor(8, 4*blockSize, minJournalLen, 1))
	back := device.NewMem(32 * blockSize)
	specs := []BackingSpec{{Name: "a", Dev: back}}
	if _, err := Format(cache, specs, FormatOptions{BucketSize: 4 * blockSize, JournalSize: minJournalLen}); err != nil {
		t.Fatal(err)
	}
	s, err := Open(cache, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, back.Size())
	stamp(want, 1, 0, 0)
	for off := int64(0); off < int64(len(want)); off += 4 * blockSize {
		if err := s.vols[0].WriteAt(want[off:off+4*blockSize], off, false); err != nil {
			t.Fatal(err)
		}
		if err := s.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// Close writes one more checkpoint, of generation jr.gen+1.
	if (s.jr.gen+1)%2 != slot {
		s.commitMu.Lock()
		err := s.checkpointLocked(0)
		s.commitMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
	}
	// Unflushed writes: only Close's checkpoint records them, no journal
	// block, so the older checkpoint does not know them.
	stamp(want[:4*blockSize], 2, 0, 0)
	if err := s.vols[0].WriteAt(want[:4*blockSize], 0, false); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return cache, back, want
}

// TestFormatForceInterrupted: a forced Format over an existing set that
// stops at any device write (here: fails, leaving what was written) must
// leave either no set or the old set intact, never the old superblock over
// checkpoint slots Format already overwrote (which opened from an older
// checkpoint and served stale data).
func TestFormatForceInterrupted(t *testing.T) {
	for slot := uint64(0); slot < 2; slot++ {
		t.Run(fmt.Sprintf("newest-checkpoint-in-slot-%d", slot), func(t *testing.T) { formatForceInterrupted(t, slot) })
	}
}

func formatForceInterrupted(t *testing.T, slot uint64) {
	for k := uint64(0); ; k++ {
		cache, back, want := closedSetWithDirtyData(t, slot)
		old, err := ReadSuperblock(cache)
		if err != nil {
			t.Fatal(err)
		}
		raw := make([]byte, back.Size())
		if _, err := back.ReadAt(raw, 0); err != nil {
			t.Fatal(err)
		}
		fd := faultdev.Wrap(cache, faultdev.After(k, faultdev.OnKind(faultdev.Write, faultdev.Always(faultdev.Error(nil)))))
		specs := []BackingSpec{{Name: "a", Dev: back}}
		_, ferr := Format(fd, specs, FormatOptions{BucketSize: 4 * blockSize, JournalSize: minJournalLen, Force: true})
		if ferr == nil {
			t.Logf("format finished after %d write attempts", k)
			return
		}
		s, err := Open(cache, specs, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err != nil {
			if !errors.Is(err, ErrNotFormatted) && !IsCorruption(err) {
				t.Fatalf("write %d: open after an interrupted format: %v", k, err)
			}
			continue
		}
		// The old set with its data, or the new, empty one showing the
		// backing device as it is.
		expect, which := want, "old"
		if s.lay.SetUUID != old.SetUUID {
			expect, which = raw, "new"
		}
		got := make([]byte, len(want))
		rerr := s.vols[0].ReadAt(got, 0)
		s.crashStop()
		if rerr != nil || !bytes.Equal(got, expect) {
			t.Fatalf("write %d: format failed (%v); the %s set opens with other data (read error %v)", k, ferr, which, rerr)
		}
	}
}

// TestFormatRefusesUnreadableDevice: Format without force must not take an
// I/O error reading the superblock for "not formatted".
func TestFormatRefusesUnreadableDevice(t *testing.T) {
	cache, back, _ := closedSetWithDirtyData(t, 0)
	before, _ := ReadSuperblock(cache)
	fd := faultdev.Wrap(cache, faultdev.OnKind(faultdev.Read, faultdev.Always(faultdev.Error(nil))))
	_, err := Format(fd, []BackingSpec{{Name: "a", Dev: back}}, FormatOptions{BucketSize: 4 * blockSize, JournalSize: minJournalLen})
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("format over an unreadable device: %v, want an I/O error", err)
	}
	if after, err := ReadSuperblock(cache); err != nil || after.SetUUID != before.SetUUID {
		t.Fatalf("the set was overwritten: %v", err)
	}
}

// TestOpenRefusesUnreadableMetadata: an I/O error reading one superblock
// copy or one checkpoint slot fails Open; falling back to the other copy
// or slot recovered older settings or an older index.
func TestOpenRefusesUnreadableMetadata(t *testing.T) {
	cache, back, _ := closedSetWithDirtyData(t, 0)
	sb, err := ReadSuperblock(cache)
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, ondisk.SBCopySize, sb.CkptOff[0], sb.CkptOff[1]} {
		fd := faultdev.Wrap(cache, faultdev.OnKind(faultdev.Read, faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
			if op.Offset == off {
				return faultdev.Error(nil)
			}
			return faultdev.Fault{}
		})))
		s, err := Open(fd, []BackingSpec{{Name: "a", Dev: back}}, OpenOptions{testing: testingKnobs{noBackground: true}})
		if err == nil {
			s.crashStop()
			t.Fatalf("read error at %d: open succeeded", off)
		}
		if !errors.Is(err, faultdev.ErrInjected) {
			t.Fatalf("read error at %d: open failed with %v, not the I/O error", off, err)
		}
	}
}
