package layout

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// Format is the head's format name; a head naming another is refused.
const Format = "tiercache-objstore/1"

// GenStart records when an owner generation began writing: its segments
// are those from sequence Start until the next generation's Start. Start 0
// means the generation fenced the previous one but has not yet chosen its
// start (it crashed while opening, or is opening now).
type GenStart struct {
	Gen   uint64 `json:"gen"`
	Start uint64 `json:"start"`
}

// Head is the small object naming an image. It changes only by
// conditional writes (If-Match on the ETag read, If-None-Match at
// creation), so two writers can never both update it from one state.
type Head struct {
	Format    string    `json:"format"`
	UUID      string    `json:"uuid"`
	Size      int64     `json:"size"`
	BlockSize int       `json:"block_size"`
	Created   time.Time `json:"created"`
	Updated   time.Time `json:"updated"`
	// Gen is the newest owner generation: each open for writing takes a
	// new one, and a segment written by an older generation past that
	// generation's range never counts.
	Gen  uint64     `json:"gen"`
	Gens []GenStart `json:"gens"` // ascending; only those that still matter after Checkpoint
	// Checkpoint is the newest checkpoint (nil: none, replay from segment 1).
	Checkpoint *SegRef `json:"checkpoint,omitempty"`
}

// OwnerOf returns the generation whose segment at sequence seq counts: the
// last generation with a chosen start at or before seq. ok is false when
// none has (a head with no generation yet).
func (h *Head) OwnerOf(seq uint64) (gen uint64, ok bool) {
	for _, g := range h.Gens {
		if g.Start != 0 && g.Start <= seq {
			gen, ok = g.Gen, true
		}
	}
	return gen, ok
}

// ImageUUID parses h.UUID.
func (h *Head) ImageUUID() (UUID, error) { return ParseUUID(h.UUID) }

func (h *Head) check() error {
	const obj = "head"
	if h.Format != Format {
		return corrupt(obj, 0, "format %q, this build reads %q", h.Format, Format)
	}
	if _, err := ParseUUID(h.UUID); err != nil {
		return corrupt(obj, 0, "uuid %q", h.UUID)
	}
	if !ValidBlockSize(h.BlockSize) {
		return corrupt(obj, 0, "block size %d", h.BlockSize)
	}
	if h.Size <= 0 {
		return corrupt(obj, 0, "size %d", h.Size)
	}
	var lastStart uint64
	for i, g := range h.Gens {
		if i > 0 && g.Gen <= h.Gens[i-1].Gen {
			return corrupt(obj, 0, "generations out of order (%d after %d)", g.Gen, h.Gens[i-1].Gen)
		}
		if g.Gen > h.Gen {
			return corrupt(obj, 0, "generation %d is newer than the head's %d", g.Gen, h.Gen)
		}
		if g.Start != 0 {
			if g.Start < lastStart {
				return corrupt(obj, 0, "generation %d starts at %d, before an earlier one's %d", g.Gen, g.Start, lastStart)
			}
			lastStart = g.Start
		}
	}
	if c := h.Checkpoint; c != nil && (c.Seq == 0 || c.Gen > h.Gen) {
		return corrupt(obj, 0, "checkpoint %d-%d", c.Seq, c.Gen)
	}
	return nil
}

// EncodeHead returns the head object: indented JSON (readable with any S3
// client) and a last line "crc32c XXXXXXXX" over the JSON.
func EncodeHead(h *Head) ([]byte, error) {
	if err := h.check(); err != nil {
		return nil, err
	}
	j, err := json.MarshalIndent(h, "", "  ")
	if err != nil {
		return nil, err
	}
	j = append(j, '\n')
	return fmt.Appendf(j, "crc32c %08x\n", CRC(j)), nil
}

// DecodeHead decodes a head object; anything but what EncodeHead writes
// is an error wrapping ErrCorrupt.
func DecodeHead(p []byte) (*Head, error) {
	const obj = "head"
	body := bytes.TrimSuffix(p, []byte("\n"))
	i := bytes.LastIndexByte(body, '\n')
	if i < 0 {
		return nil, corrupt(obj, 0, "no checksum line")
	}
	j, tail := p[:i+1], string(body[i+1:])
	var sum string
	if n, err := fmt.Sscanf(tail, "crc32c %s", &sum); n != 1 || err != nil || len(sum) != 8 {
		return nil, corrupt(obj, int64(i+1), "bad checksum line %q", tail)
	}
	want, err := strconv.ParseUint(sum, 16, 32)
	if err != nil {
		return nil, corrupt(obj, int64(i+1), "bad checksum %q", sum)
	}
	if got := CRC(j); uint32(want) != got {
		return nil, corrupt(obj, int64(i+1), "checksum %08x, computed %08x", want, got)
	}
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	h := new(Head)
	if err := dec.Decode(h); err != nil {
		return nil, corrupt(obj, dec.InputOffset(), "%v", err)
	}
	if err := h.check(); err != nil {
		return nil, err
	}
	return h, nil
}

// Lease is the content of the lease object: who owns the image for
// writing and since when. It is created with If-None-Match: * and renewed
// with If-Match on its ETag, so exactly one writer holds it.
type Lease struct {
	Host    string        `json:"host"`
	PID     int           `json:"pid"`
	Gen     uint64        `json:"gen"` // the owner's generation (0 before it has one)
	Nonce   string        `json:"nonce"`
	Renewed time.Time     `json:"renewed"`
	TTL     time.Duration `json:"ttl_ns"`
}

// EncodeLease returns the lease object.
func EncodeLease(l *Lease) ([]byte, error) { return json.Marshal(l) }

// DecodeLease decodes a lease object (errors wrap ErrCorrupt).
func DecodeLease(p []byte) (*Lease, error) {
	l := new(Lease)
	dec := json.NewDecoder(bytes.NewReader(p))
	dec.DisallowUnknownFields()
	if err := dec.Decode(l); err != nil {
		return nil, corrupt("lease", dec.InputOffset(), "%v", err)
	}
	if l.Host == "" || l.TTL <= 0 {
		return nil, corrupt("lease", 0, "no host or TTL")
	}
	return l, nil
}
