package kvm

import (
	"strings"
	"testing"

	"github.com/tiercache/tiercache/internal/crashtest"
)

// TestOracleAtFUAAckedAfterMark checks which writes the oracle of a mark
// requires durable. kvmload writes the M event, then runs the mark command
// while its writers go on: a FUA write begun before the M event and
// acknowledged after it may have been committed by tiercache (its journal
// record and the cache device FLUSH logged) only after the mark entry, so
// at the mark it is maybe-new. A FUA write acknowledged before the M event
// was durable before the mark entry was logged and must be there.
//
// OracleAt used to apply every acknowledgement, so the first write was
// promoted durable at mark f0 (its Begin had been replayed with FUA before
// the mark): TestPowerCut then reported, in about 2 runs of 12, a FUA write
// missing at a mark whose M event preceded its acknowledgement, and
// TestPowerCut stayed out of make kernel.
func TestOracleAtFUAAckedAfterMark(t *testing.T) {
	const events = `seed 7 blocks 4
B 1 0 true
B 2 1 true
A 2
FS 0
FA 0
M 0
A 1
B 3 2 false
A 3
FS 1
FA 1
M 1
END
`
	ev, err := ReadEvents(strings.NewReader(events))
	if err != nil {
		t.Fatal(err)
	}
	zero := crashtest.Decoded{Kind: crashtest.KindZero}
	w := func(id uint64) crashtest.Decoded { return crashtest.Decoded{Kind: crashtest.KindWrite, ID: id} }
	for _, c := range []struct {
		mark int
		lba  int64
		got  crashtest.Decoded
		ok   bool
	}{
		{-1, 0, zero, true},
		{-1, 1, zero, true},
		{-1, 1, w(2), true},
		// Acknowledged after M 0: maybe-new at f0.
		{0, 0, zero, true},
		{0, 0, w(1), true},
		// Acknowledged (FUA) before M 0: durable at f0.
		{0, 1, zero, false},
		{0, 1, w(2), true},
		// Begun after M 0, not FUA: maybe-new at f0.
		{0, 2, zero, true},
		{0, 2, w(3), true},
		// Flush 1 covers everything.
		{1, 0, zero, false},
		{1, 0, w(1), true},
		{1, 2, zero, false},
		{1, 2, w(3), true},
	} {
		o, err := ev.OracleAt(c.mark)
		if err != nil {
			t.Fatal(err)
		}
		_, err = o.CheckCrash(c.lba, c.got)
		if (err == nil) != c.ok {
			t.Errorf("at f%d, block %d holding %v: allowed %t, want %t (%v)", c.mark, c.lba, c.got, err == nil, c.ok, err)
		}
	}
}
