package model

import (
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/devicetest"
)

// Tests that measure the models run inside testing/synctest bubbles: time
// there is virtual and advances only when every goroutine is blocked, so a
// 5-second model run takes milliseconds and gives the same figures on a
// loaded machine. The models' precise sleep (nanosleep) is a system call
// that the bubble cannot fake, so virtual-time tests set fine to
// time.Sleep.

const gib = 1 << 30

func virtualHDD(t *testing.T, size int64, tune func(*HDDParams)) *HDD {
	t.Helper()
	p := DefaultHDD()
	p.virtual = true
	if tune != nil {
		tune(&p)
	}
	h, err := NewHDD(nullDevice{size}, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func run(t *testing.T, d device.Device, w Workload) Result {
	t.Helper()
	r, err := Run(d, w, 1)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func near(got, want, tol float64) bool { return math.Abs(got-want) <= tol*want }

// fast are HDD parameters for the conformance suite in real time: the
// default drive run 10,000 times faster.
func fastHDD(tune func(*HDDParams)) func(t *testing.T, size int64) device.Device {
	return func(t *testing.T, size int64) device.Device {
		p := DefaultHDD()
		p.TimeScale = 1e-4
		if tune != nil {
			tune(&p)
		}
		d, err := NewHDD(device.NewMem(size), p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
}

// plain hides Mem's Discard and WriteZeroes, to test the fallbacks.
type plain struct{ device.Device }

func TestHDDConformance(t *testing.T) {
	t.Parallel()
	t.Run("WriteCache", func(t *testing.T) { devicetest.RunConformance(t, fastHDD(nil)) })
	// Write-through and FIFO, over a device without Discard and
	// WriteZeroes (the fallbacks).
	t.Run("WriteThroughNoCapabilities", func(t *testing.T) {
		devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
			d, err := Wrap(KindHDD, plain{device.NewMem(size)}, Params{
				HDD: HDDParams{WriteThrough: true, QueueDepth: 1}, TimeScale: 1e-4})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { d.Close() })
			return d
		})
	})
}

// The SSD and NVMe models share their code; the conformance suite runs on
// one.
func TestSSDConformance(t *testing.T) {
	t.Parallel()
	devicetest.RunConformance(t, func(t *testing.T, size int64) device.Device {
		d, err := Wrap(KindNVMe, device.NewMem(size), Params{TimeScale: 0.01})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	})
}

func TestParse(t *testing.T) {
	for _, c := range []struct {
		spec, kind, path string
		ok               bool
	}{
		{"hdd:/var/lib/disk.img", "hdd", "/var/lib/disk.img", true},
		{"ssd:cache.img", "ssd", "cache.img", true},
		{"nvme:/dev/nvme0n1", "nvme", "/dev/nvme0n1", true},
		{"hdd:/a:b", "hdd", "/a:b", true},
		{"hdd:", "", "", false},
		{"/dev/sda", "", "", false},
		{"tape:/dev/st0", "", "", false},
		{"", "", "", false},
		{"HDD:/x", "", "", false},
	} {
		kind, path, ok := Parse(c.spec)
		if kind != c.kind || path != c.path || ok != c.ok {
			t.Errorf("Parse(%q) = %q, %q, %v; want %q, %q, %v", c.spec, kind, path, ok, c.kind, c.path, c.ok)
		}
	}
}

func TestOpen(t *testing.T) {
	path := t.TempDir() + "/disk.img"
	if err := device.CreateSparse(path, 1<<20); err != nil {
		t.Fatal(err)
	}
	m, ok, err := Open("hdd:"+path, device.FileOptions{}, Params{TimeScale: 1e-3})
	if err != nil || !ok {
		t.Fatalf("Open(hdd:...) = %v, %v", ok, err)
	}
	if _, ok := m.(*HDD); !ok || m.Size() != 1<<20 {
		t.Errorf("Open(hdd:...) gave %T of size %d", m, m.Size())
	}
	if _, err := m.WriteAt([]byte("data"), 4096); err != nil {
		t.Error(err)
	}
	if err := m.Close(); err != nil {
		t.Error(err)
	}
	if m, ok, err := Open(path, device.FileOptions{}, Params{}); ok || m != nil || err != nil {
		t.Errorf("Open(plain path) = %v, %v, %v; want nil, false, nil", m, ok, err)
	}
	if _, ok, err := Open("ssd:"+path+".missing", device.FileOptions{}, Params{}); !ok || err == nil {
		t.Errorf("Open(ssd:missing) = %v, %v; want true and an error", ok, err)
	}
	if _, ok, err := Open("nvme:"+path, device.FileOptions{}, Params{TimeScale: -1}); !ok || err == nil {
		t.Errorf("Open with a bad time scale = %v, %v; want true and an error", ok, err)
	}
}

func TestBadParams(t *testing.T) {
	m := device.NewMem(1 << 20)
	if _, err := Wrap("tape", m, Params{}); err == nil {
		t.Error("Wrap of an unknown kind succeeded")
	}
	bad := []HDDParams{
		{RPM: -1},
		{Capacity: 1 << 10},
		{QueueDepth: -3},
		{AvgSeek: time.Second, FullStroke: time.Millisecond},
		{OuterRate: 1e6, InnerRate: 2e6},
		{TimeScale: -1},
		{TimeScale: 1e-9},
		{AgeLimit: -time.Second},
	}
	for _, p := range bad {
		if d, err := NewHDD(m, p); err == nil {
			d.Close()
			t.Errorf("NewHDD(%+v) succeeded", p)
		}
	}
	for _, p := range []SSDParams{{Channels: -1}, {ReadRate: -5}, {ReadLatency: -time.Second}, {TimeScale: 1e9}} {
		if d, err := NewSSD(m, p); err == nil {
			d.Close()
			t.Errorf("NewSSD(%+v) succeeded", p)
		}
	}
	if _, err := NewHDD(nil, HDDParams{}); err == nil {
		t.Error("NewHDD(nil) succeeded")
	}
	if _, err := NewSSD(nil, SSDParams{}); err == nil {
		t.Error("NewSSD(nil) succeeded")
	}
	if _, err := NewHDD(nullDevice{0}, HDDParams{}); err == nil {
		t.Error("NewHDD of an empty device succeeded")
	}
}

// TestHDDRandomRead: random 4 KiB reads over the whole disk at QD1 cost
// seek + half a revolution + transfer each (~79 IOPS); at QD32 NCQ's
// shortest-positioning-first order serves far more, and a FIFO drive
// (QueueDepth 1) gains nothing from the deeper queue.
func TestHDDRandomRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rnd := func(qd int) Workload {
			return Workload{Random: true, BlockSize: 4096, QueueDepth: qd, Duration: 4 * time.Second, Seed: 7}
		}
		qd1 := run(t, virtualHDD(t, 8*gib, nil), rnd(1))
		ncq := run(t, virtualHDD(t, 8*gib, nil), rnd(32))
		fifo := run(t, virtualHDD(t, 8*gib, func(p *HDDParams) { p.QueueDepth = 1 }), rnd(32))
		t.Logf("random 4K read IOPS: QD1 %.1f, QD32 NCQ %.1f, QD32 FIFO %.1f", qd1.IOPS, ncq.IOPS, fifo.IOPS)
		if !near(qd1.IOPS, 1/(8.5e-3+4.17e-3+0.03e-3), 0.08) {
			t.Errorf("QD1: %.1f IOPS, want ~79", qd1.IOPS)
		}
		if !near(fifo.IOPS, qd1.IOPS, 0.1) {
			t.Errorf("QD32 FIFO: %.1f IOPS, want ~QD1's %.1f", fifo.IOPS, qd1.IOPS)
		}
		if ncq.IOPS < 1.8*fifo.IOPS {
			t.Errorf("QD32 NCQ: %.1f IOPS, want well above FIFO's %.1f", ncq.IOPS, fifo.IOPS)
		}
		if ncq.Stats.MaxQueue < 31 {
			t.Errorf("QD32: the queue held at most %d requests", ncq.Stats.MaxQueue)
		}
		if fifo.Stats.Seeks < uint64(fifo.Ops)*9/10 || ncq.Stats.SeekTracks/ncq.Stats.Seeks >= fifo.Stats.SeekTracks/fifo.Stats.Seeks {
			t.Errorf("NCQ seeks (%d, %d tracks) not shorter than FIFO's (%d, %d tracks)",
				ncq.Stats.Seeks, ncq.Stats.SeekTracks, fifo.Stats.Seeks, fifo.Stats.SeekTracks)
		}
	})
}

// TestHDDSequential: sequential streams run at the zone's rate, at QD1
// (read-ahead, write cache) and at QD32, with no lost revolutions.
func TestHDDSequential(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, c := range []struct {
			write bool
			qd    int
			bs    int64
			secs  float64
		}{
			{false, 1, 1 << 20, 3}, {false, 32, 1 << 20, 3}, {true, 1, 1 << 20, 3}, {true, 32, 1 << 20, 3},
			{false, 1, 4096, 0.5}, {false, 4, 65536, 1}, {true, 1, 4096, 0.5},
		} {
			h := virtualHDD(t, 8*gib, nil)
			d := time.Duration(c.secs * float64(time.Second))
			r := run(t, h, Workload{Write: c.write, BlockSize: c.bs, QueueDepth: c.qd, Span: gib, Duration: d})
			t.Logf("sequential write=%v QD%d bs %d: %.1f MB/s, rotational wait %v", c.write, c.qd, c.bs, r.MBps, r.Stats.RotationalWait)
			lo, hi := 0.97*139.5, 1.03*139.5
			if c.write { // at interface speed until the 16 MiB cache fills
				hi = 1.03 * (139.5 + 16.8/c.secs)
			}
			if r.MBps < lo || r.MBps > hi {
				t.Errorf("sequential write=%v QD%d bs %d: %.1f MB/s, want ~139.5 (the outer zones)", c.write, c.qd, c.bs, r.MBps)
			}
		}
	})
}

// TestHDDReadAhead: after a read, the next sequential read is in the
// buffer.
func TestHDDReadAhead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := virtualHDD(t, gib, nil)
		p := make([]byte, 4096)
		if _, err := h.ReadAt(p, 1<<20); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond) // the head streams on meanwhile
		before := h.Stats()
		start := time.Now()
		for i := range int64(16) {
			if _, err := h.ReadAt(p, 1<<20+4096*(i+1)); err != nil {
				t.Fatal(err)
			}
		}
		el := time.Since(start)
		s := h.Stats()
		if hits := s.BufferHits - before.BufferHits; hits < 15 {
			t.Errorf("%d of 16 sequential reads hit the read-ahead buffer", hits)
		}
		if el > 2*time.Millisecond {
			t.Errorf("16 sequential 4K reads after a read took %v", el)
		}
		// With read-ahead off, the same reads go to the platter.
		h2 := virtualHDD(t, gib, func(p *HDDParams) { p.ReadAhead = -1 })
		for i := range int64(4) {
			if _, err := h2.ReadAt(p, 1<<20+4096*i); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Millisecond)
		}
		if s2 := h2.Stats(); s2.BufferHits != 0 || s2.RotationalWait < 20*time.Millisecond {
			t.Errorf("read-ahead off: %d hits, rotational wait %v; want 0 and a lost turn per read", s2.BufferHits, s2.RotationalWait)
		}
	})
}

// TestHDDWriteCache: with the write cache on, random writes complete at
// interface speed until the cache fills and Sync waits for the platter;
// with it off each write pays the mechanics.
func TestHDDWriteCache(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		on := virtualHDD(t, 8*gib, nil)
		off := virtualHDD(t, 8*gib, func(p *HDDParams) { p.WriteThrough = true })
		burst := Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 1, Total: 256 * 4096, Seed: 9}
		rOn := run(t, on, burst)
		if s := on.Stats(); s.DirtyBytes == 0 || s.CachedWrites != 256 {
			t.Errorf("after the burst: %d dirty bytes, %d cached writes", s.DirtyBytes, s.CachedWrites)
		}
		start := time.Now()
		if err := on.Sync(); err != nil {
			t.Fatal(err)
		}
		drain := time.Since(start)
		if s := on.Stats(); s.DirtyBytes != 0 || s.Destages != 256 {
			t.Errorf("after Sync: %d dirty bytes, %d destages", s.DirtyBytes, s.Destages)
		}
		rOff := run(t, off, burst)
		t.Logf("256 random 4K writes: cache on %v (%.0f IOPS), off %v (%.0f IOPS)", rOn.Elapsed, rOn.IOPS, rOff.Elapsed, rOff.IOPS)
		if rOn.IOPS < 5000 || rOff.IOPS > 100 {
			t.Errorf("burst of random writes: %.0f IOPS with the cache, %.0f without; want >5000 and <100", rOn.IOPS, rOff.IOPS)
		}
		// Destaging sorted by position beats writing in arrival order.
		if drain > rOff.Elapsed/2 {
			t.Errorf("Sync drained 256 writes in %v; writing them through took %v", drain, rOff.Elapsed)
		}
		t.Logf("Sync drained 256 random writes in %v", drain)

		// Long run: the cache fills and throughput falls to the destage
		// rate, which sorting keeps above the write-through rate.
		long := Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 1, Duration: 20 * time.Second, Seed: 10}
		steady := run(t, virtualHDD(t, 8*gib, nil), long)
		t.Logf("random 4K writes for 20 s with the cache: %.0f IOPS", steady.IOPS)
		if steady.IOPS < rOff.IOPS*1.5 {
			t.Errorf("steady random writes through the cache: %.0f IOPS, no better than write-through %.0f", steady.IOPS, rOff.IOPS)
		}
	})
}

// TestHDDSyncEachWrite is the fragmentation experiment's write phase: each
// 4 KiB random write followed by a flush costs a random access.
func TestHDDSyncEachWrite(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := virtualHDD(t, gib, nil)
		r := run(t, h, Workload{Write: true, Random: true, BlockSize: 4096, QueueDepth: 1, Total: 200 * 4096, SyncEach: true, Seed: 11})
		t.Logf("4K random write + fsync over 1 GiB (whole disk): %.0f IOPS", r.IOPS)
		if r.IOPS < 60 || r.IOPS > 110 {
			t.Errorf("write+fsync: %.0f IOPS, want about one random access each (~80)", r.IOPS)
		}
	})
}

// TestHDDAgeLimit: under a queue that keeps offering nearby requests, a
// far request is still served within the age limit.
func TestHDDAgeLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := virtualHDD(t, 8*gib, nil)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for q := range 31 {
			wg.Go(func() {
				p := make([]byte, 4096)
				for i := int64(0); ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					// Neighbouring requests near the start of the disk.
					if _, err := h.ReadAt(p, (int64(q)*97+i*4099)%(64<<20)/4096*4096); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		p := make([]byte, 4096)
		if _, err := h.ReadAt(p, 8*gib-4096); err != nil {
			t.Fatal(err)
		}
		lat := time.Since(start)
		close(stop)
		wg.Wait()
		t.Logf("far request served after %v (age-forced %d)", lat, h.Stats().AgeForced)
		if lat > DefaultHDD().AgeLimit+100*time.Millisecond {
			t.Errorf("far request waited %v, want at most the age limit plus a queue's worth", lat)
		}
	})
}

// TestHDDClose: Close releases waiting requests and stops the goroutine
// (the bubble would report a leak); later I/O fails with ErrClosed.
func TestHDDClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := virtualHDD(t, gib, func(p *HDDParams) { p.WriteThrough = true })
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Go(func() {
				p := make([]byte, 4096)
				h.ReadAt(p, int64(i)*100<<20) // may succeed or fail with ErrClosed
			})
		}
		time.Sleep(5 * time.Millisecond)
		if err := h.Close(); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		if _, err := h.ReadAt(make([]byte, 1), 0); !errors.Is(err, device.ErrClosed) {
			t.Errorf("ReadAt after Close: %v", err)
		}
		if err := h.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	})
}

// TestSSD checks the SSD model's latency, parallelism and bandwidth.
func TestSSD(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		open := func(p SSDParams) *SSD {
			p.virtual = true
			s, err := NewSSD(nullDevice{8 * gib}, p)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}
		d := time.Second
		rr1 := run(t, open(SATASSD()), Workload{Random: true, BlockSize: 4096, QueueDepth: 1, Duration: d})
		rr32 := run(t, open(SATASSD()), Workload{Random: true, BlockSize: 4096, QueueDepth: 32, Duration: d})
		sr := run(t, open(SATASSD()), Workload{BlockSize: 1 << 20, QueueDepth: 8, Duration: d})
		sw := run(t, open(SATASSD()), Workload{Write: true, BlockSize: 1 << 20, QueueDepth: 8, Duration: d})
		t.Logf("SATA SSD: 4K read QD1 %.0f IOPS, QD32 %.0f IOPS; seq read %.0f MB/s, write %.0f MB/s", rr1.IOPS, rr32.IOPS, sr.MBps, sw.MBps)
		if !near(rr1.IOPS, 1/(80e-6+4096/530e6), 0.03) {
			t.Errorf("QD1 random read %.0f IOPS, want ~11,400", rr1.IOPS)
		}
		if !near(rr32.IOPS, 100000, 0.05) {
			t.Errorf("QD32 random read %.0f IOPS, want ~100,000 (8 channels / 80 µs)", rr32.IOPS)
		}
		if !near(sr.MBps, 530, 0.03) || !near(sw.MBps, 500, 0.03) {
			t.Errorf("sequential %.0f/%.0f MB/s, want 530/500", sr.MBps, sw.MBps)
		}
	})
}

// TestSSDFlush: a flush after a write costs FlushLatency once the write is
// in the drive's cache; one with nothing written or discarded since the
// previous flush costs only CleanFlushLatency, but never ends before a
// flush still in progress (which covers the writes before it).
func TestSSDFlush(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := SATASSD()
		p.virtual = true
		s, err := NewSSD(nullDevice{gib}, p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		timed := func(what string, f func() error, want time.Duration) {
			t.Helper()
			start := time.Now()
			if err := f(); err != nil {
				t.Fatal(err)
			}
			if el := time.Since(start); el != want {
				t.Errorf("%s took %v, want %v", what, el, want)
			}
		}
		write := func() error { _, err := s.WriteAt(make([]byte, 4096), 0); return err }
		writeTime := p.WriteLatency + time.Duration(4096*1e9/p.WriteRate)
		timed("flush of a drive never written", s.Sync, p.CleanFlushLatency)
		timed("4 KiB write", write, writeTime)
		timed("flush after a write", s.Sync, p.FlushLatency)
		timed("second flush, nothing written", s.Sync, p.CleanFlushLatency)
		if err := s.Discard(0, 4096); err != nil {
			t.Fatal(err)
		}
		timed("flush after a discard", s.Sync, p.FlushLatency)
		// A clean flush that arrives while a dirty one is in progress
		// waits for it.
		timed("4 KiB write", write, writeTime)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			timed("flush after a write (concurrent)", s.Sync, p.FlushLatency)
		}()
		time.Sleep(p.FlushLatency / 4)
		timed("clean flush behind a dirty one", s.Sync, p.FlushLatency*3/4)
		wg.Wait()
		if st := s.Stats(); st.Syncs != 6 {
			t.Errorf("%d syncs counted, want 6", st.Syncs)
		}
	})
}

// TestHDDNoDrift: the loop wakes up late (here by up to 3 ms, every time),
// yet the model loses nothing, because decisions are taken at the model's
// busyUntil, considering what had arrived by then, not at the late
// wake-up. With the actuator always busy (QD32) the model's throughput and
// busy time are those of a punctual loop.
func TestHDDNoDrift(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := Workload{Random: true, BlockSize: 4096, QueueDepth: 32, Duration: 5 * time.Second, Seed: 7}
		punctual := run(t, virtualHDD(t, 8*gib, nil), w)
		rng := rand.New(rand.NewPCG(5, 6))
		late := run(t, virtualHDD(t, 8*gib, func(p *HDDParams) {
			p.late = func() time.Duration { return time.Duration(rng.Int64N(int64(3 * time.Millisecond))) }
		}), w)
		busy := float64(late.Stats.BusyTime) / float64(late.Elapsed)
		t.Logf("QD32 random reads: punctual loop %.1f IOPS, late loop %.1f IOPS (actuator busy %.0f%%)", punctual.IOPS, late.IOPS, 100*busy)
		if !near(late.IOPS, punctual.IOPS, 0.05) || busy < 0.98 {
			t.Errorf("late loop: %.1f IOPS, busy %.0f%%; want the punctual %.1f IOPS and ~100%%", late.IOPS, 100*busy, punctual.IOPS)
		}
	})
}

// TestHDDRealClock runs the model on the real clock, 20 times faster than
// real time, with the actuator always busy: each decision falls due every
// ~250 µs of wall time. On an unloaded machine it gives ~190 IOPS, the
// virtual-time figure. A loaded machine delays the clients as well as the
// loop, so the bound only catches a collapse; TestHDDNoDrift checks
// lateness deterministically.
func TestHDDRealClock(t *testing.T) {
	if testing.Short() {
		t.Skip("real clock")
	}
	const scale = 0.05
	h, err := NewHDD(nullDevice{8 * gib}, HDDParams{TimeScale: scale})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	r, err := Run(h, Workload{Random: true, BlockSize: 4096, QueueDepth: 32, Duration: 20 * time.Second, Seed: 7}, scale)
	if err != nil {
		t.Fatal(err)
	}
	busy := float64(r.Stats.BusyTime) / float64(r.Elapsed)
	t.Logf("real clock x20: %.0f IOPS (model time), actuator busy %.0f%%", r.IOPS, 100*busy)
	if r.IOPS < 60 {
		t.Errorf("%.0f IOPS, actuator busy %.0f%% of the time; want ~190", r.IOPS, 100*busy)
	}
}
