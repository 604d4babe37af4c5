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
// AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS_REGION; credentials only
// from the AWS variables or credentials file, never from flags, and never
// printed. An image's identity is s3:BUCKET/PREFIX#UUID.

// isObjImage reports whether a backing spec is an object-store image URI.
func isObjImage(spec string) bool { return objstore.IsURI(spec) }

// objLocation parses an image URI and fills what it lacks from the
// environment.
func objLocation(spec string) (objstore.Location, error) {
	l, err := objstore.ParseURI(spec)
	if err != nil {
		return l, err
	}
	return l.WithEnv(), nil
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
func openObjImage(spec string, readOnly, force bool, log *slog.Logger) (*objstore.Device, error) {
	l, err := objLocation(spec)
	if err != nil {
		return nil, err
	}
	return objstore.Open(l, objstore.Options{ReadOnly: readOnly, Force: force, Log: log})
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
func checkObjBacking(name, uri, id string, size int64) []string {
	d, err := openObjImage(uri, true, false, nil)
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

type imageOpts struct {
	endpoint, region string
	pathStyle        bool
}

// location parses a URI argument and applies the flags, then the
// environment, to what the URI does not say.
func (o *imageOpts) location(arg string) (objstore.Location, error) {
	l, err := objstore.ParseURI(arg)
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

func newImageCmd(g *globals) *cobra.Command {
	o := &imageOpts{}
	cmd := &cobra.Command{
		Use:   "image",
		Short: "Create, list, describe and remove object-store images (s3://BUCKET/PREFIX) used as backing devices",
		Long: `An image is a log-structured disk in an S3-compatible bucket, usable as a
backing device: format --backing NAME=s3://BUCKET/PREFIX, attach the same.

The store is given by the URI's query (?endpoint=URL&region=R&path-style=1),
else --endpoint/--region/--path-style, else AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL and AWS_REGION. Credentials come from AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else the shared credentials
file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE); they are never printed.`,
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&o.endpoint, "endpoint", "", "store `URL` (http://host:port or https://host); default AWS S3, or $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL")
	pf.StringVar(&o.region, "region", "", "store region (default $AWS_REGION)")
	pf.BoolVar(&o.pathStyle, "path-style", false, "address the bucket in the path, not the host name (implied by --endpoint)")

	var size, blockSize string
	create := &cobra.Command{
		Use:   "create s3://BUCKET/PREFIX --size SIZE",
		Short: "Create an all-zero image (checks the bucket, credentials and conditional writes first)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := o.location(args[0])
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
			l, err := o.location(args[0])
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
			l, err := o.location(args[0])
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
			l, err := o.location(args[0])
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
	dev, err := openObjImage(path, false, req.Force, h.log.With("volume", req.Name))
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
