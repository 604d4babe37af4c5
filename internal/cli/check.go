package cli

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/backingid"
)

func newCheckCmd(g *globals) *cobra.Command {
	var cachePath string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "check [--cache PATH]",
		Short: "Verify a cache set's metadata and every cached block's checksum; exit 1 on any problem",
		Long: `Verify a cache set and exit non-zero if anything is wrong.

Online (no --cache): the running server checks the index and allocator
invariants of the set it serves and verifies the checksum of every cached
block, while serving. A clean block that fails is dropped (the next read
goes to the backing device); a dirty one is reported (it exists nowhere
else).

Offline (--cache PATH): for a cache device that is not being served. The
device is opened read-only and nothing is written: both superblock copies,
the checkpoint (on a set formatted with --index-pages: the newest index root
and every page it names, each read back and its checksum verified), the
journal (replayed into an index whose invariants are checked) and the
checksum of every cached block.

Exit status: 0 when everything checks out, 1 on any problem or error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cachePath != "" {
				return checkOffline(cmd, g, cachePath, asJSON)
			}
			ctx := cmdContext(cmd)
			s, err := g.connect(ctx)
			if err != nil {
				return err
			}
			pl := newProgressLine(g.stderr, "check", func(n int64) string { return fmt.Sprintf("%d blocks", n) })
			pl.quiet = asJSON
			fin, err := s.c.Check(ctx, pl.update)
			pl.done()
			if err != nil {
				return fmt.Errorf("check: %w", g.apiErr(err))
			}
			if asJSON {
				if err := writeServerJSON(g.stdout, s.id, fin); err != nil {
					return err
				}
				if len(fin.Problems) > 0 {
					return &exitError{code: 1, err: fmt.Errorf("check found %d problem(s)", len(fin.Problems))}
				}
				return nil
			}
			s.header(g.stdout)
			fmt.Fprintln(g.stdout, fin.Message)
			return reportProblems(g, fin.Problems)
		},
	}
	cmd.Flags().StringVar(&cachePath, "cache", "", "check this cache device offline (read-only) instead of asking the running server")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (online: the final progress with its problems; offline: what was read and verified)")
	return cmd
}

func reportProblems(g *globals, problems []string) error {
	for _, p := range problems {
		fmt.Fprintln(g.stdout, "PROBLEM:", p)
	}
	if len(problems) > 0 {
		return &exitError{code: 1, err: fmt.Errorf("check found %d problem(s)", len(problems))}
	}
	fmt.Fprintln(g.stdout, "no problems found")
	return nil
}

// checkBackings compares each backing device found at its recorded path
// with what the set recorded: size and identity (serve refuses either
// mismatch). A device not found there is no problem of the cache device
// (it may be checked elsewhere, or the disk is given to serve with
// --backing); it is said.
func checkBackings(sb *cache.Superblock, s3 s3Defaults) []string {
	var problems []string
	for _, bi := range sb.Backings {
		if bi.Free() {
			continue
		}
		if isObjImage(bi.Path) {
			problems = append(problems, checkObjBacking(bi.Name, bi.Path, bi.ID, bi.Size, s3)...)
			continue
		}
		if isRemote(bi.Path) {
			problems = append(problems, checkRemoteBacking(bi.Name, bi.Path, bi.ID, bi.Size)...)
			continue
		}
		p := devicePath(bi.Path)
		size, err := deviceSize(p)
		if err != nil {
			problems = append(problems, fmt.Sprintf("backing device %q: not checked: %v (serve needs --backing %s=PATH)", bi.Name, err, bi.Name))
			continue
		}
		if size != bi.Size {
			problems = append(problems, fmt.Sprintf("backing device %q (%s) is %d bytes, the set recorded %d (truncated or grown): serve refuses it; restore it to %d bytes (truncate -s %d, or resize the volume), serve, and detach %s to write its dirty data back, then resize it and attach it again",
				bi.Name, bi.Path, size, bi.Size, bi.Size, bi.Size, bi.Name))
		}
		if err := backingid.Check(bi.ID, p); err != nil {
			problems = append(problems, fmt.Sprintf("backing device %q: %v: serve refuses it without --force; if this IS the disk and only its identity changed, 'tiercache identity --cache CACHE --rerecord %s' records its identity now", bi.Name, err, bi.Name))
		}
	}
	return problems
}

// deviceSize is the size of a file or block device.
func deviceSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.Seek(0, io.SeekEnd)
}

func checkOffline(cmd *cobra.Command, g *globals, path string, asJSON bool) error {
	unlock, err := lockDevice(devicePath(path), "cache device", lockCheck)
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	defer unlock()
	dev, err := device.OpenFile(devicePath(path), device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	defer dev.Close()
	pr := newProgress(g.stderr, "verifying cached blocks", 1)
	ppr := newProgress(g.stderr, "verifying index pages", 1)
	opts := cache.CheckOptions{Progress: pr.set, PageProgress: ppr.set}
	if asJSON {
		opts = cache.CheckOptions{}
	}
	rep, err := cache.CheckOffline(cmdContext(cmd), dev, opts)
	ppr.finish()
	pr.finish()
	if errors.Is(err, cache.ErrNotFormatted) {
		return fmt.Errorf("check: %s is not a tiercache cache device (no superblock)", path)
	}
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	im := rep.Image
	var extra []string // the backing devices, and how to get past a journal loss
	if im.SB != nil {
		s3, err := g.s3Defaults(s3Defaults{})
		if err != nil {
			return err
		}
		extra = append(extra, checkBackings(im.SB, s3)...)
	}
	if len(rep.LostWrites) > 0 {
		extra = append(extra, fmt.Sprintf("the lost writes above are reported until acknowledged: once restored, 'tiercache lost-writes --cache %s --ack ID' for each failover", path))
	}
	if cache.IsJournalLoss(rep.OpenErr) {
		extra = append(extra, fmt.Sprintf("'tiercache serve --cache %s' refuses this set; with --force it serves what is left (the lost writes stay undone)", path))
	}
	if asJSON {
		problems := append(append(append([]string{}, rep.Problems...), extra...), rep.Scrub.Problems...)
		out := map[string]any{"cache_device": path, "superblock_copies": plainJSON(im.Copies), "scrub": plainJSON(rep.Scrub), "problems": problems, "warnings": im.Warnings}
		if im.SB != nil {
			out["set_uuid"], out["backings"], out["clean_shutdown"] = fmtUUID(im.SB.SetUUID), im.SB.LiveBackings(), im.SB.Clean
			out["checkpoint_generation"], out["journal_blocks"], out["records_replayed"] = im.Generation, im.JournalBlocks, im.Records
		}
		if im.Pages != nil {
			out["index_pages"] = plainJSON(im.Pages)
		}
		if err := writeJSON(g.stdout, out); err != nil {
			return err
		}
		if len(problems) > 0 || rep.Scrub.ProblemsTotal > 0 {
			return &exitError{code: 1, err: fmt.Errorf("check found %d problem(s)", len(problems))}
		}
		return nil
	}
	for _, c := range im.Copies {
		state := "ok"
		if c.Err != nil {
			state = "BAD"
		}
		seq := ""
		if c.SB != nil {
			seq = fmt.Sprintf(" seq %d", c.SB.Seq)
		}
		fmt.Fprintf(g.stdout, "superblock copy %d:%s %s\n", c.Index, seq, state)
	}
	if im.SB != nil {
		fmt.Fprintf(g.stdout, "cache set %s, %d backing device(s), clean shutdown: %t\n", fmtUUID(im.SB.SetUUID), im.SB.LiveBackings(), im.SB.Clean)
		fmt.Fprintf(g.stdout, "checkpoint generation %d, journal: %d blocks, %d records replayed\n", im.Generation, im.JournalBlocks, im.Records)
	}
	if ip := im.Pages; ip != nil {
		fmt.Fprintf(g.stdout, "index pages of root generation %d: %d read back and verified (%d inner, %d leaves, %d bucket table), %d entries\n",
			ip.Generation, ip.Pages(), ip.Inner, ip.Leaves, ip.Table, ip.Slots)
	}
	s := rep.Scrub
	fmt.Fprintf(g.stdout, "cached blocks verified: %d (%d dirty), checksum mismatches: %d (%d dirty), read errors: %d\n",
		s.Blocks, s.DirtyBlocks, s.Bad, s.BadDirty, s.ReadErrors)
	for _, w := range im.Warnings {
		fmt.Fprintln(g.stdout, "WARNING:", w)
	}
	problems := append(append([]string(nil), rep.Problems...), extra...)
	problems = append(problems, s.Problems...)
	if n := s.ProblemsTotal - int64(len(s.Problems)); n > 0 {
		problems = append(problems, fmt.Sprintf("... and %d more checksum problems", n))
	}
	return reportProblems(g, problems)
}
