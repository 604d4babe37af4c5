package interop

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Tests of the trust boundaries (docs/RELIABILITY.md, "Trust boundaries")
// through the built binary: who may talk to the admin API, what a TLS
// listener lets in, which export names and request bodies are accepted.

// TestTLSClientCAImpliesRequired: --tls-client-ca without --tls-required
// used to let plaintext clients list the exports (whose descriptions carry
// file paths) and read and write them, as if no certificate were needed.
// Requiring client certificates now requires TLS of every client, and the
// contradiction --tls-required=false is refused at start-up.
func TestTLSClientCAImpliesRequired(t *testing.T) {
	need(t, "nbdinfo")
	dir := t.TempDir()
	pki := filepath.Join(dir, "pki")
	os.Mkdir(pki, 0o700)
	writePKI(t, pki)
	img := randomFile(t, dir, "disk.img", mib, 3)
	port := freePort(t)
	sock := filepath.Join(dir, "s.sock")
	tlsArgs := []string{"--tls-cert", filepath.Join(pki, "server-cert.pem"), "--tls-key", filepath.Join(pki, "server-key.pem"),
		"--tls-client-ca", filepath.Join(pki, "ca-cert.pem")}
	startServerRaw(t, sock, append([]string{"serve", "--listen", "unix:" + sock, "--listen", fmt.Sprintf("tcp:127.0.0.1:%d", port),
		"--export", "disk=" + img, "--admin", "none"}, tlsArgs...)...)

	for _, args := range [][]string{
		{"--list", fmt.Sprintf("nbd://localhost:%d", port)},
		{fmt.Sprintf("nbd://localhost:%d/disk", port)},
		{"--list", "nbd+unix://?socket=" + sock},
	} {
		out, err := runErr(30*time.Second, "nbdinfo", args...)
		if err == nil || strings.Contains(out, img) || strings.Contains(out, "export-size") {
			t.Errorf("plaintext nbdinfo %s with --tls-client-ca: err %v; want a refusal without the export list or size:\n%s", strings.Join(args, " "), err, out)
		}
	}
	// With its certificate the client gets in.
	out := run(t, 30*time.Second, "nbdinfo", fmt.Sprintf("nbds://localhost:%d/disk?tls-certificates=%s", port, pki))
	if !strings.Contains(out, "export-size: 1048576") {
		t.Fatalf("nbdinfo with a client certificate:\n%s", out)
	}

	args := append([]string{"serve", "--export", "disk=" + img, "--admin", "none", "--listen", "unix:" + filepath.Join(dir, "t.sock"), "--tls-required=false"}, tlsArgs...)
	out, err := runErr(30*time.Second, bin, args...)
	if err == nil || !strings.Contains(out, "--tls-client-ca requires TLS of every client") {
		t.Errorf("serve --tls-client-ca --tls-required=false: err %v; want a refusal at start-up:\n%s", err, out)
	}
}

// badNames are export names that must be refused wherever a name enters:
// a path traversal, a newline (log and output injection), a terminal
// escape, a slash, a leading dash (an option look-alike), over 255 bytes.
var badNames = []string{"../x", "a\nb", "a\x1b[31mred", "a/b", "-x", strings.Repeat("n", 256)}

// TestExportNameRules: names with "../", newlines or terminal escapes
// were accepted by serve, format and attach. Each entry point now refuses
// them with the rule (internal/names) and starts nothing.
func TestExportNameRules(t *testing.T) {
	dir := t.TempDir()
	img := sparseFile(t, dir, "d.img", 8*mib)
	disk := sparseFile(t, dir, "disk.img", 8*mib)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	adminSock := filepath.Join(dir, "admin.sock")
	startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", adminSock)
	hc := unixHTTP(adminSock)
	const want = "invalid export name"
	for i, name := range badNames {
		other := filepath.Join(dir, fmt.Sprintf("o%d.img", i))
		check := func(what, out string, err error) {
			t.Helper()
			if err == nil || !strings.Contains(out, want) || strings.ContainsAny(out, "\x1b") {
				t.Errorf("%s with name %q: err %v; want a refusal naming the rule, without raw escapes:\n%q", what, name, err, out)
			}
		}
		out, err := runErr(20*time.Second, bin, "serve", "--export", name+"="+img, "--admin", "none", "--listen", "unix:"+filepath.Join(dir, "x.sock"))
		check("serve --export", out, err)
		cfg := filepath.Join(dir, fmt.Sprintf("c%d.toml", i))
		os.WriteFile(cfg, []byte(fmt.Sprintf("admin = \"none\"\nlisten = [\"unix:%s\"]\n[export]\n%q = %q\n", filepath.Join(dir, "y.sock"), name, img)), 0o600)
		out, err = runErr(20*time.Second, bin, "serve", "--config", cfg)
		check("serve --config [export]", out, err)
		sparseFile(t, dir, filepath.Base(other), 8*mib)
		out, err = runErr(20*time.Second, bin, "format", "--cache", sparseFile(t, dir, fmt.Sprintf("c%d.img", i), 16*mib), "--backing", name+"="+other)
		check("format --backing", out, err)
		out, err = runErr(20*time.Second, bin, "attach", "--admin", adminSock, "--", name+"="+other)
		check("attach", out, err)
		// The API itself, as a client other than the CLI would call it.
		body, _ := json.Marshal(map[string]string{"name": name, "path": other})
		code, reply := post(t, hc, "http://tiercache/v1/attach", string(body))
		if code != http.StatusBadRequest || !strings.Contains(reply, want) {
			t.Errorf("POST /v1/attach name %q: %d %s; want 400 naming the rule", name, code, reply)
		}
	}
	// A good name still attaches, and nothing else was exported meanwhile.
	good := sparseFile(t, dir, "good.img", 8*mib)
	code, reply := post(t, hc, "http://tiercache/v1/attach", fmt.Sprintf(`{"name": "vm-2.disk", "path": %q}`, good))
	if code != http.StatusOK {
		t.Fatalf("POST /v1/attach vm-2.disk: %d %s", code, reply)
	}
	st := get(t, hc, "http://tiercache/v1/status")
	if strings.Count(st, `"name"`) != 2 {
		t.Errorf("status after the refusals: want exports disk and vm-2.disk only:\n%s", st)
	}
}

// TestAdminBodyLimits: a request body over 1 MiB was cut at 1 MiB and
// reported as "unexpected EOF", and junk after the JSON object was
// ignored. Now the first gets 413 saying so and the second 400.
func TestAdminBodyLimits(t *testing.T) {
	dir := t.TempDir()
	disk := sparseFile(t, dir, "disk.img", 8*mib)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	adminSock := filepath.Join(dir, "admin.sock")
	startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", adminSock)
	hc := unixHTTP(adminSock)
	other := sparseFile(t, dir, "other.img", 8*mib)
	huge := `{"cache_mode": "writethrough", "pad": "` + strings.Repeat("x", 2<<20) + `"}`
	for _, c := range []struct {
		method, path, body string
		code               int
		want               string
	}{
		{"PUT", "/v1/exports/disk/settings", huge, http.StatusRequestEntityTooLarge, "request body larger than 1048576 bytes (1 MiB)"},
		{"POST", "/v1/attach", `{"name": "o", "path": "` + strings.Repeat("y", 2<<20) + `"}`, http.StatusRequestEntityTooLarge, "larger than 1048576 bytes"},
		{"PUT", "/v1/exports/disk/settings", `{"cache_mode": "writethrough"} {"cache_mode": "none"}`, http.StatusBadRequest, "trailing data after the JSON value"},
		{"PUT", "/v1/exports/disk/settings", `{"cache_mode": "writethrough"}xyz`, http.StatusBadRequest, "trailing data after the JSON value"},
		{"POST", "/v1/attach", fmt.Sprintf(`{"name": "o", "path": %q}]`, other), http.StatusBadRequest, "trailing data after the JSON value"},
	} {
		code, reply := do(t, hc, c.method, "http://tiercache"+c.path, c.body)
		if code != c.code || !strings.Contains(reply, c.want) {
			t.Errorf("%s %s (%d bytes): %d %.300s; want %d with %q", c.method, c.path, len(c.body), code, reply, c.code, c.want)
		}
	}
	// Nothing of the refused requests was applied.
	if s := get(t, hc, "http://tiercache/v1/exports/disk/settings"); !strings.Contains(s, `"cache_mode": "writeback"`) {
		t.Errorf("settings after refused requests:\n%s", s)
	}
	if s := get(t, hc, "http://tiercache/v1/status"); strings.Contains(s, `"name": "o"`) {
		t.Errorf("a refused attach was applied:\n%s", s)
	}
	// A body with trailing white space is fine.
	if code, reply := do(t, hc, "PUT", "http://tiercache/v1/exports/disk/settings", "{\"cache_mode\": \"writethrough\"}\n\n"); code != http.StatusOK {
		t.Errorf("PUT settings with a trailing newline: %d %s", code, reply)
	}
}

// unixHTTP is an HTTP client of the admin API on a unix socket.
func unixHTTP(sock string) *http.Client {
	return &http.Client{Timeout: time.Minute, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
}

// do sends a request (header "Authorization: hdr[0]" if given) and returns
// the status and the body.
func do(t *testing.T, hc *http.Client, method, url, body string, hdr ...string) (int, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if len(hdr) > 0 {
		req.Header.Set("Authorization", hdr[0])
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func post(t *testing.T, hc *http.Client, url, body string) (int, string) {
	t.Helper()
	return do(t, hc, "POST", url, body)
}

func get(t *testing.T, hc *http.Client, url string) string {
	t.Helper()
	code, b := do(t, hc, "GET", url, "")
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, code, b)
	}
	return b
}
