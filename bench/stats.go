package bench

import (
	"math"
	"slices"
)

// median returns the median of xs, ignoring NaNs; ok is false when no value
// is left. For an even count it is the mean of the two middle values.
func median(xs []float64) (m float64, ok bool) {
	v := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2], true
	}
	return (v[n/2-1] + v[n/2]) / 2, true
}

// minMax returns the smallest and largest non-NaN values of xs.
func minMax(xs []float64) (lo, hi float64, ok bool) {
	for _, x := range xs {
		if math.IsNaN(x) {
			continue
		}
		if !ok {
			lo, hi, ok = x, x, true
			continue
		}
		lo, hi = min(lo, x), max(hi, x)
	}
	return lo, hi, ok
}

// ratio returns a/b; ok is false when either is missing (NaN) or b is not
// positive, so that a missing peer never shows as an infinite speed-up.
func ratio(a, b float64) (r float64, ok bool) {
	if math.IsNaN(a) || math.IsNaN(b) || b <= 0 {
		return 0, false
	}
	return a / b, true
}

// cpuPerGiB returns CPU seconds per GiB moved; ok is false when nothing moved.
func cpuPerGiB(cpuSeconds float64, bytes int64) (float64, bool) {
	if bytes <= 0 || math.IsNaN(cpuSeconds) {
		return 0, false
	}
	return cpuSeconds / (float64(bytes) / (1 << 30)), true
}
