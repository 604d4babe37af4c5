package nbd

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"net"
	"testing"
	"time"
)

// testTLS returns a server config with a fresh self-signed certificate and
// a client config trusting it.
func testTLS(t *testing.T) (server, client *tls.Config) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "nbd-test"},
		DNSNames:              []string{"nbd-test", "localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:                  true,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}},
		&tls.Config{RootCAs: pool, ServerName: "nbd-test"}
}

func TestTLS(t *testing.T) {
	scfg, ccfg := testTLS(t)
	mem := newMem(1 << 20)
	ts := startServer(t, Config{TLSConfig: scfg, RequireTLS: true}, Export{Name: "d", Backend: mem})

	bothModes(t, func(t *testing.T, opts ClientOptions) {
		opts.TLSConfig = ccfg
		c := ts.dial(t, "d", opts)
		data := bytes.Repeat([]byte("tls!"), 4096)
		if err := c.WriteAt(data, 4096, true); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(data))
		if err := c.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read over TLS: %v", err)
		}
		wantErrno(t, "read past end", c.ReadAt(got, 1<<20), EINVAL)
		if err := c.Flush(); err != nil {
			t.Fatal(err)
		}
	})

	// A plain client is refused (GO fails with NBD_REP_ERR_TLS_REQD).
	if _, err := Dial(t.Context(), "unix", ts.addr, "d", ClientOptions{}); err == nil {
		t.Fatal("plain client accepted by a TLS-only server")
	}
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle)
	r.opt(optList, nil)
	r.expect(optList, repErrTLSReqd)
	r.opt(optStartTLS, []byte{1})
	r.expect(optStartTLS, repErrInvalid)
	r.opt(optStructuredReply, nil)
	r.expect(optStructuredReply, repErrTLSReqd)
	r.opt(optStartTLS, nil)
	r.expect(optStartTLS, repAck)
	tc := tls.Client(r.nc, ccfg)
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	r.nc, r.br = tc, bufio.NewReader(tc)
	r.opt(optStartTLS, nil)
	r.expect(optStartTLS, repErrInvalid) // already negotiated
	r.opt(optList, nil)
	r.expect(optList, repServer)
	r.expect(optList, repAck)
	r.goExport("d")
	r.request(requestHeader{Type: cmdFlush, Handle: 3}, nil)
	if errno, h := r.simpleReply(); errno != 0 || h != 3 {
		t.Fatalf("flush over TLS: errno %d handle %d", errno, h)
	}

	// EXPORT_NAME without TLS cannot be refused with an error: closed.
	r2 := ts.raw(t)
	r2.greet(flagCFixedNewstyle)
	r2.opt(optExportName, []byte("d"))
	r2.expectClosed()
}

func TestTLSNotConfigured(t *testing.T) {
	_, ccfg := testTLS(t)
	ts := startServer(t, Config{}, Export{Name: "d", Backend: newMem(4096)})
	_, err := Dial(t.Context(), "unix", ts.addr, "d", ClientOptions{TLSConfig: ccfg})
	if err == nil {
		t.Fatal("TLS client accepted by a server without TLS")
	}
	var e *Error
	if errors.As(err, &e) {
		t.Fatalf("unexpected *Error %v", e)
	}
}

func TestTLSOptional(t *testing.T) {
	scfg, ccfg := testTLS(t)
	ts := startServer(t, Config{TLSConfig: scfg}, Export{Name: "d", Backend: newMem(1 << 20)})
	plainC := ts.dial(t, "d", ClientOptions{})
	tlsC := ts.dial(t, "d", ClientOptions{TLSConfig: ccfg, StructuredReplies: true})
	if err := tlsC.WriteAt([]byte("secret"), 0, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	if err := plainC.ReadAt(got, 0); err != nil || string(got) != "secret" {
		t.Fatalf("%q %v", got, err)
	}
}
