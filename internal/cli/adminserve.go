package cli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tiercache/tiercache/admin"
)

// startAdmin serves the admin API on the unix socket g.adminAddr() (mode
// 0600; "none" disables it) and, with --admin-tcp, on TCP, where every
// request needs the bearer token of g.tokenPath() (/metrics too unless
// --metrics-no-auth). A TCP address without a host binds 127.0.0.1: the
// API can detach devices, so exposing it beyond the machine must be asked
// for explicitly. It returns the function that stops it.
func startAdmin(g *globals, o *serveOptions, log *slog.Logger, cfg admin.Config) (func() error, error) {
	cfg.Version = versionString()
	cfg.Logger = log
	cfg.Release = releaseBacking
	// The default socket (DATA_DIR/admin.sock) is best effort: when another
	// server already answers there (several servers sharing a data
	// directory), this one runs without it and says so. An explicit
	// --admin or $TIERCACHE_ADMIN must work.
	explicit := g.admin != "" || os.Getenv("TIERCACHE_ADMIN") != ""
	var specs []listenSpec
	if addr := g.adminAddr(); addr != "none" {
		if err := os.MkdirAll(filepath.Dir(addr), 0o700); err != nil {
			if explicit {
				return nil, fmt.Errorf("admin API: %w", err)
			}
			log.Warn("admin API not started", "err", err)
		} else {
			specs = append(specs, listenSpec{"unix", addr})
		}
	}
	if o.adminTCP != "" {
		spec, err := parseListen("tcp:" + o.adminTCP)
		if err != nil {
			return nil, fmt.Errorf("--admin-tcp: %w", err)
		}
		specs = append(specs, spec)
	}
	if len(specs) == 0 {
		return func() error { return nil }, nil
	}
	if o.adminTCP != "" {
		tok, created, err := adminToken(g.tokenPath())
		if err != nil {
			return nil, fmt.Errorf("admin API over TCP: %w", err)
		}
		if created {
			log.Info("created the admin API token (clients over TCP send it as 'Authorization: Bearer TOKEN')", "file", g.tokenPath())
		}
		cfg.Access = admin.Access{Token: tok, TokenFile: g.tokenPath(), OpenMetrics: o.metricsNoAuth}
	}
	var ls []net.Listener
	for _, spec := range specs {
		if spec.network == "unix" {
			if err := safeSocketDir(spec.addr); err != nil {
				for _, l := range ls {
					l.Close()
				}
				return nil, fmt.Errorf("admin API: %w", err)
			}
		}
		l, err := listen(spec, 0o600)
		if err != nil && spec.network == "unix" && !explicit {
			log.Warn("admin API not started on the default socket; give this server its own with --admin PATH", "err", err)
			continue
		}
		if err != nil {
			for _, l := range ls {
				l.Close()
			}
			return nil, fmt.Errorf("admin API: %w", err)
		}
		ls = append(ls, l)
		cfg.Admin = append(cfg.Admin, spec.String())
		log.Info("admin API listening", "addr", spec.String())
	}
	srv := admin.New(cfg)
	hs := &http.Server{Handler: srv.Handler(), ConnContext: admin.ConnContext, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	for _, l := range ls {
		go func() {
			if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("admin API", "addr", l.Addr().String(), "err", err)
			}
		}()
	}
	return func() error {
		// Flushes and checks in progress end now (a detach runs on), so
		// that Shutdown does not wait for them; srv.Close then waits for
		// every handler still running, since the cache set is closed
		// next and nothing may call into it after.
		srv.Shutdown()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err := hs.Shutdown(ctx)
		if err != nil {
			hs.Close()
		}
		srv.Close()
		// Closing a unix listener removes its socket file; nothing else
		// is removed, as the path may belong to another server by now.
		return nil
	}, nil
}

// adminToken reads the bearer token from path, or creates it there (32
// random bytes, hex, mode 0600, its directory 0700) when there is none. A
// token file that others may read or write is refused: anyone who can read
// it can attach and detach devices with the server's privileges.
func adminToken(path string) (tok string, created bool, err error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return "", false, err
		}
		b := make([]byte, 32)
		if _, err := rand.Read(b); err != nil {
			return "", false, err
		}
		tok = hex.EncodeToString(b)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return "", false, fmt.Errorf("creating the token file: %w", err)
		}
		_, werr := f.WriteString(tok + "\n")
		if err := errors.Join(werr, f.Sync(), f.Close()); err != nil {
			os.Remove(path)
			return "", false, fmt.Errorf("writing the token file %s: %w", path, err)
		}
		return tok, true, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("token file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return "", false, fmt.Errorf("token file %s is not a regular file (%s); remove it and a new token is created", path, fi.Mode().Type())
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return "", false, fmt.Errorf("token file %s has mode %04o: other users may read it; 'chmod 600 %s' (and, if it may have leaked, remove it so that a new token is created)", path, perm, path)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false, fmt.Errorf("token file: %w", err)
	}
	tok = strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return "", false, fmt.Errorf("token file %s holds %d characters, want at least 16 (remove it and a new token is created)", path, len(tok))
	}
	return tok, false, nil
}

// safeSocketDir refuses a socket directory that users other than its
// owner may write without the sticky bit: they could replace the socket
// and answer the commands meant for the server.
func safeSocketDir(sock string) error {
	dir := filepath.Dir(sock)
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if m := fi.Mode(); m.Perm()&0o022 != 0 && m&os.ModeSticky == 0 {
		return fmt.Errorf("the directory of the admin socket %s has mode %04o: other users may replace the socket; 'chmod go-w %s', or put the socket elsewhere with --admin PATH", sock, m.Perm(), dir)
	}
	return nil
}

// backingPath is the device spec a volume's backing device was opened
// from: --backing NAME=PATH, else the path recorded in the superblock.
func backingPath(o *serveOptions, recorded map[string]string, name string) string {
	for _, b := range o.backings {
		if n, p, err := parseNamePath("backing", b); err == nil && n == name {
			return p
		}
	}
	return recorded[name]
}
