package device

import (
	"cmp"
	"encoding/binary"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tiercache/tiercache/internal/invariants"
)

// Direct reads and writes of a File go through Linux native AIO
// (io_submit/io_getevents) on the O_DIRECT fd, not pread/pwrite, except
// a read that finds the File idle (invariant 9).
//
// A blocking pread holds an OS thread for the whole device access, so N
// requests in flight cost N threads, each parked in the kernel and woken
// by the completion, and the Go scheduler hands its P to another thread
// every time (a thread switch per request on each side). With AIO a
// request costs a share of one io_submit (requests queued meanwhile are
// submitted together) and a share of one non-blocking io_getevents in the
// reaper goroutine, which wakes the waiting goroutine through a channel,
// or, for a read started with File.StartReadAt, calls its completion
// function itself (no goroutine waits for it: a cache hit served from
// the NBD reader costs no thread hand-off to a waiter).
// The kernel signals completions on an eventfd (IOCB_FLAG_RESFD) that the
// reaper reads through the Go netpoller, so no thread blocks in the
// kernel waiting for the device: the threads stay few and the device sees
// requests in batches. The reaper takes the completions from the ring the
// kernel maps at the context's address (as libaio's and fio's userspace
// reaping do), without an io_getevents call, when the ring has the
// layout this code knows (aioRing); else with a non-blocking io_getevents.
//
// Invariants:
//
//  1. A request is queued, submitted and completed at most once; until its
//     completion is delivered on r.done the kernel may write r's buffer,
//     which stays pinned (r.pin) and reachable from the waiting goroutine.
//  2. Only the goroutine with submitting set calls io_submit; it drains
//     a.pending until it is empty. At most aioDepth requests are queued or
//     in the kernel (a.slots), so io_submit never fails for a full ring.
//  3. a.inflight counts requests from just before io_submit until their
//     completion is delivered (or io_submit refused them). The reaper is
//     started by the first submission and runs until close (which runs
//     with no I/O in flight) sets a.closing: it exits once a.closing is
//     set and a.inflight is 0, and close destroys the context after it.
//     Between bursts it waits, parked in the netpoller, for the eventfd;
//     a reaper started per burst would cost a goroutine and an OS thread
//     woken (newproc's wakep) every time the device fell idle.
//  5. Every completion, and every refusal, adds to the eventfd after its
//     event is reapable (refusals: after inflight dropped), so a reaper
//     reading the eventfd never sleeps through work; a count left over
//     from events already reaped only makes it look once more.
//  4. A request io_submit refused is completed with aioFallback: its
//     caller does the I/O with pread/pwrite itself. A short completion
//     is finished the same way, so the result is exactly that of
//     preadFull/pwriteFull.
//  7. Synchronous writes of one batch that are contiguous on one fd are
//     submitted as one IOCB_CMD_PWRITEV carried by the run's first request
//     (its vcb; the others are its merged followers, in offset order, with
//     their own slots). The kernel copies the iovecs in io_submit, so
//     a.iov is only the submitter's. The run's completion gives each
//     member the part of the result that covers it, followers first and
//     the first request last (its slot, and so its merged list, may be
//     reused once it is delivered); a member the kernel did not reach is
//     finished synchronously by its caller, as a short completion is. A
//     cache appending many writers' blocks to one bucket turns them into
//     one device request.
//  8. While a.plugged > 0 (File.Plug), async requests are queued without
//     being submitted, up to aioPlugMax of them; the last Unplug, a
//     synchronous request (do), or the aioPlugMax-th held request
//     submits everything pending. A plug holds back only async requests,
//     whose starters do not wait for them.
//  6. An async request (start) has no waiting goroutine: its r.async is
//     called once, on the reaper (or, refused, on the submitter) without
//     a.mu held, after its buffer is unpinned and its slot is free; the
//     function must not block (File.StartReadAt hands the synchronous
//     finish of a short or refused read to a new goroutine). What the
//     functions of one reaper pass leave to later runs after the last of
//     them (AsyncReader's batch).
//  9. A synchronous read (do) while nothing is pending, submitted or
//     being read this way is a plain pread on the caller's thread
//     (a.preading set meanwhile): one syscall, where io_submit costs the
//     eventfd, a reaper wake-up and a hand-off back to the caller. At
//     most one such read runs at a time, so they hold at most one thread
//     beyond AIO's; everything else goes through the ring, as does a read
//     that finds a plug holding requests back (its io_submit takes them).

// aioDepth bounds the requests of one File queued or in the kernel.
const aioDepth = 256

// aioPlugMax is the most async requests a plug holds back (invariant 8):
// enough for one io_submit to carry a client's burst of reads, few enough
// that the first of them does not wait long for the last.
const aioPlugMax = 32

const (
	iocbCmdPread   = 0
	iocbCmdPwrite  = 1
	iocbCmdPwritev = 8
)

// A run of contiguous writes of one io_submit batch is submitted as one
// vectored write of at most aioMergeMax requests and aioMergeBytes bytes.
const (
	aioMergeMax   = 64
	aioMergeBytes = 1 << 20
)

// iocb is struct iocb of linux/aio_abi.h (little- and big-endian layouts
// differ only in the order of aio_key and aio_rw_flags, both zero here).
type iocb struct {
	data   uint64
	_      uint32 // aio_key
	_      int32  // aio_rw_flags
	opcode uint16
	_      int16 // aio_reqprio
	fildes uint32
	buf    uint64
	nbytes uint64
	offset int64
	_      uint64 // aio_reserved2
	flags  uint32
	resfd  uint32
}

const iocbFlagResfd = 1 << 0 // IOCB_FLAG_RESFD

// aioRing is the header of struct aio_ring (fs/aio.c), which io_setup
// maps at the context's address; io_events follow it at headerLen. The
// kernel writes an event, then advances tail; the reader advances head
// once it has copied the events out.
type aioRing struct {
	id, nr, head, tail uint32
	magic              uint32
	compat, incompat   uint32
	headerLen          uint32
}

const aioRingMagic = 0xa10a10a1

// ioEvent is struct io_event.
type ioEvent struct {
	data uint64
	_    uint64 // obj
	res  int64
	_    int64 // res2
}

// aioFallback is a completion result meaning "not submitted".
const aioFallback = -1 << 62

type aioReq struct {
	cb   iocb
	slot int
	res  int64
	done chan struct{} // receives the completion (capacity 1); unused by async requests
	// async, if set, is called with the result instead of a send on done
	// (aio.start): on the reaper, after the slot is free again.
	async func(res int64, later func(func()))
	// vcb is the vectored write submitted for this request and its
	// merged followers (invariant 7); merged is empty unless it heads a
	// run. Both belong to the submitter until the run's completion,
	// then to the reaper until this request is delivered.
	vcb    iocb
	merged []*aioReq
	base   *byte // the buffer's first byte (cb.buf as a pointer, for iovecs)
	// pin holds the buffer in place while the kernel has its address: a
	// buffer on the caller's stack would otherwise move if the stack were
	// grown or shrunk while the caller waits (Pin also makes it escape, so
	// the compiler puts it on the heap).
	pin runtime.Pinner
}

type aio struct {
	ctx   uintptr           // aio_context_t
	ring  *aioRing          // the completion ring at ctx; nil: reap with io_getevents
	efd   *os.File          // the eventfd completions are signalled on (non-blocking, netpolled)
	efdN  int               // its descriptor
	slots chan int          // free request slots; a token per request in flight
	reqs  [aioDepth]*aioReq // by slot: the request the kernel's aio_data names
	reap  sync.WaitGroup    // the reaper goroutine, if running

	mu         sync.Mutex // guards the fields below
	pending    []*aioReq  // queued, not yet submitted
	spare      []*aioReq  // the other pending buffer
	submitting bool       // a goroutine is draining pending
	plugged    int        // Plug calls not yet matched by Unplug (invariant 8)
	inflight   int        // submitted, completion not yet delivered
	reaping    bool       // the reaper goroutine runs
	closing    bool       // close waits for the reaper to exit
	cbs        []*iocb    // the submitter's io_submit argument
	heads      []*aioReq  // the submitter's: the request each of cbs stands for
	iov        []unix.Iovec
	followers  uint64 // requests submitted as followers of a run (invariant 7)
	preading   bool   // a synchronous read runs as a pread (invariant 9)
	preads     uint64 // synchronous reads done as a pread (invariant 9)
}

// newAIO sets up an AIO context, or returns nil if the kernel refuses
// (no AIO support, or the system-wide fs.aio-max-nr is used up): the File
// then uses pread/pwrite.
func newAIO() *aio {
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil
	}
	var ctx uintptr
	if _, _, e := unix.Syscall(unix.SYS_IO_SETUP, aioDepth, uintptr(unsafe.Pointer(&ctx)), 0); e != 0 {
		unix.Close(efd)
		return nil
	}
	// A non-blocking descriptor: os.NewFile registers it with the netpoller.
	a := &aio{ctx: ctx, ring: mappedRing(&ctx), efd: os.NewFile(uintptr(efd), "aio-eventfd"), efdN: efd, slots: make(chan int, aioDepth),
		// Never grown: the iocbs of one batch point into it.
		iov: make([]unix.Iovec, 0, aioDepth)}
	for i := range aioDepth {
		a.reqs[i] = &aioReq{slot: i, done: make(chan struct{}, 1)}
		a.slots <- i
	}
	return a
}

// mappedRing returns the completion ring io_setup mapped at *ctx, or nil
// if its header is not the one userspace reaping knows (another magic,
// incompatible features, a header of another size). The address is read
// through ctx's memory so that it becomes a pointer without a uintptr
// conversion: the ring lies outside the Go heap, where the collector
// ignores it.
func mappedRing(ctx *uintptr) *aioRing {
	r := *(**aioRing)(unsafe.Pointer(ctx))
	if r == nil || atomic.LoadUint32(&r.magic) != aioRingMagic || r.incompat != 0 ||
		r.headerLen != uint32(unsafe.Sizeof(aioRing{})) || r.nr == 0 {
		return nil
	}
	return r
}

// reapRing copies up to len(evs) completions out of the ring and frees
// their places; it returns how many. Only the reaper calls it.
func (a *aio) reapRing(evs []ioEvent) int {
	r := a.ring
	nr := r.nr
	head := atomic.LoadUint32(&r.head)
	tail := atomic.LoadUint32(&r.tail) // the events before tail are written
	events := unsafe.Slice((*ioEvent)(unsafe.Add(unsafe.Pointer(r), r.headerLen)), nr)
	n := 0
	for head != tail && n < len(evs) {
		evs[n] = events[head%nr]
		head = (head + 1) % nr
		n++
	}
	if n > 0 {
		atomic.StoreUint32(&r.head, head)
	}
	return n
}

// getEvents takes up to len(evs) completions without waiting: from the
// ring, or through io_getevents.
func (a *aio) getEvents(evs []ioEvent) int {
	if a.ring != nil {
		return a.reapRing(evs)
	}
	zero := unix.Timespec{}
	for {
		n, _, e := unix.Syscall6(unix.SYS_IO_GETEVENTS, a.ctx, 0, uintptr(len(evs)), uintptr(unsafe.Pointer(&evs[0])), uintptr(unsafe.Pointer(&zero)), 0)
		if e == 0 {
			return int(n)
		}
		// EINTR; anything else (EFAULT, EINVAL) is a bug here, not a
		// device failure. The requests are still the kernel's (it may
		// yet write their buffers), so they cannot be failed: keep
		// waiting for them, as for a hung device.
		if e != unix.EINTR {
			invariants.AssertionFailedf("device: io_getevents: %v", e)
			return 0
		}
	}
}

// close destroys the context. REQUIRES: no request in flight.
func (a *aio) close() {
	a.mu.Lock()
	a.closing = true
	if a.reaping {
		a.kickLocked()
	}
	a.mu.Unlock()
	a.reap.Wait()
	unix.Syscall(unix.SYS_IO_DESTROY, a.ctx, 0, 0)
	a.efd.Close()
}

// do reads (cmd iocbCmdPread) or writes p at off on fd, a direct fd:
// offset, length and buffer are aligned. It returns the bytes transferred
// or an error, as preadFull and pwriteFull do.
func (a *aio) do(cmd uint16, fd int, p []byte, off int64) (int, error) {
	if cmd == iocbCmdPread && a.claimIdle() {
		n, err := preadFull(fd, p, off)
		a.mu.Lock()
		a.preading = false
		a.mu.Unlock()
		return n, err
	}
	slot := <-a.slots
	r := a.reqs[slot]
	r.pin.Pin(unsafe.SliceData(p))
	a.queue(r, cmd, fd, p, off)
	<-r.done
	r.pin.Unpin()
	res := r.res
	a.slots <- slot
	var done int
	if res >= 0 && res <= int64(len(p)) {
		done = int(res)
		if done == len(p) {
			return done, nil
		}
	} else if res != aioFallback {
		return 0, unix.Errno(-res)
	}
	// Not submitted, or short: finish synchronously.
	var n int
	var err error
	if cmd == iocbCmdPread {
		n, err = preadFull(fd, p[done:], off+int64(done))
	} else {
		n, err = pwriteFull(fd, p[done:], off+int64(done))
	}
	return done + n, err
}

// claimIdle reports whether nothing is queued, submitted or being read
// with pread, and if so marks a pread running (invariant 9).
func (a *aio) claimIdle() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inflight > 0 || len(a.pending) > 0 || a.submitting || a.preading {
		return false
	}
	a.preading = true
	a.preads++
	return true
}

// start queues a read (cmd iocbCmdPread) or write of p at off on fd, as
// do does, without waiting: done is called with the kernel's result (or
// aioFallback) as invariant 6 says. It returns false, having done
// nothing, when every slot is taken: the caller then uses do, which
// waits for one.
func (a *aio) start(cmd uint16, fd int, p []byte, off int64, done func(res int64, later func(func()))) bool {
	var slot int
	select {
	case slot = <-a.slots:
	default:
		return false
	}
	r := a.reqs[slot]
	r.pin.Pin(unsafe.SliceData(p))
	r.async = done
	a.queue(r, cmd, fd, p, off)
	return true
}

// queue fills r's iocb and submits it with whatever else is pending.
func (a *aio) queue(r *aioReq, cmd uint16, fd int, p []byte, off int64) {
	r.cb = iocb{data: uint64(r.slot), opcode: cmd, fildes: uint32(fd),
		buf: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(p)))), nbytes: uint64(len(p)), offset: off,
		flags: iocbFlagResfd, resfd: uint32(a.efdN)}
	r.base = unsafe.SliceData(p)
	a.mu.Lock()
	a.pending = append(a.pending, r)
	if r.async != nil && a.plugged > 0 && len(a.pending) < aioPlugMax {
		a.mu.Unlock() // held until Unplug (invariant 8)
		return
	}
	if !a.submitting {
		a.submitting = true
		if a.inflight > 0 {
			// The device is busy with other requests, whose callers are
			// likely to issue more: let those that are runnable queue
			// theirs first, so that one io_submit takes them all.
			a.mu.Unlock()
			runtime.Gosched()
			a.mu.Lock()
		}
		a.submitLocked()
	}
	a.mu.Unlock()
}

// plug holds back the submission of async requests (invariant 8).
func (a *aio) plug() {
	a.mu.Lock()
	a.plugged++
	a.mu.Unlock()
}

// unplug ends a plug; the last one submits what the plugs held back.
func (a *aio) unplug() {
	a.mu.Lock()
	a.plugged--
	if a.plugged < 0 {
		invariants.AssertionFailedf("device: Unplug without Plug")
		a.plugged = 0
	}
	if a.plugged == 0 && len(a.pending) > 0 && !a.submitting {
		a.submitting = true
		a.submitLocked()
	}
	a.mu.Unlock()
}

// complete delivers the async request r's result (invariant 6).
// REQUIRES: not a.mu; r.async set and read by the caller into cb.
func (a *aio) complete(r *aioReq, res int64, cb func(int64, func(func())), later func(func())) {
	r.pin.Unpin()
	a.slots <- r.slot
	cb(res, later)
}

// submitLocked submits everything pending until nothing is. It drops a.mu
// around io_submit. REQUIRES: a.mu, a.submitting set by the caller.
func (a *aio) submitLocked() {
	for len(a.pending) > 0 {
		batch := a.pending
		a.pending = a.spare[:0]
		a.inflight += len(batch)
		if !a.reaping {
			a.reaping = true
			a.reap.Add(1)
			go a.reaper()
		}
		// Grouped under a.mu: the reaper, which reads what group wrote,
		// takes it before it delivers (the race detector cannot see that
		// the kernel completes a request after io_submit took it).
		heads := a.group(batch)
		a.mu.Unlock()
		refused := 0
		for i := 0; i < len(a.cbs); {
			n, _, e := unix.Syscall(unix.SYS_IO_SUBMIT, a.ctx, uintptr(len(a.cbs)-i), uintptr(unsafe.Pointer(&a.cbs[i])))
			if e == unix.EINTR {
				continue
			}
			if e != 0 || n == 0 {
				// The kernel took none of them from i on: the first is
				// refused (its caller does it synchronously), and the
				// rest are retried.
				if cb := heads[i].async; cb != nil {
					heads[i].async = nil
					r := heads[i]
					WithLater(func(later func(func())) { a.complete(r, aioFallback, cb, later) })
					refused++
				} else {
					refused += a.deliver(heads[i], aioFallback)
				}
				i++
				continue
			}
			i += int(n)
		}
		// The kernel has copied the iovecs: they must not keep the
		// callers' buffers reachable.
		clear(a.cbs)
		clear(a.iov)
		clear(heads)
		a.heads = heads[:0]
		clear(batch)
		a.mu.Lock()
		a.inflight -= refused
		a.spare = batch[:0]
		if refused > 0 {
			a.kickLocked()
		}
	}
	a.submitting = false
}

// group fills a.cbs with batch's iocbs, one per run of contiguous
// synchronous writes (invariant 7), and returns the request each stands
// for. It sorts batch by fd and offset: the requests of one batch are
// concurrent, so the kernel owes them no order.
func (a *aio) group(batch []*aioReq) []*aioReq {
	a.cbs, a.iov = a.cbs[:0], a.iov[:0]
	heads := a.heads[:0]
	mergeable := func(r *aioReq) bool { return r.async == nil && r.cb.opcode == iocbCmdPwrite }
	if len(batch) > 1 {
		slices.SortFunc(batch, func(x, y *aioReq) int {
			if c := cmp.Compare(x.cb.fildes, y.cb.fildes); c != 0 {
				return c
			}
			return cmp.Compare(x.cb.offset, y.cb.offset)
		})
	}
	for i := 0; i < len(batch); {
		r := batch[i]
		i++
		heads = append(heads, r)
		if !mergeable(r) {
			a.cbs = append(a.cbs, &r.cb)
			continue
		}
		end, total := r.cb.offset+int64(r.cb.nbytes), r.cb.nbytes
		for i < len(batch) && len(r.merged)+1 < aioMergeMax {
			n := batch[i]
			if !mergeable(n) || n.cb.fildes != r.cb.fildes || n.cb.offset != end || total+n.cb.nbytes > aioMergeBytes {
				break
			}
			r.merged = append(r.merged, n)
			end += int64(n.cb.nbytes)
			total += n.cb.nbytes
			i++
		}
		if len(r.merged) == 0 {
			a.cbs = append(a.cbs, &r.cb)
			continue
		}
		first := len(a.iov)
		a.iov = append(a.iov, unix.Iovec{Base: r.base, Len: r.cb.nbytes})
		for _, m := range r.merged {
			a.iov = append(a.iov, unix.Iovec{Base: m.base, Len: m.cb.nbytes})
		}
		a.followers += uint64(len(r.merged))
		r.vcb = r.cb
		r.vcb.opcode = iocbCmdPwritev
		r.vcb.buf = uint64(uintptr(unsafe.Pointer(&a.iov[first])))
		r.vcb.nbytes = uint64(len(a.iov) - first)
		a.cbs = append(a.cbs, &r.vcb)
	}
	// An idle slot must not keep its last caller's buffer reachable.
	for _, r := range batch {
		r.base = nil
	}
	return heads
}

// deliver completes the synchronous request r, and the followers of a run
// it heads, with the run's result res (invariant 7), and returns how many
// requests that was. REQUIRES: a.mu or the submitter's refusal path.
func (a *aio) deliver(r *aioReq, res int64) int {
	if len(r.merged) == 0 {
		r.res = res
		r.done <- struct{}{}
		return 1
	}
	share := func(m *aioReq) {
		switch {
		case res < 0: // an error, or not submitted: each member's own
			m.res = res
		default:
			m.res = min(res, int64(m.cb.nbytes))
			res -= m.res
		}
	}
	share(r)
	own := r.res
	for _, m := range r.merged {
		share(m)
		m.done <- struct{}{}
	}
	n := 1 + len(r.merged)
	clear(r.merged)
	r.merged = r.merged[:0]
	r.res = own
	r.done <- struct{}{}
	return n
}

// kickLocked makes the reaper look at a.inflight again.
// REQUIRES: a.mu
func (a *aio) kickLocked() {
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	// Only EAGAIN (the counter at its maximum) can fail it, and then the
	// reaper has a count to read anyway.
	unix.Write(a.efdN, one[:])
}

// reaper delivers completions until close (invariant 3).
func (a *aio) reaper() {
	defer a.reap.Done()
	var evs [64]ioEvent
	type asyncDone struct {
		r   *aioReq
		res int64
		cb  func(int64, func(func()))
	}
	var async []asyncDone
	// What the completions of a pass leave for after the last of them.
	var pass []func()
	later := func(f func()) { pass = append(pass, f) }
	var cnt [8]byte
	for {
		// Wait in the netpoller for the eventfd; reading it resets the
		// count. Its only failure would be a closed file, and close
		// waits for this goroutine.
		if _, err := a.efd.Read(cnt[:]); err != nil {
			invariants.AssertionFailedf("device: reading the AIO eventfd: %v", err)
		}
		for {
			n := a.getEvents(evs[:])
			// Under a.mu, which the request's caller held after taking
			// the slot: the race detector cannot see the kernel order
			// it after the slot's previous use. r.done has room: one
			// completion per submission.
			a.mu.Lock()
			delivered := 0
			for _, ev := range evs[:n] {
				r := a.reqs[ev.data%aioDepth]
				if cb := r.async; cb != nil {
					r.async = nil
					async = append(async, asyncDone{r, ev.res, cb})
					delivered++
					continue
				}
				delivered += a.deliver(r, ev.res)
			}
			a.inflight -= delivered
			last := a.closing && a.inflight == 0
			if last {
				a.reaping = false
			}
			a.mu.Unlock()
			for i, d := range async {
				a.complete(d.r, d.res, d.cb, later)
				async[i] = asyncDone{}
			}
			async = async[:0]
			for i, f := range pass {
				f()
				pass[i] = nil
			}
			pass = pass[:0]
			if last {
				return
			}
			if n < len(evs) {
				break // the ring is empty for now: wait for the eventfd
			}
		}
	}
}
