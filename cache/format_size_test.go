package cache

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tiercache/tiercache/device"
)

// TestFormatMinimumSize: the refusal of a too small cache device names the
// smallest size that works, and that size is exact: one block less is
// refused, the size itself formats.
func TestFormatMinimumSize(t *testing.T) {
	for _, bs := range []int64{256 << 10, 1 << 20, 8 << 20} {
		_, err := Format(device.NewMem(1<<20), nil, FormatOptions{BucketSize: bs, Mode: Writeback})
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("bucket %d: a 1 MiB device: %v", bs, err)
		}
		need := minDeviceSize(bs, 0, bs/blockSize)
		if !strings.Contains(err.Error(), fmt.Sprintf("needs at least %d bytes", need)) {
			t.Errorf("bucket %d: the refusal does not name the minimum %d: %v", bs, need, err)
		}
		if _, err := Format(device.NewMem(need-blockSize), nil, FormatOptions{BucketSize: bs, Mode: Writeback}); !errors.Is(err, ErrInvalid) {
			t.Errorf("bucket %d: %d bytes (one block under the minimum) formatted: %v", bs, need-blockSize, err)
		}
		if _, err := Format(device.NewMem(need), nil, FormatOptions{BucketSize: bs, Mode: Writeback}); err != nil {
			t.Errorf("bucket %d: the minimum %d does not format: %v", bs, need, err)
		}
	}
}
