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
// checkpoint plus the journal, so recovery is bounded by the journal size
// and dirty state is exact (no "everything is dirty after a crash").
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
//	"SETT" u32 | { cutoff u64 | writeback % u8 | order str16 | promote str16 | rate max u64 } ...  (optional)
//
// The crc32c covers header (crc field zeroed) and payload. Updates write the
// copy seq%2 with seq+1, so the other copy always holds the previous
// version; Open takes the valid copy with the highest seq (bbolt's meta
// pages). The superblock changes only on Format, Open, SetMode, SetSettings,
// Attach, Detach and Close. A backing record's index is its volume's slot;
// a free slot (left by Detach) is a record with an empty name, empty id and
// path, size 0; the last record is never free (see attach.go).
//
// Checkpoint slot (written alternately: generation g goes to slot g%2):
//
//	header block: magic "TIERCCK\x01" | version u32 | header crc32c u32 | nonce u64 |
//	              generation u64 | journal start block u64 | journal start seq u64 |
//	              body len u64 | body crc32c u32
//	body:         nbuckets u32 | bucket generation u32 ... | nvolumes u16 (may differ from the superblock's: missing slots are empty, extra ones must be) |
//	              { flush epoch u64 | count u64 | { lba u64 | loc u32 (bit 31: dirty) | crc32c u32 } ... } ...
//
// The body is written and synced before the header that vouches for it, so a
// valid header with a bad body is corruption, never a crash. A torn header
// makes Open use the other slot, whose journal is still intact: nothing of
// generation g is written to the journal before checkpoint g is durable.
//
// # Journal framing
//
// The journal is a circular region of 4 KiB blocks. A commit writes a batch
// of at most maxBatchBlocks blocks and then syncs; each block is framed
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
//
// The crc32c covers the block after the crc field. The nonce (from the set
// UUID) and the generation (the checkpoint the journal follows) reject
// blocks of an earlier Format or an earlier journal generation. Replay
// starts at the checkpoint's journal position and stops at the first block
// that is not the expected next one:
//
//   - all zeroes, or a valid frame of another set/generation: the end of
//     the log (a zeroed or stale tail);
//   - a bad checksum: a torn tail, dropped, unless a block of a later batch
//     of this generation lies within maxBatchBlocks beyond it; since a batch
//     is written only after the previous one is synced, that later block
//     proves the damaged one was durable, and Open fails with ErrCorrupt
//     naming the offset and both checksums;
//   - a valid frame with the wrong sequence number or malformed records:
//     corruption.
//
// After replay Open writes a new checkpoint (a new generation) right away,
// so leftovers of a torn tail can never be replayed later.
//
// # Flush protocol (invariant 2)
//
// A write is complete when its data is written to the cache device (or the
// backing device) and its index change is applied in memory and appended to
// the pending journal records. Flush, and a FUA write, call commit, which:
//
//  1. takes every pending record;
//  2. syncs each backing device written since its last sync, because some
//     records depend on backing data (a clean insert from writethrough or
//     promotion, an invalidation after writearound, none, trim or
//     write-zeroes): a durable invalidation must never expose backing data
//     older than what it replaced;
//  3. syncs the cache device: the data every taken record points at is now
//     durable;
//  4. writes the records as journal blocks and syncs again (or, when the
//     journal is full, writes a checkpoint instead, which covers them).
//
// So a record is never durable before the data it names: data → sync →
// journal → sync, as bbolt does for its meta pages. commitMu makes this a
// group commit: callers queue on it, and the holder writes whatever is
// pending, so concurrent FLUSH and FUA requests share one journal write and
// one pair of syncs. A commit also runs every second and when 256 KiB of
// records are pending, bounding what an unflushed crash loses.
//
// After a crash (clean flag unset), Open drops every clean entry: a
// passthrough write may have reached the backing device while the record
// invalidating the cached copy was lost. Dirty entries are kept; they are
// newer than anything on the backing device.
//
// # Buckets, writeback and eviction (invariants 3 and 5)
//
// See gc.go and writeback.go. Buckets are filled append-only. Each volume
// has a background writeback goroutine that sweeps its index in LBA order
// (a cursor that wraps), batches up to 64 MiB of dirty blocks, merges
// adjacent LBAs into writes of up to 2 MiB, issues them in ascending order
// with up to 32 in flight (fewer for long runs: about 4 MiB in flight),
// syncs the backing device and only then journals the blocks clean. A
// clean mark applies only if the entry still points at the block written
// and the bucket's generation is unchanged.
//
// Rate (per volume): nothing while dirty data is under writeback_percent of
// the cache; above it excess/10 s (at least 1 MiB/s); full speed when the
// client has been idle for 200 ms, when the volume is not in writeback
// mode, when free buckets run short, or when dirty data is half way from
// the target to a full cache; writeback_rate_max caps background passes.
// Foreground writes sleep up to 4 ms (quadratic in the dirty share above
// 70 %), and a write that finds no free bucket within 5 ms goes around the
// cache (invalidating the range, as writearound does) instead of stalling.
//
// Eviction (the gc goroutine, when fewer than max(2, N/8) buckets are
// free) picks, among sealed buckets, an empty one, else the least recently
// used clean one (bucket-granularity LRU: reads and allocations stamp the
// bucket), else the dirty one with the fewest live blocks. A victim whose
// live blocks fill at most a quarter of it has its dirty blocks copied into
// the open bucket (a GC move, journaled as inserts) instead of written back;
// otherwise they are written back. Then its clean entries are dropped, its
// generation bump is journaled and committed, and only then is it free.
//
// # Policies
//
// See policy.go. Sequential bypass: the last 16 streams per volume are
// tracked; a request continuing a stream that has reached
// sequential_cutoff (default 4 MiB, bcache's) bypasses: a write goes to the
// backing device and invalidates the range, a read miss is not promoted.
// Promotion of read misses: always (default), never, or after:N misses of
// the same block; skipped (counted as congestion) when it would use the
// free bucket reserve. NBD_CMD_CACHE always promotes.
//
// Settings (all keys of Settings) live in the superblock, in a trailer
// after the backing list that older superblocks lack (they decode with
// DefaultSettings).
//
// # Epoch-ordered writeback (writeback_order=epoch, the default)
//
// Every insert record carries the volume's flush epoch (advanced by each
// Flush). In epoch order a dirty block of epoch e overwritten in a later
// epoch is not released: it stays owned as a superseded version (its
// bucket's live and dirty counts include it) in a per-volume tree of
// superseded versions keyed by (lba, cache block). Writeback takes the
// oldest epoch with dirty versions (found through per-child epoch bounds in
// both trees), writes its versions LBA-sorted in a sweep that resumes where
// the last batch stopped (any order is allowed within an epoch), syncs the backing
// device and journals them clean (a clean record naming a superseded
// version's cache block releases it), and only then goes on to the next
// epoch. So if the cache device dies at any moment the backing device holds
// the image after some flush plus part of the next epoch's writes, a state
// a real disk could have after a power cut (TestEpochPrefix).
//
// What keeps it: eviction never writes back out of order (it goes through
// the same epoch batches, or GC-moves live versions keeping their epoch);
// writes do not bypass the cache (sequential or cache full) while the
// volume has dirty data, they wait for space instead; an invalidation
// (writearound, none, trim, write-zeroes) and a clean insert (writethrough,
// promotion) drop every older version of the range, since the backing
// device then holds newer data; and a write that goes to the backing device
// directly (passthrough, writethrough) first waits until every epoch before
// the current one is written back. Leaving epoch order drops the
// superseded versions.
//
// Recovery: replay rebuilds superseded versions from the insert records
// (same rule, same order); a checkpoint stores an epoch section after the
// volumes: "EPCH" | per volume { n | (loc u32, epoch u64) × n for the dirty
// entries | m | (lba u64, loc u32, crc u32, epoch u64) × m superseded }.
// Its slots are sized at Format for 28 bytes per cache block (16 before);
// a set formatted earlier has smaller slots and writes back in lba order.
package cache
