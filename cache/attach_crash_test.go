package cache

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// hookDev calls hook before every write and around every sync of the
// cache device: the crash points of TestAttachDetachCrash.
type hookDev struct {
	device.Device
	hook func()
}

func (h *hookDev) WriteAt(p []byte, off int64) (int, error) {
	h.hook()
	return h.Device.WriteAt(p, off)
}

func (h *hookDev) Sync() error {
	h.hook()
	err := h.Device.Sync()
	h.hook()
	return err
}

// crashImage is the devices as a power cut would leave them.
type crashImage struct {
	phase string
	cache *device.Mem
	backs map[string]*device.Mem
}

// TestAttachDetachCrash cuts the power at every write and sync of the cache
// device while a volume is attached, written, and another detached (unsynced
// blocks kept, lost or torn at random), and recovers each image: the set
// opens, lists each of those volumes or not (nothing in between), and every
// byte written and flushed before the cut is there, through the set when
// it lists the volume, on the bare backing device when it does not.
func TestAttachDetachCrash(t *testing.T) {
	const bs = 64 << 10
	jl := int64(minJournalLen)
	mcache := device.NewMem(cacheSizeFor(16, bs, jl, 2))
	backs := map[string]*device.Mem{"a": device.NewMem(4 << 20), "b": device.NewMem(4 << 20), "c": device.NewMem(2 << 20)}
	specs := []BackingSpec{{Name: "a", Dev: backs["a"], ID: "ida"}, {Name: "b", Dev: backs["b"], ID: "idb"}}
	if _, err := Format(mcache, specs, FormatOptions{BucketSize: bs, JournalSize: jl}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var images []crashImage
	phase := ""
	rng := rand.New(rand.NewPCG(7, 7))
	hook := func() {
		mu.Lock()
		defer mu.Unlock()
		if phase == "" {
			return
		}
		cfg := device.CrashConfig{UnsyncedKeep: rng.Float64(), TornProb: rng.Float64() / 4, Rand: rand.New(rand.NewPCG(rng.Uint64(), 1))}
		im := crashImage{phase: phase, cache: mcache.CrashClone(cfg), backs: map[string]*device.Mem{}}
		// Backing devices after the cache: never older than what the
		// cache image depends on, as with a real power cut.
		for n, b := range backs {
			im.backs[n] = b.CrashClone(cfg)
		}
		images = append(images, im)
	}
	s, err := Open(&hookDev{Device: mcache, hook: hook}, specs, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.crashStop)
	va, _ := s.Volume("a")
	vb, _ := s.Volume("b")
	opsWriteBlocks(t, va, 12)
	opsWriteBlocks(t, vb, 9)
	setPhase := func(p string) { mu.Lock(); phase = p; mu.Unlock() }

	setPhase("attach")
	vc, err := s.Attach(BackingSpec{Name: "c", Dev: backs["c"], ID: "idc"}, AttachOptions{})
	if err != nil {
		t.Fatal(err)
	}
	setPhase("attached")
	opsWriteBlocks(t, vc, 5) // flushed: must survive every later cut
	setPhase("detach")
	if err := vb.Detach(context.Background(), DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	setPhase("")
	if len(images) < 10 {
		t.Fatalf("only %d crash points", len(images))
	}
	counts := map[string]map[bool]int{}
	for i, im := range images {
		sb, err := ReadSuperblock(im.cache)
		if err != nil {
			t.Fatalf("image %d (%s): %v", i, im.phase, err)
		}
		listed := map[string]bool{}
		var sp []BackingSpec
		for _, b := range sb.Backings {
			if !b.Free() {
				listed[b.Name] = true
				sp = append(sp, BackingSpec{Name: b.Name, Dev: im.backs[b.Name], ID: b.ID})
			}
		}
		key := im.phase + " c"
		which := listed["c"]
		if im.phase == "detach" {
			key, which = im.phase+" b", listed["b"]
		}
		if counts[key] == nil {
			counts[key] = map[bool]int{}
		}
		counts[key][which]++
		switch {
		case !listed["a"]:
			t.Fatalf("image %d (%s): a missing: %+v", i, im.phase, sb.Backings)
		case im.phase == "attached" || im.phase == "detach":
			if !listed["c"] {
				t.Fatalf("image %d (%s): c missing after attach returned", i, im.phase)
			}
		}
		if im.phase != "detach" && !listed["b"] {
			t.Fatalf("image %d (%s): b missing before detach", i, im.phase)
		}
		rs, err := Open(im.cache, sp, OpenOptions{})
		if err != nil {
			t.Fatalf("image %d (%s): open: %v", i, im.phase, err)
		}
		if err := rs.Check(); err != nil {
			t.Fatalf("image %d (%s): %v", i, im.phase, err)
		}
		ra, _ := rs.Volume("a")
		checkBlocks(t, "a", ra.ReadAt, 12)
		if rb, ok := rs.Volume("b"); ok {
			checkBlocks(t, "b through the set", rb.ReadAt, 9)
		} else {
			checkBlocks(t, "bare backing b", devReader(im.backs["b"]), 9)
		}
		if rc, ok := rs.Volume("c"); ok && im.phase == "detach" { // flushed before the detach began
			checkBlocks(t, "c", rc.ReadAt, 5)
		}
		rs.crashStop()
	}
	t.Logf("%d crash points; volume listed after the cut (phase volume: {listed: n}): %v", len(images), counts)
	if counts["attach c"][true] == 0 || counts["attach c"][false] == 0 || counts["detach b"][true] == 0 || counts["detach b"][false] == 0 {
		t.Errorf("a phase never saw both outcomes: %v", counts)
	}
}
