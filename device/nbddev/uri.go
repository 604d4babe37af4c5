package nbddev

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// DefaultPort is the NBD port IANA assigned, used when a TCP URI names none.
const DefaultPort = "10809"

// Target is a parsed NBD URI (NetworkBlockDevice/nbd doc/uri.md): where the
// export is and how to reach it.
type Target struct {
	Scheme  string // "nbd", "nbds", "nbd+unix" or "nbds+unix"
	Network string // "tcp" or "unix"
	Addr    string // host:port, or the socket path
	Host    string // the URI's host (TCP only), for TLS verification
	Export  string // export name: the path without its leading "/"
	TLS     bool   // nbds and nbds+unix: TLS is required

	// TLS settings, as libnbd and nbdkit take them in URIs.
	TLSCertDir  string // tls-certificates: ca-cert.pem, client-cert.pem, client-key.pem
	TLSHostname string // tls-hostname: name to verify instead of Host
	TLSNoVerify bool   // tls-verify-peer=0

	// Conns is the number of connections opened when the server
	// advertises CAN_MULTI_CONN (x-multi-conn=N); 0 means the default.
	Conns int
}

// IsURI reports whether spec is meant as an NBD URI (by its scheme), so
// that callers can tell it from a path before parsing it.
func IsURI(spec string) bool {
	for _, s := range []string{"nbd://", "nbds://", "nbd+unix://", "nbds+unix://"} {
		if strings.HasPrefix(spec, s) {
			return true
		}
	}
	return false
}

// ParseURI parses an NBD URI. Query parameters it does not know are
// refused (the spec asks that they be diagnosed), as are the TLS methods
// it does not implement (tls-type=psk or anon, tls-psk-file).
func ParseURI(s string) (Target, error) {
	var t Target
	u, err := url.Parse(s)
	if err != nil {
		return t, fmt.Errorf("NBD URI: %w", err)
	}
	if u.Opaque != "" {
		return t, fmt.Errorf("NBD URI %q: want scheme://[host[:port]]/export", s)
	}
	t.Scheme = u.Scheme
	switch u.Scheme {
	case "nbd", "nbds":
		t.Network = "tcp"
		if u.Hostname() == "" {
			return t, fmt.Errorf("NBD URI %q: no host", s)
		}
		t.Host = u.Hostname()
		port := u.Port()
		if port == "" {
			port = DefaultPort
		}
		t.Addr = net.JoinHostPort(t.Host, port)
	case "nbd+unix", "nbds+unix":
		t.Network = "unix"
		if u.Host != "" {
			return t, fmt.Errorf("NBD URI %q: a unix socket URI has no host (nbd+unix:///export?socket=PATH)", s)
		}
	default:
		return t, fmt.Errorf("NBD URI %q: scheme %q is not nbd, nbds, nbd+unix or nbds+unix", s, u.Scheme)
	}
	t.TLS = strings.HasPrefix(u.Scheme, "nbds")
	if u.User != nil {
		return t, fmt.Errorf("NBD URI %q: a user name is only for TLS PSK, which is not supported", s)
	}
	if u.Fragment != "" {
		return t, fmt.Errorf("NBD URI %q: unexpected fragment #%s", s, u.Fragment)
	}
	t.Export = strings.TrimPrefix(u.Path, "/")
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return t, fmt.Errorf("NBD URI %q: query: %w", s, err)
	}
	for k, vs := range q {
		if len(vs) != 1 {
			return t, fmt.Errorf("NBD URI %q: parameter %s given %d times", s, k, len(vs))
		}
		v := vs[0]
		switch k {
		case "socket":
			if t.Network != "unix" {
				return t, fmt.Errorf("NBD URI %q: socket= is for nbd+unix and nbds+unix", s)
			}
			t.Addr = v
		case "tls-certificates":
			t.TLSCertDir = v
		case "tls-hostname":
			t.TLSHostname = v
		case "tls-verify-peer":
			switch v {
			case "0", "false":
				t.TLSNoVerify = true
			case "1", "true":
			default:
				return t, fmt.Errorf("NBD URI %q: tls-verify-peer=%q: want 0 or 1", s, v)
			}
		case "tls-type":
			if v != "x509" {
				return t, fmt.Errorf("NBD URI %q: tls-type=%s is not supported (only x509)", s, v)
			}
		case "x-multi-conn":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > MaxConns {
				return t, fmt.Errorf("NBD URI %q: x-multi-conn=%q: want 1 to %d", s, v, MaxConns)
			}
			t.Conns = n
		default:
			return t, fmt.Errorf("NBD URI %q: unknown parameter %q", s, k)
		}
	}
	if t.Network == "unix" && t.Addr == "" {
		return t, fmt.Errorf("NBD URI %q: socket= is required for %s", s, u.Scheme)
	}
	if !t.TLS && (t.TLSCertDir != "" || t.TLSHostname != "" || t.TLSNoVerify) {
		return t, fmt.Errorf("NBD URI %q: TLS parameters need the nbds or nbds+unix scheme (nbd:// connects without TLS)", s)
	}
	return t, nil
}

// String returns the URI in a canonical form with every setting. No NBD
// URI parameter is a secret (certificates are named by directory), so it
// can be logged and shown.
func (t Target) String() string {
	q := url.Values{}
	if t.Network == "unix" {
		q.Set("socket", t.Addr)
	}
	if t.TLSCertDir != "" {
		q.Set("tls-certificates", t.TLSCertDir)
	}
	if t.TLSHostname != "" {
		q.Set("tls-hostname", t.TLSHostname)
	}
	if t.TLSNoVerify {
		q.Set("tls-verify-peer", "0")
	}
	if t.Conns != 0 {
		q.Set("x-multi-conn", strconv.Itoa(t.Conns))
	}
	return t.url(q)
}

// Name returns the URI naming the export only: scheme, address and export
// name, without the connection settings. It is what a backing device's
// identity records, so that moving certificates or changing the number of
// connections does not make the same export look like another one.
func (t Target) Name() string {
	q := url.Values{}
	if t.Network == "unix" {
		q.Set("socket", t.Addr)
	}
	return t.url(q)
}

func (t Target) url(q url.Values) string {
	// "/" needs no escaping in a query (RFC 3986 3.4); kept as is, a
	// socket path reads as the path it is.
	u := url.URL{Scheme: t.Scheme, Path: "/" + t.Export, RawQuery: strings.ReplaceAll(q.Encode(), "%2F", "/")}
	if t.Network == "tcp" {
		u.Host = t.Addr
	}
	return u.String()
}

// clientCertHint says where a client certificate goes for t.
func (t Target) clientCertHint() string {
	if t.TLSCertDir == "" {
		return "give tls-certificates=DIR in the URI, DIR holding ca-cert.pem, client-cert.pem and client-key.pem, as libnbd and qemu take them"
	}
	return fmt.Sprintf("put the client's certificate and key in %s and %s, as libnbd and qemu take them",
		filepath.Join(t.TLSCertDir, "client-cert.pem"), filepath.Join(t.TLSCertDir, "client-key.pem"))
}

// tlsConfig builds the client TLS configuration: the CA in
// TLSCertDir/ca-cert.pem (else the system roots) verifies the server, and
// TLSCertDir/client-cert.pem with client-key.pem, when present, is the
// client certificate, as in libnbd and qemu.
func (t Target) tlsConfig() (*tls.Config, error) {
	if !t.TLS {
		return nil, nil
	}
	cfg := &tls.Config{ServerName: t.Host, MinVersion: tls.VersionTLS12}
	if t.TLSHostname != "" {
		cfg.ServerName = t.TLSHostname
	}
	if t.TLSNoVerify {
		cfg.InsecureSkipVerify = true
	}
	if t.TLSCertDir == "" {
		return cfg, nil
	}
	ca, err := os.ReadFile(filepath.Join(t.TLSCertDir, "ca-cert.pem"))
	switch {
	case err == nil:
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(ca) {
			return nil, fmt.Errorf("%s: no PEM certificate", filepath.Join(t.TLSCertDir, "ca-cert.pem"))
		}
		cfg.RootCAs = pool
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	certFile := filepath.Join(t.TLSCertDir, "client-cert.pem")
	keyFile := filepath.Join(t.TLSCertDir, "client-key.pem")
	if _, err := os.Stat(certFile); err == nil {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}
