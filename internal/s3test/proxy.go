package s3test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"
)

// Proxy is a fault-injecting HTTP proxy in front of a Server. Requests
// pass through unchanged (the Host header too, so SigV4 signatures stay
// valid) unless a fault is chosen for them: by CutAfter (every request
// from a chosen PUT on is answered 503 without reaching the server, as if
// the client had died or the network had gone at that point), or by the
// function given to SetFaults.
type Proxy struct {
	srv *httptest.Server
	rp  *httputil.ReverseProxy

	mu       sync.Mutex
	puts     int // PUT requests forwarded since CutAfter
	cutAfter int // forward this many PUTs, then cut; < 0: never
	cut      bool
	choose   func(r *http.Request) Fault
	counts   map[Fault]int
}

// Fault is what the proxy does to one request.
type Fault int

const (
	// Pass forwards the request and its response unchanged.
	Pass Fault = iota
	// Unavailable answers 503 (SlowDown) without reaching the server.
	Unavailable
	// InternalError answers 500 without reaching the server.
	InternalError
	// ResetBefore closes the connection without an answer, before the
	// request reaches the server.
	ResetBefore
	// ResetAfter forwards the request (the server acts on it), then
	// closes the client's connection without an answer: a PUT may have
	// been stored although the client saw it fail.
	ResetAfter
	// Truncate forwards the request and sends only the first half of the
	// response body (the headers promise all of it), then closes.
	Truncate
	// Slow forwards the request and trickles the response body, 4 KiB
	// every SlowDelay.
	Slow
	// Delay waits Delay before forwarding.
	Delay
	// Hang never answers: the request is held until the client gives up
	// (a dead peer).
	Hang
	nFaults
)

// IgnoreConditions forwards the request, and a refusal of a conditional
// write (412 Precondition Failed) is answered 200 instead: a store that
// does not honour If-None-Match / If-Match. Not among AllFaults.
const IgnoreConditions = nFaults

// Pacing of Slow and Delay.
const (
	SlowDelay = 20 * time.Millisecond
	DelayTime = 200 * time.Millisecond
	// HangMax bounds a Hang, should the client never give up.
	HangMax = time.Minute
)

var faultNames = [...]string{"pass", "503", "500", "reset-before", "reset-after", "truncate", "slow", "delay", "hang", "ignore-conditions"}

func (f Fault) String() string { return faultNames[f] }

// NewProxy starts a proxy to s, closed when t ends.
func NewProxy(t testing.TB, s *Server) *Proxy {
	target, err := url.Parse(s.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{cutAfter: -1, counts: map[Fault]int{}}
	p.rp = &httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.SetURL(target)
		r.Out.Host = r.In.Host
	}}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if !p.cut && r.Method == http.MethodPut && p.cutAfter >= 0 && p.puts >= p.cutAfter {
		p.cut = true
	}
	f := Pass
	switch {
	case p.cut:
		f = Unavailable
	case p.choose != nil:
		f = p.choose(r)
	}
	if r.Method == http.MethodPut && f != Unavailable && f != InternalError && f != ResetBefore && f != Hang {
		p.puts++
	}
	p.counts[f]++
	p.mu.Unlock()
	switch f {
	case Unavailable:
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>fault injected by the test proxy</Message></Error>`)
	case InternalError:
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusInternalServerError)
		io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>fault injected by the test proxy</Message></Error>`)
	case ResetBefore:
		reset(w)
	case ResetAfter:
		rec := httptest.NewRecorder()
		p.rp.ServeHTTP(rec, r)
		reset(w)
	case Truncate:
		rec := httptest.NewRecorder()
		p.rp.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		if len(body) < 2 {
			// Nothing to cut: lose the answer instead.
			reset(w)
			return
		}
		copyHeader(w.Header(), rec.Header())
		w.WriteHeader(rec.Code)
		w.Write(body[:len(body)/2])
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
		reset(w)
	case Slow:
		rec := httptest.NewRecorder()
		p.rp.ServeHTTP(rec, r)
		copyHeader(w.Header(), rec.Header())
		w.WriteHeader(rec.Code)
		body := rec.Body.Bytes()
		for len(body) > 0 {
			n := min(len(body), 4096)
			if _, err := w.Write(body[:n]); err != nil {
				return
			}
			if fl, ok := w.(http.Flusher); ok {
				fl.Flush()
			}
			body = body[n:]
			select {
			case <-r.Context().Done():
				return
			case <-time.After(SlowDelay):
			}
		}
	case Delay:
		select {
		case <-r.Context().Done():
			return
		case <-time.After(DelayTime):
		}
		p.rp.ServeHTTP(w, r)
	case IgnoreConditions:
		rec := httptest.NewRecorder()
		p.rp.ServeHTTP(rec, r)
		if rec.Code == http.StatusPreconditionFailed {
			w.Header().Set("ETag", `"00000000000000000000000000000000"`)
			w.WriteHeader(http.StatusOK)
			return
		}
		copyHeader(w.Header(), rec.Header())
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
	case Hang:
		// The server notices the client closing only once the body is
		// read.
		io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-time.After(HangMax):
		}
	default:
		p.rp.ServeHTTP(w, r)
	}
}

// reset closes the client's connection at once (RST), without an answer
// or after what was already flushed.
func reset(w http.ResponseWriter) {
	c, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // not hijackable: abort the response
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}

func copyHeader(dst, src http.Header) {
	for k, v := range src {
		dst[k] = v
	}
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

// SetFaults makes choose pick the fault of every request (nil: none). It
// is called with the proxy's lock held: it must not call the proxy.
func (p *Proxy) SetFaults(choose func(r *http.Request) Fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.choose = choose
}

// Counts returns how many requests met each fault since the proxy
// started (Pass included).
func (p *Proxy) Counts() map[Fault]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[Fault]int, len(p.counts))
	for f, n := range p.counts {
		out[f] = n
	}
	return out
}

// AllFaults lists every fault but Pass, for choosers.
func AllFaults() []Fault {
	var fs []Fault
	for f := Pass + 1; f < nFaults; f++ {
		fs = append(fs, f)
	}
	return fs
}
