// Package crashtest kills an NBD server with SIGKILL while real clients
// write to it, restarts it, and checks that nothing acknowledged as durable
// was lost and nothing that was never written appears (design invariants 1
// and 2 across process crashes).
//
// Unit tests of the cache engine crash-clone in-memory devices; they cannot
// show that the whole process (NBD server, reply batching, journal group
// commit, O_DIRECT files, recovery at start) keeps its promises when the
// kernel ends it between two instructions. This package drives a real
// server through nbd.Client, over several connections, and is independent
// of how that server is started: the caller supplies a Server (start, kill)
// and a way to dial it, so the same harness runs against the race-built
// tiercache binary in internal/interop and against an in-process fake in its
// own tests.
//
// # Method
//
// Every 4 KiB block written carries a stamp (see stamp.go): magic, run
// seed, LBA, write id and a CRC32-C over the block. A block read back
// therefore names the write that put it there, or shows itself to be zero,
// torn, misdirected or foreign.
//
// The Oracle keeps three states per block (STYLE example 5): the durable
// contents, the maybe-new contents written since (in flight or
// acknowledged), and promotion: a FLUSH reply makes durable every write
// acknowledged before the FLUSH was sent (on any connection when the server
// advertises NBD_FLAG_CAN_MULTI_CONN, else on the same connection), a FUA
// reply makes its own write durable. After a kill, each block must hold its
// durable contents or one of the maybe-new ones; whatever it holds becomes
// the new durable contents.
//
// Writers never have two writes to one block in flight at once (they claim
// blocks), so each block's writes are totally ordered and "the latest write
// acknowledged before the FLUSH" is well defined.
//
// Each cycle kills the server during writes, right after a FLUSH reply
// (other writers still going) or when the clients have gone idle (background
// writeback running); some cycles kill it again right after the restart,
// and, for a Server that implements StartKiller, during its start-up
// (recovery). Reads between kills are checked against the latest write
// (invariant 1 without a crash).
//
// # Replay
//
// A run is driven by Config.Seed: the operations each connection issues
// and the moment and kind of each kill are functions of (seed, cycle,
// connection). Thread scheduling is not, so a replay repeats the workload
// and the kill plan, not the exact interleaving. A Failure carries the seed,
// the cycle and the tail of the operation log.
package crashtest
