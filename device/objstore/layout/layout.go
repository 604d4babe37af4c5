// Package layout is the on-bucket format of an object-store image: the
// names of its objects and the encoders and decoders of each. It does no
// I/O. Every decoder checks what it reads and returns an error wrapping
// ErrCorrupt (never a panic) for bytes that are not what an encoder wrote.
//
// An image under PREFIX is these objects:
//
//	PREFIX/head                 JSON: size, block size, UUID, generations, newest checkpoint
//	PREFIX/lease                JSON: the owner (host, pid, generation, renewed)
//	PREFIX/seg/SSSSSSSSSSSSSSSS-GGGGGGGG   a segment: sequence S, owner generation G (hex)
//	PREFIX/ckpt/SSSSSSSSSSSSSSSS-GGGGGGGG  a checkpoint of the map after segment S
//
// A segment is immutable: the blocks of one flush epoch (or one part of a
// large epoch), LBA-sorted, after a header listing their extents and a
// CRC32C per block (the header's length follows from its counts):
//
//	+--------------------------------------------------------------+
//	| fixed header (64 bytes)                                      |
//	|   magic "TCSEG\0\0\1" | version u32 | flags u32 (1 = final)  |
//	|   seq u64 | gen u64 | epoch u64 | uuid [16]                  |
//	|   blockSize u32 | nExtents u32                               |
//	| extents: nExtents x {lba u64, count u32, flags u32 (1=zero)} |
//	| crcs: nBlocks x u32 (CRC32C of each data block)              |
//	| header CRC32C u32 (of everything above)                      |
//	+--------------------------------------------------------------+
//	| data: nBlocks x blockSize, in extent order (zero extents     |
//	| carry no data)                                               |
//	+--------------------------------------------------------------+
//
// All integers are little-endian. A checkpoint is the whole map (every
// written block's segment, offset and CRC) as extents over a table of the
// segments they refer to, with one CRC32C over the object.
package layout

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"strconv"
	"strings"
)

// ErrCorrupt is wrapped by every decoding error: the bytes are not a valid
// object of the expected kind. Match with errors.Is or IsCorruption.
var ErrCorrupt = errors.New("objstore: corrupt object")

// IsCorruption reports whether err reports a corrupt object.
func IsCorruption(err error) bool { return errors.Is(err, ErrCorrupt) }

// CorruptError is a decoding failure with its context.
type CorruptError struct {
	Object string // what was decoded ("segment", "checkpoint", "head", or an object name)
	Off    int64  // byte offset in the object where the problem was found
	Reason string
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("objstore: corrupt %s at byte %d: %s", e.Object, e.Off, e.Reason)
}

func (e *CorruptError) Unwrap() error { return ErrCorrupt }

func corrupt(obj string, off int64, format string, a ...any) error {
	return &CorruptError{Object: obj, Off: off, Reason: fmt.Sprintf(format, a...)}
}

// Castagnoli is the CRC32C table every checksum of the format uses.
var Castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC returns the CRC32C of p.
func CRC(p []byte) uint32 { return crc32.Checksum(p, Castagnoli) }

// Limits that bound what a decoder accepts, so that a forged count cannot
// make it allocate without bound.
const (
	MinBlockSize = 512
	MaxBlockSize = 1 << 20
	// MaxSegmentBlocks bounds the data blocks of one segment.
	MaxSegmentBlocks = 1 << 20
	// MaxCheckpointBlocks bounds the blocks a checkpoint maps (2^32: 16 TiB
	// of 4 KiB blocks).
	MaxCheckpointBlocks = 1 << 32
)

// ValidBlockSize reports whether bs is a supported block size: a power of
// two in [MinBlockSize, MaxBlockSize].
func ValidBlockSize(bs int) bool {
	return bs >= MinBlockSize && bs <= MaxBlockSize && bs&(bs-1) == 0
}

// Object names, relative to the image prefix.
const (
	HeadName  = "head"
	LeaseName = "lease"
	SegDir    = "seg/"
	CkptDir   = "ckpt/"
)

// SegName is the name of segment seq written by generation gen.
func SegName(seq, gen uint64) string { return SegDir + seqGen(seq, gen) }

// CkptName is the name of the checkpoint after segment seq by generation gen.
func CkptName(seq, gen uint64) string { return CkptDir + seqGen(seq, gen) }

func seqGen(seq, gen uint64) string { return fmt.Sprintf("%016x-%08x", seq, gen) }

// ParseSeqGen parses the SSSSSSSSSSSSSSSS-GGGGGGGG tail of a segment or
// checkpoint name (after its directory).
func ParseSeqGen(s string) (seq, gen uint64, err error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok || len(a) != 16 || len(b) < 8 {
		return 0, 0, corrupt("object name", 0, "%q is not SEQ-GEN", s)
	}
	seq, err1 := strconv.ParseUint(a, 16, 64)
	gen, err2 := strconv.ParseUint(b, 16, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, corrupt("object name", 0, "%q is not SEQ-GEN in hex", s)
	}
	return seq, gen, nil
}

// UUID is an image's identity, written into every segment and checkpoint so
// that objects of another image (a copied or reused prefix) are refused.
type UUID [16]byte

func (u UUID) String() string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// ParseUUID parses the form String prints.
func ParseUUID(s string) (UUID, error) {
	var u UUID
	h := strings.ReplaceAll(s, "-", "")
	if len(h) != 32 || strings.Count(s, "-") != 4 {
		return u, corrupt("uuid", 0, "%q is not a UUID", s)
	}
	for i := range 16 {
		v, err := strconv.ParseUint(h[2*i:2*i+2], 16, 8)
		if err != nil {
			return u, corrupt("uuid", 0, "%q is not a UUID", s)
		}
		u[i] = byte(v)
	}
	return u, nil
}

var le = binary.LittleEndian
