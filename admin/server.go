package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/internal/names"
	"github.com/tiercache/tiercache/nbd"
)

// ExportControl is the part of the NBD server that attach and detach need.
type ExportControl interface {
	// CloseExport withdraws the export and ends its connections after
	// their requests in flight (nbd.Server.CloseExport).
	CloseExport(ctx context.Context, name string) (int, error)
	AddExport(e nbd.Export) error
}

// Export is one served export as the admin API sees it.
type Export struct {
	nbd.Export        // as given to the NBD server (Backend possibly wrapped by Metrics)
	Path       string // the device file: the backing device of a volume, or a plain export's device
}

// Config describes what the server serves.
type Config struct {
	// RemoteLink returns the link state of an export's remote backing
	// device, nil for a local one; nil: no export has one.
	RemoteLink func(export string) *RemoteLink
	// ObjectStore returns the image of an export's object-store backing
	// device, nil for another device; nil: no export has one.
	ObjectStore func(export string) *ObjectStore
	Version     string
	Set         *cache.Set // nil when only plain exports are served
	CachePath   string
	MirrorPath  string // a mirrored set's second cache device
	Exports     []Export
	NBD         ExportControl
	Metrics     *Metrics // nil: no /metrics and no latency
	Logger      *slog.Logger
	// ReplaceMember opens the device at path, brings it into the
	// degraded mirrored set as its failed member while the set serves
	// (cache.Set.ReplaceMirrorMember, progress reported to fn) and
	// returns the member replaced ("A" or "B") and the device's path. The
	// serve command supplies it; nil refuses replace.
	ReplaceMember func(ctx context.Context, req ReplaceRequest, fn func(cache.ResilverProgress)) (member, path string, err error)
	// Release forgets the cache set's claim on a backing device during
	// detach (before the superblock drops it); nil uses backingid.Release.
	Release func(path string) error
	// Attach opens the backing device of req, checks that it belongs to no
	// other cache set (unless req.Force), claims it and adds it to Set
	// (cache.Set.Attach). It returns the new volume and the device's path.
	// The serve command supplies it; nil refuses attach.
	Attach func(req AttachRequest) (*cache.Volume, string, error)
	// Detached, if set, is called after a volume left the set (the serve
	// command closes its backing device there).
	Detached func(name string)
	// ReadOnly: exports are served read-only (attached ones too).
	ReadOnly bool
	// Listeners are the NBD server's addresses and Admin this API's
	// (unix:PATH, tcp:HOST:PORT), as /v1/status reports them.
	Listeners, Admin []string
	// Access decides who may use the API (access.go); the http.Server
	// must set ConnContext.
	Access Access
}

// Server implements the admin API. Create it with New, serve Handler, and
// Close it when the NBD server stops.
type Server struct {
	cfg     Config
	log     *slog.Logger
	started time.Time
	stop    chan struct{}
	wg      sync.WaitGroup

	// Requests in progress, so that Close can wait for them: the serve
	// command closes the cache set right after, and a flush, check or
	// detach still running would call into the closed set and write to
	// closed devices. base is cancelled by Shutdown.
	base       context.Context
	cancelBase context.CancelCauseFunc
	reqs       struct {
		sync.Mutex           // guards the fields below
		active     int       // requests in progress
		closing    bool      // Shutdown was called: new requests are refused
		idle       sync.Cond // signalled when active drops to 0
	}

	mu struct {
		sync.Mutex                   // guards the fields below
		exports    []Export          // served now (cfg.Exports, then attach/detach)
		detached   map[string]bool   // detached since start (for messages)
		busy       map[string]string // export -> operation running (flush, detach)
		rate       map[string]*rateSample
		// paths of the mirrored set's members A (the cache device) and
		// B (cfg.CachePath, cfg.MirrorPath until a replace)
		paths [2]string
		// resilvering: the path of the device a replace running brings in
		resilvering string
	}
}

// rateSample tracks an export's writeback rate.
type rateSample struct {
	at    time.Time
	bytes uint64
	rate  float64 // bytes/s, exponentially smoothed
}

// New returns the admin server for cfg and starts its rate sampler.
func New(cfg Config) *Server {
	s := &Server{cfg: cfg, log: cfg.Logger, started: time.Now(), stop: make(chan struct{})}
	s.base, s.cancelBase = context.WithCancelCause(context.Background())
	s.reqs.idle.L = &s.reqs.Mutex
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.cfg.Release == nil {
		s.cfg.Release = backingid.Release
	}
	s.mu.exports = append([]Export(nil), cfg.Exports...)
	s.mu.detached = map[string]bool{}
	s.mu.busy = map[string]string{}
	s.mu.rate = map[string]*rateSample{}
	s.mu.paths = [2]string{cfg.CachePath, cfg.MirrorPath}
	if cfg.Metrics != nil {
		cfg.Metrics.reg.MustRegister(statsCollector{s})
	}
	s.wg.Add(1)
	go s.sampleLoop()
	return s
}

// ErrShuttingDown is the cause given to requests cut short by Shutdown.
var ErrShuttingDown = errors.New("the server is shutting down")

// Shutdown refuses new requests (503) and cancels the context of those in
// progress: a flush or a check ends early with ErrShuttingDown as the
// cause (what it did stays done: writeback is crash-safe at any point); a
// detach, which must not stop half-way, runs on to its end. Call it when
// the server starts to stop, before Close.
func (s *Server) Shutdown() {
	s.reqs.Lock()
	s.reqs.closing = true
	s.reqs.Unlock()
	s.cancelBase(ErrShuttingDown)
}

// Close stops the rate sampler and waits until every request in progress
// has ended (after Shutdown, so that none starts meanwhile); the cache set
// may be closed after it returns.
func (s *Server) Close() {
	s.Shutdown()
	close(s.stop)
	s.wg.Wait()
	s.reqs.Lock()
	for s.reqs.active > 0 {
		s.reqs.idle.Wait()
	}
	s.reqs.Unlock()
}

// track counts a request in progress for Close, refuses it after
// Shutdown, and gives it a context that Shutdown cancels.
func (s *Server) track(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.reqs.Lock()
		if s.reqs.closing {
			s.reqs.Unlock()
			writeError(w, http.StatusServiceUnavailable, "", ErrShuttingDown.Error())
			return
		}
		s.reqs.active++
		s.reqs.Unlock()
		defer func() {
			s.reqs.Lock()
			s.reqs.active--
			if s.reqs.active == 0 {
				s.reqs.idle.Broadcast()
			}
			s.reqs.Unlock()
		}()
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		stop := context.AfterFunc(s.base, func() { cancel(context.Cause(s.base)) })
		defer stop()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// interrupted names the cause of a context error: ErrShuttingDown for a
// request cut short by Shutdown.
func interrupted(ctx context.Context, err error) error {
	if c := context.Cause(ctx); err != nil && c != nil && errors.Is(err, ctx.Err()) && !errors.Is(err, c) {
		return fmt.Errorf("%w: %w", err, c)
	}
	return err
}

func (s *Server) sampleLoop() {
	defer s.wg.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			s.sample()
		}
	}
}

// sample updates the writeback rates.
func (s *Server) sample() {
	if s.cfg.Set == nil {
		return
	}
	now := time.Now()
	for _, v := range s.cfg.Set.Volumes() {
		wb := v.Stats().WritebackBytes
		s.mu.Lock()
		r := s.mu.rate[v.Name()]
		if r == nil {
			s.mu.rate[v.Name()] = &rateSample{at: now, bytes: wb}
		} else if dt := now.Sub(r.at).Seconds(); dt > 0 {
			cur := float64(wb-r.bytes) / dt
			r.rate = 0.5*r.rate + 0.5*cur
			r.at, r.bytes = now, wb
		}
		s.mu.Unlock()
	}
}

// Handler returns the API's routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", s.handleStatus)
	mux.HandleFunc("GET /v1/usage", s.handleUsage)
	mux.HandleFunc("GET /v1/stats", s.handleStats)
	mux.HandleFunc("GET /v1/exports/{name}/settings", s.handleGetSettings)
	mux.HandleFunc("PUT /v1/exports/{name}/settings", s.handlePutSettings)
	mux.HandleFunc("POST /v1/exports/{name}/flush", s.handleFlush)
	mux.HandleFunc("POST /v1/exports/{name}/detach", s.handleDetach)
	mux.HandleFunc("POST /v1/attach", s.handleAttach)
	mux.HandleFunc("POST /v1/check", s.handleCheck)
	mux.HandleFunc("POST /v1/lost-writes/ack", s.handleAckLostWrites)
	mux.HandleFunc("POST /v1/mirror/replace", s.handleReplace)
	mux.HandleFunc("POST /v1/mirror/resilver-rate", s.handleResilverRate)
	if s.cfg.Metrics != nil {
		mux.Handle("GET /metrics", s.cfg.Metrics.Handler())
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "", fmt.Sprintf("no such API endpoint: %s %s", r.Method, r.URL.Path))
	})
	return s.track(s.authorize(mux))
}

// MaxBodyBytes is the largest request body the API reads.
const MaxBodyBytes = 1 << 20

// decodeBody decodes the request body, one JSON value, into v. It answers
// 413 for a body over MaxBodyBytes and 400 for anything but exactly one
// JSON value (want describes it), unknown fields too when strict, and
// returns false after answering.
func decodeBody(w http.ResponseWriter, r *http.Request, v any, want string, strict bool) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if strict {
		dec.DisallowUnknownFields()
	}
	err := dec.Decode(v)
	if err == nil {
		// Anything after the value but white space is refused: a
		// concatenated second object or junk means the client sent
		// something else than it thinks.
		if _, terr := dec.Token(); terr != io.EOF {
			err = errors.New("trailing data after the JSON value")
			if terr != nil && !isSyntax(terr) {
				err = terr
			}
		}
	}
	if err == nil {
		return true
	}
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		writeError(w, http.StatusRequestEntityTooLarge, "", fmt.Sprintf("request body larger than %d bytes (1 MiB); want %s", MaxBodyBytes, want))
		return false
	}
	writeError(w, http.StatusBadRequest, "", fmt.Sprintf("request body: want %s: %v", want, err))
	return false
}

func isSyntax(err error) bool {
	_, ok := errors.AsType[*json.SyntaxError](err)
	return ok
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, key, msg string) {
	writeJSON(w, status, ErrorReply{Error: msg, Key: key})
}

// export finds a served export.
func (s *Server) export(w http.ResponseWriter, name string) (*Export, bool) {
	s.mu.Lock()
	det := s.mu.detached[name]
	for i := range s.mu.exports {
		if s.mu.exports[i].Name == name {
			e := s.mu.exports[i]
			s.mu.Unlock()
			return &e, true
		}
	}
	s.mu.Unlock()
	msg := fmt.Sprintf("no export named %q (exports: %s)", name, s.exportNames())
	if det {
		msg = fmt.Sprintf("export %q was detached (exports: %s)", name, s.exportNames())
	}
	writeError(w, http.StatusNotFound, "", msg)
	return nil, false
}

// exportList returns a copy of the served exports.
func (s *Server) exportList() []Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Export(nil), s.mu.exports...)
}

func (s *Server) exportNames() string {
	var names []string
	for _, e := range s.exportList() {
		names = append(names, e.Name)
	}
	if len(names) == 0 {
		return "none"
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// volume returns the cache volume behind an export, or nil for a plain one.
func (s *Server) volume(name string) *cache.Volume {
	if s.cfg.Set == nil {
		return nil
	}
	v, _ := s.cfg.Set.Volume(name)
	return v
}

// lostWrites describes the set's unacknowledged lost writes, one line per
// volume and failover, and why they could not be recorded ("" if they were).
func (s *Server) lostWrites() ([]string, string) {
	evs, werr := s.cfg.Set.LostWrites()
	var lines []string
	for _, ev := range evs {
		lines = append(lines, cache.DescribeLostEvent(ev)...)
	}
	if werr != nil {
		return lines, werr.Error()
	}
	return lines, ""
}

func (s *Server) status() Status {
	st := Status{Version: s.cfg.Version, PID: os.Getpid(), Started: s.started, UptimeSeconds: time.Since(s.started).Seconds(),
		Listeners: s.cfg.Listeners, Admin: s.cfg.Admin}
	if s.cfg.Set != nil {
		sb := s.cfg.Set.Superblock()
		ss := s.cfg.Set.Stats()
		paths := s.memberPaths()
		st.Set = &SetInfo{UUID: fmtUUID(sb.SetUUID), CachePath: paths[0], CacheSize: sb.NBuckets * sb.BucketSize,
			DeviceSize: deviceSize(paths[0]), BucketSize: sb.BucketSize, Buckets: sb.NBuckets, State: "ok",
			CachedBytes: ss.CachedBlocks * blockBytes, DirtyBytes: ss.DirtyBlocks * blockBytes}
		if m := ss.Mirror; m != nil {
			mi := &MirrorInfo{Path: paths[1], State: "ok", Failed: m.Failed, Slots: m.Slots, SlotsUsed: m.SlotsUsed,
				Reads: m.Reads, ReadRetries: m.ReadRetries, Repairs: m.Repairs, WritethroughBytes: m.WritethroughBlocks * blockBytes}
			if m.Degraded {
				mi.State, st.Set.State = "degraded", "degraded"
			}
			mi.Resilver = resilverInfo(m.Resilver, s.resilveringPath())
			if mi.Path == "" && mi.Resilver != nil && mi.Resilver.Member == "B" {
				mi.Path = mi.Resilver.Path // an attach running
			}
			st.Set.Mirror = mi
		}
		if ss.Failed {
			st.Set.State, st.Set.FailCause = "failed", ss.Cause
		}
		st.Set.LostWrites, st.Set.LostWritesUnrecorded = s.lostWrites()
	}
	for _, e := range s.exportList() {
		st.Exports = append(st.Exports, s.exportInfo(e))
	}
	return st
}

func (s *Server) exportInfo(e Export) ExportInfo {
	ei := ExportInfo{Name: e.Name, Path: e.Path, Size: e.Backend.Size(), Mode: "plain"}
	if v := s.volume(e.Name); v != nil {
		vs := v.Stats()
		ei.Cached, ei.Mode = true, v.Mode().String()
		ei.CachedBytes, ei.DirtyBytes, ei.HitRatio = vs.CachedBlocks*blockBytes, vs.DirtyBlocks*blockBytes, hitRatio(vs)
		ei.Consistency = consistency(v, vs)
	}
	if s.cfg.RemoteLink != nil {
		ei.Remote = s.cfg.RemoteLink(e.Name)
	}
	if s.cfg.ObjectStore != nil {
		ei.ObjectStore = s.cfg.ObjectStore(e.Name)
	}
	return ei
}

func consistency(v *cache.Volume, vs cache.VolumeStats) Consistency {
	c := Consistency{WritebackOrder: v.Settings().WritebackOrder.String(), BackingConsistent: vs.BackingConsistent, CatchingUp: vs.CatchingUp}
	if !vs.InconsistentSince.IsZero() {
		t := vs.InconsistentSince
		c.InconsistentSince = &t
	}
	return c
}

func hitRatio(vs cache.VolumeStats) float64 {
	if r := vs.ReadHitBytes + vs.ReadMissBytes; r > 0 {
		return float64(vs.ReadHitBytes) / float64(r)
	}
	return 0
}

// deviceSize is the size of the file or block device at path (a device
// spec such as ssd:PATH names its file after the colon); 0 if unknown.
func deviceSize(path string) int64 {
	if i := strings.IndexByte(path, ':'); i > 0 && !strings.Contains(path[:i], "/") {
		path = path[i+1:]
	}
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0
	}
	return n
}

func (s *Server) handleStatus(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.status())
}

// allocated is the space a file takes on its file system (sparse files
// take less than their size); for block devices it is the size.
func allocated(path string, size int64) int64 {
	fi, err := os.Stat(path)
	if err != nil || !fi.Mode().IsRegular() {
		return size
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return min(st.Blocks*512, size)
	}
	return size
}

func (s *Server) usage() Usage {
	var u Usage
	if s.cfg.Set != nil {
		sb := s.cfg.Set.Superblock()
		ss := s.cfg.Set.Stats()
		u.Cache = &CacheUsage{Path: s.memberPaths()[0], Size: sb.NBuckets * sb.BucketSize, Buckets: ss.Buckets, FreeBuckets: ss.FreeBuckets, EmptyBuckets: ss.EmptyBuckets,
			UsedBytes: (ss.Buckets - ss.FreeBuckets) * sb.BucketSize, CachedBytes: ss.CachedBlocks * blockBytes, DirtyBytes: ss.DirtyBlocks * blockBytes,
			Failed: ss.Failed, FailCause: ss.Cause, UnreachableDirtyBytes: ss.UnreachableDirtyBlocks * blockBytes}
	}
	for _, ei := range s.status().Exports {
		eu := ExportUsage{Name: ei.Name, Path: ei.Path, Mode: ei.Mode, Size: ei.Size, Used: allocated(ei.Path, ei.Size), ObjectStore: ei.ObjectStore}
		if ei.ObjectStore != nil {
			eu.Used = ei.ObjectStore.StoredBytes
		}
		if v := s.volume(ei.Name); v != nil {
			vs := v.Stats()
			eu.Cached, eu.Dirty = vs.CachedBlocks*blockBytes, vs.DirtyBlocks*blockBytes
			eu.PendingWriteback = eu.Dirty
			eu.Consistency = consistency(v, vs)
			eu.UnreachableDirty, eu.LostWrites = vs.UnreachableDirtyBlocks*blockBytes, vs.LostWriteBlocks*blockBytes
			if eu.UnreachableDirty > 0 {
				eu.PendingWriteback = 0 // nothing can write it back
			}
		}
		u.Exports = append(u.Exports, eu)
	}
	return u
}

func (s *Server) handleUsage(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.usage())
}

func (s *Server) stats() Stats {
	st := Stats{Time: time.Now(), Started: s.started}
	if s.cfg.Set != nil {
		st.Set = &SetStats{s.cfg.Set.Stats()}
	}
	for _, ei := range s.status().Exports {
		es := ExportStats{Name: ei.Name, Mode: ei.Mode, Cached: ei.Cached, Remote: ei.Remote, ObjectStore: ei.ObjectStore}
		if s.cfg.Metrics != nil {
			es.Latency = s.cfg.Metrics.latencyOf(ei.Name)
		}
		if v := s.volume(ei.Name); v != nil {
			vs := v.Stats()
			es.Volume = &VolumeStats{vs}
			es.WritebackOrder = v.Settings().WritebackOrder.String()
			es.HitRatio = hitRatio(vs)
			s.mu.Lock()
			if r := s.mu.rate[ei.Name]; r != nil {
				es.WritebackRate = r.rate
			}
			s.mu.Unlock()
			dirty := float64(vs.DirtyBlocks * blockBytes)
			switch {
			case dirty == 0:
			case es.WritebackRate < blockBytes: // under a block per second: idle
				es.WritebackETASeconds = -1
			default:
				es.WritebackETASeconds = dirty / es.WritebackRate
			}
		}
		st.Exports = append(st.Exports, es)
	}
	return st
}

func (s *Server) handleStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.stats())
}

func settingsMap(st cache.Settings) map[string]string {
	out := map[string]string{}
	for _, k := range cache.SettingKeys {
		if v, ok := st.Get(k); ok {
			out[k] = v
		}
	}
	return out
}

// settingsVolume is the cached volume of the export a settings call names;
// it writes the refusal, and reports false, for an unknown or plain export.
func (s *Server) settingsVolume(w http.ResponseWriter, name string) (*cache.Volume, bool) {
	if _, ok := s.export(w, name); !ok {
		return nil, false
	}
	v := s.volume(name)
	if v == nil {
		writeError(w, http.StatusConflict, "", fmt.Sprintf("export %q is a plain export (no cache): it has no settings", name))
		return nil, false
	}
	return v, true
}

func (s *Server) handleGetSettings(w http.ResponseWriter, r *http.Request) {
	v, ok := s.settingsVolume(w, r.PathValue("name"))
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, settingsMap(v.Settings()))
}

func (s *Server) handlePutSettings(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	v, ok := s.settingsVolume(w, name)
	if !ok {
		return
	}
	var req map[string]string
	if !decodeBody(w, r, &req, `a JSON object of "key": "value" strings`, false) {
		return
	}
	if len(req) == 0 {
		writeError(w, http.StatusBadRequest, "", "no settings given")
		return
	}
	keys := make([]string, 0, len(req))
	for k := range req {
		keys = append(keys, k)
	}
	// Apply in the documented key order, unknown keys last, so that the
	// first error reported does not depend on map order.
	slices.SortFunc(keys, func(a, b string) int {
		ia, ib := slices.Index(cache.SettingKeys, a), slices.Index(cache.SettingKeys, b)
		if ia < 0 {
			ia = len(cache.SettingKeys)
		}
		if ib < 0 {
			ib = len(cache.SettingKeys)
		}
		if ia != ib {
			return ia - ib
		}
		return cmpString(a, b)
	})
	st := v.Settings()
	for _, k := range keys {
		if err := cache.ParseSetting(&st, k, req[k]); err != nil {
			writeError(w, http.StatusBadRequest, k, fmt.Sprintf("%s=%s: %v", k, req[k], err))
			return
		}
	}
	if err := v.SetSettings(st); err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, cache.ErrInvalid) {
			status = http.StatusBadRequest
		}
		writeError(w, status, "", fmt.Sprintf("export %s: the engine refused the settings: %v", name, err))
		return
	}
	s.log.Info("settings changed", "export", name, "settings", keyValues(req, keys))
	writeJSON(w, http.StatusOK, settingsMap(v.Settings()))
}

// keyValues prints m as "k1=v1 k2=v2" in the order of keys (for logs).
func keyValues(m map[string]string, keys []string) string {
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, " ")
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// streamer writes newline-delimited Progress objects, at most every
// interval except the final one.
type streamer struct {
	w     http.ResponseWriter
	f     http.Flusher
	mu    sync.Mutex
	last  time.Time
	every time.Duration
}

func newStreamer(w http.ResponseWriter) *streamer {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	return &streamer{w: w, f: f, every: 200 * time.Millisecond}
}

func (st *streamer) send(p Progress, force bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !force && time.Since(st.last) < st.every {
		return
	}
	st.last = time.Now()
	b, _ := json.Marshal(p)
	st.w.Write(append(b, '\n'))
	if st.f != nil {
		st.f.Flush()
	}
}

// begin marks name busy with op; it fails if another operation runs. The
// returned function ends the operation (idempotent): call it before the
// final progress line, so that a client that goes on at once finds the
// export free.
func (s *Server) begin(w http.ResponseWriter, name, op string) (func(), bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cur := s.mu.busy[name]; cur != "" {
		writeError(w, http.StatusConflict, "", fmt.Sprintf("export %q: %s already running", name, cur))
		return nil, false
	}
	s.mu.busy[name] = op
	return sync.OnceFunc(func() {
		s.mu.Lock()
		delete(s.mu.busy, name)
		s.mu.Unlock()
	}), true
}

// drainProgress returns a progress callback that reports bytes written
// back out of the dirty bytes at the start, with rate and ETA.
func drainProgress(st *streamer, op, name string) (func(int64), func() Progress) {
	start := time.Now()
	first := int64(-1)
	var last Progress
	var mu sync.Mutex
	cb := func(dirtyBlocks int64) {
		mu.Lock()
		dirty := dirtyBlocks * blockBytes
		if first < 0 {
			first = dirty
		}
		total := max(first, dirty)
		done := max(total-dirty, 0)
		p := Progress{Op: op, Export: name, Done: done, Total: total, DirtyBytes: dirty}
		if el := time.Since(start).Seconds(); el > 0 && done > 0 {
			p.Rate = float64(done) / el
			p.ETASeconds = float64(dirty) / p.Rate
		}
		last = p
		mu.Unlock()
		st.send(p, false)
	}
	return cb, func() Progress { mu.Lock(); defer mu.Unlock(); return last }
}

func (s *Server) handleFlush(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	e, ok := s.export(w, name)
	if !ok {
		return
	}
	end, ok := s.begin(w, name, "flush")
	if !ok {
		return
	}
	defer end()
	st := newStreamer(w)
	v := s.volume(name)
	var err error
	var final Progress
	if v == nil {
		err = e.Backend.Flush()
		final = Progress{Op: "flush", Export: name}
	} else {
		cb, last := drainProgress(st, "flush", name)
		err = interrupted(r.Context(), v.DrainDirty(r.Context(), cb))
		final = last()
	}
	final.Finished = true
	switch {
	case errors.Is(err, ErrShuttingDown):
		final.Error = err.Error()
		s.log.Warn("flush cut short by the shutdown; the rest stays dirty in the cache", "export", name, "written_back", final.Done)
	case err != nil:
		final.Error = err.Error()
		s.log.Error("flush failed", "export", name, "err", err)
	default:
		s.log.Info("flushed", "export", name, "bytes", final.Done)
	}
	end()
	st.send(final, true)
}

func (s *Server) handleDetach(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	e, ok := s.export(w, name)
	if !ok {
		return
	}
	v := s.volume(name)
	if v == nil {
		writeError(w, http.StatusConflict, "", fmt.Sprintf("export %q is a plain export: there is no cache to detach it from", name))
		return
	}
	end, ok := s.begin(w, name, "detach")
	if !ok {
		return
	}
	defer end()
	// Detach runs to completion even if the client goes away: stopping
	// half-way would leave the export withdrawn but still cached.
	ctx := context.WithoutCancel(r.Context())
	// The export is withdrawn and its connections end (after their
	// requests in flight): nothing reaches the volume once it leaves.
	nconns, err := s.cfg.NBD.CloseExport(ctx, name)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "", fmt.Sprintf("detach %s: %v", name, err))
		return
	}
	st := newStreamer(w)
	cb, last := drainProgress(st, "detach", name)
	err = v.Detach(ctx, cache.DetachOptions{Progress: cb, BeforeRemove: func() error {
		if err := s.cfg.Release(e.Path); err != nil {
			return fmt.Errorf("releasing %s: %w", e.Path, err)
		}
		return nil
	}})
	final := last()
	final.Finished = true
	if err != nil {
		final.Error = err.Error() + fmt.Sprintf("; nothing was removed: the export is served again, in mode %s, its dirty data kept in the cache (run detach again once the backing device answers; tiercache set %s cache_mode=... resumes caching)", v.Mode(), name)
		s.log.Error("detach failed; export served again", "export", name, "mode", v.Mode().String(), "err", err)
		if aerr := s.cfg.NBD.AddExport(e.Export); aerr != nil {
			s.log.Error("re-adding export", "export", name, "err", aerr)
		}
	} else {
		s.mu.Lock()
		s.mu.exports = slices.DeleteFunc(s.mu.exports, func(x Export) bool { return x.Name == name })
		s.mu.detached[name] = true
		delete(s.mu.rate, name)
		s.mu.Unlock()
		if s.cfg.Metrics != nil {
			s.cfg.Metrics.Forget(name)
		}
		if s.cfg.Detached != nil {
			s.cfg.Detached(name)
		}
		final.Message = fmt.Sprintf("%s is detached: %s is complete and can be used alone", name, e.Path)
		s.log.Info("detached", "export", name, "backing", e.Path, "connections_closed", nconns)
	}
	end()
	st.send(final, true)
}

// attachStatus maps an attach error to an HTTP status.
func attachStatus(err error) int {
	switch {
	case errors.Is(err, cache.ErrExists), errors.Is(err, backingid.ErrAttachedElsewhere):
		return http.StatusConflict
	case errors.Is(err, cache.ErrInvalid), errors.Is(err, os.ErrNotExist), errors.Is(err, os.ErrPermission):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func (s *Server) handleAttach(w http.ResponseWriter, r *http.Request) {
	var req AttachRequest
	if !decodeBody(w, r, &req, `{"name": ..., "path": ..., "mode": ..., "force": ...}`, true) {
		return
	}
	switch {
	case s.cfg.Set == nil:
		writeError(w, http.StatusConflict, "", "this server serves no cache set: there is nothing to attach to (serve one with --cache)")
		return
	case s.cfg.Attach == nil:
		writeError(w, http.StatusNotImplemented, "", "this server cannot attach backing devices")
		return
	case s.cfg.ReadOnly:
		writeError(w, http.StatusConflict, "", "the server runs with --read-only: attach needs a writable backing device")
		return
	case req.Name == "" || req.Path == "":
		writeError(w, http.StatusBadRequest, "", "attach needs a name and a path (NAME=PATH)")
		return
	}
	if err := names.Check(req.Name); err != nil {
		writeError(w, http.StatusBadRequest, "name", fmt.Sprintf("attach: %v", err))
		return
	}
	if req.Mode == "" {
		req.Mode = cache.Writeback.String()
	}
	mode, err := cache.ParseMode(req.Mode)
	if err != nil {
		writeError(w, http.StatusBadRequest, "mode", fmt.Sprintf("--mode %s: %v", req.Mode, err))
		return
	}
	if _, exists := s.findExport(req.Name); exists {
		writeError(w, http.StatusConflict, "", fmt.Sprintf("an export named %q exists already (exports: %s)", req.Name, s.exportNames()))
		return
	}
	end, ok := s.begin(w, req.Name, "attach")
	if !ok {
		return
	}
	defer end()
	v, path, err := s.cfg.Attach(req)
	if err != nil {
		writeError(w, attachStatus(err), "", err.Error()) // Config.Attach names the attach
		return
	}
	var backend nbd.Backend = v
	if s.cfg.Metrics != nil {
		backend = s.cfg.Metrics.Wrap(req.Name, v)
	}
	x := Export{Export: nbd.Export{Name: req.Name, Description: fmt.Sprintf("tiercache volume %s (%s)", req.Name, mode),
		Backend: backend, ReadOnly: s.cfg.ReadOnly}, Path: path}
	if err := s.cfg.NBD.AddExport(x.Export); err != nil {
		// Not exportable (the NBD server's name rules): take it out again.
		derr := v.Detach(context.WithoutCancel(r.Context()), cache.DetachOptions{BeforeRemove: func() error { return s.cfg.Release(path) }})
		if derr == nil && s.cfg.Detached != nil {
			s.cfg.Detached(req.Name)
		}
		writeError(w, http.StatusBadRequest, "", fmt.Sprintf("attach %s: %v (detached again: %v)", req.Name, err, derr))
		return
	}
	s.mu.Lock()
	s.mu.exports = append(s.mu.exports, x)
	delete(s.mu.detached, req.Name)
	s.mu.Unlock()
	s.log.Info("attached", "export", req.Name, "backing", path, "size", v.Size(), "mode", mode.String())
	writeJSON(w, http.StatusOK, s.exportInfo(x))
}

// findExport returns the served export of that name.
func (s *Server) findExport(name string) (Export, bool) {
	for _, e := range s.exportList() {
		if e.Name == name {
			return e, true
		}
	}
	return Export{}, false
}

func (s *Server) handleAckLostWrites(w http.ResponseWriter, r *http.Request) {
	var req LostWritesAck
	if !decodeBody(w, r, &req, `{"ids": [N, ...]}`, true) {
		return
	}
	switch {
	case s.cfg.Set == nil:
		writeError(w, http.StatusConflict, "", "this server serves no cache set: there are no lost writes to acknowledge")
		return
	case len(req.IDs) == 0:
		writeError(w, http.StatusBadRequest, "ids", "name each failover to acknowledge by its number (there is no 'all')")
		return
	}
	evs, err := s.cfg.Set.AckLostWrites(req.IDs)
	if err != nil {
		var lines []string
		for _, ev := range evs {
			lines = append(lines, fmt.Sprint(ev.ID))
		}
		msg := err.Error()
		if errors.Is(err, cache.ErrNoSuchLostEvent) {
			msg = fmt.Sprintf("%v; the record lists failover(s) %s: nothing was acknowledged", err, joinOr(lines, "none"))
		}
		writeError(w, http.StatusConflict, "ids", msg)
		return
	}
	rep := LostWritesReply{LostWrites: []string{}}
	for _, ev := range evs {
		rep.LostWrites = append(rep.LostWrites, cache.DescribeLostEvent(ev)...)
	}
	s.log.Warn("lost writes acknowledged by the operator", "failovers", req.IDs)
	writeJSON(w, http.StatusOK, rep)
}

func joinOr(s []string, none string) string {
	if len(s) == 0 {
		return none
	}
	return strings.Join(s, ", ")
}

func (s *Server) handleCheck(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Set == nil {
		writeError(w, http.StatusConflict, "", "this server serves no cache set: nothing to check")
		return
	}
	st := newStreamer(w)
	final := Progress{Op: "check", Finished: true}
	if err := s.cfg.Set.Check(); err != nil {
		final.Problems = append(final.Problems, "index: "+err.Error())
	}
	lost, unrec := s.lostWrites()
	final.Problems = append(final.Problems, lost...)
	if unrec != "" {
		final.Problems = append(final.Problems, "the lost writes above could not be recorded on the cache device: "+unrec)
	}
	start := time.Now()
	rep, err := s.cfg.Set.Scrub(r.Context(), func(done, total int64) {
		p := Progress{Op: "check", Done: done, Total: total}
		if el := time.Since(start).Seconds(); el > 0 && done > 0 {
			p.Rate = float64(done) / el
			p.ETASeconds = float64(total-done) / p.Rate
		}
		st.send(p, false)
	})
	final.Done, final.Total = rep.Blocks, rep.Blocks
	final.Problems = append(final.Problems, rep.Problems...)
	if n := rep.ProblemsTotal - int64(len(rep.Problems)); n > 0 {
		final.Problems = append(final.Problems, fmt.Sprintf("... and %d more", n))
	}
	if err != nil {
		final.Error = interrupted(r.Context(), err).Error()
	}
	final.Message = fmt.Sprintf("%d cached blocks verified (%d dirty), %d bad", rep.Blocks, rep.DirtyBlocks, rep.Bad)
	if rep.Repaired > 0 {
		final.Message += fmt.Sprintf(", %d repaired from the mirror's other copy", rep.Repaired)
	}
	s.log.Info("check", "blocks", rep.Blocks, "bad", rep.Bad, "problems", len(final.Problems))
	st.send(final, true)
}

// fmtUUID prints a 16-byte UUID in its canonical form.
func fmtUUID(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
