package nbd

import (
	"math/bits"
	"sync"
)

// Payload buffers come from one sync.Pool per power-of-two size class, from
// 512 bytes to hardMaxPayload. Pools hold *[]byte so that Get and Put do not
// allocate.
const (
	minClassShift = 9
	maxClassShift = 26 // 64 MiB == hardMaxPayload
)

var bufPools [maxClassShift - minClassShift + 1]sync.Pool

func sizeClass(n int) int {
	if n <= 1<<minClassShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minClassShift
}

// getBuf returns a buffer of length n (n <= hardMaxPayload). Its contents
// are unspecified.
func getBuf(n int) *[]byte {
	c := sizeClass(n)
	if p, ok := bufPools[c].Get().(*[]byte); ok {
		*p = (*p)[:n]
		return p
	}
	b := make([]byte, n, 1<<(c+minClassShift))
	return &b
}

// putBuf returns a buffer obtained from getBuf. The caller must not use it
// afterwards.
func putBuf(p *[]byte) {
	if p == nil {
		return
	}
	c := cap(*p)
	if c < 1<<minClassShift || c&(c-1) != 0 || c > 1<<maxClassShift {
		return
	}
	bufPools[bits.Len(uint(c))-1-minClassShift].Put(p)
}
