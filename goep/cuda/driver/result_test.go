package driver

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestResultError(t *testing.T) {
	tests := []struct {
		r    Result
		want string
	}{
		{ErrorInvalidValue, "CUDA_ERROR_INVALID_VALUE: invalid argument"},
		{ErrorOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY: out of memory"},
		{ErrorNoBinaryForGPU, "CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image is available for execution on the device"},
		{ErrorIllegalAddress, "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"},
		{Result(12345), "CUDA_ERROR_12345: unrecognized CUDA error code"},
	}
	for _, tt := range tests {
		name, desc := tt.r.builtinText()
		assert.Equal(t, tt.want, name+": "+desc)
		if !loaded.Load() {
			assert.Equal(t, tt.want, tt.r.Error())
		}
	}
	assert.Equal(t, "CUDA_ERROR_NOT_READY", ErrorNotReady.Name())
}

func TestWrap(t *testing.T) {
	assert.NoError(t, wrap("cuMemAlloc_v2", Success))
	err := wrap("cuMemAlloc_v2(1024 bytes)", ErrorOutOfMemory)
	require.Error(t, err)
	assert.True(t, errors.Is(err, ErrorOutOfMemory))
	assert.Contains(t, err.Error(), "pyep: cuMemAlloc_v2(1024 bytes): CUDA_ERROR_OUT_OF_MEMORY")
	var r Result
	require.ErrorAs(t, err, &r)
	assert.Equal(t, ErrorOutOfMemory, r)
}

func TestDevicePtrAdd(t *testing.T) {
	assert.Equal(t, DevicePtr(0x1010), DevicePtr(0x1000).Add(16))
}
