package interop

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestHostileClientsMemory: 16 connections pipelining 1 MiB READs without
// reading the replies took the server from 14 MiB to over 1 GiB of RSS
// (64 MiB per connection, connections unlimited), still there minutes
// after they closed. With --max-inflight and --max-connections the
// server's RSS stays under a bound while they push, a well-behaved client
// (qemu-io, 256 KiB requests, within its connection's reserve) gets its
// writes and verified reads done meanwhile, a connection over the limit
// is refused with a message saying why, and the memory goes back to the
// OS once the hostile clients are gone.
func TestHostileClientsMemory(t *testing.T) {
	need(t, "qemu-io", "nbdinfo")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 64*mib)
	const hostile = 16
	// RSS is measured on a binary built without the race detector, whose
	// shadow memory would swamp the figures and is never returned.
	sock := filepath.Join(dir, "nbd.sock")
	s := startServerBin(t, plainBin(t), sock, "serve", "--listen", "unix:"+sock, "--export", "disk="+img, "--admin", "none",
		"--log-level", "debug", "--max-inflight", "64M", "--max-connections", strconv.Itoa(hostile+1))
	pid := s.cmd.Process.Pid
	base := rssMiB(t, pid)

	var conns []net.Conn
	var wg sync.WaitGroup
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		wg.Wait()
	}()
	flood := func() {
		c, err := nbdGo(s.sock, "disk")
		// A slot freed by a client that just left comes back when the
		// server has ended its connection.
		for deadline := time.Now().Add(20 * time.Second); err != nil && strings.Contains(err.Error(), "too many connections") && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
			c, err = nbdGo(s.sock, "disk")
		}
		if err != nil {
			t.Fatalf("hostile connection %d: %v", len(conns), err)
		}
		conns = append(conns, c)
		wg.Add(1)
		go func() {
			defer wg.Done()
			floodReads(c, 64*mib)
		}()
	}
	for range hostile {
		flood()
	}

	// Sample the server's RSS while the good client works.
	stop := make(chan struct{})
	peak := make(chan int64, 1)
	go func() {
		var m int64
		for {
			m = max(m, rssMiB(t, pid))
			select {
			case <-stop:
				peak <- m
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	var cmds []string
	for i := 0; i < 32; i++ {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P 0x%02x %d 256k", i+1, i*256<<10))
	}
	for i := 0; i < 32; i++ {
		cmds = append(cmds, "-c", fmt.Sprintf("read -P 0x%02x %d 256k", i+1, i*256<<10))
	}
	out := run(t, 2*time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("disk")}, cmds...)...)
	if strings.Contains(out, "fail") || strings.Contains(out, "error") || strings.Count(out, "read 262144/262144 bytes") != 32 {
		t.Errorf("the well-behaved client beside %d hostile ones:\n%s", hostile, out)
	}
	// The limit: one more hostile connection fills it, the next client is
	// refused at NBD_OPT_GO, saying why.
	flood()
	out, err := runErr(30*time.Second, "qemu-io", "-f", "raw", s.uri("disk"), "-c", "read 0 4k")
	if err == nil || !strings.Contains(out, "too many connections: this server serves at most 17 at once (--max-connections)") {
		t.Errorf("a client over --max-connections: err %v; want a refusal saying why:\n%.3000s", err, out)
	}
	waitLog(t, s, "refused a client: too many connections")
	// Hold the load a little longer, so that the bound is not measured
	// before the hostile connections had their fill.
	time.Sleep(2 * time.Second)
	close(stop)
	loaded := <-peak
	t.Logf("server RSS: %d MiB at start, at most %d MiB under %d hostile connections", base, loaded, hostile+1)
	const bound = 300 // MiB: 64 MiB of payload, pooled buffers, GC headroom
	if loaded > bound {
		t.Errorf("server RSS reached %d MiB under %d hostile connections with --max-inflight 64M; want under %d MiB", loaded, hostile+1, bound)
	}

	// Gone: the memory goes back.
	for _, c := range conns {
		c.Close()
	}
	wg.Wait()
	conns = nil
	// Nothing in flight any more: the server hands the idle buffers back
	// (and says so at debug level).
	waitLog(t, s, "returned idle buffer memory to the OS")
	const after = 48 // MiB, against 70 and more under the load
	now := rssMiB(t, pid)
	t.Logf("server RSS after the hostile connections closed and the server returned idle memory: %d MiB", now)
	if now > after {
		t.Errorf("server RSS %d MiB after the hostile connections closed and the server returned memory; want under %d MiB", now, after)
	}
	// And the export still works, once the server has ended the closed
	// connections (their slots come back as each one ends).
	for deadline := time.Now().Add(30 * time.Second); ; {
		out, err := runErr(time.Minute, "qemu-io", "-f", "raw", s.uri("disk"), "-c", "read -P 0x01 0 256k")
		if err == nil {
			break
		}
		if time.Now().After(deadline) || !strings.Contains(out, "too many connections") {
			t.Fatalf("qemu-io after the hostile connections closed: %v\n%s", err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitLog waits until the server's log (copied from its stderr by a
// goroutine, so a little behind) contains want.
func waitLog(t *testing.T, s *server, want string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(s.log.String(), want); {
		if time.Now().After(deadline) {
			t.Errorf("the server did not log %q:\n%s", want, s.log)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var plain struct {
	once sync.Once
	bin  string
	err  error
}

// plainBin is the tiercache binary built without the race detector (bin
// itself with TIERCACHE_INTEROP_NORACE).
func plainBin(t *testing.T) string {
	t.Helper()
	if os.Getenv("TIERCACHE_INTEROP_NORACE") != "" {
		return bin
	}
	plain.once.Do(func() {
		plain.bin = bin + "-norace"
		out, err := exec.Command("go", "build", "-o", plain.bin, "github.com/tiercache/tiercache/cmd/tiercache").CombinedOutput()
		if err != nil {
			plain.err = fmt.Errorf("building tiercache without -race: %v\n%s", err, out)
		}
	})
	if plain.err != nil {
		t.Fatal(plain.err)
	}
	return plain.bin
}

// rssMiB is VmRSS of process pid, in MiB.
func rssMiB(t *testing.T, pid int) int64 {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Errorf("reading the server's RSS: %v", err)
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb >> 10
		}
	}
	return 0
}

// nbdGo opens a unix socket NBD connection and negotiates export name with
// NBD_OPT_GO (fixed newstyle, no structured replies); it returns the
// connection in the transmission phase.
func nbdGo(sock, name string) (net.Conn, error) {
	c, err := net.Dial("unix", sock)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	fail := func(err error) (net.Conn, error) { c.Close(); return nil, err }
	var hello [18]byte
	if _, err := io.ReadFull(c, hello[:]); err != nil {
		return fail(err)
	}
	b := binary.BigEndian.AppendUint32(nil, 3) // FIXED_NEWSTYLE | NO_ZEROES
	b = binary.BigEndian.AppendUint64(b, 0x49484156454F5054)
	b = binary.BigEndian.AppendUint32(b, 7) // NBD_OPT_GO
	b = binary.BigEndian.AppendUint32(b, uint32(4+len(name)+2))
	b = binary.BigEndian.AppendUint32(b, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, 0)
	if _, err := c.Write(b); err != nil {
		return fail(err)
	}
	for {
		var h [20]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return fail(err)
		}
		typ, n := binary.BigEndian.Uint32(h[12:]), binary.BigEndian.Uint32(h[16:])
		data := make([]byte, n)
		if _, err := io.ReadFull(c, data); err != nil {
			return fail(err)
		}
		switch {
		case typ == 1: // NBD_REP_ACK
			c.SetDeadline(time.Time{})
			return c, nil
		case typ&(1<<31) != 0:
			return fail(fmt.Errorf("NBD_OPT_GO refused (%#x): %s", typ, data))
		}
	}
}

// floodReads sends 1 MiB READs over an export of size bytes until the
// connection fails, and never reads a reply.
func floodReads(c net.Conn, size int64) {
	var req [28]byte
	binary.BigEndian.PutUint32(req[0:], 0x25609513)
	binary.BigEndian.PutUint32(req[24:], 1<<20)
	for i := uint64(0); ; i++ {
		binary.BigEndian.PutUint64(req[8:], i)
		binary.BigEndian.PutUint64(req[16:], (i<<20)%uint64(size))
		if _, err := c.Write(req[:]); err != nil {
			return
		}
	}
}
