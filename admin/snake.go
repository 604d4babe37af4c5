package admin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"time"
	"unicode"

	"github.com/tiercache/tiercache/cache"
)

// The engine's counters (cache.VolumeStats, cache.SetStats) have no JSON
// tags: their fields grow with the engine. The API serializes them with
// snake_case names derived from the Go names (ReadHitBytes ->
// read_hit_bytes), modes as their names, times as RFC 3339 (empty when
// zero), so that every field added to the engine appears in /v1/stats
// under a predictable name without a change here. renamed holds the fields
// whose Go name would mislead an operator.
var renamed = map[string]string{
	// Only writes (and write-zeroes) sent straight to the backing device;
	// the bypass_*_bytes reasons count read misses not promoted too.
	"BypassBytes": "bypass_write_bytes",
	// The engine's target now, not a measurement (writeback_rate is the
	// measured one, in ExportStats).
	"WritebackRate": "writeback_target_rate",
}

// SnakeName is the API's name of a counter field.
func SnakeName(field string) string {
	if n, ok := renamed[field]; ok {
		return n
	}
	rs := []rune(field)
	var b strings.Builder
	for i, r := range rs {
		// A word starts at an upper-case letter after a lower-case one,
		// or at the last capital of an acronym (GCMoves -> gc_moves).
		if i > 0 && unicode.IsUpper(r) && (unicode.IsLower(rs[i-1]) || i+1 < len(rs) && unicode.IsLower(rs[i+1]) && unicode.IsUpper(rs[i-1])) {
			b.WriteByte('_')
		}
		b.WriteRune(unicode.ToLower(r))
	}
	return b.String()
}

var (
	modeType = reflect.TypeFor[cache.Mode]()
	timeType = reflect.TypeFor[time.Time]()
)

// marshalSnake writes the exported fields of the struct v as a JSON object
// with SnakeName keys, in field order.
func marshalSnake(v any) ([]byte, error) {
	rv := reflect.ValueOf(v)
	rt := rv.Type()
	var buf bytes.Buffer
	buf.WriteByte('{')
	n := 0
	for i := 0; i < rt.NumField(); i++ {
		f := rt.Field(i)
		if !f.IsExported() {
			continue
		}
		var val any = rv.Field(i).Interface()
		switch f.Type {
		case modeType:
			val = rv.Field(i).Interface().(cache.Mode).String()
		case timeType:
			t := rv.Field(i).Interface().(time.Time)
			val = ""
			if !t.IsZero() {
				val = t.UTC().Format(time.RFC3339Nano)
			}
		}
		b, err := json.Marshal(val)
		if err != nil {
			return nil, fmt.Errorf("%s.%s: %w", rt.Name(), f.Name, err)
		}
		if n > 0 {
			buf.WriteByte(',')
		}
		n++
		k, _ := json.Marshal(SnakeName(f.Name))
		buf.Write(k)
		buf.WriteByte(':')
		buf.Write(b)
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

// unmarshalSnake is marshalSnake's inverse into the struct *v; unknown
// keys (a newer server) are ignored.
func unmarshalSnake(data []byte, v any) error {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		return err
	}
	rv := reflect.ValueOf(v).Elem()
	rt := rv.Type()
	for i := 0; i < rt.NumField(); i++ {
		f := rt.Field(i)
		raw, ok := m[SnakeName(f.Name)]
		if !f.IsExported() || !ok {
			continue
		}
		switch f.Type {
		case modeType:
			var s string
			if err := json.Unmarshal(raw, &s); err != nil {
				return fmt.Errorf("%s: %w", SnakeName(f.Name), err)
			}
			md, err := cache.ParseMode(s)
			if err != nil {
				return fmt.Errorf("%s: %w", SnakeName(f.Name), err)
			}
			rv.Field(i).Set(reflect.ValueOf(md))
		case timeType:
			var s string
			if err := json.Unmarshal(raw, &s); err != nil {
				return fmt.Errorf("%s: %w", SnakeName(f.Name), err)
			}
			if s != "" {
				t, err := time.Parse(time.RFC3339Nano, s)
				if err != nil {
					return fmt.Errorf("%s: %w", SnakeName(f.Name), err)
				}
				rv.Field(i).Set(reflect.ValueOf(t))
			}
		default:
			if err := json.Unmarshal(raw, rv.Field(i).Addr().Interface()); err != nil {
				return fmt.Errorf("%s: %w", SnakeName(f.Name), err)
			}
		}
	}
	return nil
}

// VolumeStats is cache.VolumeStats with snake_case JSON.
type VolumeStats struct{ cache.VolumeStats }

func (s VolumeStats) MarshalJSON() ([]byte, error)     { return marshalSnake(s.VolumeStats) }
func (s *VolumeStats) UnmarshalJSON(data []byte) error { return unmarshalSnake(data, &s.VolumeStats) }

// SetStats is cache.SetStats with snake_case JSON.
type SetStats struct{ cache.SetStats }

func (s SetStats) MarshalJSON() ([]byte, error)     { return marshalSnake(s.SetStats) }
func (s *SetStats) UnmarshalJSON(data []byte) error { return unmarshalSnake(data, &s.SetStats) }
