package cache

// Routing: where a write, write-zeroes or trim of whole blocks goes.
//
// route is the one decision, a pure function of the volume's state at the
// request (routeIn) to a destination (routeOut), tested over its whole
// table. Volume.write, WriteZeroes and Trim compute the inputs, carry out
// what it says (routeBlocks), and do nothing else to decide.

// routeOp is the kind of request being routed.
type routeOp uint8

const (
	opWrite  routeOp = iota // data
	opZeroes                // whole blocks of write-zeroes
	opTrim                  // whole blocks of a trim (the backing device can discard)
)

func (o routeOp) String() string { return [...]string{"write", "zeroes", "trim"}[o] }

// routeIn is what routing looks at.
type routeIn struct {
	mode Mode
	op   routeOp
	// seq: the request belongs to a sequential stream past the cutoff
	// (policy.go).
	seq bool
	// failed: the cache device failed over (failover.go).
	failed bool
	// olderDirty: epoch order (not degraded), and dirty versions of
	// epochs before the current one are in the cache, so nothing may go
	// to the backing device before them.
	olderDirty bool
	// small: at most epochZeroInCache bytes (zeroes and trims written
	// into the cache as zero blocks instead).
	small bool
	// keeps: the backing device keeps unsynced writes (device.SyncKeeper,
	// an object-store image): whatever goes to it is durable only once a
	// sync stores it, and that sync needs the store.
	keeps bool
}

// dest is where a request goes.
type dest uint8

const (
	toCacheDirty dest = iota // into the cache, dirty (written back later)
	toCacheClean             // into the cache and to the backing device (writethrough)
	toAround                 // to the backing device, dropping cached copies (passthrough)
	toNothing                // a trim that is skipped (a trim may leave the old data)
)

func (d dest) String() string {
	return [...]string{"cache-dirty", "cache-clean", "around", "nothing"}[d]
}

// routeOut is route's decision.
type routeOut struct {
	dest dest
	// why: the bypass counter of a write around the cache.
	why bypassReason
	// degrade: leave epoch order first (order.go), with this reason; the
	// rest of the decision assumes it succeeded.
	degrade degradeReason
	// deferred: written into the cache only because older epochs are
	// dirty (VolumeStats.EpochDeferBytes).
	deferred bool
}

// olderDirtyMatters reports whether route's decision for in can depend
// on olderDirty: a random write in writeback mode goes into the cache
// dirty whatever older epochs hold, and a failed set sends everything
// around. Routing skips the index walk (and the set lock) olderDirty costs
// where it cannot change the answer, which is every hot-path write.
func (in routeIn) olderDirtyMatters() bool {
	return !in.failed && !(in.op == opWrite && in.mode == Writeback && !in.seq) && !in.keepsInCache()
}

// keepsInCache: a write-zeroes or trim in writeback mode over a backing
// that keeps unsynced writes. Nothing of it goes to the backing device:
// there it would wait in memory for a sync, and every later FLUSH or FUA
// would then need the store (a stream of writes is absorbed for the same
// reason, seqWrite).
func (in routeIn) keepsInCache() bool {
	return in.keeps && in.mode == Writeback && in.op != opWrite
}

// route decides where a request goes. After failover everything goes
// around the cache (fenced blocks are refused there: passthrough). In
// epoch order with older epochs dirty, nothing may reach the backing
// device before them: small requests go into the cache as dirty data of
// the current epoch; a sequential stream or a large write-zeroes degrades
// the volume to lba order instead of waiting; a large trim does nothing.
// Otherwise the mode decides, and a sequential stream bypasses writeback
// and writethrough. In writeback mode over a backing that keeps unsynced
// writes, write-zeroes of any size and small trims go into the cache as
// dirty zero blocks and a large trim does nothing, whatever older epochs
// hold: a FLUSH or FUA then needs only the cache device.
func route(in routeIn) routeOut {
	if in.failed {
		if in.op == opWrite {
			return routeOut{dest: toAround, why: bypassFailed}
		}
		return routeOut{dest: toAround, why: bypassMode}
	}
	if in.keepsInCache() {
		if in.op == opZeroes || in.small {
			return routeOut{dest: toCacheDirty}
		}
		return routeOut{dest: toNothing}
	}
	if in.olderDirty {
		switch {
		case in.op == opWrite && in.seq:
			out := route(routeIn{mode: in.mode, op: in.op, seq: true, small: in.small})
			out.degrade = degradeSequential
			return out
		case in.op == opWrite && in.mode == Writeback:
			return routeOut{dest: toCacheDirty}
		case in.op == opWrite || in.small:
			return routeOut{dest: toCacheDirty, deferred: true}
		case in.op == opZeroes:
			return routeOut{dest: toAround, why: bypassMode, degrade: degradeLargeZeroes}
		default:
			return routeOut{dest: toNothing}
		}
	}
	switch {
	case in.op != opWrite:
		return routeOut{dest: toAround, why: bypassMode}
	case in.seq && (in.mode == Writeback || in.mode == Writethrough):
		return routeOut{dest: toAround, why: bypassSequential}
	case in.mode == Writeback:
		return routeOut{dest: toCacheDirty}
	case in.mode == Writethrough:
		return routeOut{dest: toCacheClean}
	default:
		return routeOut{dest: toAround, why: bypassMode}
	}
}
