package cli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
)

// TestStatusConsistency: status says per export whether the backing device
// alone is consistent (the CONSISTENT column), and for a volume whose
// epoch order degraded, since when, whether it is catching up and when it
// is consistent again; usage says the same per export. Exact output (nothing here is volatile): the
// walk-through shows only the consistent case, since a degrade depends on
// timing.
func TestStatusConsistency(t *testing.T) {
	since := time.Date(2026, 12, 2, 10, 2, 3, 0, time.Local)
	started := time.Date(2026, 12, 2, 9, 0, 0, 0, time.Local)
	vol := func(name, order string, ok bool, at *time.Time) admin.ExportInfo {
		return admin.ExportInfo{Name: name, Path: "/srv/" + name + ".img", Size: 1 << 30, Cached: true, Mode: "writeback",
			CachedBytes: 64 << 20, DirtyBytes: 8 << 20, HitRatio: 0.5,
			Consistency: admin.Consistency{WritebackOrder: order, BackingConsistent: ok, InconsistentSince: at}}
	}
	catching := vol("wal", "epoch", false, &since)
	catching.CatchingUp = true
	s := &session{id: serverID{Found: "$TIERCACHE_ADMIN"}, st: admin.Status{
		Version: "v1", PID: 42, Started: started, UptimeSeconds: 60,
		Listeners: []string{"unix:/srv/nbd.sock"}, Admin: []string{"unix:/srv/admin.sock"},
		Set: &admin.SetInfo{UUID: "u", CachePath: "/srv/ssd.img", CacheSize: 240 << 20, DeviceSize: 256 << 20, BucketSize: 1 << 20, Buckets: 240,
			State: "ok", CachedBytes: 192 << 20, DirtyBytes: 24 << 20},
		Exports: []admin.ExportInfo{
			vol("db", "epoch", true, nil),
			vol("logs", "epoch", false, &since),
			vol("scratch", "lba", false, nil),
			catching,
			{Name: "iso", Path: "/srv/iso.img", Size: 1 << 20, Mode: "plain"},
		},
	}}
	var out bytes.Buffer
	if err := printStatus(&out, s); err != nil {
		t.Fatal(err)
	}
	want := `server        v1, pid 42, up 1m0s (since 2026-12-02 09:00:00)
admin API     unix:/srv/admin.sock (found by $TIERCACHE_ADMIN)
NBD           unix:/srv/nbd.sock
cache set     u
cache device  /srv/ssd.img (256 MiB: 240 buckets of 1 MiB, the rest metadata)
state         ok; 192 MiB cached, 24 MiB dirty

EXPORT   MODE       SIZE   CACHED  DIRTY  HIT    CONSISTENT                       DEVICE
db       writeback  1 GiB  64 MiB  8 MiB  50.0%  yes                              /srv/db.img
logs     writeback  1 GiB  64 MiB  8 MiB  50.0%  no, since 10:02:03               /srv/logs.img
scratch  writeback  1 GiB  64 MiB  8 MiB  50.0%  no (lba order)                   /srv/scratch.img
wal      writeback  1 GiB  64 MiB  8 MiB  50.0%  no, since 10:02:03, catching up  /srv/wal.img
iso      plain      1 MiB  -       -      -      -                                /srv/iso.img

logs: backing device consistent: no, since 2026-12-02 10:02:03; consistent again once writeback catches up (a full drain, or the catch-up pass that starts once 5 s have passed since the degrade and since the last write stream around the cache)
wal: backing device consistent: no, since 2026-12-02 10:02:03; catching up now: consistent again once the catch-up pass has written back everything dirty from before its cut
`
	if got := out.String(); got != want {
		t.Errorf("status printed:\n%s\nwant:\n%s", got, want)
	}

	var u admin.Usage
	for _, e := range s.st.Exports[:4] {
		u.Exports = append(u.Exports, admin.ExportUsage{Name: e.Name, Path: e.Path, Mode: e.Mode, Size: e.Size, Used: e.Size,
			Cached: e.CachedBytes, Dirty: e.DirtyBytes, PendingWriteback: e.DirtyBytes, Consistency: e.Consistency})
	}
	out.Reset()
	if err := printUsage(&out, u, 0); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"  backing device consistent: yes\n",
		"  backing device consistent: no, since 2026-12-02 10:02:03; consistent again once writeback catches up (a full drain, or the catch-up pass that starts once 5 s have passed since the degrade and since the last write stream around the cache)\n",
		"  backing device consistent: no (writeback_order lba: writeback does not keep the order of flushes)\n",
		"  backing device consistent: no, since 2026-12-02 10:02:03; catching up now: consistent again once the catch-up pass has written back everything dirty from before its cut\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("usage lacks %q:\n%s", want, out.String())
		}
	}
}

// TestIntervalLine: 'stats INTERVAL' prints the rates and the hit ratio of
// the interval, not since the start: the first line covers the time since
// the start, the next one only what happened between the two replies.
func TestIntervalLine(t *testing.T) {
	started := time.Date(2026, 12, 2, 9, 0, 0, 0, time.Local)
	at := func(sec int, reads, hit, miss, writes uint64, dirty int64) admin.Stats {
		vs := cache.VolumeStats{ReadOps: reads, ReadBytes: (hit + miss) * 4096, ReadHitBytes: hit * 4096, ReadMissBytes: miss * 4096,
			WriteOps: writes, WriteBytes: writes * 4096, DirtyBlocks: dirty}
		return admin.Stats{Time: started.Add(time.Duration(sec) * time.Second), Started: started,
			Exports: []admin.ExportStats{{Name: "home", Mode: "writeback", Cached: true, Volume: &admin.VolumeStats{VolumeStats: vs}}}}
	}
	// 10 s with 100 reads (10% hits), then 2 s with 400 more, all hits.
	first, second := at(10, 100, 10, 90, 50, 256), at(12, 500, 410, 90, 50, 512)
	var out bytes.Buffer
	printInterval(&out, first, nil, true)
	printInterval(&out, second, &first, false)
	want := `time      export           r/s     w/s  rMiB/s  wMiB/s   hit%      dirty  wbMiB/s  r_p99_us  w_p99_us
09:00:10  home              10       5     0.0     0.0   10.0      1 MiB      0.0         -         -
09:00:12  home             200       0     0.8     0.0  100.0      2 MiB      0.0         -         -
`
	if got := out.String(); got != want {
		t.Errorf("interval lines:\n%s\nwant:\n%s", got, want)
	}
}
