package cache

import (
	"errors"
	"testing"
)

// TestLostWritesRecord: a failover that loses acknowledged writes records
// them on the cache device (volume, blocks, ranges); a reopen loads the
// record, an acknowledgement of a failover the record does not hold is
// refused with nothing changed, and one that it holds clears it, online
// and offline.
func TestLostWritesRecord(t *testing.T) {
	s, cdev, backs := newTestSetKnobs(t, testingKnobs{noBackground: true}, 16, 64<<10, 1<<20)
	v, _ := s.Volume("a")
	buf := make([]byte, 3*blockSize)
	if err := v.WriteAt(buf, 5*blockSize, false); err != nil {
		t.Fatal(err)
	}
	s.failover(errors.New("injected"))
	if n := v.Stats().LostWriteBlocks; n != 3 {
		t.Fatalf("lost %d blocks, want 3", n)
	}
	rec, err := ReadLostWrites(cdev)
	if err != nil || len(rec.Events) != 1 {
		t.Fatalf("record after failover: %+v, %v", rec, err)
	}
	ev := rec.Events[0]
	if ev.ID != 1 || len(ev.Vols) != 1 || ev.Vols[0].Name != "a" || ev.Vols[0].Blocks != 3 ||
		len(ev.Vols[0].Ranges) != 1 || ev.Vols[0].Ranges[0] != (LostRange{LBA: 5, N: 3}) {
		t.Fatalf("recorded %+v", ev)
	}
	if _, err := s.AckLostWrites([]uint64{1}); err == nil {
		t.Errorf("a failed-over set acknowledged its own failover")
	}
	s.Close()

	s2, err := Open(cdev, []BackingSpec{{Name: "a", Dev: backs[0]}}, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if evs, werr := s2.LostWrites(); len(evs) != 1 || werr != nil || evs[0].ID != 1 {
		t.Fatalf("reopened set's lost writes: %+v, %v", evs, werr)
	}
	if _, err := s2.AckLostWrites([]uint64{1, 7}); !errors.Is(err, ErrNoSuchLostEvent) {
		t.Fatalf("ack of 1 and 7: %v, want ErrNoSuchLostEvent", err)
	}
	if rec, _ := ReadLostWrites(cdev); len(rec.Events) != 1 {
		t.Fatalf("a refused acknowledgement changed the record: %+v", rec)
	}
	if evs, err := s2.AckLostWrites([]uint64{1}); err != nil || len(evs) != 0 {
		t.Fatalf("ack of 1: %+v, %v", evs, err)
	}
	if rec, _ := ReadLostWrites(cdev); len(rec.Events) != 0 {
		t.Fatalf("record after the acknowledgement: %+v", rec)
	}
	if _, err := AckLostWrites(cdev, []uint64{1}); !errors.Is(err, ErrNoSuchLostEvent) {
		t.Fatalf("offline ack of an acknowledged failover: %v", err)
	}
}
