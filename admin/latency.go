package admin

import (
	"math"
	"math/bits"
	"sync/atomic"
	"time"
)

// histogram counts durations in logarithmic buckets: 8 per power of two
// of nanoseconds, so a percentile read from it is within 12.5% of the
// true value. Observe is lock-free (one atomic add per bucket, count and
// sum); a snapshot taken while observations run may be off by the ones in
// flight.
type histogram struct {
	counts [62 * histSub]atomic.Uint64
	n, sum atomic.Uint64
}

const histSub = 8

// histBucket returns the bucket of d nanoseconds.
func histBucket(ns uint64) int {
	if ns < histSub {
		return int(ns)
	}
	e := bits.Len64(ns) - 1 // ns in [2^e, 2^(e+1))
	sub := (ns >> (e - 3)) & (histSub - 1)
	return (e-2)*histSub + int(sub)
}

// histUpper is the largest duration (ns) bucket i holds.
func histUpper(i int) uint64 {
	if i < histSub {
		return uint64(i)
	}
	e, sub := i/histSub+2, uint64(i%histSub)
	return (histSub+sub+1)<<(e-3) - 1
}

func (h *histogram) observe(d time.Duration) {
	ns := uint64(max(d, 0))
	h.counts[histBucket(ns)].Add(1)
	h.n.Add(1)
	h.sum.Add(ns)
}

// summary is the histogram as the API reports it: count, mean,
// percentiles, and the non-empty buckets (so that a client can take the
// percentiles of an interval from two summaries; see Sub).
func (h *histogram) summary(op, tier string) LatencySummary {
	s := LatencySummary{Op: op, Tier: tier, Count: h.n.Load()}
	for i := range h.counts {
		if c := h.counts[i].Load(); c > 0 {
			s.Buckets = append(s.Buckets, [2]uint64{histUpper(i), c})
		}
	}
	s.fill(h.sum.Load())
	return s
}

// fill computes the mean and percentiles from Count, Buckets and sum (ns).
func (s *LatencySummary) fill(sum uint64) {
	var total uint64
	for _, b := range s.Buckets {
		total += b[1]
	}
	s.Count = total
	if total == 0 {
		return
	}
	s.MeanMicros = math.Round(float64(sum)/float64(total)/100) / 10
	s.P50Micros = s.quantile(0.50)
	s.P99Micros = s.quantile(0.99)
	s.P999Micros = s.quantile(0.999)
	s.MaxMicros = micros(s.Buckets[len(s.Buckets)-1][0])
	s.SumNanos = sum
}

// micros is ns in whole µs, rounded up (a bucket's bound stays a bound).
func micros(ns uint64) float64 { return math.Ceil(float64(ns) / 1e3) }

// quantile is the upper bound (µs) of the bucket holding the q-th
// observation.
func (s *LatencySummary) quantile(q float64) float64 {
	var total uint64
	for _, b := range s.Buckets {
		total += b[1]
	}
	rank := uint64(q*float64(total) + 0.5)
	rank = max(min(rank, total), 1)
	var seen uint64
	for _, b := range s.Buckets {
		seen += b[1]
		if seen >= rank {
			return micros(b[0])
		}
	}
	return micros(s.Buckets[len(s.Buckets)-1][0])
}

// Sub returns the summary of the observations in s and not in old (the
// same series, taken earlier): the latencies of the interval between them.
func (s LatencySummary) Sub(old LatencySummary) LatencySummary {
	prev := map[uint64]uint64{}
	for _, b := range old.Buckets {
		prev[b[0]] = b[1]
	}
	out := LatencySummary{Op: s.Op, Tier: s.Tier}
	for _, b := range s.Buckets {
		if c := b[1] - min(prev[b[0]], b[1]); c > 0 {
			out.Buckets = append(out.Buckets, [2]uint64{b[0], c})
		}
	}
	out.fill(s.SumNanos - min(old.SumNanos, s.SumNanos))
	return out
}
