package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/plain"
	"github.com/tiercache/tiercache/nbd"
)

// Sizes of the embedded default's sparse files: big enough to mkfs and use,
// free until written.
const (
	defaultBackingSize = 8 << 30
	defaultCacheSize   = 1 << 30
	defaultExportName  = "default"
)

type serveOptions struct {
	exports    []string
	listens    []string
	readOnly   bool
	direct     string
	socketMode string
	drainWait  time.Duration
}

func newServeCmd(g *globals) *cobra.Command {
	o := &serveOptions{}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve exports over NBD until SIGINT or SIGTERM",
		Long: `Serve exports over NBD.

With no arguments, serve creates (once) sparse files under --data-dir and
serves them as the export "default" on the unix socket
DATA_DIR/tiercache.sock.

--export NAME=PATH serves a file or block device directly, without a cache.

On SIGINT or SIGTERM the server stops accepting connections, lets in-flight
requests finish, flushes every export and exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return serve(cmd.Context(), g, o) },
	}
	f := cmd.Flags()
	f.StringArrayVar(&o.exports, "export", nil, "serve `NAME=PATH` (a file or block device) without a cache; repeatable")
	f.StringArrayVar(&o.listens, "listen", nil, "listen on `unix:PATH` or tcp:HOST:PORT (host defaults to 127.0.0.1); repeatable (default unix:DATA_DIR/tiercache.sock)")
	f.BoolVar(&o.readOnly, "read-only", false, "serve every export read-only")
	f.StringVar(&o.direct, "direct", "auto", "O_DIRECT for devices: auto (when the file system allows it), on, off")
	f.StringVar(&o.socketMode, "socket-mode", "0600", "permissions of unix sockets")
	f.DurationVar(&o.drainWait, "shutdown-timeout", 30*time.Second, "how long to wait for in-flight requests at shutdown")
	return cmd
}

// parseDirect maps the --direct flag to a device.DirectMode.
func parseDirect(s string) (device.DirectMode, error) {
	switch s {
	case "auto":
		return device.DirectAuto, nil
	case "on":
		return device.DirectOn, nil
	case "off":
		return device.DirectOff, nil
	}
	return 0, fmt.Errorf("--direct %q: want auto, on or off", s)
}

// parseNamePath splits NAME=PATH.
func parseNamePath(flag, s string) (name, path string, err error) {
	name, path, ok := strings.Cut(s, "=")
	if !ok || name == "" || path == "" {
		return "", "", fmt.Errorf("--%s %q: want NAME=PATH", flag, s)
	}
	if len(name) > 4096 {
		return "", "", fmt.Errorf("--%s: name longer than 4096 bytes", flag)
	}
	return name, path, nil
}

func serve(ctx context.Context, g *globals, o *serveOptions) error {
	log, err := g.logger()
	if err != nil {
		return err
	}
	direct, err := parseDirect(o.direct)
	if err != nil {
		return err
	}
	mode, err := strconv.ParseUint(o.socketMode, 8, 32)
	if err != nil || mode > 0o777 {
		return fmt.Errorf("--socket-mode %q: want an octal mode such as 0600", o.socketMode)
	}
	var specs []listenSpec
	for _, s := range o.listens {
		spec, err := parseListen(s)
		if err != nil {
			return err
		}
		specs = append(specs, spec)
	}
	if len(specs) == 0 {
		if err := os.MkdirAll(g.dataDir, 0o700); err != nil {
			return fmt.Errorf("data directory: %w", err)
		}
		specs = append(specs, listenSpec{"unix", filepath.Join(g.dataDir, "tiercache.sock")})
	}

	exports := o.exports
	if len(exports) == 0 {
		path, err := prepareDefault(g.dataDir, log)
		if err != nil {
			return err
		}
		exports = []string{defaultExportName + "=" + path}
	}

	setIOFlusher(log)

	srv := nbd.NewServer(nbd.Config{Logger: log})
	var devs []device.Device
	defer func() {
		for _, d := range devs {
			d.Close()
		}
	}()
	seen := map[string]bool{}
	for _, e := range exports {
		name, path, err := parseNamePath("export", e)
		if err != nil {
			return err
		}
		if seen[name] {
			return fmt.Errorf("--export: export %q given twice", name)
		}
		seen[name] = true
		dev, err := device.OpenFile(path, device.FileOptions{ReadOnly: o.readOnly, Direct: direct})
		if err != nil {
			return fmt.Errorf("export %q: %w", name, err)
		}
		devs = append(devs, dev)
		if err := srv.AddExport(nbd.Export{
			Name:        name,
			Description: "tiercache plain export of " + path,
			Backend:     plain.New(dev),
			ReadOnly:    o.readOnly,
		}); err != nil {
			return err
		}
		log.Info("export", "name", name, "path", path, "size", dev.Size(), "direct", dev.Direct(), "read_only", o.readOnly)
	}
	return run2(ctx, log, srv, specs, os.FileMode(mode), o.drainWait)
}

// run2 listens on every spec and serves until a signal, then shuts down.
func run2(ctx context.Context, log *slog.Logger, srv *nbd.Server, specs []listenSpec, perm os.FileMode, drainWait time.Duration) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	var listeners []net.Listener
	for _, spec := range specs {
		l, err := listen(spec, perm)
		if err != nil {
			for _, l := range listeners {
				l.Close()
			}
			return err
		}
		listeners = append(listeners, l)
		log.Info("listening", "addr", spec.String())
	}
	serveErr := make(chan error, len(listeners))
	var wg sync.WaitGroup
	for _, l := range listeners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(l); err != nil && !errors.Is(err, nbd.ErrServerClosed) {
				serveErr <- err
			}
		}()
	}
	var err error
	select {
	case <-ctx.Done():
		log.Info("shutting down: finishing in-flight requests and flushing")
	case err = <-serveErr:
		log.Error("listener failed; shutting down", "err", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), drainWait)
	defer cancel()
	if serr := srv.Shutdown(sctx); serr != nil && err == nil {
		err = fmt.Errorf("shutdown: %w", serr)
	}
	for _, l := range listeners {
		l.Close()
	}
	wg.Wait()
	for _, spec := range specs {
		if spec.network == "unix" {
			os.Remove(spec.addr)
		}
	}
	if err == nil {
		log.Info("stopped cleanly")
	}
	return err
}

// prepareDefault creates the embedded default's backing file once.
func prepareDefault(dir string, log *slog.Logger) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("data directory: %w", err)
	}
	path := filepath.Join(dir, "backing.img")
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		if err := device.CreateSparse(path, defaultBackingSize); err != nil {
			return "", err
		}
		log.Info("created sparse backing file", "path", path, "size", defaultBackingSize)
	}
	return path, nil
}

// setIOFlusher marks the process as an I/O flusher (PR_SET_IO_FLUSHER, Linux
// 5.6+): when the kernel's NBD client runs on the same machine, memory
// reclaim may wait on writeback through us, and our own allocations must
// not recurse into that reclaim or the machine deadlocks.
func setIOFlusher(log *slog.Logger) {
	const prSetIOFlusher = 57
	if err := unix.Prctl(prSetIOFlusher, 1, 0, 0, 0); err != nil {
		log.Debug("PR_SET_IO_FLUSHER not set", "err", err)
	}
}
