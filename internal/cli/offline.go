package cli

import (
	"errors"
	"fmt"
	"sort"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
)

// readSuperblock returns the newest valid superblock of the cache device
// at path, opened read-only: nothing is written.
func readSuperblock(path string) (*cache.Superblock, error) {
	dev, err := device.OpenFile(devicePath(path), device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		return nil, err
	}
	defer dev.Close()
	copies := cache.ReadSuperblockCopies(dev)
	var best *cache.Superblock
	for _, c := range copies {
		if c.Err == nil && (best == nil || c.SB.Seq > best.Seq) {
			best = c.SB
		}
	}
	if best == nil {
		if errors.Is(copies[0].Err, cache.ErrNotFormatted) && errors.Is(copies[1].Err, cache.ErrNotFormatted) {
			return nil, fmt.Errorf("%s is not a tiercache cache device (no superblock)", path)
		}
		return nil, fmt.Errorf("%s: no valid superblock copy (%v; %v); 'tiercache check --cache %s' says more", path, copies[0].Err, copies[1].Err, path)
	}
	return best, nil
}

// settingsOf is a recorded volume's settings as key -> stored value.
func settingsOf(b cache.BackingInfo) map[string]string {
	m := map[string]string{}
	st := b.Settings
	for _, k := range cache.SettingKeys {
		if v, ok := st.Get(k); ok {
			m[k] = v
		}
	}
	return m
}

func volumeNames(sb *cache.Superblock) []string {
	var names []string
	for _, b := range sb.Backings {
		if !b.Free() {
			names = append(names, b.Name)
		}
	}
	sort.Strings(names)
	return names
}

// setOffline shows or changes the settings recorded for a volume of the
// cache set on cachePath, which must not be served. Showing reads the
// superblock only; changing opens the set (its lock keeps a running
// server out) and records them as a live change does.
func setOffline(g *globals, cachePath, direct, export string, kv map[string]string, order []string, asJSON bool) error {
	if len(kv) == 0 {
		sb, err := readSuperblock(cachePath)
		if err != nil {
			return fmt.Errorf("set: %w", err)
		}
		for _, b := range sb.Backings {
			if !b.Free() && b.Name == export {
				cur := settingsOf(b)
				if asJSON {
					return writeJSON(g.stdout, map[string]any{"cache_device": cachePath, "set_uuid": fmtUUID(sb.SetUUID), "export": export, "settings": cur})
				}
				fmt.Fprintf(g.stdout, "cache set %s on %s (offline)\n", fmtUUID(sb.SetUUID), cachePath)
				return printSettings(g.stdout, cur, nil)
			}
		}
		return fmt.Errorf("set: the cache set on %s has no volume %q (volumes: %s)", cachePath, export, joinOrNone(volumeNames(sb)))
	}
	h, _, err := openOffline(g, cachePath, direct)
	if err != nil {
		return fmt.Errorf("set --cache %s: %w", cachePath, err)
	}
	v, ok := h.set.Volume(export)
	if !ok {
		var names []string
		for _, x := range h.set.Volumes() {
			names = append(names, x.Name())
		}
		sort.Strings(names)
		h.close()
		return fmt.Errorf("set: the cache set on %s has no volume %q (volumes: %s)", cachePath, export, joinOrNone(names))
	}
	st := v.Settings()
	for _, k := range order {
		if err := cache.ParseSetting(&st, k, kv[k]); err != nil {
			h.close()
			return fmt.Errorf("%s=%s: %w", k, kv[k], err)
		}
	}
	err = v.SetSettings(st)
	cur := map[string]string{}
	for _, k := range cache.SettingKeys {
		if val, ok := v.Settings().Get(k); ok {
			cur[k] = val
		}
	}
	uuid := fmtUUID(h.set.Superblock().SetUUID)
	if cerr := h.close(); err == nil && cerr != nil {
		err = fmt.Errorf("closing the cache set: %w", cerr)
	}
	if err != nil {
		return fmt.Errorf("set --cache %s %s: %w", cachePath, export, err)
	}
	if asJSON {
		return writeJSON(g.stdout, map[string]any{"cache_device": cachePath, "set_uuid": uuid, "export": export, "settings": cur, "changed": order})
	}
	fmt.Fprintf(g.stdout, "cache set %s on %s (offline; applies at the next 'tiercache serve --cache %s')\n", uuid, cachePath, cachePath)
	return printSettings(g.stdout, cur, kv)
}

func newShowCmd(g *globals) *cobra.Command {
	var cachePath string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "show --cache PATH",
		Short: "Show a cache set's superblock without a server: UUID, size, state, each volume with its settings",
		Long: `Show what a cache device records, like 'bcache-super-show': the cache
set's UUID, the bucket space, whether it was shut down cleanly, and each
backing device (volume) with its path, size and settings. The device is
opened read-only and nothing is written; a device being served may have
changed since its last superblock write ('tiercache status' asks the
server instead).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cachePath == "" {
				return errors.New("show: --cache PATH is required (the cache device to read)")
			}
			sb, err := readSuperblock(cachePath)
			if err != nil {
				return fmt.Errorf("show: %w", err)
			}
			type vol struct {
				Name     string            `json:"name"`
				Path     string            `json:"path"`
				Size     int64             `json:"size"`
				Settings map[string]string `json:"settings"`
			}
			out := struct {
				CacheDevice string `json:"cache_device"`
				SetUUID     string `json:"set_uuid"`
				Version     uint32 `json:"format_version"`
				Clean       bool   `json:"clean_shutdown"`
				Buckets     int64  `json:"buckets"`
				BucketSize  int64  `json:"bucket_size"`
				JournalSize int64  `json:"journal_size"`
				Volumes     []vol  `json:"volumes"`
			}{CacheDevice: cachePath, SetUUID: fmtUUID(sb.SetUUID), Version: uint32(sb.Version), Clean: sb.Clean,
				Buckets: sb.NBuckets, BucketSize: sb.BucketSize, JournalSize: sb.JournalLen, Volumes: []vol{}}
			for _, b := range sb.Backings {
				if !b.Free() {
					out.Volumes = append(out.Volumes, vol{b.Name, b.Path, b.Size, settingsOf(b)})
				}
			}
			if asJSON {
				return writeJSON(g.stdout, out)
			}
			w := newTable(g.stdout, 0)
			fmt.Fprintf(w, "cache set\t%s\n", out.SetUUID)
			fmt.Fprintf(w, "cache device\t%s\n", cachePath)
			fmt.Fprintf(w, "buckets\t%d x %s = %s\n", sb.NBuckets, human(sb.BucketSize), human(sb.NBuckets*sb.BucketSize))
			fmt.Fprintf(w, "journal\t%s\n", human(sb.JournalLen))
			clean := "yes"
			if !sb.Clean {
				clean = "no (being served, or it crashed: the next start replays the journal)"
			}
			fmt.Fprintf(w, "clean shutdown\t%s\n", clean)
			if len(out.Volumes) == 0 {
				fmt.Fprintf(w, "volumes\tnone (attach one with 'tiercache attach')\n")
			}
			for _, v := range out.Volumes {
				fmt.Fprintf(w, "\t\n")
				fmt.Fprintf(w, "volume %s\t%s, %s\n", v.Name, v.Path, human(v.Size))
				for _, k := range cache.SettingKeys {
					if val, ok := v.Settings[k]; ok {
						fmt.Fprintf(w, "  %s\t%s\n", k, settingOut(k, val))
					}
				}
			}
			return w.Flush()
		},
	}
	cmd.Flags().StringVar(&cachePath, "cache", "", "the cache device to read (required)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
