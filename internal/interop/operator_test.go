package interop

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestOperatorCommands drives the operator's commands through the real
// binary against a server started from a config file, the way the packaged
// server runs: the commands find it through the same file (--config and
// $TIERCACHE_CONFIG) and say which server answered; status and list fit
// one screen; every command's --json is one object, snake_case throughout,
// naming the server; settings go in and come out in human units; stats
// shows µs percentiles and an iostat-like line per interval; SIGTERM says
// how much dirty data stays in the cache; show and set --cache read and
// change the stopped set's settings offline; --version and shell
// completion work.
func TestOperatorCommands(t *testing.T) {
	need(t, "qemu-io")
	cs := formatSet(t, 32*mib, 64*mib, []string{"disk"}, "--bucket-size", "256K")
	dir := cs.dir
	sock, adminSock := filepath.Join(dir, "nbd.sock"), filepath.Join(dir, "admin.sock")
	cfg := filepath.Join(dir, "tiercache.toml")
	os.WriteFile(cfg, []byte(fmt.Sprintf("data_dir = %q\ncache = %q\nlisten = [\"unix:%s\"]\nadmin = %q\nlog_format = \"text\"\n", dir, cs.cache, sock, adminSock)), 0o600)
	s := startServerRaw(t, sock, "serve", "--config", cfg)
	home := t.TempDir() // no other server's data directory in the way
	tcEnv := func(env []string, args ...string) (string, error) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), append([]string{"HOME=" + home, "TIERCACHE_ADMIN=", "TIERCACHE_DATA_DIR=", "TIERCACHE_CONFIG=", "XDG_DATA_HOME=",
			// The race detector's default 1 s pause at exit, 30 times over.
			"GORACE=halt_on_error=1 atexit_sleep_ms=0"}, env...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	tc := func(args ...string) string {
		t.Helper()
		out, err := tcEnv(nil, append(args, "--config", cfg)...)
		if err != nil {
			t.Fatalf("tiercache %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	waitFor(t, 10*time.Second, func() bool { _, err := tcEnv(nil, "status", "--config", cfg); return err == nil }, "the admin API")

	// Who answered: the first line of every command.
	out := tc("status")
	uuid := regexp.MustCompile(`cache set\s+([0-9a-f-]{36})`).FindStringSubmatch(out)
	if uuid == nil {
		t.Fatalf("status shows no cache set UUID:\n%s", out)
	}
	for _, want := range []string{"admin API     unix:" + adminSock + " (found by admin of --config " + cfg + ")", "NBD           unix:" + sock,
		"cache device  " + cs.cache + " (32 MiB", "state         ok;", "EXPORT  MODE       SIZE", "disk    writeback  64 MiB"} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	header := "server " + adminSock + " (admin of --config " + cfg + "): pid "
	for _, cmd := range [][]string{{"list"}, {"usage"}, {"stats"}, {"set", "disk"}} {
		if out := tc(cmd...); !strings.HasPrefix(out, header) || !strings.Contains(strings.SplitN(out, "\n", 2)[0], "cache set "+uuid[1]+" on "+cs.cache) {
			t.Errorf("%s: the first line does not name the server:\n%s", cmd[0], out)
		}
	}
	for _, cmd := range []string{"status", "list", "usage", "stats"} {
		if l := regexp.MustCompile(`(?m)^.* +$`).FindString(tc(cmd)); l != "" {
			t.Errorf("%s prints a line with trailing spaces: %q", cmd, l)
		}
	}
	if out, err := tcEnv([]string{"TIERCACHE_CONFIG=" + cfg}, "list"); err != nil || !strings.Contains(out, "(admin of $TIERCACHE_CONFIG "+cfg+")") || !strings.Contains(out, "disk") {
		t.Errorf("list with $TIERCACHE_CONFIG: %v\n%s", err, out)
	}
	if out, err := tcEnv(nil, "usage"); err == nil || !strings.Contains(out, "no tiercache server is running at "+filepath.Join(home, ".local/share/tiercache/admin.sock")+" (the data directory") {
		t.Errorf("usage without a way to the server: %v\n%s", err, out)
	}

	// Human units in and out; stored as numbers.
	out = tc("set", "disk", "writeback_rate_max=4KiB", "sequential_cutoff=1.5M")
	for _, want := range []string{`writeback_rate_max +4 KiB/s +\(changed\)`, `sequential_cutoff +1.5 MiB +\(changed\)`, `writeback_percent +10%\n`} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("set does not match %s:\n%s", want, out)
		}
	}
	if out, err := tcEnv(nil, "set", "disk", "writeback_rate_max=lots", "--config", cfg); err == nil || !strings.Contains(out, "want a byte count such as 4096, 512K, 4MiB or 1.5G") {
		t.Errorf("set with a bad size: %v\n%s", err, out)
	}
	if out, err := tcEnv(nil, "detach", "--config", cfg); err == nil || !strings.Contains(out, "detach needs the EXPORT to detach (exports: disk)") {
		t.Errorf("detach without an export: %v\n%s", err, out)
	}

	// Scattered writes: dirty data that the 4 KiB/s writeback leaves.
	var cmds []string
	for i := 0; i < 64; i++ {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P 0x%02x %d 4k", i, int64(i)<<20))
		cmds = append(cmds, "-c", fmt.Sprintf("read %d 4k", int64(i)<<20))
	}
	run(t, time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("disk")}, append(cmds, "-c", "flush")...)...)

	out = tc("stats")
	for _, re := range []string{`counters since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(up `, `write_ops\s+64\n`, `bypass_write_bytes\s+0 B`,
		`latency_write\s+n=64 mean \d+ p50 \d+ p99 \d+ p99.9 \d+ µs`, `latency_read_cache\s+n=64 `, `writeback_target_rate\s+`, `throttle_time\s+\d+ µs`} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("stats does not match %s:\n%s", re, out)
		}
	}
	out = tc("stats", "0.2", "2")
	if lines := regexp.MustCompile(`(?m)^\d\d:\d\d:\d\d  disk +\d+ +\d+ `).FindAllString(out, -1); len(lines) != 2 || !strings.Contains(out, "r_p99_us  w_p99_us") {
		t.Errorf("stats 0.2 2: want a header and 2 lines for disk:\n%s", out)
	}

	// --json: one object per command, snake_case keys, the server first.
	upper := regexp.MustCompile(`"[^"]*[A-Z][^"]*"\s*:`)
	for _, cmd := range [][]string{{"status"}, {"list"}, {"usage"}, {"stats"}, {"set", "disk"}, {"flush", "disk"}, {"check"}} {
		out := tc(append(cmd, "--json")...)
		var v struct {
			Server struct {
				Admin   string `json:"admin"`
				SetUUID string `json:"set_uuid"`
			} `json:"server"`
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil || v.Server.Admin != adminSock || v.Server.SetUUID != uuid[1] {
			t.Errorf("%s --json: %v, server %+v:\n%s", cmd[0], err, v.Server, out)
		}
		if k := upper.FindString(out); k != "" {
			t.Errorf("%s --json: key %s is not snake_case", cmd[0], k)
		}
	}
	var set struct {
		Settings map[string]string `json:"settings"`
	}
	if err := json.Unmarshal([]byte(tc("set", "disk", "--json")), &set); err != nil || set.Settings["writeback_rate_max"] != "4096" || set.Settings["sequential_cutoff"] != "1572864" {
		t.Errorf("set --json: %v %+v", err, set)
	}
	// flush wrote everything back; new dirty data for the stop.
	run(t, time.Minute, "qemu-io", append([]string{"-f", "raw", s.uri("disk")}, append(cmds[:64], "-c", "flush")...)...)
	var st struct {
		Set struct {
			DirtyBytes int64 `json:"dirty_bytes"`
		} `json:"set"`
	}
	if err := json.Unmarshal([]byte(tc("status", "--json")), &st); err != nil || st.Set.DirtyBytes == 0 {
		t.Fatalf("status --json: %v, dirty %d: the stop below would prove nothing", err, st.Set.DirtyBytes)
	}

	// Completion asks the server for export names and knows the keys.
	if out, _ := tcEnv(nil, "__complete", "set", "--config", cfg, ""); !strings.Contains(out, "disk") {
		t.Errorf("completion of set's export:\n%s", out)
	}
	if out, _ := tcEnv(nil, "__complete", "set", "disk", "cache_mode="); !strings.Contains(out, "cache_mode=writethrough") {
		t.Errorf("completion of a setting's value:\n%s", out)
	}

	// SIGTERM: the log says what stays in the cache.
	s.stop()
	if !regexp.MustCompile(`stopped cleanly; dirty data stays in the cache, written back after the next start.*dirty="?\d`).MatchString(s.log.String()) {
		t.Errorf("the stop does not say what dirty data stays:\n%s", s.log)
	}

	// Offline: show reads the superblock, set --cache changes it.
	out = tc("show", "--cache", cs.cache)
	for _, want := range []string{`cache set\s+` + uuid[1], `clean shutdown\s+yes`, `volume disk\s+` + regexp.QuoteMeta(cs.backings["disk"]) + `, 64 MiB`, `\n  writeback_rate_max\s+4 KiB/s`} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("show does not match %s:\n%s", want, out)
		}
	}
	out = tc("set", "--cache", cs.cache, "disk", "cache_mode=writethrough", "writeback_rate_max=0")
	if !regexp.MustCompile(`cache_mode +writethrough +\(changed\)`).MatchString(out) || !regexp.MustCompile(`writeback_rate_max +0 \(no limit\) +\(changed\)`).MatchString(out) {
		t.Errorf("set --cache:\n%s", out)
	}
	var sh struct {
		Volumes []struct {
			Name     string            `json:"name"`
			Settings map[string]string `json:"settings"`
		} `json:"volumes"`
	}
	if err := json.Unmarshal([]byte(tc("show", "--cache", cs.cache, "--json")), &sh); err != nil || len(sh.Volumes) != 1 || sh.Volumes[0].Settings["cache_mode"] != "writethrough" {
		t.Errorf("show --json after set --cache: %v %+v", err, sh)
	}
	if out, err := tcEnv(nil, "set", "--cache", cs.cache, "nope"); err == nil || !strings.Contains(out, `has no volume "nope" (volumes: disk)`) {
		t.Errorf("set --cache of a missing volume: %v\n%s", err, out)
	}

	// Every offline command's --json too.
	jsonObject := func(args ...string) map[string]any {
		t.Helper()
		cmd := exec.Command(bin, append(args, "--json")...)
		cmd.Env = append(os.Environ(), "GORACE=halt_on_error=1 atexit_sleep_ms=0")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		b, err := cmd.Output()
		out := string(b)
		if err != nil {
			t.Errorf("%s --json: %v\n%s%s", args[0], err, out, stderr.String())
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			t.Errorf("%s --json: %v\n%s", args[0], err, out)
		}
		if k := upper.FindString(out); k != "" {
			t.Errorf("%s --json: key %s is not snake_case", args[0], k)
		}
		return m
	}
	if m := jsonObject("check", "--cache", cs.cache); fmt.Sprint(m["problems"]) != "[]" || m["set_uuid"] != uuid[1] {
		t.Errorf("check --cache --json: %v", m)
	}
	jsonObject("inspect", "superblock", "--cache", cs.cache)
	jsonObject("inspect", "journal", "--cache", cs.cache)
	if m := jsonObject("inspect", "index", "--cache", cs.cache, "--limit", "2"); len(fmt.Sprint(m["entries"])) < 10 {
		t.Errorf("inspect index --limit 2 --json: %v", m["entries"])
	}
	if m := jsonObject("detach", "--cache", cs.cache, "disk"); m["export"] != "disk" {
		t.Errorf("detach --cache --json: %v", m)
	}
	if m := jsonObject("attach", "--cache", cs.cache, "disk="+cs.backings["disk"]); m["name"] != "disk" || m["mode"] != "writeback" {
		t.Errorf("attach --cache --json: %v", m)
	}
	if m := jsonObject("format", "--cache", sparseFile(t, dir, "c2.img", 16*mib)); m["buckets"] == nil || m["set_uuid"] == "" {
		t.Errorf("format --json: %v", m)
	}

	if out, _ := tcEnv(nil, "--version"); !regexp.MustCompile(`^tiercache version \S.*, go1\.\d+`).MatchString(out) {
		t.Errorf("--version: %q", out)
	}
}

// TestMakeInstall runs 'make install' into a staging directory (DESTDIR)
// and checks what a package would hold: the binary with its version, the
// systemd unit pointing at it, the config file (kept when already there),
// bash/zsh/fish completion and a man page per command.
func TestMakeInstall(t *testing.T) {
	need(t, "make", "git")
	stage := t.TempDir()
	install := func() {
		t.Helper()
		cmd := exec.Command("make", "-C", "../..", "install", "DESTDIR="+stage, "PREFIX=/usr")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("make install: %v\n%s", err, out)
		}
	}
	install()
	read := func(p string) string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(stage, p))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	unit := read("etc/systemd/system/tiercache.service")
	if !strings.Contains(unit, "ExecStart=/usr/bin/tiercache serve --config /etc/tiercache/tiercache.toml") {
		t.Errorf("installed unit does not start the installed binary:\n%s", unit)
	}
	for p, want := range map[string]string{
		"usr/share/bash-completion/completions/tiercache":    "__start_tiercache",
		"usr/share/zsh/site-functions/_tiercache":            "#compdef tiercache",
		"usr/share/fish/vendor_completions.d/tiercache.fish": "complete -c tiercache",
		"usr/share/man/man1/tiercache.1":                     ".TH \"TIERCACHE\" \"1\"",
		"usr/share/man/man1/tiercache-status.1":              "tiercache-status",
		"etc/tiercache/tiercache.toml":                       "admin = \"/run/tiercache/admin.sock\"",
	} {
		if got := read(p); !strings.Contains(got, want) {
			t.Errorf("%s lacks %q", p, want)
		}
	}
	out, err := exec.Command(filepath.Join(stage, "usr/bin/tiercache"), "--version").CombinedOutput()
	if err != nil || !regexp.MustCompile(`^tiercache version [0-9a-f]{7,}(-dirty)?, go1\.`).Match(out) && !strings.HasPrefix(string(out), "tiercache version v") {
		t.Errorf("installed --version: %v %q (want git describe's version)", err, out)
	}
	// An edited config survives a second install.
	cfg := filepath.Join(stage, "etc/tiercache/tiercache.toml")
	os.WriteFile(cfg, []byte("# edited\n"), 0o644)
	install()
	if got := read("etc/tiercache/tiercache.toml"); got != "# edited\n" {
		t.Errorf("make install replaced an edited config: %q", got)
	}
}
