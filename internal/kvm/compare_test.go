package kvm

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

var (
	//go:embed testdata/cachesys.sh
	cacheSysScript string
	//go:embed testdata/powercut-compare.sh
	compareScript string
	//go:embed testdata/lwmark.sh
	lwmarkScript string
)

// compareSystems are the kernel's caches TestPowerCutCompare cuts the power
// of, each in writeback mode.
var compareSystems = []string{"bcache", "dmcache"}

// TestPowerCutCompare runs TestPowerCut's power-cut method against the
// kernel's own caches, bcache and dm-cache (smq), both in writeback mode,
// so that docs/RELIABILITY.md can say how tiercache compares. In one guest
// boot, for each system: its cache, backing (and dm-cache's metadata)
// devices are slices of one dm-log-writes device; the same workload as
// TestPowerCut's (kvmload's stamped blocks with the crashtest oracle, ext4
// files with fsync) runs on the cached device directly, no NBD between;
// then, in the same guest (only its kernel can recover these caches),
// kvmreplay writes the devices as each chosen point left them onto a loop
// device, assembles the cache on it (bcache: register both devices;
// dm-cache: load its table) and checks the same promises: it recovers,
// every write acknowledged durable before the point reads back and nothing
// else appears, ext4 fscks clean and holds every file fsynced before the
// point.
//
// What the other systems lose is a finding, reported as a table, not a
// failure of this test; the test fails when the harness does not run to
// its end or when a system fails the end of its log (its own clean
// shutdown), which would mean the layout or the oracle is wrong. make
// kernel runs a short workload and a seeded sample of
// TIERCACHE_KVM_POINTS (default 1) points per kind and system, and
// the end of the log; make
// kernel-sweep (TIERCACHE_KVM_FULL=1) every point of a longer workload.
// TIERCACHE_KVM_SEED repeats the workload's choices and the sample;
// TIERCACHE_KVM_MODES=dmcache (or bcache) runs one system.
func TestPowerCutCompare(t *testing.T) {
	img := guestImage(t)
	full := os.Getenv("TIERCACHE_KVM_FULL") != ""
	perKind := 1
	if s := os.Getenv("TIERCACHE_KVM_POINTS"); s != "" {
		perKind, _ = strconv.Atoi(s)
	}
	seed := uint64(time.Now().UnixNano() % 100000)
	if s := os.Getenv("TIERCACHE_KVM_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (TIERCACHE_KVM_SEED=%d: the same workload and sample of points)", seed, seed)
	writes, files := 150, 3
	fullFlag := ""
	if full {
		writes, files, fullFlag = 2000, 30, "-full"
	}
	systems := compareSystems
	if s := os.Getenv("TIERCACHE_KVM_MODES"); s != "" {
		systems = nil
		for _, sys := range compareSystems {
			if slices.Contains(strings.Split(s, ","), sys) {
				systems = append(systems, sys)
			}
		}
	}
	// TIERCACHE_KVM_KEEP=DIR keeps each system's log and events there
	// (the replay runs in the guest, so a kept log is for reading: dm-cache's
	// metadata with cache_dump, the entries with internal/logwrites).
	dir := os.Getenv("TIERCACHE_KVM_KEEP")
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"kvmload", "kvmreplay"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, c), "github.com/tiercache/tiercache/internal/kvm/"+c)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building %s: %v\n%s", c, err, out)
		}
	}
	for name, s := range map[string]string{"cachesys.sh": cacheSysScript, "lwmark.sh": lwmarkScript} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	script := strings.NewReplacer("@BLOCKS@", strconv.Itoa(pcBlocks), "@WRITES@", strconv.Itoa(writes), "@SEED@", strconv.FormatUint(seed, 10),
		"@FILES@", strconv.Itoa(files), "@POINTS@", strconv.Itoa(perKind), "@FULL@", fullFlag).Replace(compareScript)
	var disks []Disk
	for i, s := range systems {
		disks = append(disks,
			Disk{Path: sparse(t, filepath.Join(dir, s+".data"), (8+32+81)<<20)},
			Disk{Path: sparse(t, filepath.Join(dir, s+".log"), pcLogMiB<<20)})
		script += fmt.Sprintf("run_sys %s /dev/vd%c /dev/vd%c || { echo \"SYSTEM %s FAIL\"; exit 1; }\n", s, 'a'+2*i, 'a'+2*i+1, s)
	}
	// Each replay takes ~40 s in the guest on a loaded 2-core host; the
	// timeout only catches a hung guest.
	timeout := 15*time.Minute + time.Duration(3*perKind+1)*time.Duration(len(systems))*90*time.Second
	if full {
		timeout = 3 * time.Hour
	}
	res, err := Run(context.Background(), Config{Image: img, Share: dir, Script: script, Disks: disks, MemMiB: 2048, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("guest workload and replay, %d systems: %v", len(systems), res.Elapsed.Round(time.Second))
	if testing.Verbose() || res.Status != 0 {
		for _, l := range strings.Split(res.Log, "\n") {
			if strings.HasPrefix(l, "POINT ") && !strings.HasSuffix(strings.TrimSpace(l), " ok") || strings.HasPrefix(l, "WORKLOAD") {
				t.Log(l)
			}
		}
	}
	if res.Status != 0 {
		t.Fatalf("guest script exit status %d; console:\n%s", res.Status, tail(res.Log, 80))
	}
	sum := regexp.MustCompile(`(?m)^SUMMARY (.*?)\r?$`)
	var table strings.Builder
	table.WriteString("| system | points (mark, FLUSH/FUA, torn, end) | stamped blocks checked | durable writes found | unflushed writes found | torn blocks | points failed: recovery, stamped, fsck, files | per replay | sectors of plain writes kept from a FUA write's |\n|---|---|---|---|---|---|---|---|---|\n")
	found := map[string]bool{}
	for _, m := range sum.FindAllStringSubmatch(res.Log, -1) {
		kv := map[string]string{}
		for _, f := range strings.Fields(m[1]) {
			k, v, _ := strings.Cut(f, "=")
			kv[k] = v
		}
		found[kv["name"]] = true
		fmt.Fprintf(&table, "| %s | %s (%s, %s, %s, %s) | %s | %s | %s | %s | %s: %s, %s, %s, %s | %s | %s |\n", kv["name"], kv["points"], kv["mark"], kv["flush"], kv["torn"], kv["end"],
			kv["blocks"], kv["durable"], kv["maybe"], kv["tornread"], kv["failures"], kv["recovery"], kv["stamped"], kv["fsck"], kv["files"], kv["per"], kv["fuakept"])
		if kv["endok"] != "true" {
			t.Errorf("%s: the end of its log (a clean shutdown) fails the checks: the harness's layout or oracle is wrong", kv["name"])
		}
	}
	t.Logf("power cuts of the kernel's caches (seed %d):\n%s", seed, table.String())
	for _, s := range systems {
		if !found[s] {
			t.Errorf("no replay summary for %s", s)
		}
	}
}
