package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/tiercache/tiercache/admin"
)

// packagedPaths are where the packaged server (dist/) keeps its
// configuration and admin socket; globals holds them so that tests give
// their own.
type packagedPaths struct{ config, admin string }

var packaged = packagedPaths{config: "/etc/tiercache/tiercache.toml", admin: "/run/tiercache/admin.sock"}

// discover returns the admin address the commands talk to, and how it was
// chosen (for every output and error): --admin; $TIERCACHE_ADMIN; the
// admin socket of --config FILE ($TIERCACHE_CONFIG); an explicit
// --data-dir or $TIERCACHE_DATA_DIR; the packaged server's (the admin key
// of /etc/tiercache/tiercache.toml, else /run/tiercache/admin.sock when
// root), when its socket exists; else DATA_DIR/admin.sock.
func (g *globals) discover() (addr, how string) {
	if g.admin != "" {
		return g.admin, "--admin"
	}
	if a := os.Getenv("TIERCACHE_ADMIN"); a != "" {
		return a, "$TIERCACHE_ADMIN"
	}
	if p, how := g.configPath(); p != "" {
		a, err := configAdmin(p, g.dataDir)
		if err != nil {
			return filepath.Join(g.dataDir, "admin.sock"), fmt.Sprintf("%s: %v", how, err)
		}
		return a, "admin of " + how
	}
	if g.dataDirSet || os.Getenv("TIERCACHE_DATA_DIR") != "" {
		return filepath.Join(g.dataDir, "admin.sock"), "the data directory"
	}
	if a, err := configAdmin(g.packaged.config, ""); err == nil && a != "" && exists(a) {
		return a, "admin of " + g.packaged.config
	}
	if os.Geteuid() == 0 && exists(g.packaged.admin) {
		return g.packaged.admin, "the packaged server's socket"
	}
	return filepath.Join(g.dataDir, "admin.sock"), "the data directory"
}

// configPath is --config FILE, else $TIERCACHE_CONFIG, with how it was
// given; "" when neither is.
func (g *globals) configPath() (string, string) {
	if g.config != "" {
		return g.config, "--config " + g.config
	}
	if p := os.Getenv("TIERCACHE_CONFIG"); p != "" {
		return p, "$TIERCACHE_CONFIG " + p
	}
	return "", ""
}

// configAdmin is the admin socket a server started with the config file at
// path listens on: its admin key (its admin_tcp when that is "none"), else
// DATA_DIR/admin.sock of its data_dir (dataDir when the file has none).
func configAdmin(path, dataDir string) (string, error) {
	c, err := loadServeConfig(path)
	if err != nil {
		return "", err
	}
	if c.Admin != nil && *c.Admin == "none" && c.AdminTCP != nil {
		return "tcp:" + *c.AdminTCP, nil
	}
	if c.Admin != nil {
		return *c.Admin, nil
	}
	if c.DataDir != nil {
		dataDir = *c.DataDir
	}
	if dataDir == "" {
		return "", nil
	}
	return filepath.Join(dataDir, "admin.sock"), nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// serverID says which server answered: every admin command prints it
// first (and --json puts it under "server").
type serverID struct {
	Admin   string `json:"admin"` // the socket (or tcp:HOST:PORT) asked
	Found   string `json:"found_by"`
	PID     int    `json:"pid"`
	Version string `json:"version"`
	SetUUID string `json:"set_uuid,omitempty"` // "" when the server serves no cache set
	Cache   string `json:"cache_device,omitempty"`
}

func (s serverID) String() string {
	set := "no cache set"
	if s.SetUUID != "" {
		set = "cache set " + s.SetUUID + " on " + s.Cache
	}
	return fmt.Sprintf("server %s (%s): pid %d, %s", s.Admin, s.Found, s.PID, set)
}

// session is one admin command's connection to the server.
type session struct {
	c  *admin.Client
	id serverID
	st admin.Status // as the command started
}

// connect finds the server (discover) and asks it who it is.
func (g *globals) connect(ctx context.Context) (*session, error) {
	addr, how := g.discover()
	c := g.clientFor(addr)
	st, err := c.Status(ctx)
	if err != nil {
		return nil, g.apiErr(err)
	}
	id := serverID{Admin: addr, Found: how, PID: st.PID, Version: st.Version}
	if st.Set != nil {
		id.SetUUID, id.Cache = st.Set.UUID, st.Set.CachePath
	}
	return &session{c: c, id: id, st: st}, nil
}

// header prints which server answered (human output).
func (s *session) header(w io.Writer) {
	fmt.Fprintln(w, s.id.String())
}

// writeServerJSON writes v (a struct or map marshalling to a JSON object)
// as one indented JSON object with "server" (serverID) as its first key.
func writeServerJSON(w io.Writer, id serverID, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	sb, err := json.Marshal(id)
	if err != nil {
		return err
	}
	body := strings.TrimSpace(string(b))
	if !strings.HasPrefix(body, "{") {
		return fmt.Errorf("internal: %T does not marshal to a JSON object", v)
	}
	out := `{"server":` + string(sb)
	if body != "{}" {
		out += "," + body[1:]
	} else {
		out += "}"
	}
	var buf strings.Builder
	var m json.RawMessage = json.RawMessage(out)
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(m); err != nil {
		return err
	}
	_, err = io.WriteString(w, buf.String())
	return err
}
