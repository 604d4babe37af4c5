package admin

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestAccessTCP: over TCP the token is required for every route but
// /metrics with OpenMetrics; a request on a connection ConnContext did not
// record is refused.
func TestAccessTCP(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	for _, open := range []bool{false, true} {
		srv := New(Config{Version: "test", NBD: &fakeNBD{}, Metrics: NewMetrics(), Access: Access{Token: token, TokenFile: "/x/admin.token", OpenMetrics: open}})
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		hs := &http.Server{Handler: srv.Handler(), ConnContext: ConnContext}
		go hs.Serve(l)
		base := "http://" + l.Addr().String()
		call := func(method, path, auth string) (int, string) {
			req, _ := http.NewRequest(method, base+path, nil)
			if auth != "" {
				req.Header.Set("Authorization", auth)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		for _, c := range []struct {
			method, path, auth string
			want               int
		}{
			{"GET", "/v1/status", "", 401},
			{"GET", "/v1/status", "Bearer " + token[:31] + "0", 401},
			{"GET", "/v1/status", "Bearer " + token[:31], 401},
			{"GET", "/v1/status", "bearer " + token, 401},
			{"GET", "/v1/status", "Bearer " + token, 200},
			{"POST", "/v1/attach", "", 401},
			{"GET", "/nope", "", 401}, // no route is discovered without the token
			{"GET", "/metrics", "", map[bool]int{false: 401, true: 200}[open]},
			{"POST", "/metrics", "", 401},
			{"GET", "/metrics", "Bearer " + token, 200},
		} {
			code, body := call(c.method, c.path, c.auth)
			if code != c.want {
				t.Errorf("open metrics %v: %s %s (auth %q): %d %s; want %d", open, c.method, c.path, c.auth, code, body, c.want)
			}
			if code == 401 && !strings.Contains(body, "/x/admin.token") {
				t.Errorf("401 does not say where the token is: %s", body)
			}
		}
		hs.Close()
		srv.Close()
	}
	// Without ConnContext nobody gets in.
	srv := New(Config{Version: "test", NBD: &fakeNBD{}})
	defer srv.Close()
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	resp, err := http.Get(ts.URL + "/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("a server without ConnContext: %s; want 403", resp.Status)
	}
}
