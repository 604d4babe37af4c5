package cli

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Every command that opens a cache device, or a backing device of a set,
// takes the same lock on it: flock(2) on the device's file (a block
// device's node, or the file), exclusive for whoever writes (serve, format,
// offline attach and detach) and shared for the read-only tools (check
// --cache, inspect). flock is per open file, so it also separates two
// opens within one process. --force never overrides it: a lock held means
// a live process has the device open, and no flag makes writing under it
// safe.

// lockKind says who takes a lock, for the refusal message.
type lockKind struct {
	exclusive bool
	// proceed says how to get the work done while the device is in use.
	proceed string
}

var (
	lockServe = lockKind{true, "stop it first, or change the set through its admin API (the same command without --cache)"}
	lockCheck = lockKind{false, "check a served set online with 'tiercache check' (without --cache), or stop the server first"}
)

// lockDevice takes the lock on the device file at path and returns its
// release. role names the device in messages ("cache device", "backing
// device of volume x").
func lockDevice(path, role string, k lockKind) (func(), error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", role, err)
	}
	how := unix.LOCK_SH
	if k.exclusive {
		how = unix.LOCK_EX
	}
	if err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB); err != nil {
		holder := lockHolder(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &deviceBusyError{role: role, path: path, holder: holder, proceed: k.proceed}
		}
		return nil, fmt.Errorf("locking %s %s: %w", role, path, err)
	}
	return func() { f.Close() }, nil
}

// deviceBusyError: the device is locked by a live process.
type deviceBusyError struct {
	role, path, holder, proceed string
}

func (e *deviceBusyError) holderName() string {
	if e.holder != "" {
		return e.holder
	}
	return "another tiercache process"
}

func (e *deviceBusyError) Error() string {
	who := e.holderName()
	return fmt.Sprintf("%s %s is in use by %s (a running server, or an offline attach, detach or format); --force does not override this: %s",
		e.role, e.path, who, e.proceed)
}

// lockHolder names a process holding a flock on f's file, from /proc/locks
// ("" if none is found: the holder may be in another PID namespace).
func lockHolder(f *os.File) string {
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) != nil {
		return ""
	}
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		// 1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF
		fs := strings.Fields(l)
		if len(fs) < 6 || fs[1] != "FLOCK" || fs[5] != want {
			continue
		}
		pid, err := strconv.Atoi(fs[4])
		if err != nil || pid == os.Getpid() {
			continue
		}
		name := "process " + fs[4]
		if c, err := os.ReadFile("/proc/" + fs[4] + "/cmdline"); err == nil && len(c) > 0 {
			args := strings.Split(strings.TrimRight(string(c), "\x00"), "\x00")
			name = fmt.Sprintf("process %d (%s)", pid, strings.Join(args[:min(len(args), 3)], " "))
		}
		return name
	}
	return ""
}
