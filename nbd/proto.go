package nbd

import "encoding/binary"

// Wire constants of the NBD protocol (doc/proto.md of NetworkBlockDevice/nbd).
// The names follow the spec: NBD_OPT_GO is optGo, NBD_FLAG_SEND_FUA is
// FlagSendFUA. Transmission-phase values that users of Client need are
// exported; handshake-phase values are not.

// Magic numbers.
const (
	nbdMagic              uint64 = 0x4e42444d41474943 // NBDMAGIC, INIT_PASSWD
	ihaveOpt              uint64 = 0x49484156454F5054 // IHAVEOPT
	optReplyMagic         uint64 = 0x3e889045565a9
	requestMagic          uint32 = 0x25609513 // NBD_REQUEST_MAGIC
	simpleReplyMagic      uint32 = 0x67446698 // NBD_SIMPLE_REPLY_MAGIC
	structuredReplyMagic  uint32 = 0x668e33ef // NBD_STRUCTURED_REPLY_MAGIC
	requestHeaderSize            = 28
	simpleReplySize              = 16
	structuredReplyHdrLen        = 20
)

// Handshake flags (server) and client flags.
const (
	flagFixedNewstyle  uint16 = 1 << 0 // NBD_FLAG_FIXED_NEWSTYLE
	flagNoZeroes       uint16 = 1 << 1 // NBD_FLAG_NO_ZEROES
	flagCFixedNewstyle uint32 = 1 << 0 // NBD_FLAG_C_FIXED_NEWSTYLE
	flagCNoZeroes      uint32 = 1 << 1 // NBD_FLAG_C_NO_ZEROES
)

// Transmission flags (NBD_FLAG_*), sent with the export size.
const (
	FlagHasFlags        uint16 = 1 << 0  // NBD_FLAG_HAS_FLAGS
	FlagReadOnly        uint16 = 1 << 1  // NBD_FLAG_READ_ONLY
	FlagSendFlush       uint16 = 1 << 2  // NBD_FLAG_SEND_FLUSH
	FlagSendFUA         uint16 = 1 << 3  // NBD_FLAG_SEND_FUA
	FlagRotational      uint16 = 1 << 4  // NBD_FLAG_ROTATIONAL
	FlagSendTrim        uint16 = 1 << 5  // NBD_FLAG_SEND_TRIM
	FlagSendWriteZeroes uint16 = 1 << 6  // NBD_FLAG_SEND_WRITE_ZEROES
	FlagSendDF          uint16 = 1 << 7  // NBD_FLAG_SEND_DF
	FlagCanMultiConn    uint16 = 1 << 8  // NBD_FLAG_CAN_MULTI_CONN
	FlagSendResize      uint16 = 1 << 9  // NBD_FLAG_SEND_RESIZE
	FlagSendCache       uint16 = 1 << 10 // NBD_FLAG_SEND_CACHE
	FlagSendFastZero    uint16 = 1 << 11 // NBD_FLAG_SEND_FAST_ZERO
)

// Options (NBD_OPT_*).
const (
	optExportName      uint32 = 1
	optAbort           uint32 = 2
	optList            uint32 = 3
	optPeekExport      uint32 = 4
	optStartTLS        uint32 = 5
	optInfo            uint32 = 6
	optGo              uint32 = 7
	optStructuredReply uint32 = 8
	optListMetaContext uint32 = 9
	optSetMetaContext  uint32 = 10
	optExtendedHeaders uint32 = 11
)

// Option reply types (NBD_REP_*).
const (
	repAck              uint32 = 1
	repServer           uint32 = 2
	repInfo             uint32 = 3
	repMetaContext      uint32 = 4
	repFlagError        uint32 = 1 << 31
	repErrUnsup         uint32 = repFlagError | 1
	repErrPolicy        uint32 = repFlagError | 2
	repErrInvalid       uint32 = repFlagError | 3
	repErrPlatform      uint32 = repFlagError | 4
	repErrTLSReqd       uint32 = repFlagError | 5
	repErrUnknown       uint32 = repFlagError | 6
	repErrShutdown      uint32 = repFlagError | 7
	repErrBlockSizeReqd uint32 = repFlagError | 8
	repErrTooBig        uint32 = repFlagError | 9
)

// Information types for NBD_OPT_INFO and NBD_OPT_GO (NBD_INFO_*).
const (
	infoExport      uint16 = 0
	infoName        uint16 = 1
	infoDescription uint16 = 2
	infoBlockSize   uint16 = 3
)

// Commands (NBD_CMD_*).
const (
	cmdRead        uint16 = 0
	cmdWrite       uint16 = 1
	cmdDisc        uint16 = 2
	cmdFlush       uint16 = 3
	cmdTrim        uint16 = 4
	cmdCache       uint16 = 5
	cmdWriteZeroes uint16 = 6
	cmdBlockStatus uint16 = 7
)

// Command flags (NBD_CMD_FLAG_*).
const (
	CmdFlagFUA      uint16 = 1 << 0 // NBD_CMD_FLAG_FUA
	CmdFlagNoHole   uint16 = 1 << 1 // NBD_CMD_FLAG_NO_HOLE
	CmdFlagDF       uint16 = 1 << 2 // NBD_CMD_FLAG_DF
	CmdFlagReqOne   uint16 = 1 << 3 // NBD_CMD_FLAG_REQ_ONE
	CmdFlagFastZero uint16 = 1 << 4 // NBD_CMD_FLAG_FAST_ZERO
)

// Structured reply flags and types (NBD_REPLY_FLAG_*, NBD_REPLY_TYPE_*).
const (
	replyFlagDone        uint16 = 1 << 0
	replyTypeNone        uint16 = 0
	replyTypeOffsetData  uint16 = 1
	replyTypeOffsetHole  uint16 = 2
	replyTypeBlockStatus uint16 = 5
	replyTypeErrorBit    uint16 = 1 << 15
	replyTypeError       uint16 = replyTypeErrorBit | 1
	replyTypeErrorOffset uint16 = replyTypeErrorBit | 2
	metaContextBaseAlloc        = "base:allocation"
	baseAllocationID     uint32 = 1 // our context id for base:allocation
)

// Error values (NBD_E*), carried in replies and in *Error.
const (
	EPERM     uint32 = 1
	EIO       uint32 = 5
	ENOMEM    uint32 = 12
	EINVAL    uint32 = 22
	ENOSPC    uint32 = 28
	EOVERFLOW uint32 = 75
	ENOTSUP   uint32 = 95
	ESHUTDOWN uint32 = 108
)

// Limits.
const (
	// maxStringLen is the spec's hard limit for strings (export names,
	// messages, context names).
	maxStringLen = 4096
	// hardMaxPayload bounds any single request payload the server will
	// buffer or discard: a WRITE longer than this is a denial of service
	// and closes the connection. The spec asks that lengths below 32 MiB
	// never be treated so.
	hardMaxPayload = 64 << 20
	// defaultMaxBlockSize is the default maximum block size (2^25, the
	// spec's interoperable maximum for READ and WRITE).
	defaultMaxBlockSize = 32 << 20
)

// request is the fixed 28-byte request header.
type requestHeader struct {
	Flags  uint16
	Type   uint16
	Handle uint64
	Offset uint64
	Length uint32
}

// encodeRequest writes h with the request magic into b[:28].
func encodeRequest(b []byte, h requestHeader) {
	_ = b[requestHeaderSize-1]
	binary.BigEndian.PutUint32(b[0:], requestMagic)
	binary.BigEndian.PutUint16(b[4:], h.Flags)
	binary.BigEndian.PutUint16(b[6:], h.Type)
	binary.BigEndian.PutUint64(b[8:], h.Handle)
	binary.BigEndian.PutUint64(b[16:], h.Offset)
	binary.BigEndian.PutUint32(b[24:], h.Length)
}

// decodeRequest parses b[:28]; ok is false when the magic is wrong.
func decodeRequest(b []byte) (h requestHeader, ok bool) {
	_ = b[requestHeaderSize-1]
	if binary.BigEndian.Uint32(b[0:]) != requestMagic {
		return h, false
	}
	h.Flags = binary.BigEndian.Uint16(b[4:])
	h.Type = binary.BigEndian.Uint16(b[6:])
	h.Handle = binary.BigEndian.Uint64(b[8:])
	h.Offset = binary.BigEndian.Uint64(b[16:])
	h.Length = binary.BigEndian.Uint32(b[24:])
	return h, true
}

// putSimpleReply writes a simple reply header into b[:16].
func putSimpleReply(b []byte, errno uint32, handle uint64) {
	_ = b[simpleReplySize-1]
	binary.BigEndian.PutUint32(b[0:], simpleReplyMagic)
	binary.BigEndian.PutUint32(b[4:], errno)
	binary.BigEndian.PutUint64(b[8:], handle)
}

// putChunkHeader writes a structured reply chunk header into b[:20].
func putChunkHeader(b []byte, flags, typ uint16, handle uint64, length uint32) {
	_ = b[structuredReplyHdrLen-1]
	binary.BigEndian.PutUint32(b[0:], structuredReplyMagic)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], handle)
	binary.BigEndian.PutUint32(b[16:], length)
}

func cmdName(t uint16) string {
	switch t {
	case cmdRead:
		return "READ"
	case cmdWrite:
		return "WRITE"
	case cmdDisc:
		return "DISC"
	case cmdFlush:
		return "FLUSH"
	case cmdTrim:
		return "TRIM"
	case cmdCache:
		return "CACHE"
	case cmdWriteZeroes:
		return "WRITE_ZEROES"
	case cmdBlockStatus:
		return "BLOCK_STATUS"
	}
	return "UNKNOWN"
}
