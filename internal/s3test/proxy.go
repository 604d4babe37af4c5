package s3test

import (
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
)

// Proxy is a fault-injecting HTTP proxy in front of a Server: requests
// pass through unchanged (the Host header too, so SigV4 signatures stay
// valid) until it is cut, after which every request is answered 503
// without reaching the server, as if the client had died or the network
// had gone at that point.
type Proxy struct {
	srv *httptest.Server

	mu       sync.Mutex
	puts     int // PUT requests forwarded since Reset
	cutAfter int // forward this many PUTs, then cut; < 0: never
	cut      bool
}

// NewProxy starts a proxy to s, closed when t ends.
func NewProxy(t testing.TB, s *Server) *Proxy {
	target, err := url.Parse(s.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{cutAfter: -1}
	rp := &httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.SetURL(target)
		r.Out.Host = r.In.Host
	}}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		if !p.cut && r.Method == http.MethodPut && p.cutAfter >= 0 && p.puts >= p.cutAfter {
			p.cut = true
		}
		cut := p.cut
		if !cut && r.Method == http.MethodPut {
			p.puts++
		}
		p.mu.Unlock()
		if cut {
			http.Error(w, "cut by the test proxy", http.StatusServiceUnavailable)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// Endpoint is the proxy's URL.
func (p *Proxy) Endpoint() string { return p.srv.URL }

// CutAfter lets n more PUT requests through, then cuts (n < 0: never).
func (p *Proxy) CutAfter(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.puts, p.cutAfter, p.cut = 0, n, false
}

// Puts is the number of PUTs forwarded since the last CutAfter.
func (p *Proxy) Puts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.puts
}
