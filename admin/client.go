package admin

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// ErrNoServer is returned when no server answers at the admin address.
var ErrNoServer = errors.New("no tiercache server is running there")

// Client talks to a running server's admin API.
type Client struct {
	addr  string // unix socket path, or tcp:HOST:PORT
	hc    *http.Client
	base  string
	token string // bearer token sent with every request, if set
}

// NewClient returns a client for addr: a unix socket path, or
// tcp:HOST:PORT.
func NewClient(addr string) *Client {
	c := &Client{addr: addr}
	tr := &http.Transport{DisableCompression: true}
	if hp, ok := strings.CutPrefix(addr, "tcp:"); ok {
		c.base = "http://" + hp
	} else {
		c.base = "http://tiercache"
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", addr)
		}
	}
	c.hc = &http.Client{Transport: tr}
	return c
}

// SetToken makes the client send "Authorization: Bearer token" (the
// admin API over TCP requires it).
func (c *Client) SetToken(token string) { c.token = token }

// Addr is the address the client talks to.
func (c *Client) Addr() string { return c.addr }

// APIError is an error status from the server.
type APIError struct {
	Status int
	Msg    string
	Key    string
}

func (e *APIError) Error() string { return e.Msg }

func (c *Client) do(ctx context.Context, method, path string, body any) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) && (errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)) {
			return nil, fmt.Errorf("%s: %w", c.addr, ErrNoServer)
		}
		return nil, fmt.Errorf("admin API at %s: %w", c.addr, err)
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		var er ErrorReply
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		if json.Unmarshal(b, &er) != nil || er.Error == "" {
			er.Error = fmt.Sprintf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(b)))
		}
		return nil, &APIError{Status: resp.StatusCode, Msg: er.Error, Key: er.Key}
	}
	return resp, nil
}

func (c *Client) getJSON(ctx context.Context, method, path string, body, out any) error {
	resp, err := c.do(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: decoding reply: %w", method, path, err)
	}
	return nil
}

// Status returns the server's status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var st Status
	return st, c.getJSON(ctx, "GET", "/v1/status", nil, &st)
}

// Usage returns space usage.
func (c *Client) Usage(ctx context.Context) (Usage, error) {
	var u Usage
	return u, c.getJSON(ctx, "GET", "/v1/usage", nil, &u)
}

// Stats returns the counters; raw is the reply as sent (for --json).
func (c *Client) Stats(ctx context.Context) (st Stats, raw json.RawMessage, err error) {
	if err = c.getJSON(ctx, "GET", "/v1/stats", nil, &raw); err != nil {
		return st, nil, err
	}
	return st, raw, json.Unmarshal(raw, &st)
}

// Settings returns an export's settings.
func (c *Client) Settings(ctx context.Context, export string) (map[string]string, error) {
	var m map[string]string
	return m, c.getJSON(ctx, "GET", "/v1/exports/"+url.PathEscape(export)+"/settings", nil, &m)
}

// SetSettings changes settings and returns them all as they are now.
func (c *Client) SetSettings(ctx context.Context, export string, kv map[string]string) (map[string]string, error) {
	var m map[string]string
	return m, c.getJSON(ctx, "PUT", "/v1/exports/"+url.PathEscape(export)+"/settings", kv, &m)
}

// stream runs a streaming operation, calling fn for each Progress line,
// and returns the final one.
func (c *Client) stream(ctx context.Context, path string, fn func(Progress)) (Progress, error) {
	return c.streamBody(ctx, path, struct{}{}, fn)
}

// streamBody is stream with a request body.
func (c *Client) streamBody(ctx context.Context, path string, body any, fn func(Progress)) (Progress, error) {
	resp, err := c.do(ctx, "POST", path, body)
	if err != nil {
		return Progress{}, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var p Progress
		if err := json.Unmarshal(sc.Bytes(), &p); err != nil {
			return Progress{}, fmt.Errorf("POST %s: bad progress line %q: %w", path, sc.Text(), err)
		}
		if fn != nil {
			fn(p)
		}
		if p.Finished {
			if p.Error != "" {
				return p, errors.New(p.Error)
			}
			return p, nil
		}
	}
	if err := sc.Err(); err != nil {
		return Progress{}, fmt.Errorf("POST %s: %w", path, err)
	}
	return Progress{}, fmt.Errorf("POST %s: the server closed the stream before the operation finished", path)
}

// Flush writes back an export's dirty data.
func (c *Client) Flush(ctx context.Context, export string, fn func(Progress)) (Progress, error) {
	return c.stream(ctx, "/v1/exports/"+url.PathEscape(export)+"/flush", fn)
}

// Detach flushes an export, stops caching it and releases its backing device.
func (c *Client) Detach(ctx context.Context, export string, fn func(Progress)) (Progress, error) {
	return c.stream(ctx, "/v1/exports/"+url.PathEscape(export)+"/detach", fn)
}

// Check verifies the served cache set.
func (c *Client) Check(ctx context.Context, fn func(Progress)) (Progress, error) {
	return c.stream(ctx, "/v1/check", fn)
}

// Replace resilvers the device at req.Path into the served degraded
// mirrored set as its failed member.
func (c *Client) Replace(ctx context.Context, req ReplaceRequest, fn func(Progress)) (Progress, error) {
	return c.streamBody(ctx, "/v1/mirror/replace", req, fn)
}

// SetResilverRate changes the running resilver's rate limit (bytes a
// second, 0: none).
func (c *Client) SetResilverRate(ctx context.Context, rate int64) error {
	var out ResilverRate
	return c.getJSON(ctx, "POST", "/v1/mirror/resilver-rate", ResilverRate{Rate: rate}, &out)
}

// Attach asks the server to add a backing device to its cache set as a new
// volume and export.
func (c *Client) Attach(ctx context.Context, req AttachRequest) (ExportInfo, error) {
	var ei ExportInfo
	err := c.getJSON(ctx, "POST", "/v1/attach", req, &ei)
	return ei, err
}

// AckLostWrites acknowledges the lost writes of the failovers ids and
// returns those still recorded.
func (c *Client) AckLostWrites(ctx context.Context, ids []uint64) (LostWritesReply, error) {
	var rep LostWritesReply
	err := c.getJSON(ctx, "POST", "/v1/lost-writes/ack", LostWritesAck{IDs: ids}, &rep)
	return rep, err
}

// Metrics returns the Prometheus text exposition.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	resp, err := c.do(ctx, "GET", "/metrics", nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// Wait polls until the server answers or timeout passes.
func (c *Client) Wait(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		_, err := c.Status(ctx)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}
