package cache

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

var flagRewrite = flagBool("rewrite", false, "regenerate the golden policy traces in testdata/policy from the reference model")

// TestPolicyGolden replays the traces in testdata/policy against a real
// volume and compares each request's outcome with the golden line (STYLE
// example 8). The golden outcomes come from refPolicy, a tiny reference
// model of the promotion and sequential-bypass rules; -rewrite regenerates
// them from it:
//
//	go test ./cache -run TestPolicyGolden -rewrite
//
// Trace lines (LBAs and lengths in 4 KiB blocks):
//
//	set key=value ...           change settings
//	read LBA N -> hit | miss [bypass] [promote=K]
//	write LBA N -> cache | bypass
func TestPolicyGolden(t *testing.T) {
	files, _ := filepath.Glob("testdata/policy/*.trace")
	if len(files) == 0 {
		t.Fatal("no traces in testdata/policy")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) { runPolicyTrace(t, f) })
	}
}

func runPolicyTrace(t *testing.T, path string) {
	fh, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	fh.Close()
	// 64 buckets of 16 blocks: nothing is evicted in these traces.
	s, _, _ := newTestSet(t, 64, 16*blockSize, 4096*blockSize)
	v := s.vols[0]
	ref := newRefPolicy()
	var out []string
	for ln, line := range lines {
		op, want, _ := strings.Cut(line, " -> ")
		f := strings.Fields(op)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			out = append(out, line)
			continue
		}
		if f[0] == "set" {
			st := v.Settings()
			for _, kv := range f[1:] {
				k, val, _ := strings.Cut(kv, "=")
				if err := ParseSetting(&st, k, val); err != nil {
					t.Fatalf("%s:%d: %v", path, ln+1, err)
				}
			}
			if err := v.SetSettings(st); err != nil {
				t.Fatal(err)
			}
			ref.st = st
			out = append(out, line)
			continue
		}
		if len(f) != 3 {
			t.Fatalf("%s:%d: bad line %q", path, ln+1, line)
		}
		lba, _ := strconv.ParseUint(f[1], 10, 64)
		n, _ := strconv.Atoi(f[2])
		var got, model string
		switch f[0] {
		case "read":
			got = engineRead(t, v, lba, n)
			model = ref.read(lba, n)
		case "write":
			got = engineWrite(t, v, lba, n)
			model = ref.write(lba, n)
		default:
			t.Fatalf("%s:%d: unknown op %q", path, ln+1, f[0])
		}
		if *flagRewrite {
			out = append(out, op+" -> "+model)
			continue
		}
		if got != want {
			t.Errorf("%s:%d: %s: engine %q, golden %q (reference model %q)", path, ln+1, op, got, want, model)
		}
	}
	if *flagRewrite {
		if err := os.WriteFile(path, []byte(strings.Join(out, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func engineRead(t *testing.T, v *Volume, lba uint64, n int) string {
	before := v.Stats()
	if err := v.ReadAt(make([]byte, n*blockSize), int64(lba)*blockSize); err != nil {
		t.Fatal(err)
	}
	after := v.Stats()
	var r []string
	switch {
	case after.ReadHitOps > before.ReadHitOps:
		r = append(r, "hit")
	default:
		r = append(r, "miss")
	}
	if after.BypassSequentialBytes > before.BypassSequentialBytes {
		r = append(r, "bypass")
	}
	if k := (after.PromoteBytes - before.PromoteBytes) / blockSize; k > 0 {
		r = append(r, fmt.Sprintf("promote=%d", k))
	}
	return strings.Join(r, " ")
}

func engineWrite(t *testing.T, v *Volume, lba uint64, n int) string {
	before := v.Stats()
	if err := v.WriteAt(make([]byte, n*blockSize), int64(lba)*blockSize, false); err != nil {
		t.Fatal(err)
	}
	if v.Stats().BypassSequentialBytes > before.BypassSequentialBytes {
		return "bypass"
	}
	return "cache"
}

// refPolicy is the reference model: the rules of doc.go's policy section
// written as plainly as possible, over a map of cached blocks.
type refPolicy struct {
	st      Settings
	cached  map[uint64]bool
	misses  map[uint64]int
	streams []refStream // most recently used last
}

type refStream struct{ next, seen int64 }

func newRefPolicy() *refPolicy {
	return &refPolicy{st: DefaultSettings(), cached: map[uint64]bool{}, misses: map[uint64]int{}}
}

// seq: a request continuing a remembered stream extends it; otherwise it
// starts a new one, forgetting the least recently used of 16.
func (r *refPolicy) seq(lba uint64, n int) bool {
	off, ln := int64(lba)*blockSize, int64(n)*blockSize
	for i, s := range r.streams {
		if s.next == off {
			s.next, s.seen = off+ln, s.seen+ln
			r.streams = append(append(r.streams[:i:i], r.streams[i+1:]...), s)
			return r.st.SequentialCutoff > 0 && s.seen >= r.st.SequentialCutoff
		}
	}
	if len(r.streams) == seqStreams {
		r.streams = r.streams[1:]
	}
	r.streams = append(r.streams, refStream{off + ln, ln})
	return r.st.SequentialCutoff > 0 && ln >= r.st.SequentialCutoff
}

func (r *refPolicy) read(lba uint64, n int) string {
	seq := r.seq(lba, n)
	all := true
	for i := 0; i < n; i++ {
		all = all && r.cached[lba+uint64(i)]
	}
	if all {
		return "hit"
	}
	if seq {
		return "miss bypass"
	}
	need := r.st.PromoteNeed()
	k := 0
	for i := 0; i < n; i++ {
		b := lba + uint64(i)
		if r.cached[b] || need == 0 {
			continue
		}
		r.misses[b]++
		if r.misses[b] >= need {
			delete(r.misses, b)
			r.cached[b] = true
			k++
		}
	}
	if k > 0 {
		return fmt.Sprintf("miss promote=%d", k)
	}
	return "miss"
}

func (r *refPolicy) write(lba uint64, n int) string {
	seq := r.seq(lba, n)
	for i := 0; i < n; i++ {
		r.cached[lba+uint64(i)] = !seq
	}
	if seq {
		return "bypass"
	}
	return "cache"
}
