package backingid

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestClaimFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(p, []byte("data that must not change"), 0o600); err != nil {
		t.Fatal(err)
	}
	id, err := Read(p)
	if err != nil {
		t.Fatal(err)
	}
	if id.ID != "" || id.Set != "" {
		t.Fatalf("fresh file has identity %+v", id)
	}
	a, err := Claim(p, "set-a", false)
	if err != nil {
		t.Fatal(err)
	}
	if a.ID == "" {
		t.Skip("file system keeps no user xattrs")
	}
	again, err := Read(p)
	if err != nil || again != a {
		t.Fatalf("Read after Claim = %+v, %v; want %+v", again, err, a)
	}
	if _, err := Claim(p, "set-b", false); !errors.Is(err, ErrAttachedElsewhere) {
		t.Fatalf("claim by another set: %v, want ErrAttachedElsewhere", err)
	}
	b, err := Claim(p, "set-b", true)
	if err != nil || b.ID != a.ID || b.Set != "set-b" {
		t.Fatalf("forced claim = %+v, %v", b, err)
	}
	if err := Release(p); err != nil {
		t.Fatal(err)
	}
	if r, _ := Read(p); r.Set != "" || r.ID != a.ID {
		t.Fatalf("after Release: %+v", r)
	}
	if _, err := Claim(p, "set-c", false); err != nil {
		t.Fatalf("claim after release: %v", err)
	}
	data, _ := os.ReadFile(p)
	if string(data) != "data that must not change" {
		t.Fatal("claiming changed the file's bytes")
	}
}

func TestUUID(t *testing.T) {
	a, b := NewUUID(), NewUUID()
	if a == b || len(a) != 36 || a[14] != '4' {
		t.Fatalf("bad UUIDs %q %q", a, b)
	}
}

// TestCopyWithAttributes: a copy that carries the identity attribute (cp -a,
// rsync -X, a restore that keeps xattrs) is not the file: Check refuses it
// and says it looks like such a copy.
func TestCopyWithAttributes(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(p, []byte("disk"), 0o600); err != nil {
		t.Fatal(err)
	}
	id, err := EnsureID(p)
	if err != nil {
		t.Fatal(err)
	}
	if id.ID == "" {
		t.Skip("file system keeps no user xattrs")
	}
	if err := Check(id.ID, p); err != nil {
		t.Fatalf("the file itself: %v", err)
	}
	u, err := getxattr(p, xattrID)
	if err != nil {
		t.Fatal(err)
	}
	c := filepath.Join(dir, "copy.img")
	if err := os.WriteFile(c, []byte("disk"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := setxattr(c, xattrID, u); err != nil {
		t.Fatal(err)
	}
	err = Check(id.ID, c)
	var me *MismatchError
	if !errors.As(err, &me) || !strings.Contains(err.Error(), "a copy made with its extended attributes") {
		t.Fatalf("Check of a copy with the attribute = %v, want a mismatch naming the copy", err)
	}
	// Renaming keeps the identity.
	r := filepath.Join(dir, "renamed.img")
	if err := os.Rename(p, r); err != nil {
		t.Fatal(err)
	}
	if err := Check(id.ID, r); err != nil {
		t.Fatalf("after a rename: %v", err)
	}
}
