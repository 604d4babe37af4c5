package interop

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// writePKI writes a CA, a server certificate for localhost and a client
// certificate into dir, under the file names libnbd and QEMU look for
// (ca-cert.pem, client-cert.pem, client-key.pem; server-*.pem for us).
func writePKI(t *testing.T, dir string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "tiercache test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	writePEM(t, filepath.Join(dir, "ca-cert.pem"), "CERTIFICATE", caDER)
	leaf := func(name string, serial int64, usage x509.ExtKeyUsage, hosts bool) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}
		if hosts {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kb, _ := x509.MarshalPKCS8PrivateKey(key)
		writePEM(t, filepath.Join(dir, name+"-cert.pem"), "CERTIFICATE", der)
		writePEM(t, filepath.Join(dir, name+"-key.pem"), "PRIVATE KEY", kb)
	}
	leaf("server", 2, x509.ExtKeyUsageServerAuth, true)
	leaf("client", 3, x509.ExtKeyUsageClientAuth, false)
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestTLS serves over TCP with STARTTLS required and client certificates
// verified, and talks to it with libnbd (nbdinfo, nbdcopy) and QEMU
// (qemu-io with tls-creds-x509).
func TestTLS(t *testing.T) {
	need(t, "nbdinfo", "qemu-io")
	dir := t.TempDir()
	pki := filepath.Join(dir, "pki")
	os.Mkdir(pki, 0o700)
	writePKI(t, pki)
	img := sparseFile(t, dir, "disk.img", 16*mib)
	port := freePort(t)
	sock := filepath.Join(dir, "s.sock")
	startServerRaw(t, sock, "serve", "--listen", "unix:"+sock, "--listen", fmt.Sprintf("tcp:127.0.0.1:%d", port),
		"--export", "disk="+img,
		"--tls-cert", filepath.Join(pki, "server-cert.pem"), "--tls-key", filepath.Join(pki, "server-key.pem"),
		"--tls-client-ca", filepath.Join(pki, "ca-cert.pem"), "--tls-required")

	// libnbd with the client certificate.
	uri := fmt.Sprintf("nbds://localhost:%d/disk?tls-certificates=%s", port, pki)
	out := run(t, 30*time.Second, "nbdinfo", uri)
	if !strings.Contains(out, "export-size: 16777216") {
		t.Fatalf("nbdinfo over TLS:\n%s", out)
	}

	// QEMU with x509 credentials: write, flush, read back.
	obj := "tls-creds-x509,id=tls0,dir=" + pki + ",endpoint=client"
	img2 := fmt.Sprintf("driver=nbd,host=localhost,port=%d,export=disk,tls-creds=tls0", port)
	out = run(t, time.Minute, "qemu-io", "--object", obj, "--image-opts", img2,
		"-c", "write -P 0x3c 0 128k", "-c", "flush", "-c", "read -P 0x3c 0 128k")
	if strings.Contains(out, "failed") || strings.Contains(out, "error") {
		t.Fatalf("qemu-io over TLS:\n%s", out)
	}

	// Plaintext is refused when TLS is required.
	if out, err := runErr(30*time.Second, "nbdinfo", fmt.Sprintf("nbd://localhost:%d/disk", port)); err == nil {
		t.Fatalf("plaintext client accepted with --tls-required:\n%s", out)
	}
	// A client without a certificate is refused when client certificates are required.
	noCert := filepath.Join(dir, "nocert")
	os.Mkdir(noCert, 0o700)
	caPEM, _ := os.ReadFile(filepath.Join(pki, "ca-cert.pem"))
	os.WriteFile(filepath.Join(noCert, "ca-cert.pem"), caPEM, 0o600)
	if out, err := runErr(30*time.Second, "nbdinfo", fmt.Sprintf("nbds://localhost:%d/disk?tls-certificates=%s", port, noCert)); err == nil {
		t.Fatalf("client without certificate accepted:\n%s", out)
	}
	// The data is in the file.
	data, _ := os.ReadFile(img)
	if data[0] != 0x3c || data[128<<10-1] != 0x3c {
		t.Fatal("TLS write did not reach the file")
	}
}

// TestTLSBadFlags checks TLS flag errors.
func TestTLSBadFlags(t *testing.T) {
	dir := t.TempDir()
	img := sparseFile(t, dir, "d.img", mib)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"}, "TLS certificate"},
		{[]string{"--tls-cert", "/x.pem"}, "go together"},
		{[]string{"--tls-required"}, "need --tls-cert"},
	} {
		args := append([]string{"serve", "--export", "d=" + img, "--listen", "unix:" + filepath.Join(dir, "s.sock")}, c.args...)
		out, err := runErr(30*time.Second, bin, args...)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("%v: err %v, output %q; want failure mentioning %q", c.args, err, out, c.want)
		}
	}
}
