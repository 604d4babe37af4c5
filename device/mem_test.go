package device_test

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
)

func TestMemConformance(t *testing.T) {
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		m := device.NewMem(size)
		t.Cleanup(func() {
			m.Close()
			if err := m.Check(); err != nil {
				t.Error(err)
			}
		})
		return m
	})
}

const bs = device.MemBlockSize

func block(seed uint64) []byte {
	p := make([]byte, bs)
	devicetest.Fill(p, seed)
	return p
}

func readBlock(t *testing.T, d device.Device, i int64) []byte {
	t.Helper()
	p := make([]byte, bs)
	if _, err := d.ReadAt(p, i*bs); err != nil {
		t.Fatal(err)
	}
	return p
}

// crashSetup writes blocks 0..9 with "old" data and syncs, then overwrites
// blocks 5..14 with "new" data without syncing. Blocks 0..4 are synced old,
// 5..9 old-synced with unsynced new, 10..14 zero-synced with unsynced new.
func crashSetup(t *testing.T) *device.Mem {
	m := device.NewMem(1 << 20)
	for i := int64(0); i < 10; i++ {
		if _, err := m.WriteAt(block(uint64(i)), i*bs); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	for i := int64(5); i < 15; i++ {
		if _, err := m.WriteAt(block(100+uint64(i)), i*bs); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if err := m.Check(); err != nil {
			t.Error(err)
		}
	})
	if got := m.Unsynced(); got != 10 {
		t.Fatalf("Unsynced() = %d, want 10", got)
	}
	return m
}

func oldBlock(i int64) []byte {
	if i < 10 {
		return block(uint64(i))
	}
	return make([]byte, bs)
}

func newBlock(i int64) []byte {
	if i < 5 {
		return block(uint64(i))
	}
	return block(100 + uint64(i))
}

func TestMemCrashDropsUnsynced(t *testing.T) {
	m := crashSetup(t)
	c := m.CrashClone(device.CrashConfig{UnsyncedKeep: 0, Rand: rand.New(rand.NewPCG(1, 1))})
	for i := int64(0); i < 16; i++ {
		if !bytes.Equal(readBlock(t, c, i), oldBlock(i)) {
			t.Errorf("block %d after a crash with UnsyncedKeep=0 is not the synced content", i)
		}
	}
	// The original is untouched and still reads the new data.
	for i := int64(0); i < 15; i++ {
		if !bytes.Equal(readBlock(t, m, i), newBlock(i)) {
			t.Errorf("CrashClone changed block %d of the original", i)
		}
	}
	if err := c.Check(); err != nil {
		t.Error(err)
	}
	if c.Unsynced() != 0 {
		t.Errorf("clone has %d unsynced blocks, want 0", c.Unsynced())
	}
}

func TestMemCrashKeepsAll(t *testing.T) {
	m := crashSetup(t)
	c := m.CrashClone(device.CrashConfig{UnsyncedKeep: 1, Rand: rand.New(rand.NewPCG(1, 1))})
	for i := int64(0); i < 15; i++ {
		if !bytes.Equal(readBlock(t, c, i), newBlock(i)) {
			t.Errorf("block %d after a crash with UnsyncedKeep=1 is not the latest content", i)
		}
	}
}

func TestMemCrashSyncedSurvives(t *testing.T) {
	for seed := range uint64(20) {
		m := crashSetup(t)
		c := m.CrashClone(device.CrashConfig{UnsyncedKeep: 0.5, TornProb: 0.3, Rand: rand.New(rand.NewPCG(seed, 0))})
		for i := int64(0); i < 5; i++ {
			if !bytes.Equal(readBlock(t, c, i), oldBlock(i)) {
				t.Fatalf("seed %d: synced block %d lost in a crash", seed, i)
			}
		}
		for i := int64(15); i < 20; i++ {
			if !bytes.Equal(readBlock(t, c, i), make([]byte, bs)) {
				t.Fatalf("seed %d: never-written block %d not zero after a crash", seed, i)
			}
		}
	}
}

func TestMemCrashProbability(t *testing.T) {
	const n = 2000
	m := device.NewMem(n * bs)
	for i := int64(0); i < n; i++ {
		if _, err := m.WriteAt(block(uint64(i)), i*bs); err != nil {
			t.Fatal(err)
		}
	}
	c := m.CrashClone(device.CrashConfig{UnsyncedKeep: 0.25, Rand: rand.New(rand.NewPCG(7, 7))})
	kept := 0
	for i := int64(0); i < n; i++ {
		if !bytes.Equal(readBlock(t, c, i), make([]byte, bs)) {
			kept++
		}
	}
	if kept < n/4-150 || kept > n/4+150 {
		t.Errorf("UnsyncedKeep=0.25 kept %d of %d blocks", kept, n)
	}
}

func TestMemCrashTorn(t *testing.T) {
	m := crashSetup(t)
	c := m.CrashClone(device.CrashConfig{TornProb: 1, Rand: rand.New(rand.NewPCG(3, 3))})
	mixed := 0
	for i := int64(5); i < 15; i++ {
		got, old, cur := readBlock(t, c, i), oldBlock(i), newBlock(i)
		var nOld, nNew int
		for s := 0; s < bs; s += device.SectorSize {
			switch sec := got[s : s+device.SectorSize]; {
			case bytes.Equal(sec, cur[s:s+device.SectorSize]):
				nNew++
			case bytes.Equal(sec, old[s:s+device.SectorSize]):
				nOld++
			default:
				t.Fatalf("block %d sector %d is neither old nor new", i, s/device.SectorSize)
			}
		}
		if nOld > 0 && nNew > 0 {
			mixed++
		}
	}
	if mixed == 0 {
		t.Error("TornProb=1: no block mixes old and new sectors")
	}
	for i := int64(0); i < 5; i++ {
		if !bytes.Equal(readBlock(t, c, i), oldBlock(i)) {
			t.Errorf("synced block %d torn", i)
		}
	}
}

func TestMemCrashReplays(t *testing.T) {
	m := crashSetup(t)
	cfg := func(seed uint64) device.CrashConfig {
		return device.CrashConfig{UnsyncedKeep: 0.5, TornProb: 0.3, Rand: rand.New(rand.NewPCG(seed, 0))}
	}
	image := func(d device.Device) []byte {
		p := make([]byte, 16*bs)
		if _, err := d.ReadAt(p, 0); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := image(m.CrashClone(cfg(42))), image(m.CrashClone(cfg(42)))
	if !bytes.Equal(a, b) {
		t.Fatal("same seed gave different crash clones")
	}
	differs := false
	for seed := uint64(43); seed < 53 && !differs; seed++ {
		differs = !bytes.Equal(a, image(m.CrashClone(cfg(seed))))
	}
	if !differs {
		t.Error("ten other seeds all gave the same clone as seed 42")
	}
}

// TestMemCloneIsolation: the clone shares synced arrays with the original;
// writes to either must not show in the other.
func TestMemCloneIsolation(t *testing.T) {
	m := crashSetup(t)
	c := m.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
	if _, err := c.WriteAt(block(999), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(block(998), bs); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readBlock(t, m, 0), newBlock(0)) {
		t.Error("a write to the clone changed the original")
	}
	if !bytes.Equal(readBlock(t, c, 1), newBlock(1)) {
		t.Error("a write to the original changed the clone")
	}
	// And a crash of the clone still has the original's synced data.
	cc := c.CrashClone(device.CrashConfig{})
	if !bytes.Equal(readBlock(t, cc, 0), newBlock(0)) {
		t.Error("crash of a clone lost the data the clone started with")
	}
}

func TestMemZeroesAndDiscardAreWrites(t *testing.T) {
	m := device.NewMem(1 << 20)
	if _, err := m.WriteAt(block(1), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(block(2), bs); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := m.WriteZeroes(0, bs); err != nil {
		t.Fatal(err)
	}
	if err := m.Discard(bs+100, 100); err != nil {
		t.Fatal(err)
	}
	lost := m.CrashClone(device.CrashConfig{UnsyncedKeep: 0})
	if !bytes.Equal(readBlock(t, lost, 0), block(1)) || !bytes.Equal(readBlock(t, lost, 1), block(2)) {
		t.Error("unsynced zeroing survived a crash that drops unsynced writes")
	}
	kept := m.CrashClone(device.CrashConfig{UnsyncedKeep: 1})
	want := block(2)
	clear(want[100:200])
	if !bytes.Equal(readBlock(t, kept, 0), make([]byte, bs)) || !bytes.Equal(readBlock(t, kept, 1), want) {
		t.Error("kept zeroing not in the clone")
	}
}

func TestMemCorrupt(t *testing.T) {
	m := device.NewMem(1 << 20)
	p := block(5)
	if _, err := m.WriteAt(p, 3*bs); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := m.Corrupt(3*bs+10, 1); err != nil {
		t.Fatal(err)
	}
	got := readBlock(t, m, 3)
	want := bytes.Clone(p)
	want[10] ^= 0xff
	if !bytes.Equal(got, want) {
		t.Fatal("Corrupt did not invert exactly the given byte")
	}
	if c := m.CrashClone(device.CrashConfig{}); !bytes.Equal(readBlock(t, c, 3), want) {
		t.Fatal("corruption did not survive a crash")
	}
	if err := m.Corrupt(1<<20-1, 2); !errors.Is(err, device.ErrOutOfRange) {
		t.Errorf("Corrupt out of range: %v", err)
	}
	// Corrupting a never-written block makes it non-zero.
	if err := m.Corrupt(7*bs, 4); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(readBlock(t, m, 7)[:4], make([]byte, 4)) {
		t.Error("corrupting a zero block left zeroes")
	}
	if err := m.Check(); err != nil {
		t.Error(err)
	}
}

func TestMemSparseAndStats(t *testing.T) {
	m := device.NewMem(1 << 40) // 1 TiB: must cost nothing until written
	p := make([]byte, 100)
	devicetest.Fill(p, 1)
	if _, err := m.WriteAt(p, 1<<40-100); err != nil {
		t.Fatal(err)
	}
	q := make([]byte, 8192)
	if _, err := m.ReadAt(q, 1<<39); err != nil {
		t.Fatal(err)
	}
	if _, err := m.ReadAt(q[:100], 1<<40-100); err != nil || !bytes.Equal(q[:100], p) {
		t.Fatalf("read back at the end of a sparse Mem: %v", err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteAt(p, -1); err == nil {
		t.Fatal("negative offset accepted")
	}
	s := m.Stats()
	want := device.MemStats{Reads: 2, Writes: 1, Syncs: 1, BytesRead: 8292, BytesWritten: 100}
	if s != want {
		t.Errorf("Stats() = %+v, want %+v (rejected requests are not counted)", s, want)
	}
	// Writes copy: changing the caller's slice later changes nothing.
	p[0]++
	if _, err := m.ReadAt(q[:1], 1<<40-100); err != nil || q[0] == p[0] {
		t.Error("Mem retained the caller's buffer")
	}
}
