package kvm

import (
	"bufio"
	"fmt"
	"io"
	"strings"

	"github.com/tiercache/tiercache/internal/crashtest"
)

// Events is the oracle event log kvmload writes in the guest: every
// crashtest.Oracle call of the workload, in the order the oracle saw them,
// and the marks it put into the dm-log-writes log.
type Events struct {
	Seed   uint64
	Blocks int64
	Marks  int // marks issued: f0 .. f(Marks-1)
	lines  []event
}

type event struct {
	kind string // B, A, FS, FA, M
	id   uint64
	lba  int64
	fua  bool
}

// ReadEvents parses an events file.
func ReadEvents(r io.Reader) (*Events, error) {
	ev := &Events{}
	sc := bufio.NewScanner(r)
	first, end := true, false
	for sc.Scan() {
		line := sc.Text()
		if first {
			if _, err := fmt.Sscanf(line, "seed %d blocks %d", &ev.Seed, &ev.Blocks); err != nil {
				return nil, fmt.Errorf("events: header %q: %v", line, err)
			}
			first = false
			continue
		}
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		var e event
		var err error
		switch e.kind = f[0]; e.kind {
		case "B":
			_, err = fmt.Sscanf(line, "B %d %d %t", &e.id, &e.lba, &e.fua)
		case "A", "FS", "FA", "M":
			_, err = fmt.Sscanf(line, e.kind+" %d", &e.id)
			if e.kind == "M" {
				ev.Marks = int(e.id) + 1
			}
		case "END":
			end = true
			continue
		default:
			err = fmt.Errorf("unknown event")
		}
		if err != nil {
			return nil, fmt.Errorf("events: %q: %v", line, err)
		}
		ev.lines = append(ev.lines, e)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !end {
		return nil, fmt.Errorf("events: no END line (the workload did not finish)")
	}
	return ev, nil
}

// OracleAt rebuilds the oracle for a point of the log after mark fK (K = -1:
// before the first mark). Events up to the mark's M event are applied as
// they happened: what was acknowledged durable by then must be on the
// replayed devices. Every later event only adds maybe-new contents: a write
// begun later, and a FUA write begun before the M event but acknowledged
// after it, whose FUA may have reached the log only after the mark (the
// mark command runs after the M event, while the other writers go on).
func (ev *Events) OracleAt(k int) (*crashtest.Oracle, error) {
	// The position of the M event of mark k (len: none), and of each
	// write's acknowledgement.
	mark := len(ev.lines)
	acked := map[uint64]int{}
	for i, e := range ev.lines {
		switch {
		case e.kind == "M" && int(e.id) == k && k >= 0:
			mark = min(mark, i)
		case e.kind == "A":
			acked[e.id] = i
		}
	}
	if k < 0 {
		mark = -1
	}
	o := crashtest.NewOracle(ev.Blocks, true)
	ops := map[uint64]*crashtest.Op{}
	toks := map[uint64]crashtest.FlushToken{}
	for i, e := range ev.lines {
		before := i < mark
		switch e.kind {
		case "B":
			a, ok := acked[e.id]
			op, err := o.Begin(crashtest.OpWrite, e.lba, 1, 0, e.fua && ok && a < mark, 0)
			if err != nil {
				return nil, err
			}
			if op.ID != e.id {
				return nil, fmt.Errorf("events: write id %d replayed as %d", e.id, op.ID)
			}
			ops[e.id] = op
		case "A":
			op, ok := ops[e.id]
			if !ok {
				return nil, fmt.Errorf("events: write id %d acknowledged before it began", e.id)
			}
			o.Ack(op)
		case "FS":
			if before {
				toks[e.id] = o.FlushStart(0)
			}
		case "FA":
			if before {
				o.FlushAck(toks[e.id])
			}
		}
	}
	return o, nil
}

// WritesTo returns the ids of every write to block lba, in order.
func (ev *Events) WritesTo(lba int64) []uint64 {
	var ids []uint64
	for _, e := range ev.lines {
		if e.kind == "B" && e.lba == lba {
			ids = append(ids, e.id)
		}
	}
	return ids
}
