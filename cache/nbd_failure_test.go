package cache_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
	"github.com/tiercache/tiercache/nbd"
)

// TestNBDDeviceFailures serves a cache volume over NBD (in process, one
// connection) and breaks its devices under the client: a failing backing
// device gives the client EIO and the same connection works once it
// heals; a dead cache device fails the set over, after which the client
// reads uncached data and writes new data through the backing device, and
// gets EIO (never other data) for data that was dirty in the cache.
func TestNBDDeviceFailures(t *testing.T) {
	const bs = 64 << 10
	cacheMem := device.NewMem(8 << 20)
	backMem := device.NewMem(4 << 20)
	var cacheDead, backDead atomic.Bool
	failIf := func(b *atomic.Bool) faultdev.Injector {
		return faultdev.InjectorFunc(func(faultdev.Op) faultdev.Fault {
			if b.Load() {
				return faultdev.Error(nil)
			}
			return faultdev.Fault{}
		})
	}
	cacheDev := faultdev.Wrap(cacheMem, failIf(&cacheDead))
	backDev := faultdev.Wrap(backMem, failIf(&backDead))
	// Old data on the backing device everywhere.
	old := bytes.Repeat([]byte{0xee}, int(backMem.Size()))
	if _, err := backMem.WriteAt(old, 0); err != nil {
		t.Fatal(err)
	}
	specs := []cache.BackingSpec{{Name: "a", Dev: backDev}}
	if _, err := cache.Format(cacheMem, specs, cache.FormatOptions{BucketSize: bs}); err != nil {
		t.Fatal(err)
	}
	set, err := cache.Open(cacheDev, specs, cache.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = set.Close() }() // fails: the set failed over
	vol, _ := set.Volume("a")
	st := vol.Settings()
	st.WritebackPercent = 100
	st.Promote = "never"
	if err := vol.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	srv := nbd.NewServer(nbd.Config{})
	if err := srv.AddExport(nbd.Export{Name: "a", Backend: vol}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", t.TempDir()+"/nbd.sock")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	defer func() { _ = srv.Shutdown(context.Background()) }()
	ctx := context.Background()
	cl, err := nbd.Dial(ctx, "unix", l.Addr().String(), "a", nbd.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	blk := func(b byte) []byte { return bytes.Repeat([]byte{b}, 4096) }
	read := func(off int64) ([]byte, error) {
		p := make([]byte, 4096)
		err := cl.ReadAt(p, off)
		return p, err
	}

	// Dirty data in the cache, flushed.
	if err := cl.WriteAt(blk(1), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}

	// 1. The backing device fails: EIO to the client, the server lives.
	backDead.Store(true)
	if _, err := read(1 << 20); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of the failing backing device: %v, want EIO", err)
	}
	if p, err := read(0); err != nil || !bytes.Equal(p, blk(1)) {
		t.Fatalf("cached read while the backing device fails: %v", err)
	}
	backDead.Store(false)
	if p, err := read(1 << 20); err != nil || !bytes.Equal(p, old[:4096]) {
		t.Fatalf("read after the backing device healed: %v", err)
	}
	if set.Failed() != nil {
		t.Fatalf("backing device errors failed the cache over: %v", set.Failed())
	}

	// 2. The cache device dies for good.
	cacheDead.Store(true)
	if err := cl.WriteAt(blk(2), 2<<20, false); err != nil {
		t.Fatalf("write while the cache device dies (goes around it): %v", err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush that fails the set over, nothing lost: %v", err)
	}
	if set.Failed() == nil {
		t.Fatal("a flush with a dead cache device did not fail the set over")
	}
	if p, err := read(2 << 20); err != nil || !bytes.Equal(p, blk(2)) {
		t.Fatalf("read of the write sent around the cache: %v", err)
	}
	if p, err := read(3 << 20); err != nil || !bytes.Equal(p, old[:4096]) {
		t.Fatalf("read of uncached data after failover: %v", err)
	}
	if err := cl.WriteAt(blk(3), 3<<20, true); err != nil {
		t.Fatalf("FUA write after failover: %v", err)
	}
	if p, err := read(3 << 20); err != nil || !bytes.Equal(p, blk(3)) {
		t.Fatalf("read back after failover: %v", err)
	}
	if on := make([]byte, 4096); func() error { _, err := backMem.ReadAt(on, 3<<20); return err }() != nil || !bytes.Equal(on, blk(3)) {
		t.Fatal("the FUA write after failover is not on the backing device")
	}
	// Block 0 was dirty in the cache (unless written back meanwhile): EIO
	// for reads and writes, never the old backing data.
	p, err := read(0)
	vs := vol.Stats()
	switch {
	case err == nil && !bytes.Equal(p, blk(1)):
		t.Fatalf("read of block 0 after failover returned wrong data")
	case err != nil && (!errors.Is(err, syscall.EIO) || vs.UnreachableDirtyBlocks == 0):
		t.Fatalf("read of block 0: %v with %d unreachable dirty blocks", err, vs.UnreachableDirtyBlocks)
	case err != nil:
		if werr := cl.WriteAt(blk(4), 0, false); !errors.Is(werr, syscall.EIO) {
			t.Fatalf("write to unreachable dirty block: %v, want EIO", werr)
		}
	}
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush after failover, nothing lost: %v", err)
	}
	t.Logf("after failover: %+v", set.Stats())
}
