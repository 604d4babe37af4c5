package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDiscoverOrder: the admin commands' server is --admin, then
// $TIERCACHE_ADMIN, then the config file's (--config, $TIERCACHE_CONFIG:
// its admin key, else its data_dir's admin.sock), then an explicit data
// directory, and each answer says how it was found.
func TestDiscoverOrder(t *testing.T) {
	dir := t.TempDir()
	withAdmin := filepath.Join(dir, "a.toml")
	os.WriteFile(withAdmin, []byte("admin = \"/x/admin.sock\"\n"), 0o600)
	withDataDir := filepath.Join(dir, "d.toml")
	os.WriteFile(withDataDir, []byte("data_dir = \"/var/lib/tc\"\n"), 0o600)
	tcpOnly := filepath.Join(dir, "t.toml")
	os.WriteFile(tcpOnly, []byte("admin = \"none\"\nadmin_tcp = \"127.0.0.1:9450\"\nadmin_token_file = \"/etc/tc.token\"\n"), 0o600)
	bad := filepath.Join(dir, "bad.toml")
	// The packaged server: its config names a socket that exists (up), or
	// one that does not (down: the commands fall through).
	sysSock := filepath.Join(dir, "run", "admin.sock")
	os.MkdirAll(filepath.Dir(sysSock), 0o700)
	os.WriteFile(sysSock, nil, 0o600)
	sysCfg := filepath.Join(dir, "etc.toml")
	os.WriteFile(sysCfg, []byte(fmt.Sprintf("admin = %q\n", sysSock)), 0o600)
	downCfg := filepath.Join(dir, "etc-down.toml")
	os.WriteFile(downCfg, []byte(fmt.Sprintf("admin = %q\n", filepath.Join(dir, "gone.sock"))), 0o600)
	pkgUp := packagedPaths{config: sysCfg, admin: filepath.Join(dir, "nothing.sock")}
	pkgDown := packagedPaths{config: downCfg, admin: filepath.Join(dir, "nothing.sock")}
	os.WriteFile(bad, []byte("admn = 1\n"), 0o600)
	for _, tc := range []struct {
		name     string
		g        globals
		env      map[string]string
		addr     string
		howParts []string
	}{
		{"flag", globals{admin: "/f.sock", config: withAdmin}, map[string]string{"TIERCACHE_ADMIN": "/e.sock"}, "/f.sock", []string{"--admin"}},
		{"env", globals{config: withAdmin}, map[string]string{"TIERCACHE_ADMIN": "/e.sock"}, "/e.sock", []string{"$TIERCACHE_ADMIN"}},
		{"config admin", globals{config: withAdmin, dataDir: dir}, nil, "/x/admin.sock", []string{"admin of --config " + withAdmin}},
		{"config data_dir", globals{config: withDataDir, dataDir: dir}, nil, "/var/lib/tc/admin.sock", []string{"--config " + withDataDir}},
		{"config env", globals{dataDir: dir}, map[string]string{"TIERCACHE_CONFIG": withAdmin}, "/x/admin.sock", []string{"$TIERCACHE_CONFIG " + withAdmin}},
		{"config tcp only", globals{config: tcpOnly, dataDir: dir}, nil, "tcp:127.0.0.1:9450", []string{"admin of --config " + tcpOnly}},
		{"bad config", globals{config: bad, dataDir: dir}, nil, filepath.Join(dir, "admin.sock"), []string{"--config " + bad, `unknown key "admn"`}},
		{"data dir", globals{dataDir: dir, dataDirSet: true, packaged: pkgUp}, nil, filepath.Join(dir, "admin.sock"), []string{"the data directory"}},
		{"packaged config", globals{dataDir: dir, packaged: pkgUp}, nil, sysSock, []string{"admin of " + sysCfg}},
		{"packaged config, no socket", globals{dataDir: dir, packaged: pkgDown}, nil, filepath.Join(dir, "admin.sock"), []string{"the data directory"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, k := range []string{"TIERCACHE_ADMIN", "TIERCACHE_CONFIG", "TIERCACHE_DATA_DIR"} {
				t.Setenv(k, tc.env[k])
			}
			addr, how := tc.g.discover()
			if addr != tc.addr {
				t.Errorf("address %q, want %q", addr, tc.addr)
			}
			for _, p := range tc.howParts {
				if !strings.Contains(how, p) {
					t.Errorf("how %q lacks %q", how, p)
				}
			}
		})
	}
}

// TestDiscoverPackagedSocket: as root, with no config of the packaged
// server to read, its /run socket is used when it exists.
func TestDiscoverPackagedSocket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the packaged server's socket is looked for only as root")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	os.WriteFile(sock, nil, 0o600)
	for _, k := range []string{"TIERCACHE_ADMIN", "TIERCACHE_CONFIG", "TIERCACHE_DATA_DIR"} {
		t.Setenv(k, "")
	}
	g := globals{dataDir: t.TempDir(), packaged: packagedPaths{config: filepath.Join(dir, "none.toml"), admin: sock}}
	if addr, how := g.discover(); addr != sock || how != "the packaged server's socket" {
		t.Errorf("discover = %q (%s), want %q (the packaged server's socket)", addr, how, sock)
	}
}

// TestTokenFromConfig: over TCP the commands send the token of the
// server's config file unless --admin-token-file names another.
func TestTokenFromConfig(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.toml")
	os.WriteFile(cfg, []byte("data_dir = \"/var/lib/tc\"\n"), 0o600)
	t.Setenv("TIERCACHE_CONFIG", "")
	for _, tc := range []struct {
		g    globals
		want string
	}{
		{globals{config: cfg, dataDir: dir}, "/var/lib/tc/admin.token"},
		{globals{config: cfg, dataDir: dir, tokenFile: "/x.token"}, "/x.token"},
		{globals{dataDir: dir}, filepath.Join(dir, "admin.token")},
	} {
		if got := tc.g.tokenPath(); got != tc.want {
			t.Errorf("%+v: token %q, want %q", tc.g, got, tc.want)
		}
	}
}

func TestHumanUnits(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "4K": 4096, "4KiB": 4096, "4 KiB": 4096, "1.5M": 3 << 19, "256K/s": 256 << 10, "1g": 1 << 30, "0": 0, "10MB": 10 << 20} {
		if got, err := parseHumanBytes(in); err != nil || got != want {
			t.Errorf("parseHumanBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "K", "-1", "1X", "lots"} {
		if _, err := parseHumanBytes(in); err == nil {
			t.Errorf("parseHumanBytes(%q) accepted", in)
		}
	}
	for _, c := range [][3]string{
		{"writeback_rate_max", "262144", "256 KiB/s"}, {"writeback_rate_max", "0", "0 (no limit)"},
		{"sequential_cutoff", "4194304", "4 MiB"}, {"sequential_cutoff", "0", "0 (off)"},
		{"writeback_percent", "10", "10%"}, {"cache_mode", "writeback", "writeback"},
	} {
		if got := settingOut(c[0], c[1]); got != c[2] {
			t.Errorf("settingOut(%s, %s) = %q, want %q", c[0], c[1], got, c[2])
		}
	}
}
