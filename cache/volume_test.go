package cache_test

import (
	"github.com/tiercache/tiercache/cache"
	"github.com/tiercache/tiercache/nbd"
)

// The engine's volumes are what NBD exports serve.
var (
	_ nbd.Backend     = (*cache.Volume)(nil)
	_ nbd.Trimmer     = (*cache.Volume)(nil)
	_ nbd.ZeroWriter  = (*cache.Volume)(nil)
	_ nbd.Prefetcher  = (*cache.Volume)(nil)
	_ nbd.AsyncReader = (*cache.Volume)(nil)
)
