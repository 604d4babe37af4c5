// Command kvm-logdump lists the entries of a dm-log-writes log (the power-cut
// tests' logs, internal/kvm): each entry's flags, the slice of the logged
// device it falls in, and the stamped blocks (internal/crashtest) its data
// carries, so that a loss a replay found can be traced to the writes that
// made it.
//
//	kvm-logdump -log dmcache.log -slices meta:8,cache:32,back:81 -seed 1 -lba 1433
//
// -slices names the slices of the logged device in order with their sizes in
// MiB; -lba keeps only the entries carrying a stamp of that block, and every
// FLUSH, FUA write and mark.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/logwrites"
)

type slice struct {
	name       string
	start, end int64
}

func main() {
	logPath := flag.String("log", "", "the log device (file)")
	slices := flag.String("slices", "", "name:MiB,... of the logged device, in order")
	seed := flag.Uint64("seed", 0, "the workload's seed (stamps of another seed are listed as foreign)")
	lba := flag.Int64("lba", -1, "only entries carrying this stamped block, and FLUSH, FUA and marks")
	flag.Parse()
	if err := run(*logPath, *slices, *seed, *lba); err != nil {
		fmt.Fprintln(os.Stderr, "kvm-logdump:", err)
		os.Exit(1)
	}
}

func run(logPath, slicesFlag string, seed uint64, only int64) error {
	var sl []slice
	off := int64(0)
	for _, s := range strings.Split(slicesFlag, ",") {
		if s == "" {
			continue
		}
		name, mib, ok := strings.Cut(s, ":")
		n, err := strconv.ParseInt(mib, 10, 64)
		if !ok || err != nil {
			return fmt.Errorf("-slices: %q is not NAME:MiB", s)
		}
		sl = append(sl, slice{name, off, off + n<<20})
		off += n << 20
	}
	f, err := os.Open(logPath)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	lg, err := logwrites.Open(f, fi.Size())
	if err != nil {
		return err
	}
	where := func(b int64) string {
		for _, s := range sl {
			if b >= s.start && b < s.end {
				return fmt.Sprintf("%s+%d", s.name, b-s.start)
			}
		}
		return strconv.FormatInt(b, 10)
	}
	for _, e := range lg.Entries {
		line := e.String()
		start := int64(e.Sector) * lg.SectorSize
		if e.NrSectors > 0 {
			line += fmt.Sprintf(" [%s, %d bytes]", where(start), int64(e.NrSectors)*lg.SectorSize)
		}
		var stamps []string
		hit := false
		if e.HasData() {
			b, err := lg.Data(e)
			if err != nil {
				return err
			}
			for o := 0; o+crashtest.BlockSize <= len(b); o += crashtest.BlockSize {
				blk := b[o : o+crashtest.BlockSize]
				d := crashtest.Decode(blk, seed, 0)
				switch d.Kind {
				case crashtest.KindZero, crashtest.KindGarbage:
					continue
				}
				s := fmt.Sprintf("@%d:b%d=w%d", o/crashtest.BlockSize, d.LBA, d.ID)
				if d.Kind == crashtest.KindTorn {
					s += "(torn)"
				} else if d.Seed != seed {
					s += "(foreign)"
				}
				stamps = append(stamps, s)
				hit = hit || int64(d.LBA) == only
			}
		}
		if only >= 0 && !hit && !e.IsFlush() && !e.IsFUA() && !e.IsMark() {
			continue
		}
		if len(stamps) > 0 {
			if only >= 0 && len(stamps) > 4 {
				var keep []string
				for _, s := range stamps {
					if strings.Contains(s, fmt.Sprintf(":b%d=", only)) {
						keep = append(keep, s)
					}
				}
				line += fmt.Sprintf(" %d stamps, %s", len(stamps), strings.Join(keep, " "))
			} else {
				line += " " + strings.Join(stamps, " ")
			}
		}
		fmt.Println(line)
	}
	return nil
}
