// Package admin is the running server's management API: a small JSON HTTP
// API (normally on a unix socket, mode 0600) for status, usage, stats,
// settings, flush, detach and check, and Prometheus metrics on /metrics.
//
// Routes (stdlib ServeMux patterns):
//
//	GET  /v1/status                   version, uptime, cache set, exports
//	GET  /v1/usage                    per device: size, used, cached, dirty
//	GET  /v1/stats                    counters per export and for the set
//	GET  /v1/exports/{name}/settings  the export's settings (key: value)
//	PUT  /v1/exports/{name}/settings  change settings: {"key": "value", ...}
//	POST /v1/exports/{name}/flush     write back dirty data; streams Progress
//	POST /v1/exports/{name}/detach    write back, remove from the set and the NBD server, release the backing device; streams Progress
//	POST /v1/attach                   add a backing device as a new volume and export: AttachRequest -> ExportInfo
//	POST /v1/check                    verify index and every cached block; streams Progress
//	POST /v1/lost-writes/ack          acknowledge failovers' lost writes: LostWritesAck -> LostWritesReply
//	POST /v1/mirror/replace           resilver a new device as a degraded mirror's failed member, or attach it as the mirror of a set on one device: ReplaceRequest; streams Progress
//	POST /v1/mirror/resilver-rate     change the running resilver's rate limit: ResilverRate
//	GET  /metrics                     Prometheus text exposition
//
// Errors are JSON {"error": "...", "key": "..."} with a 4xx/5xx status.
// Streaming replies are newline-delimited JSON Progress objects; the last
// one has Finished set, and Error when the operation failed.
//
// Client is the Go client the CLI uses.
package admin

import (
	"time"
)

// Status is the reply of GET /v1/status.
type Status struct {
	Version       string       `json:"version"`
	PID           int          `json:"pid"`
	Started       time.Time    `json:"started"`
	UptimeSeconds float64      `json:"uptime_seconds"`
	Listeners     []string     `json:"listeners"` // NBD: unix:PATH, tcp:HOST:PORT
	Admin         []string     `json:"admin"`     // this API: unix:PATH, tcp:HOST:PORT
	Set           *SetInfo     `json:"set,omitempty"`
	Exports       []ExportInfo `json:"exports"`
}

// SetInfo describes the cache set being served.
type SetInfo struct {
	UUID       string `json:"uuid"`
	CachePath  string `json:"cache_path"`
	CacheSize  int64  `json:"cache_size"`  // bucket space (buckets x bucket size)
	DeviceSize int64  `json:"device_size"` // the whole cache device: bucket space + metadata
	BucketSize int64  `json:"bucket_size"`
	Buckets    int64  `json:"buckets"`
	// State is "ok", or "failed" after the cache device failed (every
	// export is then served from its backing device; FailCause says why).
	State       string `json:"state"`
	FailCause   string `json:"fail_cause,omitempty"`
	CachedBytes int64  `json:"cached_bytes"`
	DirtyBytes  int64  `json:"dirty_bytes"`
	// LostWrites lists, one line per volume, the acknowledged writes that
	// cache device failovers lost and no operator has acknowledged yet
	// (the lost-writes record; 'tiercache lost-writes'). LostWritesUnrecorded
	// is why this server could not record its failover's on the cache
	// device (the list is then only in its memory).
	LostWrites           []string `json:"lost_writes,omitempty"`
	LostWritesUnrecorded string   `json:"lost_writes_unrecorded,omitempty"`
	// Mirror: a mirrored set's two cache devices (State is then
	// "degraded" while one of them is failed).
	Mirror *MirrorInfo `json:"mirror,omitempty"`
}

// MirrorInfo is the state of a mirrored set's cache devices: member A
// (the cache device, --cache) and member B (--cache-mirror), which holds
// the metadata and a copy of every dirty block in its slots.
type MirrorInfo struct {
	Path string `json:"path"` // member B's
	// State is "ok" (both members in sync) or "degraded" (Failed, "A" or
	// "B", failed: the set runs on the other alone, and a second failure
	// fails it over).
	State  string `json:"state"`
	Failed string `json:"failed,omitempty"`
	Slots  int64  `json:"slots"`
	// SlotsUsed: B's slots holding a copy of a bucket with dirty data.
	SlotsUsed int64 `json:"slots_used"`
	// Reads: the reads each member served (A, B; a block both hold is
	// read from each in turn). ReadRetries: reads that failed on one
	// member and were served by the other; Repairs: copies rewritten from
	// the other member.
	Reads       [2]uint64 `json:"reads"`
	ReadRetries uint64    `json:"read_retries"`
	Repairs     uint64    `json:"repairs"`
	// WritethroughBytes: writeback writes sent to the backing device too
	// because B had no free slot.
	WritethroughBytes uint64 `json:"writethrough_bytes"`
	// Resilver is the progress of a replace running (nil when none).
	Resilver *ResilverInfo `json:"resilver,omitempty"`
}

// ResilverInfo is the progress of a resilver ('tiercache replace'): the
// member being brought in and the bytes copied of those to copy.
type ResilverInfo struct {
	Member string `json:"member"`
	// Path is the device being brought in (as the replace named it).
	Path       string  `json:"path,omitempty"`
	Done       int64   `json:"done"`
	Total      int64   `json:"total"`
	ETASeconds float64 `json:"eta_seconds,omitempty"`
	// Rate is the copy's limit in bytes a second (0: none).
	Rate int64 `json:"rate,omitempty"`
}

// ReplaceRequest is the body of POST /v1/mirror/replace: the device that
// replaces the failed member of the degraded mirrored set, or, for a set
// on one cache device, that is attached as its mirror (member B). Force accepts
// a device that holds data or another set's mirror label. Rate limits the
// copy to that many bytes a second (0: no limit).
type ReplaceRequest struct {
	Path  string `json:"path"`
	Force bool   `json:"force,omitempty"`
	Rate  int64  `json:"rate,omitempty"`
}

// ResilverRate is the body of POST /v1/mirror/resilver-rate: the running
// resilver's new rate limit in bytes a second (0: no limit).
type ResilverRate struct {
	Rate int64 `json:"rate"`
}

// LostWritesAck is the body of POST /v1/lost-writes/ack: the failovers
// (their numbers, as the lost-writes lines name them) whose lost writes
// the operator has dealt with.
type LostWritesAck struct {
	IDs []uint64 `json:"ids"`
}

// LostWritesReply is the reply of POST /v1/lost-writes/ack: the lost
// writes still recorded, one line per volume and failover.
type LostWritesReply struct {
	LostWrites []string `json:"lost_writes"`
}

// ExportInfo describes one export.
type ExportInfo struct {
	Name   string `json:"name"`
	Path   string `json:"path"` // the backing device (cached) or the device (plain)
	Size   int64  `json:"size"`
	Cached bool   `json:"cached"` // a volume of the cache set (else a plain export)
	Mode   string `json:"mode"`   // cache mode; "plain" for plain exports
	// Volumes only (zero for plain exports):
	CachedBytes int64 `json:"cached_bytes"`
	DirtyBytes  int64 `json:"dirty_bytes"`
	// HitRatio is the share of bytes read that came from the cache, since
	// the server started; 0 before the first read.
	HitRatio float64 `json:"hit_ratio"`
	Consistency
	// Remote is the link to a remote (NBD URI) backing device; nil for
	// local devices.
	Remote *RemoteLink `json:"remote,omitempty"`
	// ObjectStore is the image of an object-store (s3://) backing
	// device; nil for other devices.
	ObjectStore *ObjectStore `json:"object_store,omitempty"`
}

// ObjectStore describes an object-store image backing a volume and counts
// the device's traffic to the store since the server opened it.
type ObjectStore struct {
	Image      string `json:"image"` // s3://BUCKET/PREFIX
	Generation uint64 `json:"generation"`
	// Epoch is the newest epoch stored, of generation EpochGeneration, at
	// EpochTime (nil when unknown: nothing stored since the image was
	// opened and recovered from a checkpoint alone). Recovery from the
	// bucket alone gives at least this epoch's image.
	Epoch           uint64     `json:"epoch"`
	EpochGeneration uint64     `json:"epoch_generation"`
	EpochTime       *time.Time `json:"epoch_time,omitempty"`
	// Fenced says why the device stopped writing (another host took a
	// newer generation of the image); "" while it writes.
	Fenced string `json:"fenced,omitempty"`
	// Space: segments the map knows, their bytes, the bytes of the blocks
	// the map refers to, and stored / live.
	Segments           int64   `json:"segments"`
	StoredBytes        int64   `json:"stored_bytes"`
	LiveBytes          int64   `json:"live_bytes"`
	SpaceAmplification float64 `json:"space_amplification"`
	// Writeback: segment objects and bytes PUT (checkpoints included),
	// the data bytes they carried, and bytes PUT per data byte.
	SegmentsPut      int64   `json:"segments_put"`
	BytesPut         int64   `json:"bytes_put"`
	WrittenBytes     int64   `json:"written_bytes"`
	PutAmplification float64 `json:"put_amplification"`
	Checkpoints      int64   `json:"checkpoints"`
	// Reads: ranged GETs of segment data and their bytes.
	Gets     int64 `json:"gets"`
	BytesGot int64 `json:"bytes_got"`
	// Garbage collection: rounds, live bytes rewritten, bytes PUT for
	// them, segments deleted and their bytes; GCWriteAmplification is
	// (BytesPut + GCBytesPut) / BytesPut.
	GCRuns               int64   `json:"gc_runs"`
	GCRewrittenBytes     int64   `json:"gc_rewritten_bytes"`
	GCBytesPut           int64   `json:"gc_bytes_put"`
	GCDeletedSegments    int64   `json:"gc_deleted_segments"`
	GCDeletedBytes       int64   `json:"gc_deleted_bytes"`
	GCWriteAmplification float64 `json:"gc_write_amplification"`
}

// RemoteLink is the state of the connection to a remote backing device.
type RemoteLink struct {
	// State is "up" (connected), "reconnecting" (down for less than the
	// outage timeout: requests wait), "down" (for longer: requests fail
	// with EIO at once) or "refused" (the server now answering is not the
	// recorded export).
	State string `json:"state"`
	// Since is when the link came up, or went down.
	Since      time.Time `json:"since"`
	Conns      int       `json:"connections"`
	Reconnects uint64    `json:"reconnects"`
	Outages    uint64    `json:"outages"`
	// RequestTimeouts counts connections closed as hung: a request got no
	// reply within the request timeout.
	RequestTimeouts uint64 `json:"request_timeouts"`
	// ReplayedWrites and ReplayedBytes count the unflushed writes written
	// again on new connections after outages.
	ReplayedWrites uint64 `json:"replayed_writes"`
	ReplayedBytes  uint64 `json:"replayed_bytes"`
	// DownSeconds is the length of the current outage (0 when up);
	// DownTotalSeconds the time disconnected since serve started.
	DownSeconds      float64 `json:"down_seconds"`
	DownTotalSeconds float64 `json:"down_total_seconds"`
	// NotDurable counts backing syncs refused because a connection ended
	// before a flush covered earlier writes (they were written again).
	NotDurable uint64 `json:"not_durable"`
	LastError  string `json:"last_error,omitempty"`
}

// Consistency says what the backing device of a volume holds alone (what
// is left if the cache device is lost). Volumes only.
type Consistency struct {
	// WritebackOrder is the volume's writeback_order setting ("epoch" or
	// "lba").
	WritebackOrder string `json:"writeback_order,omitempty"`
	// BackingConsistent: in epoch order, the backing device alone holds
	// the image after some flush plus part of the next epoch. False in
	// lba order, and from InconsistentSince (when epoch order degraded)
	// until the next full drain of the volume's dirty data.
	BackingConsistent bool       `json:"backing_consistent"`
	InconsistentSince *time.Time `json:"inconsistent_since,omitempty"`
	// CatchingUp: a degraded volume is catching up with epoch order; the
	// backing device is consistent again once the pass is done.
	CatchingUp bool `json:"catching_up,omitempty"`
}

// AttachRequest is the body of POST /v1/attach.
type AttachRequest struct {
	Name  string `json:"name"`           // the export (and volume) name
	Path  string `json:"path"`           // device spec: a path, or hdd:PATH, ssd:PATH, nvme:PATH
	Mode  string `json:"mode,omitempty"` // cache mode; default writeback
	Force bool   `json:"force,omitempty"`
	// TrustPath identifies a device that nothing else identifies (no
	// serial, WWN, partition UUID, loop backing file or file attribute) by
	// its path: a different disk appearing at that path is not caught.
	TrustPath bool `json:"trust_path,omitempty"`
}

// Usage is the reply of GET /v1/usage.
type Usage struct {
	Cache   *CacheUsage   `json:"cache,omitempty"`
	Exports []ExportUsage `json:"exports"`
}

// CacheUsage is the cache device's space.
type CacheUsage struct {
	Path        string `json:"path"`
	Size        int64  `json:"size"`         // bucket space (buckets x bucket size)
	UsedBytes   int64  `json:"used_bytes"`   // buckets not free
	CachedBytes int64  `json:"cached_bytes"` // live cached blocks
	DirtyBytes  int64  `json:"dirty_bytes"`  // of those, not yet written back
	Buckets     int64  `json:"buckets"`
	FreeBuckets int64  `json:"free_buckets"`
	// EmptyBuckets are used buckets that hold no live block (overwritten
	// or dropped data): GC frees them first, without writeback, when space
	// is needed. A detach frees those its disk left at once.
	EmptyBuckets int64 `json:"empty_buckets"`
	// Failed: the cache device failed; every export is served from its
	// backing device and UnreachableDirtyBytes of dirty data is left on
	// the failed device (see docs/OPERATIONS.md).
	Failed                bool   `json:"failed,omitempty"`
	FailCause             string `json:"fail_cause,omitempty"`
	UnreachableDirtyBytes int64  `json:"unreachable_dirty_bytes,omitempty"`
}

// ExportUsage is one export's space.
type ExportUsage struct {
	Name   string `json:"name"`
	Path   string `json:"path"`
	Mode   string `json:"mode"`
	Size   int64  `json:"size"`
	Used   int64  `json:"used_bytes"` // allocated on the device (sparse files: less than size)
	Cached int64  `json:"cached_bytes"`
	Dirty  int64  `json:"dirty_bytes"`
	// PendingWriteback is the dirty data the background writeback still
	// has to write to this device. With the current engine every dirty
	// block is pending, so it equals Dirty.
	PendingWriteback int64 `json:"pending_writeback_bytes"`
	// After a cache device failure: dirty data left on the failed device
	// (reads of it fail) and writes acknowledged before the failure that
	// are not durable (flushes fail).
	UnreachableDirty int64 `json:"unreachable_dirty_bytes,omitempty"`
	LostWrites       int64 `json:"lost_write_bytes,omitempty"`
	Consistency
	// ObjectStore: the image of an object-store backing device (its
	// stored and live bytes, space and GC write amplification).
	ObjectStore *ObjectStore `json:"object_store,omitempty"`
}

// Stats is the reply of GET /v1/stats.
type Stats struct {
	Time    time.Time     `json:"time"`
	Started time.Time     `json:"started"` // the counters count since then
	Set     *SetStats     `json:"set,omitempty"`
	Exports []ExportStats `json:"exports"`
}

// ExportStats are one export's counters. Volume is the engine's
// VolumeStats with snake_case names (see SnakeName), so fields added to
// the engine appear here without a change.
type ExportStats struct {
	Name   string       `json:"name"`
	Mode   string       `json:"mode"`
	Cached bool         `json:"cached"`
	Volume *VolumeStats `json:"volume,omitempty"`
	// WritebackOrder is the volume's writeback_order setting; Volume has
	// backing_consistent and inconsistent_since.
	WritebackOrder string           `json:"writeback_order,omitempty"`
	Latency        []LatencySummary `json:"latency,omitempty"`
	// Remote is the link to a remote (NBD URI) backing device; nil for
	// local devices.
	Remote *RemoteLink `json:"remote,omitempty"`
	// ObjectStore: the image of an object-store backing device.
	ObjectStore *ObjectStore `json:"object_store,omitempty"`
	// HitRatio is ReadHitBytes / (ReadHitBytes + ReadMissBytes) since the
	// start, 0 before the first read.
	HitRatio float64 `json:"hit_ratio"`
	// WritebackRate is bytes written back per second, measured over the
	// last seconds (smoothed).
	WritebackRate float64 `json:"writeback_rate"`
	// WritebackETASeconds is dirty bytes / WritebackRate; 0 when nothing is
	// dirty, -1 when dirty data waits but writeback is idle.
	WritebackETASeconds float64 `json:"writeback_eta_seconds"`
}

// LatencySummary summarizes one request type's latency since the server
// started, as the backend served it (the NBD server's queueing aside).
// Reads and writes appear three times: all of them (Tier ""), and split by
// the tier that served them: for reads "cache" (every block was cached)
// and "backing"; for writes "cache" (the cache device alone: writeback)
// and "backing" (the backing device was written: writethrough,
// writearound, none, and writes bypassed around the cache).
// Percentiles are the upper bounds of the histogram's buckets (8 per power
// of two: within 12.5%). Buckets lists the non-empty ones as [upper bound
// in ns, count], so that the percentiles of an interval can be taken from
// two replies (LatencySummary.Sub).
type LatencySummary struct {
	Op         string      `json:"op"`
	Tier       string      `json:"tier,omitempty"`
	Count      uint64      `json:"count"`
	MeanMicros float64     `json:"mean_us"`
	P50Micros  float64     `json:"p50_us"`
	P99Micros  float64     `json:"p99_us"`
	P999Micros float64     `json:"p999_us"`
	MaxMicros  float64     `json:"max_us"`
	SumNanos   uint64      `json:"sum_ns"`
	Buckets    [][2]uint64 `json:"buckets,omitempty"`
}

// Progress is one line of a streaming reply (flush, detach, check).
type Progress struct {
	Op         string   `json:"op"`
	Export     string   `json:"export,omitempty"`
	Done       int64    `json:"done"`  // bytes written back, or blocks verified
	Total      int64    `json:"total"` // of Done
	DirtyBytes int64    `json:"dirty_bytes,omitempty"`
	Rate       float64  `json:"rate,omitempty"` // units of Done per second
	ETASeconds float64  `json:"eta_seconds,omitempty"`
	Finished   bool     `json:"finished,omitempty"`
	Error      string   `json:"error,omitempty"`
	Problems   []string `json:"problems,omitempty"` // check: what was found
	Message    string   `json:"message,omitempty"`
}

// ErrorReply is the body of an error status.
type ErrorReply struct {
	Error string `json:"error"`
	Key   string `json:"key,omitempty"` // the setting at fault, for settings errors
}
