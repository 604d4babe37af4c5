package interop

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/nbd"
)

// Stop ends the server with SIGTERM (crashtest.Stopper): the documented
// clean shutdown. With killAfter > 0 a server still running that long
// after the SIGTERM is killed there, in the middle of its shutdown. clean
// is true when it exited by itself with status 0 (then its log must say
// "stopped cleanly"); a non-zero exit it was not killed into is an error,
// and so is a shutdown longer than 60 s.
func (s *killableServer) Stop(_ context.Context, killAfter time.Duration) (bool, error) {
	if s.cur == nil {
		return false, errors.New("server not running")
	}
	cmd := s.cur
	s.cur = nil
	select {
	case <-s.done:
		return false, fmt.Errorf("tiercache had exited by itself before the stop: %v\n%s", s.err, s.log)
	default:
	}
	cmd.Process.Signal(syscall.SIGTERM)
	var cut <-chan time.Time
	if killAfter > 0 {
		cut = time.After(killAfter)
	}
	select {
	case <-s.done:
	case <-cut:
		cmd.Process.Signal(syscall.SIGKILL)
		<-s.done
	case <-time.After(60 * time.Second):
		cmd.Process.Signal(syscall.SIGKILL)
		<-s.done
		return false, fmt.Errorf("tiercache did not stop within 60s of SIGTERM\n%s", s.log)
	}
	if err := s.checkLog(); err != nil {
		return false, err
	}
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if ws.Signaled() && ws.Signal() == syscall.SIGKILL && killAfter > 0 {
		return false, nil // cut by the kill
	}
	if s.err != nil {
		return false, fmt.Errorf("tiercache exited with %v after SIGTERM\n%s", s.err, s.log)
	}
	if !strings.Contains(s.log.String(), "stopped cleanly") {
		return false, fmt.Errorf("tiercache exited 0 after SIGTERM without saying it stopped cleanly\n%s", s.log)
	}
	return true, nil
}

// lifecycleServer is a killableServer serving a cache set on a unix socket
// and, with TLS offered (client certificates verified), on TCP; each cycle
// is ended by a SIGKILL or a SIGTERM (crashtest.Stopper) that lands in the
// middle of everything around the I/O path the plain cases leave idle:
//
//   - admin requests: `tiercache flush` and `tiercache check` (the admin
//     API they call, POST /v1/exports/vol/flush and /v1/check) in a loop;
//   - connections parked at every step of the handshake: connected,
//     greeting read, client flags sent, an option half sent, STARTTLS
//     acknowledged with half a ClientHello sent, TLS up and no option yet;
//   - real clients negotiating in a loop: nbdinfo --list over TLS and
//     nbdinfo over the unix socket (option haggling with NBD_OPT_INFO/GO);
//   - start-up: in half the restarts the server is first killed right
//     after its cache set is open, aimed at listener set-up (the NBD
//     socket, then the admin socket, both replacing the stale files the
//     last kill left).
//
// The crashtest workload itself runs over both listeners (half its
// connections TLS). After a kill or stop every parked connection and
// every client must end (no hang), and the oracle checks every block.
type lifecycleServer struct {
	*killableServer
	t         *testing.T
	cachePath string
	tcpAddr   string
	tlsConfig *tls.Config
	pki       string
	rng       *rand.Rand
	dials     atomic.Int64

	// the current cycle's activities
	halt    chan struct{}
	wg      sync.WaitGroup
	parked  []*parkedConn
	adminOp atomic.Value // string: the admin request in flight, or ""
	client  atomic.Value // string: the real client running, or ""

	mu sync.Mutex // guards the counts below
	// admin requests that completed / were cut by the end of the server;
	// what was in flight at each end
	flushOK, checkOK, adminCut int
	endedDuring                map[string]int
	// real clients that succeeded / were cut
	clientsOK, clientsCut int
	// aimed start-up kills by where the log showed the server was
	startKills map[string]int
	// clean stops that found the set marked clean, and the longest one
	cleanMarked  int
	longestClean time.Duration
	// restarts after a clean stop that recovered dirty blocks
	dirtyAfterStop, startsAfterStop int
	lastStopClean                   bool
}

func newLifecycleServer(t *testing.T, ks *killableServer, cachePath, tcpAddr, pki string, seed uint64) (*lifecycleServer, error) {
	caPEM, err := os.ReadFile(filepath.Join(pki, "ca-cert.pem"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "client-cert.pem"), filepath.Join(pki, "client-key.pem"))
	if err != nil {
		return nil, err
	}
	return &lifecycleServer{
		killableServer: ks, t: t, cachePath: cachePath, tcpAddr: tcpAddr, pki: pki,
		tlsConfig:   &tls.Config{RootCAs: pool, ServerName: "localhost", Certificates: []tls.Certificate{cert}},
		rng:         rand.New(rand.NewPCG(seed, 0x11fe)),
		endedDuring: map[string]int{}, startKills: map[string]int{},
	}, nil
}

// dial alternates between the unix socket (plain) and TCP with TLS.
func (l *lifecycleServer) dial(ctx context.Context) (*nbd.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if l.dials.Add(1)%2 == 0 {
		return nbd.Dial(ctx, "tcp", l.tcpAddr, "vol", nbd.ClientOptions{TLSConfig: l.tlsConfig})
	}
	return nbd.Dial(ctx, "unix", l.sock, "vol", nbd.ClientOptions{})
}

func (l *lifecycleServer) Start(ctx context.Context) error {
	if l.rng.IntN(2) == 0 {
		phase, err := l.startAndKillAtListen(time.Duration(l.rng.IntN(3000)) * time.Microsecond)
		if err != nil {
			return err
		}
		l.mu.Lock()
		l.startKills[phase]++
		l.mu.Unlock()
	}
	if err := l.killableServer.Start(ctx); err != nil {
		return err
	}
	if m := dirtyRE.FindStringSubmatch(l.log.String()); m != nil && l.lastStopClean {
		l.startsAfterStop++
		if m[1] != "0" {
			l.dirtyAfterStop++
		}
	}
	l.lastStopClean = false
	l.begin()
	return nil
}

// startAndKillAtListen starts the server and SIGKILLs it extra after its
// log says the cache set is open: the next steps are the NBD listeners
// (replacing the stale socket file) and the admin API's. It returns where
// the log shows the server had got to.
func (l *lifecycleServer) startAndKillAtListen(extra time.Duration) (string, error) {
	s := l.killableServer
	cmd, done, err := s.spawn()
	if err != nil {
		return "", err
	}
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(s.log.String(), "cache set open") {
		select {
		case <-done:
			return "", fmt.Errorf("tiercache exited during start-up: %v\n%s", s.err, s.log)
		default:
		}
		if time.Now().After(deadline) {
			cmd.Process.Signal(syscall.SIGKILL)
			<-done
			return "", fmt.Errorf("tiercache did not open its cache set within 60s\n%s", s.log)
		}
		time.Sleep(100 * time.Microsecond)
	}
	time.Sleep(extra)
	cmd.Process.Signal(syscall.SIGKILL)
	<-done
	if err := s.checkLog(); err != nil {
		return "", err
	}
	log := s.log.String()
	switch {
	case strings.Contains(log, "admin API listening"):
		return "admin API listening", nil
	case strings.Count(log, "msg=listening") == 2:
		return "NBD listeners up, admin API not yet", nil
	case strings.Contains(log, "msg=listening"):
		return "one NBD listener up", nil
	}
	return "before the NBD listeners", nil
}

// begin starts the cycle's activities around the running server.
func (l *lifecycleServer) begin() {
	// The TCP listener and the admin API come up right after the unix
	// socket Start waited for.
	adminSock := filepath.Join(l.args[1], "admin.sock") // newKillableServer's --data-dir
	for _, a := range [][2]string{{"tcp", l.tcpAddr}, {"unix", adminSock}} {
		for deadline := time.Now().Add(10 * time.Second); ; {
			c, err := net.Dial(a[0], a[1])
			if err == nil {
				c.Close()
				break
			}
			if time.Now().After(deadline) {
				l.t.Errorf("%s listener %s not up 10s after the NBD unix socket: %v", a[0], a[1], err)
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	l.halt = make(chan struct{})
	l.adminOp.Store("")
	l.client.Store("")
	seed := l.rng.Uint64()
	ac := admin.NewClient(adminSock)
	// The admin loop runs in two cycles of three: its flushes leave no
	// dirty data for a stop to keep in the cache.
	l.wg.Add(1)
	if seed%3 != 0 {
		l.wg.Add(1)
		go l.adminLoop(ac, rand.New(rand.NewPCG(seed, 1)))
	}
	go l.clientLoop(rand.New(rand.NewPCG(seed, 2)))
	l.parked = nil
	for i := range 6 {
		p, err := l.park(i)
		if err != nil {
			l.t.Errorf("parking a connection at handshake step %d on a running server: %v", i, err)
			continue
		}
		l.parked = append(l.parked, p)
	}
}

func (l *lifecycleServer) halted() bool {
	select {
	case <-l.halt:
		return true
	default:
		return false
	}
}

// adminLoop sends admin flush and check requests one after another, with
// short pauses, until the server's end; one cut by that end is counted,
// any other failure fails the test.
func (l *lifecycleServer) adminLoop(ac *admin.Client, rng *rand.Rand) {
	defer l.wg.Done()
	for !l.halted() {
		op := "flush"
		if rng.IntN(2) == 0 {
			op = "check"
		}
		l.adminOp.Store(op)
		var fin admin.Progress
		var err error
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		if op == "flush" {
			fin, err = ac.Flush(ctx, "vol", nil)
		} else {
			fin, err = ac.Check(ctx, nil)
		}
		cancel()
		l.adminOp.Store("")
		if err == nil && fin.Error != "" {
			err = errors.New(fin.Error)
		}
		if err == nil && len(fin.Problems) > 0 {
			err = fmt.Errorf("check found problems: %v", fin.Problems)
		}
		l.mu.Lock()
		switch {
		case err != nil && l.halted():
			l.adminCut++
		case err != nil:
			l.t.Errorf("admin %s on a running server: %v", op, err)
		case op == "flush":
			l.flushOK++
		default:
			l.checkOK++
		}
		l.mu.Unlock()
		if err != nil {
			return
		}
		select {
		case <-l.halt:
		case <-time.After(time.Duration(rng.IntN(30)) * time.Millisecond):
		}
	}
}

// clientLoop runs real clients that only negotiate, one after another:
// nbdinfo --list over TLS, and nbdinfo on the unix socket.
func (l *lifecycleServer) clientLoop(rng *rand.Rand) {
	defer l.wg.Done()
	port := l.tcpAddr[strings.LastIndex(l.tcpAddr, ":")+1:]
	for !l.halted() {
		what, args := "nbdinfo --list over TLS", []string{"--list", fmt.Sprintf("nbds://localhost:%s/?tls-certificates=%s", port, l.pki)}
		if rng.IntN(2) == 0 {
			what, args = "nbdinfo over unix", []string{fmt.Sprintf("nbd+unix:///vol?socket=%s", l.sock)}
		}
		l.client.Store(what)
		out, err := runErr(30*time.Second, "nbdinfo", args...)
		l.client.Store("")
		l.mu.Lock()
		switch {
		case err != nil && l.halted():
			l.clientsCut++
		case err != nil:
			l.t.Errorf("nbdinfo %v on a running server: %v\n%s", args, err, out)
		case !strings.Contains(out, "vol"):
			l.t.Errorf("nbdinfo %v: export vol not shown:\n%s", args, out)
		default:
			l.clientsOK++
		}
		l.mu.Unlock()
		if err != nil {
			return
		}
		select {
		case <-l.halt:
		case <-time.After(time.Duration(rng.IntN(20)) * time.Millisecond):
		}
	}
}

// parkedConn is a connection left at one step of the handshake; ended
// closes when a read on it fails (the server closed it or died).
type parkedConn struct {
	step  string
	nc    net.Conn
	ended chan struct{}
}

// Handshake steps a connection is parked at (NBD fixed newstyle).
var parkSteps = []string{
	"connected",         // nothing read
	"greeting read",     // no client flags
	"client flags sent", // no option
	"option half sent",  // NBD_OPT_GO header, part of its data
	"STARTTLS acked, ClientHello half sent",
	"TLS up, no option",
}

// park opens a connection and takes it to parkSteps[step]: TCP for the
// TLS steps, the unix socket for the others.
func (l *lifecycleServer) park(step int) (*parkedConn, error) {
	network, addr := "unix", l.sock
	if step >= 4 {
		network, addr = "tcp", l.tcpAddr
	}
	nc, err := net.DialTimeout(network, addr, 10*time.Second)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*parkedConn, error) {
		nc.Close()
		return nil, err
	}
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	if step >= 1 {
		greeting := make([]byte, 18) // NBDMAGIC, IHAVEOPT, handshake flags
		if _, err := io.ReadFull(nc, greeting); err != nil {
			return fail(fmt.Errorf("greeting: %w", err))
		}
	}
	if step >= 2 {
		if _, err := nc.Write([]byte{0, 0, 0, 3}); err != nil { // FIXED_NEWSTYLE | NO_ZEROES
			return fail(err)
		}
	}
	option := func(opt uint32, data []byte, send int) error {
		b := make([]byte, 16, 16+len(data))
		copy(b, "IHAVEOPT")
		binary.BigEndian.PutUint32(b[8:], opt)
		binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
		b = append(b, data...)
		_, err := nc.Write(b[:send])
		return err
	}
	conn := nc
	switch step {
	case 3:
		// NBD_OPT_GO (7) for "vol" with no info requests: 4+3+2 bytes of
		// data, of which only 5 are sent.
		if err := option(7, []byte{0, 0, 0, 3, 'v', 'o', 'l', 0, 0}, 16+5); err != nil {
			return fail(err)
		}
	case 4, 5:
		if err := option(5, nil, 16); err != nil { // NBD_OPT_STARTTLS
			return fail(err)
		}
		rep := make([]byte, 20) // reply magic, option, type, length
		if _, err := io.ReadFull(nc, rep); err != nil {
			return fail(fmt.Errorf("STARTTLS reply: %w", err))
		}
		if typ := binary.BigEndian.Uint32(rep[12:]); typ != 1 {
			return fail(fmt.Errorf("STARTTLS refused: reply type %#x", typ))
		}
		if step == 4 {
			// A TLS handshake record header promising 512 bytes, and 16.
			hello := append([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}, make([]byte, 10)...)
			if _, err := nc.Write(hello); err != nil {
				return fail(err)
			}
			break
		}
		tc := tls.Client(nc, l.tlsConfig)
		if err := tc.Handshake(); err != nil {
			return fail(fmt.Errorf("TLS handshake: %w", err))
		}
		conn = tc
	}
	nc.SetDeadline(time.Time{})
	p := &parkedConn{step: parkSteps[step], nc: conn, ended: make(chan struct{})}
	go func() {
		defer close(p.ended)
		buf := make([]byte, 512)
		for {
			if _, err := conn.Read(buf); err != nil {
				return
			}
		}
	}()
	return p, nil
}

// end records what was in flight, lets do end the server, and waits for
// every activity: admin requests and clients must fail or finish, parked
// connections must be closed, within 30 s.
func (l *lifecycleServer) end(do func() error) error {
	if l.halt == nil {
		return do() // the server never got to begin
	}
	defer func() { l.halt = nil }()
	l.mu.Lock()
	if op := l.adminOp.Load().(string); op != "" {
		l.endedDuring["admin "+op]++
	}
	if c := l.client.Load().(string); c != "" {
		l.endedDuring[c]++
	}
	l.mu.Unlock()
	close(l.halt)
	err := do()
	done := make(chan struct{})
	go func() { l.wg.Wait(); close(done) }()
	timeout := time.After(30 * time.Second)
	select {
	case <-done:
	case <-timeout:
		return errors.Join(err, fmt.Errorf("an admin request or a client did not end within 30s of the server's end (admin %q, client %q)", l.adminOp.Load(), l.client.Load()))
	}
	for _, p := range l.parked {
		select {
		case <-p.ended:
			p.nc.Close()
		case <-timeout:
			p.nc.Close()
			return errors.Join(err, fmt.Errorf("a connection parked at %q was not closed within 30s of the server's end", p.step))
		}
	}
	return err
}

// abandon stops the activities of a failed run without waiting for the
// server's end: the loops finish their current request, parked
// connections are closed here.
func (l *lifecycleServer) abandon() {
	if l.halt == nil {
		return
	}
	close(l.halt)
	l.halt = nil
	for _, p := range l.parked {
		p.nc.Close()
	}
	done := make(chan struct{})
	go func() { l.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
	}
}

func (l *lifecycleServer) Kill() error {
	return l.end(l.killableServer.Kill)
}

// Stop is a SIGTERM (killed killAfter into it if killAfter > 0). A clean
// stop must leave the cache set marked clean in its superblock.
func (l *lifecycleServer) Stop(ctx context.Context, killAfter time.Duration) (bool, error) {
	var clean bool
	t0 := time.Now()
	err := l.end(func() error {
		var err error
		clean, err = l.killableServer.Stop(ctx, killAfter)
		return err
	})
	took := time.Since(t0)
	if err != nil || !clean {
		return clean, err
	}
	dev, err := device.OpenFile(l.cachePath, device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		return clean, err
	}
	defer dev.Close()
	sb, err := cache.ReadSuperblock(dev)
	if err != nil {
		return clean, fmt.Errorf("superblock after a clean stop: %w", err)
	}
	if !sb.Clean {
		return clean, fmt.Errorf("tiercache exited 0 after SIGTERM but the cache set is not marked clean\n%s", l.log)
	}
	l.mu.Lock()
	l.cleanMarked++
	l.longestClean = max(l.longestClean, took)
	l.lastStopClean = true
	l.mu.Unlock()
	return clean, nil
}

// summary is one line of what the case did besides the workload.
func (l *lifecycleServer) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	keys := func(m map[string]int) string {
		var s []string
		for k, v := range m {
			s = append(s, fmt.Sprintf("%s %d", k, v))
		}
		sort.Strings(s)
		return strings.Join(s, ", ")
	}
	return fmt.Sprintf("admin: %d flushes and %d checks completed, %d cut by the server's end; ended during: {%s}; "+
		"nbdinfo: %d negotiated, %d cut; 6 connections parked in the handshake at every end; "+
		"aimed start-up kills: {%s}; clean stops with the set marked clean: %d (longest %v), restarts after them recovering dirty blocks: %d of %d",
		l.flushOK, l.checkOK, l.adminCut, keys(l.endedDuring), l.clientsOK, l.clientsCut, keys(l.startKills),
		l.cleanMarked, l.longestClean.Round(time.Millisecond), l.dirtyAfterStop, l.startsAfterStop)
}

// TestStopDuringAdminFlush sends SIGTERM while `tiercache flush` writes
// back tens of MiB of dirty data to a slow (hdd: model) backing device.
// The flush must end at once with "the server is shutting down" (before,
// the shutdown waited 5 s for it, then cut its connection, "unexpected
// EOF", and closed the cache set and its devices under it: the flush went
// on writing back to closed devices), the server must exit 0 with the
// set marked clean and the rest of the dirty data kept in the cache, and
// every write must be there after the restart (fio verify).
func TestStopDuringAdminFlush(t *testing.T) {
	need(t, "fio")
	dir := t.TempDir()
	back := sparseFile(t, dir, "back.img", 2<<30)
	cachePath := sparseFile(t, dir, "cache.img", 256*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol=hdd:"+back, "--bucket-size", "1M")
	dd := filepath.Join(dir, "data")
	s := startServer(t, "--cache", cachePath, "--data-dir", dd)
	adminSock := filepath.Join(dd, "admin.sock")
	ac := adminClient(t, adminSock)
	// Background writeback held back, so that the data stays dirty.
	if _, err := ac.SetSettings(context.Background(), "vol", map[string]string{"writeback_rate_max": "4K"}); err != nil {
		t.Fatal(err)
	}
	// 40 MiB of random 4 KiB writes over 2 GiB: the model's seeks make
	// the writeback take seconds.
	job := []string{"--name=dirty", "--ioengine=nbd", "--uri=" + s.uri("vol"), "--rw=randwrite", "--bs=4k",
		"--size=2g", "--io_size=40m", "--iodepth=16", "--randseed=11",
		"--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"}
	checkFio(t, run(t, 5*time.Minute, "fio", append(job, "--do_verify=0")...))

	flush, out, flushed := background(t, bin, "flush", "vol", "--admin", adminSock)
	defer flush.Process.Kill()
	waitFor(t, time.Minute, func() bool { return strings.Count(out.String(), "flush vol [") >= 2 }, "the flush's progress")
	t0 := time.Now()
	s.stop() // SIGTERM; requires exit status 0
	took := time.Since(t0)
	var ferr error
	select {
	case ferr = <-flushed:
	case <-time.After(30 * time.Second):
		t.Fatalf("tiercache flush still running 30s after the server stopped:\n%s", out)
	}
	log := s.log.String()
	t.Logf("server stopped %v after SIGTERM; tiercache flush: %v\n%s", took.Round(time.Millisecond), ferr, strings.TrimSpace(out.String()))
	if ferr == nil {
		t.Fatalf("the flush completed before the shutdown reached it: the test proves nothing (make its data larger)\n%s", out)
	}
	if !strings.Contains(out.String(), "shutting down") {
		t.Errorf("tiercache flush did not say the server is shutting down:\n%s", out)
	}
	if i := strings.Index(log, "stopped cleanly"); i < 0 || strings.Contains(log[i:], "level=ERROR") || strings.Contains(log, "device: closed") {
		t.Errorf("errors after the stop (something ran on after the cache set closed):\n%s", log)
	}
	dev, err := device.OpenFile(cachePath, device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cache.ReadSuperblock(dev)
	dev.Close()
	if err != nil || !sb.Clean {
		t.Fatalf("cache set not marked clean after the stop: %v", err)
	}

	s2 := startServer(t, "--cache", cachePath, "--data-dir", dd)
	// serve binds its listeners before it opens the cache set: the
	// recovery's log line may come after the socket answers.
	waitFor(t, time.Minute, func() bool { return dirtyRE.MatchString(s2.log.String()) }, "the restart's cache set open line")
	m := dirtyRE.FindStringSubmatch(s2.log.String())
	if m[1] == "0" {
		t.Fatalf("restart found no dirty data: the stop wrote everything back or lost it\n%s", s2.log)
	}
	job[2] = "--uri=" + s2.uri("vol")
	checkFio(t, run(t, 5*time.Minute, "fio", append(job, "--verify_only=1")...))
	t.Logf("after the restart: %s dirty blocks recovered, every write verified", m[1])
}
