package nbd

import (
	"sync"
	"sync/atomic"
	"testing"
)

// benchRead measures per-request overhead: a client at queue depth qd
// reading size-byte blocks over a unix socket from a null backend.
func benchRead(b *testing.B, size, qd int, opts ClientOptions) {
	ts := startServer(b, Config{}, Export{Name: "null", Backend: nullBackend{size: 1 << 30}})
	c := ts.dial(b, "null", opts)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	for range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, size)
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				off := (i * 7919 % (1 << 18)) * int64(size) % (1 << 30)
				if err := c.ReadAt(buf, off); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func BenchmarkServerRead4K(b *testing.B) {
	benchRead(b, 4096, 32, ClientOptions{})
}

func BenchmarkServerRead4KStructured(b *testing.B) {
	benchRead(b, 4096, 32, ClientOptions{StructuredReplies: true})
}

func BenchmarkServerRead4KQD1(b *testing.B) {
	benchRead(b, 4096, 1, ClientOptions{})
}

func BenchmarkServerRead128K(b *testing.B) {
	benchRead(b, 128<<10, 32, ClientOptions{})
}

func BenchmarkServerWrite4K(b *testing.B) {
	ts := startServer(b, Config{}, Export{Name: "null", Backend: nullBackend{size: 1 << 30}})
	c := ts.dial(b, "null", ClientOptions{})
	b.SetBytes(4096)
	b.ReportAllocs()
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4096)
			for next.Add(1) <= int64(b.N) {
				if err := c.WriteAt(buf, 0, false); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
