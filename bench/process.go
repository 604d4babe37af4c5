package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Servers the harness knows, in the default interleaving order.
var serverNames = []string{"tiercache", "qemu-nbd", "nbdkit"}

// serverArgv returns the command line that serves file on unix socket sock.
// tiercacheBin is the freshly built tiercache binary.
func serverArgv(name, tiercacheBin, file, sock string) ([]string, error) {
	switch name {
	case "tiercache":
		// --direct off: the page cache, like the peers' defaults.
		return []string{tiercacheBin, "serve", "--export", exportName + "=" + file, "--listen", "unix:" + sock, "--direct", "off"}, nil
	case "qemu-nbd":
		// -t: keep serving after a client disconnects; default cache
		// mode (writeback, page cache), aio=threads.
		return []string{"qemu-nbd", "-f", "raw", "-t", "-x", exportName, "-k", sock, file}, nil
	case "nbdkit":
		// -f: foreground. The file plugin's thread model is parallel and
		// it advertises multi-conn; it serves any export name.
		return []string{"nbdkit", "-f", "-U", sock, "file", file}, nil
	}
	return nil, fmt.Errorf("unknown server %q (known: %s)", name, strings.Join(serverNames, ", "))
}

// process is a child started in its own process group, so that it and
// anything it forks can be signalled together and a Ctrl-C on the terminal
// reaches only the harness, which then stops it in order.
type process struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has been reaped
	err  error         // Wait's result, valid after done is closed
	log  string        // file holding its stdout and stderr
}

func startProcess(name string, argv []string, logPath string) (*process, error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Pdeathsig: if the harness dies without cleaning up (SIGKILL), the
	// kernel kills the server too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *process) pid() int { return p.cmd.Process.Pid }

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the process group, then SIGKILL after grace, and
// waits until the process is reaped. It is safe to call more than once.
func (p *process) stop(grace time.Duration) error {
	if p.exited() {
		return nil
	}
	pgid := p.pid()
	if err := syscall.Kill(-pgid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("stop %s (pid %d): %w", p.name, pgid, err)
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	if err := syscall.Kill(-pgid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill %s (pid %d): %w", p.name, pgid, err)
	}
	<-p.done
	return fmt.Errorf("%s (pid %d) ignored SIGTERM for %v and was killed", p.name, pgid, grace)
}

// logTail returns the last lines of the process's output, for error messages.
func (p *process) logTail() string {
	data, err := os.ReadFile(p.log)
	if err != nil || len(data) == 0 {
		return ""
	}
	const keep = 1200
	if len(data) > keep {
		data = data[len(data)-keep:]
	}
	return strings.TrimSpace(string(data))
}

// NBD handshake constants used by the readiness probe.
var (
	nbdMagic = []byte("NBDMAGIC")
	nbdOpt   = []byte("IHAVEOPT")
)

const (
	nbdFlagFixedNewstyle = 1 << 0 // server and client handshake flag
	nbdFlagNoZeroes      = 1 << 1
	nbdOptAbort          = 2
)

// waitNBD waits until a server answers on unix socket sock with the NBD
// greeting, the process exits, ctx is done or timeout passes. The probe
// connection is closed right after the greeting.
func waitNBD(ctx context.Context, p *process, sock string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if p.exited() {
			return fmt.Errorf("%s exited before serving (%v); its output:\n%s", p.name, p.err, p.logTail())
		}
		if last = probeNBD(sock); last == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not serving on %s after %v: %w; its output:\n%s", p.name, sock, timeout, last, p.logTail())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// probeNBD checks that an NBD server answers on sock: it reads the
// fixed-newstyle greeting, then ends the handshake politely with
// NBD_OPT_ABORT, so that servers do not log a broken connection.
func probeNBD(sock string) error {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		return err
	}
	greeting := make([]byte, 18) // NBDMAGIC, IHAVEOPT, 16-bit handshake flags
	if _, err := io.ReadFull(c, greeting); err != nil {
		return fmt.Errorf("read NBD greeting: %w", err)
	}
	if !bytes.Equal(greeting[:8], nbdMagic) || !bytes.Equal(greeting[8:16], nbdOpt) {
		return fmt.Errorf("greeting %q is not fixed-newstyle NBD", greeting[:16])
	}
	flags := uint32(binary.BigEndian.Uint16(greeting[16:]) & (nbdFlagFixedNewstyle | nbdFlagNoZeroes))
	msg := binary.BigEndian.AppendUint32(nil, flags)
	msg = append(msg, nbdOpt...)
	msg = binary.BigEndian.AppendUint32(msg, nbdOptAbort)
	msg = binary.BigEndian.AppendUint32(msg, 0) // option length
	if _, err := c.Write(msg); err != nil {
		return fmt.Errorf("send NBD_OPT_ABORT: %w", err)
	}
	// The server may acknowledge the abort or just close; either is fine,
	// and waiting for it lets the server finish before the socket closes.
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64))
	return nil
}

// registry tracks live servers so that every exit path can stop them.
type registry struct {
	mu    sync.Mutex
	procs map[*process]string // process → socket to remove after it stops
}

func (r *registry) add(p *process, sock string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.procs == nil {
		r.procs = make(map[*process]string)
	}
	r.procs[p] = sock
}

// stop stops p, removes its socket and forgets it.
func (r *registry) stop(p *process) error {
	r.mu.Lock()
	sock, ok := r.procs[p]
	delete(r.procs, p)
	r.mu.Unlock()
	err := p.stop(5 * time.Second)
	if ok && sock != "" {
		if rerr := os.Remove(sock); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = errors.Join(err, fmt.Errorf("remove socket: %w", rerr))
		}
	}
	return err
}

// stopAll stops every server still running.
func (r *registry) stopAll() error {
	r.mu.Lock()
	ps := make([]*process, 0, len(r.procs))
	for p := range r.procs {
		ps = append(ps, p)
	}
	r.mu.Unlock()
	var errs []error
	for _, p := range ps {
		errs = append(errs, r.stop(p))
	}
	return errors.Join(errs...)
}
