package names

import (
	"errors"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, ok := range []string{"a", "default", "home-2", "vm_01.disk", "db@host:5", "A+B", strings.Repeat("x", MaxLen)} {
		if err := Check(ok); err != nil {
			t.Errorf("Check(%q) = %v, want nil", ok, err)
		}
	}
	for _, bad := range []string{"", "../etc", "a/b", "..", ".hidden", "-x", "a\nb", "a\x1b[31mred", "a b", "é", "a=b", "a\x00", strings.Repeat("x", MaxLen+1)} {
		err := Check(bad)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("Check(%q) = %v, want ErrInvalid", bad, err)
			continue
		}
		if strings.ContainsAny(err.Error(), "\n\x1b\x00") {
			t.Errorf("Check(%q): the message carries a control byte: %q", bad, err.Error())
		}
	}
}
