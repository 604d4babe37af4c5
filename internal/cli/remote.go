package cli

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/device/nbddev"
	"github.com/tiercache/tiercache/internal/backingid"
)

// Remote backing devices: an NBD URI (nbd://, nbds://, nbd+unix://,
// nbds+unix://) wherever a backing device path is taken. A remote export
// has no extended attributes and no device file to flock: its identity is
// nbd:URI#MARKER (backingid.NBDID), its description as the server gives
// it, and "attached to another set" cannot be recorded on it, as on a
// block device. What can be caught is two servers on one host: serve and
// attach hold a flock on a file named after the export (lockRemote).

// isRemote reports whether a backing spec is an NBD URI.
func isRemote(spec string) bool { return nbddev.IsURI(spec) }

// remoteSpec is the canonical form of an NBD URI, recorded as the
// backing's path; a spec that does not parse is returned as given (opening
// it reports why).
func remoteSpec(spec string) string {
	t, err := nbddev.ParseURI(spec)
	if err != nil {
		return spec
	}
	return t.String()
}

// remoteTimeouts are serve's --remote-timeout and
// --remote-request-timeout (zero: nbddev's defaults).
type remoteTimeouts struct {
	outage  time.Duration // how long requests wait for a lost link
	request time.Duration // how long a request waits for its reply before its connection counts as hung
}

// openRemote connects to the export a URI names. log receives the link's
// state changes (outages, reconnects, refusals), nil discards them.
func openRemote(spec string, readOnly bool, to remoteTimeouts, log *slog.Logger) (*nbddev.Device, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*nbddev.DefaultDialTimeout)
	defer cancel()
	return nbddev.Open(ctx, spec, nbddev.Options{ReadOnly: readOnly, OutageTimeout: to.outage, RequestTimeout: to.request, Log: log})
}

// syncRemote flushes a remote export before anything is served from it.
// A previous serve that was killed may have left writes the server
// acknowledged and no FLUSH covered; a client could read them now and
// take them for durable, and a restart of the server would then take them
// back. A local backing device keeps such writes in the page cache, which
// a killed process does not lose; a remote server may keep them in a
// volatile cache of its own.
func syncRemote(d *nbddev.Device, readOnly bool) error {
	if readOnly {
		return nil // nothing is written: what is read stays as durable as it is
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("flushing the remote export before serving it: %w", err)
	}
	return nil
}

// remoteLockDir is the host-wide directory of the remote exports' lock
// files: /run/lock/tiercache when /run/lock exists, else tiercache-locks
// in the temporary directory. It is world-writable with the sticky bit,
// so that servers of every user meet there.
func remoteLockDir() (string, error) {
	dir := filepath.Join(os.TempDir(), "tiercache-locks")
	if st, err := os.Stat("/run/lock"); err == nil && st.IsDir() && unix.Access("/run/lock", unix.W_OK) == nil {
		dir = "/run/lock/tiercache"
	}
	if err := os.Mkdir(dir, 0o700); err == nil {
		if err := os.Chmod(dir, os.ModePerm|os.ModeSticky); err != nil {
			return "", err
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return "", err
	}
	return dir, nil
}

// remoteLockKey names the export d reaches for its lock: its identity
// (URI and description). The description alone would also catch one
// export reached by two URIs, but descriptions are not always unique (a
// tiercache export's default one names only the volume and mode).
func remoteLockKey(d *nbddev.Device) string { return remoteID(d) }

// lockRemote takes the host-wide lock of the export d reaches, exclusive,
// for as long as a server uses it as a backing device, and returns its
// release. Two cache sets in front of one export corrupt it (each writes
// back over the other's data, and each serves reads from its own cache);
// servers on other hosts cannot be seen from here (OPERATIONS.md: the
// server can refuse a second client).
func lockRemote(d *nbddev.Device, role string) (func(), error) {
	dir, err := remoteLockDir()
	if err != nil {
		return nil, fmt.Errorf("%s: the directory of remote export locks: %w", role, err)
	}
	key := remoteLockKey(d)
	path := filepath.Join(dir, fmt.Sprintf("nbd-%x.lock", sha256.Sum256([]byte(key))))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		return nil, fmt.Errorf("%s: locking remote export (%s): %w", role, path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder := lockHolder(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			if holder == "" {
				holder = "another tiercache process"
			}
			return nil, fmt.Errorf("%s %s: expected no other server on this host to use the export (%s) as a backing device, found it in use by %s (lock %s); two cache sets in front of one export corrupt it, and --force does not override this: detach it from the other set (or stop that server) first, or give this volume another export",
				role, d.Target(), key, holder, path)
		}
		return nil, fmt.Errorf("%s: locking remote export (%s): %w", role, path, err)
	}
	f.Truncate(0)
	f.WriteAt([]byte(key+"\n"), 0)
	return func() { f.Close() }, nil
}

// remoteID is the identity of the export d is connected to.
func remoteID(d *nbddev.Device) string {
	return backingid.NBDID(d.Target().Name(), d.Description())
}

// identifyRemote is identify for a remote export: one without a
// description is refused unless trustPath, and then identified by its URI
// alone, said loudly on warn.
func identifyRemote(warn io.Writer, what string, d *nbddev.Device, trustPath bool) (string, error) {
	if d.Description() != "" {
		return remoteID(d), nil
	}
	name := d.Target().Name()
	if !trustPath {
		return "", fmt.Errorf("%s (%s): the export has no description, so a different export served at this URI would not be caught; give it one the set records as its marker (qemu-nbd --description=MARKER, nbdkit --filter=exportname ... exportdesc=fixed:MARKER), or --trust-path to identify it by its URI alone", what, name)
	}
	if warn != nil {
		fmt.Fprintf(warn, "WARNING: %s (%s): the export has no description; identified by its URI (--trust-path): a different export served at that URI will NOT be caught\n", what, name)
	}
	return remoteID(d), nil
}

// checkRemote reports whether d is the export whose identity was recorded.
func checkRemote(recorded string, d *nbddev.Device) error {
	return backingid.CheckNBD(recorded, d.Target().Name(), remoteID(d))
}

// releaseBacking forgets the set's claim on a backing device (detach):
// nothing is recorded on a remote export.
func releaseBacking(spec string) error {
	if isRemote(spec) || isObjImage(spec) {
		return nil
	}
	return backingid.Release(devicePath(spec))
}

// checkRemoteBacking is checkBackings for a remote export: it connects
// read-only and compares the size and identity with those recorded.
func checkRemoteBacking(name, uri, id string, size int64) []string {
	d, err := openRemote(uri, true, remoteTimeouts{}, nil)
	if err != nil {
		return []string{fmt.Sprintf("backing device %q: not checked: %v (serve needs the export reachable, or --backing %s=URI)", name, err, name)}
	}
	defer d.Close()
	var problems []string
	if d.Size() != size {
		problems = append(problems, fmt.Sprintf("backing device %q (%s) is %d bytes, the set recorded %d: serve refuses it; serve the export at its recorded size", name, uri, d.Size(), size))
	}
	if err := checkRemote(id, d); err != nil {
		problems = append(problems, fmt.Sprintf("backing device %q: %v: serve refuses it without --force", name, err))
	}
	return problems
}

// remoteLink is admin.Config.RemoteLink: the link state of the remote
// backing device of an export, nil for a local one.
func (h *openedSet) remoteLink(export string) *admin.RemoteLink {
	h.mu.Lock()
	d, ok := h.devs[export].(*nbddev.Device)
	h.mu.Unlock()
	if !ok {
		return nil
	}
	s := d.Stats()
	l := &admin.RemoteLink{State: "up", Since: s.Since, Conns: s.Conns, Reconnects: s.Reconnects, Outages: s.Outages,
		RequestTimeouts: s.Timeouts, ReplayedWrites: s.ReplayedWrites, ReplayedBytes: s.ReplayedBytes,
		DownSeconds: s.DownFor.Seconds(), DownTotalSeconds: s.DownTotal.Seconds(), NotDurable: s.NotDurable, LastError: s.LastError}
	switch {
	case s.Refused:
		l.State = "refused"
	case s.Failing:
		l.State = "down"
	case !s.Up:
		l.State = "reconnecting"
	}
	return l
}

// remoteRows are the rows stats prints for the remote link of each export
// with a remote backing device ("-" for the others), in order.
var remoteRows = []statRow[admin.RemoteLink]{
	{"remote_link", func(r *admin.RemoteLink) string { return r.State }},
	{"remote_since", func(r *admin.RemoteLink) string {
		if r.Since.IsZero() {
			return "-"
		}
		return r.Since.Local().Format(time.DateTime)
	}},
	{"remote_connections", func(r *admin.RemoteLink) string { return fmt.Sprint(r.Conns) }},
	{"remote_reconnects", func(r *admin.RemoteLink) string { return fmt.Sprint(r.Reconnects) }},
	{"remote_outages", func(r *admin.RemoteLink) string { return fmt.Sprint(r.Outages) }},
	{"remote_down_time", func(r *admin.RemoteLink) string {
		return (time.Duration(r.DownTotalSeconds * float64(time.Second))).Round(time.Millisecond).String()
	}},
	{"remote_request_timeouts", func(r *admin.RemoteLink) string { return fmt.Sprint(r.RequestTimeouts) }},
	{"remote_replayed_bytes", func(r *admin.RemoteLink) string {
		return fmt.Sprintf("%s (%d writes)", human(int64(r.ReplayedBytes)), r.ReplayedWrites)
	}},
	{"remote_not_durable", func(r *admin.RemoteLink) string { return fmt.Sprint(r.NotDurable) }},
	{"remote_last_error", func(r *admin.RemoteLink) string {
		if r.LastError == "" {
			return "-"
		}
		return r.LastError
	}},
}

// remoteText is status's line for a remote backing device's link.
func remoteText(name string, r *admin.RemoteLink) string {
	s := fmt.Sprintf("%s: remote link %s", name, r.State)
	if r.State == "up" {
		s += fmt.Sprintf(" (%d connection(s))", r.Conns)
	} else {
		s += fmt.Sprintf(" for %s", (time.Duration(r.DownSeconds * float64(time.Second))).Round(time.Millisecond))
	}
	s += fmt.Sprintf(", %d reconnect(s), %s disconnected in all", r.Reconnects, (time.Duration(r.DownTotalSeconds * float64(time.Second))).Round(time.Millisecond))
	if r.NotDurable > 0 {
		s += fmt.Sprintf(", %d sync(s) refused after a restart (written again)", r.NotDurable)
	}
	if r.State != "up" && r.LastError != "" {
		s += ": " + r.LastError
	}
	return s
}
