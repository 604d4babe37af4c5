package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/internal/names"
)

func newAttachCmd(g *globals) *cobra.Command {
	var (
		cachePath, mode, direct  string
		force, asJSON, trustPath bool
	)
	cmd := &cobra.Command{
		Use:   "attach [--cache PATH] NAME=PATH [--mode MODE] [--force]",
		Short: "Add an existing disk (backing device) to a cache set, as a new export",
		Long: `Add the backing device PATH to a cache set as the volume NAME.

Without --cache, the running server (found like every other command, by
--admin, $TIERCACHE_ADMIN or the data directory) attaches it while it
serves: NAME becomes a new NBD export at once, clients of the other
exports are not disturbed. With --cache PATH, the cache set on PATH is
changed offline (it must not be served; the export appears at the next
'tiercache serve --cache PATH').

The disk keeps every byte: attach writes only the cache set's superblock
and two extended attributes of a backing file (user.tiercache.id and
user.tiercache.set), never its data. Its data is served as it is, and
cached from then on in MODE (default writeback).

Refused: a NAME that is already an export, a PATH that is already in the
set or is the cache device, and a disk that belongs to another cache set
(its user.tiercache.set attribute names it) unless --force (use --force
only when that set is gone: it may hold newer, dirty data for the disk).

The disk's identity is recorded and checked at every later serve: a file's
user.tiercache.id attribute (a copy made without attributes is refused), a
block device's WWN or serial, partition UUID, device-mapper/md UUID, a loop
device's backing file, or its /dev/disk/by-id link. A device with none of
these is refused unless --trust-path (identified by its path then). A disk
that a running tiercache process has open is refused, even with --force.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path, err := parseNamePath("attach", args[0])
			if errors.Is(err, names.ErrInvalid) {
				return fmt.Errorf("attach: %w", errors.Unwrap(err))
			}
			if err != nil {
				return fmt.Errorf("attach: want NAME=PATH, got %q", args[0])
			}
			if _, err := cache.ParseMode(mode); err != nil {
				return fmt.Errorf("--mode: %w", err)
			}
			req := admin.AttachRequest{Name: name, Path: absSpec(path), Mode: mode, Force: force, TrustPath: trustPath}
			if cachePath == "" {
				ctx := cmdContext(cmd)
				s, err := g.connect(ctx)
				if err != nil {
					return err
				}
				ei, err := s.c.Attach(ctx, req)
				if err != nil {
					return g.apiErr(err) // the server's message names the attach
				}
				if asJSON {
					return writeServerJSON(g.stdout, s.id, ei)
				}
				s.header(g.stdout)
				fmt.Fprintf(g.stdout, "attached %s (%s, %s) in mode %s; export %q is served now\n", ei.Path, human(ei.Size), name, ei.Mode, name)
				return nil
			}
			// Refused before the set is opened (which writes the cache
			// device): a refused attach changes nothing.
			if !isRemote(req.Path) {
				// A served set says so first (openOffline locks it again).
				unlock, err := lockDevice(devicePath(cachePath), "cache device", lockServe)
				if err != nil {
					return err
				}
				unlock()
				sb, err := readSuperblock(cachePath)
				if err != nil {
					return fmt.Errorf("attach: %w", err)
				}
				if _, err := attachRefusal(sb, cachePath, req); err != nil {
					return fmt.Errorf("attach %s: %w", name, err)
				}
			}
			h, dm, err := openOffline(g, cachePath, direct)
			if err != nil {
				return err
			}
			v, _, err := h.attach(req, dm)
			if cerr := h.close(); err == nil && cerr != nil {
				err = fmt.Errorf("closing the cache set: %w", cerr)
			}
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, admin.ExportInfo{Name: name, Path: req.Path, Size: v.Size(), Cached: true, Mode: v.Mode().String()})
			}
			fmt.Fprintf(g.stdout, "attached %s (%s, %s) in mode %s to the cache set on %s; 'tiercache serve --cache %s' exports it\n",
				req.Path, human(v.Size()), name, v.Mode(), cachePath, cachePath)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cachePath, "cache", "", "change the cache set on this cache device offline (not being served)")
	f.BoolVar(&asJSON, "json", false, "print JSON (the new export)")
	f.StringVar(&mode, "mode", "writeback", "cache mode of the new volume: writeback, writethrough, writearound or none")
	f.BoolVar(&force, "force", false, "take over a disk that belongs to another cache set")
	f.BoolVar(&trustPath, "trust-path", false, "identify a device that nothing else identifies by its path (a different disk at that path is not caught)")
	f.StringVar(&direct, "direct", "auto", "offline: O_DIRECT for the devices: auto, on, off")
	return cmd
}

// attach opens the backing device of req, checks it, claims it (durably)
// and adds it to the set; on failure the claim is put back as it was. Only
// the cache device's superblock and the file's extended attributes are
// written. The claim comes before the superblock write, so after a crash
// in between the disk says it belongs to this set while the set does not
// list it: a later attach to this set accepts that (the set has nothing
// for it), anything else refuses it until --force. The other order could
// leave the set listing a disk that does not say so, which 'serve --export'
// would then serve alone while the set caches it.
func (h *openedSet) attach(req admin.AttachRequest, direct device.DirectMode) (*cache.Volume, string, error) {
	v, path, err := h.attachDevice(req, direct)
	if err != nil && !strings.HasPrefix(err.Error(), "attach ") {
		err = fmt.Errorf("attach %s: %w", req.Name, err)
	}
	return v, path, err
}

func (h *openedSet) attachDevice(req admin.AttachRequest, direct device.DirectMode) (*cache.Volume, string, error) {
	mode, err := cache.ParseMode(req.Mode)
	if err != nil {
		return nil, "", fmt.Errorf("%w: %v", cache.ErrInvalid, err)
	}
	path := req.Path
	if isRemote(path) {
		return h.attachRemote(req, mode)
	}
	if isObjImage(path) {
		return h.attachObjImage(req, mode)
	}
	dp := devicePath(path)
	sb := h.set.Superblock()
	setUUID := fmtUUID(sb.SetUUID)
	id, err := attachRefusal(sb, h.cachePath, req)
	if err != nil {
		return nil, "", err
	}
	release, err := lockDevice(dp, "device", lockServe)
	if err != nil {
		return nil, "", err
	}
	dev, err := openDevice(path, device.FileOptions{Direct: direct})
	if err != nil {
		release()
		return nil, "", err
	}
	claimed, err := backingid.Claim(dp, setUUID, true)
	if err == nil && claimed.ID == "" {
		// A block device (Claim records nothing on it), or a file system
		// without user xattrs.
		claimed, err = identifyAttach(dp, req.TrustPath)
	}
	if err != nil {
		dev.Close()
		release()
		return nil, "", err
	}
	v, err := h.set.Attach(cache.BackingSpec{Name: req.Name, Dev: dev, ID: claimed.ID, Path: path}, cache.AttachOptions{Mode: mode})
	if err != nil {
		dev.Close()
		release()
		if rerr := backingid.Restore(dp, id); rerr != nil {
			err = errors.Join(err, fmt.Errorf("restoring the claim of %s: %w", path, rerr))
		}
		return nil, "", err
	}
	h.mu.Lock()
	h.devs[req.Name] = dev
	h.locks[req.Name] = release
	h.mu.Unlock()
	return v, path, nil
}

// attachRefusal makes every refusal of attaching req.Path to the set of sb
// that needs no change to anything, before anything is changed (the
// device's identity attributes, the cache device), and returns the
// device's identity as it is.
func attachRefusal(sb *cache.Superblock, cachePath string, req admin.AttachRequest) (backingid.Identity, error) {
	path := req.Path
	dp := devicePath(path)
	if _, err := os.Stat(dp); err != nil {
		return backingid.Identity{}, err
	}
	if same, _ := sameFile(dp, devicePath(cachePath)); same {
		return backingid.Identity{}, fmt.Errorf("%w: %s is the cache device", cache.ErrInvalid, path)
	}
	setUUID := fmtUUID(sb.SetUUID)
	id, err := backingid.Read(dp)
	if err != nil {
		return id, err
	}
	for _, bi := range sb.Backings {
		if bi.Free() {
			continue
		}
		if same, _ := sameFile(dp, devicePath(bi.Path)); same || (id.ID != "" && id.ID == bi.ID) {
			return id, fmt.Errorf("%w: %s is the backing device of volume %q", cache.ErrExists, path, bi.Name)
		}
		if bi.Name == req.Name {
			return id, fmt.Errorf("%w: a volume of that name exists", cache.ErrExists)
		}
	}
	if id.Set != "" && id.Set != setUUID && !req.Force {
		return id, fmt.Errorf("%s: %w %s, which may hold newer (dirty) data for it; detach it there first, or use --force if that set is gone",
			path, backingid.ErrAttachedElsewhere, id.Set)
	}
	if id.ID == "" && !req.TrustPath && !backingid.Settable(dp) {
		_, err := identifyAttach(dp, false)
		return id, err
	}
	return id, nil
}

// attachRemote is attachDevice for an NBD URI: nothing is claimed on the
// export, and the set refuses an export it already has (by identity).
func (h *openedSet) attachRemote(req admin.AttachRequest, mode cache.Mode) (*cache.Volume, string, error) {
	path := remoteSpec(req.Path)
	dev, err := openRemote(path, false, h.remote, h.log.With("volume", req.Name))
	if err != nil {
		return nil, "", err
	}
	id, err := identifyRemote(nil, "remote export", dev, req.TrustPath)
	if err != nil {
		dev.Close()
		return nil, "", fmt.Errorf("%w: %v", cache.ErrInvalid, err)
	}
	for _, bi := range h.set.Superblock().Backings {
		if !bi.Free() && bi.ID == id {
			dev.Close()
			return nil, "", fmt.Errorf("%w: %s is the backing device of volume %q", cache.ErrExists, path, bi.Name)
		}
	}
	release, err := lockRemote(dev, fmt.Sprintf("backing device of volume %q", req.Name))
	if err != nil {
		dev.Close()
		return nil, "", fmt.Errorf("%w: %v", cache.ErrExists, err)
	}
	if err := syncRemote(dev, false); err != nil {
		dev.Close()
		release()
		return nil, "", err
	}
	v, err := h.set.Attach(cache.BackingSpec{Name: req.Name, Dev: dev, ID: id, Path: path}, cache.AttachOptions{Mode: mode})
	if err != nil {
		dev.Close()
		release()
		return nil, "", err
	}
	h.mu.Lock()
	h.devs[req.Name] = dev
	h.locks[req.Name] = release
	h.mu.Unlock()
	return v, path, nil
}

// identifyAttach is format's identify for attach: a device with no identity
// of its own (EnsureID gives a loop device's backing file one) is refused
// unless trustPath.
func identifyAttach(path string, trustPath bool) (backingid.Identity, error) {
	id, err := backingid.EnsureID(path)
	if err != nil || id.ID != "" {
		return id, err
	}
	if !trustPath {
		return id, fmt.Errorf("%w: %s: nothing identifies this device (no serial or WWN, partition UUID, device-mapper/md UUID, loop backing file, /dev/disk/by-id link, or file attribute), so a different disk in its place would not be caught; attach it with --trust-path to identify it by its path", cache.ErrInvalid, path)
	}
	id.ID = backingid.PathID(path)
	return id, nil
}

// openOffline opens the cache set on cachePath for an offline change (the
// lock refuses a set being served).
func openOffline(g *globals, cachePath, direct string) (*openedSet, device.DirectMode, error) {
	dm, err := parseDirect(direct)
	if err != nil {
		return nil, dm, err
	}
	log, err := g.logger()
	if err != nil {
		return nil, dm, err
	}
	s3, err := g.s3Defaults(s3Defaults{})
	if err != nil {
		return nil, dm, err
	}
	h, err := openSet(log, cachePath, &serveOptions{s3: s3}, dm)
	return h, dm, err
}

// detachOffline detaches a volume of a cache set that is not being served.
func detachOffline(g *globals, cachePath, name, direct string, asJSON bool) error {
	h, _, err := openOffline(g, cachePath, direct)
	if err != nil {
		return err
	}
	v, ok := h.set.Volume(name)
	if !ok {
		var names []string
		for _, x := range h.set.Volumes() {
			names = append(names, x.Name())
		}
		h.close()
		return fmt.Errorf("detach: the cache set on %s has no volume %q (volumes: %s)", cachePath, name, joinOrNone(names))
	}
	var path string
	for _, bi := range h.set.Superblock().Backings {
		if bi.Name == name {
			path = bi.Path
		}
	}
	pl := newProgressLine(g.stderr, "detach "+name, human)
	pl.quiet = asJSON
	start := time.Now()
	var first int64 = -1
	err = v.Detach(context.Background(), cache.DetachOptions{
		Progress: func(dirty int64) {
			if first < 0 {
				first = dirty
			}
			pl.update(admin.Progress{Op: "detach", Export: name, Done: (first - dirty) * 4096, Total: first * 4096, DirtyBytes: dirty * 4096})
		},
		BeforeRemove: func() error { return releaseBacking(path) },
	})
	pl.done()
	if err == nil {
		h.closeBacking(name)
	}
	if cerr := h.close(); err == nil && cerr != nil {
		err = fmt.Errorf("closing the cache set: %w", cerr)
	}
	if err != nil {
		return fmt.Errorf("detach %s: %w", name, err)
	}
	if asJSON {
		return writeJSON(g.stdout, map[string]any{"cache_device": cachePath, "export": name, "path": path, "written_back_bytes": max(first, 0) * 4096,
			"message": fmt.Sprintf("%s is detached: %s is complete and can be used alone", name, path)})
	}
	fmt.Fprintf(g.stdout, "wrote back %s in %s\n%s is detached: %s is complete and can be used alone\n",
		human(max(first, 0)*4096), time.Since(start).Round(time.Millisecond), name, path)
	return nil
}
