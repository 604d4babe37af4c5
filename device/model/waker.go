package model

import (
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// waker is the real clock's sleep: one ppoll with a nanosecond timeout on
// an eventfd, which poke can interrupt. A loaded machine delays every
// wake-up of a thread, so one precise wake-up per event beats a timer
// followed by a train of short nanosleeps (each of which would be delayed),
// and, unlike a bare nanosleep, a new earlier event is not missed.
type waker struct {
	efd     int
	polling atomic.Bool // the loop is (about to be) in ppoll: poke must write efd
}

func newWaker() (*waker, error) {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	return &waker{efd: fd}, nil
}

// wake interrupts a sleep in progress (or the next one, if it is about to
// start). Cheap when the loop is not sleeping: no system call.
func (w *waker) wake() {
	if w.polling.Load() {
		one := [8]byte{1}
		_, _ = unix.Write(w.efd, one[:]) // EAGAIN: the counter is already set
	}
}

// sleep waits for d or a wake, whichever comes first; it reports whether it
// was woken. A kick already pending on kick counts as a wake.
func (w *waker) sleep(d time.Duration, kick <-chan struct{}, stop <-chan struct{}) bool {
	w.polling.Store(true)
	defer w.polling.Store(false)
	// A poke after this check writes efd, so it cannot be lost.
	select {
	case <-kick:
		return true
	case <-stop:
		return true
	default:
	}
	ts := unix.NsecToTimespec(int64(d))
	fds := []unix.PollFd{{Fd: int32(w.efd), Events: unix.POLLIN}}
	n, _ := unix.Ppoll(fds, &ts, nil) // EINTR: waking early is harmless
	if n > 0 {
		var buf [8]byte
		_, _ = unix.Read(w.efd, buf[:])
		select { // the poke's channel send, if it got there
		case <-kick:
		default:
		}
		return true
	}
	return false
}

func (w *waker) close() { _ = unix.Close(w.efd) }
