package nbd

import (
	"errors"
	"fmt"
	"syscall"
)

// Error is an error reply from an NBD server (or, on the server side, an
// error a Backend may return to choose the exact errno sent to the client).
type Error struct {
	Errno   uint32 // NBD error value: EPERM, EIO, EINVAL, ...
	Op      string // command, e.g. "READ"
	Offset  uint64
	Length  uint32
	Message string // optional human-readable text from a structured reply
}

func (e *Error) Error() string {
	s := fmt.Sprintf("nbd: %s offset %d length %d: %s", e.Op, e.Offset, e.Length, errnoString(e.Errno))
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Is lets errors.Is match an *Error against the equivalent syscall errno
// (errors.Is(err, syscall.ENOSPC)) and ErrUnsupported for ENOTSUP.
func (e *Error) Is(target error) bool {
	switch target {
	case errors.ErrUnsupported:
		return e.Errno == ENOTSUP
	}
	if en, ok := target.(syscall.Errno); ok {
		return errnoSyscall(e.Errno) == en
	}
	return false
}

// ErrClosed is returned by Client methods after Close or after the
// connection failed.
var ErrClosed = errors.New("nbd: client closed")

// ErrServerClosed is returned by Serve after Shutdown.
var ErrServerClosed = errors.New("nbd: server closed")

func errnoSyscall(n uint32) syscall.Errno {
	switch n {
	case EPERM:
		return syscall.EPERM
	case EIO:
		return syscall.EIO
	case ENOMEM:
		return syscall.ENOMEM
	case EINVAL:
		return syscall.EINVAL
	case ENOSPC:
		return syscall.ENOSPC
	case EOVERFLOW:
		return syscall.EOVERFLOW
	case ENOTSUP:
		return syscall.ENOTSUP
	case ESHUTDOWN:
		return syscall.ESHUTDOWN
	}
	return syscall.EINVAL // the spec: treat unknown values as EINVAL
}

func errnoString(n uint32) string {
	switch n {
	case EPERM:
		return "EPERM (operation not permitted)"
	case EIO:
		return "EIO (input/output error)"
	case ENOMEM:
		return "ENOMEM (cannot allocate memory)"
	case EINVAL:
		return "EINVAL (invalid argument)"
	case ENOSPC:
		return "ENOSPC (no space left on device)"
	case EOVERFLOW:
		return "EOVERFLOW (value too large)"
	case ENOTSUP:
		return "ENOTSUP (operation not supported)"
	case ESHUTDOWN:
		return "ESHUTDOWN (server shutting down)"
	}
	return fmt.Sprintf("errno %d", n)
}

// errnoFor maps a Backend error to the NBD error value sent to the client.
// It is the only place where that mapping is made.
func errnoFor(err error) uint32 {
	var ne *Error
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ne) && ne.Errno != 0:
		return ne.Errno // e.g. a remote NBD backing device
	case errors.Is(err, errors.ErrUnsupported): // also ENOTSUP, EOPNOTSUPP, ENOSYS
		return ENOTSUP
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT), errors.Is(err, syscall.EFBIG):
		return ENOSPC
	case errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EACCES):
		return EPERM
	case errors.Is(err, syscall.EINVAL):
		return EINVAL
	case errors.Is(err, syscall.ENOMEM):
		return ENOMEM
	case errors.Is(err, syscall.ESHUTDOWN):
		return ESHUTDOWN
	}
	return EIO
}
