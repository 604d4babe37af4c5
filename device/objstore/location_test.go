package objstore

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/tiercache/tiercache/internal/s3test"
)

// TestCredentialsFile: with no AWS_ACCESS_KEY_ID in the environment, the
// credentials come from the shared credentials file, the profile
// AWS_PROFILE names; the file's other profile, with wrong keys, is
// refused with ErrCredentials.
func TestCredentialsFile(t *testing.T) {
	srv := s3test.Start(t)
	srv.Bucket("images")
	f := filepath.Join(t.TempDir(), "credentials")
	if err := os.WriteFile(f, []byte("[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong\n\n[bench]\naws_access_key_id = "+
		s3test.AccessKey+"\naws_secret_access_key = "+s3test.SecretKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} {
		t.Setenv(k, "")
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", f)
	l := Location{Bucket: "images", Endpoint: srv.Endpoint(), Region: s3test.Region, PathStyle: true}
	t.Setenv("AWS_PROFILE", "")
	l.Prefix = "default"
	if _, err := Create(l, 1<<20, 4096); !errors.Is(err, ErrCredentials) {
		t.Fatalf("Create with the default profile's wrong keys: %v, want ErrCredentials", err)
	}
	t.Setenv("AWS_PROFILE", "bench")
	l.Prefix = "bench"
	if _, err := Create(l, 1<<20, 4096); err != nil {
		t.Fatalf("Create with the profile's keys from the file: %v", err)
	}
	d, err := Open(l, Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
}

// TestEndpointFromEnv: WithEnv takes the endpoint from AWS_ENDPOINT_URL_S3
// before AWS_ENDPOINT_URL and the region from AWS_REGION before
// AWS_DEFAULT_REGION, keeps what the location already names, and a
// non-AWS endpoint implies path-style addressing.
func TestEndpointFromEnv(t *testing.T) {
	t.Setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
	t.Setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
	t.Setenv("AWS_REGION", "r1")
	t.Setenv("AWS_DEFAULT_REGION", "r2")
	l, err := ParseURI("s3://b/p")
	if err != nil {
		t.Fatal(err)
	}
	if e := l.WithEnv(); e.Endpoint != "http://127.0.0.1:1" || e.Region != "r1" || !e.PathStyle {
		t.Fatalf("WithEnv: %+v, want the S3 endpoint, region r1, path-style", e)
	}
	t.Setenv("AWS_ENDPOINT_URL_S3", "")
	t.Setenv("AWS_REGION", "")
	if e := l.WithEnv(); e.Endpoint != "http://127.0.0.1:2" || e.Region != "r2" {
		t.Fatalf("WithEnv without the S3 variables: %+v, want the general endpoint and region r2", e)
	}
	l, err = ParseURI("s3://b/p?endpoint=http://127.0.0.1:3&region=r3")
	if err != nil {
		t.Fatal(err)
	}
	if e := l.WithEnv(); e.Endpoint != "http://127.0.0.1:3" || e.Region != "r3" {
		t.Fatalf("WithEnv of a URI naming its store: %+v, want its own endpoint and region", e)
	}
}
