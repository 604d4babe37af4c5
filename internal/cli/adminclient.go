package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/tiercache/tiercache/admin"
)

// adminAddr is where the running server's admin API is: --admin, else
// $TIERCACHE_ADMIN, else DATA_DIR/admin.sock (the embedded default's).
func (g *globals) adminAddr() string {
	if g.admin != "" {
		return g.admin
	}
	if a := os.Getenv("TIERCACHE_ADMIN"); a != "" {
		return a
	}
	return filepath.Join(g.dataDir, "admin.sock")
}

// client returns an admin API client for the server the commands talk to
// (g.discover); errors it returns say how the address was chosen when no
// server answers. Over TCP it sends the bearer token from g.tokenPath()
// (the server's 401 says where it is if it cannot be read).
func (g *globals) client() *admin.Client {
	addr, _ := g.discover()
	return g.clientFor(addr)
}

// clientFor returns a client of the admin API at addr, with the bearer
// token for a tcp: address.
func (g *globals) clientFor(addr string) *admin.Client {
	c := admin.NewClient(addr)
	if strings.HasPrefix(addr, "tcp:") {
		if tok, err := os.ReadFile(g.tokenPath()); err == nil {
			c.SetToken(strings.TrimSpace(string(tok)))
		}
	}
	return c
}

// tokenPath is the admin API's bearer token file: --admin-token-file, else
// the config file's (its admin_token_file, else its data_dir's
// admin.token), else DATA_DIR/admin.token.
func (g *globals) tokenPath() string {
	if g.tokenFile != "" {
		return g.tokenFile
	}
	if p, _ := g.configPath(); p != "" {
		if c, err := loadServeConfig(p); err == nil {
			switch {
			case c.AdminTokenFile != nil:
				return *c.AdminTokenFile
			case c.DataDir != nil:
				return filepath.Join(*c.DataDir, "admin.token")
			}
		}
	}
	return filepath.Join(g.dataDir, "admin.token")
}

// apiErr makes an admin API error readable on the command line.
func (g *globals) apiErr(err error) error {
	if errors.Is(err, admin.ErrNoServer) {
		addr, how := g.discover()
		return fmt.Errorf("no tiercache server is running at %s (%s; start one with 'tiercache serve', or point to it with --admin PATH, $TIERCACHE_ADMIN or --config FILE)", addr, how)
	}
	return err
}

// cmdContext is the command's context, never nil.
func cmdContext(cmd *cobra.Command) context.Context {
	if ctx := cmd.Context(); ctx != nil {
		return ctx
	}
	return context.Background()
}

// bar draws frac of width cells.
func bar(frac float64, width int) string {
	frac = min(max(frac, 0), 1)
	n := int(frac*float64(width) + 0.5)
	if frac > 0 && n == 0 {
		n = 1
	}
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", width-n) + "]"
}

// pct prints part/whole as a percentage.
func pct(part, whole int64) string {
	if whole <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(part)/float64(whole))
}

// humanDur prints a duration for ETAs and elapsed times.
func humanDur(sec float64) string {
	if sec < 0 {
		return "-"
	}
	d := time.Duration(sec * float64(time.Second))
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

// humanRate prints bytes per second.
func humanRate(r float64) string {
	if r <= 0 {
		return "0 B/s"
	}
	return human(int64(r)) + "/s"
}

// table is a tabwriter whose output loses its trailing spaces (the padding
// of empty last columns) on the way to out.
type table struct {
	*tabwriter.Writer
	buf bytes.Buffer
	out io.Writer
}

func newTable(out io.Writer, flags uint) *table {
	t := &table{out: out}
	t.Writer = tabwriter.NewWriter(&t.buf, 0, 4, 2, ' ', flags)
	return t
}

// Flush writes the table to out.
func (t *table) Flush() error {
	if err := t.Writer.Flush(); err != nil {
		return err
	}
	var b strings.Builder
	for _, l := range strings.SplitAfter(t.buf.String(), "\n") {
		nl := strings.HasSuffix(l, "\n")
		b.WriteString(strings.TrimRight(l, " \n"))
		if nl {
			b.WriteByte('\n')
		}
	}
	t.buf.Reset()
	_, err := io.WriteString(t.out, b.String())
	return err
}
