package bench

import (
	"io"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseFlags(t *testing.T) {
	o, err := parseFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.Rounds != 5 || o.Runtime != 10*time.Second || o.Ramp != 2*time.Second || o.FileSize != 1<<30 ||
		!slices.Equal(o.Servers, serverNames) || !o.Baselines {
		t.Errorf("defaults = %+v", o)
	}

	o, err = parseFlags([]string{"--quick", "--rounds=2", "--servers", "nbdkit, qemu-nbd,nbdkit"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.Rounds != 2 || o.Runtime != 2*time.Second || o.Ramp != 0 || o.FileSize != 64<<20 {
		t.Errorf("--quick with explicit --rounds = %+v", o)
	}
	if !slices.Equal(o.Servers, []string{"nbdkit", "qemu-nbd"}) {
		t.Errorf("servers = %q", o.Servers)
	}

	for _, bad := range [][]string{
		{"--servers=nbd-server"}, {"--rounds=0"}, {"--size=1000"}, {"--runtime=10ms"},
		{"--servers=", "--baselines=false"}, {"extra"},
	} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) succeeded", bad)
		}
	}
}

func TestServerArgv(t *testing.T) {
	for _, name := range serverNames {
		argv, err := serverArgv(name, "/b/tiercache", "/w/data.img", "/w/s.sock")
		if err != nil {
			t.Fatal(err)
		}
		line := strings.Join(argv, " ")
		if !strings.Contains(line, "/w/data.img") || !strings.Contains(line, "/w/s.sock") {
			t.Errorf("%s: %s", name, line)
		}
	}
	if _, err := serverArgv("nope", "", "", ""); err == nil {
		t.Error("unknown server accepted")
	}
}
