package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/internal/backingid"
)

// startAdmin serves the admin API on the unix socket g.adminAddr() (mode
// 0600; "none" disables it) and, with --admin-tcp, on TCP. A TCP address
// without a host binds 127.0.0.1: the API can detach devices, so exposing
// it beyond the machine must be asked for explicitly. It returns the
// function that stops it.
func startAdmin(g *globals, o *serveOptions, log *slog.Logger, cfg admin.Config) (func() error, error) {
	cfg.Version = Version
	cfg.Logger = log
	cfg.Release = func(path string) error { return backingid.Release(devicePath(path)) }
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
	var ls []net.Listener
	for _, spec := range specs {
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
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
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
