package interop

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const mib = 1 << 20

// nbdinfoJSON is the part of `nbdinfo --json` output the tests check.
type nbdinfoJSON struct {
	Exports []struct {
		ExportName    string `json:"export-name"`
		Description   string `json:"description"`
		ExportSize    int64  `json:"export-size"`
		IsReadOnly    bool   `json:"is_read_only"`
		CanFlush      bool   `json:"can_flush"`
		CanFUA        bool   `json:"can_fua"`
		CanMultiConn  bool   `json:"can_multi_conn"`
		CanTrim       bool   `json:"can_trim"`
		CanZero       bool   `json:"can_zero"`
		CanFastZero   bool   `json:"can_fast_zero"`
		CanDF         bool   `json:"can_df"`
		BlockSizeMin  int64  `json:"block_size_minimum"`
		BlockSizePref int64  `json:"block_size_preferred"`
		BlockSizeMax  int64  `json:"block_size_maximum"`
	} `json:"exports"`
}

func TestNbdinfo(t *testing.T) {
	need(t, "nbdinfo")
	dir := t.TempDir()
	a := sparseFile(t, dir, "a.img", 64*mib)
	b := sparseFile(t, dir, "b.img", 3*mib)
	s := startServer(t, "--export", "alpha="+a, "--export", "beta="+b)

	list := run(t, 30*time.Second, "nbdinfo", "--list", "--json", s.uri(""))
	var l nbdinfoJSON
	if err := json.Unmarshal([]byte(list), &l); err != nil {
		t.Fatalf("nbdinfo --list --json: %v\n%s", err, list)
	}
	sizes := map[string]int64{}
	for _, e := range l.Exports {
		sizes[e.ExportName] = e.ExportSize
	}
	if sizes["alpha"] != 64*mib || sizes["beta"] != 3*mib || len(sizes) != 2 {
		t.Fatalf("nbdinfo --list: exports %v, want alpha=64MiB beta=3MiB\n%s", sizes, list)
	}

	out := run(t, 30*time.Second, "nbdinfo", "--json", s.uri("alpha"))
	var info nbdinfoJSON
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo --json: %v\n%s", err, out)
	}
	e := info.Exports[0]
	if e.ExportSize != 64*mib || e.IsReadOnly || !e.CanFlush || !e.CanFUA || !e.CanMultiConn || !e.CanTrim || !e.CanZero || !e.CanFastZero {
		t.Errorf("alpha flags wrong: %+v\n%s", e, out)
	}
	if e.BlockSizeMin == 0 || e.BlockSizePref < e.BlockSizeMin || e.BlockSizeMax < e.BlockSizePref {
		t.Errorf("alpha block sizes wrong: min %d pref %d max %d", e.BlockSizeMin, e.BlockSizePref, e.BlockSizeMax)
	}
	if !strings.Contains(e.Description, a) {
		t.Errorf("description %q does not name the file", e.Description)
	}

	// An unknown export is refused with a message, not a hang or a crash.
	if out, err := runErr(30*time.Second, "nbdinfo", s.uri("nosuch")); err == nil {
		t.Errorf("nbdinfo of an unknown export succeeded:\n%s", out)
	}
}

func TestNbdinfoReadOnly(t *testing.T) {
	need(t, "nbdinfo", "qemu-io")
	dir := t.TempDir()
	a := sparseFile(t, dir, "a.img", 8*mib)
	s := startServer(t, "--read-only", "--export", "ro="+a)
	out := run(t, 30*time.Second, "nbdinfo", "--json", s.uri("ro"))
	var info nbdinfoJSON
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo --json: %v\n%s", err, out)
	}
	if e := info.Exports[0]; !e.IsReadOnly || e.CanTrim || e.CanZero {
		t.Errorf("read-only export flags wrong: %+v", e)
	}
	// qemu-io refuses to open a read-only export for writing, or gets EPERM.
	out, err := runErr(30*time.Second, "qemu-io", "-f", "raw", s.uri("ro"), "-c", "write -P 0x55 0 4k")
	if err == nil && !strings.Contains(out, "Permission denied") && !strings.Contains(out, "read-only") && !strings.Contains(out, "Operation not permitted") {
		t.Fatalf("write to a read-only export was not refused:\n%s", out)
	}
	if b, _ := os.ReadFile(a); bytes.Count(b, []byte{0x55}) != 0 {
		t.Fatal("read-only export was written")
	}
}

func TestQemuIO(t *testing.T) {
	need(t, "qemu-io")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 32*mib)
	s := startServer(t, "--export", "disk="+img)
	uri := s.uri("disk")

	// Patterns at aligned and odd-sized places, a FUA write, write-zeroes,
	// discard and flush; every read checks the pattern it expects.
	out := run(t, time.Minute, "qemu-io", "-f", "raw", uri,
		"-c", "write -P 0xab 0 64k",
		"-c", "write -P 0xcd 1m 4k",
		"-c", "write -f -P 0xef 2m 128k",
		"-c", "write -P 0x11 31m 1m",
		"-c", "flush",
		"-c", "read -P 0xab 0 64k",
		"-c", "read -P 0xcd 1m 4k",
		"-c", "read -P 0xef 2m 128k",
		"-c", "read -P 0x11 31m 1m",
		"-c", "read -P 0 64k 960k",
		"-c", "write -z 2m 64k",
		"-c", "read -P 0 2m 64k",
		"-c", "read -P 0xef 2112k 64k",
		"-c", "discard 31m 1m",
		"-c", "flush",
	)
	if strings.Contains(out, "Pattern verification failed") || strings.Contains(out, "error") {
		t.Fatalf("qemu-io:\n%s", out)
	}

	// A second connection sees the first one's flushed data.
	out = run(t, time.Minute, "qemu-io", "-f", "raw", uri, "-c", "read -P 0xab 0 64k", "-c", "read -P 0xcd 1m 4k")
	if strings.Contains(out, "failed") {
		t.Fatalf("second connection:\n%s", out)
	}

	// Reads past the end are refused by the client or the server, never served.
	out, _ = runErr(time.Minute, "qemu-io", "-f", "raw", uri, "-c", "read 32m 4k")
	if !strings.Contains(out, "Input/output error") && !strings.Contains(out, "out of range") && !strings.Contains(out, "Invalid argument") && !strings.Contains(out, "past end") {
		t.Errorf("read past end was not refused:\n%s", out)
	}

	// The file itself holds the flushed data (plain export: no cache).
	data, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data[:64<<10], bytes.Repeat([]byte{0xab}, 64<<10)) {
		t.Error("file does not hold the 0xab pattern at 0")
	}
}

func TestQemuImgConvertCompare(t *testing.T) {
	need(t, "qemu-img")
	dir := t.TempDir()
	src := randomFile(t, dir, "src.img", 24*mib, 7)
	img := sparseFile(t, dir, "disk.img", 24*mib)
	s := startServer(t, "--export", "disk="+img)
	uri := s.uri("disk")
	run(t, 2*time.Minute, "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", "-W", "-m", "8", src, uri)
	out := run(t, 2*time.Minute, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, uri)
	if !strings.Contains(out, "Images are identical") {
		t.Fatalf("qemu-img compare:\n%s", out)
	}
	// And a difference is detected: change one byte through NBD.
	need(t, "qemu-io")
	run(t, time.Minute, "qemu-io", "-f", "raw", uri, "-c", "write -P 0x00 12m 512")
	if out, err := runErr(2*time.Minute, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, uri); err == nil {
		t.Fatalf("qemu-img compare missed a changed sector:\n%s", out)
	}
}

func TestNbdcopyRoundTrip(t *testing.T) {
	need(t, "nbdcopy")
	dir := t.TempDir()
	src := randomFile(t, dir, "src.img", 48*mib, 11)
	img := sparseFile(t, dir, "disk.img", 48*mib)
	s := startServer(t, "--export", "disk="+img)
	uri := s.uri("disk")
	run(t, 2*time.Minute, "nbdcopy", "--connections=4", "--requests=64", "--flush", src, uri)
	back := filepath.Join(dir, "back.img")
	run(t, 2*time.Minute, "nbdcopy", "--connections=4", "--requests=64", uri, back)
	a, _ := os.ReadFile(src)
	b, err := os.ReadFile(back)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("nbdcopy round trip differs")
	}
}

func TestFioVerify(t *testing.T) {
	need(t, "fio")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 256*mib)
	s := startServer(t, "--export", "disk="+img)
	// Four jobs, each on its own 64 MiB region over its own connection, random
	// 4 KiB..64 KiB writes at QD16, then fio reads everything back and checks
	// crc32c and the block headers.
	fioVerify(t, s.uri("disk"), 4, "64m", "--do_verify=1")
	// Then a second pass that only verifies, on a fresh connection, which
	// proves the data reached the export and not only fio's view of it.
	fioVerify(t, s.uri("disk"), 4, "64m", "--verify_only=1")
}

// fioVerify runs fio's nbd engine with jobs writers, each on its own 64 MiB
// region of uri, writing size bytes of random 4..64 KiB blocks with crc32c
// verify headers; pass is --do_verify=1 (write, then verify) or
// --verify_only=1 (verify what an earlier run wrote).
func fioVerify(t *testing.T, uri string, jobs int, size, pass string) {
	t.Helper()
	out := run(t, 5*time.Minute, "fio",
		"--name=verify", "--ioengine=nbd", "--uri="+uri,
		"--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16", fmt.Sprintf("--numjobs=%d", jobs),
		"--size="+size, "--offset_increment=64m", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", pass, "--group_reporting", "--output-format=json",
	)
	checkFio(t, out)
}

// checkFio fails unless fio's JSON shows no errors.
func checkFio(t *testing.T, out string) {
	t.Helper()
	i := strings.Index(out, "{")
	if i < 0 {
		t.Fatalf("fio printed no JSON:\n%s", out)
	}
	var r struct {
		Jobs []struct {
			Error int `json:"error"`
			Read  struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"read"`
			Write struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"write"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal([]byte(out[i:]), &r); err != nil {
		t.Fatalf("fio JSON: %v\n%s", err, out)
	}
	if len(r.Jobs) == 0 {
		t.Fatalf("fio ran no job:\n%s", out)
	}
	var moved int64
	for _, j := range r.Jobs {
		if j.Error != 0 {
			t.Fatalf("fio job error %d:\n%s", j.Error, out)
		}
		moved += j.Read.IOBytes + j.Write.IOBytes
	}
	if moved == 0 {
		t.Fatalf("fio moved no data:\n%s", out)
	}
	if strings.Contains(out, "verify:") || strings.Contains(out, "bad magic") || strings.Contains(out, "crc32c: verify failed") {
		t.Fatalf("fio reported verify failures:\n%s", out)
	}
}

func TestTCPListen(t *testing.T) {
	need(t, "qemu-io")
	dir := t.TempDir()
	img := sparseFile(t, dir, "disk.img", 4*mib)
	port := freePort(t)
	sock := filepath.Join(dir, "probe.sock")
	// Listen on both: the unix socket is how startServerRaw waits for readiness.
	startServerRaw(t, sock, "serve", "--listen", "unix:"+sock, "--listen", fmt.Sprintf("tcp::%d", port), "--export", "disk="+img)
	uri := fmt.Sprintf("nbd://127.0.0.1:%d/disk", port)
	out := run(t, time.Minute, "qemu-io", "-f", "raw", uri, "-c", "write -P 0x42 0 8k", "-c", "flush", "-c", "read -P 0x42 0 8k")
	if strings.Contains(out, "failed") {
		t.Fatalf("qemu-io over TCP:\n%s", out)
	}
}
