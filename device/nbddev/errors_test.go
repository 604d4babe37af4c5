package nbddev

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestServerErrors: a server that answers requests with EIO (nbdkit's
// error filter, failing every read and write while a file exists) is
// answering, not gone: the requests fail with a *device.IOError wrapping
// EIO at once, the link stays up without a reconnect, and once the server
// answers again the data written before reads back and new writes land.
func TestServerErrors(t *testing.T) {
	needTool(t, "nbdkit")
	trigger := filepath.Join(t.TempDir(), "fail")
	p := nbdkitMemory(t, 1<<20, []string{"--filter=error"}, "error=EIO", "error-rate=100%", "error-file="+trigger)
	d := openT(t, p.uri(""), Options{})
	want := bytes.Repeat([]byte{7}, 4096)
	if _, err := d.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(trigger, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for what, err := range map[string]error{
		"read":  func() error { _, err := d.ReadAt(buf, 0); return err }(),
		"write": func() error { _, err := d.WriteAt(buf, 8192); return err }(),
	} {
		var ioe *device.IOError
		if !errors.As(err, &ioe) || !errors.Is(err, syscall.EIO) || errors.Is(err, ErrLinkDown) {
			t.Fatalf("%s while the server answers EIO: %v; want an *device.IOError wrapping EIO, not a link failure", what, err)
		}
	}
	if st := d.Stats(); !st.Up || st.Outages != 0 || st.Reconnects != 0 {
		t.Fatalf("link after error replies: %+v; want up, no outage", st)
	}
	if err := os.Remove(trigger); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, want) {
		t.Fatalf("read after the errors stopped: %v (data equal %t)", err, bytes.Equal(buf, want))
	}
	if _, err := d.WriteAt(want, 8192); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
}
