package cli

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/backingid"
)

// lockIdentity: re-recording an identity writes the superblock.
var lockIdentity = lockKind{true, "stop it first: identities are re-recorded offline"}

type identityOptions struct {
	cache      string
	backings   []string // NAME=PATH overrides
	rerecord   []string // volumes
	cacheToo   bool     // --rerecord-cache
	trustPath  bool
	asJSON     bool
	overridden map[string]string
}

func newIdentityCmd(g *globals) *cobra.Command {
	o := &identityOptions{}
	cmd := &cobra.Command{
		Use:   "identity --cache PATH [--backing NAME=PATH]... [--rerecord NAME]... [--rerecord-cache]",
		Short: "Compare each device's identity with the one its cache set recorded; re-record it on purpose",
		Long: `Show the identity the cache set recorded for its cache device and each
backing device, and the identity of the device found at its path now
(see docs/RELIABILITY.md, "Trust boundaries"). Exit 1 if one does not
match: serve refuses such a set without --force.

--rerecord NAME records the identity of the device now at the volume's
path (or at --backing NAME=PATH) as the volume's, after you have made
sure it IS the volume's disk and only its identity changed (a restore in
place, a move to another file system, a re-created loop device); serve
--force serves such a disk once, this makes it the set's disk for good.
The set then refuses every other device for the volume, the one recorded
before included. --rerecord-cache does the same for the cache device.

Refused, with nothing written: a device whose size is not the recorded
one, one that belongs to another cache set, one whose identity already
matches, and a device nothing identifies (unless --trust-path). The set
must not be served.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.cache == "" {
				return errors.New("identity: --cache PATH is required (the cache device whose records to compare)")
			}
			o.overridden = map[string]string{}
			for _, b := range o.backings {
				name, path, ok := strings.Cut(b, "=")
				if !ok || name == "" || path == "" {
					return fmt.Errorf("identity: --backing %q: want NAME=PATH", b)
				}
				o.overridden[name] = path
			}
			return identityCmd(g, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.cache, "cache", "", "the cache device (not served)")
	f.StringArrayVar(&o.backings, "backing", nil, "look for volume NAME at `NAME=PATH` instead of its recorded path (repeatable)")
	f.StringArrayVar(&o.rerecord, "rerecord", nil, "record the identity of the device now at volume `NAME`'s path as its own (repeatable)")
	f.BoolVar(&o.cacheToo, "rerecord-cache", false, "record the cache device's identity now as the set's cache device")
	f.BoolVar(&o.trustPath, "trust-path", false, "with --rerecord: identify a device nothing else identifies by its path")
	f.BoolVar(&o.asJSON, "json", false, "print JSON")
	return cmd
}

// identityRow is one device's recorded and current identity.
type identityRow struct {
	Volume   string `json:"volume"` // "" for the cache device
	Path     string `json:"path"`
	Recorded string `json:"recorded"`
	Found    string `json:"found"`
	Match    bool   `json:"match"`
	Problem  string `json:"problem,omitempty"`
	size     int64  // recorded size (volumes)
	set      string // the file's claim
	remote   bool
}

func identityCmd(g *globals, o *identityOptions) error {
	writing := len(o.rerecord) > 0 || o.cacheToo
	k := lockCheck
	if writing {
		k = lockIdentity
	}
	cpath := devicePath(o.cache)
	unlock, err := lockDevice(cpath, "cache device", k)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	defer unlock()
	dev, err := device.OpenFile(cpath, device.FileOptions{ReadOnly: !writing, Direct: device.DirectOff})
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	defer dev.Close()
	sb, err := cache.ReadSuperblock(dev)
	if errors.Is(err, cache.ErrNotFormatted) {
		return fmt.Errorf("identity: %s is not a tiercache cache device (no superblock)", o.cache)
	}
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	setUUID := fmtUUID(sb.SetUUID)
	rows := []identityRow{identityOf("", o.cache, sb.CacheID, 0)}
	for _, bi := range sb.Backings {
		if bi.Free() {
			continue
		}
		path := bi.Path
		if p, ok := o.overridden[bi.Name]; ok {
			path = p
			delete(o.overridden, bi.Name)
		}
		rows = append(rows, identityOf(bi.Name, path, bi.ID, bi.Size))
	}
	for name := range o.overridden {
		return fmt.Errorf("identity: --backing %s: cache set %s has no volume of that name (volumes: %s)", name, setUUID, joinOrNone(volumeNames(sb)))
	}

	// Every refusal before anything is written.
	var todo []*identityRow
	for _, name := range o.rerecord {
		i := slices.IndexFunc(rows, func(r identityRow) bool { return r.Volume == name && name != "" })
		if i < 0 {
			return fmt.Errorf("identity: --rerecord %s: cache set %s has no volume of that name (volumes: %s); nothing was written", name, setUUID, joinOrNone(volumeNames(sb)))
		}
		todo = append(todo, &rows[i])
	}
	if o.cacheToo {
		todo = append(todo, &rows[0])
	}
	for _, r := range todo {
		if err := r.refuseRerecord(setUUID, o.trustPath); err != nil {
			return fmt.Errorf("identity: %w; nothing was written", err)
		}
		if r.Volume != "" {
			release, err := lockDevice(devicePath(r.Path), fmt.Sprintf("backing device %q", r.Volume), lockIdentity)
			if err != nil {
				return fmt.Errorf("identity: %w; nothing was written", err)
			}
			defer release()
		}
	}
	for _, r := range todo {
		if err := r.rerecord(g, dev, setUUID, o.trustPath); err != nil {
			return fmt.Errorf("identity: %w", err)
		}
	}

	if o.asJSON {
		return writeJSON(g.stdout, map[string]any{"cache_device": o.cache, "set_uuid": setUUID, "devices": rows})
	}
	w := newTable(g.stdout, 0)
	fmt.Fprintln(w, "DEVICE\tPATH\tRECORDED\tFOUND\tMATCH")
	bad := 0
	for _, r := range rows {
		what := "cache device"
		if r.Volume != "" {
			what = "volume " + r.Volume
		}
		m := "yes"
		if !r.Match {
			m, bad = "NO", bad+1
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", what, r.Path, orNone(r.Recorded), orNone(r.Found), m)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Problem != "" {
			fmt.Fprintln(g.stdout, "PROBLEM:", r.Problem)
		}
	}
	if bad > 0 {
		return &exitError{code: 1, err: fmt.Errorf("%d device(s) do not match the identity the set recorded", bad)}
	}
	return nil
}

// identityOf compares the device at path with the identity recorded.
func identityOf(volume, path, recorded string, size int64) identityRow {
	r := identityRow{Volume: volume, Path: path, Recorded: recorded, size: size}
	what := "the cache device"
	flag := "--rerecord-cache"
	if volume != "" {
		what, flag = fmt.Sprintf("volume %q", volume), "--rerecord "+volume
	}
	if isRemote(path) {
		r.remote, r.Match, r.Found = true, true, "(remote: serve and check compare it)"
		return r
	}
	id, err := backingid.Read(devicePath(path))
	if err != nil {
		r.Problem = fmt.Sprintf("%s: %v (give --backing %s=PATH if it moved)", what, err, volume)
		return r
	}
	r.Found, r.set = id.ID, id.Set
	if volume == "" && recorded == "" {
		r.Match = true // format found nothing to record, and said so
		return r
	}
	if cerr := backingid.Check(recorded, devicePath(path)); cerr != nil {
		r.Problem = fmt.Sprintf("%s: %v: serve refuses it without --force; if this IS its device and only its identity changed, record the identity it has now with 'tiercache identity --cache CACHE %s'", what, cerr, flag)
		return r
	}
	r.Match = true
	return r
}

// refuseRerecord says why the identity of r's device may not be recorded
// as the set's (nil: it may).
func (r *identityRow) refuseRerecord(setUUID string, trustPath bool) error {
	what := "the cache device " + r.Path
	if r.Volume != "" {
		what = fmt.Sprintf("volume %q (%s)", r.Volume, r.Path)
	}
	switch {
	case r.remote:
		return fmt.Errorf("%s: a remote export's identity is its URI and description: detach it and attach it again to record a new one", what)
	case r.Match && r.Recorded != "":
		return fmt.Errorf("%s: its identity %s already matches the recorded one: nothing to re-record", what, r.Recorded)
	}
	p := devicePath(r.Path)
	if _, err := backingid.Read(p); err != nil {
		return fmt.Errorf("%s: %v (give --backing NAME=PATH if it moved)", what, err)
	}
	if r.Volume != "" {
		size, err := deviceSize(p)
		if err != nil {
			return fmt.Errorf("%s: %v", what, err)
		}
		if size != r.size {
			return fmt.Errorf("%s is %d bytes, the set recorded %d: it is not the volume's disk as the set knows it (the index addresses %d bytes), and no identity is recorded for it: restore it to %d bytes first, or give the right device with --backing %s=PATH",
				what, size, r.size, r.size, r.size, r.Volume)
		}
		if r.set != "" && r.set != setUUID {
			return fmt.Errorf("%s belongs to cache set %s (its user.tiercache.set attribute), not %s: that set may hold newer data for it; detach it there first, or if that set is gone, remove the claim on purpose ('setfattr -x user.tiercache.set %s') and run this again",
				what, r.set, setUUID, r.Path)
		}
	}
	if r.Found == "" && !trustPath && !canIdentify(p) {
		return fmt.Errorf("%s: nothing identifies this device (no serial or WWN, partition UUID, device-mapper/md UUID, loop backing file, /dev/disk/by-id link, or file attribute), so a different disk in its place would not be caught; give --trust-path to identify it by its path", what)
	}
	return nil
}

// canIdentify reports whether EnsureID can give the device at path an
// identity without --trust-path: a regular file (an attribute, if its file
// system keeps them) or a loop device over one.
func canIdentify(path string) bool {
	id, err := backingid.Read(path)
	if err == nil && id.ID != "" {
		return true
	}
	return backingid.Settable(path)
}

// rerecord records the identity of r's device now as the set's.
func (r *identityRow) rerecord(g *globals, dev device.Device, setUUID string, trustPath bool) error {
	p := devicePath(r.Path)
	id, err := backingid.EnsureID(p)
	if err != nil {
		return err
	}
	if id.ID == "" {
		if !trustPath {
			return fmt.Errorf("%s: nothing identifies this device (its file system keeps no extended attributes); give --trust-path to identify it by its path", r.Path)
		}
		id.ID = backingid.PathID(p)
	}
	if r.Volume != "" && !strings.HasPrefix(id.ID, "path:") {
		if _, err := backingid.Claim(p, setUUID, false); err != nil {
			return err
		}
		id, err = backingid.Read(p)
		if err != nil {
			return err
		}
	}
	path := ""
	if r.Volume != "" {
		path = absSpec(r.Path)
	}
	if _, err := cache.RecordIdentity(dev, r.Volume, id.ID, path); err != nil {
		return fmt.Errorf("recording the identity: %w", err)
	}
	what := "cache device " + r.Path
	if r.Volume != "" {
		what = fmt.Sprintf("volume %q (%s)", r.Volume, r.Path)
	}
	fmt.Fprintf(g.stdout, "%s: identity re-recorded: was %s, now %s; the set now refuses any other device in its place, the one recorded before included\n",
		what, orNone(r.Recorded), id.ID)
	r.Recorded, r.Found, r.Match, r.Problem = id.ID, id.ID, true, ""
	return nil
}
