package cli

import (
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
)

func newInspectCmd(g *globals) *cobra.Command {
	var cachePath string
	var limit int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect superblock|journal|index --cache PATH",
		Short: "Print a cache device's superblock, journal or index (read-only, for debugging)",
		Long: `Print on-disk metadata of a cache device, for debugging. The device is
opened read-only and nothing is written. Inspect a device that is not being
served (stop the server, or inspect a copy): a served device changes under
the reader, and the result may look inconsistent.

  superblock  both superblock copies and both checkpoint slots (a set
              formatted with --index-pages: both index roots and the pages
              the newest one names, counted from its inner pages)
  journal     every journal record replayed after the newest checkpoint
  index       the rebuilt index: per export counts, then one line per
              cached 4 KiB block (--limit N lines)`,
		Args:      cobra.ExactArgs(1),
		ValidArgs: []string{"superblock", "journal", "index"},
		RunE: func(cmd *cobra.Command, args []string) error {
			what := args[0]
			if what != "superblock" && what != "journal" && what != "index" {
				return fmt.Errorf("inspect %q: want superblock, journal or index", what)
			}
			if cachePath == "" {
				return errors.New("inspect: --cache PATH is required")
			}
			unlock, err := lockDevice(devicePath(cachePath), "cache device", lockCheck)
			if err != nil {
				var busy *deviceBusyError
				if !errors.As(err, &busy) {
					return fmt.Errorf("inspect: %w", err)
				}
				fmt.Fprintf(g.stderr, "WARNING: %s is in use by %s: inspect reads a MOVING TARGET, and what it prints may be inconsistent (stop the server, or inspect a copy)\n", cachePath, busy.holderName())
			} else {
				defer unlock()
			}
			dev, err := device.OpenFile(devicePath(cachePath), device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
			if err != nil {
				return fmt.Errorf("inspect: %w", err)
			}
			defer dev.Close()
			switch what {
			case "superblock":
				if asJSON {
					copies := cache.ReadSuperblockCopies(dev)
					out := map[string]any{"cache_device": cachePath, "copies": plainJSON(copies)}
					var best *cache.Superblock
					for _, c := range copies {
						if c.Err == nil && (best == nil || c.SB.Seq > best.Seq) {
							best = c.SB
						}
					}
					if best == nil {
						return inspectErr(cachePath, copies[0].Err)
					}
					out["checkpoint_slots"] = plainJSON(cache.ReadCheckpointSlots(dev, best))
					if best.HasIndexPages() {
						ip, err := cache.ReadIndexPages(dev, best)
						if err != nil {
							return inspectErr(cachePath, err)
						}
						out["index_pages"] = plainJSON(ip)
					}
					return writeJSON(g.stdout, out)
				}
				return inspectSuperblock(g, dev, cachePath)
			case "journal":
				n := 0
				records := []string{}
				im, err := cache.OpenImage(dev, cache.ImageOptions{OnRecord: func(r string) {
					if asJSON {
						records = append(records, r)
						return
					}
					fmt.Fprintf(g.stdout, "%6d  %s\n", n, r)
					n++
				}})
				if asJSON {
					if err != nil {
						return inspectErr(cachePath, err)
					}
					return writeJSON(g.stdout, map[string]any{"cache_device": cachePath, "checkpoint_generation": im.Generation,
						"journal_start": im.JournalStart, "journal_end": im.JournalEnd, "journal_blocks": im.JournalBlocks, "records": records})
				}
				if im.SB != nil {
					fmt.Fprintf(g.stdout, "checkpoint generation %d; journal blocks %d..%d (%d blocks), %d records\n",
						im.Generation, im.JournalStart, im.JournalEnd, im.JournalBlocks, im.Records)
				}
				return inspectErr(cachePath, err)
			default:
				im, err := cache.OpenImage(dev, cache.ImageOptions{})
				if err != nil {
					return inspectErr(cachePath, err)
				}
				if asJSON {
					var entries []cache.IndexEntry
					im.Index(func(e cache.IndexEntry) bool {
						if limit > 0 && len(entries) >= limit {
							return false
						}
						entries = append(entries, e)
						return true
					})
					return writeJSON(g.stdout, map[string]any{"cache_device": cachePath, "volumes": plainJSON(im.Volumes()), "entries": plainJSON(entries)})
				}
				w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(w, "export\tsize\tmode\tcached\tdirty\tflush epoch")
				for _, v := range im.Volumes() {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\n", v.Name, human(v.Size), v.Mode, human(v.CachedBlocks*4096), human(v.DirtyBlocks*4096), v.FlushEpoch)
				}
				fmt.Fprintln(w, "\t\t\t\t\t")
				fmt.Fprintln(w, "export\tlba\tcache block\tcache offset\tbucket/gen\tcrc32c\tstate")
				n := 0
				im.Index(func(e cache.IndexEntry) bool {
					if limit > 0 && n >= limit {
						return false
					}
					n++
					state := "clean"
					if e.Dirty {
						state = "dirty"
					}
					fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d/%d\t%08x\t%s\n", e.Volume, e.LBA, e.CacheBlock, e.CacheOffset, e.Bucket, e.Generation, e.CRC, state)
					return true
				})
				return w.Flush()
			}
		},
	}
	cmd.Flags().StringVar(&cachePath, "cache", "", "cache device to inspect (required)")
	cmd.Flags().IntVar(&limit, "limit", 0, "index: print at most N entries (0: all)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func inspectErr(path string, err error) error {
	if errors.Is(err, cache.ErrNotFormatted) {
		return fmt.Errorf("inspect: %s is not a tiercache cache device (no superblock)", path)
	}
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	return nil
}

func inspectSuperblock(g *globals, dev device.Device, path string) error {
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	copies := cache.ReadSuperblockCopies(dev)
	var best *cache.Superblock
	for _, c := range copies {
		if c.Err != nil {
			fmt.Fprintf(w, "copy %d (offset %d)\tINVALID: %v\n", c.Index, c.Offset, c.Err)
			continue
		}
		fmt.Fprintf(w, "copy %d (offset %d)\tvalid, seq %d\n", c.Index, c.Offset, c.SB.Seq)
		if best == nil || c.SB.Seq > best.Seq {
			best = c.SB
		}
	}
	if best == nil {
		w.Flush()
		if errors.Is(copies[0].Err, cache.ErrNotFormatted) && errors.Is(copies[1].Err, cache.ErrNotFormatted) {
			return fmt.Errorf("inspect: %s is not a tiercache cache device (no superblock)", path)
		}
		return errors.New("inspect: no valid superblock copy")
	}
	sb := best
	fmt.Fprintf(w, "in use\tseq %d\n", sb.Seq)
	fmt.Fprintf(w, "format version\t%d\n", sb.Version)
	fmt.Fprintf(w, "cache set\t%s\n", fmtUUID(sb.SetUUID))
	fmt.Fprintf(w, "clean shutdown\t%t\n", sb.Clean)
	fmt.Fprintf(w, "block size\t%d\n", sb.BlockSize)
	fmt.Fprintf(w, "buckets\t%d x %s at offset %d\n", sb.NBuckets, human(sb.BucketSize), sb.BucketsOff)
	fmt.Fprintf(w, "journal\t%s at offset %d\n", human(sb.JournalLen), sb.JournalOff)
	ip, ierr := cache.ReadIndexPages(dev, sb)
	if sb.HasIndexPages() {
		fmt.Fprintf(w, "index pages\t%s at offset %d: two root slots, then the pages\n", human(2*sb.CkptLen), sb.CkptOff[0])
		switch {
		case ierr != nil:
			fmt.Fprintf(w, "  pages\tINVALID: %v\n", ierr)
		default:
			fmt.Fprintf(w, "  pages\t%d in the area: the newest root (generation %d) names %d (%d inner, %d leaves, %d bucket table), %d kept for the root before it, %d free\n",
				ip.AreaPages, ip.Generation, ip.Pages(), ip.Inner, ip.Leaves, ip.Table, ip.Kept, ip.Free)
			fmt.Fprintf(w, "  entries\t%d in %d trees\n", ip.Slots, ip.Trees)
			if ip.Previous == 0 && ip.PreviousErr != nil {
				fmt.Fprintf(w, "  previous root\tnot intact: %v\n", ip.PreviousErr)
			}
		}
	} else {
		fmt.Fprintf(w, "checkpoint slots\t2 x %s at offsets %d, %d\n", human(sb.CkptLen), sb.CkptOff[0], sb.CkptOff[1])
	}
	for _, sl := range cache.ReadCheckpointSlots(dev, sb) {
		if sl.IndexRoot {
			if sl.Err != nil {
				fmt.Fprintf(w, "  root slot %d\tempty or invalid: %v\n", sl.Index, sl.Err)
				continue
			}
			fmt.Fprintf(w, "  root slot %d\tgeneration %d, %d trees, journal from block %d\n", sl.Index, sl.Generation, sl.Trees, sl.JournalBlock)
			continue
		}
		if sl.Err != nil {
			fmt.Fprintf(w, "  slot %d\tempty or invalid: %v\n", sl.Index, sl.Err)
			continue
		}
		fmt.Fprintf(w, "  slot %d\tgeneration %d, journal from block %d seq %d, body %s crc32c %08x\n",
			sl.Index, sl.Generation, sl.JournalBlock, sl.JournalSeq, human(int64(sl.BodyLen)), sl.BodyCRC)
	}
	if len(sb.Backings) == 0 {
		fmt.Fprintf(w, "backing devices\tnone (attach one with 'tiercache attach')\n")
	}
	for i, b := range sb.Backings {
		if b.Free() {
			fmt.Fprintf(w, "backing %d\tfree slot (detached)\n", i)
			continue
		}
		id := b.ID
		if id == "" {
			id = "none"
		}
		fmt.Fprintf(w, "backing %d\t%s: %s, %s, mode %s, id %s\n", i, b.Name, b.Path, human(b.Size), b.Settings.Mode, id)
	}
	return w.Flush()
}
