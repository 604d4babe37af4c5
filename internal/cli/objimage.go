package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/tiercache/tiercache/admin"
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device/objstore"
)

// Object-store images (s3://BUCKET/PREFIX) wherever a backing device path
// is taken, and the `image` commands that manage them. The store's
// endpoint and region come from the URI's query (endpoint=, region=,
// path-style=1), else --endpoint/--region/--path-style of `image`, else
// the [s3] table of the config file, else AWS_ENDPOINT_URL_S3 /
// AWS_ENDPOINT_URL / AWS_REGION; credentials only from the AWS variables
// or credentials file, never from flags or the config file, and never
// printed. An image's identity is s3:BUCKET/PREFIX#UUID.

// isObjImage reports whether a backing spec is an object-store image URI.
func isObjImage(spec string) bool { return objstore.IsURI(spec) }

// s3Defaults say where the store is for an image URI that does not, and
// how an owner garbage-collects.
type s3Defaults struct {
	endpoint, region string
	pathStyle        bool
	// gcRate: objstore.Options.GCRate (0: its default).
	gcRate int64
}

// s3Defaults are the image command's flags (given, when called from it),
// completed by the config file's [s3] table.
func (g *globals) s3Defaults(flags s3Defaults) (s3Defaults, error) {
	p, how := g.configPath()
	if p == "" {
		return flags, nil
	}
	c, err := loadServeConfig(p)
	if err != nil {
		return flags, fmt.Errorf("%s: %w", how, err)
	}
	if c.S3 == nil {
		return flags, nil
	}
	if flags.endpoint == "" && c.S3.Endpoint != nil {
		flags.endpoint = *c.S3.Endpoint
	}
	if flags.region == "" && c.S3.Region != nil {
		flags.region = *c.S3.Region
	}
	if c.S3.PathStyle != nil && *c.S3.PathStyle {
		flags.pathStyle = true
	}
	if r := c.S3.GCRate; r != nil {
		if *r == "unlimited" {
			flags.gcRate = -1
		} else if n, err := parseSize(*r); err != nil || n <= 0 {
			return flags, fmt.Errorf("%s: [s3] gc_rate %q: want bytes per second (e.g. 16M) or \"unlimited\"", how, *r)
		} else {
			flags.gcRate = n
		}
	}
	return flags, nil
}

// location parses an image URI and applies the defaults, then the
// environment, to what the URI does not say. An endpoint from the
// defaults implies path-style addressing, as one from the environment.
func (o s3Defaults) location(spec string) (objstore.Location, error) {
	l, err := objstore.ParseURI(spec)
	if err != nil {
		return l, err
	}
	if l.Endpoint == "" && o.endpoint != "" {
		l.Endpoint, l.PathStyle = o.endpoint, true
	}
	if l.Region == "" {
		l.Region = o.region
	}
	if o.pathStyle {
		l.PathStyle = true
	}
	return l.WithEnv(), nil
}

// imageLocation is the image an image command's URI argument names, with
// the command's flags, then the config file, then the environment filling
// in what the URI does not say.
func (g *globals) imageLocation(flags s3Defaults, spec string) (objstore.Location, error) {
	d, err := g.s3Defaults(flags)
	if err != nil {
		return objstore.Location{}, err
	}
	return d.location(spec)
}

// objImageSpec is the canonical form of an image URI, recorded as the
// backing's path (as given, when it does not parse: opening says why).
func objImageSpec(spec string) string {
	l, err := objstore.ParseURI(spec)
	if err != nil {
		return spec
	}
	return l.String()
}

// openObjImage opens the image a URI names; for writing it takes the
// lease (force: even from a live holder).
func openObjImage(spec string, s3 s3Defaults, readOnly, force bool, log *slog.Logger) (*objstore.Device, error) {
	l, err := s3.location(spec)
	if err != nil {
		return nil, err
	}
	return objstore.Open(l, objstore.Options{ReadOnly: readOnly, Force: force, Log: log, GCRate: s3.gcRate})
}

// objImageID is the identity of an open image.
func objImageID(d *objstore.Device) string {
	l := d.Location()
	return "s3:" + l.Bucket + "/" + l.Prefix + "#" + d.UUID()
}

// checkObjImage reports whether d is the image whose identity was
// recorded: the UUID decides (an image copied to another prefix is the
// same image; a new image at the same prefix is not).
func checkObjImage(recorded string, d *objstore.Device) error {
	_, wantUUID, _ := strings.Cut(recorded, "#")
	if wantUUID != d.UUID() {
		return fmt.Errorf("%s is image %s, the set recorded %s", d.Location(), d.UUID(), recorded)
	}
	return nil
}

// checkObjBacking is checkBackings for an image: opened read-only, its
// size and identity compared with those recorded.
func checkObjBacking(name, uri, id string, size int64, s3 s3Defaults) []string {
	d, err := openObjImage(uri, s3, true, false, nil)
	if err != nil {
		return []string{fmt.Sprintf("backing device %q: not checked: %v", name, err)}
	}
	defer d.Close()
	var problems []string
	if d.Size() != size {
		problems = append(problems, fmt.Sprintf("backing device %q (%s) is %d bytes, the set recorded %d", name, uri, d.Size(), size))
	}
	if err := checkObjImage(id, d); err != nil {
		problems = append(problems, fmt.Sprintf("backing device %q: %v: serve refuses it without --force", name, err))
	}
	return problems
}

func newImageCmd(g *globals) *cobra.Command {
	flags := &s3Defaults{}
	cmd := &cobra.Command{
		Use:   "image",
		Short: "Create, list, describe and remove object-store images (s3://BUCKET/PREFIX) used as backing devices",
		Long: `An image is a log-structured disk in an S3-compatible bucket, usable as a
backing device: format --backing NAME=s3://BUCKET/PREFIX, attach the same.

The store is given by the URI's query (?endpoint=URL&region=R&path-style=1),
else --endpoint/--region/--path-style, else the [s3] table of the config
file (endpoint, region, path_style), else AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL and AWS_REGION. Credentials come from AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else the shared credentials
file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE); they are never printed.`,
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&flags.endpoint, "endpoint", "", "store `URL` (http://host:port or https://host); default AWS S3, or $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL")
	pf.StringVar(&flags.region, "region", "", "store region (default $AWS_REGION)")
	pf.BoolVar(&flags.pathStyle, "path-style", false, "address the bucket in the path, not the host name (implied by --endpoint)")

	var size, blockSize string
	create := &cobra.Command{
		Use:   "create s3://BUCKET/PREFIX --size SIZE",
		Short: "Create an all-zero image (checks the bucket, credentials and conditional writes first)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := g.imageLocation(*flags, args[0])
			if err != nil {
				return err
			}
			n, err := parseSize(size)
			if err != nil || n == 0 {
				return fmt.Errorf("--size: want e.g. 100G (%v)", err)
			}
			bs, err := parseSize(blockSize)
			if err != nil {
				return fmt.Errorf("--block-size: %w", err)
			}
			h, err := objstore.Create(l, n, int(bs))
			if err != nil {
				return err
			}
			fmt.Fprintf(g.stdout, "created image %s: %d bytes, block size %d, uuid %s\n", l, h.Size, h.BlockSize, h.UUID)
			return nil
		},
	}
	create.Flags().StringVar(&size, "size", "", "image size (e.g. 100G)")
	create.Flags().StringVar(&blockSize, "block-size", "4K", "image block size")

	ls := &cobra.Command{
		Use:   "ls s3://BUCKET[/PREFIX]",
		Short: "List the images under a prefix",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := g.imageLocation(*flags, args[0])
			if err != nil {
				return err
			}
			imgs, err := objstore.List(l)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "IMAGE\tSIZE\tUUID\tOWNER")
			for _, im := range imgs {
				in, err := objstore.Stat(im)
				if err != nil {
					fmt.Fprintf(tw, "s3://%s/%s\t?\t?\t%v\n", im.Bucket, im.Prefix, err)
					continue
				}
				fmt.Fprintf(tw, "s3://%s/%s\t%d\t%s\t%s\n", im.Bucket, im.Prefix, in.Head.Size, in.Head.UUID, ownerText(in))
			}
			return tw.Flush()
		},
	}

	info := &cobra.Command{
		Use:   "info s3://BUCKET/PREFIX",
		Short: "Describe an image: size, newest complete epoch and when, space, owner",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := g.imageLocation(*flags, args[0])
			if err != nil {
				return err
			}
			in, err := objstore.Stat(l)
			if err != nil {
				return err
			}
			h := in.Head
			w := g.stdout
			fmt.Fprintf(w, "image:        s3://%s/%s\n", l.Bucket, l.Prefix)
			fmt.Fprintf(w, "uuid:         %s\n", h.UUID)
			fmt.Fprintf(w, "size:         %d bytes, block size %d\n", h.Size, h.BlockSize)
			fmt.Fprintf(w, "created:      %s\n", h.Created.Format(time.RFC3339))
			if in.Seq == 0 {
				fmt.Fprintf(w, "newest epoch: none (all zero)\n")
			} else {
				fmt.Fprintf(w, "newest epoch: %d of generation %d, stored %s (segment %d)\n", in.Epoch, in.EpochGen, in.Time.UTC().Format(time.RFC3339), in.Seq)
			}
			fmt.Fprintf(w, "generation:   %d\n", h.Gen)
			if h.Checkpoint != nil {
				fmt.Fprintf(w, "checkpoint:   after segment %d\n", h.Checkpoint.Seq)
			}
			live := in.LiveBlocks * int64(h.BlockSize)
			fmt.Fprintf(w, "stored:       %d bytes in %d segments, %d live", in.StoredBytes, in.Segments, live)
			if live > 0 {
				fmt.Fprintf(w, " (space amplification %.2f)", float64(in.StoredBytes)/float64(live))
			}
			fmt.Fprintln(w)
			fmt.Fprintf(w, "owner:        %s\n", ownerText(in))
			return nil
		},
	}

	var force bool
	rm := &cobra.Command{
		Use:   "rm s3://BUCKET/PREFIX",
		Short: "Delete an image and all its objects (refused while a live lease names an owner)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := g.imageLocation(*flags, args[0])
			if err != nil {
				return err
			}
			if err := objstore.Remove(l, force); err != nil {
				if errors.Is(err, objstore.ErrOwned) {
					return fmt.Errorf("image rm: %w", err)
				}
				return err
			}
			fmt.Fprintf(g.stdout, "removed image s3://%s/%s\n", l.Bucket, l.Prefix)
			return nil
		},
	}
	rm.Flags().BoolVar(&force, "force", false, "remove even while the lease is live (its owner's writes then fail)")
	cmd.AddCommand(create, ls, info, rm)
	return cmd
}

func ownerText(in *objstore.Info) string {
	if in.Lease == nil {
		return "none"
	}
	s := fmt.Sprintf("%s pid %d (generation %d), lease renewed %s ago", in.Lease.Host, in.Lease.PID, in.Lease.Gen, in.LeaseAge.Round(time.Second))
	if in.LeaseExpired {
		s += ", expired"
	}
	return s
}

// attachObjImage is attachDevice for an image URI: the image's lease is
// taken (req.Force takes it from a live holder), and the set refuses an
// image it already has (by identity).
func (h *openedSet) attachObjImage(req admin.AttachRequest, mode cache.Mode) (*cache.Volume, string, error) {
	path := objImageSpec(req.Path)
	dev, err := openObjImage(path, h.s3, false, req.Force, h.log.With("volume", req.Name))
	if err != nil {
		return nil, "", err
	}
	id := objImageID(dev)
	for _, bi := range h.set.Superblock().Backings {
		if !bi.Free() && bi.ID == id {
			dev.Close()
			return nil, "", fmt.Errorf("%w: %s is the backing device of volume %q", cache.ErrExists, path, bi.Name)
		}
	}
	v, err := h.set.Attach(cache.BackingSpec{Name: req.Name, Dev: dev, ID: id, Path: path}, cache.AttachOptions{Mode: mode})
	if err != nil {
		dev.Close()
		return nil, "", err
	}
	h.mu.Lock()
	h.devs[req.Name] = dev
	h.locks[req.Name] = func() {}
	h.mu.Unlock()
	return v, path, nil
}

// objectStore is admin.Config.ObjectStore: the image of an export's
// object-store backing device, nil for another device.
func (h *openedSet) objectStore(export string) *admin.ObjectStore {
	h.mu.Lock()
	d, ok := h.devs[export].(*objstore.Device)
	h.mu.Unlock()
	if !ok {
		return nil
	}
	s := d.Stats()
	l := d.Location()
	o := &admin.ObjectStore{Image: "s3://" + l.Bucket + "/" + l.Prefix, Generation: s.Generation,
		Epoch: s.Epoch, EpochGeneration: s.EpochGen, Fenced: s.Fenced,
		Segments: s.Segments, StoredBytes: s.StoredBytes, LiveBytes: s.LiveBytes,
		SegmentsPut: s.SegmentsPut, BytesPut: s.BytesPut, WrittenBytes: s.BlocksWritten * d.BlockSize(), Checkpoints: s.Checkpoints,
		Gets: s.Gets, BytesGot: s.BytesGot,
		GCRuns: s.GCRuns, GCRewrittenBytes: s.GCBlocks * d.BlockSize(), GCBytesPut: s.GCBytesPut,
		GCDeletedSegments: s.GCDeleted, GCDeletedBytes: s.GCDeletedByte}
	if !s.EpochTime.IsZero() {
		t := s.EpochTime
		o.EpochTime = &t
	}
	if o.LiveBytes > 0 {
		o.SpaceAmplification = float64(o.StoredBytes) / float64(o.LiveBytes)
	}
	if o.WrittenBytes > 0 {
		o.PutAmplification = float64(o.BytesPut) / float64(o.WrittenBytes)
	}
	if o.BytesPut > 0 {
		o.GCWriteAmplification = float64(o.BytesPut+o.GCBytesPut) / float64(o.BytesPut)
	}
	return o
}

// objStoreRows are the rows stats prints for the image of each export
// with an object-store backing device ("-" for the others), in order.
var objStoreRows = []statRow[admin.ObjectStore]{
	{"objstore_image", func(o *admin.ObjectStore) string { return o.Image }},
	{"objstore_generation", func(o *admin.ObjectStore) string { return fmt.Sprint(o.Generation) }},
	{"objstore_epoch", func(o *admin.ObjectStore) string { return objEpochText(o) }},
	{"objstore_fenced", func(o *admin.ObjectStore) string {
		if o.Fenced == "" {
			return "no"
		}
		return o.Fenced
	}},
	{"objstore_segments", func(o *admin.ObjectStore) string { return fmt.Sprint(o.Segments) }},
	{"objstore_stored_bytes", func(o *admin.ObjectStore) string { return human(o.StoredBytes) }},
	{"objstore_live_bytes", func(o *admin.ObjectStore) string { return human(o.LiveBytes) }},
	{"objstore_space_amplification", func(o *admin.ObjectStore) string { return ratioText(o.SpaceAmplification) }},
	{"objstore_segments_put", func(o *admin.ObjectStore) string { return fmt.Sprint(o.SegmentsPut) }},
	{"objstore_bytes_put", func(o *admin.ObjectStore) string { return human(o.BytesPut) }},
	{"objstore_written_bytes", func(o *admin.ObjectStore) string { return human(o.WrittenBytes) }},
	{"objstore_put_amplification", func(o *admin.ObjectStore) string { return ratioText(o.PutAmplification) }},
	{"objstore_checkpoints", func(o *admin.ObjectStore) string { return fmt.Sprint(o.Checkpoints) }},
	{"objstore_gets", func(o *admin.ObjectStore) string { return fmt.Sprint(o.Gets) }},
	{"objstore_bytes_got", func(o *admin.ObjectStore) string { return human(o.BytesGot) }},
	{"objstore_gc_runs", func(o *admin.ObjectStore) string { return fmt.Sprint(o.GCRuns) }},
	{"objstore_gc_rewritten_bytes", func(o *admin.ObjectStore) string { return human(o.GCRewrittenBytes) }},
	{"objstore_gc_bytes_put", func(o *admin.ObjectStore) string { return human(o.GCBytesPut) }},
	{"objstore_gc_deleted", func(o *admin.ObjectStore) string {
		return fmt.Sprintf("%d segments, %s", o.GCDeletedSegments, human(o.GCDeletedBytes))
	}},
	{"objstore_gc_write_amplification", func(o *admin.ObjectStore) string { return ratioText(o.GCWriteAmplification) }},
}

func ratioText(r float64) string {
	if r == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", r)
}

func objEpochText(o *admin.ObjectStore) string {
	if o.Epoch == 0 {
		return "none stored since open"
	}
	s := fmt.Sprintf("%d of generation %d", o.Epoch, o.EpochGeneration)
	if o.EpochTime != nil {
		s += ", stored " + o.EpochTime.Local().Format(time.DateTime)
	}
	return s
}
