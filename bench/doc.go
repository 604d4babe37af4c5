// Package bench is tiercache's benchmark harness: the code behind `make bench`.
//
// Why it exists: tiercache only earns its complexity if serving a device
// through it costs no more than serving it through the NBD servers people
// already use. On a small, shared, noisy machine a single run proves nothing,
// so the harness fixes the method instead of leaving it to whoever runs it:
//
//   - one data file (random bytes, not sparse) is served in turn by tiercache
//     and by the peers qemu-nbd and nbdkit's file plugin, each on a unix
//     socket, all with the host page cache in use;
//   - the same fio workloads (fio's nbd engine, one connection) run against
//     each server for a fixed time after a ramp;
//   - servers are interleaved round by round, the order rotating each round,
//     so that machine noise falls on all of them alike, and the report gives
//     the median of the rounds, the ratios of tiercache to each peer and the
//     server's CPU seconds per GiB moved (from /proc/PID/stat);
//   - fio run directly on the file (O_DIRECT and buffered) gives baselines.
//
// Every command line the harness runs is printed and written into the report,
// so a result can be reproduced by hand.
//
// `tcbench cache` (cache.go, cache_scenarios.go, cache_apps.go,
// cache_report.go, cache_cliff.go, cache_hit.go) runs the cache scenarios
// S1-S10: tiercache
// with an SSD model in front of an HDD model, side by side with the plain HDD
// model (and qemu-nbd in S5), driving tiercache's admin CLI (set, flush,
// stats --json) between fio runs (S6: pgbench and db_bench on ext4 through
// the kernel; S7-S8: writes larger than the cache, in every writeback order,
// with a cache already full of history; S9: warm-up under load; S10: cache
// hits on a local disk against the disk itself and qemu-nbd), and
// reports each published seed figure beside ours; docs/BENCHMARKS.md
// describes the method.
//
// The pure parts (fio JSON, /proc stat, size parsing, medians and ratios, the
// report) are unit tested. The harness itself is slow and needs fio, qemu-nbd
// and nbdkit, so it is not part of `go test`; `go run ./cmd/tcbench --quick`
// runs it end to end in well under a minute.
package bench
