// Package nbd implements the Network Block Device protocol: a server that
// exports Backends to the Linux kernel, QEMU, libnbd and fio, and a client
// used by tests, as a remote backing device and by the crash harness.
//
// The protocol is doc/proto.md of github.com/NetworkBlockDevice/nbd. Only
// fixed newstyle negotiation is spoken, with NBD_OPT_EXPORT_NAME, INFO, GO,
// LIST, ABORT, STRUCTURED_REPLY, the base:allocation meta context (reported
// as one allocated extent) and STARTTLS. Without Config.TLSConfig, STARTTLS
// gets NBD_REP_ERR_POLICY; with it TLS is optional, and with
// Config.RequireTLS as well the server runs the spec's FORCEDTLS mode. The handshake reads nothing
// ahead of an option's data, so after the STARTTLS reply the connection is
// swapped for a tls.Conn in place. Extended headers are not supported
// (NBD_REP_ERR_UNSUP), so lengths are 32-bit.
//
// Block sizes: an export advertises its minimum, preferred and maximum
// block size (default 1, 4096, 32 MiB) in every NBD_OPT_INFO/GO reply and
// enforces them on every request: misaligned requests, and READ, WRITE,
// CACHE or WRITE_ZEROES (without FAST_ZERO) longer than the maximum fail
// with EINVAL; a WRITE payload is discarded to keep the stream in sync,
// unless longer than 64 MiB, which closes the connection. Requests beyond
// the end fail with ENOSPC for WRITE and WRITE_ZEROES, EINVAL otherwise;
// writes, trims and zeroes on a read-only export with EPERM.
//
// # Server design
//
// Each connection has three roles:
//
//   - One reader goroutine parses request headers through a bufio.Reader,
//     validates them (command, flags, alignment, range, read-only, block
//     size limits) and answers invalid ones with an error at once. A WRITE
//     payload is read into a pooled buffer before the request is handed
//     on; an invalid WRITE's payload is read and discarded so the stream
//     stays in sync. Only the reader touches the input stream, so request
//     framing needs no lock. A READ the Backend can start without a
//     goroutine waiting for it (AsyncReader: a cache hit) the reader starts
//     itself; while more requests wait in its buffer it plugs the Backend
//     (Plugger), which holds those reads' device I/O back and sends it
//     together, and it unplugs before it waits for anything. A READ that
//     arrived alone, with no other request in flight, the reader serves
//     itself, waiting for the backend (HitReader: a cache hit): its client
//     waits for the reply before sending more.
//   - Workers (a per-connection pool, grown on demand up to
//     Config.MaxWorkers and kept until the connection ends, so the steady
//     state allocates nothing) execute requests against the Backend
//     concurrently. A slow request never holds up the others: replies go out
//     in completion order, matched by handle, as the protocol allows.
//   - One writer at a time: a finished worker queues its reply; if nobody
//     is writing it becomes the writer and sends everything queued, header
//     and data of each reply together, with one writev (net.Buffers) per
//     batch, until the queue is empty. Replies never interleave. With one
//     request in flight the reply goes out at once; with more, the new
//     writer first yields once so that replies finishing meanwhile join
//     its batch. A success header is only ever queued after
//     the backend call succeeded, and a READ's data is complete before its
//     header is queued, so an error can always still be reported.
//
// The reader acquires the bytes of every READ and WRITE (and 1 KiB for any
// other request) from a per-connection budget (Config.MaxInFlightBytes),
// released when the reply has been written, and stops reading while the
// budget is used up: a client cannot make the server buffer unbounded data,
// even one that never reads its replies. Buffers come from size-classed
// sync.Pools; requests, buffers and workers are reused, so a request costs
// no allocation in the steady state. The Client uses the same batching for
// requests.
//
// # Ordering and durability
//
// The server never reorders a request relative to its reply: a reply is sent
// only when the backend call has returned. The Backend contract makes a
// completed WriteAt visible to every later ReadAt on any connection, and
// makes Flush cover every write completed before it on any connection. So
// NBD_CMD_FLUSH, which must cover every write already replied to, is a plain
// Backend.Flush with no barrier in the server, FUA is passed down to the
// backend, and NBD_FLAG_CAN_MULTI_CONN is advertised.
//
// NBD_CMD_DISC stops the reader; the in-flight requests finish and are
// replied to, the backend is flushed and the connection closed. A client
// that vanishes is handled the same way minus the flush. Server.Shutdown
// stops accepting, closes connections still negotiating, answers requests
// already received but not yet started with ESHUTDOWN, drains the rest the
// same way and then flushes every export.
//
// Backend errors are mapped to NBD error values by errnoFor alone, and
// logged with export, command, offset and length.
package nbd
