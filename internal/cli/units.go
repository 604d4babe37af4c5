package cli

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// byteSettings are the settings whose values are byte counts (per second
// for rates); the CLI takes them in human units and shows them so.
var byteSettings = map[string]string{"sequential_cutoff": "", "writeback_rate_max": "/s"}

// parseHumanBytes reads a byte count: 4096, 4K, 4KiB, 4 MiB, 1.5G, 256K/s
// (binary units; the suffix B and /s are optional).
func parseHumanBytes(v string) (int64, error) {
	s := strings.ToUpper(strings.ReplaceAll(strings.TrimSpace(v), " ", ""))
	s = strings.TrimSuffix(s, "/S")
	s = strings.TrimSuffix(s, "B")
	s = strings.TrimSuffix(s, "I")
	mult := 1.0
	if n := len(s); n > 0 {
		if i := strings.IndexByte("KMGTP", s[n-1]); i >= 0 {
			mult = math.Pow(1024, float64(i+1))
			s = s[:n-1]
		}
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || math.IsInf(f, 0) || f*mult > math.MaxInt64/2 {
		return 0, fmt.Errorf("%q: want a byte count such as 4096, 512K, 4MiB or 1.5G", v)
	}
	return int64(f * mult), nil
}

// settingIn turns a value given on the command line into the form the
// server parses (byte counts as plain numbers).
func settingIn(key, v string) (string, error) {
	if _, ok := byteSettings[key]; !ok {
		return v, nil
	}
	n, err := parseHumanBytes(v)
	if err != nil {
		return "", fmt.Errorf("%s=%s: %w", key, v, err)
	}
	return strconv.FormatInt(n, 10), nil
}

// settingOut shows a setting's value for people: byte counts in binary
// units, zeros that mean "off" saying so.
func settingOut(key, v string) string {
	suffix, ok := byteSettings[key]
	if !ok {
		if key == "writeback_percent" {
			return v + "%"
		}
		return v
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return v
	}
	if n == 0 {
		if key == "writeback_rate_max" {
			return "0 (no limit)"
		}
		return "0 (off)"
	}
	return human(n) + suffix
}
