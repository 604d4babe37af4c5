// Command kvmload is the power-cut tests' block workload, run inside the
// test guest (internal/kvm) against the kernel NBD device of a tiercache
// export. It writes stamped 4 KiB blocks (internal/crashtest) with O_DIRECT
// from several goroutines, some with O_DSYNC (FUA), and FLUSHes (fdatasync)
// now and then; after each FLUSH returns it runs the mark command, so that
// the dm-log-writes log under tiercache's devices holds a mark after which
// every write acknowledged before that FLUSH must survive.
//
// It keeps a crashtest.Oracle and writes every oracle event, in the order
// the oracle saw it, to the events file: the host rebuilds the oracle of any
// point of the log from it (see ReadEvents in internal/kvm). At the end it
// reads every block back and checks it against the oracle (no crash: the
// latest write).
package main

import (
	"bufio"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"github.com/tiercache/tiercache/internal/crashtest"
)

func main() {
	dev := flag.String("dev", "/dev/nbd0", "block device to write")
	blocks := flag.Int64("blocks", 2048, "blocks (4 KiB) of the device to use, from 0")
	writes := flag.Int("writes", 2000, "writes in all")
	writers := flag.Int("writers", 4, "concurrent writers")
	flushEvery := flag.Int("flush-every", 64, "a FLUSH after about this many acknowledged writes")
	fuaPct := flag.Int("fua", 10, "percent of writes sent with O_DSYNC (FUA)")
	seed := flag.Uint64("seed", 1, "seed of the workload and of the stamps")
	out := flag.String("events", "events", "events file to write")
	mark := flag.String("mark", "", "command run after each FLUSH with the mark name appended, e.g. 'dmsetup message lw 0 mark'")
	flag.Parse()
	if err := run(*dev, *blocks, *writes, *writers, *flushEvery, *fuaPct, *seed, *out, *mark); err != nil {
		fmt.Fprintln(os.Stderr, "kvmload:", err)
		os.Exit(1)
	}
}

type workload struct {
	mu      sync.Mutex // orders oracle calls and their events
	o       *crashtest.Oracle
	ev      *bufio.Writer
	claimed map[int64]bool
	acked   int
	flushCh chan struct{}
}

func (w *workload) event(format string, args ...any) {
	fmt.Fprintf(w.ev, format+"\n", args...)
}

func run(dev string, blocks int64, writes, writers, flushEvery, fuaPct int, seed uint64, out, mark string) error {
	plain, err := os.OpenFile(dev, os.O_RDWR|syscall.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer plain.Close()
	dsync, err := os.OpenFile(dev, os.O_RDWR|syscall.O_DIRECT|syscall.O_DSYNC, 0)
	if err != nil {
		return err
	}
	defer dsync.Close()
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	w := &workload{o: crashtest.NewOracle(blocks, true), ev: bufio.NewWriter(f), claimed: map[int64]bool{}, flushCh: make(chan struct{}, 1)}
	w.event("seed %d blocks %d", seed, blocks)

	flushes := 0
	flush := func() error {
		w.mu.Lock()
		tok := w.o.FlushStart(0)
		w.event("FS %d", flushes)
		w.mu.Unlock()
		if err := plain.Sync(); err != nil {
			return fmt.Errorf("fdatasync: %w", err)
		}
		w.mu.Lock()
		w.o.FlushAck(tok)
		w.event("FA %d", flushes)
		w.mu.Unlock()
		if mark != "" {
			// The event goes first: a write acknowledged while the mark
			// command runs may reach the log after the mark, so it must
			// count as after it.
			w.mu.Lock()
			w.event("M %d", flushes)
			w.mu.Unlock()
			args := append(strings.Fields(mark), fmt.Sprintf("f%d", flushes))
			if b, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				return fmt.Errorf("%s: %v %s", strings.Join(args, " "), err, b)
			}
		}
		flushes++
		return nil
	}

	var wg sync.WaitGroup
	errs := make(chan error, writers+1)
	per := writes / writers
	for c := 0; c < writers; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			buf := alignedBlock()
			for i := 0; i < per; i++ {
				w.mu.Lock()
				var lba int64
				for {
					lba = rng.Int64N(blocks)
					if !w.claimed[lba] {
						break
					}
				}
				w.claimed[lba] = true
				fua := rng.IntN(100) < fuaPct
				op, err := w.o.Begin(crashtest.OpWrite, lba, 1, 0, fua, 0)
				if err != nil {
					w.mu.Unlock()
					errs <- err
					return
				}
				w.event("B %d %d %t", op.ID, lba, fua)
				w.mu.Unlock()
				crashtest.Stamp(buf, seed, uint64(lba), op.ID)
				fd := plain
				if fua {
					fd = dsync
				}
				if _, err := fd.WriteAt(buf, lba*crashtest.BlockSize); err != nil {
					errs <- fmt.Errorf("write w%d at block %d: %w", op.ID, lba, err)
					return
				}
				w.mu.Lock()
				w.o.Ack(op)
				w.event("A %d", op.ID)
				delete(w.claimed, lba)
				w.acked++
				if w.acked%flushEvery == 0 {
					select {
					case w.flushCh <- struct{}{}:
					default:
					}
				}
				w.mu.Unlock()
			}
		}(c)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for running := true; running; {
		select {
		case <-w.flushCh:
			if err := flush(); err != nil {
				return err
			}
		case <-done:
			running = false
		}
	}
	close(errs)
	for err := range errs {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	w.event("END")
	if err := w.ev.Flush(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}

	// Every block reads as its latest write.
	buf := alignedBlock()
	bad := 0
	for _, lba := range w.o.Touched() {
		if _, err := plain.ReadAt(buf, lba*crashtest.BlockSize); err != nil {
			return fmt.Errorf("read block %d: %w", lba, err)
		}
		if err := w.o.CheckLive(lba, crashtest.Decode(buf, seed, uint64(lba))); err != nil {
			fmt.Fprintln(os.Stderr, "kvmload:", err)
			bad++
		}
	}
	fmt.Printf("kvmload: %d writes, %d flushes, %d blocks read back, %d bad\n", writes/writers*writers, flushes, len(w.o.Touched()), bad)
	if bad > 0 {
		return fmt.Errorf("%d blocks do not read as their latest write", bad)
	}
	return nil
}

// alignedBlock returns a 4 KiB buffer aligned for O_DIRECT.
func alignedBlock() []byte {
	b := make([]byte, 2*crashtest.BlockSize)
	off := 0
	for (uintptr(unsafe.Pointer(unsafe.SliceData(b)))+uintptr(off))%crashtest.BlockSize != 0 {
		off++
	}
	return b[off : off+crashtest.BlockSize]
}
