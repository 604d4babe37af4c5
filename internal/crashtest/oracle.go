package crashtest

import (
	"fmt"
	"slices"
	"strings"
	"sync"
)

// OpKind is the kind of a tracked modifying operation.
type OpKind int

const (
	// OpWrite writes stamped blocks.
	OpWrite OpKind = iota
	// OpZero is NBD_CMD_WRITE_ZEROES: the blocks read as zeroes.
	OpZero
	// OpTrim is NBD_CMD_TRIM. NBD lets trimmed blocks read as anything;
	// tiercache (and nbd.Trimmer) promise zeroes or the old data, and the
	// oracle holds the server to that.
	OpTrim
)

func (k OpKind) String() string {
	switch k {
	case OpWrite:
		return "write"
	case OpZero:
		return "write-zeroes"
	}
	return "trim"
}

// Op is one modifying operation the oracle tracks. Its ID is also the
// write id stamped into the blocks of an OpWrite.
type Op struct {
	ID    uint64
	Kind  OpKind
	LBA   int64 // first block
	N     int64 // blocks
	Conn  int
	FUA   bool
	Cycle int

	acked  bool
	ackSeq uint64 // position in the oracle's completion order
}

func (op *Op) String() string {
	s := fmt.Sprintf("%s w%d lba %d+%d conn %d cycle %d", op.Kind, op.ID, op.LBA, op.N, op.Conn, op.Cycle)
	if op.FUA {
		s += " fua"
	}
	if op.acked {
		return s + " (acknowledged)"
	}
	return s + " (in flight or failed)"
}

// maybeVal is one operation's effect on one block, not yet known durable.
type maybeVal struct {
	op   *Op
	vals []uint64 // contents it may leave: its write id, or 0, or (trim) 0 plus the previous contents
}

// blockState is the three-state record of one block.
type blockState struct {
	touched bool
	durable []uint64   // contents if none of maybe landed (usually one)
	maybe   []maybeVal // in issue order
}

// Oracle is the three-state model of an export's blocks (STYLE example 5,
// design invariant 2). It is safe for concurrent use. The caller must not
// have two operations on one block in flight at once (Begin refuses), which
// makes each block's history a sequence.
//
// Blocks start durable-zero: the export must read as zeroes before the run.
type Oracle struct {
	mu struct {
		sync.Mutex // guards the fields below
		blocks     []blockState
		ops        map[uint64]*Op
		nextID     uint64
		seq        uint64 // completion counter
	}
	multiConn bool
}

// NewOracle tracks blocks [0, blocks). With multiConn (the server advertises
// NBD_FLAG_CAN_MULTI_CONN) a FLUSH covers writes acknowledged on every
// connection; otherwise only those on the FLUSH's connection.
func NewOracle(blocks int64, multiConn bool) *Oracle {
	o := &Oracle{multiConn: multiConn}
	o.mu.blocks = make([]blockState, blocks)
	o.mu.ops = make(map[uint64]*Op)
	return o
}

// Blocks returns the number of tracked blocks.
func (o *Oracle) Blocks() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	return int64(len(o.mu.blocks))
}

// Begin records an operation about to be sent: from now on its contents are
// maybe-new in each of its blocks. It fails if the range is out of bounds or
// a block already has an operation in flight.
func (o *Oracle) Begin(kind OpKind, lba, n int64, conn int, fua bool, cycle int) (*Op, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if lba < 0 || n <= 0 || lba+n > int64(len(o.mu.blocks)) {
		return nil, fmt.Errorf("crashtest: range %d+%d outside %d blocks", lba, n, len(o.mu.blocks))
	}
	for b := lba; b < lba+n; b++ {
		if m := o.mu.blocks[b].maybe; len(m) > 0 && !m[len(m)-1].op.acked {
			return nil, fmt.Errorf("crashtest: block %d already has %v in flight", b, m[len(m)-1].op)
		}
	}
	o.mu.nextID++
	op := &Op{ID: o.mu.nextID, Kind: kind, LBA: lba, N: n, Conn: conn, FUA: fua, Cycle: cycle}
	o.mu.ops[op.ID] = op
	for b := lba; b < lba+n; b++ {
		bs := &o.mu.blocks[b]
		bs.touched = true
		var vals []uint64
		switch kind {
		case OpWrite:
			vals = []uint64{op.ID}
		case OpZero:
			vals = []uint64{0}
		case OpTrim:
			prev := bs.durable
			if len(bs.maybe) > 0 {
				prev = bs.maybe[len(bs.maybe)-1].vals
			}
			vals = union([]uint64{0}, prev)
		}
		bs.maybe = append(bs.maybe, maybeVal{op: op, vals: vals})
	}
	return op, nil
}

// Ack records op's successful reply. A FUA reply promotes op's contents to
// durable in its blocks.
func (o *Oracle) Ack(op *Op) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.mu.seq++
	op.acked, op.ackSeq = true, o.mu.seq
	if !op.FUA {
		return
	}
	for b := op.LBA; b < op.LBA+op.N; b++ {
		bs := &o.mu.blocks[b]
		for i := len(bs.maybe) - 1; i >= 0; i-- {
			if bs.maybe[i].op == op {
				bs.promoteLocked(i)
				break
			}
		}
	}
}

// promoteLocked makes maybe[i] durable, dropping it and everything before it.
func (bs *blockState) promoteLocked(i int) {
	bs.durable = bs.maybe[i].vals
	bs.maybe = slices.Delete(bs.maybe, 0, i+1)
}

// FlushToken is a FLUSH in flight: the completion position when it was sent.
type FlushToken struct {
	conn int
	seq  uint64
}

// FlushStart records a FLUSH about to be sent on conn.
func (o *Oracle) FlushStart(conn int) FlushToken {
	o.mu.Lock()
	defer o.mu.Unlock()
	return FlushToken{conn: conn, seq: o.mu.seq}
}

// FlushAck records the FLUSH's successful reply: in every block, the latest
// operation acknowledged before the FLUSH was sent (on a covered
// connection) becomes durable.
func (o *Oracle) FlushAck(f FlushToken) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for b := range o.mu.blocks {
		bs := &o.mu.blocks[b]
		for i := len(bs.maybe) - 1; i >= 0; i-- {
			op := bs.maybe[i].op
			if op.acked && op.ackSeq <= f.seq && (o.multiConn || op.Conn == f.conn) {
				bs.promoteLocked(i)
				break
			}
		}
	}
}

// CleanStop records that the server stopped cleanly (SIGTERM, exit status
// 0) after every client operation ended: it answered what it had taken in,
// flushed every export and exited, so in every block the latest
// acknowledged operation is durable, on any connection, whatever the
// server advertised (tiercache's documented shutdown). Operations without a
// reply stay maybe-new: the server may have stopped before reading them.
func (o *Oracle) CleanStop() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for b := range o.mu.blocks {
		bs := &o.mu.blocks[b]
		for i := len(bs.maybe) - 1; i >= 0; i-- {
			if bs.maybe[i].op.acked {
				bs.promoteLocked(i)
				break
			}
		}
	}
}

// Latest returns the contents block lba must read as now, with no crash in
// between (invariant 1), or ok false when an operation on it is in flight.
// A trimmed block may hold more than one value.
func (o *Oracle) Latest(lba int64) (vals []uint64, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	bs := &o.mu.blocks[lba]
	if len(bs.maybe) == 0 {
		return bs.durable0(), true
	}
	last := bs.maybe[len(bs.maybe)-1]
	if !last.op.acked {
		return nil, false
	}
	return last.vals, true
}

func (bs *blockState) durable0() []uint64 {
	if bs.durable == nil {
		return []uint64{0}
	}
	return bs.durable
}

// Touched returns the blocks ever named by an operation, ascending.
func (o *Oracle) Touched() []int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []int64
	for b := range o.mu.blocks {
		if o.mu.blocks[b].touched {
			out = append(out, int64(b))
		}
	}
	return out
}

// Outcome says which allowed state a block was found in after a crash.
type Outcome int

const (
	// Durable: the block holds its durable contents (no maybe-new write
	// landed, or the latest maybe equals it).
	Durable Outcome = iota
	// MaybeLatest: the latest maybe-new contents landed.
	MaybeLatest
	// MaybeOlder: an older maybe-new contents landed (a later unflushed
	// write was lost, which a crash allows).
	MaybeOlder
)

// CheckCrash checks a block read back after a crash: it must hold its
// durable contents or one maybe-new contents. On success the observed
// contents become durable. The error names what the block holds, the write
// that put it there and what was allowed.
func (o *Oracle) CheckCrash(lba int64, got Decoded) (Outcome, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	bs := &o.mu.blocks[lba]
	var v uint64
	switch got.Kind {
	case KindZero:
		v = 0
	case KindWrite:
		v = got.ID
	default:
		return 0, fmt.Errorf("block %d holds %v; allowed %s", lba, got, o.allowedLocked(bs))
	}
	out := Durable
	found := slices.Contains(bs.durable0(), v)
	if !found {
		for i := len(bs.maybe) - 1; i >= 0; i-- {
			if slices.Contains(bs.maybe[i].vals, v) {
				found = true
				out = MaybeOlder
				if i == len(bs.maybe)-1 {
					out = MaybeLatest
				}
				break
			}
		}
	}
	if !found {
		return 0, fmt.Errorf("block %d holds %s; allowed %s", lba, o.describeLocked(v), o.allowedLocked(bs))
	}
	bs.durable = []uint64{v}
	bs.maybe = nil
	return out, nil
}

// CheckLive checks a block read with no crash since its last operation and
// no operation in flight on it (invariant 1): it must hold the latest
// contents.
func (o *Oracle) CheckLive(lba int64, got Decoded) error {
	vals, ok := o.Latest(lba)
	if !ok {
		return fmt.Errorf("crashtest: live check of block %d with an operation in flight", lba)
	}
	if (got.Kind == KindZero && slices.Contains(vals, 0)) || (got.Kind == KindWrite && slices.Contains(vals, got.ID)) {
		return nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	what := got.String()
	if got.Kind == KindWrite {
		what = o.describeLocked(got.ID)
	}
	return fmt.Errorf("block %d reads %s; the latest completed operation left %s", lba, what, o.valsLocked(vals))
}

func (o *Oracle) describeLocked(v uint64) string {
	if v == 0 {
		return "zeroes"
	}
	if op, ok := o.mu.ops[v]; ok {
		return op.String()
	}
	return fmt.Sprintf("w%d (never issued)", v)
}

func (o *Oracle) valsLocked(vals []uint64) string {
	var s []string
	for _, v := range vals {
		s = append(s, o.describeLocked(v))
	}
	return "{" + strings.Join(s, " | ") + "}"
}

func (o *Oracle) allowedLocked(bs *blockState) string {
	s := "durable " + o.valsLocked(bs.durable0())
	if len(bs.maybe) > 0 {
		var m []string
		for _, mv := range bs.maybe {
			m = append(m, o.valsLocked(mv.vals))
		}
		s += ", maybe " + strings.Join(m, ", ")
	}
	return s
}

func union(a, b []uint64) []uint64 {
	out := slices.Clone(a)
	for _, v := range b {
		if !slices.Contains(out, v) {
			out = append(out, v)
		}
	}
	return out
}
