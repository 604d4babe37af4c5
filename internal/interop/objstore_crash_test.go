package interop

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tiercache/tiercache/internal/crashtest"
	"github.com/tiercache/tiercache/internal/s3test"
)

// TestKillCyclesObjStore runs the SIGKILL harness over a writeback set whose
// backing device is an object-store image on a real versitygw: tiercache
// is killed at random points (writeback to the image in flight among them)
// and restarted, taking the image's lease of its dead predecessor, and
// every flushed block must read back (the three-state oracle).
func TestKillCyclesObjStore(t *testing.T) {
	seed, cycles := crashConfig(t)
	cycles = max(cycles/10, 2)
	srv := s3test.Start(t)
	srv.Bucket("images")
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	const uri = "s3://images/crash"
	run(t, time.Minute, bin, "image", "create", uri, "--size", "64M")
	dir := shortDir(t)
	cachePath := sparseFile(t, dir, "cache.img", 16*mib)
	run(t, time.Minute, bin, "format", "--cache", cachePath, "--backing", "vol="+uri, "--mode", "writeback", "--bucket-size", "256K")
	ks := newKillableServer(t, "--cache", cachePath)
	start := time.Now()
	st, err := crashtest.Run(context.Background(), crashtest.Config{
		Server:         ks,
		Dial:           ks.dial("vol"),
		Seed:           seed + 300,
		Cycles:         cycles,
		Conns:          4,
		Blocks:         24 * mib / crashtest.BlockSize,
		OpsPerCycle:    150,
		MaxWriteBlocks: 16,
		TrimPercent:    2,
		ZeroPercent:    2,
		Replay:         fmt.Sprintf("go test ./internal/interop -run 'TestKillCyclesObjStore$' -seed %d -cycles %d -v", seed, cycles*10),
		Logf:           t.Logf,
	})
	t.Logf("objstore: %v in %v; server: %s", st, time.Since(start).Round(time.Millisecond), ks.recoveryStats())
	if err != nil {
		log := ""
		if ks.log != nil {
			log = ks.log.String()
			if len(log) > 8000 {
				log = "...\n" + log[len(log)-8000:]
			}
		}
		t.Fatalf("%v\nserver log (current process):\n%s", err, log)
	}
}
