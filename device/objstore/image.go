package objstore

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/tiercache/tiercache/device/objstore/layout"
)

// Errors of image management, matched with errors.Is.
var (
	// ErrNoImage: there is no head object at the location.
	ErrNoImage = errors.New("objstore: no image at this location")
	// ErrExists: Create found an image already there.
	ErrExists = errors.New("objstore: an image already exists at this location")
	// ErrFenced: another opener took a newer generation of the image; this
	// device's writes since its last successful Sync may not count, and it
	// refuses further writes.
	ErrFenced = errors.New("objstore: the image was opened for writing elsewhere (a newer owner generation); this device no longer writes to it")
	// ErrNoConditionalWrites: the store ignored If-None-Match, so it cannot
	// keep one writer per image.
	ErrNoConditionalWrites = errors.New("objstore: the store does not honour conditional writes (If-None-Match); it cannot hold an image safely")
)

// DefaultBlockSize is the image block size unless Create is told otherwise.
const DefaultBlockSize = 4096

// DefaultTimeout bounds one store call, retries included.
const DefaultTimeout = 60 * time.Second

func newStore(loc Location, tries int) (*store, error) {
	c, err := loc.client(tries)
	if err != nil {
		return nil, err
	}
	// PUTs are retried here, each attempt with its own reader: minio-go
	// retries a PUT by seeking the one reader while the transport may
	// still be reading it for the attempt before (a data race when a
	// store answers 503 before reading the body).
	putc, err := loc.client(1)
	if err != nil {
		return nil, err
	}
	if tries <= 0 {
		tries = defaultTries
	}
	return &store{c: c, putc: putc, tries: tries, loc: loc, timeout: DefaultTimeout}, nil
}

func newUUID() layout.UUID {
	var u layout.UUID
	rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return u
}

// Create makes a new, all-zero image of size bytes at loc. It checks what
// later writes need, so that a wrong endpoint, missing bucket, bad
// credentials or a store without conditional writes is one error here
// rather than a failed writeback later.
func Create(loc Location, size int64, blockSize int) (*layout.Head, error) {
	if blockSize == 0 {
		blockSize = DefaultBlockSize
	}
	if !layout.ValidBlockSize(blockSize) {
		return nil, fmt.Errorf("objstore: block size %d: want a power of two from %d to %d", blockSize, layout.MinBlockSize, layout.MaxBlockSize)
	}
	if size <= 0 || size%int64(blockSize) != 0 {
		return nil, fmt.Errorf("objstore: size %d: want a positive multiple of the block size %d", size, blockSize)
	}
	s, err := newStore(loc, 0)
	if err != nil {
		return nil, err
	}
	if err := s.checkBucket(); err != nil {
		return nil, err
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	h := &layout.Head{Format: layout.Format, UUID: newUUID().String(), Size: size, BlockSize: blockSize, Created: now, Updated: now}
	p, err := layout.EncodeHead(h)
	if err != nil {
		return nil, err
	}
	if _, err := s.put(layout.HeadName, p, putIfAbsent, ""); err != nil {
		if errors.Is(err, errPrecondition) {
			// Unless it is our own create, landed with its answer lost.
			if cur, _, rerr := s.getETag(layout.HeadName); rerr != nil || string(cur) != string(p) {
				return nil, fmt.Errorf("%s: %w", loc.Name(), ErrExists)
			}
		} else {
			return nil, err
		}
	}
	// The same conditional create again must be refused: a store that
	// accepts it would let two hosts both take an image.
	if _, err := s.put(layout.HeadName, p, putIfAbsent, ""); !errors.Is(err, errPrecondition) {
		s.remove(layout.HeadName)
		if err != nil {
			return nil, fmt.Errorf("%s: checking conditional writes: %w", loc.Name(), err)
		}
		return nil, fmt.Errorf("%s: %w", loc.Name(), ErrNoConditionalWrites)
	}
	return h, nil
}

// checkBucket turns the usual first-contact failures into one clear error.
func (s *store) checkBucket() error {
	ctx, cancel := s.ctx()
	defer cancel()
	ok, err := s.c.BucketExists(ctx, s.loc.Bucket)
	if credentialsRefused(err) {
		return fmt.Errorf("objstore: reaching bucket %q at %s: %w: %v", s.loc.Bucket, endpointName(s.loc), ErrCredentials, err)
	}
	if err != nil {
		return fmt.Errorf("objstore: reaching bucket %q at %s: %w", s.loc.Bucket, endpointName(s.loc), err)
	}
	if !ok {
		// The answer to a HEAD has no body to say why: some stores
		// (versitygw) answer an unknown access key 404. A listing's
		// error names the cause.
		lctx, lcancel := context.WithCancel(ctx)
		o, ok := <-s.c.ListObjects(lctx, s.loc.Bucket, minio.ListObjectsOptions{MaxKeys: 1})
		lcancel() // ends the listing's goroutine
		if ok && credentialsRefused(o.Err) {
			return fmt.Errorf("objstore: reaching bucket %q at %s: %w: %v", s.loc.Bucket, endpointName(s.loc), ErrCredentials, o.Err)
		}
		return fmt.Errorf("objstore: bucket %q does not exist at %s", s.loc.Bucket, endpointName(s.loc))
	}
	return nil
}

func endpointName(l Location) string {
	if l.Endpoint == "" {
		return "AWS S3"
	}
	return l.Endpoint
}

// readHead reads and decodes the head object, with its ETag.
func (s *store) readHead() (*layout.Head, string, error) {
	p, etag, err := s.getETag(layout.HeadName)
	if errors.Is(err, errNoObject) {
		return nil, "", fmt.Errorf("%s: %w", s.loc.Name(), ErrNoImage)
	}
	if err != nil {
		return nil, "", err
	}
	h, err := layout.DecodeHead(p)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", s.loc.Name(), err)
	}
	return h, etag, nil
}

// Info describes an image: its head, what recovery finds, and its owner.
type Info struct {
	Location Location
	Head     *layout.Head
	// The newest complete flush epoch in the bucket: the state a new
	// opener sees.
	Seq      uint64    // its last segment (0: nothing written)
	Epoch    uint64    // its owner's flush count
	EpochGen uint64    // the generation that wrote it
	Time     time.Time // when its last segment was stored
	// Space.
	Segments     int   // segment objects in the bucket
	StoredBytes  int64 // bytes of all segment objects
	LiveBlocks   int64 // blocks the map refers to
	Checkpoints  int
	Lease        *layout.Lease // nil when nobody owns the image
	LeaseAge     time.Duration
	LeaseExpired bool
}

// Stat recovers the image's newest state read-only and describes it.
func Stat(loc Location) (*Info, error) {
	s, err := newStore(loc, 0)
	if err != nil {
		return nil, err
	}
	h, _, err := s.readHead()
	if err != nil {
		return nil, err
	}
	st, err := recoverImage(s, h)
	if err != nil {
		return nil, err
	}
	in := &Info{Location: loc, Head: h, Seq: st.lastSeq, Epoch: st.lastEpoch, EpochGen: st.lastGen, Time: st.lastTime,
		LiveBlocks: int64(len(st.index))}
	objs, err := s.list(layout.SegDir)
	if err != nil {
		return nil, err
	}
	for _, o := range objs {
		in.Segments++
		in.StoredBytes += o.Size
	}
	ck, err := s.list(layout.CkptDir)
	if err != nil {
		return nil, err
	}
	in.Checkpoints = len(ck)
	if l, age, err := s.readLease(); err == nil && l != nil {
		in.Lease, in.LeaseAge, in.LeaseExpired = l, age, age > l.TTL
	} else if err != nil {
		return nil, err
	}
	return in, nil
}

// List returns the locations of the images under loc's prefix (the
// prefixes holding a head object), sorted.
func List(loc Location) ([]Location, error) {
	s, err := newStore(loc, 0)
	if err != nil {
		return nil, err
	}
	if err := s.checkBucket(); err != nil {
		return nil, err
	}
	objs, err := s.list("")
	if err != nil {
		return nil, err
	}
	var out []Location
	for _, o := range objs {
		full := loc.key(o.Name)
		if full != layout.HeadName && !strings.HasSuffix(full, "/"+layout.HeadName) {
			continue
		}
		l := loc
		l.Prefix = strings.TrimSuffix(strings.TrimSuffix(full, layout.HeadName), "/")
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Prefix < out[j].Prefix })
	return out, nil
}

// ErrOwned is wrapped by Remove and Open when a live lease names another
// owner.
var ErrOwned = errors.New("objstore: the image is owned")

// Remove deletes the image: its segments, checkpoints, lease and head
// (last, so that a Remove cut short leaves an image that Remove finishes).
// It is refused while the lease is live, unless force.
func Remove(loc Location, force bool) error {
	s, err := newStore(loc, 0)
	if err != nil {
		return err
	}
	if _, _, err := s.readHead(); err != nil {
		return err
	}
	l, age, err := s.readLease()
	if err != nil {
		return err
	}
	if l != nil && age <= l.TTL && !force {
		return &OwnedError{Loc: loc, Lease: *l, Age: age}
	}
	for _, dir := range []string{layout.SegDir, layout.CkptDir} {
		objs, err := s.list(dir)
		if err != nil {
			return err
		}
		for _, o := range objs {
			if err := s.remove(o.Name); err != nil {
				return err
			}
		}
	}
	if err := s.remove(layout.LeaseName); err != nil {
		return err
	}
	return s.remove(layout.HeadName)
}
