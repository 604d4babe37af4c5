package nbd

import "golang.org/x/sys/unix"

// maxIOV is the most buffers one writev takes (IOV_MAX).
const maxIOV = 1024

// tryWrite writes as much of bufs as the socket takes without waiting,
// in one writev, and returns the bytes written: fewer than all (0
// included) when the socket's buffer is full or there is no raw socket
// (c.rc nil), the caller then writing the rest with a blocking write. An
// error is a failed connection.
func (c *conn) tryWrite(bufs [][]byte) (int, error) {
	if c.rc == nil {
		return 0, nil
	}
	if len(bufs) > maxIOV {
		bufs = bufs[:maxIOV]
	}
	var n int
	var err error
	if rerr := c.rc.Write(func(fd uintptr) bool {
		for {
			n, err = unix.Writev(int(fd), bufs)
			if err != unix.EINTR {
				return true // done: never wait in the poller
			}
		}
	}); rerr != nil {
		return 0, rerr
	}
	if err != nil {
		if err == unix.EAGAIN {
			return 0, nil
		}
		return 0, err
	}
	return n, nil
}
