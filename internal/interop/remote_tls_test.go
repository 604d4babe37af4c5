package interop

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRemoteTLS: the backing device is an nbdkit export that requires TLS
// and a client certificate (--tls=require --tls-verify-peer); the cache
// set reaches it with nbds+unix:// and tls-certificates (the CA and the
// client certificate, libnbd's layout). Data written through a writeback
// set and detached is on the remote, read back over TLS by nbdcopy; the
// same URI without the client certificate is refused by the server.
func TestRemoteTLS(t *testing.T) {
	need(t, "nbdkit", "nbdcopy")
	dir := shortDir(t)
	pki := filepath.Join(dir, "pki")
	os.Mkdir(pki, 0o700)
	writePKI(t, pki)
	rsock := filepath.Join(dir, "r.sock")
	startRemote(t, rsock, "nbdkit", "-f", "--exit-with-parent", "-U", rsock, "--tls=require", "--tls-certificates="+pki, "--tls-verify-peer",
		"--filter=exportname", "memory", "16M", "exportdesc=fixed:marker-tls")
	uri := "nbds+unix:///?socket=" + rsock + "&tls-certificates=" + pki + "&tls-hostname=localhost"

	// Without the client certificate the server refuses the handshake.
	noCert := filepath.Join(dir, "nocert")
	os.Mkdir(noCert, 0o700)
	ca, _ := os.ReadFile(filepath.Join(pki, "ca-cert.pem"))
	os.WriteFile(filepath.Join(noCert, "ca-cert.pem"), ca, 0o600)
	refusedRun(t, []string{`backing "vm"`, "nocert"}, "format", "--cache", sparseFile(t, dir, "c0.img", 16*mib), "--backing",
		"vm=nbds+unix:///?socket="+rsock+"&tls-certificates="+noCert+"&tls-hostname=localhost")

	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	if out := run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vm="+uri, "--bucket-size", "256K"); !strings.Contains(out, "#marker-tls") {
		t.Fatalf("format output does not show the remote identity:\n%s", out)
	}
	src := randomFile(t, dir, "src", 2*mib, 11)
	sock := filepath.Join(dir, "nbd.sock")
	s := startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", filepath.Join(dir, "admin.sock"))
	run(t, time.Minute, "nbdcopy", src, s.uri("vm"))
	s.stop()
	run(t, 2*time.Minute, bin, "detach", "--cache", cachePath, "vm")
	got := filepath.Join(dir, "got")
	run(t, time.Minute, "nbdcopy", uri, got)
	want, _ := os.ReadFile(src)
	if have, _ := os.ReadFile(got); len(have) != 16*mib || !bytes.Equal(have[:len(want)], want) {
		t.Fatalf("the TLS remote does not hold what was written through the cache (%d bytes read)", len(have))
	}
}
