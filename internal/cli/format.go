package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/nbddev"
	"github.com/tiercache/tiercache/device/objstore"
	"github.com/tiercache/tiercache/internal/backingid"
)

type formatOptions struct {
	cache      string
	mirror     string
	backings   []string
	mode       string
	bucketSize string
	force      bool
	trustPath  bool
	direct     string
	asJSON     bool
	indexPages bool
}

func newFormatCmd(g *globals) *cobra.Command {
	o := &formatOptions{}
	cmd := &cobra.Command{
		Use:   "format --cache PATH [--backing NAME=PATH ...]",
		Short: "Create a cache set on a cache device, for backing devices given now or attached later",
		Long: `Create a cache set: a superblock (two copies), journal and checkpoint areas
and buckets on the cache device, naming each backing device with its size and
identity.

Only the cache device is written. Backing devices keep every byte: an existing
disk can be accelerated as it is, and is usable alone again after a clean
detach. A backing file is marked with extended attributes (user.tiercache.id,
user.tiercache.set), which are not part of its data.

Backing devices may also be added later, to a running server or offline,
with 'tiercache attach' (a set may start with none).

format refuses a cache device that already holds a cache set, or a backing
file that belongs to another cache set, unless --force. It refuses a device
that a running tiercache process has open, even with --force.

Every device is identified by what survives reboots (see 'tiercache
attach --help'); a backing device nothing identifies is refused unless
--trust-path, which identifies it by its path. A cache file is allocated
in full (fallocate): a sparse one the file system cannot hold is refused.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runFormat(g, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.cache, "cache", "", "cache device: a file or block device (required)")
	f.StringVar(&o.mirror, "cache-mirror", "", "second cache device `PATH` holding a copy of the metadata and dirty data (may be smaller than --cache: the metadata region and room for the dirty data)")
	f.StringArrayVar(&o.backings, "backing", nil, "backing device `NAME=PATH`, exported as NAME; repeatable (or none: attach them later)")
	f.StringVar(&o.mode, "mode", "writeback", "cache mode: writeback, writethrough, writearound or none")
	f.StringVar(&o.bucketSize, "bucket-size", "1M", "bucket size (a multiple of 4K, e.g. 512K, 1M, 4M)")
	f.BoolVar(&o.asJSON, "json", false, "print JSON (what was formatted)")
	f.BoolVar(&o.force, "force", false, "overwrite an existing cache set / take over backing devices of another set")
	f.BoolVar(&o.trustPath, "trust-path", false, "identify backing devices that nothing else identifies by their path (a different disk at that path is not caught)")
	f.StringVar(&o.direct, "direct", "auto", "O_DIRECT for the cache device: auto, on, off")
	f.BoolVar(&o.indexPages, "index-pages", false, "keep the index on the cache device as pages: a checkpoint writes the index pages that changed, then a root, not the whole index (a larger metadata region; at most 40 backing devices; docs/CACHE.md, \"Index pages\")")
	return cmd
}

// parseSize parses 4096, 4K, 1M, 2G (binary units).
func parseSize(s string) (int64, error) {
	u := strings.ToUpper(strings.TrimSpace(s))
	mult := int64(1)
	for _, suf := range []struct {
		s string
		m int64
	}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"TIB", 1 << 40}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}} {
		if strings.HasSuffix(u, suf.s) {
			u, mult = strings.TrimSuffix(u, suf.s), suf.m
			break
		}
	}
	var n int64
	if _, err := fmt.Sscan(u, &n); err != nil || n < 0 || fmt.Sprint(n) != u {
		return 0, fmt.Errorf("bad size %q (want e.g. 4096, 512K, 1M)", s)
	}
	if n > (1<<62)/mult {
		return 0, fmt.Errorf("size %q too large", s)
	}
	return n * mult, nil
}

func runFormat(g *globals, o *formatOptions) error {
	if o.cache == "" {
		return errors.New("format: --cache is required")
	}
	unlock, err := lockDevice(devicePath(o.cache), "cache device", lockServe)
	if err != nil {
		return fmt.Errorf("format: %w", err)
	}
	defer unlock()
	mode, err := cache.ParseMode(o.mode)
	if err != nil {
		return fmt.Errorf("--mode: %w", err)
	}
	bs, err := parseSize(o.bucketSize)
	if err != nil {
		return fmt.Errorf("--bucket-size: %w", err)
	}
	direct, err := parseDirect(o.direct)
	if err != nil {
		return err
	}
	type backing struct {
		name, path string
		dev        device.Device
		id         backingid.Identity
		remote     *nbddev.Device   // dev, when path is an NBD URI
		obj        *objstore.Device // dev, when path is an object-store image
	}
	var bks []backing
	defer func() {
		for _, b := range bks {
			b.dev.Close()
		}
	}()
	seen := map[string]bool{}
	for _, s := range o.backings {
		name, path, err := parseNamePath("backing", s)
		if err != nil {
			return err
		}
		if seen[name] {
			return fmt.Errorf("--backing: name %q given twice", name)
		}
		seen[name] = true
		if isObjImage(path) {
			// Read-only, as the remote case: no lease is taken.
			s3, err := g.s3Defaults(s3Defaults{})
			if err != nil {
				return err
			}
			od, err := openObjImage(path, s3, true, false, nil)
			if err != nil {
				return fmt.Errorf("backing %q: %w", name, err)
			}
			bks = append(bks, backing{name: name, path: path, dev: od, obj: od})
			continue
		}
		if isRemote(path) {
			// Opened read-only: format only measures it and reads its
			// identity.
			rd, err := openRemote(path, true, remoteTimeouts{}, nil)
			if err != nil {
				return fmt.Errorf("backing %q: %w", name, err)
			}
			bks = append(bks, backing{name: name, path: path, dev: rd, remote: rd})
			continue
		}
		if same, _ := sameFile(devicePath(path), devicePath(o.cache)); same {
			return fmt.Errorf("--backing %s: %s is the cache device", name, path)
		}
		release, err := lockDevice(devicePath(path), fmt.Sprintf("backing device %q", name), lockServe)
		if err != nil {
			return fmt.Errorf("format: %w", err)
		}
		defer release()
		id, err := backingid.Read(devicePath(path))
		if err != nil {
			return fmt.Errorf("backing %q: %w", name, err)
		}
		if id.Set != "" && !o.force {
			return fmt.Errorf("backing %q (%s) already belongs to cache set %s; detach it there first, or use --force if that set is gone", name, path, id.Set)
		}
		// Backing devices are opened read-only: format only measures them.
		dev, err := device.OpenFile(devicePath(path), device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
		if err != nil {
			return fmt.Errorf("backing %q: %w", name, err)
		}
		bks = append(bks, backing{name: name, path: path, dev: dev})
	}
	cdev, err := openDevice(o.cache, device.FileOptions{Direct: direct})
	if err != nil {
		return fmt.Errorf("cache device: %w", err)
	}
	defer cdev.Close()
	var mdev device.Device
	if o.mirror != "" {
		if same, _ := sameFile(devicePath(o.mirror), devicePath(o.cache)); same {
			return fmt.Errorf("--cache-mirror %s is the cache device", o.mirror)
		}
		for _, b := range bks {
			if same, _ := sameFile(devicePath(o.mirror), devicePath(b.path)); same {
				return fmt.Errorf("--cache-mirror %s is backing device %q", o.mirror, b.name)
			}
		}
		release, err := lockDevice(devicePath(o.mirror), "mirror cache device", lockServe)
		if err != nil {
			return fmt.Errorf("format: %w", err)
		}
		defer release()
		if mdev, err = openDevice(o.mirror, device.FileOptions{Direct: direct}); err != nil {
			return fmt.Errorf("mirror cache device: %w", err)
		}
		defer mdev.Close()
		if sb, err := cache.ReadSuperblock(mdev); err == nil && !o.force {
			return fmt.Errorf("%s already holds cache set %s with %d backing device(s); use --force to overwrite it (its cached data, dirty data included, is lost)", o.mirror, fmtUUID(sb.SetUUID), sb.LiveBackings())
		}
		if err := allocateCache(devicePath(o.mirror), mdev.Size()); err != nil {
			return fmt.Errorf("format: %w", err)
		}
	}
	if sb, err := cache.ReadSuperblock(cdev); err == nil && !o.force {
		return fmt.Errorf("%s already holds cache set %s with %d backing device(s); use --force to overwrite it (its cached data, dirty data included, is lost)", o.cache, fmtUUID(sb.SetUUID), sb.LiveBackings())
	}

	// Before anything is written (identity attributes included): a cache
	// file its file system cannot hold is refused with nothing changed.
	if err := allocateCache(devicePath(o.cache), cdev.Size()); err != nil {
		return fmt.Errorf("format: %w", err)
	}

	// Every refusal before any identity attribute is written: a device
	// nothing would identify, and a layout or superblock the cache device
	// cannot hold (a dry run of the format with the identities to come).
	specs := make([]cache.BackingSpec, len(bks))
	for i := range bks {
		what := fmt.Sprintf("backing %q", bks[i].name)
		id := placeholderID
		if bks[i].obj != nil {
			id = objImageID(bks[i].obj)
			bks[i].id.ID = id
		} else if bks[i].remote != nil {
			rid, err := identifyRemote(g.stderr, what, bks[i].remote, o.trustPath)
			if err != nil {
				return err
			}
			id, bks[i].id.ID = rid, rid
		} else if err := identifiable(what, bks[i].path, o.trustPath); err != nil {
			return err
		}
		specs[i] = cache.BackingSpec{Name: bks[i].name, Dev: bks[i].dev, ID: id, Path: absSpec(bks[i].path)}
	}
	if _, err := cache.Format(cdev, specs, cache.FormatOptions{BucketSize: bs, Mode: mode, Force: o.force, CacheID: placeholderID, DryRun: true, Mirror: mdev, IndexPages: o.indexPages}); err != nil {
		return fmt.Errorf("format %s: %w", o.cache, err)
	}
	for i := range bks {
		if bks[i].remote != nil || bks[i].obj != nil {
			continue
		}
		id, err := identify(g, fmt.Sprintf("backing %q", bks[i].name), bks[i].path, o.trustPath)
		if err != nil {
			return err
		}
		bks[i].id = id
		specs[i].ID = id.ID
	}
	cacheID, err := backingid.EnsureID(devicePath(o.cache))
	if err != nil {
		return fmt.Errorf("cache device: %w", err)
	}
	if cacheID.ID == "" {
		fmt.Fprintf(g.stderr, "WARNING: nothing identifies the cache device %s (no serial, WWN, partition UUID, loop backing file or file attribute): a copy of it, served later, is not told from it\n", o.cache)
	}
	pr := newProgress(g.stderr, "format", 3)
	if o.asJSON {
		pr = newProgress(io.Discard, "format", 3)
	}
	// No line before the first step is done: a layout the device cannot
	// hold fails first, without a progress line that suggests otherwise.
	sb, err := cache.Format(cdev, specs, cache.FormatOptions{BucketSize: bs, Mode: mode, Force: o.force, Progress: func(done, total int64) {
		if done > 0 {
			pr.set(done, total)
		}
	}, CacheID: cacheID.ID, Mirror: mdev, IndexPages: o.indexPages})
	pr.finish()
	if err != nil {
		return fmt.Errorf("format %s: %w", o.cache, err)
	}
	if err := cdev.Sync(); err != nil {
		return fmt.Errorf("format %s: sync: %w", o.cache, err)
	}
	if mdev != nil {
		if err := mdev.Sync(); err != nil {
			return fmt.Errorf("format %s: sync: %w", o.mirror, err)
		}
	}
	setUUID := fmtUUID(sb.SetUUID)
	for _, b := range bks {
		if b.remote != nil || b.obj != nil {
			continue // nothing is recorded on a remote export
		}
		if _, err := backingid.Claim(devicePath(b.path), setUUID, true); err != nil {
			return fmt.Errorf("backing %q: %w", b.name, err)
		}
	}

	if o.asJSON {
		var backings []map[string]any
		for _, b := range bks {
			backings = append(backings, map[string]any{"name": b.name, "path": b.path, "size": b.dev.Size(), "id": b.id.ID})
		}
		return writeJSON(g.stdout, map[string]any{"set_uuid": setUUID, "cache_device": o.cache, "device_size": cdev.Size(),
			"mirror_device": o.mirror, "buckets": sb.NBuckets, "bucket_size": sb.BucketSize, "journal_size": sb.JournalLen, "mode": mode.String(), "backings": backings, "index_pages": o.indexPages})
	}
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "cache set\t%s\n", setUUID)
	fmt.Fprintf(w, "cache device\t%s (%s)\n", o.cache, human(cdev.Size()))
	if mdev != nil {
		fmt.Fprintf(w, "mirror device\t%s (%s): metadata and dirty data on both\n", o.mirror, human(mdev.Size()))
	}
	fmt.Fprintf(w, "buckets\t%d x %s = %s\n", sb.NBuckets, human(sb.BucketSize), human(sb.NBuckets*sb.BucketSize))
	fmt.Fprintf(w, "journal\t%s\n", human(sb.JournalLen))
	if o.indexPages {
		fmt.Fprintf(w, "index\tpages on the cache device (2 x %s of page area; checkpoints write what changed)\n", human(sb.CkptLen))
	}
	fmt.Fprintf(w, "mode\t%s\n", mode)
	if len(bks) == 0 {
		fmt.Fprintf(w, "backing devices\tnone yet: add them with 'tiercache attach'\n")
	}
	for _, b := range bks {
		fmt.Fprintf(w, "backing %s\t%s (%s, id %s)\n", b.name, b.path, human(b.dev.Size()), orNone(b.id.ID))
	}
	return w.Flush()
}

// placeholderID stands for an identity not recorded yet in format's dry
// run: as long as a file's ("UUID/ino:N/born:S.NS" at their longest).
var placeholderID = strings.Repeat("x", len("loop:")+36+len("/ino:18446744073709551615/born:-9223372036854775808.999999999"))

// identifiable refuses, before anything is written, a device identify
// would refuse: nothing identifies it and nothing can be recorded on it
// (a block device with no identity, a file on a file system without user
// xattrs), unless trustPath.
func identifiable(what, spec string, trustPath bool) error {
	p := devicePath(spec)
	id, err := backingid.Read(p)
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if id.ID != "" || trustPath || backingid.Settable(p) {
		return nil
	}
	return unidentifiedError(what, spec)
}

func unidentifiedError(what, spec string) error {
	return fmt.Errorf("%s (%s): nothing identifies this device (no serial or WWN, partition UUID, device-mapper/md UUID, loop backing file, /dev/disk/by-id link, or file attribute: the file system keeps no user xattrs), so a different disk in its place would not be caught; give --trust-path to identify it by its path, or use a device that has an identity", what, spec)
}

// identify gives the device at spec an identity to record (a new file
// attribute if it had none). A device that nothing identifies is refused,
// unless trustPath: then its path is its identity, said loudly.
func identify(g *globals, what, spec string, trustPath bool) (backingid.Identity, error) {
	id, err := backingid.EnsureID(devicePath(spec))
	if err != nil {
		return id, fmt.Errorf("%s: %w", what, err)
	}
	if id.ID != "" {
		return id, nil
	}
	if !trustPath {
		return id, unidentifiedError(what, spec)
	}
	id.ID = backingid.PathID(devicePath(spec))
	fmt.Fprintf(g.stderr, "WARNING: %s (%s): nothing identifies this device; identified by its path (--trust-path): a different disk appearing at %s will NOT be caught\n", what, spec, devicePath(spec))
	return id, nil
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// fmtUUID prints a 16-byte UUID in its canonical form.
func fmtUUID(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// human prints a byte count in binary units.
func human(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	if v == float64(int64(v)) {
		return fmt.Sprintf("%d %ciB", int64(v), "KMGTPE"[exp])
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGTPE"[exp])
}

// sameFile reports whether two paths name the same file.
func sameFile(a, b string) (bool, error) {
	fa, err := os.Stat(a)
	if err != nil {
		return false, err
	}
	fb, err := os.Stat(b)
	if err != nil {
		return false, err
	}
	return os.SameFile(fa, fb), nil
}
