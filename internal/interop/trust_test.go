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
	hc, adminSock := serveDiskSet(t, dir)
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
	hc, _ := serveDiskSet(t, dir)
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

// waitDial waits until addr accepts connections (the admin API starts
// after the NBD listeners that startServerRaw waits for).
func waitDial(t *testing.T, network, addr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.Dial(network, addr)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %s did not accept connections within 20s: %v", network, addr, err)
		}
		time.Sleep(20 * time.Millisecond)
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

// TestAdminTCPAuth: as user nobody, a POST /v1/attach of a root-only file
// to serve --admin-tcp returned 200 and exported the file. Now every
// request over TCP needs the bearer token serve wrote into a 0600 file in
// the data directory (/metrics too, unless --metrics-no-auth), the unix
// socket serves only its owner and root (SO_PEERCRED, even if its mode is
// loosened), and a token file or socket directory others could use is
// refused at start-up.
func TestAdminTCPAuth(t *testing.T) {
	need(t, "curl", "setpriv")
	dir := t.TempDir()
	disk := sparseFile(t, dir, "disk.img", 8*mib)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	private := filepath.Join(dir, "private")
	os.Mkdir(private, 0o700)
	secret := filepath.Join(private, "secret")
	os.WriteFile(secret, []byte(strings.Repeat("root only\n", 1000)), 0o600)
	sock := filepath.Join(dir, "nbd.sock")
	adminSock := filepath.Join(dir, "admin.sock")
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--data-dir", dir, "--admin", adminSock, "--admin-tcp", addr)
	waitDial(t, "tcp", addr)

	tokenFile := filepath.Join(dir, "admin.token")
	hc := &http.Client{Timeout: time.Minute}
	base := "http://" + addr
	attach := fmt.Sprintf(`{"name": "leak", "path": %q}`, secret)
	// The finding as it was reproduced: user nobody, curl, a root-only file.
	if os.Geteuid() == 0 {
		out, _ := runErr(30*time.Second, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
			"curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "-d", attach, base+"/v1/attach")
		if out != "401" {
			t.Errorf("nobody: curl POST /v1/attach of a root-only file over TCP: %q; want 401", out)
		}
	}
	for _, c := range []struct {
		method, path, body string
		auth               []string
	}{
		{"POST", "/v1/attach", attach, nil},
		{"POST", "/v1/attach", attach, []string{"Bearer " + strings.Repeat("0", 64)}},
		{"POST", "/v1/attach", attach, []string{"Basic " + strings.Repeat("0", 64)}},
		{"GET", "/v1/status", "", nil},
		{"GET", "/v1/usage", "", nil},
		{"GET", "/v1/stats", "", nil},
		{"PUT", "/v1/exports/disk/settings", `{"cache_mode": "none"}`, nil},
		{"POST", "/v1/exports/disk/flush", "{}", nil},
		{"POST", "/v1/check", "{}", nil},
		{"POST", "/v1/lost-writes/ack", `{"ids": [1]}`, nil},
		{"POST", "/v1/exports/disk/detach", "{}", nil},
		{"GET", "/metrics", "", nil},
	} {
		code, reply := do(t, hc, c.method, base+c.path, c.body, c.auth...)
		if code != http.StatusUnauthorized || !strings.Contains(reply, "needs its bearer token") || !strings.Contains(reply, tokenFile) {
			t.Errorf("%s %s over TCP (auth %q): %d %s; want 401 naming the token file", c.method, c.path, c.auth, code, reply)
		}
	}
	st := get(t, unixHTTP(adminSock), "http://tiercache/v1/status")
	if strings.Contains(st, "leak") {
		t.Fatalf("a refused attach exported the file:\n%s", st)
	}
	fi, err := os.Stat(tokenFile)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v (mode %v); want one of mode 0600", err, fi)
	}
	b, _ := os.ReadFile(tokenFile)
	token := strings.TrimSpace(string(b))
	// With the token: the API works, from the CLI too (it reads the token
	// from the data directory).
	if code, reply := do(t, hc, "GET", base+"/v1/status", "", "Bearer "+token); code != http.StatusOK || !strings.Contains(reply, `"disk"`) {
		t.Errorf("GET /v1/status with the token: %d %s", code, reply)
	}
	if out := run(t, time.Minute, bin, "usage", "--admin", "tcp:"+addr, "--data-dir", dir); !strings.Contains(out, "export disk") {
		t.Errorf("usage over TCP with the token:\n%s", out)
	}

	// The unix socket is 0600, and even loosened it serves only its owner
	// and root.
	if fi, err := os.Stat(adminSock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("admin socket: %v (mode %v); want 0600", err, fi)
	}
	if os.Geteuid() == 0 {
		os.Chmod(filepath.Dir(dir), 0o755) // t.TempDir's parent
		os.Chmod(dir, 0o755)
		os.Chmod(adminSock, 0o666)
		out, _ := runErr(30*time.Second, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
			"curl", "-s", "--unix-socket", adminSock, "-X", "POST", "-d", attach, "-w", "\n%{http_code}", "http://tiercache/v1/attach")
		if !strings.HasSuffix(out, "\n403") || !strings.Contains(out, "serves its owner (uid 0) and root only; this peer is uid 65534") {
			t.Errorf("nobody on a loosened admin socket: %q; want 403", out)
		}
		os.Chmod(adminSock, 0o600)
		os.Chmod(dir, 0o700)
		os.Chmod(filepath.Dir(dir), 0o700)
	}

	// --metrics-no-auth opens GET /metrics only.
	img := sparseFile(t, dir, "p.img", mib)
	addr2 := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	sock2 := filepath.Join(dir, "p.sock")
	startServerRaw(t, sock2, "serve", "--export", "p="+img, "--listen", "unix:"+sock2, "--admin", "none", "--data-dir", dir,
		"--admin-tcp", addr2, "--metrics-no-auth")
	waitDial(t, "tcp", addr2)
	if code, reply := do(t, hc, "GET", "http://"+addr2+"/metrics", ""); code != http.StatusOK || !strings.Contains(reply, `tiercache_export_info{export="p"`) {
		t.Errorf("GET /metrics with --metrics-no-auth: %d %.500s", code, reply)
	}
	if code, reply := do(t, hc, "GET", "http://"+addr2+"/v1/status", ""); code != http.StatusUnauthorized {
		t.Errorf("GET /v1/status with --metrics-no-auth, no token: %d %s; want 401", code, reply)
	}

	// Refused at start-up: a token file others may read, a socket
	// directory others may write.
	// Their own disk: p.img is locked by the server above, and that
	// refusal would come first.
	img = sparseFile(t, dir, "q.img", mib)
	loose := filepath.Join(dir, "loose.token")
	os.WriteFile(loose, []byte(token+"\n"), 0o644)
	out, err := runErr(30*time.Second, bin, "serve", "--export", "p="+img, "--listen", "unix:"+filepath.Join(dir, "q.sock"), "--admin", "none",
		"--admin-tcp", "127.0.0.1:0", "--admin-token-file", loose)
	if err == nil || !strings.Contains(out, "has mode 0644: other users may read it; 'chmod 600") {
		t.Errorf("serve with a token file of mode 0644: err %v\n%s", err, out)
	}
	open := filepath.Join(dir, "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	out, err = runErr(30*time.Second, bin, "serve", "--export", "p="+img, "--listen", "unix:"+filepath.Join(dir, "r.sock"), "--admin", filepath.Join(open, "admin.sock"))
	if err == nil || !strings.Contains(out, "other users may replace the socket; 'chmod go-w") {
		t.Errorf("serve with the admin socket in a 0777 directory: err %v\n%s", err, out)
	}
}

// serveDiskSet formats a cache set in dir with one 8 MiB backing "disk",
// serves it with its admin API on a unix socket, and returns an HTTP
// client of that socket and its path.
func serveDiskSet(t *testing.T, dir string) (*http.Client, string) {
	t.Helper()
	disk := sparseFile(t, dir, "disk.img", 8*mib)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "disk="+disk, "--bucket-size", "256K")
	sock := filepath.Join(dir, "nbd.sock")
	adminSock := filepath.Join(dir, "admin.sock")
	startServerRaw(t, sock, "serve", "--cache", cachePath, "--listen", "unix:"+sock, "--admin", adminSock)
	waitDial(t, "unix", adminSock)
	hc := unixHTTP(adminSock)
	return hc, adminSock
}
