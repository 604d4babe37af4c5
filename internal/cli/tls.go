package cli

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// tlsOptions are serve's TLS flags.
type tlsOptions struct {
	cert, key, clientCA string
	required            bool
}

// config builds the server's TLS configuration, or nil when TLS is off.
// Client certificates are required and verified when a client CA is given:
// with NBD a client that can connect can read and write the whole disk.
func (o tlsOptions) config() (*tls.Config, error) {
	if o.cert == "" && o.key == "" {
		if o.clientCA != "" || o.required {
			return nil, errors.New("--tls-client-ca and --tls-required need --tls-cert and --tls-key")
		}
		return nil, nil
	}
	if o.cert == "" || o.key == "" {
		return nil, errors.New("--tls-cert and --tls-key go together")
	}
	pair, err := tls.LoadX509KeyPair(o.cert, o.key)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	if o.clientCA != "" {
		pem, err := os.ReadFile(o.clientCA)
		if err != nil {
			return nil, fmt.Errorf("--tls-client-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-client-ca %s: no PEM certificates", o.clientCA)
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}
