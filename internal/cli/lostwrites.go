package cli

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
)

// lockAck: acknowledging lost writes writes the cache device.
var lockAck = lockKind{true, "stop it first: lost writes are acknowledged offline; 'tiercache status' and 'tiercache check' show them meanwhile"}

func newLostWritesCmd(g *globals) *cobra.Command {
	var cachePath string
	var acks []string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "lost-writes [--cache PATH] [--ack ID]...",
		Short: "List the acknowledged writes cache device failovers lost, or acknowledge them once handled",
		Long: `List or acknowledge the lost-writes record of a cache set.

When the cache device fails, the set serves every volume from its backing
device. Writes a client was told had succeeded, but whose journal records
never became durable (no FLUSH had covered them), are lost: they are on
neither device. The set records each such failover on the cache device (a
numbered failover: when, why, and per volume the bytes lost and their
ranges), and 'tiercache check' (exit 1) and 'tiercache status' report it
until an operator acknowledges it here.

Without --ack, prints the record (read-only). With --ack ID (repeatable)
removes those failovers from the record, after you have restored or
rewritten what they lost (from the application's log, a backup, or a
filesystem check of the volume).

Online (no --cache): the running server's record; it refuses while it is
failed over itself (restart it on a working cache device first). Offline
(--cache PATH): a cache device that is not being served.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var ids []uint64
			for _, a := range acks {
				id, err := strconv.ParseUint(a, 10, 64)
				if err != nil || id == 0 {
					return fmt.Errorf("lost-writes: --ack %q: want the number of a failover, as 'tiercache lost-writes --cache %s' lists them (each must be named: there is no --ack all)", a, cachePath)
				}
				ids = append(ids, id)
			}
			if cachePath == "" {
				return lostWritesOnline(cmd, g, ids, asJSON)
			}
			return lostWrites(g, cachePath, ids, asJSON)
		},
	}
	cmd.Flags().StringVar(&cachePath, "cache", "", "read or change the record of this cache device offline (not served) instead of asking the running server")
	cmd.Flags().StringArrayVar(&acks, "ack", nil, "acknowledge failover `ID` (repeatable): its lost writes are handled; removes it from the record")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func lostWrites(g *globals, path string, ids []uint64, asJSON bool) error {
	k := lockCheck
	if len(ids) > 0 {
		k = lockAck
	}
	unlock, err := lockDevice(devicePath(path), "cache device", k)
	if err != nil {
		return fmt.Errorf("lost-writes: %w", err)
	}
	defer unlock()
	dev, err := device.OpenFile(devicePath(path), device.FileOptions{ReadOnly: len(ids) == 0, Direct: device.DirectOff})
	if err != nil {
		return fmt.Errorf("lost-writes: %w", err)
	}
	defer dev.Close()
	rec, err := cache.ReadLostWrites(dev)
	if errors.Is(err, cache.ErrNotFormatted) {
		return fmt.Errorf("lost-writes: %s is not a tiercache cache device (no superblock)", path)
	}
	if err != nil {
		return fmt.Errorf("lost-writes: %w", err)
	}
	if len(ids) > 0 {
		rec, err = cache.AckLostWrites(dev, ids)
		if errors.Is(err, cache.ErrNoSuchLostEvent) {
			return fmt.Errorf("lost-writes: %w in the record of %s, which lists %s: nothing was acknowledged", err, path, listIDs(rec.Events))
		}
		if err != nil {
			return fmt.Errorf("lost-writes: %w", err)
		}
		if !asJSON {
			for _, id := range ids {
				fmt.Fprintf(g.stdout, "failover %d acknowledged: its lost writes are no longer reported\n", id)
			}
		}
	}
	if asJSON {
		return writeJSON(g.stdout, map[string]any{"cache_device": path, "failovers": plainJSON(rec.Events)})
	}
	if len(rec.Events) == 0 {
		fmt.Fprintln(g.stdout, "no lost writes recorded")
		return nil
	}
	for _, ev := range rec.Events {
		fmt.Fprintf(g.stdout, "failover %d at %s: %s\n", ev.ID, time.Unix(0, ev.Time).UTC().Format(time.RFC3339), ev.Cause)
		for _, l := range cache.DescribeLostEvent(ev) {
			fmt.Fprintln(g.stdout, "  "+l)
		}
	}
	fmt.Fprintf(g.stdout, "once what they lost is restored, acknowledge each with 'tiercache lost-writes --cache %s --ack ID'\n", path)
	return nil
}

func listIDs(evs []cache.LostEvent) string {
	if len(evs) == 0 {
		return "no failover"
	}
	var s []string
	for _, ev := range evs {
		s = append(s, strconv.FormatUint(ev.ID, 10))
	}
	return "failover " + strings.Join(s, ", ")
}

// lostWritesOnline lists or acknowledges the running server's lost writes.
func lostWritesOnline(cmd *cobra.Command, g *globals, ids []uint64, asJSON bool) error {
	ctx := cmdContext(cmd)
	s, err := g.connect(ctx)
	if err != nil {
		return err
	}
	if s.st.Set == nil {
		return errors.New("lost-writes: the server serves no cache set")
	}
	lines := s.st.Set.LostWrites
	if len(ids) > 0 {
		rep, err := s.c.AckLostWrites(ctx, ids)
		if err != nil {
			return fmt.Errorf("lost-writes: %w", g.apiErr(err))
		}
		lines = rep.LostWrites
	}
	if asJSON {
		return writeServerJSON(g.stdout, s.id, map[string]any{"lost_writes": lines, "acknowledged": ids})
	}
	s.header(g.stdout)
	for _, id := range ids {
		fmt.Fprintf(g.stdout, "failover %d acknowledged: its lost writes are no longer reported\n", id)
	}
	if len(lines) == 0 {
		fmt.Fprintln(g.stdout, "no lost writes recorded")
		return nil
	}
	for _, l := range lines {
		fmt.Fprintln(g.stdout, "  "+l)
	}
	fmt.Fprintln(g.stdout, "once what they lost is restored, acknowledge each with 'tiercache lost-writes --ack ID'")
	return nil
}
