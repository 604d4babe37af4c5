package crashtest

import (
	"strings"
	"testing"
)

func zero() Decoded        { return Decoded{Kind: KindZero} }
func wr(id uint64) Decoded { return Decoded{Kind: KindWrite, ID: id} }
func mustBegin(t *testing.T, o *Oracle, kind OpKind, lba, n int64, conn int, fua bool) *Op {
	t.Helper()
	op, err := o.Begin(kind, lba, n, conn, fua, 1)
	if err != nil {
		t.Fatal(err)
	}
	return op
}

func flush(o *Oracle, conn int) { o.FlushAck(o.FlushStart(conn)) }

// wantCrash checks one block after a simulated crash on a copy of the
// oracle's state: ok says whether got must be accepted. The check adopts,
// so each case builds its own oracle.
func wantCrash(t *testing.T, o *Oracle, lba int64, got Decoded, ok bool, mention string) {
	t.Helper()
	_, err := o.CheckCrash(lba, got)
	if ok && err != nil {
		t.Fatalf("block %d holding %v rejected: %v", lba, got, err)
	}
	if !ok {
		if err == nil {
			t.Fatalf("block %d holding %v accepted", lba, got)
		}
		if !strings.Contains(err.Error(), mention) {
			t.Fatalf("error %q does not mention %q", err, mention)
		}
	}
}

func TestOracleLostFlushedWrite(t *testing.T) {
	o := NewOracle(8, true)
	w := mustBegin(t, o, OpWrite, 2, 2, 0, false)
	o.Ack(w)
	flush(o, 0)
	wantCrash(t, o, 2, zero(), false, "durable {write w1")
	wantCrash(t, o, 3, wr(w.ID), true, "")
}

func TestOracleLostFUAWrite(t *testing.T) {
	o := NewOracle(8, true)
	w := mustBegin(t, o, OpWrite, 0, 1, 0, true)
	o.Ack(w)
	wantCrash(t, o, 0, zero(), false, "durable")
}

func TestOracleNeverWritten(t *testing.T) {
	o := NewOracle(8, true)
	w := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w)
	wantCrash(t, o, 0, wr(99), false, "w99 (never issued)")
	wantCrash(t, o, 0, Decoded{Kind: KindMisdirected, ID: w.ID, LBA: 5}, false, "misdirected")
	wantCrash(t, o, 0, Decoded{Kind: KindTorn, ID: w.ID}, false, "torn")
	// A write to another block landing here is not allowed either.
	v := mustBegin(t, o, OpWrite, 4, 1, 0, false)
	o.Ack(v)
	wantCrash(t, o, 0, wr(v.ID), false, "lba 4+1")
}

func TestOracleAcceptsMaybe(t *testing.T) {
	o := NewOracle(8, true)
	w1 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w1)
	w2 := mustBegin(t, o, OpWrite, 0, 1, 1, false) // in flight at the crash
	_ = w2
	for _, c := range []struct {
		got  Decoded
		want Outcome
	}{{zero(), Durable}, {wr(w1.ID), MaybeOlder}, {wr(w2.ID), MaybeLatest}} {
		o2 := cloneOracle(o)
		out, err := o2.CheckCrash(0, c.got)
		if err != nil || out != c.want {
			t.Fatalf("%v: outcome %v, %v; want %v", c.got, out, err, c.want)
		}
	}
}

// cloneOracle copies an oracle's block states (operations are shared).
func cloneOracle(o *Oracle) *Oracle {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := &Oracle{multiConn: o.multiConn}
	c.mu.blocks = make([]blockState, len(o.mu.blocks))
	for i, b := range o.mu.blocks {
		c.mu.blocks[i] = blockState{touched: b.touched, durable: b.durable, maybe: append([]maybeVal(nil), b.maybe...)}
	}
	c.mu.ops = o.mu.ops
	c.mu.nextID = o.mu.nextID
	c.mu.seq = o.mu.seq
	return c
}

func TestOracleFlushCoversOnlyEarlierAcks(t *testing.T) {
	o := NewOracle(8, true)
	w1 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w1)
	tok := o.FlushStart(1)
	w2 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w2) // acknowledged after the FLUSH was sent: not covered
	o.FlushAck(tok)
	wantCrash(t, cloneOracle(o), 0, zero(), false, "durable")
	wantCrash(t, cloneOracle(o), 0, wr(w1.ID), true, "")
	wantCrash(t, cloneOracle(o), 0, wr(w2.ID), true, "")
	flush(o, 0)
	wantCrash(t, cloneOracle(o), 0, wr(w1.ID), false, "durable {write w2")
}

func TestOracleMultiConn(t *testing.T) {
	for _, multi := range []bool{false, true} {
		o := NewOracle(8, multi)
		w := mustBegin(t, o, OpWrite, 0, 1, 1, false)
		o.Ack(w)
		flush(o, 0) // on another connection
		wantCrash(t, o, 0, zero(), !multi, "durable")
	}
}

func TestOracleStaleAfterOverwrite(t *testing.T) {
	o := NewOracle(8, true)
	w1 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w1)
	flush(o, 0)
	w2 := mustBegin(t, o, OpWrite, 0, 1, 0, true)
	o.Ack(w2)
	wantCrash(t, o, 0, wr(w1.ID), false, "holds write w1")
}

func TestOracleTrimAndZeroes(t *testing.T) {
	o := NewOracle(8, true)
	w1 := mustBegin(t, o, OpWrite, 0, 2, 0, false)
	o.Ack(w1)
	flush(o, 0)
	tr := mustBegin(t, o, OpTrim, 0, 1, 0, false)
	o.Ack(tr)
	z := mustBegin(t, o, OpZero, 1, 1, 0, false)
	o.Ack(z)
	flush(o, 0)
	// Trimmed: zeroes or the old data; write-zeroed: zeroes only.
	wantCrash(t, cloneOracle(o), 0, zero(), true, "")
	wantCrash(t, cloneOracle(o), 0, wr(w1.ID), true, "")
	wantCrash(t, cloneOracle(o), 1, zero(), true, "")
	wantCrash(t, cloneOracle(o), 1, wr(w1.ID), false, "durable {zeroes}")
	if vals, ok := o.Latest(1); !ok || len(vals) != 1 || vals[0] != 0 {
		t.Fatalf("Latest after write-zeroes = %v, %t", vals, ok)
	}
}

func TestOracleAdopts(t *testing.T) {
	o := NewOracle(8, true)
	w1 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w1)
	wantCrash(t, o, 0, wr(w1.ID), true, "") // the unflushed write survived ...
	wantCrash(t, o, 0, zero(), false, "")   // ... so it cannot vanish at the next crash
}

func TestOracleRefusesOverlap(t *testing.T) {
	o := NewOracle(8, true)
	w := mustBegin(t, o, OpWrite, 0, 4, 0, false)
	if _, err := o.Begin(OpWrite, 3, 2, 1, false, 1); err == nil {
		t.Fatal("overlapping in-flight writes accepted")
	}
	if _, ok := o.Latest(1); ok {
		t.Fatal("Latest of a block in flight reported ok")
	}
	o.Ack(w)
	if _, err := o.Begin(OpWrite, 3, 2, 1, false, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := o.Begin(OpWrite, 7, 2, 1, false, 1); err == nil {
		t.Fatal("range past the end accepted")
	}
}

func TestOracleLive(t *testing.T) {
	o := NewOracle(8, true)
	w := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w)
	if err := o.CheckLive(0, zero()); err == nil {
		t.Fatal("live read of zeroes after an acknowledged write accepted")
	}
	if err := o.CheckLive(0, wr(w.ID)); err != nil {
		t.Fatal(err)
	}
	if err := o.CheckLive(1, zero()); err != nil {
		t.Fatal(err)
	}
}

// TestOracleCleanStop: after a clean stop every acknowledged write is
// durable, on any connection and without a FLUSH; one without a reply may
// or may not have landed.
func TestOracleCleanStop(t *testing.T) {
	o := NewOracle(8, false)
	w1 := mustBegin(t, o, OpWrite, 0, 1, 0, false)
	o.Ack(w1)
	w2 := mustBegin(t, o, OpWrite, 1, 1, 3, false)
	o.Ack(w2)
	w3 := mustBegin(t, o, OpWrite, 2, 1, 1, false) // no reply before the stop
	o.CleanStop()
	wantCrash(t, cloneOracle(o), 0, zero(), false, "durable {write w1")
	wantCrash(t, cloneOracle(o), 1, zero(), false, "durable {write w2")
	wantCrash(t, cloneOracle(o), 0, wr(w1.ID), true, "")
	wantCrash(t, cloneOracle(o), 2, zero(), true, "")
	wantCrash(t, cloneOracle(o), 2, wr(w3.ID), true, "")
}
