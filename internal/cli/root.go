// Package cli implements the tiercache subcommands. cmd/tiercache only calls
// Main, so every command is importable and testable in-process.
package cli

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
)

// exitError carries a specific exit code out of a command.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// Main runs the CLI with args and returns the process exit code.
func Main(args []string) int {
	return run(args, os.Stdout, os.Stderr)
}

func run(args []string, stdout, stderr io.Writer) int {
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	if err := root.Execute(); err != nil {
		fmt.Fprintf(stderr, "tiercache: %v\n", err)
		var ee *exitError
		if errors.As(err, &ee) {
			return ee.code
		}
		return 1
	}
	return 0
}

// globals are the flags every subcommand shares.
type globals struct {
	dataDir   string
	logFormat string
	logLevel  string
	admin     string // admin API address (--admin)
	config    string // --config FILE
	tokenFile string // admin API bearer token for TCP (--admin-token-file)
	// dataDirSet: --data-dir was given (the admin commands then look
	// there before the packaged server's socket).
	dataDirSet bool
	packaged   packagedPaths // the packaged server's config and socket
	stdout     io.Writer
	stderr     io.Writer
}

func newRoot(stdout, stderr io.Writer) *cobra.Command {
	g := &globals{stdout: stdout, stderr: stderr, packaged: packaged}
	root := &cobra.Command{
		Use:   "tiercache",
		Short: "A userspace tiered block device: an SSD cache in front of HDDs, served over NBD",
		Long: `tiercache puts a small fast device (SSD) in front of one or more large slow
devices (HDDs) and exports the result over NBD to the Linux kernel, QEMU,
libnbd and fio.

With no arguments, 'tiercache serve' creates sparse files under the data
directory and serves them, so you can try it at once:

    tiercache serve
    nbdinfo "nbd+unix:///default?socket=$HOME/.local/share/tiercache/tiercache.sock"

See which server the other commands talk to, and what it serves:

    tiercache status`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       versionString(),
	}
	root.PersistentPreRun = func(cmd *cobra.Command, _ []string) {
		g.dataDirSet = cmd.Flags().Changed("data-dir")
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	pf := root.PersistentFlags()
	pf.StringVar(&g.dataDir, "data-dir", defaultDataDir(), "directory for the embedded default's files, sockets and state ($TIERCACHE_DATA_DIR)")
	pf.StringVar(&g.logFormat, "log-format", "text", "log format: text or json")
	pf.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	pf.StringVar(&g.tokenFile, "admin-token-file", "", "bearer token `FILE` of the admin API over TCP (default DATA_DIR/admin.token); serve creates it, mode 0600, with --admin-tcp")
	pf.StringVar(&g.admin, "admin", "", "admin API socket of the running server (default: $TIERCACHE_ADMIN, the config file's, the packaged server's, else DATA_DIR/admin.sock); serve: where to listen, \"none\" to disable")
	pf.StringVar(&g.config, "config", "", "the server's TOML config `FILE` ($TIERCACHE_CONFIG; see docs/OPERATIONS.md): serve reads its settings (flags override them), the other commands its admin socket")

	root.AddCommand(newServeCmd(g), newFormatCmd(g))
	root.AddCommand(newStatusCmd(g), newListCmd(g), newUsageCmd(g), newStatsCmd(g), newSetCmd(g), newFlushCmd(g), newDetachCmd(g), newAttachCmd(g),
		newCheckCmd(g), newInspectCmd(g), newShowCmd(g), newLostWritesCmd(g), newIdentityCmd(g), newImageCmd(g), newReplaceCmd(g))
	root.AddCommand(newManCmd(root))
	return root
}

// defaultDataDir is $TIERCACHE_DATA_DIR, else $XDG_DATA_HOME/tiercache, else
// ~/.local/share/tiercache.
func defaultDataDir() string {
	if d := os.Getenv("TIERCACHE_DATA_DIR"); d != "" {
		return d
	}
	if d := os.Getenv("XDG_DATA_HOME"); d != "" {
		return filepath.Join(d, "tiercache")
	}
	if h, err := os.UserHomeDir(); err == nil {
		return filepath.Join(h, ".local", "share", "tiercache")
	}
	return "tiercache-data"
}

func (g *globals) logger() (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(g.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", g.logLevel)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch strings.ToLower(g.logFormat) {
	case "text":
		return slog.New(slog.NewTextHandler(g.stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(g.stderr, opts)), nil
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", g.logFormat)
	}
}
