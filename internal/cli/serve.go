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
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/nbddev"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/internal/names"
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
	// s3 is where the store of image URIs is that do not say (the
	// config file's [s3]).
	s3     s3Defaults
	cache  string
	mirror string
	// mirrorMissing: open a mirrored set with one member missing (gone for
	// good, the other not run alone since).
	mirrorMissing bool
	backings      []string
	force         bool
	coldClean     bool
	exports       []string
	listens       []string
	readOnly      bool
	direct        string
	socketMode    string
	drainWait     time.Duration
	adminTCP      string
	// metricsNoAuth: GET /metrics over --admin-tcp needs no token.
	metricsNoAuth bool
	maxConns      int
	maxInFlight   string // a size: payload bytes in flight on all connections
	procs         string // --procs: auto or N (procs.go)
	tls           tlsOptions
	// remote: how long requests to a remote backing device wait for its
	// link to come back before failing with EIO, and for a reply.
	remote remoteTimeouts
}

func newServeCmd(g *globals) *cobra.Command {
	o := &serveOptions{}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve exports over NBD until SIGINT or SIGTERM",
		Long: `Serve exports over NBD.

With no arguments, serve creates (once) a cache set under --data-dir: a
sparse 1 GiB cache file in front of a sparse 8 GiB backing file, in writeback
mode, and serves it as the export "default" on the unix socket
DATA_DIR/tiercache.sock.

--cache PATH opens the cache set on PATH (see 'tiercache format'), recovers
it, and exports every backing device under its name. The backing devices are
found at the paths recorded by format; --backing NAME=PATH overrides one.

--export NAME=PATH serves a file or block device directly, without a cache.

Any device PATH may be written hdd:PATH, ssd:PATH or nvme:PATH to put a
performance model of such a disk over the file (see docs/MODELS.md). A
backing device may be an NBD URI (nbd://HOST[:PORT]/EXPORT, nbds://...,
nbd+unix:///EXPORT?socket=PATH; see docs/OPERATIONS.md, "Remote backing
devices").
A backing file that belongs to a cache set is refused (the set may hold
newer, dirty data for it) unless --force.

On SIGINT or SIGTERM the server stops accepting connections, lets in-flight
requests finish, flushes every export, cuts short a 'tiercache flush' or
'check' in progress (a detach runs to its end), closes the cache set (final
checkpoint, marked clean) and exits 0. If any of that fails it exits 1 with
the reason; a cache set failed over to passthrough is left unclean on
purpose (a repaired cache device replays its journal).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfgPath, _ := g.configPath(); cfgPath != "" {
				c, err := loadServeConfig(cfgPath)
				if err != nil {
					return err
				}
				if err := applyServeConfig(cmd, g, o, c); err != nil {
					return err
				}
				if o.s3, err = g.s3Defaults(s3Defaults{}); err != nil {
					return err
				}
			}
			if o.tls.clientCA != "" {
				// Client certificates authenticate clients only if every
				// client must start TLS: a plaintext client would bypass
				// them (and list exports, read and write).
				if cmd.Flags().Changed("tls-required") && !o.tls.required {
					return errors.New("--tls-client-ca requires TLS of every client, so --tls-required=false contradicts it: drop --tls-required=false, or drop --tls-client-ca to let clients in without certificates")
				}
				o.tls.required = true
			}
			return serve(cmd.Context(), g, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.cache, "cache", "", "serve the cache set on this cache device")
	f.StringVar(&o.mirror, "cache-mirror", "", "the second cache device `PATH` of a mirrored cache set (see 'tiercache format --cache-mirror')")
	f.BoolVar(&o.mirrorMissing, "mirror-missing", false, "serve a mirrored cache set on the one member given, although its label says the other is in sync (the other is gone for good and this one was not served alone since)")
	f.StringArrayVar(&o.backings, "backing", nil, "path of a cache set's backing device `NAME=PATH`, overriding the recorded one; repeatable")
	f.BoolVar(&o.force, "force", false, "serve despite identity mismatches or a backing device that belongs to a cache set (may serve stale data)")
	f.BoolVar(&o.coldClean, "cold-clean", false, "recover the cache set with no clean cached data, as after a crash of a set without region marks (a restart on a cache device that failed over; see the log of the failover)")
	f.StringArrayVar(&o.exports, "export", nil, "serve `NAME=PATH` (a file or block device) without a cache; repeatable")
	f.StringArrayVar(&o.listens, "listen", nil, "listen on `unix:PATH` or tcp:HOST:PORT (host defaults to 127.0.0.1); repeatable (default unix:DATA_DIR/tiercache.sock)")
	f.BoolVar(&o.readOnly, "read-only", false, "serve every export read-only")
	f.StringVar(&o.direct, "direct", "auto", "O_DIRECT for devices: auto (when the file system allows it), on, off")
	f.StringVar(&o.socketMode, "socket-mode", "0600", "permissions of unix sockets")
	f.StringVar(&o.tls.cert, "tls-cert", "", "PEM certificate `FILE` for NBD STARTTLS")
	f.StringVar(&o.tls.key, "tls-key", "", "PEM private key `FILE` for --tls-cert")
	f.StringVar(&o.tls.clientCA, "tls-client-ca", "", "require client certificates signed by the CAs in this PEM `FILE` (implies --tls-required)")
	f.BoolVar(&o.tls.required, "tls-required", false, "refuse clients that do not start TLS")
	f.DurationVar(&o.drainWait, "shutdown-timeout", 30*time.Second, "how long to wait for in-flight requests at shutdown")
	f.StringVar(&o.adminTCP, "admin-tcp", "", "also serve the admin API and /metrics on TCP `HOST:PORT` (host defaults to 127.0.0.1); requests need the bearer token of --admin-token-file")
	f.IntVar(&o.maxConns, "max-connections", 64, "serve at most `N` NBD connections at once; more are refused at NBD_OPT_GO (0: unlimited)")
	f.StringVar(&o.maxInFlight, "max-inflight", "256M", "bound on READ/WRITE payload `BYTES` in flight on all NBD connections together (each connection keeps max-inflight/(2 x max-connections) of it)")
	f.StringVar(&o.procs, "procs", "auto", "Go processors (GOMAXPROCS) to serve with: auto (one per connection serving an export, at most the CPUs; all CPUs while none serves) or `N`; GOMAXPROCS in the environment overrides it")
	f.DurationVar(&o.remote.outage, "remote-timeout", nbddev.DefaultOutageTimeout, "how long requests to a remote (NBD URI) backing device wait for a lost connection to come back, or keep failing on new ones, before failing with EIO (reads of cached data and writeback-mode writes do not wait)")
	f.DurationVar(&o.remote.request, "remote-request-timeout", nbddev.DefaultRequestTimeout, "how long a request to a remote (NBD URI) backing device waits for its reply before the connection is closed as hung and the request sent again on a new one")
	f.BoolVar(&o.metricsNoAuth, "metrics-no-auth", false, "let GET /metrics over --admin-tcp in without the bearer token (every other request still needs it)")
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

// parseNamePath splits NAME=PATH and checks NAME against the name rule
// (internal/names): every name given on the command line, in the config
// file or to attach passes through here.
func parseNamePath(flag, s string) (name, path string, err error) {
	name, path, ok := strings.Cut(s, "=")
	if !ok || name == "" || path == "" {
		return "", "", fmt.Errorf("--%s %q: want NAME=PATH", flag, s)
	}
	if err := names.Check(name); err != nil {
		return "", "", fmt.Errorf("--%s: %w", flag, err)
	}
	return name, path, nil
}

func serve(ctx context.Context, g *globals, o *serveOptions) (err error) {
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
	// Names are checked before anything is opened or listened on.
	for _, e := range o.exports {
		if _, _, err := parseNamePath("export", e); err != nil {
			return err
		}
	}
	for _, b := range o.backings {
		if _, _, err := parseNamePath("backing", b); err != nil {
			return err
		}
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

	// The NBD listeners first: a socket another server holds is refused
	// before the cache set is opened (recovery writes a checkpoint). They
	// exist before the admin API answers too, so a script that waits for
	// the admin socket can connect to the exports at once; connections
	// wait in the backlog until the exports are added.
	var listeners []net.Listener
	var listenNames []string
	handedOver := false
	defer func() {
		if !handedOver {
			for _, l := range listeners {
				l.Close()
			}
		}
	}()
	for _, spec := range specs {
		l, err := listen(spec, os.FileMode(mode))
		if err != nil {
			return err
		}
		listeners = append(listeners, l)
		listenNames = append(listenNames, spec.String())
		log.Info("listening", "addr", spec.String())
	}

	cachePath := o.cache
	if cachePath == "" && len(o.exports) == 0 {
		if cachePath, err = prepareDefault(g.dataDir, log); err != nil {
			return err
		}
	}

	setIOFlusher(log)

	tlsCfg, err := o.tls.config()
	if err != nil {
		return err
	}
	maxInFlight, err := parseSize(o.maxInFlight)
	if err != nil || maxInFlight < 1<<20 {
		return fmt.Errorf("--max-inflight %q: want a size of at least 1M, such as 256M", o.maxInFlight)
	}
	if o.maxConns < 0 {
		return fmt.Errorf("--max-connections %d: want 0 (unlimited) or more", o.maxConns)
	}
	onServing, err := servingProcs(o.procs)
	if err != nil {
		return err
	}
	srv := nbd.NewServer(nbd.Config{Logger: log, TLSConfig: tlsCfg, RequireTLS: o.tls.required,
		MaxConnections: o.maxConns, MaxInFlightTotal: maxInFlight, OnServing: onServing})
	// Closed in reverse order: the admin API (waiting for its requests),
	// then the cache set (final checkpoint, clean flag), then devices. A
	// failure there is the exit status too: "stopped cleanly" and exit 0
	// mean the set is marked clean (a failed-over set is not, on purpose).
	var closers []func() error
	served := false
	// dirty is what the cache set still holds for the backing devices when
	// it closes (a clean stop does not write it back).
	var dirty int64
	defer func() {
		for i := len(closers) - 1; i >= 0; i-- {
			if cerr := closers[i](); cerr != nil {
				log.Error("close", "err", cerr)
				if err == nil {
					err = cerr
				}
			}
		}
		if served && err == nil {
			if dirty > 0 {
				log.Info("stopped cleanly; dirty data stays in the cache, written back after the next start (tiercache flush or detach before stopping writes it back now)",
					"dirty", human(dirty), "dirty_bytes", dirty)
			} else {
				log.Info("stopped cleanly; no dirty data in the cache")
			}
		}
	}()
	metrics := admin.NewMetrics()
	adminCfg := admin.Config{NBD: srv, Metrics: metrics, CachePath: cachePath, MirrorPath: o.mirror}
	if cachePath != "" {
		h, err := openSet(log, cachePath, o, direct)
		if err != nil {
			return err
		}
		closers = append(closers, h.close)
		set := h.set
		// Runs after the admin API and the NBD server stopped, just before
		// the set closes: nothing makes new dirty data any more.
		closers = append(closers, func() error {
			dirty = set.Stats().DirtyBlocks * 4096
			return nil
		})
		adminCfg.Set = set
		adminCfg.ReadOnly = o.readOnly
		adminCfg.Attach = func(req admin.AttachRequest) (*cache.Volume, string, error) {
			return h.attach(req, direct)
		}
		adminCfg.Detached = h.closeBacking
		adminCfg.ReplaceMember = func(ctx context.Context, req admin.ReplaceRequest, fn func(cache.ResilverProgress)) (string, string, error) {
			return h.replaceMember(ctx, req, fn, direct)
		}
		adminCfg.RemoteLink = h.remoteLink
		adminCfg.ObjectStore = h.objectStore
		recorded := map[string]string{}
		for _, bi := range set.Superblock().Backings {
			recorded[bi.Name] = bi.Path
		}
		for _, v := range set.Volumes() {
			x := nbd.Export{
				Name:        v.Name(),
				Description: fmt.Sprintf("tiercache volume %s (%s)", v.Name(), v.Mode()),
				Backend:     metrics.Wrap(v.Name(), v),
				ReadOnly:    o.readOnly,
			}
			if err := srv.AddExport(x); err != nil {
				return err
			}
			adminCfg.Exports = append(adminCfg.Exports, admin.Export{Export: x, Path: backingPath(o, recorded, v.Name())})
			log.Info("export", "name", v.Name(), "size", v.Size(), "mode", v.Mode().String(), "cache", cachePath)
		}
	}
	for _, e := range o.exports {
		name, path, err := parseNamePath("export", e)
		if err != nil {
			return err
		}
		release, err := lockDevice(devicePath(path), fmt.Sprintf("export %q: device", name), lockServe)
		if err != nil {
			return err
		}
		closers = append(closers, func() error { release(); return nil })
		if err := refuseClaimed(log, name, path, o.force); err != nil {
			return err
		}
		dev, err := openDevice(path, device.FileOptions{ReadOnly: o.readOnly, Direct: direct})
		if err != nil {
			return fmt.Errorf("export %q: %w", name, err)
		}
		closers = append(closers, dev.Close)
		if sb, err := cache.ReadSuperblock(dev); err == nil {
			if !o.force {
				return fmt.Errorf("export %q: %s is the cache device of cache set %s; serving it as a plain disk exposes (and lets clients overwrite) the set's metadata and cached data: serve the set with --cache %s, or --force to export the raw device anyway",
					name, path, fmtUUID(sb.SetUUID), path)
			}
			log.Warn("exporting a cache device as a plain disk (--force)", "export", name, "path", path, "set", fmtUUID(sb.SetUUID))
		}
		x := nbd.Export{
			Name:        name,
			Description: "tiercache plain export of " + path,
			Backend:     metrics.Wrap(name, plain.New(dev)),
			ReadOnly:    o.readOnly,
		}
		if err := srv.AddExport(x); err != nil {
			return fmt.Errorf("export %q: %w", name, err)
		}
		adminCfg.Exports = append(adminCfg.Exports, admin.Export{Export: x, Path: path})
		log.Info("export", "name", name, "device", path, "size", dev.Size(), "read_only", o.readOnly)
	}
	adminCfg.Listeners = listenNames
	stopAdmin, err := startAdmin(g, o, log, adminCfg)
	if err != nil {
		return err
	}
	closers = append(closers, stopAdmin)
	served = true
	handedOver = true
	return run2(ctx, log, srv, specs, listeners, o.drainWait)
}

// run2 serves on the listeners until a signal, then shuts down.
func run2(ctx context.Context, log *slog.Logger, srv *nbd.Server, specs []listenSpec, listeners []net.Listener, drainWait time.Duration) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
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
	// From here on SIGTERM is a clean stop and every export is served:
	// scripts and tests wait for this line, not for the sockets, which
	// exist (and queue connections) before the cache set is open.
	log.Info("serving", "listeners", len(listeners))
	var err error
	select {
	case <-ctx.Done():
		log.Info("shutting down: finishing in-flight requests, then flushing them (durable in the cache; writeback of dirty data resumes after the next start)")
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
	return err
}

// prepareDefault creates the embedded default once: a sparse cache file in
// front of a sparse backing file, formatted as a writeback cache set. It
// returns the cache device path.
func prepareDefault(dir string, log *slog.Logger) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("data directory: %w", err)
	}
	backing := filepath.Join(dir, "backing.img")
	cachePath := filepath.Join(dir, "cache.img")
	for _, f := range []struct {
		path string
		size int64
	}{{backing, defaultBackingSize}, {cachePath, defaultCacheSize}} {
		if _, err := os.Stat(f.path); errors.Is(err, os.ErrNotExist) {
			if err := device.CreateSparse(f.path, f.size); err != nil {
				return "", err
			}
			log.Info("created sparse file", "path", f.path, "size", f.size)
		}
	}
	unlock, err := lockDevice(cachePath, "cache device", lockServe)
	if err != nil {
		return "", err
	}
	defer unlock()
	cdev, err := device.OpenFile(cachePath, device.FileOptions{Direct: device.DirectOff})
	if err != nil {
		return "", err
	}
	defer cdev.Close()
	if _, err := cache.ReadSuperblock(cdev); err == nil {
		return cachePath, nil
	}
	bdev, err := device.OpenFile(backing, device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		return "", err
	}
	defer bdev.Close()
	id, err := backingid.EnsureID(backing)
	if err != nil {
		return "", err
	}
	if id.ID == "" {
		// A file system without user xattrs: the default set's own file,
		// in its own directory, is identified by its path.
		id.ID = backingid.PathID(backing)
		log.Warn("nothing identifies the default backing file (its file system keeps no user xattrs); identified by its path: a different file put at that path will NOT be caught", "path", backing)
	}
	cacheID, err := backingid.EnsureID(cachePath)
	if err != nil {
		return "", err
	}
	if err := allocateCache(cachePath, cdev.Size()); err != nil {
		return "", err
	}
	sb, err := cache.Format(cdev, []cache.BackingSpec{{Name: defaultExportName, Dev: bdev, ID: id.ID, Path: backing}}, cache.FormatOptions{Mode: cache.Writeback, CacheID: cacheID.ID})
	if err != nil {
		return "", fmt.Errorf("formatting the default cache set: %w", err)
	}
	if err := cdev.Sync(); err != nil {
		return "", err
	}
	if _, err := backingid.Claim(backing, fmtUUID(sb.SetUUID), true); err != nil {
		return "", err
	}
	log.Info("formatted the default cache set", "cache", cachePath, "backing", backing, "set", fmtUUID(sb.SetUUID))
	return cachePath, nil
}

// openedSet is an open cache set with the devices it was opened on. Backing
// devices come and go with attach and detach while it serves.
type openedSet struct {
	set       *cache.Set
	cachePath string
	cdev      device.Device
	mdev      device.Device // mirror member B, nil unless mirrored
	munlock   func()        // its lock's release
	unlock    func()
	mu        sync.Mutex
	devs      map[string]device.Device // backing devices by volume name
	locks     map[string]func()        // their locks' releases (lock.go)
	log       *slog.Logger             // for remote backings attached later
	remote    remoteTimeouts           // serveOptions.remote
	s3        s3Defaults               // serveOptions.s3
	replaced  []func()                 // close and release devices brought in by replace (replace.go)
}

// closeBacking closes the backing device of a volume that left the set.
func (h *openedSet) closeBacking(name string) {
	h.mu.Lock()
	d, release := h.devs[name], h.locks[name]
	delete(h.devs, name)
	delete(h.locks, name)
	h.mu.Unlock()
	if d != nil {
		d.Close()
	}
	if release != nil {
		release()
	}
}

// closeDevices closes every device and releases the cache device's lock.
func (h *openedSet) closeDevices() {
	h.mu.Lock()
	for n, d := range h.devs {
		d.Close()
		delete(h.devs, n)
	}
	for n, release := range h.locks {
		release()
		delete(h.locks, n)
	}
	for _, c := range h.replaced {
		c()
	}
	h.replaced = nil
	h.mu.Unlock()
	h.cdev.Close()
	if h.mdev != nil {
		h.mdev.Close()
		h.munlock()
	}
	h.unlock()
}

// close shuts the set down cleanly and closes its devices.
func (h *openedSet) close() error {
	err := h.set.Close()
	h.closeDevices()
	return err
}

// openSet opens and recovers the cache set on cachePath with its backing
// devices.
func openSet(log *slog.Logger, cachePath string, o *serveOptions, direct device.DirectMode) (*openedSet, error) {
	overrides := map[string]string{}
	for _, b := range o.backings {
		name, path, err := parseNamePath("backing", b)
		if err != nil {
			return nil, err
		}
		overrides[name] = path
	}
	unlock, err := lockDevice(devicePath(cachePath), "cache device", lockServe)
	if err != nil {
		return nil, err
	}
	cdev, err := openDevice(cachePath, device.FileOptions{Direct: direct})
	if err != nil {
		unlock()
		return nil, fmt.Errorf("cache device: %w", err)
	}
	h := &openedSet{cachePath: cachePath, cdev: cdev, unlock: unlock, devs: map[string]device.Device{}, locks: map[string]func(){}, log: log, remote: o.remote, s3: o.s3}
	if o.mirror != "" {
		release, err := lockDevice(devicePath(o.mirror), "mirror cache device", lockServe)
		if err != nil {
			h.closeDevices()
			return nil, err
		}
		mdev, err := openDevice(o.mirror, device.FileOptions{Direct: direct})
		if err != nil {
			release()
			h.closeDevices()
			return nil, fmt.Errorf("mirror cache device: %w", err)
		}
		h.mdev, h.munlock = mdev, release
	}
	sb, err := cache.ReadSuperblock(cdev)
	if errors.Is(err, cache.ErrNotFormatted) {
		h.closeDevices()
		return nil, fmt.Errorf("%s is not a tiercache cache device (no superblock); create a cache set with 'tiercache format'", cachePath)
	}
	if err != nil {
		h.closeDevices()
		return nil, fmt.Errorf("cache device %s: %w", cachePath, err)
	}
	setUUID := fmtUUID(sb.SetUUID)
	closeDevs := h.closeDevices
	// The identity recorded is member A's: member B of a mirrored set
	// served alone (A failed) is recognised by its mirror label.
	if sb.CacheID != "" && cache.MirrorMember(cdev) != "B" {
		if err := backingid.Check(sb.CacheID, devicePath(cachePath)); err != nil {
			if !o.force {
				closeDevs()
				return nil, fmt.Errorf("cache device %w: this is not the device cache set %s was formatted on (a copy of it?); its dirty data would be written back into the set's disks, over newer data: serve the original device; if this IS the set's device and only its identity changed, record its identity now with 'tiercache identity --cache %s --rerecord-cache' (--force serves it once, and every later serve needs --force again)", err, setUUID, cachePath)
			}
			log.Warn("serving a cache device whose identity does not match the one recorded (--force); if it is the set's device, record its identity with 'tiercache identity --cache CACHE --rerecord-cache' once the server is stopped", "cache", cachePath, "err", err)
		}
	}
	var specs []cache.BackingSpec
	for _, bi := range sb.Backings {
		if bi.Free() {
			continue
		}
		path := bi.Path
		if p, ok := overrides[bi.Name]; ok {
			path = p
			delete(overrides, bi.Name)
		}
		if path == "" {
			closeDevs()
			return nil, fmt.Errorf("cache set %s: no path for backing device %q; give --backing %s=PATH", setUUID, bi.Name, bi.Name)
		}
		if isObjImage(path) {
			od, err := openObjImage(path, o.s3, o.readOnly, o.force, log.With("volume", bi.Name))
			if err != nil {
				closeDevs()
				return nil, fmt.Errorf("backing %q: %w", bi.Name, err)
			}
			if err := checkObjImage(bi.ID, od); err != nil {
				if !o.force {
					od.Close()
					closeDevs()
					return nil, fmt.Errorf("backing %q: %w; give the right image with --backing %s=s3://..., or --force", bi.Name, err, bi.Name)
				}
				log.Warn("serving an object-store image whose identity does not match the one recorded (--force)", "volume", bi.Name, "err", err)
			}
			h.devs[bi.Name] = od
			specs = append(specs, cache.BackingSpec{Name: bi.Name, Dev: od, ID: bi.ID, Path: path})
			continue
		}
		if isRemote(path) {
			rd, err := openRemote(path, o.readOnly, o.remote, log.With("volume", bi.Name))
			if err != nil {
				closeDevs()
				return nil, fmt.Errorf("backing %q: %w", bi.Name, err)
			}
			if err := checkRemote(bi.ID, rd); err != nil {
				if !o.force {
					rd.Close()
					closeDevs()
					return nil, fmt.Errorf("backing %q: %w; a different export would be served the set's cached data for %q and written its dirty data: give the right export with --backing %s=URI, or --force if this is the export and only its URI or description changed",
						bi.Name, err, bi.Name, bi.Name)
				}
				log.Warn("serving a remote backing whose identity does not match the one recorded (--force)", "volume", bi.Name, "uri", rd.Target().String(), "err", err)
			}
			release := func() {}
			if !o.readOnly {
				if release, err = lockRemote(rd, fmt.Sprintf("backing device of volume %q", bi.Name)); err != nil {
					rd.Close()
					closeDevs()
					return nil, err
				}
			}
			if err := syncRemote(rd, o.readOnly); err != nil {
				rd.Close()
				release()
				closeDevs()
				return nil, fmt.Errorf("backing %q: %w", bi.Name, err)
			}
			h.devs[bi.Name] = rd
			h.locks[bi.Name] = release
			specs = append(specs, cache.BackingSpec{Name: bi.Name, Dev: rd, ID: bi.ID, Path: path})
			continue
		}
		release, err := lockDevice(devicePath(path), fmt.Sprintf("backing device %q", bi.Name), lockServe)
		if err != nil {
			closeDevs()
			return nil, err
		}
		h.locks[bi.Name] = release
		id, err := backingid.Read(devicePath(path))
		if err != nil {
			closeDevs()
			return nil, fmt.Errorf("backing %q: %w", bi.Name, err)
		}
		if id.Set != "" && id.Set != setUUID && !o.force {
			closeDevs()
			return nil, fmt.Errorf("backing %q (%s) belongs to cache set %s, not %s; use --force to serve it anyway", bi.Name, path, id.Set, setUUID)
		}
		if err := backingid.Check(bi.ID, devicePath(path)); err != nil {
			if !o.force {
				closeDevs()
				return nil, fmt.Errorf("backing %q: %w; a wrong disk would be served the set's cached data for %q and written its dirty data: give the right device with --backing %s=PATH; if this IS the disk and only its identity changed, record its identity now with 'tiercache identity --cache %s --rerecord %s' (--force serves it once, and every later serve needs --force again)",
					bi.Name, err, bi.Name, bi.Name, cachePath, bi.Name)
			}
			log.Warn("serving a backing device whose identity does not match the one recorded (--force); if it is the volume's disk, record its identity with 'tiercache identity --cache CACHE --rerecord NAME' once the server is stopped", "volume", bi.Name, "path", path, "err", err)
		}
		bdev, err := openDevice(path, device.FileOptions{ReadOnly: o.readOnly, Direct: direct})
		if err != nil {
			closeDevs()
			return nil, fmt.Errorf("backing %q: %w", bi.Name, err)
		}
		h.devs[bi.Name] = bdev
		specs = append(specs, cache.BackingSpec{Name: bi.Name, Dev: bdev, ID: bi.ID, Path: path})
	}
	for name := range overrides {
		closeDevs()
		return nil, fmt.Errorf("--backing %s: cache set %s has no backing device of that name", name, setUUID)
	}
	start := time.Now()
	set, err := cache.Open(cdev, specs, cache.OpenOptions{Force: o.force, AcceptJournalLoss: o.force, ColdClean: o.coldClean, Logger: log,
		Mirror: h.mdev, MirrorMissing: o.mirrorMissing})
	if err != nil {
		closeDevs()
		return nil, fmt.Errorf("opening cache set %s on %s: %w%s", setUUID, cachePath, err, openHint(err))
	}
	// Recovery's transient heap (the checkpoint body, the decoded entries,
	// the reverse map) is garbage once Open returns, several times the
	// index; the runtime gives it back to the OS only slowly, so a served
	// set's RSS otherwise stays at its recovery peak (docs/BENCHMARKS.md,
	// "Metadata at scale").
	debug.FreeOSMemory()
	st := set.Stats()
	log.Info("cache set open", "set", setUUID, "cache", cachePath, "recovery", time.Since(start).Round(time.Millisecond),
		"cached_blocks", st.CachedBlocks, "dirty_blocks", st.DirtyBlocks)
	h.set = set
	return h, nil
}

// openHint says how to proceed past an Open refusal on purpose.
func openHint(err error) string {
	var bm *cache.BackingMismatchError
	switch {
	case cache.IsJournalLoss(err):
		return "; 'tiercache check --cache' reports the same; to serve what is left (the lost writes stay undone), serve with --force"
	case errors.As(err, &bm) && bm.Field == "size":
		return fmt.Sprintf("; the set's index addresses a device of %s bytes, and no flag serves a different size: restore the device to that size "+
			"(truncate -s %s, or resize the volume), serve, and detach %s to write its dirty data back; then resize it and attach it again",
			bm.Expected, bm.Expected, bm.Name)
	}
	return ""
}

// refuseClaimed refuses to serve a cache set's backing device alone: the set
// may hold newer (dirty) data for it, so reads would be stale, and writes
// made now would be overwritten by that data's writeback later.
func refuseClaimed(log *slog.Logger, name, path string, force bool) error {
	id, err := backingid.Read(devicePath(path))
	if err != nil {
		return fmt.Errorf("export %q: %w", name, err)
	}
	if id.Set == "" {
		return nil
	}
	if !force {
		return fmt.Errorf("export %q: %s is a backing device of cache set %s, which may hold newer (dirty) data for it; serve the set with --cache, or detach it first (--force serves it alone anyway)", name, path, id.Set)
	}
	log.Warn("serving a cache set's backing device alone (--force): reads may return data older than clients wrote through the set, and the set's dirty data will overwrite what is written now when it is served again", "export", name, "path", path, "set", id.Set)
	return nil
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
