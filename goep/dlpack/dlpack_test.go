package dlpack

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestViewRoundTrip(t *testing.T) {
	mem := make([]float32, 10)
	addr, err := NewView(unsafe.Pointer(&mem[0]), CPU, 0, F32, int64(len(mem)))
	require.NoError(t, err)
	defer FreeView(addr)
	got, err := Parse(addr)
	require.NoError(t, err)
	assert.Equal(t, unsafe.Pointer(&mem[0]), got.Data)
	assert.Equal(t, F32, got.DType)
	assert.Equal(t, []int64{10}, got.Shape)
	assert.EqualValues(t, 10, got.Numel())
	assert.Equal(t, CPU, got.DeviceType)
	assert.Equal(t, 4, got.DType.Size())
	assert.Equal(t, "float32", got.DType.String())
}

func TestParseRejectsNull(t *testing.T) {
	_, err := Parse(0)
	assert.ErrorContains(t, err, "null DLPack tensor")
}
