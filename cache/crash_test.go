package cache

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/device"
)

var (
	flagSeeds = flag.Int("seeds", 0, "number of TestCrashModel seeds (default 2000; 200 with -short or -race)")
	flagSeed  = flag.Int64("seed", -1, "run TestCrashModel for this seed only")
	flagOps   = flag.Int("ops", 50, "operations per TestCrashModel seed")
)

// TestCrashModel is a model-based crash test. A reference model (one byte
// slice per volume) receives the same random writes, reads, flushes, FUA
// writes, trims, write-zeroes, mode switches and drains as the cache set;
// reads are compared exactly. At random points both the cache and the
// backing devices are crash-cloned (unsynced blocks kept, lost or torn), the
// set is reopened from the clones, and every 4 KiB block must hold one of
// the contents the model allows (STYLE example 5, refined to 512-byte
// sectors because an unflushed write may be torn on the backing device): its last durable content
// or any content written since (maybe-new). A FLUSH or FUA reply collapses
// the allowed set to the current content (durable-new, invariant 2). Caches
// are a few tiny buckets, so writeback, eviction and checkpoints run all the
// time.
//
// Every written sector is stamped with (write id, volume, sector), so a
// mismatch names the write that landed there. Replay a failure with
//
//	go test ./cache -run TestCrashModel -seed N -v
func TestCrashModel(t *testing.T) {
	if *flagSeed >= 0 {
		runCrashSeed(t, uint64(*flagSeed), *flagOps)
		return
	}
	def := *flagSeeds
	if def == 0 {
		def = 2000
		if testing.Short() || raceEnabled {
			def = 200
		}
	}
	first, n := stressSeeds(t, "CRASHMODEL", def)
	start := time.Now()
	for seed := first; seed < first+n; seed++ {
		if !runCrashSeed(t, seed, *flagOps) {
			return
		}
	}
	t.Logf("seeds %d..%d in %v", first, first+n-1, time.Since(start))
}

type modelVol struct {
	cur  []byte     // exact current content
	cand [][][]byte // per block: allowed contents after a crash
}

type crashRun struct {
	t     *testing.T
	seed  uint64
	rng   *rand.Rand
	log   []string
	cache *device.Mem
	backs []*device.Mem
	hide  bool // backing devices without Discarder/Zeroer
	specs []BackingSpec
	set   *Set
	model []*modelVol
	wid   uint64
	sets  []Settings // per volume: what SetSettings/SetMode last set (durable at once)
}

// plainDev hides the optional capabilities of a device.
type plainDev struct{ device.Device }

func (r *crashRun) logf(format string, args ...any) {
	r.log = append(r.log, fmt.Sprintf(format, args...))
}

func (r *crashRun) fatalf(format string, args ...any) {
	r.t.Helper()
	last := r.log
	if len(last) > 200 {
		last = last[len(last)-200:]
	}
	r.t.Fatalf("seed %d: %s\nreplay: go test ./cache -run TestCrashModel -seed %d -v\nop log:\n  %s",
		r.seed, fmt.Sprintf(format, args...), r.seed, strings.Join(last, "\n  "))
}

func runCrashSeed(t *testing.T, seed uint64, nops int) bool {
	r := &crashRun{t: t, seed: seed, rng: rand.New(rand.NewPCG(seed, 0x7c))}
	ok := t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
		r.t = t
		r.run(nops)
	})
	return ok
}

func (r *crashRun) run(nops int) {
	rng := r.rng
	bs := int64(blockSize) * int64(2+rng.IntN(3)) // 2..4 blocks per bucket
	nb := int64(minBuckets + rng.IntN(6))
	nvols := 1 + rng.IntN(2)
	r.hide = rng.IntN(4) == 0
	jl := int64(minJournalLen)
	r.cache = device.NewMem(cacheSizeForPaged(nb, bs, jl, nvols, testIndexPages(r.seed)))
	for i := 0; i < nvols; i++ {
		size := int64(16+rng.IntN(48)) * blockSize
		if rng.IntN(4) == 0 {
			size -= int64(1+rng.IntN(7)) * 512 // a partial last block
		}
		b := device.NewMem(size)
		r.backs = append(r.backs, b)
		r.model = append(r.model, &modelVol{cur: make([]byte, size), cand: make([][][]byte, (size+blockSize-1)/blockSize)})
	}
	r.specs = r.makeSpecs()
	mode := Mode(rng.IntN(4))
	r.logf("format: %d buckets of %d, %d volumes, mode %v, hide caps %t, index pages %t", nb, bs, nvols, mode, r.hide, testIndexPages(r.seed))
	if _, err := Format(r.cache, r.specs, FormatOptions{BucketSize: bs, JournalSize: jl, Mode: mode, markShift: testMarkShift(r.seed), IndexPages: testIndexPages(r.seed)}); err != nil {
		r.fatalf("format: %v", err)
	}
	r.open()
	defer func() { r.set.crashStop() }()
	for vi := range r.model {
		st := DefaultSettings()
		st.Mode = mode
		r.sets = append(r.sets, st)
		if rng.IntN(2) == 0 {
			r.randomSettings(vi)
		}
	}
	for _, m := range r.model {
		for b := range m.cand {
			m.cand[b] = [][]byte{r.block(m, b)}
		}
	}
	for i := 0; i < nops; i++ {
		t0 := time.Now()
		r.step()
		if d := time.Since(t0); d > 5*time.Millisecond {
			r.t.Logf("slow op %v: %s", d, r.log[len(r.log)-1])
		}
		if err := r.set.Check(); err != nil {
			r.fatalf("after op %d: Check: %v", i, err)
		}
	}
	// Clean shutdown keeps everything.
	r.logf("close + reopen")
	if err := r.set.Close(); err != nil {
		r.fatalf("close: %v", err)
	}
	if sb, err := ReadSuperblock(r.cache); err != nil || !sb.Clean {
		r.fatalf("after Close: superblock %+v, %v (want clean)", sb, err)
	}
	r.open()
	for vi, m := range r.model {
		if st := r.set.vols[vi].Settings(); st != r.sets[vi] {
			r.fatalf("after clean reopen, vol%d settings %+v, want %+v", vi, st, r.sets[vi])
		}
		got := make([]byte, len(m.cur))
		if err := r.set.vols[vi].ReadAt(got, 0); err != nil {
			r.fatalf("read after clean reopen: %v", err)
		}
		if !bytes.Equal(got, m.cur) {
			r.fatalf("after clean reopen, volume %d differs: %s", vi, r.describe(vi, got, m.cur))
		}
	}
}

func (r *crashRun) makeSpecs() []BackingSpec {
	var specs []BackingSpec
	for i, b := range r.backs {
		var d device.Device = b
		if r.hide {
			d = plainDev{b}
		}
		specs = append(specs, BackingSpec{Name: fmt.Sprintf("vol%d", i), Dev: d, ID: fmt.Sprintf("id-%d", i)})
	}
	return specs
}

func (r *crashRun) open() {
	s, err := Open(r.cache, r.specs, OpenOptions{})
	if err != nil {
		r.fatalf("open: %v", err)
	}
	if err := checkCleanCoherent(s); err != nil {
		r.fatalf("open: %v", err)
	}
	r.set = s
}

func (r *crashRun) block(m *modelVol, b int) []byte {
	end := min(int64(b+1)*blockSize, int64(len(m.cur)))
	return bytes.Clone(m.cur[int64(b)*blockSize : end])
}

// touched appends the current content of blocks overlapping [off, off+n) to
// their allowed sets; durable collapses the set to the current content.
func (r *crashRun) touched(vi int, off, n int64, durable bool) {
	m := r.model[vi]
	if n <= 0 {
		return
	}
	for b := off / blockSize; b <= (off+n-1)/blockSize; b++ {
		c := r.block(m, int(b))
		if durable {
			m.cand[b] = [][]byte{c}
		} else {
			m.cand[b] = append(m.cand[b], c)
		}
	}
}

// stamp fills p (at volume offset off) with sectors naming (write, volume, sector):
// bytes 0-7 of each sector hold the write id, 8-15 the sector number, 16 the
// volume, the rest a filler derived from the write id.
func stamp(p []byte, wid uint64, vi int, off int64) {
	var tmpl [512]byte
	for in := 17; in < 512; in++ {
		tmpl[in] = byte(wid*31 + uint64(in))
	}
	le.PutUint64(tmpl[0:], wid)
	tmpl[16] = byte(vi)
	for i := 0; i < len(p); {
		pos := off + int64(i)
		sec, in := pos/512, int(pos%512)
		le.PutUint64(tmpl[8:], uint64(sec))
		i += copy(p[i:], tmpl[in:])
	}
}

func describeSector(p []byte) string {
	if len(p) < 17 {
		return "short"
	}
	if ondisk.IsZero(p) {
		return "zero"
	}
	return fmt.Sprintf("w%d/s%d", le.Uint64(p), le.Uint64(p[8:]))
}

func (r *crashRun) describe(vi int, got, want []byte) string {
	for i := 0; i < len(got); i += 512 {
		e := min(i+512, len(got))
		if !bytes.Equal(got[i:e], want[i:e]) {
			return fmt.Sprintf("first difference in sector %d (byte %d): got %s, want %s", i/512, i, describeSector(got[i:e]), describeSector(want[i:e]))
		}
	}
	return "equal"
}

func (r *crashRun) randRange(vi int) (int64, int64) {
	size := int64(len(r.model[vi].cur))
	var off, n int64
	if r.rng.IntN(3) == 0 { // sector-granular
		off = int64(r.rng.Int64N(size/512)) * 512
		n = int64(1+r.rng.IntN(16)) * 512
	} else {
		off = int64(r.rng.Int64N((size+blockSize-1)/blockSize)) * blockSize
		n = int64(1+r.rng.IntN(8)) * blockSize
	}
	if off >= size {
		off = size - 512
	}
	return off, min(n, size-off)
}

func (r *crashRun) step() {
	rng := r.rng
	vi := rng.IntN(len(r.model))
	v := r.set.vols[vi]
	m := r.model[vi]
	switch k := rng.IntN(100); {
	case k < 3: // settings (all keys, persisted)
		r.randomSettings(vi)
		return
	case k < 5: // one GC step now: eviction, writeback of a victim, GC moves
		r.logf("gc")
		r.set.evictOne()
		return
	}
	switch k := rng.IntN(100); {
	case k < 40: // write
		off, n := r.randRange(vi)
		fua := rng.IntN(5) == 0
		r.wid++
		p := make([]byte, n)
		stamp(p, r.wid, vi, off)
		r.logf("write w%d vol%d off=%d len=%d fua=%t mode=%v", r.wid, vi, off, n, fua, v.Mode())
		if err := v.WriteAt(p, off, fua); err != nil {
			r.fatalf("write: %v", err)
		}
		copy(m.cur[off:], p)
		r.touched(vi, off, n, fua)
	case k < 60: // read
		off, n := r.randRange(vi)
		got := make([]byte, n)
		r.logf("read vol%d off=%d len=%d", vi, off, n)
		if err := v.ReadAt(got, off); err != nil {
			r.fatalf("read: %v", err)
		}
		if !bytes.Equal(got, m.cur[off:off+n]) {
			r.fatalf("read vol%d off=%d len=%d: %s", vi, off, n, r.describe(vi, got, m.cur[off:off+n]))
		}
	case k < 70: // flush
		r.logf("flush vol%d", vi)
		if err := v.Flush(); err != nil {
			r.fatalf("flush: %v", err)
		}
		r.touched(vi, 0, int64(len(m.cur)), true)
	case k < 75: // trim
		off, n := r.randRange(vi)
		fua := rng.IntN(3) == 0
		r.logf("trim vol%d off=%d len=%d fua=%t", vi, off, n, fua)
		if err := v.Trim(off, n, fua); err != nil {
			r.fatalf("trim: %v", err)
		}
		if !r.hide { // whole blocks inside the range now read as zeroes
			a := (off + blockSize - 1) / blockSize * blockSize
			b := (off + n) / blockSize * blockSize
			if off+n == int64(len(m.cur)) {
				b = off + n
			}
			if a < b {
				clear(m.cur[a:b])
				r.touched(vi, a, b-a, fua)
			}
		}
	case k < 82: // write zeroes
		off, n := r.randRange(vi)
		fua := rng.IntN(3) == 0
		r.logf("write-zeroes vol%d off=%d len=%d fua=%t", vi, off, n, fua)
		if err := v.WriteZeroes(off, n, fua, true, false); err != nil {
			r.fatalf("write-zeroes: %v", err)
		}
		clear(m.cur[off : off+n])
		r.touched(vi, off, n, fua)
	case k < 87: // mode switch
		mode := Mode(rng.IntN(4))
		r.logf("set-mode vol%d %v", vi, mode)
		if err := v.SetMode(mode); err != nil {
			r.fatalf("set-mode: %v", err)
		}
		r.sets[vi].Mode = mode
	case k < 89: // drain
		r.logf("drain")
		if err := r.set.Drain(context.Background()); err != nil {
			r.fatalf("drain: %v", err)
		}
		if st := r.set.Stats(); st.DirtyBlocks != 0 {
			r.fatalf("after drain: %d dirty blocks", st.DirtyBlocks)
		}
	case k < 91: // prefetch
		off, n := r.randRange(vi)
		r.logf("prefetch vol%d off=%d len=%d", vi, off, n)
		if err := v.Prefetch(off, n); err != nil {
			r.fatalf("prefetch: %v", err)
		}
	default:
		r.crash()
	}
}

func (r *crashRun) crash() {
	keep := []float64{0, 0.5, 1}[r.rng.IntN(3)]
	torn := []float64{0, 0.2}[r.rng.IntN(2)]
	r.logf("crash keep=%.1f torn=%.1f", keep, torn)
	cfg := device.CrashConfig{UnsyncedKeep: keep, TornProb: torn, Rand: r.rng}
	// Every device at one instant, as in a power cut: cloned one after
	// the other, a backing device could take writeback of data whose
	// insert record the cache's clone lacks, and recovery would then
	// rightly keep the older clean entry it replaced, which no real crash
	// can leave over newer backing data (marks.go, rule 4).
	clones := device.CrashCloneAll(cfg, append([]*device.Mem{r.cache}, r.backs...)...)
	cache, backs := clones[0], clones[1:]
	r.set.crashStop()
	r.cache, r.backs = cache, backs
	r.specs = r.makeSpecs()
	r.open()
	for vi, m := range r.model {
		v := r.set.vols[vi]
		got := make([]byte, len(m.cur))
		if err := v.ReadAt(got, 0); err != nil {
			r.fatalf("read after crash: %v", err)
		}
		for b := range m.cand {
			g := got[int64(b)*blockSize : min(int64(b+1)*blockSize, int64(len(got)))]
			// Per sector: an unflushed write may be torn, as on a disk.
			ok := true
			for i := 0; i < len(g); i += 512 {
				e := min(i+512, len(g))
				found := false
				for _, c := range m.cand[b] {
					if bytes.Equal(g[i:e], c[i:e]) {
						found = true
						break
					}
				}
				ok = ok && found
			}
			if !ok {
				var allowed []string
				for _, c := range m.cand[b] {
					allowed = append(allowed, describeSectors(c))
				}
				r.fatalf("after crash, vol%d block %d holds %s; allowed: %s", vi, b, describeSectors(g), strings.Join(allowed, " | "))
			}
		}
		// Settings are durable when SetSettings returns.
		if got := v.Settings(); got != r.sets[vi] {
			r.fatalf("after crash, vol%d settings %+v, want %+v", vi, got, r.sets[vi])
		}
		// What survived is now the durable content.
		copy(m.cur, got)
		r.touched(vi, 0, int64(len(got)), true)
	}
}

func describeSectors(p []byte) string {
	var s []string
	for i := 0; i < len(p); i += 512 {
		s = append(s, describeSector(p[i:min(i+512, len(p))]))
	}
	return "[" + strings.Join(s, " ") + "]"
}

// randomSettings sets every key of volume vi at random: small sequential
// cutoffs (so bypass happens in these tiny volumes), writeback targets from
// 0 % (background writeback runs all the time) to 100 %, every promote
// policy, both orders and a rate cap.
func (r *crashRun) randomSettings(vi int) {
	rng := r.rng
	st := r.sets[vi]
	st.SequentialCutoff = []int64{0, 8 << 10, 16 << 10, 32 << 10, 4 << 20}[rng.IntN(5)]
	st.WritebackPercent = []int{0, 10, 50, 100}[rng.IntN(4)]
	st.WritebackOrder = []WritebackOrder{OrderEpoch, OrderLBA}[rng.IntN(2)]
	st.Promote = []string{"always", "never", "after:2", "after:3"}[rng.IntN(4)]
	st.WritebackRateMax = []int64{0, 0, 64 << 10}[rng.IntN(3)]
	r.logf("settings vol%d %+v", vi, st)
	if err := r.set.vols[vi].SetSettings(st); err != nil {
		r.fatalf("set settings: %v", err)
	}
	r.sets[vi] = st
}
