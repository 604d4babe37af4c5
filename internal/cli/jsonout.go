package cli

import (
	"fmt"
	"reflect"
	"time"

	"github.com/tiercache/tiercache/admin"
)

// plainJSON turns v (the engine's structs, which have no JSON tags) into
// values that encoding/json prints the way the API does: struct fields
// under their snake_case names (admin.SnakeName), errors as their message
// (null when nil), UUIDs with dashes, modes and other Stringers by name,
// times as RFC 3339. Unexported fields are left out.
func plainJSON(v any) any { return plainValue(reflect.ValueOf(v)) }

var (
	errorType    = reflect.TypeFor[error]()
	stringerType = reflect.TypeFor[fmt.Stringer]()
)

func plainValue(v reflect.Value) any {
	if !v.IsValid() {
		return nil
	}
	if v.Kind() == reflect.Interface || v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return nil
		}
		if v.Type().Implements(errorType) {
			return v.Interface().(error).Error()
		}
		return plainValue(v.Elem())
	}
	if t, ok := v.Interface().(time.Time); ok {
		if t.IsZero() {
			return ""
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	if v.Kind() == reflect.Array && v.Type().Elem().Kind() == reflect.Uint8 && v.Len() == 16 {
		var u [16]byte
		reflect.Copy(reflect.ValueOf(&u).Elem(), v)
		return fmtUUID(u)
	}
	if v.Kind() != reflect.Struct && v.Kind() != reflect.String && v.Type().Implements(stringerType) && v.Type().PkgPath() != "" {
		return v.Interface().(fmt.Stringer).String()
	}
	switch v.Kind() {
	case reflect.Struct:
		m := map[string]any{}
		t := v.Type()
		for i := 0; i < t.NumField(); i++ {
			if f := t.Field(i); f.IsExported() {
				m[admin.SnakeName(f.Name)] = plainValue(v.Field(i))
			}
		}
		return m
	case reflect.Slice, reflect.Array:
		if v.Kind() == reflect.Slice && v.IsNil() {
			return []any{}
		}
		out := make([]any, v.Len())
		for i := range out {
			out[i] = plainValue(v.Index(i))
		}
		return out
	case reflect.Map:
		m := map[string]any{}
		for _, k := range v.MapKeys() {
			m[fmt.Sprint(k.Interface())] = plainValue(v.MapIndex(k))
		}
		return m
	}
	return v.Interface()
}
