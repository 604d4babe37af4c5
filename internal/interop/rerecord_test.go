package interop

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fileState is a file's bytes and extended attributes, to show that a
// refused command changed nothing.
type fileState struct {
	data  []byte
	attrs map[string]string
}

func stateOf(t *testing.T, path string) fileState {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fileState{data: data, attrs: map[string]string{}}
	buf := make([]byte, 4096)
	n, err := unix.Listxattr(path, buf)
	if err != nil && err != unix.ENOTSUP {
		t.Fatal(err)
	}
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		v := make([]byte, 4096)
		m, err := unix.Getxattr(path, name, v)
		if err != nil {
			t.Fatal(err)
		}
		st.attrs[name] = string(v[:m])
	}
	return st
}

// sameState requires every file to be byte- and xattr-identical to before.
func sameState(t *testing.T, what string, before map[string]fileState) {
	t.Helper()
	var paths []string
	for p := range before {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		now := stateOf(t, p)
		if !bytes.Equal(now.data, before[p].data) {
			t.Errorf("%s: the refused command changed the bytes of %s", what, p)
		}
		if len(now.attrs) != len(before[p].attrs) {
			t.Errorf("%s: the refused command changed the extended attributes of %s: %v, before %v", what, p, now.attrs, before[p].attrs)
			continue
		}
		for k, v := range before[p].attrs {
			if now.attrs[k] != v {
				t.Errorf("%s: the refused command changed %s of %s: %q, before %q", what, k, p, now.attrs[k], v)
			}
		}
	}
}

func snapshot(t *testing.T, paths ...string) map[string]fileState {
	t.Helper()
	m := map[string]fileState{}
	for _, p := range paths {
		m[p] = stateOf(t, p)
	}
	return m
}

// TestTrustRefusalsWriteNothing: a refused format or attach leaves every
// file it was given byte- and xattr-identical. On main format gave the
// first backing file its identity attribute before it refused the second
// (nothing identifies a file on ramfs) and before it refused a cache
// device too small for the layout, and an offline attach under a name the
// set has left the file a new identity attribute.
func TestTrustRefusalsWriteNothing(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	rf := filepath.Join(dir, "ramfs")
	if err := os.Mkdir(rf, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, time.Minute, "mount", "-t", "ramfs", "ramfs", rf)
	t.Cleanup(func() { exec.Command("umount", "-l", rf).Run() })
	good := randomFile(t, dir, "good.img", 4*mib, 1)
	bad := randomFile(t, rf, "bad.img", 4*mib, 2)
	cache := sparseFile(t, dir, "cache.img", 16*mib)
	tiny := sparseFile(t, dir, "tiny.img", 512<<10)

	before := snapshot(t, good, bad, cache)
	refused(t, []string{`backing "b"`, "nothing identifies this device", "--trust-path"},
		"format", "--cache", cache, "--backing", "a="+good, "--backing", "b="+bad, "--bucket-size", "256K")
	sameState(t, "format with an unidentifiable second backing", before)

	before = snapshot(t, good, tiny)
	refused(t, []string{"fewer than", "buckets"},
		"format", "--cache", tiny, "--backing", "a="+good, "--bucket-size", "256K")
	sameState(t, "format of a cache device too small", before)

	// A set with volume "a"; attaching another file as "a" is refused.
	run(t, time.Minute, bin, "format", "--cache", cache, "--backing", "a="+good, "--bucket-size", "256K")
	other := randomFile(t, dir, "other.img", 4*mib, 3)
	before = snapshot(t, other, cache)
	refused(t, []string{"a volume of that name exists"}, "attach", "--cache", cache, "a="+other)
	sameState(t, "attach under a name the set has", before)
	before = snapshot(t, bad, cache)
	refused(t, []string{"nothing identifies this device", "--trust-path"}, "attach", "--cache", cache, "b="+bad)
	sameState(t, "attach of an unidentifiable device", before)
}

// TestTrustRerecordIdentity: after serve --force of a disk whose identity
// changed (a backup restored in its place: the same attributes on a new
// inode), every later serve needed --force again and no command recorded
// the disk's identity now short of a detach and an attach (main had none).
// `tiercache identity` shows what was expected and what is found, exits 1,
// and says how to proceed; --rerecord records it, refusing with nothing
// written a disk of another size, an unknown volume and an identity that
// already matches; serve then starts without --force. The same for the
// cache device (--rerecord-cache), and the dirty data is still there.
func TestTrustRerecordIdentity(t *testing.T) {
	cs, _ := dirtySet(t)
	vol := cs.backings["vol"]
	x := "unix:" + filepath.Join(cs.dir, "x.sock")
	// Restore a copy in the disk's place: same path, same attributes,
	// another inode.
	restored := vol + ".restored"
	run(t, time.Minute, "cp", "-a", vol, restored)
	if err := os.Rename(restored, vol); err != nil {
		t.Fatal(err)
	}
	refused(t, []string{`backing "vol"`, "identity mismatch", "tiercache identity --cache " + cs.cache + " --rerecord vol", "--force"},
		"serve", "--cache", cs.cache, "--listen", x)
	// serve --force serves it once; the next serve is refused again.
	s := cs.serve(t, "--force", "--data-dir", cs.dir)
	s.stop()
	refused(t, []string{`backing "vol"`, "identity mismatch"}, "serve", "--cache", cs.cache, "--listen", x)

	out := refused(t, []string{"volume vol", "NO", "PROBLEM:", "identity mismatch", "expected ", "found ", "--rerecord vol"},
		"identity", "--cache", cs.cache)
	t.Logf("identity:\n%s", out)

	// Refusals, with nothing written.
	small := randomFile(t, cs.dir, "small.img", 8*mib, 5)
	before := snapshot(t, cs.cache, vol, small)
	refused(t, []string{`volume "vol"`, "is 8388608 bytes, the set recorded 33554432", "nothing was written"},
		"identity", "--cache", cs.cache, "--backing", "vol="+small, "--rerecord", "vol")
	refused(t, []string{"--rerecord nope", "no volume of that name", "nothing was written"},
		"identity", "--cache", cs.cache, "--rerecord", "nope")
	refused(t, []string{"the cache device", "already matches", "nothing to re-record", "nothing was written"},
		"identity", "--cache", cs.cache, "--rerecord-cache")
	sameState(t, "identity --rerecord refused", before)

	out = run(t, time.Minute, bin, "identity", "--cache", cs.cache, "--rerecord", "vol")
	if !strings.Contains(out, `volume "vol"`) || !strings.Contains(out, "identity re-recorded: was ") {
		t.Errorf("identity --rerecord vol:\n%s", out)
	}
	run(t, time.Minute, bin, "identity", "--cache", cs.cache) // exit 0: everything matches
	refused(t, []string{`volume "vol"`, "already matches"}, "identity", "--cache", cs.cache, "--rerecord", "vol")

	// The cache device restored in place the same way.
	restored = cs.cache + ".restored"
	run(t, time.Minute, "cp", "-a", "--sparse=always", cs.cache, restored)
	if err := os.Rename(restored, cs.cache); err != nil {
		t.Fatal(err)
	}
	refused(t, []string{"cache device", "identity mismatch", "--rerecord-cache"}, "serve", "--cache", cs.cache, "--listen", x)
	run(t, time.Minute, bin, "identity", "--cache", cs.cache, "--rerecord-cache")

	s = cs.serve(t, "--data-dir", cs.dir)
	if out := run(t, time.Minute, "qemu-io", "-f", "raw", s.uri("vol"), "-c", "read -P 0x5a 0 1m"); strings.Contains(out, "failed") {
		t.Fatalf("the set lost its dirty data:\n%s", out)
	}
}
