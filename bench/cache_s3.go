package bench

// S6's object-store target (writeback-s3): the same cache set and
// workload as writeback, with an object-store image as the backing device
// instead of the HDD model: a versitygw (posix backend, under the workdir)
// on loopback, started by the suite on first use and stopped at its end,
// as internal/s3test starts one for the tests.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/tiercache/tiercache/device/objstore"
)

// The local store's root credentials and bucket (benchmark-only values).
const (
	s3Access = "tcbench"
	s3Secret = "tcbenchsecret"
	s3Region = "us-east-1"
	s3Bucket = "tcbench"
)

// s3Store is the suite's versitygw.
type s3Store struct {
	addr string
	p    *process
}

// versitygwBinary finds versitygw in $PATH or $(go env GOPATH)/bin.
func versitygwBinary() (string, error) {
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	if gp, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		p := filepath.Join(strings.TrimSpace(string(gp)), "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("versitygw not found (scripts/install-deps.sh installs it)")
}

// objStore returns the suite's store, starting it (and creating its bucket) on
// first use. Every tiercache process the suite starts afterwards finds it
// through the AWS_* variables it sets.
func (c *cacheRunner) objStore(ctx context.Context) (*s3Store, error) {
	if c.s3st != nil {
		return c.s3st, nil
	}
	bin, err := versitygwBinary()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(c.workdir, "s3")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.Close()
	argv := []string{bin, "--access", s3Access, "--secret", s3Secret, "--region", s3Region, "--port", addr, "--quiet", "posix", dir}
	c.r.noteCommand(argv)
	p, err := startProcess("versitygw", argv, filepath.Join(c.workdir, "versitygw.log"))
	if err != nil {
		return nil, err
	}
	c.r.servers.add(p, "")
	for deadline := time.Now().Add(30 * time.Second); ; {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
			break
		}
		if p.exited() || time.Now().After(deadline) {
			return nil, fmt.Errorf("versitygw did not listen on %s (log %s)", addr, p.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	cl, err := minio.New(addr, &minio.Options{Creds: credentials.NewStaticV4(s3Access, s3Secret, ""), Region: s3Region, BucketLookup: minio.BucketLookupPath})
	if err != nil {
		return nil, err
	}
	if err := cl.MakeBucket(ctx, s3Bucket, minio.MakeBucketOptions{Region: s3Region}); err != nil {
		return nil, fmt.Errorf("make bucket: %w", err)
	}
	for k, v := range map[string]string{"AWS_ENDPOINT_URL": "http://" + addr, "AWS_ENDPOINT_URL_S3": "", "AWS_REGION": s3Region,
		"AWS_ACCESS_KEY_ID": s3Access, "AWS_SECRET_ACCESS_KEY": s3Secret, "AWS_SESSION_TOKEN": "", "AWS_SHARED_CREDENTIALS_FILE": os.DevNull} {
		if err := os.Setenv(k, v); err != nil {
			return nil, err
		}
	}
	c.s3st = &s3Store{addr: addr, p: p}
	return c.s3st, nil
}

// cachedS3 is cachedFrom over a new object-store image holding src's
// bytes (size c.sz.Disk; src's all-zero MiBs are never written and read as
// zeroes without a request) instead of the HDD model. It returns the
// server and the image's URI.
func (c *cacheRunner) cachedS3(ctx context.Context, tag, cacheKind, mode string, cacheSize int64, src string) (*server, string, error) {
	if _, err := c.objStore(ctx); err != nil {
		return nil, "", err
	}
	dir, err := c.tcDir(tag)
	if err != nil {
		return nil, "", err
	}
	c.s3n++
	uri := fmt.Sprintf("s3://%s/%s-%d", s3Bucket, tag, c.s3n)
	if _, err := c.cmd(ctx, time.Minute, c.tcBin, "image", "create", uri, "--size", fmt.Sprint(c.sz.Disk)); err != nil {
		return nil, "", err
	}
	if err := copyToImage(uri, src); err != nil {
		return nil, "", fmt.Errorf("copy %s into %s: %w", src, uri, err)
	}
	srv, err := c.serveCache(ctx, c.tcBin, dir, cacheKind, uri, mode, cacheSize)
	return srv, uri, err
}

// copyToImage writes src's non-zero MiBs into the image at uri (the
// environment names the store) and syncs.
func copyToImage(uri, src string) error {
	l, err := objstore.ParseURI(uri)
	if err != nil {
		return err
	}
	d, err := objstore.Open(l.WithEnv(), objstore.Options{})
	if err != nil {
		return err
	}
	f, err := os.Open(src)
	if err != nil {
		d.Close()
		return err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for off := int64(0); ; off += int64(len(buf)) {
		n, err := f.ReadAt(buf, off)
		if n > 0 && !zeroes(buf[:n]) {
			if _, werr := d.WriteAt(buf[:n], off); werr != nil {
				d.Close()
				return werr
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			d.Close()
			return err
		}
	}
	if err := d.Sync(); err != nil {
		d.Close()
		return err
	}
	return d.Close()
}

func zeroes(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}
