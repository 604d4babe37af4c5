package admin

// Prometheus metrics. The table below maps every numeric field of
// cache.VolumeStats and cache.SetStats to a metric; the package's tests
// fail when a field has no line here, so a field added to the engine gets
// a metric (or an explicit reason why not) in this one place.

import (
	"errors"
	"net/http"
	"reflect"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/nbd"
)

// metricDef maps one stats field to a metric.
type metricDef struct {
	name  string // "" with skip: deliberately not a metric
	help  string
	kind  prometheus.ValueType
	scale float64 // multiplies the field (blocks to bytes); 0 means 1
	skip  string  // why the field is not exported (then name is empty)
}

const blockBytes = 4096

var (
	counter = prometheus.CounterValue
	gauge   = prometheus.GaugeValue
)

// volumeMetrics maps cache.VolumeStats fields (label export).
var volumeMetrics = map[string]metricDef{
	"Mode":                   {skip: "exported as tiercache_export_info{mode}"},
	"ReadOps":                {name: "tiercache_read_requests_total", help: "Read requests.", kind: counter},
	"WriteOps":               {name: "tiercache_write_requests_total", help: "Write requests.", kind: counter},
	"FlushOps":               {name: "tiercache_flush_requests_total", help: "Flush requests.", kind: counter},
	"TrimOps":                {name: "tiercache_trim_requests_total", help: "Trim requests.", kind: counter},
	"ZeroOps":                {name: "tiercache_write_zeroes_requests_total", help: "Write-zeroes requests.", kind: counter},
	"ReadBytes":              {name: "tiercache_read_bytes_total", help: "Bytes read by clients.", kind: counter},
	"WriteBytes":             {name: "tiercache_write_bytes_total", help: "Bytes written by clients.", kind: counter},
	"ReadHitBytes":           {name: "tiercache_read_hit_bytes_total", help: "Bytes read from the cache device.", kind: counter},
	"ReadMissBytes":          {name: "tiercache_read_miss_bytes_total", help: "Bytes read from the backing device.", kind: counter},
	"BypassBytes":            {name: "tiercache_bypass_bytes_total", help: "Bytes written straight to the backing device (writearound, none, write-zeroes).", kind: counter},
	"PromoteBytes":           {name: "tiercache_promote_bytes_total", help: "Read misses copied into the cache.", kind: counter},
	"WritebackBytes":         {name: "tiercache_writeback_bytes_total", help: "Dirty bytes written back to the backing device.", kind: counter},
	"ChecksumErrors":         {name: "tiercache_checksum_errors_total", help: "Cached blocks that failed checksum verification.", kind: counter},
	"ChecksumRepairs":        {name: "tiercache_checksum_repairs_total", help: "Cached blocks that failed verification and were served intact: clean ones re-read from the backing device, a mirrored set's from the other copy.", kind: counter},
	"CachedBlocks":           {name: "tiercache_cached_bytes", help: "Bytes of the export held in the cache.", kind: gauge, scale: blockBytes},
	"DirtyBlocks":            {name: "tiercache_dirty_bytes", help: "Bytes held in the cache and not yet written back.", kind: gauge, scale: blockBytes},
	"ReadHitOps":             {name: "tiercache_read_hit_requests_total", help: "Reads served entirely from the cache.", kind: counter},
	"ReadMissOps":            {name: "tiercache_read_miss_requests_total", help: "Reads that needed the backing device.", kind: counter},
	"PromoteOps":             {name: "tiercache_promotions_total", help: "Promotions of read misses (runs of blocks).", kind: counter},
	"BypassSequentialBytes":  {name: "tiercache_bypass_sequential_bytes_total", help: "Bytes that skipped the cache as part of a stream longer than sequential_cutoff.", kind: counter},
	"BypassModeBytes":        {name: "tiercache_bypass_mode_bytes_total", help: "Bytes that skipped the cache because of the cache mode (or write-zeroes).", kind: counter},
	"BypassCongestionBytes":  {name: "tiercache_bypass_congestion_bytes_total", help: "Read misses not promoted because the free bucket reserve was low.", kind: counter},
	"BypassCacheFullBytes":   {name: "tiercache_bypass_cache_full_bytes_total", help: "Writes sent around the cache because no bucket was free in time.", kind: counter},
	"WritebackRate":          {name: "tiercache_writeback_rate_bytes", help: "Background writeback target rate in bytes/s (-1: full speed).", kind: gauge},
	"SupersededBlocks":       {name: "tiercache_superseded_bytes", help: "Older dirty versions kept for epoch-ordered writeback.", kind: gauge, scale: blockBytes},
	"SpaceWaitNanos":         {name: "tiercache_write_space_wait_seconds_total", help: "Time foreground writes waited for a free bucket.", kind: counter, scale: 1e-9},
	"ThrottleNanos":          {name: "tiercache_write_throttle_seconds_total", help: "Time foreground writes were delayed to let writeback catch up.", kind: counter, scale: 1e-9},
	"BypassCacheFailedBytes": {name: "tiercache_bypass_cache_failed_bytes_total", help: "Writes sent to the backing device because the cache device failed a write or failed over.", kind: counter},
	"UnreachableDirtyBlocks": {name: "tiercache_unreachable_dirty_bytes", help: "Dirty bytes left on a failed cache device: reads of them fail.", kind: gauge, scale: blockBytes},
	"LostWriteBlocks":        {name: "tiercache_lost_write_bytes", help: "Bytes of writes acknowledged before the cache device failed and not durable on it: flushes fail.", kind: gauge, scale: blockBytes},
	"UnreachableReadErrors":  {name: "tiercache_unreachable_read_errors_total", help: "Reads failed because their dirty data could not be read from the cache device.", kind: counter},
	"BackingConsistent":      {name: "tiercache_backing_consistent", help: "1 when the export is in epoch order and its backing device alone holds a flushed image (0 in lba order, or degraded until the next full drain).", kind: gauge},
	"WritebackDegrades":      {name: "tiercache_writeback_degrades_total", help: "Times epoch-order writeback fell behind and degraded to lba order.", kind: counter},
	"CatchingUp":             {name: "tiercache_writeback_catching_up", help: "1 while a degraded export catches up with epoch order (writing back everything dirty from before its cut); consistent again when it is done.", kind: gauge},
	"CatchUps":               {name: "tiercache_writeback_catch_ups_total", help: "Catch-ups to epoch order started (a degraded export under constant writes cuts 5 s after the degrade and after the last write stream around the cache).", kind: counter},
	"EpochDeferBytes":        {name: "tiercache_epoch_defer_bytes_total", help: "Writethrough/writearound writes and small write-zeroes cached as dirty data because older flush epochs were still dirty (epoch order).", kind: counter},
	"BackingSyncErrors":      {name: "tiercache_backing_sync_errors_total", help: "Failed syncs of the backing device; after the first, flushes of the export fail.", kind: counter},
	"WritebackFailures":      {name: "tiercache_writeback_failures_total", help: "Background writeback batches that failed (failing or full backing device); retried with backoff.", kind: counter},
	"WritebackFailing":       {name: "tiercache_writeback_failing", help: "1 while background writeback keeps failing and retries with backoff.", kind: gauge},
	"FencedWriteErrors":      {name: "tiercache_fenced_write_errors_total", help: "Writes refused after failover: the failed cache may hold newer durable data for their blocks.", kind: counter},
}

// setMetrics maps cache.SetStats fields (no label).
var setMetrics = map[string]metricDef{
	"Buckets":                {name: "tiercache_set_buckets", help: "Buckets on the cache device.", kind: gauge},
	"FreeBuckets":            {name: "tiercache_set_free_buckets", help: "Free buckets.", kind: gauge},
	"SealedBuckets":          {name: "tiercache_set_sealed_buckets", help: "Full buckets waiting for GC.", kind: gauge},
	"EmptyBuckets":           {name: "tiercache_set_empty_buckets", help: "Sealed buckets no live block points into (freed first by GC, with nothing to write back).", kind: gauge},
	"CachedBlocks":           {name: "tiercache_set_cached_bytes", help: "Bytes cached, all exports.", kind: gauge, scale: blockBytes},
	"DirtyBlocks":            {name: "tiercache_set_dirty_bytes", help: "Dirty bytes, all exports.", kind: gauge, scale: blockBytes},
	"Commits":                {name: "tiercache_set_journal_commits_total", help: "Journal commits (group commits of flushes).", kind: counter},
	"JournalBlocks":          {name: "tiercache_set_journal_blocks_total", help: "Journal blocks written.", kind: counter},
	"Checkpoints":            {name: "tiercache_set_checkpoints_total", help: "Index checkpoints written.", kind: counter},
	"Evictions":              {name: "tiercache_set_gc_evictions_total", help: "Buckets freed by GC (and the empty buckets a detach frees).", kind: counter},
	"WritebackBlocks":        {name: "tiercache_set_writeback_bytes_total", help: "Bytes written back, all exports.", kind: counter, scale: blockBytes},
	"GCMoves":                {name: "tiercache_set_gc_moved_bytes_total", help: "Live dirty bytes copied out of mostly-empty buckets by GC.", kind: counter, scale: blockBytes},
	"CacheErrors":            {name: "tiercache_set_cache_device_errors_total", help: "Failed cache device I/Os.", kind: counter},
	"CacheNoSpaceErrors":     {name: "tiercache_set_cache_device_nospace_total", help: "Cache writes that failed with ENOSPC (the cache file's file system is full) and went around the cache.", kind: counter},
	"Failed":                 {name: "tiercache_set_failed", help: "1 when the cache device failed and every export is served from its backing device.", kind: gauge},
	"Cause":                  {skip: "text; in /v1/stats and the log"},
	"UnreachableDirtyBlocks": {name: "tiercache_set_unreachable_dirty_bytes", help: "Dirty bytes left on a failed cache device, all exports.", kind: gauge, scale: blockBytes},
}

// objectStoreMetrics maps ObjectStore fields (label export), for exports
// with an object-store backing device.
var objectStoreMetrics = map[string]metricDef{
	"Generation":           {name: "tiercache_objstore_generation", help: "Owner generation of the object-store image held by this server.", kind: gauge},
	"Epoch":                {name: "tiercache_objstore_epoch", help: "Newest epoch stored in the object-store image (of the generation tiercache_objstore_epoch_generation).", kind: gauge},
	"EpochGeneration":      {name: "tiercache_objstore_epoch_generation", help: "Owner generation of the newest epoch stored.", kind: gauge},
	"Segments":             {name: "tiercache_objstore_segments", help: "Segment objects of the image the map knows.", kind: gauge},
	"StoredBytes":          {name: "tiercache_objstore_stored_bytes", help: "Bytes of the image's segment objects.", kind: gauge},
	"LiveBytes":            {name: "tiercache_objstore_live_bytes", help: "Bytes of the blocks the image's map refers to.", kind: gauge},
	"SpaceAmplification":   {name: "tiercache_objstore_space_amplification", help: "Stored bytes / live bytes of the image.", kind: gauge},
	"SegmentsPut":          {name: "tiercache_objstore_segments_put_total", help: "Segment objects PUT by writeback.", kind: counter},
	"BytesPut":             {name: "tiercache_objstore_put_bytes_total", help: "Bytes PUT by writeback: segments and checkpoints.", kind: counter},
	"WrittenBytes":         {name: "tiercache_objstore_written_bytes_total", help: "Data bytes the writeback segments carried.", kind: counter},
	"PutAmplification":     {name: "tiercache_objstore_put_amplification", help: "Bytes PUT by writeback per data byte written.", kind: gauge},
	"Checkpoints":          {name: "tiercache_objstore_checkpoints_total", help: "Map checkpoints stored.", kind: counter},
	"Gets":                 {name: "tiercache_objstore_gets_total", help: "Ranged GETs of segment data.", kind: counter},
	"BytesGot":             {name: "tiercache_objstore_get_bytes_total", help: "Bytes of segment data read.", kind: counter},
	"GCRuns":               {name: "tiercache_objstore_gc_runs_total", help: "Garbage-collection rounds.", kind: counter},
	"GCRewrittenBytes":     {name: "tiercache_objstore_gc_rewritten_bytes_total", help: "Live bytes garbage collection copied out of mostly dead segments.", kind: counter},
	"GCBytesPut":           {name: "tiercache_objstore_gc_put_bytes_total", help: "Bytes PUT by garbage collection.", kind: counter},
	"GCDeletedSegments":    {name: "tiercache_objstore_gc_deleted_segments_total", help: "Segment objects garbage collection deleted.", kind: counter},
	"GCDeletedBytes":       {name: "tiercache_objstore_gc_deleted_bytes_total", help: "Bytes of the segment objects garbage collection deleted.", kind: counter},
	"GCWriteAmplification": {name: "tiercache_objstore_gc_write_amplification", help: "(Bytes PUT by writeback + by garbage collection) / bytes PUT by writeback.", kind: gauge},
}

// Request latency buckets: 10 µs to ~10 s, x4.
var latencyBuckets = prometheus.ExponentialBuckets(10e-6, 4, 11)

// Forget drops the latency series of an export that is gone (detached), so
// /metrics does not keep reporting it; an export attached again under the
// name starts from zero.
func (m *Metrics) Forget(export string) {
	for _, v := range []interface {
		DeletePartialMatch(prometheus.Labels) int
	}{m.latency, m.errs, m.reads, m.writes} {
		v.DeletePartialMatch(prometheus.Labels{"export": export})
	}
}

// Metrics owns the Prometheus registry and the latency histograms of the
// instrumented backends.
type Metrics struct {
	reg     *prometheus.Registry
	latency *prometheus.HistogramVec
	errs    *prometheus.CounterVec
	reads   *prometheus.HistogramVec // by tier: cache (hit) or backing (miss)
	writes  *prometheus.HistogramVec // by tier: cache (alone) or backing

	mu   sync.Mutex               // guards inst
	inst map[string]*instrumented // per export, for /v1/stats
}

// NewMetrics returns a registry with the Go runtime and process collectors
// and the request latency histograms.
func NewMetrics() *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tiercache_request_duration_seconds",
		Help:    "Latency of NBD requests as served by the backend, by export and operation.",
		Buckets: latencyBuckets,
	}, []string{"export", "op"})
	m.errs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tiercache_request_errors_total",
		Help: "NBD requests answered with an error, by export and operation.",
	}, []string{"export", "op"})
	m.reads = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tiercache_read_duration_seconds",
		Help:    "Latency of reads by the tier that served them: cache (every block was cached when the read started) or backing.",
		Buckets: latencyBuckets,
	}, []string{"export", "tier"})
	m.writes = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tiercache_write_duration_seconds",
		Help:    "Latency of writes by the tier they went to: cache (the cache device alone: writeback) or backing (writethrough, writearound, none, and writes bypassed around the cache).",
		Buckets: latencyBuckets,
	}, []string{"export", "tier"})
	m.reg.MustRegister(m.latency, m.errs, m.reads, m.writes, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// statsCollector turns the engine's stats into metrics at scrape time.
type statsCollector struct{ s *Server }

func (c statsCollector) Describe(chan<- *prometheus.Desc) {} // unchecked collector

func (c statsCollector) Collect(ch chan<- prometheus.Metric) {
	infoDesc := prometheus.NewDesc("tiercache_export_info", "One per export; labels give the cache mode (plain: no cache).", []string{"export", "mode"}, nil)
	ratioDesc := prometheus.NewDesc("tiercache_read_hit_ratio", "Read hit bytes / read bytes since start.", []string{"export"}, nil)
	rateDesc := prometheus.NewDesc("tiercache_writeback_rate_bytes_per_second", "Writeback rate over the last seconds.", []string{"export"}, nil)
	sinceDesc := prometheus.NewDesc("tiercache_backing_inconsistent_since_seconds", "Unix time epoch order degraded, from when the backing device alone is not consistent until the next full drain (0 while consistent or in lba order).", []string{"export"}, nil)
	upDesc := prometheus.NewDesc("tiercache_uptime_seconds", "Seconds since the server started.", nil, nil)
	ch <- prometheus.MustNewConstMetric(upDesc, gauge, time.Since(c.s.started).Seconds())
	st := c.s.stats()
	for _, e := range st.Exports {
		ch <- prometheus.MustNewConstMetric(infoDesc, gauge, 1, e.Name, e.Mode)
		if e.Volume == nil {
			continue
		}
		emitStruct(ch, volumeMetrics, e.Volume.VolumeStats, e.Name)
		ch <- prometheus.MustNewConstMetric(ratioDesc, gauge, e.HitRatio, e.Name)
		ch <- prometheus.MustNewConstMetric(rateDesc, gauge, e.WritebackRate, e.Name)
		since := 0.0
		if t := e.Volume.InconsistentSince; !t.IsZero() {
			since = float64(t.UnixNano()) / 1e9
		}
		ch <- prometheus.MustNewConstMetric(sinceDesc, gauge, since, e.Name)
	}
	if st.Set != nil {
		emitStruct(ch, setMetrics, st.Set.SetStats, "")
	}
	if c.s.cfg.RemoteLink != nil {
		for _, e := range st.Exports {
			if r := c.s.cfg.RemoteLink(e.Name); r != nil {
				emitRemote(ch, e.Name, r)
			}
		}
	}
	for _, e := range st.Exports {
		if o := e.ObjectStore; o != nil {
			emitStruct(ch, objectStoreMetrics, *o, e.Name)
			fenced := 0.0
			if o.Fenced != "" {
				fenced = 1
			}
			ch <- prometheus.MustNewConstMetric(objFencedDesc, gauge, fenced, e.Name)
		}
	}
}

// Remote backing device link metrics (exports with an NBD URI backing).
var (
	remoteUpDesc         = prometheus.NewDesc("tiercache_remote_link_up", "1 while the export's remote backing device is connected (0: reconnecting, or refused as another export).", []string{"export"}, nil)
	remoteReconnectsDesc = prometheus.NewDesc("tiercache_remote_reconnects_total", "Reconnections to the remote backing device after a lost connection.", []string{"export"}, nil)
	remoteOutagesDesc    = prometheus.NewDesc("tiercache_remote_outages_total", "Times the connection to the remote backing device was lost.", []string{"export"}, nil)
	remoteDownDesc       = prometheus.NewDesc("tiercache_remote_down_seconds_total", "Time the remote backing device was disconnected, the current outage included.", []string{"export"}, nil)
	remoteNotDurableDesc = prometheus.NewDesc("tiercache_remote_not_durable_syncs_total", "Backing syncs refused because a connection ended before a flush covered earlier writes (those were written again).", []string{"export"}, nil)
	remoteTimeoutsDesc   = prometheus.NewDesc("tiercache_remote_request_timeouts_total", "Connections to the remote backing device closed as hung: a request got no reply within the request timeout.", []string{"export"}, nil)
	remoteReplayedDesc   = prometheus.NewDesc("tiercache_remote_replayed_bytes_total", "Bytes of unflushed writes written again on new connections to the remote backing device after outages.", []string{"export"}, nil)
)

var objFencedDesc = prometheus.NewDesc("tiercache_objstore_fenced", "1 when another host took a newer generation of the export's object-store image: this server no longer writes to it.", []string{"export"}, nil)

func emitRemote(ch chan<- prometheus.Metric, export string, r *RemoteLink) {
	up := 0.0
	if r.State == "up" {
		up = 1
	}
	ch <- prometheus.MustNewConstMetric(remoteUpDesc, gauge, up, export)
	ch <- prometheus.MustNewConstMetric(remoteReconnectsDesc, prometheus.CounterValue, float64(r.Reconnects), export)
	ch <- prometheus.MustNewConstMetric(remoteOutagesDesc, prometheus.CounterValue, float64(r.Outages), export)
	ch <- prometheus.MustNewConstMetric(remoteDownDesc, prometheus.CounterValue, r.DownTotalSeconds, export)
	ch <- prometheus.MustNewConstMetric(remoteNotDurableDesc, prometheus.CounterValue, float64(r.NotDurable), export)
	ch <- prometheus.MustNewConstMetric(remoteTimeoutsDesc, prometheus.CounterValue, float64(r.RequestTimeouts), export)
	ch <- prometheus.MustNewConstMetric(remoteReplayedDesc, prometheus.CounterValue, float64(r.ReplayedBytes), export)
}

// emitStruct emits one metric per numeric field found in table.
func emitStruct(ch chan<- prometheus.Metric, table map[string]metricDef, v any, export string) {
	rv := reflect.ValueOf(v)
	rt := rv.Type()
	for i := 0; i < rt.NumField(); i++ {
		d, ok := table[rt.Field(i).Name]
		if !ok || d.name == "" {
			continue
		}
		f, ok := numeric(rv.Field(i))
		if !ok {
			continue
		}
		if d.scale != 0 {
			f *= d.scale
		}
		var labels []string
		var values []string
		if export != "" {
			labels, values = []string{"export"}, []string{export}
		}
		ch <- prometheus.MustNewConstMetric(prometheus.NewDesc(d.name, d.help, labels, nil), d.kind, f, values...)
	}
}

// numeric returns a numeric field's value.
func numeric(v reflect.Value) (float64, bool) {
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return float64(v.Int()), true
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return float64(v.Uint()), true
	case reflect.Float32, reflect.Float64:
		return v.Float(), true
	case reflect.Bool:
		if v.Bool() {
			return 1, true
		}
		return 0, true
	}
	return 0, false
}

// Backend decoration: latency of every request, by operation.

var ops = [...]string{"read", "write", "flush", "trim", "write_zeroes", "prefetch"}

const (
	opRead = iota
	opWrite
	opFlush
	opTrim
	opZero
	opPrefetch
)

// tierReader is implemented by backends that say whether a read was served
// from the cache (cache.Volume).
type tierReader interface {
	ReadAtTier(p []byte, off int64) (cache.Tier, error)
}

// tierWriter is implemented by backends that say which tier a write went
// to (cache.Volume).
type tierWriter interface {
	WriteAtTier(p []byte, off int64, fua bool) (cache.Tier, error)
}

// instrumented wraps an nbd.Backend and records each request's latency.
type instrumented struct {
	b      nbd.Backend
	async  nbd.AsyncReader        // b's, or nil
	plug   nbd.Plugger            // b's, or nil
	hits   nbd.HitReader          // b's, or nil
	tiers  tierReader             // nil: reads are not split by tier
	tier   [2]prometheus.Observer // read latency: backing, cache
	wtiers tierWriter             // nil: writes are not split by tier
	wtier  [2]prometheus.Observer // write latency: cache.TierCache, cache.TierBacking
	hist   [len(ops)]prometheus.Observer
	errs   [len(ops)]prometheus.Counter
	// For /v1/stats: finer than the Prometheus buckets, so that p99.9
	// means something.
	lat      [len(ops)]histogram
	tierLat  [2]histogram // reads: backing, cache
	wtierLat [2]histogram // writes: cache, backing
}

func (w *instrumented) observe(op int, start time.Time, err error) error {
	return w.observeDur(op, time.Since(start), err)
}

// observeDur records a request of op that took d.
func (w *instrumented) observeDur(op int, d time.Duration, err error) error {
	w.hist[op].Observe(d.Seconds())
	w.lat[op].observe(d)
	if err != nil {
		w.errs[op].Inc()
	}
	return err
}

func (w *instrumented) Size() int64 { return w.b.Size() }

func (w *instrumented) ReadAt(p []byte, off int64) error {
	t := time.Now()
	if w.tiers == nil {
		return w.observe(opRead, t, w.b.ReadAt(p, off))
	}
	tier, err := w.tiers.ReadAtTier(p, off)
	d := time.Since(t)
	err = w.observeDur(opRead, d, err)
	if err == nil {
		i := 0 // tier[] and tierLat[] are backing, cache
		if tier == cache.TierCache {
			i = 1
		}
		w.tier[i].Observe(d.Seconds())
		w.tierLat[i].observe(d)
	}
	return err
}

// StartReadAt passes a read on to the wrapped backend's StartReadAt, if it
// has one (else it starts nothing): such a read is a cache hit
// (cache.Volume starts only those), timed until its completion.
func (w *instrumented) StartReadAt(p []byte, off int64, done func(error, func(func()))) bool {
	if w.async == nil {
		return false
	}
	t := time.Now()
	return w.async.StartReadAt(p, off, func(err error, later func(func())) {
		done(w.observeHit(time.Since(t), err), later)
	})
}

// observeHit records a cache hit read that took d, and returns err.
func (w *instrumented) observeHit(d time.Duration, err error) error {
	err = w.observeDur(opRead, d, err)
	if err == nil && w.tiers != nil {
		w.tier[1].Observe(d.Seconds()) // tier[] is backing, cache
		w.tierLat[1].observe(d)
	}
	return err
}

// ReadHitAt passes a read on to the wrapped backend's ReadHitAt, if it has
// one (else it serves nothing), timed as a cache hit like StartReadAt.
func (w *instrumented) ReadHitAt(p []byte, off int64) (bool, error) {
	if w.hits == nil {
		return false, nil
	}
	t := time.Now()
	ok, err := w.hits.ReadHitAt(p, off)
	if !ok {
		return false, nil
	}
	return true, w.observeHit(time.Since(t), err)
}

// Plug and Unplug pass a plug on to the wrapped backend's (nbd.Plugger).
func (w *instrumented) Plug() {
	if w.plug != nil {
		w.plug.Plug()
	}
}

func (w *instrumented) Unplug() {
	if w.plug != nil {
		w.plug.Unplug()
	}
}

func (w *instrumented) WriteAt(p []byte, off int64, fua bool) error {
	t := time.Now()
	if w.wtiers == nil {
		return w.observe(opWrite, t, w.b.WriteAt(p, off, fua))
	}
	tier, err := w.wtiers.WriteAtTier(p, off, fua)
	d := time.Since(t)
	err = w.observeDur(opWrite, d, err)
	if err == nil {
		w.wtier[tier].Observe(d.Seconds())
		w.wtierLat[tier].observe(d)
	}
	return err
}

func (w *instrumented) Flush() error {
	t := time.Now()
	return w.observe(opFlush, t, w.b.Flush())
}

func (w *instrumented) latency() []LatencySummary {
	var out []LatencySummary
	for i, name := range ops {
		if w.lat[i].n.Load() == 0 {
			continue
		}
		out = append(out, w.lat[i].summary(name, ""))
		if i == opRead && w.tiers != nil {
			for t, tier := range []string{"backing", "cache"} {
				if w.tierLat[t].n.Load() > 0 {
					out = append(out, w.tierLat[t].summary(name, tier))
				}
			}
		}
		if i == opWrite && w.wtiers != nil {
			for _, t := range []cache.Tier{cache.TierCache, cache.TierBacking} {
				if w.wtierLat[t].n.Load() > 0 {
					out = append(out, w.wtierLat[t].summary(name, t.String()))
				}
			}
		}
	}
	return out
}

// The optional capabilities are passed through only when the wrapped
// backend has them: the NBD server advertises them by type assertion.

type trimmer struct{ *instrumented }

func (w trimmer) Trim(off, length int64, fua bool) error {
	t := time.Now()
	return w.observe(opTrim, t, w.b.(nbd.Trimmer).Trim(off, length, fua))
}

type zeroer struct{ *instrumented }

func (w zeroer) WriteZeroes(off, length int64, fua, mayTrim, fastOnly bool) error {
	t := time.Now()
	err := w.b.(nbd.ZeroWriter).WriteZeroes(off, length, fua, mayTrim, fastOnly)
	if errors.Is(err, errors.ErrUnsupported) && fastOnly {
		return err // a refused fast zero is an answer, not a failure
	}
	return w.observe(opZero, t, err)
}

type prefetcher struct{ *instrumented }

func (w prefetcher) Prefetch(off, length int64) error {
	t := time.Now()
	return w.observe(opPrefetch, t, w.b.(nbd.Prefetcher).Prefetch(off, length))
}

type (
	wrapT  struct{ trimmer }
	wrapZ  struct{ zeroer }
	wrapP  struct{ prefetcher }
	wrapTZ struct {
		trimmer
		zeroer
	}
	wrapTP struct {
		trimmer
		prefetcher
	}
	wrapZP struct {
		zeroer
		prefetcher
	}
	wrapTZP struct {
		trimmer
		zeroer
		prefetcher
	}
)

// Size etc. are ambiguous through several embedded *instrumented; resolve
// them once with a base field.
type base struct{ *instrumented }

// Wrap returns b decorated with latency histograms under the label export,
// keeping exactly b's optional capabilities (Trimmer, ZeroWriter,
// Prefetcher).
func (m *Metrics) Wrap(export string, b nbd.Backend) nbd.Backend {
	w := &instrumented{b: b}
	w.async, _ = b.(nbd.AsyncReader)
	w.plug, _ = b.(nbd.Plugger)
	w.hits, _ = b.(nbd.HitReader)
	if h, ok := b.(tierReader); ok {
		w.tiers = h
		w.tier[0] = m.reads.WithLabelValues(export, "backing")
		w.tier[1] = m.reads.WithLabelValues(export, "cache")
	}
	if tw, ok := b.(tierWriter); ok {
		w.wtiers = tw
		for _, t := range []cache.Tier{cache.TierCache, cache.TierBacking} {
			w.wtier[t] = m.writes.WithLabelValues(export, t.String())
		}
	}
	for i, op := range ops {
		w.hist[i] = m.latency.WithLabelValues(export, op)
		w.errs[i] = m.errs.WithLabelValues(export, op)
	}
	_, t := b.(nbd.Trimmer)
	_, z := b.(nbd.ZeroWriter)
	_, p := b.(nbd.Prefetcher)
	T, Z, P := trimmer{w}, zeroer{w}, prefetcher{w}
	var out nbd.Backend
	switch {
	case t && z && p:
		out = &struct {
			base
			wrapTZP
		}{base{w}, wrapTZP{T, Z, P}}
	case t && z:
		out = &struct {
			base
			wrapTZ
		}{base{w}, wrapTZ{T, Z}}
	case t && p:
		out = &struct {
			base
			wrapTP
		}{base{w}, wrapTP{T, P}}
	case z && p:
		out = &struct {
			base
			wrapZP
		}{base{w}, wrapZP{Z, P}}
	case t:
		out = &struct {
			base
			wrapT
		}{base{w}, wrapT{T}}
	case z:
		out = &struct {
			base
			wrapZ
		}{base{w}, wrapZ{Z}}
	case p:
		out = &struct {
			base
			wrapP
		}{base{w}, wrapP{P}}
	default:
		out = w
	}
	m.wrapped(export, w)
	return out
}

// wrapped remembers the decorator of export for the latency summaries of
// /v1/stats.
func (m *Metrics) wrapped(export string, w *instrumented) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.inst == nil {
		m.inst = map[string]*instrumented{}
	}
	m.inst[export] = w
}

func (m *Metrics) latencyOf(export string) []LatencySummary {
	m.mu.Lock()
	w := m.inst[export]
	m.mu.Unlock()
	if w == nil {
		return nil
	}
	return w.latency()
}
