package goep

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/dlpack"
)

// ownBuf is memory at a fixed address (a test's stack may move), as a tensor's is.
var ownBuf [12]int32

func TestTensorsOwn(t *testing.T) {
	buf := ownBuf[:]
	addr := uintptr(unsafe.Pointer(&buf[0]))
	tests := []struct {
		name     string
		data     uintptr
		optional bool
		dims     []int64
		valid    bool
		err      string
	}{
		{"present", addr, false, []int64{3, 4}, true, ""},
		{"absent optional", 0, true, []int64{3, 4}, false, ""},
		{"absent required", 0, false, []int64{3, 4}, false, "t: expected a tensor, got None"},
		// An empty tensor may have no address: it is present, with nothing to read or write.
		{"empty without address", 0, false, []int64{0, 4}, true, ""},
		{"negative size", addr, false, []int64{-1, 4}, false, "t: shape [-1 4] has a negative size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := &Tensors{DeviceType: dlpack.CUDA, DeviceID: 2}
			got := ts.Own("t", tt.data, tt.optional, dlpack.I32, tt.dims...)
			if tt.err != "" {
				require.Error(t, ts.Err)
				assert.Contains(t, ts.Err.Error(), tt.err)
				assert.True(t, IsArgument(ts.Err))
				return
			}
			require.NoError(t, ts.Err)
			assert.Equal(t, tt.valid, got.Valid)
			if tt.valid {
				assert.Equal(t, tt.dims, got.Shape)
				assert.Equal(t, dlpack.I32, got.DType)
				assert.Equal(t, dlpack.CUDA, got.DeviceType)
				assert.Equal(t, 2, got.DeviceID)
			}
		})
	}
	// Once a tensor is wrong, later ones are not looked at: the first mistake is the one reported.
	ts := &Tensors{DeviceType: dlpack.CPU}
	ts.Own("a", 0, false, dlpack.I32, 2)
	assert.False(t, ts.Own("b", addr, false, dlpack.I32, 2).Valid)
	assert.Contains(t, ts.Err.Error(), "a: expected a tensor")
	// A present tensor views the memory at its address.
	ts = &Tensors{DeviceType: dlpack.CPU}
	buf[5] = 42
	assert.Equal(t, int32(42), Int32s(ts.Own("c", addr, false, dlpack.I32, 3, 4))[5])
}
