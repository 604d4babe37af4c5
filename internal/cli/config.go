package cli

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
	"github.com/spf13/cobra"
)

// serveConfig is the TOML file of 'serve --config'. Every key mirrors a
// flag; a flag given on the command line overrides the file.
//
//	data_dir = "/var/lib/tiercache"
//	log_format = "json"           # text | json
//	log_level = "info"
//	cache = "/dev/disk/by-id/nvme-...-part1"
//	listen = ["unix:/run/tiercache/nbd.sock"]
//	admin = "/run/tiercache/admin.sock"
//	admin_tcp = "127.0.0.1:9450"  # also /metrics; needs the bearer token
//	admin_token_file = "/var/lib/tiercache/admin.token"
//	metrics_no_auth = false       # GET /metrics over admin_tcp without the token
//	read_only = false
//	direct = "auto"
//	socket_mode = "0600"
//	shutdown_timeout = "30s"
//	max_connections = 64          # NBD connections served at once
//	max_inflight = "256M"         # payload bytes in flight, all connections
//	force = false
//
//	[backing]                     # NAME = PATH, overriding the recorded paths
//	home = "/dev/disk/by-id/ata-...-part1"
//
//	[export]                      # NAME = PATH, served without a cache
//	scratch = "/srv/scratch.img"
//
//	[s3]                          # the store of s3:// images whose URI does not name it
//	endpoint = "https://s3.example.net"
//	region = "eu-west-1"
//	path_style = true
//	gc_rate = "16M"               # garbage collection, bytes/s of live data; "unlimited"
type serveConfig struct {
	DataDir         *string           `toml:"data_dir"`
	LogFormat       *string           `toml:"log_format"`
	LogLevel        *string           `toml:"log_level"`
	Cache           *string           `toml:"cache"`
	Listen          []string          `toml:"listen"`
	Admin           *string           `toml:"admin"`
	AdminTCP        *string           `toml:"admin_tcp"`
	AdminTokenFile  *string           `toml:"admin_token_file"`
	MetricsNoAuth   *bool             `toml:"metrics_no_auth"`
	ReadOnly        *bool             `toml:"read_only"`
	Direct          *string           `toml:"direct"`
	SocketMode      *string           `toml:"socket_mode"`
	ShutdownTimeout *string           `toml:"shutdown_timeout"`
	MaxConnections  *int              `toml:"max_connections"`
	MaxInFlight     *string           `toml:"max_inflight"`
	Force           *bool             `toml:"force"`
	Backing         map[string]string `toml:"backing"`
	Export          map[string]string `toml:"export"`
	S3              *s3Config         `toml:"s3"`
}

// s3Config is the [s3] table: where the store of object-store image URIs
// is when the URI does not say (image's --endpoint, --region,
// --path-style; an endpoint implies path-style addressing).
// Credentials are never read from here.
//
// gc_rate bounds the live data an owner's garbage collection reads and
// rewrites per second ("16M", the default; "unlimited").
type s3Config struct {
	Endpoint  *string `toml:"endpoint"`
	Region    *string `toml:"region"`
	PathStyle *bool   `toml:"path_style"`
	GCRate    *string `toml:"gc_rate"`
}

// loadServeConfig parses path. Unknown keys are errors naming the line.
func loadServeConfig(path string) (*serveConfig, error) {
	var c serveConfig
	md, err := toml.DecodeFile(path, &c)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			return nil, fmt.Errorf("config %s:%d:%d: %s", path, pe.Position.Line, pe.Position.Col, pe.Message)
		}
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		var msgs []string
		seen := map[string]bool{}
		for _, k := range und {
			seen[k.String()] = true
		}
	keys:
		for _, k := range und {
			for i := 1; i < len(k); i++ {
				if seen[k[:i].String()] {
					continue keys // inside an unknown table: reported with it
				}
			}
			msgs = append(msgs, fmt.Sprintf("%s:%d: unknown key %q", path, keyLine(path, k), k.String()))
		}
		sort.Strings(msgs)
		return nil, fmt.Errorf("config: %s (known keys: data_dir, log_format, log_level, cache, listen, admin, admin_tcp, admin_token_file, metrics_no_auth, read_only, direct, socket_mode, shutdown_timeout, max_connections, max_inflight, force, [backing], [export], [s3])",
			strings.Join(msgs, "; "))
	}
	return &c, nil
}

// keyLine finds the line that defines key k (BurntSushi/toml does not
// expose key positions): a "name =" line inside the key's table, or the
// table header itself. 0 when not found.
func keyLine(path string, k toml.Key) int {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	table := strings.Join(k[:len(k)-1], ".")
	last := regexp.QuoteMeta(k[len(k)-1])
	assign := regexp.MustCompile(`^\s*("` + last + `"|'` + last + `'|` + last + `)\s*=`)
	header := regexp.MustCompile(`^\s*\[+\s*` + regexp.QuoteMeta(k.String()) + `\s*\]+`)
	hdr := regexp.MustCompile(`^\s*\[+\s*([^\]]+?)\s*\]+`)
	cur := ""
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if header.MatchString(line) {
			return n
		}
		if m := hdr.FindStringSubmatch(line); m != nil {
			cur = m[1]
			continue
		}
		if cur == table && assign.MatchString(line) {
			return n
		}
	}
	return 0
}

// applyServeConfig sets every flag the command line did not set from the
// file.
func applyServeConfig(cmd *cobra.Command, g *globals, o *serveOptions, c *serveConfig) error {
	fs := cmd.Flags()
	setS := func(flag string, dst *string, v *string) {
		if v != nil && !fs.Changed(flag) {
			*dst = *v
		}
	}
	setS("data-dir", &g.dataDir, c.DataDir)
	setS("log-format", &g.logFormat, c.LogFormat)
	setS("log-level", &g.logLevel, c.LogLevel)
	setS("cache", &o.cache, c.Cache)
	setS("admin", &g.admin, c.Admin)
	setS("admin-tcp", &o.adminTCP, c.AdminTCP)
	setS("admin-token-file", &g.tokenFile, c.AdminTokenFile)
	if c.MetricsNoAuth != nil && !fs.Changed("metrics-no-auth") {
		o.metricsNoAuth = *c.MetricsNoAuth
	}
	setS("direct", &o.direct, c.Direct)
	setS("socket-mode", &o.socketMode, c.SocketMode)
	if c.ReadOnly != nil && !fs.Changed("read-only") {
		o.readOnly = *c.ReadOnly
	}
	if c.Force != nil && !fs.Changed("force") {
		o.force = *c.Force
	}
	setS("max-inflight", &o.maxInFlight, c.MaxInFlight)
	if c.MaxConnections != nil && !fs.Changed("max-connections") {
		o.maxConns = *c.MaxConnections
	}
	if c.ShutdownTimeout != nil && !fs.Changed("shutdown-timeout") {
		d, err := time.ParseDuration(*c.ShutdownTimeout)
		if err != nil {
			return fmt.Errorf("config: shutdown_timeout %q: %v", *c.ShutdownTimeout, err)
		}
		o.drainWait = d
	}
	if len(c.Listen) > 0 && !fs.Changed("listen") {
		o.listens = c.Listen
	}
	if len(c.Backing) > 0 && !fs.Changed("backing") {
		o.backings = nil
		for _, name := range sortedKeys(c.Backing) {
			o.backings = append(o.backings, name+"="+c.Backing[name])
		}
	}
	if len(c.Export) > 0 && !fs.Changed("export") {
		o.exports = nil
		for _, name := range sortedKeys(c.Export) {
			o.exports = append(o.exports, name+"="+c.Export[name])
		}
	}
	return nil
}

func sortedKeys(m map[string]string) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
