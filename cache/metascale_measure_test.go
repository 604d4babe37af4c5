package cache

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tiercache/tiercache/cache/internal/index"
	"github.com/tiercache/tiercache/cache/internal/ondisk"
	"github.com/tiercache/tiercache/cache/internal/pages"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/internal/backingid"
	"github.com/tiercache/tiercache/nbd"
)

var (
	flagMetaSizes = flag.String("metasizes", "1M,16M", "TestMeasureMetadataScale: cached block counts to measure (K, M suffixes)")
	flagMetaDir   = flag.String("metadir", "", "TestMeasureMetadataScale: directory for the sparse cache and backing files (default: a test temp dir)")
	flagMetaLoad  = flag.Duration("metaload", 30*time.Second, "TestMeasureMetadataScale: length of the 4 KiB random write load")
	flagMetaPaged = flag.Bool("metapaged", false, "TestMeasureMetadataScale: format the sets with index pages (FormatOptions.IndexPages)")
)

// TestMeasureMetadataScale measures what the engine's metadata costs a
// served cache set at each size in -metasizes (issue 20; docs/CACHE.md,
// "Metadata at scale"): the tiercache binary serves a cache set holding N
// dirty cached 4 KiB blocks, half of a cache of 2N blocks (a sparse cache
// file), at random LBAs of a sparse backing file 8N blocks long. The set is
// made without writing N blocks of data: the test formats it and writes a
// checkpoint naming N blocks whose checksum is that of a zero block, which
// is what the never-written (sparse) cache blocks read as; writeback is
// capped at one block per second (writeback_rate_max=4096) so the data
// stays cached and the backing file sparse. For each size, and for an
// empty set on a cache device of the same size, it reports:
//
//   - time from exec to the first 4 KiB read answered over NBD, and the
//     process's RSS: at a clean start, after a SIGKILL under a 4 KiB
//     random write load (recovery replays the journal written since the
//     last checkpoint), and after a clean restart (SIGTERM, final
//     checkpoint); RSS as VmHWM (the peak since exec, recovery included)
//     when the first request is answered and VmRSS 10 s later;
//   - under fio 4 KiB random writes at QD16 for -metaload: the writes per
//     second, the checkpoints written and their bytes per second, and the
//     highest VmRSS sampled.
//
// Figures only; nothing is asserted. Run with
//
//	go test ./cache -run TestMeasureMetadataScale -measure -v -timeout 3h -metasizes 1M,16M
func TestMeasureMetadataScale(t *testing.T) {
	if !*flagMeasure {
		t.Skip("use -measure")
	}
	if _, err := exec.LookPath("fio"); err != nil {
		t.Fatal("fio is needed (make deps)")
	}
	dir := *flagMetaDir
	if dir == "" {
		dir = t.TempDir()
	}
	bin := filepath.Join(dir, "tiercache")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/tiercache/tiercache/cmd/tiercache").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("loadavg at start: %s", strings.TrimSpace(string(load)))
	var rows []string
	for _, f := range strings.Split(*flagMetaSizes, ",") {
		n, err := parseCount(f)
		if err != nil {
			t.Fatal(err)
		}
		rows = append(rows, measureMetaScale(t, bin, dir, n)...)
	}
	load, _ = os.ReadFile("/proc/loadavg")
	t.Logf("loadavg at end: %s", strings.TrimSpace(string(load)))
	t.Logf("\n%s", strings.Join(rows, "\n"))
}

func parseCount(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n * mult, err
}

// metaSet makes a cache set for TestMeasureMetadataScale in dir: a sparse
// cache file of about 2n blocks and a sparse backing file of 8n blocks
// (given a file identity, as format does), formatted, with n dirty entries
// in a checkpoint (none for n = 0), writeback capped at 4 KiB/s, marked
// clean. It returns the cache file's path and the entries' LBAs.
func metaSet(t *testing.T, dir string, n, cacheBlocks int64) (cachePath string, lbas []uint64) {
	cachePath = filepath.Join(dir, "cache.img")
	backPath := filepath.Join(dir, "hdd.img")
	for _, p := range []string{cachePath, backPath} {
		os.Remove(p)
	}
	bpb := int64(defaultBucketSize / blockSize)
	nb := (cacheBlocks + bpb - 1) / bpb
	size := nb*(defaultBucketSize+2*(4+bpb*(ondisk.CkptEntrySize+ondisk.CkptEpochExtra))) +
		2*ondisk.SBCopySize + (64 << 20) + 2*ondisk.CkptSlotLen(0, bpb, ondisk.MaxBackings) + 2*defaultBucketSize
	if *flagMetaPaged {
		size = cacheSizeForPaged(nb, defaultBucketSize, 64<<20, 1, true) + 2*ondisk.SBCopySize
	}
	backBlocks := max(8*n, 8*cacheBlocks/2)
	if err := device.CreateSparse(cachePath, size); err != nil {
		t.Fatal(err)
	}
	if err := device.CreateSparse(backPath, backBlocks*blockSize); err != nil {
		t.Fatal(err)
	}
	id, err := backingid.EnsureID(backPath)
	if err != nil {
		t.Fatal(err)
	}
	cdev, err := device.OpenFile(cachePath, device.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer cdev.Close()
	bdev, err := device.OpenFile(backPath, device.FileOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer bdev.Close()
	sb, err := Format(cdev, []BackingSpec{{Name: "hdd", Dev: bdev, ID: id.ID, Path: backPath}}, FormatOptions{Mode: Writeback, IndexPages: *flagMetaPaged})
	if err != nil {
		t.Fatal(err)
	}
	u := sb.SetUUID
	if _, err := backingid.Claim(backPath, fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]), false); err != nil {
		t.Fatal(err)
	}
	total := sb.NBuckets * sb.BlocksPerBucket()
	if n > total {
		t.Fatalf("%d entries into %d cache blocks", n, total)
	}
	// n distinct random LBAs in order (one in each run of 8), each at a
	// random cache block of the first n (buckets filled in arrival order,
	// the LBAs landing in them at random).
	rng := rand.New(rand.NewPCG(uint64(n), 20))
	zeroCRC := ondisk.CRC32C(make([]byte, blockSize))
	locs := make([]uint32, n)
	for i := range locs {
		locs[i] = uint32(i)
	}
	rng.Shuffle(len(locs), func(i, j int) { locs[i], locs[j] = locs[j], locs[i] })
	es := make([]index.Ent, n)
	lbas = make([]uint64, n)
	for i := range es {
		lbas[i] = 8*uint64(i) + rng.Uint64N(8)
		es[i] = index.Ent{LBA: lbas[i], Loc: locs[i] | index.DirtyBit, CRC: zeroCRC}
	}
	locs = nil
	tree := index.BuildPtree(es, nil)
	es = nil
	// One flush epoch per bucket filled.
	epochOf := func(loc uint32) uint64 { return 1 + uint64(int64(loc)/bpb) }
	volEpoch := uint64(2 + total/bpb)
	h := ondisk.CkptHeader{Nonce: sb.Nonce(), Gen: 2}
	vers := []ondisk.VerSnap{{EpochOf: epochOf, Dirty: int(n)}}
	if sb.HasIndexPages() {
		// Root 2 naming the entries, as a paged checkpoint writes it.
		st, _, err := pages.Open(cdev, pages.SetLayout(sb), pages.OpenCachePages)
		if err != nil {
			t.Fatal(err)
		}
		tab, err := st.Table(int(sb.NBuckets))
		if err != nil {
			t.Fatal(err)
		}
		tr := st.Tree(0)
		var perr error
		tree.Ascend(func(e index.Ent) bool {
			if _, _, perr = tr.Put(pages.Slot{LBA: e.LBA, Loc: e.Loc, CRC: e.CRC, Epoch: epochOf(e.Block())}); perr != nil {
				return false
			}
			b := int(int64(e.Block()) / bpb)
			r := tab.Get(b)
			r.Live++
			r.Dirty++
			tab.Set(b, r)
			return true
		})
		if perr != nil {
			t.Fatal(perr)
		}
		if err := st.Checkpoint(pages.EncodePayload(0, []uint64{volEpoch}, []int64{n})); err != nil {
			t.Fatal(err)
		}
	} else if err := ondisk.WriteCheckpoint(cdev, sb, h, make([]uint32, sb.NBuckets), []uint64{volEpoch}, []*index.Ptree{tree}, vers); err != nil {
		t.Fatal(err)
	}
	sb.Backings[0].Settings.WritebackRateMax = blockSize
	sb.Backings[0].Settings.WritebackPercent = 100
	sb.Clean = true
	sb.Seq++
	if err := ondisk.WriteSuperblock(cdev, sb); err != nil {
		t.Fatal(err)
	}
	return cachePath, lbas
}

// metaServer is one run of tiercache serve.
type metaServer struct {
	cmd   *exec.Cmd
	sock  string
	admin string
	start time.Time
	first time.Duration // exec to the first read answered
	hwm   int64         // VmHWM when the first read was answered
}

func startMetaServer(t *testing.T, bin, dir, cachePath string, probeLBA uint64) *metaServer {
	sock := filepath.Join(dir, "nbd.sock")
	os.Remove(sock)
	logf, err := os.OpenFile(filepath.Join(dir, "serve.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	admin := filepath.Join(dir, "admin.sock")
	os.Remove(admin)
	cmd := exec.Command(bin, "--data-dir", dir, "--admin", admin, "serve", "--cache", cachePath, "--listen", "unix:"+sock)
	cmd.Stdout, cmd.Stderr = logf, logf
	m := &metaServer{cmd: cmd, sock: sock, admin: admin, start: time.Now()}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Poll: a measurement of when the server answers, at 2 ms resolution.
	p := make([]byte, blockSize)
	for {
		if time.Since(m.start) > 30*time.Minute {
			t.Fatal("server did not answer within 30 minutes")
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		c, err := nbd.Dial(ctx, "unix", sock, "hdd", nbd.ClientOptions{})
		cancel()
		if err == nil {
			err = c.ReadAt(p, int64(probeLBA)*blockSize)
			c.Close()
			if err == nil {
				m.first = time.Since(m.start)
				m.hwm = procStatusKB(t, cmd.Process.Pid, "VmHWM")
				return m
			}
		}
		if cmd.ProcessState != nil {
			t.Fatalf("server exited: see %s", filepath.Join(dir, "serve.log"))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func (m *metaServer) rss(t *testing.T) int64 { return procStatusKB(t, m.cmd.Process.Pid, "VmRSS") }

// stop ends the server with sig and waits for it; it returns how long that took.
func (m *metaServer) stop(t *testing.T, sig syscall.Signal) time.Duration {
	t0 := time.Now()
	if err := m.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	err := m.cmd.Wait()
	if sig == syscall.SIGTERM && err != nil {
		t.Fatalf("server exit after SIGTERM: %v", err)
	}
	return time.Since(t0)
}

// metaCounters are the set's figures from the admin API's /metrics.
type metaCounters struct {
	journalBlocks, checkpoints, cached, superseded int64
}

func (m *metaServer) counters(t *testing.T) (c metaCounters) {
	hc := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", m.admin)
	}}}
	resp, err := hc.Get("http://admin/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "tiercache_set_journal_blocks_total":
			c.journalBlocks = int64(v)
		case "tiercache_set_checkpoints_total":
			c.checkpoints = int64(v)
		case "tiercache_set_cached_bytes":
			c.cached = int64(v) / blockSize
		case `tiercache_superseded_bytes{export="hdd"}`:
			c.superseded = int64(v) / blockSize
		}
	}
	return c
}

// procStatusKB returns a field of /proc/PID/status in KiB.
func procStatusKB(t *testing.T, pid int, field string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// ckptBodies reads the body length of both checkpoint slots, and the
// journal's length.
func ckptBodies(t *testing.T, cachePath string) (bodyLen [2]uint64, journalLen int64) {
	dev, err := device.OpenFile(cachePath, device.FileOptions{ReadOnly: true, Direct: device.DirectOff})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	sb, _, err := ondisk.ReadSuperblock(dev)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		b := make([]byte, blockSize)
		if _, err := dev.ReadAt(b, sb.CkptOff[i]); err != nil {
			t.Fatal(err)
		}
		h, err := ondisk.DecodeCkptHeader(b, sb.CkptOff[i])
		if err != nil {
			continue
		}
		bodyLen[i] = h.BodyLen
	}
	return bodyLen, sb.JournalLen
}

// measureMetaScale measures one size and an empty set of the same cache
// size, and returns the table rows.
func measureMetaScale(t *testing.T, bin, dir string, n int64) []string {
	mib := func(kb int64) string { return fmt.Sprintf("%.0f MiB", float64(kb)/1024) }
	sec := func(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }
	cacheBlocks := 2 * n
	loadavg := func() string {
		b, _ := os.ReadFile("/proc/loadavg")
		return strings.Join(strings.Fields(string(b))[:3], " ")
	}
	var rows []string
	row := func(format string, args ...any) {
		r := fmt.Sprintf("%d cached: ", n) + fmt.Sprintf(format, args...) + " (load " + loadavg() + ")"
		t.Log(r)
		rows = append(rows, r)
	}

	// The empty set of the same cache size: the baseline.
	cachePath, _ := metaSet(t, dir, 0, cacheBlocks)
	e := startMetaServer(t, bin, dir, cachePath, 0)
	time.Sleep(10 * time.Second)
	emptyRSS := e.rss(t)
	row("empty set: first read %s, VmHWM %s, VmRSS at +10 s %s", sec(e.first), mib(e.hwm), mib(emptyRSS))
	e.stop(t, syscall.SIGKILL)
	e = startMetaServer(t, bin, dir, cachePath, 0)
	row("empty set after SIGKILL: first read %s, VmHWM %s", sec(e.first), mib(e.hwm))
	e.stop(t, syscall.SIGTERM)

	t0 := time.Now()
	cachePath, lbas := metaSet(t, dir, n, cacheBlocks)
	row("made in %s", sec(time.Since(t0)))
	probe := lbas[len(lbas)/2]
	// Per cached block: the set's cached blocks and superseded versions
	// (the write load adds some).
	perBlock := func(kb int64, c metaCounters) string {
		return fmt.Sprintf("%s (%.1f B a block above empty)", mib(kb), float64(kb-emptyRSS)*1024/float64(c.cached+c.superseded))
	}
	steady := func(label string, m *metaServer) {
		time.Sleep(10 * time.Second)
		c := m.counters(t)
		row("%s: %d blocks cached, %d superseded: first read %s, VmHWM %s, VmRSS at +10 s %s", label, c.cached, c.superseded,
			sec(m.first), perBlock(m.hwm, c), perBlock(m.rss(t), c))
	}
	s := startMetaServer(t, bin, dir, cachePath, probe)
	steady("clean start", s)

	// The write load: fio through NBD, sampling the server's RSS.
	c0 := s.counters(t)
	uri := fmt.Sprintf("nbd+unix:///hdd?socket=%s", s.sock)
	fio := exec.Command("fio", "--name=w", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k", "--iodepth=16",
		"--time_based", fmt.Sprintf("--runtime=%d", int(flagMetaLoad.Seconds())), "--output-format=json")
	out := &strings.Builder{}
	fio.Stdout = out
	fio.Stderr = os.Stderr
	loadStart := time.Now()
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fio.Wait() }()
	var maxRSS int64
	tick := time.NewTicker(250 * time.Millisecond)
	for waiting := true; waiting; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("fio: %v", err)
			}
			waiting = false
		case <-tick.C:
			maxRSS = max(maxRSS, s.rss(t))
		}
	}
	tick.Stop()
	loadTime := time.Since(loadStart)
	c1 := s.counters(t)
	bodies, journalLen := ckptBodies(t, cachePath)
	var res struct {
		Jobs []struct {
			Write struct{ IOPS float64 } `json:"write"`
		} `json:"jobs"`
	}
	js := out.String()
	if i := strings.Index(js, "\n{"); i >= 0 {
		js = js[i+1:] // fio prints notes before its JSON
	}
	if err := json.Unmarshal([]byte(js), &res); err != nil || len(res.Jobs) == 0 {
		t.Fatalf("fio output: %v\n%s", err, out)
	}
	ckpt := float64(slices.Max(bodies[:]) + blockSize) // bytes a checkpoint writes
	jps := float64((c1.journalBlocks-c0.journalBlocks)*blockSize) / loadTime.Seconds()
	// A checkpoint is written when the journal is full: at this journal
	// rate, one every journalLen/jps seconds.
	row("4K random writes QD16 for %s: %.0f writes/s; journal %.2f MiB/s (one %d MiB journal every %.0f s); checkpoints of %.0f MiB: %d written (%.2f MiB/s), %.2f MiB/s at one per journal; VmRSS max %s",
		sec(loadTime), res.Jobs[0].Write.IOPS, jps/(1<<20), journalLen>>20, float64(journalLen)/jps, ckpt/(1<<20),
		c1.checkpoints-c0.checkpoints, float64(c1.checkpoints-c0.checkpoints)*ckpt/(1<<20)/loadTime.Seconds(),
		ckpt*jps/float64(journalLen)/(1<<20), perBlock(maxRSS, c1))

	// A crash under the load's journal, then a clean restart.
	s.stop(t, syscall.SIGKILL)
	s = startMetaServer(t, bin, dir, cachePath, probe)
	steady("after SIGKILL", s)
	shut := s.stop(t, syscall.SIGTERM)
	row("clean shutdown took %s", sec(shut))
	s = startMetaServer(t, bin, dir, cachePath, probe)
	steady("clean restart", s)
	s.stop(t, syscall.SIGTERM)
	for _, p := range []string{cachePath, filepath.Join(dir, "hdd.img")} {
		os.Remove(p)
	}
	return rows
}
