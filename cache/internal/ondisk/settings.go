package ondisk

import (
	"fmt"
	"strconv"
	"strings"
)

// Settings are a volume's tunables: what `tiercache set EXPORT key=value`
// changes while serving. Every field is validated by SetSettings, applied
// live and persisted in the superblock so it survives restarts.
//
// Keys (as used by the CLI and admin API, see ParseSetting):
//
//	cache_mode          writeback | writethrough | writearound | none
//	sequential_cutoff   bytes (e.g. 4M); streams longer than this bypass the cache (writeback write streams: longer than this and the cache's room); 0 disables
//	writeback_percent   target dirty share of the cache, 0..100
//	writeback_order     epoch | lba
//	promote             always | never | after:N (promote a block read N times)
//	writeback_rate_max  bytes per second cap on background writeback; 0 = no cap
type Settings struct {
	Mode             Mode
	SequentialCutoff int64
	WritebackPercent int
	WritebackOrder   WritebackOrder
	Promote          string
	WritebackRateMax int64
}

// DefaultSettings are the settings of a freshly formatted volume.
func DefaultSettings() Settings {
	return Settings{
		Mode:             Writeback,
		SequentialCutoff: 4 << 20,
		WritebackPercent: 10,
		WritebackOrder:   OrderEpoch,
		Promote:          "always",
	}
}

// Validate reports the first invalid field.
func (s Settings) Validate() error {
	if !s.Mode.Valid() {
		return fmt.Errorf("%w: cache_mode %d", ErrInvalid, int(s.Mode))
	}
	if s.SequentialCutoff < 0 {
		return fmt.Errorf("%w: sequential_cutoff %d is negative", ErrInvalid, s.SequentialCutoff)
	}
	if s.WritebackPercent < 0 || s.WritebackPercent > 100 {
		return fmt.Errorf("%w: writeback_percent %d (want 0..100)", ErrInvalid, s.WritebackPercent)
	}
	if s.WritebackOrder != OrderEpoch && s.WritebackOrder != OrderLBA {
		return fmt.Errorf("%w: writeback_order %q (want epoch or lba)", ErrInvalid, s.WritebackOrder)
	}
	if _, err := ParsePromote(s.Promote); err != nil {
		return err
	}
	if s.WritebackRateMax < 0 {
		return fmt.Errorf("%w: writeback_rate_max %d is negative", ErrInvalid, s.WritebackRateMax)
	}
	return nil
}

// WritebackOrder is the order in which a volume's dirty data is written
// back: OrderEpoch (flush epoch by flush epoch, so that the backing device
// always holds the image of some client flush) or OrderLBA.
type WritebackOrder uint8

// The writeback orders. The zero value is none of them (settings built
// without an order).
const (
	OrderEpoch WritebackOrder = iota + 1
	OrderLBA
)

func (o WritebackOrder) String() string {
	switch o {
	case OrderEpoch:
		return "epoch"
	case OrderLBA:
		return "lba"
	}
	return fmt.Sprintf("WritebackOrder(%d)", uint8(o))
}

// ParseWritebackOrder parses "epoch" or "lba".
func ParseWritebackOrder(s string) (WritebackOrder, error) {
	switch s {
	case "epoch":
		return OrderEpoch, nil
	case "lba":
		return OrderLBA, nil
	}
	return 0, fmt.Errorf("%w: writeback_order %q (want epoch or lba)", ErrInvalid, s)
}

// MarshalText and UnmarshalText give the order its text form in JSON.
func (o WritebackOrder) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

func (o *WritebackOrder) UnmarshalText(b []byte) error {
	v, err := ParseWritebackOrder(string(b))
	*o = v
	return err
}

// ParsePromote returns the hit count a block needs before it is promoted:
// 1 for always, 0 for never.
func ParsePromote(p string) (int, error) {
	switch {
	case p == "always":
		return 1, nil
	case p == "never":
		return 0, nil
	case strings.HasPrefix(p, "after:"):
		n, err := strconv.Atoi(strings.TrimPrefix(p, "after:"))
		if err == nil && n >= 1 && n <= 255 {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%w: promote %q (want always, never or after:N with N in 1..255)", ErrInvalid, p)
}

// SettingKeys lists the keys ParseSetting accepts, in display order.
var SettingKeys = []string{"cache_mode", "sequential_cutoff", "writeback_percent", "writeback_order", "promote", "writeback_rate_max"}

// ParseSetting applies key=value to s. Sizes accept K, M, G suffixes.
func ParseSetting(s *Settings, key, value string) error {
	switch key {
	case "cache_mode":
		m, err := ParseMode(value)
		if err != nil {
			return err
		}
		s.Mode = m
	case "sequential_cutoff":
		n, err := parseBytes(value)
		if err != nil {
			return fmt.Errorf("%w: sequential_cutoff: %v", ErrInvalid, err)
		}
		s.SequentialCutoff = n
	case "writeback_percent":
		n, err := strconv.Atoi(value)
		if err != nil {
			return fmt.Errorf("%w: writeback_percent %q is not a number", ErrInvalid, value)
		}
		s.WritebackPercent = n
	case "writeback_order":
		o, err := ParseWritebackOrder(value)
		if err != nil {
			return err
		}
		s.WritebackOrder = o
	case "promote":
		s.Promote = value
	case "writeback_rate_max":
		n, err := parseBytes(value)
		if err != nil {
			return fmt.Errorf("%w: writeback_rate_max: %v", ErrInvalid, err)
		}
		s.WritebackRateMax = n
	default:
		return fmt.Errorf("%w: unknown setting %q (known: %s)", ErrInvalid, key, strings.Join(SettingKeys, ", "))
	}
	return s.Validate()
}

// Get returns the value of key formatted as ParseSetting accepts it.
func (s Settings) Get(key string) (string, bool) {
	switch key {
	case "cache_mode":
		return s.Mode.String(), true
	case "sequential_cutoff":
		return strconv.FormatInt(s.SequentialCutoff, 10), true
	case "writeback_percent":
		return strconv.Itoa(s.WritebackPercent), true
	case "writeback_order":
		return s.WritebackOrder.String(), true
	case "promote":
		return s.Promote, true
	case "writeback_rate_max":
		return strconv.FormatInt(s.WritebackRateMax, 10), true
	}
	return "", false
}

// parseBytes parses 4096, 4K, 4M, 1G (binary units).
func parseBytes(v string) (int64, error) {
	u := strings.ToUpper(strings.TrimSpace(v))
	mult := int64(1)
	for _, suf := range []struct {
		s string
		m int64
	}{{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}} {
		if strings.HasSuffix(u, suf.s) {
			u, mult = strings.TrimSuffix(u, suf.s), suf.m
			break
		}
	}
	n, err := strconv.ParseInt(u, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, fmt.Errorf("bad size %q", v)
	}
	return n * mult, nil
}

// PromoteNeed is the miss count that promotes a block under the settings.
func (st *Settings) PromoteNeed() int {
	n, err := ParsePromote(st.Promote)
	if err != nil {
		return 1
	}
	return n
}
