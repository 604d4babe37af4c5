package nbddev

import (
	"strings"
	"testing"
)

func TestParseURI(t *testing.T) {
	for _, c := range []struct {
		uri     string
		network string
		addr    string
		export  string
		tls     bool
		name    string // Target.Name()
	}{
		{"nbd://example.com/disk", "tcp", "example.com:10809", "disk", false, "nbd://example.com:10809/disk"},
		{"nbd://example.com", "tcp", "example.com:10809", "", false, "nbd://example.com:10809/"},
		{"nbd://example.com/", "tcp", "example.com:10809", "", false, "nbd://example.com:10809/"},
		{"nbd://example.com//disk", "tcp", "example.com:10809", "/disk", false, "nbd://example.com:10809//disk"},
		{"nbd://example.com/hello%20world", "tcp", "example.com:10809", "hello world", false, "nbd://example.com:10809/hello%20world"},
		{"nbd://[::1]:1234/x", "tcp", "[::1]:1234", "x", false, "nbd://[::1]:1234/x"},
		{"nbds://h:99/e?tls-certificates=/etc/pki&x-multi-conn=2", "tcp", "h:99", "e", true, "nbds://h:99/e"},
		{"nbd+unix:///disk?socket=/run/x.sock", "unix", "/run/x.sock", "disk", false, "nbd+unix:///disk?socket=/run/x.sock"},
		{"nbds+unix:///?socket=sock&tls-hostname=srv", "unix", "sock", "", true, "nbds+unix:///?socket=sock"},
	} {
		tg, err := ParseURI(c.uri)
		if err != nil {
			t.Errorf("ParseURI(%q): %v", c.uri, err)
			continue
		}
		if tg.Network != c.network || tg.Addr != c.addr || tg.Export != c.export || tg.TLS != c.tls {
			t.Errorf("ParseURI(%q) = %+v", c.uri, tg)
		}
		if got := tg.Name(); got != c.name {
			t.Errorf("ParseURI(%q).Name() = %q, want %q", c.uri, got, c.name)
		}
		// String round-trips to the same target.
		again, err := ParseURI(tg.String())
		if err != nil || again != tg {
			t.Errorf("ParseURI(%q).String() = %q parses to %+v, %v", c.uri, tg.String(), again, err)
		}
	}
}

func TestParseURIRefused(t *testing.T) {
	for _, c := range []struct{ uri, want string }{
		{"http://h/e", "scheme"},
		{"nbd:/e", "no host"},
		{"nbd:opaque", "want scheme"},
		{"nbd+unix:///e", "socket= is required"},
		{"nbd+unix://host/e?socket=s", "no host"},
		{"nbd://h/e?socket=s", "socket= is for"},
		{"nbd://h/e?colour=blue", "unknown parameter"},
		{"nbd://user@h/e", "PSK"},
		{"nbds://h/e?tls-type=psk", "not supported"},
		{"nbd://h/e?tls-certificates=/x", "need the nbds"},
		{"nbds://h/e?tls-verify-peer=maybe", "want 0 or 1"},
		{"nbd://h/e?x-multi-conn=0", "x-multi-conn"},
		{"nbd://h/e?x-multi-conn=1&x-multi-conn=2", "given 2 times"},
		{"nbd://h/e#frag", "fragment"},
	} {
		_, err := ParseURI(c.uri)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseURI(%q) = %v; want an error containing %q", c.uri, err, c.want)
		}
	}
}

func TestIsURI(t *testing.T) {
	for s, want := range map[string]bool{
		"nbd://h/e": true, "nbds://h": true, "nbd+unix:///?socket=s": true, "nbds+unix:///?socket=s": true,
		"/dev/sdb": false, "hdd:/x": false, "nbd:x": false, "./nbd://x": false,
	} {
		if IsURI(s) != want {
			t.Errorf("IsURI(%q) = %v", s, !want)
		}
	}
}
