package objstore

import (
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Location is where an image lives: a bucket, a prefix in it, and how to
// reach the store. Credentials are not part of it: they come from the
// standard AWS variables or credentials file (Client), and are never
// printed.
type Location struct {
	Bucket    string
	Prefix    string // without leading or trailing "/"; may be empty
	Endpoint  string // http://host:port or https://host[:port]; "" means AWS S3
	Region    string
	PathStyle bool // bucket in the path instead of the host name
}

// IsURI reports whether spec is an object-store image URI (s3://).
func IsURI(spec string) bool { return strings.HasPrefix(spec, "s3://") }

// ParseURI parses s3://BUCKET/PREFIX[?endpoint=URL&region=R&path-style=1].
// Unknown query parameters are refused.
func ParseURI(s string) (Location, error) {
	var l Location
	u, err := url.Parse(s)
	if err != nil {
		return l, fmt.Errorf("object-store URI: %w", err)
	}
	if u.Scheme != "s3" || u.Host == "" || u.User != nil || u.Fragment != "" {
		return l, fmt.Errorf("object-store URI %q: want s3://BUCKET/PREFIX", s)
	}
	l.Bucket = u.Host
	l.Prefix = strings.Trim(u.Path, "/")
	for k, v := range u.Query() {
		switch k {
		case "endpoint":
			l.Endpoint = v[0]
		case "region":
			l.Region = v[0]
		case "path-style":
			l.PathStyle = v[0] == "1" || v[0] == "true"
		default:
			return l, fmt.Errorf("object-store URI %q: unknown parameter %q (endpoint, region, path-style)", s, k)
		}
	}
	if l.Endpoint != "" {
		if _, _, err := splitEndpoint(l.Endpoint); err != nil {
			return l, err
		}
	}
	return l, nil
}

// Name is s3://BUCKET/PREFIX, for messages.
func (l Location) Name() string { return "s3://" + l.Bucket + "/" + l.Prefix }

// String is the canonical URI of l.
func (l Location) String() string {
	s := "s3://" + l.Bucket + "/" + l.Prefix
	q := url.Values{}
	if l.Endpoint != "" {
		q.Set("endpoint", l.Endpoint)
	}
	if l.Region != "" {
		q.Set("region", l.Region)
	}
	if l.PathStyle {
		q.Set("path-style", "1")
	}
	if len(q) > 0 {
		s += "?" + q.Encode()
	}
	return s
}

// WithEnv fills the endpoint and region l does not set from the standard
// variables: AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL; AWS_REGION, then
// AWS_DEFAULT_REGION. A non-AWS endpoint implies path-style addressing
// unless the URI says otherwise (most self-hosted stores need it).
func (l Location) WithEnv() Location {
	if l.Endpoint == "" {
		l.Endpoint = firstEnv("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
		if l.Endpoint != "" {
			l.PathStyle = true
		}
	}
	if l.Region == "" {
		l.Region = firstEnv("AWS_REGION", "AWS_DEFAULT_REGION")
	}
	return l
}

func firstEnv(names ...string) string {
	for _, n := range names {
		if v := os.Getenv(n); v != "" {
			return v
		}
	}
	return ""
}

func splitEndpoint(ep string) (host string, secure bool, err error) {
	u, err := url.Parse(ep)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return "", false, fmt.Errorf("object-store endpoint %q: want http://HOST[:PORT] or https://HOST[:PORT]", ep)
	}
	return u.Host, u.Scheme == "https", nil
}

// Client returns an S3 client for l. Credentials come from
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else the
// shared credentials file (AWS_SHARED_CREDENTIALS_FILE or
// ~/.aws/credentials, profile AWS_PROFILE or "default").
func (l Location) Client() (*minio.Client, error) { return l.client(0) }

// client is Client with at most tries attempts per call (0: minio-go's
// default).
func (l Location) client(tries int) (*minio.Client, error) {
	host, secure := "s3.amazonaws.com", true
	if l.Endpoint != "" {
		var err error
		if host, secure, err = splitEndpoint(l.Endpoint); err != nil {
			return nil, err
		}
	} else if l.Region != "" {
		host = "s3." + l.Region + ".amazonaws.com"
	}
	lookup := minio.BucketLookupAuto
	if l.PathStyle {
		lookup = minio.BucketLookupPath
	}
	creds := credentials.NewChainCredentials([]credentials.Provider{
		&credentials.EnvAWS{},
		&credentials.FileAWSCredentials{Filename: os.Getenv("AWS_SHARED_CREDENTIALS_FILE"), Profile: os.Getenv("AWS_PROFILE")},
	})
	return minio.New(host, &minio.Options{Creds: creds, Secure: secure, Region: l.Region, BucketLookup: lookup, MaxRetries: tries})
}

// key is the object name of name (relative to the image) in the bucket.
func (l Location) key(name string) string {
	if l.Prefix == "" {
		return name
	}
	return l.Prefix + "/" + name
}
