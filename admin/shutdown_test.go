package admin

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
	"github.com/tiercache/tiercache/nbd"
)

// TestShutdownCutsFlushAndCloseWaits: Shutdown makes a flush in progress
// end at once with ErrShuttingDown as its reported cause and refuses new
// requests, and Close returns only after the flush's handler has ended, so
// that the serve command may close the cache set right after (before, the
// set was closed under a running flush, which wrote back on to closed
// devices).
func TestShutdownCutsFlushAndCloseWaits(t *testing.T) {
	cdev := device.NewMem(64 << 20)
	// Writes to the backing device (writeback) block until released.
	// Every write that enters the gate is announced on entered, so the
	// test can tell the background writeback's first write (it starts
	// wbIdle after the last client write) from the flush's own.
	entered, release := make(chan struct{}, 4096), make(chan struct{})
	gate := faultdev.InjectorFunc(func(faultdev.Op) faultdev.Fault {
		entered <- struct{}{}
		<-release
		return faultdev.Fault{}
	})
	back := faultdev.Wrap(device.NewMem(64<<20), faultdev.OnKind(faultdev.Write, gate))
	specs := []cache.BackingSpec{{Name: "a", Dev: back}}
	if _, err := cache.Format(cdev, specs, cache.FormatOptions{BucketSize: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	set, err := cache.Open(cdev, specs, cache.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	v := set.Volumes()[0]
	st := v.Settings()
	st.WritebackRateMax = 4096 // background writeback held back
	if err := v.SetSettings(st); err != nil {
		t.Fatal(err)
	}
	// More dirty blocks than one writeback batch (1024), scattered.
	blk := make([]byte, 4096)
	for i := int64(0); i < 2000; i++ {
		blk[0] = byte(i + 1)
		if err := v.WriteAt(blk, i*16<<10, false); err != nil {
			t.Fatal(err)
		}
	}
	// Background writeback goes to full speed once the client is idle:
	// wait until its first write is parked in the gate, so that the write
	// the flush is found inside below is the flush's own (a flush cut while
	// only the background writer is inside a device write may, and does,
	// end at once).
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("background writeback did not start")
	}
	srv := New(Config{Version: "test", Set: set, Exports: []Export{{Export: nbd.Export{Name: "a", Backend: v}}}, NBD: &fakeNBD{}})
	c, stopHTTP := serveHTTP(t, srv)
	defer stopHTTP()

	type result struct {
		fin Progress
		err error
	}
	done := make(chan result, 1)
	started := make(chan struct{}, 1)
	go func() {
		fin, err := c.Flush(context.Background(), "a", func(Progress) {
			select {
			case started <- struct{}{}:
			default:
			}
		})
		done <- result{fin, err}
	}()
	for _, ch := range []chan struct{}{started, entered} {
		select {
		case <-ch:
		case <-time.After(30 * time.Second):
			t.Fatal("the flush did not start writing back")
		}
	}
	// The flush is inside a device write: Shutdown cancels it, and Close
	// must wait until its handler has ended.
	srv.Shutdown()
	if _, err := c.Status(context.Background()); err == nil || !strings.Contains(err.Error(), "shutting down") {
		t.Errorf("a request after Shutdown: %v, want a refusal saying the server is shutting down", err)
	}
	var closed atomic.Bool
	closeDone := make(chan struct{})
	go func() { srv.Close(); closed.Store(true); close(closeDone) }()
	time.Sleep(200 * time.Millisecond)
	if closed.Load() {
		t.Fatal("Close returned while a flush handler was still running")
	}
	close(release)
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the flush did not end within 30s of Shutdown")
	}
	select {
	case <-closeDone:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return after the flush ended")
	}
	if r.err == nil && r.fin.Error == "" {
		t.Fatalf("the flush completed although Shutdown cut it: %+v", r.fin)
	}
	msg := r.fin.Error
	if r.err != nil {
		msg = r.err.Error()
	}
	if !strings.Contains(msg, ErrShuttingDown.Error()) {
		t.Errorf("the flush's error %q does not say the server is shutting down", msg)
	}
	t.Logf("flush: %s", msg)
	if left := v.Stats().DirtyBlocks; left == 0 {
		t.Errorf("nothing left dirty: the flush was not cut")
	}
	if !errors.Is(context.Cause(srv.base), ErrShuttingDown) {
		t.Errorf("base context cause %v", context.Cause(srv.base))
	}
}
