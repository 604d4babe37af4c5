package nbd

// Backend is what an export serves: the cache engine's volume, or a plain
// device. It is the only way the protocol layer reaches storage, so the
// ordering rules of NBD (FLUSH covers every write completed before it, FUA
// makes one write durable before its reply) are the Backend's contract:
//
//   - ReadAt fills p entirely or returns an error.
//   - WriteAt returns only when the write is complete (visible to every later
//     ReadAt on any connection); with fua it is also durable.
//   - Flush returns only when every write completed before the call is
//     durable, whichever connection sent it. That is what lets an export
//     advertise NBD_FLAG_CAN_MULTI_CONN.
//
// Implementations must be safe for concurrent use.
type Backend interface {
	Size() int64
	ReadAt(p []byte, off int64) error
	WriteAt(p []byte, off int64, fua bool) error
	Flush() error
}

// AsyncReader is implemented by backends that can serve some reads without
// a goroutine waiting for them (the cache engine's whole-block hits). The
// connection's reader offers every READ to StartReadAt first; when it
// returns true, done is called exactly once with what ReadAt would have
// returned (the same contract: p is filled entirely, or an error), from
// another goroutine, and must not block; when it returns false nothing
// was done, and the READ goes to a worker's ReadAt. done may call
// later(f) to have f run on the same goroutine once the completions
// delivered with this one (the backend's batch) have all returned; f must
// not block either. The connection writes the replies of a batch then, in
// one writev.
type AsyncReader interface {
	StartReadAt(p []byte, off int64, done func(err error, later func(func()))) bool
}

// HitReader is implemented by AsyncReaders that can also serve the reads
// StartReadAt would start while the caller waits. The connection's reader
// serves a READ that arrived alone, with no other request buffered or in
// flight, with ReadHitAt on its own goroutine: such a client waits for the
// reply before it sends more, so a hand-off to another goroutine and back
// would only add wake-ups. ReadHitAt returns false, having done nothing,
// when the read is not one it serves (the READ then goes to StartReadAt);
// else true and what ReadAt would have returned.
type HitReader interface {
	ReadHitAt(p []byte, off int64) (bool, error)
}

// Plugger is implemented by AsyncReaders that can hold back the device
// I/O of the reads StartReadAt starts until Unplug, to send them to the
// device together. The connection's reader plugs while it starts READs
// that the client has already sent (they are in its read buffer), and
// unplugs before it waits for anything: the socket, the in-flight budget,
// a worker. Every Plug is matched by one Unplug.
type Plugger interface {
	Plug()
	Unplug()
}

// Trimmer is implemented by backends that support NBD_CMD_TRIM. After a
// successful Trim the range may read as zeroes or as the old data.
type Trimmer interface {
	Trim(off, length int64, fua bool) error
}

// ZeroWriter is implemented by backends that support NBD_CMD_WRITE_ZEROES.
// mayTrim is false when the client sent NBD_CMD_FLAG_NO_HOLE. When fastOnly
// is set (NBD_CMD_FLAG_FAST_ZERO) the backend must fail with an error that
// wraps errors.ErrUnsupported unless it can zero faster than writing zeroes.
type ZeroWriter interface {
	WriteZeroes(off, length int64, fua, mayTrim, fastOnly bool) error
}

// Prefetcher is implemented by backends that support NBD_CMD_CACHE: bring
// the range into the cache tier without returning data.
type Prefetcher interface {
	Prefetch(off, length int64) error
}
