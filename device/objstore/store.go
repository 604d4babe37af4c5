package objstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
)

// store is the image's objects on one bucket: the few S3 calls the device
// makes, each wrapped with the object's name. 5xx, throttling and network
// errors are retried with backoff: by minio-go for reads, by put for
// PUTs (a fresh body reader per attempt); what comes out is final.
type store struct {
	c *minio.Client
	// putc makes one attempt per call; put retries with tries attempts.
	putc  *minio.Client
	tries int
	loc   Location
	// timeout bounds one call (its retries included).
	timeout time.Duration
}

// errPrecondition is wrapped when a conditional write found the object
// changed (HTTP 412) or already there.
var errPrecondition = errors.New("objstore: precondition failed")

// ErrCredentials is wrapped when the store refused the request's
// credentials or signature.
var ErrCredentials = errors.New("objstore: the store refused the credentials or what they may do (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or the shared credentials file)")

// credentialsRefused reports whether err is the store refusing who asked.
func credentialsRefused(err error) bool {
	switch minio.ToErrorResponse(err).Code {
	case "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken",
		"XAdminUserNotFound": // versitygw's answer to an unknown access key (404)
		return true
	}
	return false
}

// errNoObject is wrapped when an object does not exist.
var errNoObject = errors.New("objstore: no such object")

func (s *store) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), s.timeout)
}

func (s *store) wrap(op, name string, err error) error {
	if err == nil {
		return nil
	}
	r := minio.ToErrorResponse(err)
	switch {
	case r.StatusCode == http.StatusPreconditionFailed || r.Code == "PreconditionFailed":
		err = fmt.Errorf("%w (%v)", errPrecondition, err)
	case r.StatusCode == http.StatusNotFound || r.Code == "NoSuchKey":
		err = fmt.Errorf("%w (%v)", errNoObject, err)
	case credentialsRefused(err):
		err = fmt.Errorf("%w: %v", ErrCredentials, err)
	}
	return fmt.Errorf("%s s3://%s/%s: %w", op, s.loc.Bucket, s.loc.key(name), err)
}

type putCond int

const (
	putAny putCond = iota
	putIfAbsent
	putIfMatch
)

// put writes an object and returns its ETag. With putIfAbsent it fails
// (errPrecondition) if the object exists; with putIfMatch, unless its ETag
// is etag.
func (s *store) put(name string, data []byte, cond putCond, etag string) (string, error) {
	ctx, cancel := s.ctx()
	defer cancel()
	var o minio.PutObjectOptions
	o.ContentType = "application/octet-stream"
	o.DisableMultipart = true
	switch cond {
	case putIfAbsent:
		o.SetMatchETagExcept("*")
	case putIfMatch:
		o.SetMatchETag(etag)
	}
	for try, delay := 1, 200*time.Millisecond; ; try, delay = try+1, min(2*delay, time.Second) {
		info, err := s.putc.PutObject(ctx, s.loc.Bucket, s.loc.key(name), bytes.NewReader(data), int64(len(data)), o)
		if err == nil {
			return info.ETag, nil
		}
		if try >= s.tries || !retryable(err) {
			return "", s.wrap("put", name, err)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", s.wrap("put", name, err)
		case <-t.C:
		}
	}
}

// defaultTries is minio-go's own number of attempts, used for PUTs too.
const defaultTries = 10

// retryable reports whether a failed request may succeed when tried
// again: no answer (network errors, timeouts), throttling and 5xx.
func retryable(err error) bool {
	r := minio.ToErrorResponse(err)
	switch {
	case r.StatusCode == 0, r.StatusCode == http.StatusTooManyRequests, r.StatusCode >= 500:
		return true
	}
	switch r.Code {
	case "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable":
		return true
	}
	return false
}

// get reads n bytes at off of an object (n < 0: all of it from off).
func (s *store) get(name string, off, n int64) ([]byte, error) {
	ctx, cancel := s.ctx()
	defer cancel()
	var o minio.GetObjectOptions
	if off != 0 || n >= 0 {
		end := int64(-1)
		if n >= 0 {
			end = off + n - 1
		}
		if n == 0 {
			return nil, nil
		}
		if end < 0 {
			o.SetRange(off, 0)
		} else {
			o.SetRange(off, end)
		}
	}
	obj, err := s.c.GetObject(ctx, s.loc.Bucket, s.loc.key(name), o)
	if err != nil {
		return nil, s.wrap("get", name, err)
	}
	defer obj.Close()
	var buf bytes.Buffer
	if n > 0 {
		buf.Grow(int(n))
	}
	if _, err := io.Copy(&buf, obj); err != nil {
		return nil, s.wrap("get", name, err)
	}
	if n > 0 && int64(buf.Len()) != n {
		return nil, fmt.Errorf("get s3://%s/%s: %d bytes at %d, want %d: %w", s.loc.Bucket, s.loc.key(name), buf.Len(), off, n, io.ErrUnexpectedEOF)
	}
	return buf.Bytes(), nil
}

// getETag reads a whole object and its ETag, both from one GET. (A HEAD
// then a GET, as minio-go's Object does when asked its Stat first, meets
// two versions of an object a writer replaces between them: minio-go
// sends the GET with If-Match of the HEAD's ETag, and the store answers
// 412.)
func (s *store) getETag(name string) ([]byte, string, error) {
	ctx, cancel := s.ctx()
	defer cancel()
	body, info, _, err := minio.Core{Client: s.c}.GetObject(ctx, s.loc.Bucket, s.loc.key(name), minio.GetObjectOptions{})
	if err != nil {
		return nil, "", s.wrap("get", name, err)
	}
	defer body.Close()
	p, err := io.ReadAll(body)
	if err != nil {
		return nil, "", s.wrap("get", name, err)
	}
	if info.Size >= 0 && int64(len(p)) != info.Size {
		return nil, "", fmt.Errorf("get s3://%s/%s: %d bytes, want %d: %w", s.loc.Bucket, s.loc.key(name), len(p), info.Size, io.ErrUnexpectedEOF)
	}
	return p, info.ETag, nil
}

// stat returns an object's ETag and modification time.
func (s *store) stat(name string) (string, time.Time, int64, error) {
	ctx, cancel := s.ctx()
	defer cancel()
	st, err := s.c.StatObject(ctx, s.loc.Bucket, s.loc.key(name), minio.StatObjectOptions{})
	if err != nil {
		return "", time.Time{}, 0, s.wrap("stat", name, err)
	}
	return st.ETag, st.LastModified, st.Size, nil
}

type objInfo struct {
	Name     string // relative to the image prefix
	Size     int64
	Modified time.Time
}

// list returns the objects whose names (relative to the image) start with
// dir, in name order.
func (s *store) list(dir string) ([]objInfo, error) {
	ctx, cancel := s.ctx()
	defer cancel()
	pfx := s.loc.key(dir)
	var out []objInfo
	for o := range s.c.ListObjects(ctx, s.loc.Bucket, minio.ListObjectsOptions{Prefix: pfx, Recursive: true}) {
		if o.Err != nil {
			return nil, s.wrap("list", dir, o.Err)
		}
		out = append(out, objInfo{Name: dir + strings.TrimPrefix(o.Key, pfx), Size: o.Size, Modified: o.LastModified})
	}
	return out, nil
}

// remove deletes an object (a missing one is not an error).
func (s *store) remove(name string) error {
	ctx, cancel := s.ctx()
	defer cancel()
	return s.wrap("delete", name, s.c.RemoveObject(ctx, s.loc.Bucket, s.loc.key(name), minio.RemoveObjectOptions{}))
}
