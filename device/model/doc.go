// Package model wraps a device.Device in a performance model of an HDD or
// an SSD: the data goes to the inner device (a file, or device.Mem), and
// each request completes when the modelled disk would complete it.
//
// Why: tiercache exists to hide a slow disk's mechanics, and its
// benchmarks must show that on machines (CI, laptops, this project's
// 2-core build host) that have no HDD. A model also makes the numbers
// repeatable: the same workload gives the same figures, and testing/synctest
// runs it in virtual time. Select a model with a device spec: Parse splits
// "hdd:PATH", "ssd:PATH" or "nvme:PATH", and Wrap builds the model. See
// docs/MODELS.md for the parameters, their sources and the calibration.
//
// # HDD
//
// One actuator serves one request at a time. Model time t is nanoseconds
// since the model started (scaled by TimeScale). The disk has Z zones of
// equal track count; zone z's sustained rate R_z falls linearly from
// OuterRate to InnerRate, and a track holds what passes the head in one
// revolution:
//
//	rev          = 60 s / RPM
//	trackBytes_z = R_z · (rev + t2t)     (sustained rate includes track switches)
//	media rate   = trackBytes_z / rev
//
// The seek over d tracks, as a fraction x = d/tracks of the stroke, is
// Ruemmler and Wilkes's two-part curve (settle included):
//
//	seek(0) = 0
//	seek(x) = t2t + a·(√x − √x₁)                        x ≤ x₀ = 0.25 (x₁: one track)
//	seek(x) = seek(x₀) + (full − seek(x₀))·(x − x₀)/(1 − x₀)   x > x₀
//
// with a fitted so that the mean over two uniformly random positions,
// ∫₀¹ seek(x)·2(1−x) dx, equals AvgSeek. Byte b of track k passes under the
// head at spindle phase
//
//	θ(k, b) = (b/trackBytes·rev + k·skew) mod rev,  skew = seek(1 track)
//
// (track skew: a sequential transfer crossing a track finds the next
// track's first sector just as the switch ends). A request of n bytes at
// model time t costs, track by track: seek to the track, wait
// (θ − t) mod rev for the first sector, transfer piece/trackBytes·rev. So
// a request just ahead of the head on the same track costs almost only its
// transfer, and a random one the average seek plus half a revolution
// (4.17 ms at 7200 rpm) on average.
//
// Queue: requests wait in arrival order; whenever the actuator is free,
// the drive chooses among the oldest QueueDepth (NCQ, 32) the one with the
// shortest positioning time (seek + rotational wait), unless the oldest has
// waited AgeLimit, which then goes first. Read-ahead: after a read the head
// keeps streaming into a buffer (up to ReadAhead bytes) while the drive is
// idle, so a sequential reader at QD1 finds its next block in the buffer or
// being read. Write cache: a write completes once transferred into the
// cache (CommandOverhead + n/InterfaceRate); cached writes are destaged,
// contiguous ones coalesced, in positioning order among the oldest
// DestageQueue; a write that finds the cache full waits for room; Sync
// waits until every write cached before it is on the platter. With
// WriteThrough a write completes when it is on the platter.
//
// # SSD
//
// Channels requests are served at once. A read occupies a channel for
// ReadLatency, then its data crosses the host link at ReadRate; a write
// crosses the link at WriteRate, then completes WriteLatency later (in the
// drive's cache) and keeps its channel busy for max(WriteLatency,
// ProgramTime). The link carries one transfer at a time. A flush waits for
// every completed write and adds FlushLatency; a flush with nothing written
// or discarded since the previous one costs CleanFlushLatency (a command's
// round trip), no earlier than that previous flush. So at QD1 random 4 KiB
// reads run at 1/(ReadLatency + 4096/ReadRate) and writes at
// 1/(WriteLatency + 4096/WriteRate); deep queues at
// min(Channels/ReadLatency, ReadRate/4096) and
// min(Channels/ProgramTime, WriteRate/4096).
//
// # Clock
//
// Every completion time is computed from model state alone (actuator busy
// until, head position, link and channel free times), never from when a
// goroutine happened to run: the next decision starts at
// max(busyUntil, arrival of the request), decisions are made only once the
// wall clock has passed that time, and a late wake-up delays a
// notification without moving the model. One goroutine per model releases
// waiting requests: a Go timer for the bulk of a long wait, then one ppoll
// with a nanosecond timeout on the loop's own thread (timer slack 1 ns),
// which a new request interrupts through an eventfd. (Go's timers fire up to
// ~1 ms late on an idle process, too late for an SSD.) There is no
// busy-waiting. On a shared 2-core machine a notification is
// typically 50-150 µs late, which matters for the SSD at QD1 and not for the
// HDD.
//
// Concurrency: every method may be called from many goroutines. Close
// releases waiting requests, stops the goroutine and closes the inner
// device.
package model
