package nbd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// Export is one named block device offered by a Server.
type Export struct {
	Name        string
	Description string
	Backend     Backend
	ReadOnly    bool

	// Block size constraints advertised with NBD_INFO_BLOCK_SIZE and
	// enforced on every request (misaligned or oversized requests fail
	// with EINVAL). Zero means the default: 1, 4096 and 32 MiB.
	// MinBlockSize must be a power of two <= 64 KiB, PreferredBlockSize a
	// power of two >= max(MinBlockSize, 512), MaxBlockSize a multiple of
	// MinBlockSize, >= PreferredBlockSize and <= 64 MiB.
	MinBlockSize, PreferredBlockSize, MaxBlockSize uint32
}

// Config configures a Server. The zero value is usable.
type Config struct {
	// Logger receives connection and backend error logs. Nil discards.
	Logger *slog.Logger
	// MaxInFlightBytes bounds READ and WRITE payload bytes being processed
	// per connection; the connection stops reading requests while over it.
	// Default 64 MiB.
	MaxInFlightBytes int64
	// MaxWorkers bounds concurrently executing requests per connection.
	// Default 128.
	MaxWorkers int
	// MaxInFlightTotal bounds READ and WRITE payload bytes being processed
	// on all connections together (see budget in sem.go): each connection
	// has a reserve of MaxInFlightTotal / (2 x MaxConnections) that the
	// others cannot take, the other half is shared. Default 256 MiB.
	MaxInFlightTotal int64
	// MaxConnections bounds connections serving an export (all
	// listeners). A client over it is refused at NBD_OPT_GO with
	// NBD_REP_ERR_POLICY and a message saying so (NBD_OPT_EXPORT_NAME:
	// the connection is closed). 0 means unlimited (then there are no
	// reserves: connections share MaxInFlightTotal).
	MaxConnections int
	// MaxHandshakes bounds connections still negotiating; new connections
	// beyond it are closed at once. Default 256.
	MaxHandshakes int
	// MaxOptionLength bounds the data of one handshake option; longer
	// options get NBD_REP_ERR_TOO_BIG (their data is discarded). Default
	// 64 KiB.
	MaxOptionLength uint32
	// HandshakeTimeout bounds the whole option phase of a connection.
	// Default 60 s; negative disables.
	HandshakeTimeout time.Duration
	// DefaultExport is the export that the empty name ("") selects, if no
	// export is named "".
	DefaultExport string
	// TLSConfig enables NBD_OPT_STARTTLS (else it is refused with
	// NBD_REP_ERR_POLICY).
	TLSConfig *tls.Config
	// RequireTLS selects the spec's FORCEDTLS mode: until TLS is up, every
	// option but STARTTLS and ABORT fails with NBD_REP_ERR_TLS_REQD (and
	// NBD_OPT_EXPORT_NAME closes the connection). Without TLSConfig nobody
	// can connect.
	RequireTLS bool
	// OnServing, if set, is called with the number of connections serving
	// an export (past the handshake) each time it changes, in the order of
	// the changes (under the server's lock: it must be quick and must not
	// call the Server).
	OnServing func(n int)
}

// Server serves exports over NBD (fixed newstyle handshake only). It is
// safe for concurrent use; Serve may run on several listeners at once.
type Server struct {
	cfg Config
	log *slog.Logger

	mu struct {
		sync.Mutex // guards the fields below
		exports    map[string]*export
		listeners  map[net.Listener]struct{}
		conns      map[*conn]struct{}
		serving    int // connections holding a MaxConnections slot
		shutdown   bool
	}
	budget  *budget
	reserve int64 // each connection's share of budget held back from the others
	// connWG counts serveConn goroutines. Add is only called under mu
	// while !mu.shutdown, so Shutdown's Wait never races an Add from zero.
	connWG sync.WaitGroup
}

// export is an Export with its defaults applied and its capabilities
// resolved once.
type export struct {
	Export
	trimmer     Trimmer
	zeroWriter  ZeroWriter
	prefetcher  Prefetcher
	asyncReader AsyncReader
	plugger     Plugger   // only with asyncReader
	hitReader   HitReader // only with asyncReader
}

// NewServer returns a Server with cfg's defaults applied.
func NewServer(cfg Config) *Server {
	if cfg.MaxInFlightBytes <= 0 {
		cfg.MaxInFlightBytes = 64 << 20
	}
	if cfg.MaxWorkers <= 0 {
		cfg.MaxWorkers = 128
	}
	if cfg.MaxOptionLength == 0 {
		cfg.MaxOptionLength = 64 << 10
	}
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = 60 * time.Second
	}
	if cfg.MaxInFlightTotal <= 0 {
		cfg.MaxInFlightTotal = 256 << 20
	}
	if cfg.MaxHandshakes <= 0 {
		cfg.MaxHandshakes = 256
	}
	s := &Server{cfg: cfg, log: cfg.Logger}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	pool := cfg.MaxInFlightTotal
	if cfg.MaxConnections > 0 {
		s.reserve = cfg.MaxInFlightTotal / (2 * int64(cfg.MaxConnections))
		pool -= s.reserve * int64(cfg.MaxConnections)
	}
	s.budget = newBudget(pool, min(16<<20, cfg.MaxInFlightTotal/2), s.log)
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	s.mu.exports = make(map[string]*export)
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.conns = make(map[*conn]struct{})
	return s
}

func validString(s string) bool {
	return len(s) <= maxStringLen && utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func isPow2(v uint32) bool { return v != 0 && v&(v-1) == 0 }

// AddExport validates e, applies defaults and makes it available to new
// connections.
func (s *Server) AddExport(e Export) error {
	if e.Backend == nil {
		return fmt.Errorf("nbd: export %q: nil Backend", e.Name)
	}
	if !validString(e.Name) || !validString(e.Description) {
		return fmt.Errorf("nbd: export %q: name or description is not a valid NBD string", e.Name)
	}
	if e.MinBlockSize == 0 {
		e.MinBlockSize = 1
	}
	if e.PreferredBlockSize == 0 {
		e.PreferredBlockSize = max(4096, e.MinBlockSize)
	}
	if e.MaxBlockSize == 0 {
		e.MaxBlockSize = max(defaultMaxBlockSize, e.PreferredBlockSize)
	}
	switch {
	case !isPow2(e.MinBlockSize) || e.MinBlockSize > 64<<10:
		return fmt.Errorf("nbd: export %q: MinBlockSize %d must be a power of two <= 65536", e.Name, e.MinBlockSize)
	case !isPow2(e.PreferredBlockSize) || e.PreferredBlockSize < max(e.MinBlockSize, 512):
		return fmt.Errorf("nbd: export %q: PreferredBlockSize %d must be a power of two >= max(MinBlockSize, 512)", e.Name, e.PreferredBlockSize)
	case e.MaxBlockSize%e.MinBlockSize != 0 || e.MaxBlockSize < e.PreferredBlockSize || e.MaxBlockSize > hardMaxPayload:
		return fmt.Errorf("nbd: export %q: MaxBlockSize %d must be a multiple of MinBlockSize, >= PreferredBlockSize and <= %d", e.Name, e.MaxBlockSize, hardMaxPayload)
	}
	size := e.Backend.Size()
	if size < 0 || size%int64(e.MinBlockSize) != 0 {
		return fmt.Errorf("nbd: export %q: size %d is not a multiple of MinBlockSize %d", e.Name, size, e.MinBlockSize)
	}
	x := &export{Export: e}
	x.trimmer, _ = e.Backend.(Trimmer)
	x.zeroWriter, _ = e.Backend.(ZeroWriter)
	x.prefetcher, _ = e.Backend.(Prefetcher)
	x.asyncReader, _ = e.Backend.(AsyncReader)
	if x.asyncReader != nil {
		x.plugger, _ = e.Backend.(Plugger)
		x.hitReader, _ = e.Backend.(HitReader)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.mu.exports[e.Name]; dup {
		return fmt.Errorf("nbd: export %q already exists", e.Name)
	}
	s.mu.exports[e.Name] = x
	return nil
}

// RemoveExport makes the export unavailable to new connections. Existing
// connections to it keep being served (and flush it on NBD_CMD_DISC);
// Shutdown still flushes it if it had connections.
func (s *Server) RemoveExport(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.mu.exports[name]; !ok {
		return fmt.Errorf("nbd: export %q does not exist", name)
	}
	delete(s.mu.exports, name)
	return nil
}

// CloseExport removes the export, if it is still offered, and ends the
// connections serving it as Shutdown does: requests in flight finish and
// are replied to, requests read later get ESHUTDOWN, then the connection is
// closed. It waits for those connections to end (or ctx) and returns how
// many there were. Connections to other exports are not touched. Detach
// uses it so that nothing reaches a backend after it is taken away; a
// client still in the handshake may yet pick the export up if it looked it
// up before the removal, which is why such backends also refuse I/O once
// detached.
func (s *Server) CloseExport(ctx context.Context, name string) (int, error) {
	s.mu.Lock()
	x := s.mu.exports[name]
	delete(s.mu.exports, name)
	all := make([]*conn, 0, len(s.mu.conns))
	for c := range s.mu.conns {
		all = append(all, c)
	}
	s.mu.Unlock()
	var conns []*conn
	for _, c := range all { // c.mu is not taken under s.mu
		if cx := c.servedExport(); cx != nil && (cx == x || cx.Name == name) {
			conns = append(conns, c)
		}
	}
	for _, c := range conns {
		c.beginShutdown()
	}
	for _, c := range conns {
		select {
		case <-c.done:
		case <-ctx.Done():
			for _, c := range conns {
				c.nc.Close()
			}
			return len(conns), ctx.Err()
		}
	}
	return len(conns), nil
}

// lookup resolves a client-supplied export name.
func (s *Server) lookup(name string) *export {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x, ok := s.mu.exports[name]; ok {
		return x
	}
	if name == "" && s.cfg.DefaultExport != "" {
		return s.mu.exports[s.cfg.DefaultExport]
	}
	return nil
}

// exportList returns the exports sorted by name.
func (s *Server) exportList() []*export {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*export, 0, len(s.mu.exports))
	for _, x := range s.mu.exports {
		out = append(out, x)
	}
	slices.SortFunc(out, func(a, b *export) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Serve accepts connections on l until l fails or Shutdown is called; it
// then returns ErrServerClosed (after Shutdown) or the accept error. Serve
// may be called for several listeners concurrently.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.mu.shutdown {
		s.mu.Unlock()
		l.Close()
		return ErrServerClosed
	}
	s.mu.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.mu.listeners, l)
		s.mu.Unlock()
	}()

	var delay time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			shut := s.mu.shutdown
			s.mu.Unlock()
			if shut {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Anything else (EMFILE, ECONNABORTED, ...) may pass: back
			// off and retry, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.log.Warn("nbd: accept", "err", err, "retry", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		s.startConn(nc)
	}
}

// startConn registers and starts a connection, or closes it when the
// server is shutting down or full.
func (s *Server) startConn(nc net.Conn) {
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	c := newConn(s, nc)
	s.mu.Lock()
	if s.mu.shutdown || len(s.mu.conns)-s.mu.serving >= s.cfg.MaxHandshakes {
		full := !s.mu.shutdown
		s.mu.Unlock()
		if full {
			s.log.Warn("nbd: too many connections in the handshake, closing a new one", "remote", nc.RemoteAddr().String(), "max_handshakes", s.cfg.MaxHandshakes)
		}
		nc.Close()
		return
	}
	s.mu.conns[c] = struct{}{}
	s.connWG.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.connWG.Done()
		defer func() {
			s.mu.Lock()
			delete(s.mu.conns, c)
			if c.slot {
				s.mu.serving--
				s.servingChangedLocked()
			}
			s.mu.Unlock()
			close(c.done)
		}()
		c.serve()
	}()
}

// takeSlot reserves one of MaxConnections for a connection about to serve
// an export; false when all are taken.
func (s *Server) takeSlot() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cfg.MaxConnections > 0 && s.mu.serving >= s.cfg.MaxConnections {
		return false
	}
	s.mu.serving++
	s.servingChangedLocked()
	return true
}

// servingChangedLocked reports the number of connections serving to
// Config.OnServing. REQUIRES: s.mu.
func (s *Server) servingChangedLocked() {
	if s.cfg.OnServing != nil {
		s.cfg.OnServing(s.mu.serving)
	}
}

// refusalFull is the message of a client refused by MaxConnections.
func (s *Server) refusalFull() string {
	return fmt.Sprintf("too many connections: this server serves at most %d at once (--max-connections); try again later", s.cfg.MaxConnections)
}

// Shutdown stops accepting connections, closes connections still in the
// handshake, answers requests received but not started with ESHUTDOWN, lets
// every in-flight request finish and be replied to, closes the connections
// and finally flushes every export's backend. If ctx ends
// first, the connections are closed at once and ctx's error is returned
// (without a flush, since requests may still be running).
func (s *Server) Shutdown(ctx context.Context) error {
	s.budget.stop()
	s.mu.Lock()
	s.mu.shutdown = true
	for l := range s.mu.listeners {
		l.Close()
	}
	conns := make([]*conn, 0, len(s.mu.conns))
	for c := range s.mu.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.beginShutdown()
	}

	done := make(chan struct{})
	go func() {
		s.connWG.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		for _, c := range conns {
			c.nc.Close()
		}
		return ctx.Err()
	}

	// Flush every export, and those that were removed but still had
	// connections.
	xs := s.exportList()
	for _, c := range conns {
		if x := c.servedExport(); x != nil {
			xs = append(xs, x)
		}
	}
	var errs []error
	seen := make(map[Backend]bool)
	for _, x := range xs {
		if seen[x.Backend] {
			continue
		}
		seen[x.Backend] = true
		if err := x.Backend.Flush(); err != nil {
			s.log.Error("nbd: flush at shutdown", "export", x.Name, "err", err)
			errs = append(errs, fmt.Errorf("nbd: flush export %q: %w", x.Name, err))
		}
	}
	return errors.Join(errs...)
}
