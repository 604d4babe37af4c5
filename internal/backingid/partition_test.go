package backingid

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// fakeDisk makes, under the roots r, disk name (block major 8, minor
// 16*idx) with partition 1 (minor 16*idx+1): its sysfs entries (serial if
// not "", loop backing file if not "") and its device node holding img.
func fakeDisk(t *testing.T, r roots, idx int, name, serial, loopFile string, img []byte) (maj, mnr uint32) {
	t.Helper()
	dir := filepath.Join(r.sys, "devices", name)
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(dir, name+"1", "partition"), "1\n")
	write(filepath.Join(dir, "uevent"), "MAJOR=8\nDEVNAME="+name+"\nDEVTYPE=disk\n")
	write(filepath.Join(dir, "queue", "logical_block_size"), "512\n")
	if serial != "" {
		write(filepath.Join(dir, "serial"), serial+"\n")
	}
	if loopFile != "" {
		write(filepath.Join(dir, "loop", "backing_file"), loopFile+"\n")
	}
	write(filepath.Join(r.dev, name), string(img))
	mnr = uint32(16*idx + 1)
	link := filepath.Join(r.sys, "dev", "block", fmt.Sprintf("8:%d", mnr))
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, name+"1"), link); err != nil {
		t.Fatal(err)
	}
	return 8, mnr
}

// gptImage is the start of a disk whose GPT's first partition has the
// unique GUID 01 02 ... 10 (on disk: mixed-endian).
func gptImage() []byte {
	img := make([]byte, 4*512)
	copy(img[512:], "EFI PART")
	binary.LittleEndian.PutUint64(img[512+72:], 2) // entries at LBA 2
	binary.LittleEndian.PutUint32(img[512+80:], 128)
	binary.LittleEndian.PutUint32(img[512+84:], 128)
	for i := 0; i < 16; i++ {
		img[2*512+16+i] = byte(i + 1)
	}
	return img
}

const gptUUID = "04030201-0605-0807-090a-0b0c0d0e0f10"

// TestPartitionIdentityRefusesClone: a dd clone of a whole disk carries
// its partition UUIDs, so identifying a partition by its UUID alone (as
// main did, preferring it to the disk's serial plus the partition number)
// passed the clone as the disk. A partition is identified by both now. Made-up
// sysfs trees: the test machine's kernel may not parse partition tables
// (loop devices with -P then have no partitions).
func TestPartitionIdentityRefusesClone(t *testing.T) {
	tmp := t.TempDir()
	r := roots{sys: filepath.Join(tmp, "sys"), udev: filepath.Join(tmp, "udev"), dev: filepath.Join(tmp, "dev")}
	img := gptImage()
	orig := r.blockID(fakeDisk(t, r, 0, "sda", "S1", "", img))
	if want := "hw:S1-part1/partuuid:" + gptUUID; orig != want {
		t.Fatalf("partition of a disk with a serial: %q, want %q", orig, want)
	}
	// dd of the whole disk onto another disk, with and without a serial.
	if clone := r.blockID(fakeDisk(t, r, 1, "sdb", "S2", "", img)); clone == orig {
		t.Errorf("a clone onto a disk with another serial has the original's identity %q", clone)
	}
	if clone := r.blockID(fakeDisk(t, r, 2, "sdc", "", "", img)); clone == orig || clone != "partuuid:"+gptUUID {
		t.Errorf("a clone onto a disk without a serial: %q (original %q): want partuuid:%s alone, not the original's", clone, orig, gptUUID)
	}
	// The partition table rewritten on the same disk (another UUID).
	img2 := gptImage()
	img2[2*512+16] = 0xff
	if again := r.blockID(fakeDisk(t, r, 3, "sdd", "S1", "", img2)); again == orig {
		t.Errorf("a new partition table on the disk keeps the identity %q", again)
	}
	// udev's value is taken when udev recorded one.
	if err := os.MkdirAll(r.udev, 0o755); err != nil {
		t.Fatal(err)
	}
	maj, mnr := fakeDisk(t, r, 4, "sde", "S5", "", nil)
	if err := os.WriteFile(filepath.Join(r.udev, fmt.Sprintf("b%d:%d", maj, mnr)), []byte("E:ID_PART_ENTRY_UUID=abcd-01\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := r.blockID(maj, mnr); got != "hw:S5-part1/partuuid:abcd-01" {
		t.Errorf("with udev's ID_PART_ENTRY_UUID: %q", got)
	}
	// MBR: the disk signature and the partition number.
	mbr := make([]byte, 512)
	binary.LittleEndian.PutUint32(mbr[440:], 0xdeadbeef)
	mbr[510], mbr[511] = 0x55, 0xaa
	if got := r.blockID(fakeDisk(t, r, 5, "sdf", "", "", mbr)); got != "partuuid:deadbeef-01" {
		t.Errorf("MBR partition: %q, want partuuid:deadbeef-01", got)
	}
	// A partition of a loop device: the backing file's identity, so a
	// loop device over a dd copy of the file is not the disk.
	f := filepath.Join(tmp, "disk.img")
	if err := os.WriteFile(f, img, 0o600); err != nil {
		t.Fatal(err)
	}
	if id, err := EnsureID(f); err != nil || id.ID == "" {
		t.Skipf("file system keeps no user xattrs (%v)", err)
	}
	fid, _ := fileID(f)
	loopID := r.blockID(fakeDisk(t, r, 6, "loop0", "", f, img))
	if want := "loop:" + fid + "-part1/partuuid:" + gptUUID; loopID != want {
		t.Fatalf("loop partition: %q, want %q", loopID, want)
	}
	cp := filepath.Join(tmp, "clone.img")
	if err := os.WriteFile(cp, img, 0o600); err != nil {
		t.Fatal(err)
	}
	if clone := r.blockID(fakeDisk(t, r, 7, "loop1", "", cp, img)); clone == loopID {
		t.Errorf("a loop partition over a dd copy has the original's identity %q", clone)
	}
}
