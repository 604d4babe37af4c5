package kvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Disk is a virtio-blk disk of the guest, backed by a host file. Disks
// appear in the guest as /dev/vda, /dev/vdb, ... in the order given.
type Disk struct {
	Path string
	// IOPS, when > 0, throttles the disk to that many operations per
	// second (qemu's throttling.iops-total): a slow "HDD".
	IOPS int
}

// Config is one boot of the guest.
type Config struct {
	Image *Image
	// Share is a host directory the guest mounts at /host (9p). The
	// script, and whatever the test puts there (binaries, inputs), are
	// read from it; results can be written to it.
	Share string
	// Script is run by the guest's dash as /host/script, from /host.
	Script string
	Disks  []Disk
	MemMiB int // default 1024
	CPUs   int // default 2
	// Timeout bounds the whole boot (default 10 minutes): a guest that
	// hangs is killed and Run returns an error with its log.
	Timeout time.Duration
	// Console, if set, receives the guest's console as it is printed.
	Console io.Writer
	// KernelArgs are appended to the kernel's command line.
	KernelArgs string
}

// Result is how one boot ended.
type Result struct {
	Status  int           // the script's exit status
	Log     string        // the guest's console: kernel messages and the script's output
	Elapsed time.Duration // qemu start to exit
}

// Run boots the guest, runs cfg.Script in it and returns its exit status
// and console log. The guest runs under TCG (qemu's emulator: the host's
// KVM cannot boot a stock kernel) without a network. An error means the
// guest did not run the script to its end: qemu failed, the guest hung
// past the timeout, or it powered off without an exit status.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.MemMiB == 0 {
		cfg.MemMiB = 1024
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = 2
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Minute
	}
	if cfg.Share == "" {
		return nil, errors.New("kvm: Config.Share is required (the guest reads its script from it)")
	}
	status := filepath.Join(cfg.Share, "status")
	os.Remove(status)
	if err := os.WriteFile(filepath.Join(cfg.Share, "script"), []byte(cfg.Script), 0o755); err != nil {
		return nil, err
	}
	args := []string{
		"-accel", "tcg,thread=multi", "-cpu", "max",
		"-m", strconv.Itoa(cfg.MemMiB), "-smp", strconv.Itoa(cfg.CPUs),
		"-nic", "none", "-display", "none", "-monitor", "none", "-serial", "stdio",
		"-no-reboot",
		"-kernel", cfg.Image.Kernel, "-initrd", cfg.Image.Initrd,
		"-append", strings.TrimSpace("console=ttyS0 panic=-1 quiet loglevel=4 nbd.nbds_max=4 " + cfg.KernelArgs),
		"-virtfs", "local,path=" + cfg.Share + ",mount_tag=host,security_model=none,id=host",
	}
	for i, d := range cfg.Disks {
		drive := fmt.Sprintf("file=%s,format=raw,if=none,id=d%d,cache=none,aio=native", d.Path, i)
		if d.IOPS > 0 {
			drive += fmt.Sprintf(",throttling.iops-total=%d", d.IOPS)
		}
		args = append(args, "-drive", drive, "-device", fmt.Sprintf("virtio-blk-pci,drive=d%d,serial=tc%d", i, i))
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	var log lockedBuffer
	var w io.Writer = &log
	if cfg.Console != nil {
		w = io.MultiWriter(&log, cfg.Console)
	}
	cmd.Stdout, cmd.Stderr = w, w
	start := time.Now()
	err := cmd.Run()
	res := &Result{Log: log.String(), Elapsed: time.Since(start)}
	if ctx.Err() != nil {
		return res, fmt.Errorf("kvm: guest still running after %v, killed; console:\n%s", cfg.Timeout, tail(res.Log, 60))
	}
	if err != nil {
		return res, fmt.Errorf("kvm: qemu-system-x86_64: %v; console:\n%s", err, tail(res.Log, 60))
	}
	b, err := os.ReadFile(status)
	if err != nil {
		return res, fmt.Errorf("kvm: the guest powered off without the script's exit status (%v); console:\n%s", err, tail(res.Log, 60))
	}
	res.Status, err = strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return res, fmt.Errorf("kvm: exit status %q: %v", b, err)
	}
	return res, nil
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
