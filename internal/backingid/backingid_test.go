package backingid

import (
	"errors"
	"os"
	"path/filepath"
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
