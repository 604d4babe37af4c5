package nbd

import (
	"bytes"
	"sync"
	"testing"
)

// plugBackend is a memBackend whose StartReadAt behaves as the cache
// device's under a plug: a read started while plugged is held until the
// last Unplug, then completed (on a goroutine, as a batch). It records how
// many reads one plug held at most.
type plugBackend struct {
	*memBackend
	mu      sync.Mutex
	plugs   int // Plug calls
	unplugs int
	depth   int                        // Plug calls not matched yet
	held    []func(later func(func())) // reads started under the plug
	maxHeld int
}

func (b *plugBackend) StartReadAt(p []byte, off int64, done func(error, func(func()))) bool {
	run := func(later func(func())) { done(b.memBackend.ReadAt(p, off), later) }
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.depth > 0 {
		b.held = append(b.held, run)
		b.maxHeld = max(b.maxHeld, len(b.held))
		return true
	}
	go runBatch(run)
	return true
}

func (b *plugBackend) Plug() {
	b.mu.Lock()
	b.plugs++
	b.depth++
	b.mu.Unlock()
}

func (b *plugBackend) Unplug() {
	b.mu.Lock()
	b.unplugs++
	b.depth--
	var held []func(later func(func()))
	if b.depth == 0 {
		held, b.held = b.held, nil
	}
	b.mu.Unlock()
	if len(held) > 0 {
		go runBatch(func(later func(func())) {
			for _, f := range held {
				f(later)
			}
		})
	}
}

func (b *plugBackend) counts() (plugs, unplugs, maxHeld int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.plugs, b.unplugs, b.maxHeld
}

// burst sends reads of 4 KiB at offs in one write, so that the server's
// reader finds them in its buffer together, and checks every reply (in any
// order) against mem.
func burst(t *testing.T, r *raw, mem *memBackend, offs []int64) {
	t.Helper()
	var b []byte
	for i, off := range offs {
		var h [requestHeaderSize]byte
		encodeRequest(h[:], requestHeader{Type: cmdRead, Handle: uint64(i), Offset: uint64(off), Length: 4096})
		b = append(b, h[:]...)
	}
	r.write(b)
	seen := map[uint64]bool{}
	for range offs {
		errno, handle := r.simpleReply()
		if errno != 0 || handle >= uint64(len(offs)) || seen[handle] {
			t.Fatalf("reply errno %d handle %d (seen: %v)", errno, handle, seen[handle])
		}
		seen[handle] = true
		got := make([]byte, 4096)
		r.read(got)
		off := offs[handle]
		if !bytes.Equal(got, mem.data[off:off+4096]) {
			t.Fatalf("read at %d: wrong data", off)
		}
	}
}

// TestPlugBurst: READs that arrive together are started under one plug
// (the backend holds them and submits them together at Unplug), every
// Plug is matched by an Unplug before the reader waits for the socket, and
// a read alone (QD1) is started without a plug.
func TestPlugBurst(t *testing.T) {
	mem := newMem(1 << 20)
	for i := range mem.data {
		mem.data[i] = byte(i * 7 / 4096)
	}
	pb := &plugBackend{memBackend: mem}
	ts := startServer(t, Config{}, Export{Name: "d", Backend: pb})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	burst(t, r, mem, []int64{0})
	if plugs, _, _ := pb.counts(); plugs != 0 {
		t.Fatalf("a lone READ plugged the backend %d times", plugs)
	}
	offs := make([]int64, 16)
	for i := range offs {
		offs[i] = int64(i*37%256) * 4096
	}
	burst(t, r, mem, offs)
	plugs, unplugs, maxHeld := pb.counts()
	if plugs == 0 || maxHeld < 2 {
		t.Fatalf("16 READs sent together: %d plugs, at most %d reads held by one, want a plug holding several", plugs, maxHeld)
	}
	if unplugs != plugs {
		t.Fatalf("%d plugs, %d unplugs after the replies", plugs, unplugs)
	}
}

// TestPlugBudget: with the in-flight budget smaller than a burst of READs,
// the reader unplugs before it waits for budget: the reads it holds are
// submitted, complete and release budget, so the rest of the burst gets
// in. (Waiting plugged would deadlock: only the held reads can free it.)
func TestPlugBudget(t *testing.T) {
	mem := newMem(1 << 20)
	for i := range mem.data {
		mem.data[i] = byte(i / 4096)
	}
	pb := &plugBackend{memBackend: mem}
	ts := startServer(t, Config{MaxInFlightBytes: 2 * 4096}, Export{Name: "d", Backend: pb})
	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.goExport("d")
	offs := make([]int64, 12)
	for i := range offs {
		offs[i] = int64(i) * 4096
	}
	burst(t, r, mem, offs) // the raw client's deadline fails a deadlock
	if plugs, unplugs, _ := pb.counts(); plugs == 0 || plugs != unplugs {
		t.Fatalf("%d plugs, %d unplugs", plugs, unplugs)
	}
}
