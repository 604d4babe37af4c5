package s3test

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/minio/minio-go/v7"
)

// TestConditionalWrites checks what the object-store device relies on:
// If-None-Match: * refuses to overwrite, If-Match refuses a stale ETag,
// and a ranged GET returns exactly the range.
func TestConditionalWrites(t *testing.T) {
	s := Start(t)
	b := s.Bucket("cond")
	c := s.Client()
	ctx := context.Background()
	put := func(body string, o minio.PutObjectOptions) (minio.UploadInfo, error) {
		return c.PutObject(ctx, b, "k", bytes.NewReader([]byte(body)), int64(len(body)), o)
	}
	var create minio.PutObjectOptions
	create.SetMatchETagExcept("*")
	first, err := put("one", create)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if _, err := put("two", create); minio.ToErrorResponse(err).StatusCode != 412 {
		t.Fatalf("second create: %v (status %d), want 412", err, minio.ToErrorResponse(err).StatusCode)
	}
	var match minio.PutObjectOptions
	match.SetMatchETag(first.ETag)
	second, err := put("three", match)
	if err != nil {
		t.Fatalf("put if-match current: %v", err)
	}
	if _, err := put("four", match); minio.ToErrorResponse(err).StatusCode != 412 {
		t.Fatalf("put if-match stale: %v (status %d), want 412", err, minio.ToErrorResponse(err).StatusCode)
	}
	st, err := c.StatObject(ctx, b, "k", minio.StatObjectOptions{})
	if err != nil || st.ETag != second.ETag {
		t.Fatalf("stat: %v, etag %q want %q", err, st.ETag, second.ETag)
	}
	var g minio.GetObjectOptions
	g.SetRange(1, 3)
	o, err := c.GetObject(ctx, b, "k", g)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(o)
	if err != nil || string(got) != "hre" {
		t.Fatalf("ranged get: %q, %v", got, err)
	}
	s.Restart()
	if _, err := c.StatObject(ctx, b, "k", minio.StatObjectOptions{}); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}
