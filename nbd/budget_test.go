package nbd

import (
	"testing"
	"time"
)

// TestBudgetHostileConnections: connections that pipeline READs and never
// read a reply hold the shared pool and their reserves, and no more; a
// well-behaved client's requests within its reserve are still served; a
// connection over MaxConnections is refused at NBD_OPT_GO with the
// message; and once the hostile connections are gone the budget is empty.
func TestBudgetHostileConnections(t *testing.T) {
	const total, conns = 8 << 20, 4
	ts := startServer(t, Config{MaxInFlightTotal: total, MaxConnections: conns + 1},
		Export{Name: "d", Backend: newMem(16 << 20)})
	reserve := int64(total / (2 * (conns + 1)))
	var hostile []*raw
	for range conns {
		r := ts.raw(t)
		r.nc.SetDeadline(time.Time{})
		r.greet(flagCFixedNewstyle | flagCNoZeroes)
		r.opt(optGo, infoData("d"))
		for typ, _ := r.reply(optGo); typ != repAck; typ, _ = r.reply(optGo) {
		}
		hostile = append(hostile, r)
		go func() {
			var b [requestHeaderSize]byte
			for i := uint64(0); ; i++ {
				encodeRequest(b[:], requestHeader{Type: cmdRead, Handle: i, Offset: (i << 20) % (16 << 20), Length: 1 << 20})
				if _, err := r.nc.Write(b[:]); err != nil {
					return
				}
			}
		}()
	}
	// Wait until the hostile connections have taken the whole pool.
	pool := int64(total) - reserve*(conns+1)
	for deadline := time.Now().Add(10 * time.Second); ; {
		ts.budget.mu.Lock()
		used := ts.budget.used
		ts.budget.mu.Unlock()
		if used > pool-1<<20 { // no further 1 MiB READ fits
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("hostile connections hold %d pool bytes after 10 s, want %d", used, pool)
		}
		time.Sleep(time.Millisecond)
	}

	good := ts.dial(t, "d", ClientOptions{})
	buf := make([]byte, 256<<10) // within the reserve (409 KiB)
	for i := range 64 {
		if err := good.WriteAt(buf, int64(i)*int64(len(buf)), false); err != nil {
			t.Fatalf("good client write %d: %v", i, err)
		}
		if err := good.ReadAt(buf, int64(i)*int64(len(buf))); err != nil {
			t.Fatalf("good client read %d: %v", i, err)
		}
	}
	ts.budget.mu.Lock()
	held, used := ts.budget.total, ts.budget.used
	ts.budget.mu.Unlock()
	if bound := int64(total) + 1<<20; held > bound || used > pool+1<<20 {
		t.Errorf("in flight: %d bytes (%d from the pool of %d); want at most %d", held, used, pool, bound)
	}

	r := ts.raw(t)
	r.greet(flagCFixedNewstyle | flagCNoZeroes)
	r.opt(optGo, infoData("d"))
	if msg := r.expect(optGo, repErrPolicy); string(msg) != "too many connections: this server serves at most 5 at once (--max-connections); try again later" {
		t.Errorf("refusal message %q", msg)
	}

	for _, h := range hostile {
		h.nc.Close()
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		ts.budget.mu.Lock()
		held = ts.budget.total
		ts.budget.mu.Unlock()
		if held == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes still in flight 10 s after the hostile connections closed", held)
		}
		time.Sleep(time.Millisecond)
	}
}
