package cli

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// listenSpec is one parsed --listen value.
type listenSpec struct {
	network string // "unix" or "tcp"
	addr    string
}

func (l listenSpec) String() string { return l.network + ":" + l.addr }

// parseListen parses unix:PATH, tcp:HOST:PORT, tcp::PORT and tcp:PORT. A TCP
// listener without a host binds 127.0.0.1: exposing a block device to the
// network must be asked for explicitly.
func parseListen(s string) (listenSpec, error) {
	network, rest, ok := strings.Cut(s, ":")
	if !ok {
		return listenSpec{}, fmt.Errorf("--listen %q: want unix:PATH or tcp:HOST:PORT", s)
	}
	switch network {
	case "unix":
		if rest == "" {
			return listenSpec{}, fmt.Errorf("--listen %q: empty socket path", s)
		}
		return listenSpec{"unix", rest}, nil
	case "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil {
			// tcp:PORT
			if _, perr := strconv.Atoi(rest); perr != nil {
				return listenSpec{}, fmt.Errorf("--listen %q: want tcp:HOST:PORT: %v", s, err)
			}
			host, port = "", rest
		}
		if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
			return listenSpec{}, fmt.Errorf("--listen %q: bad port %q", s, port)
		}
		if host == "" {
			host = "127.0.0.1"
		}
		return listenSpec{"tcp", net.JoinHostPort(host, port)}, nil
	default:
		return listenSpec{}, fmt.Errorf("--listen %q: unknown network %q (want unix or tcp)", s, network)
	}
}

// listen opens the listener. A unix socket is created with mode perm; a
// stale socket file left by a dead server is replaced, a live one is an
// error (two servers on one socket would serve clients at random).
func listen(spec listenSpec, perm os.FileMode) (net.Listener, error) {
	if spec.network != "unix" {
		return net.Listen(spec.network, spec.addr)
	}
	if fi, err := os.Lstat(spec.addr); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("listen %s: %s exists and is not a socket", spec, spec.addr)
		}
		c, err := net.DialTimeout("unix", spec.addr, time.Second)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("listen %s: another server is already listening there", spec)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("listen %s: probing existing socket: %w", spec, err)
		}
		if err := os.Remove(spec.addr); err != nil {
			return nil, fmt.Errorf("listen %s: removing stale socket: %w", spec, err)
		}
	}
	// Create the socket under a tight umask so that there is no window in
	// which another user could connect, then set the requested mode.
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", spec.addr)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(spec.addr, perm); err != nil {
		l.Close()
		return nil, fmt.Errorf("listen %s: chmod: %w", spec, err)
	}
	return l, nil
}
