// Package cache is tiercache's engine: a log-structured cache of 4 KiB
// blocks on a fast device in front of one or more slow backing devices, each
// served as a Volume (what an NBD export serves).
//
// # Why it is shaped like this
//
// Random client writes become sequential writes into buckets on the cache
// device (cheap on an SSD), and reach the HDD later, sorted by LBA and in
// place, so the backing device keeps its layout and stays a plain image that
// can be used alone after a clean detach. All metadata lives on the cache
// device. The index lives in memory and is rebuilt at Open from the newest
// checkpoint plus the journal, so dirty state is exact after a crash (no
// "everything is dirty").
//
// # On-disk layout of the cache device
//
//	0        64K       128K                   +JournalLen   +CkptLen     +CkptLen  (aligned)
//	+---------+---------+------------------------+------------+------------+-------+----------+-----+----------+
//	| super 0 | super 1 | journal (circular,     | checkpoint | checkpoint | (pad) | bucket 0 | ... | bucket   |
//	|         |         | 4 KiB blocks)          | slot 0     | slot 1     |       |          |     | N-1      |
//	+---------+---------+------------------------+------------+------------+-------+----------+-----+----------+
//
// Superblock copy (64 KiB slot; only the encoded length is written):
//
//	magic "TIERCSB\x01" | version u32 | payload len u32 | crc32c u32 | pad u32 |
//	seq u64 | set uuid [16] | block size u32 | bucket size u64 | nbuckets u64 |
//	journal off, len u64 | ckpt off[2], len u64 | buckets off u64 | clean u8 |
//	nbackings u16 | { name str16 | id str16 | size u64 | mode u8 | path str16 } ...
//	"SETT" u32 | { cutoff u64 | writeback % u8 | order str16 | promote str16 | rate max u64 |
//	               inconsistent since u64 } ... |
//	[ "CAID" u32 | cache device id str16 ] | "FEAT" u32 | features u64 | flags u64 | mark shift u8
//
// The version is 4 (ondisk.FormatVersion); every superblock has the FEAT
// trailer (features: bit 0 warm-clean, set on every set and not read; bit 1
// mirror; bit 2 paged index; flags: bit 0 clean entries untrusted; mark
// shift: log2 of a mark region's blocks). The crc32c covers header (crc field zeroed) and payload. A
// backing record's index is its volume's slot; a free slot (left by Detach)
// is a record with an empty name, empty id and path, size 0. Which copy an
// update writes, and which versions Open accepts: docs/CACHE.md, "Layout".
//
// The last two 4 KiB blocks of each 64 KiB copy are not the superblock's:
// the second-to-last holds a lost-writes record slot (what a failover lost,
// until acknowledged: ondisk/lostwrites.go) and the last a journal head
// record slot (ondisk/journalhead.go); each pair alternates by its own
// counter, and Format zeroes all four.
//
// Checkpoint slot (written alternately: generation g goes to slot g%2):
//
//	header block: magic "TIERCCK\x01" | version u32 | header crc32c u32 | nonce u64 |
//	              generation u64 | journal start block u64 | journal start seq u64 |
//	              body len u64 | body crc32c u32
//	body:         nbuckets u32 | bucket generation u32 ... | nvolumes u16 (may differ from the superblock's: missing slots are empty, extra ones must be) |
//	              { flush epoch u64 | count u64 | { lba u64 | loc u32 (bit 31: dirty) | crc32c u32 } ... } ... |
//	              "EPCH" u32 | { n u64 | { loc u32 | epoch u64 } × n | m u64 | { lba u64 | loc u32 | crc32c u32 | epoch u64 } × m } ...
//
// The header's version is 2, its own (not the superblock's FormatVersion;
// a set's format version is the superblock's). In what order a checkpoint
// is written and how Open chooses a slot: docs/CACHE.md, "Recovery".
//
// # Journal framing
//
// The journal is a circular region of 4 KiB blocks. A commit writes a batch
// of at most ondisk.MaxBatchBlocks blocks and then syncs; each block is framed
// alone and holds whole records:
//
//	+----------------------------------------------------------------------+
//	| magic u32 | crc32c u32 | nonce u64 | generation u64 | seq u64 |       |
//	| batch start seq u64 | used u16 | pad [6]                  (48 bytes) |
//	+----------------------------------------------------------------------+
//	| record | record | ...                         (used bytes, ≤ 4048)   |
//	+----------------------------------------------------------------------+
//	record: type u8 | body len u16 | body
//	  insert:     vol u16 | lba u64 | loc u32 | bucket gen u32 | dirty u8 | epoch u64 | n u16 | crc32c u32 × n
//	  clean:      vol u16 | lba u64 | loc u32
//	  invalidate: vol u16 | lba u64 | n u64
//	  reuse:      bucket u32 | new generation u32
//	  mark:       vol u16 | region u64 (lba >> mark shift)
//	  unmark:     vol u16 | region u64
//
// The crc32c covers the block after the crc field. The nonce (from the set
// UUID) and the generation (the checkpoint the journal follows) tell a
// block of this journal from one of an earlier Format or an earlier
// journal generation. Where replay finds the end of the log, and what it
// calls corruption: docs/CACHE.md, "Recovery".
//
// # Where things are
//
// The protocols (flush, recovery, index pages, region marks, writeback and
// epoch order, eviction, attach and detach, failover) are described once,
// in docs/CACHE.md; the
// invariants they keep are numbered in docs/DESIGN.md. The code is split
// by room:
//
//   - internal/ondisk: the formats above and their codecs;
//   - internal/index: the in-memory index (no I/O), guarded by Set.mu;
//     index.go: the engine's per-volume state beside it;
//   - internal/pages and pagedckpt.go: checkpoints as index pages;
//   - format.go, identity.go, errors.go, journalhead.go: Format, identity
//     re-recording, and the on-disk types and errors of the API;
//   - recovery.go: Open, the checkpoint load and the journal replay;
//   - commit.go: journal appends, group commit, checkpoints, backing
//     syncs and FUA;
//   - set.go: the Set (orchestration: locks, volumes, Close, stats);
//   - volume.go, route.go, readpath.go, policy.go: the client I/O paths
//     (route.go: where a write, write-zeroes or trim goes);
//   - order.go: epoch order's degrade, catch-up and return; marks.go:
//     region marks;
//   - alloc.go: bucket allocation; evict.go: eviction and GC moves;
//   - internal/writeback: the writeback mechanism, its loop, its entry
//     points (eviction, a write waiting for space, Drain), queue depth and
//     yielding; writeback.go is the set's side of it (writeback.Volume);
//   - internal/backoff: retry pacing of operations failing outside the
//     cache (writeback, ENOSPC);
//   - failover.go: fencing and loss accounting after a cache failure;
//   - internal/mirror, mirror.go, resilver.go: mirrored cache devices;
//   - attach.go, inspect.go, scrub.go: volume slots, read-only inspection,
//     checksum scrubs.
package cache
