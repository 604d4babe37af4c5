package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// Version is set at build time with -ldflags "-X .../cli.Version=..."
// (make build sets git describe's output); "dev" otherwise.
var Version = "dev"

// versionString is what --version and /v1/status print: the version (the
// ldflags one, else the module version of a 'go install ...@VERSION'),
// the VCS revision and time the binary was built from (with "+modified"
// when the tree had uncommitted changes) and the Go version.
func versionString() string {
	v, rev, when, modified := Version, "", "", false
	if info, ok := debug.ReadBuildInfo(); ok {
		if v == "dev" && info.Main.Version != "" && info.Main.Version != "(devel)" {
			v = info.Main.Version
		}
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.time":
				when = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if modified {
			rev += "+modified"
		}
		v += " (" + rev
		if when != "" {
			v += ", " + when
		}
		v += ")"
	}
	return v + ", " + runtime.Version()
}

// newManCmd writes the man pages (hidden: make install runs it).
func newManCmd(root *cobra.Command) *cobra.Command {
	return &cobra.Command{
		Use:    "man DIR",
		Short:  "Write a man page per command into DIR (section 1)",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir := args[0]
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
			root.DisableAutoGenTag = true
			hdr := &doc.GenManHeader{Title: "TIERCACHE", Section: "1", Source: "tiercache " + Version, Manual: "tiercache manual"}
			if err := doc.GenManTree(root, hdr, dir); err != nil {
				return fmt.Errorf("man pages: %w", err)
			}
			m, _ := filepath.Glob(filepath.Join(dir, "*.1"))
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %d man pages into %s\n", len(m), dir)
			return nil
		},
	}
}
