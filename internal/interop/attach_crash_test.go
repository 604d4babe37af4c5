package interop

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/backingid"
)

// TestKillDuringAttachDetach SIGKILLs the race-built server at random
// moments of attach and of detach (with dirty data being written back),
// restarts it, and checks the documented outcomes: the set lists the disk
// or not, nothing in between; listed, the export serves every byte written;
// not listed after a detach, the bare file holds every byte and is not
// claimed; a stale claim left by a killed attach is accepted by the next
// attach to the same set.
func TestKillDuringAttachDetach(t *testing.T) {
	t.Parallel() // self-contained: its own files, sockets and processes
	need(t, "qemu-io", "nbdcopy")
	seed, _ := crashConfig(t)
	t.Logf("seed %d (rerun: -seed %d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 3))
	dir := t.TempDir()
	disk := randomFile(t, dir, "disk.img", 16<<20, 5)
	want, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	cachePath := sparseFile(t, dir, "cache.img", 64<<20)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--bucket-size", "256K")
	s := newKillableServer(t, "--cache", cachePath)
	admin := filepath.Join(s.args[1], "admin.sock") // newKillableServer's --data-dir
	ctx := context.Background()
	tc := func(args ...string) (string, error) {
		return runErr(time.Minute, bin, append(args, "--admin", admin)...)
	}
	listed := func() bool {
		out, err := tc("usage", "--json")
		if err != nil {
			t.Fatalf("usage: %v\n%s", err, out)
		}
		var u struct{ Exports []struct{ Name string } }
		if err := json.Unmarshal([]byte(out), &u); err != nil {
			t.Fatal(err)
		}
		return len(u.Exports) == 1 && u.Exports[0].Name == "disk"
	}
	// killDuring runs the command in the background, SIGKILLs the server
	// a random delay after the command's output contains mark ("" for at
	// once), and waits for the command (which fails or not).
	killDuring := func(mark string, maxDelay time.Duration, args ...string) {
		_, out, exited := background(t, bin, append(args, "--admin", admin)...)
		for deadline := time.Now().Add(20 * time.Second); mark != "" && !strings.Contains(out.String(), mark) && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		d := time.Duration(rng.Int64N(int64(maxDelay)))
		time.Sleep(d)
		if err := s.Kill(); err != nil {
			t.Fatal(err)
		}
		werr := <-exited
		t.Logf("killed %v after %q of %v: %v %s", d, mark, args, werr, strings.TrimSpace(out.String()))
	}
	check := func(what string) bool {
		if err := s.Start(ctx); err != nil {
			t.Fatal(err)
		}
		in := listed()
		if in {
			got := filepath.Join(dir, "got.img")
			if out, err := runErr(time.Minute, "nbdcopy", "nbd+unix:///disk?socket="+s.sock, got); err != nil {
				t.Fatalf("%s: nbdcopy: %v\n%s", what, err, out)
			}
			if b, _ := os.ReadFile(got); !bytes.Equal(b, want) {
				t.Fatalf("%s: the disk is listed but the export does not serve what was written", what)
			}
		} else {
			if b, _ := os.ReadFile(disk); !bytes.Equal(b, want) {
				t.Fatalf("%s: the disk left the set incomplete", what)
			}
		}
		return in
	}
	var outcomes []string
	for cycle := 0; cycle < 6; cycle++ {
		if err := s.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if !listed() {
			killDuring("", 400*time.Millisecond, "attach", "disk="+disk) // the CLI's start-up is part of the range
			in := check("kill during attach")
			outcomes = append(outcomes, map[bool]string{true: "attach:in", false: "attach:out"}[in])
			if !in {
				// A stale claim of this set is accepted.
				if out, err := tc("attach", "disk="+disk); err != nil {
					t.Fatalf("attach after a killed attach: %v\n%s", err, out)
				}
			}
		}
		// Dirty data for the detach to write back.
		if out, err := tc("set", "disk", "writeback_rate_max=4K", "cache_mode=writeback"); err != nil {
			t.Fatalf("set: %v\n%s", err, out)
		}
		var cmds []string
		b := byte(0x30 + cycle)
		for i := 0; i < 256; i++ {
			off := int64(rng.IntN(16<<20/8192)) * 8192
			cmds = append(cmds, "-c", "write -P "+itoa(int64(b))+" "+itoa(off)+" 8k")
			copy(want[off:off+8192], bytes.Repeat([]byte{b}, 8192))
		}
		cmds = append(cmds, "-c", "flush")
		run(t, time.Minute, "qemu-io", append([]string{"-f", "raw", "nbd+unix:///disk?socket=" + s.sock}, cmds...)...)
		killDuring("detach disk [", 300*time.Millisecond, "detach", "disk")
		in := check("kill during detach")
		outcomes = append(outcomes, map[bool]string{true: "detach:in", false: "detach:out"}[in])
		if !in {
			if id, err := backingid.Read(disk); err != nil || id.Set != "" {
				t.Fatalf("detached by a killed detach but still claimed: %+v %v", id, err)
			}
		}
		if err := s.Kill(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("outcomes: %v", outcomes)
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if listed() {
		if out, err := tc("detach", "disk"); err != nil {
			t.Fatalf("final detach: %v\n%s", err, out)
		}
	}
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(disk); !bytes.Equal(b, want) {
		t.Fatal("after the final detach the disk lacks writes")
	}
}
