package bench

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseProcStatCPU(t *testing.T) {
	tests := []struct {
		name, data   string
		utime, stime uint64
		wantErr      string
	}{
		{
			name:  "qemu-nbd",
			data:  "4242 (qemu-nbd) S 1 4242 4242 0 -1 4194560 1529 0 0 0 1234 567 0 0 20 0 3 0 9999 123 456 18446744073709551615\n",
			utime: 1234, stime: 567,
		},
		{
			// The command name may hold spaces and parentheses.
			name:  "odd comm",
			data:  "7 (a) b (c) R 1 7 7 0 -1 0 0 0 0 0 5 6 0 0 20 0 1 0 1 2 3\n",
			utime: 5, stime: 6,
		},
		{name: "no paren", data: "7 a R 1", wantErr: "no ')'"},
		{name: "short", data: "7 (a) R 1 2 3", wantErr: "fields"},
		{name: "not a number", data: "7 (a) R 1 7 7 0 -1 0 0 0 0 0 x 6 0", wantErr: "utime"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u, s, err := parseProcStatCPU([]byte(tt.data))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if u != tt.utime || s != tt.stime {
				t.Errorf("utime, stime = %d, %d; want %d, %d", u, s, tt.utime, tt.stime)
			}
		})
	}
}

func TestProcessCPUSelf(t *testing.T) {
	// Burn some CPU so that at least a few ticks are counted.
	before, err := processCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	x := 0
	for start := time.Now(); time.Since(start) < 50*time.Millisecond; {
		x++
	}
	after, err := processCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after < before || after == 0 {
		t.Errorf("cpu went from %v to %v (spun %d times)", before, after, x)
	}
	if _, err := processCPU(-1); err == nil {
		t.Error("processCPU(-1) succeeded")
	}
}

func TestTicksToDuration(t *testing.T) {
	if got := ticksToDuration(250); got != 2500*time.Millisecond {
		t.Errorf("250 ticks = %v, want 2.5s", got)
	}
}

func TestParseSystemCPU(t *testing.T) {
	data := "cpu  100 5 50 1000 20 3 2 7 0 0\ncpu0 50 2 25 500 10 1 1 3 0 0\nintr 1 2 3\n"
	busy, total, err := parseSystemCPU([]byte(data))
	if err != nil {
		t.Fatal(err)
	}
	if busy != 100+5+50+3+2+7 || total != 100+5+50+1000+20+3+2+7 {
		t.Errorf("busy, total = %d, %d", busy, total)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5 6 7\n", "cpu 1 2 x 4 5 6 7\n", "cpu 1 2\n"} {
		if _, _, err := parseSystemCPU([]byte(bad)); err == nil {
			t.Errorf("parseSystemCPU(%q) succeeded", bad)
		}
	}
	if d, err := systemBusy(); err != nil || d <= 0 {
		t.Errorf("systemBusy() = %v, %v", d, err)
	}
}
