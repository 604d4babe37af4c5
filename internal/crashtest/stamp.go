package crashtest

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

// BlockSize is the unit the harness stamps, tracks and checks.
const BlockSize = 4096

// Stamp layout of one 4 KiB block (little endian):
//
//	[0:8)       magic "TCCRASH1"
//	[8:16)      run seed
//	[16:24)     LBA (byte offset / BlockSize)
//	[24:32)     write id (never 0; 0 means "all zeroes")
//	[32:4092)   filler, a function of (seed, LBA, write id)
//	[4092:4096) CRC32-C of [0:4092)
const (
	stampMagic = "TCCRASH1"
	crcOff     = BlockSize - 4
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Stamp fills b (len BlockSize) with the contents of write id at lba.
func Stamp(b []byte, seed, lba, id uint64) {
	copy(b[0:8], stampMagic)
	binary.LittleEndian.PutUint64(b[8:], seed)
	binary.LittleEndian.PutUint64(b[16:], lba)
	binary.LittleEndian.PutUint64(b[24:], id)
	x := seed ^ lba*0x9E3779B97F4A7C15 ^ id*0xC2B2AE3D27D4EB4F | 1
	for i := 32; i+8 <= crcOff; i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	// 4092-32 is not a multiple of 8: the last 4 filler bytes.
	binary.LittleEndian.PutUint32(b[crcOff-4:], uint32(x>>32))
	binary.LittleEndian.PutUint32(b[crcOff:], crc32.Checksum(b[:crcOff], castagnoli))
}

// Kind classifies a block read back.
type Kind int

const (
	// KindZero: all zeroes (never written, trimmed or write-zeroed).
	KindZero Kind = iota
	// KindWrite: a valid stamp of this run for this LBA.
	KindWrite
	// KindTorn: a stamp header whose CRC does not match (a torn or
	// corrupted block).
	KindTorn
	// KindMisdirected: a valid stamp of this run, for another LBA.
	KindMisdirected
	// KindForeign: a valid stamp of another run (another seed).
	KindForeign
	// KindGarbage: neither zero nor a stamp.
	KindGarbage
)

func (k Kind) String() string {
	switch k {
	case KindZero:
		return "zero"
	case KindWrite:
		return "write"
	case KindTorn:
		return "torn"
	case KindMisdirected:
		return "misdirected"
	case KindForeign:
		return "foreign"
	}
	return "garbage"
}

// Decoded is what a block read back holds.
type Decoded struct {
	Kind Kind
	ID   uint64 // write id for KindWrite, KindMisdirected, KindForeign, KindTorn (as the header claims)
	LBA  uint64 // LBA the stamp names
	Seed uint64 // seed the stamp names
}

func (d Decoded) String() string {
	switch d.Kind {
	case KindZero:
		return "zeroes"
	case KindWrite:
		return fmt.Sprintf("w%d", d.ID)
	case KindGarbage:
		return "garbage"
	}
	return fmt.Sprintf("%s (header: seed %d lba %d w%d)", d.Kind, d.Seed, d.LBA, d.ID)
}

// Decode classifies block b read at lba in the run with seed.
func Decode(b []byte, seed, lba uint64) Decoded {
	if len(b) != BlockSize {
		return Decoded{Kind: KindGarbage}
	}
	if isZero(b) {
		return Decoded{Kind: KindZero}
	}
	if string(b[0:8]) != stampMagic {
		return Decoded{Kind: KindGarbage}
	}
	d := Decoded{
		Seed: binary.LittleEndian.Uint64(b[8:]),
		LBA:  binary.LittleEndian.Uint64(b[16:]),
		ID:   binary.LittleEndian.Uint64(b[24:]),
	}
	switch {
	case crc32.Checksum(b[:crcOff], castagnoli) != binary.LittleEndian.Uint32(b[crcOff:]) || d.ID == 0:
		d.Kind = KindTorn
	case d.Seed != seed:
		d.Kind = KindForeign
	case d.LBA != lba:
		d.Kind = KindMisdirected
	default:
		d.Kind = KindWrite
	}
	return d
}

func isZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
