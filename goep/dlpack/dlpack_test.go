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

// managed mirrors pyep_DLManagedTensor (the DLPack ABI) so that tests build tensors of any shape
// and strides without cgo.
type managed struct {
	data                 unsafe.Pointer
	deviceType, deviceID int32
	ndim                 int32
	code, bits           uint8
	lanes                uint16
	shape, strides       *int64
	byteOffset           uint64
	ctx, deleter         unsafe.Pointer
}

func tensorAt(m *managed) uintptr { return uintptr(unsafe.Pointer(m)) }

func newManaged(mem []float32, code, bits uint8, lanes uint16, shape, strides []int64) *managed {
	m := &managed{data: unsafe.Pointer(&mem[0]), deviceType: CPU, ndim: int32(len(shape)), code: code, bits: bits,
		lanes: lanes, shape: &shape[0]}
	if strides != nil {
		m.strides = &strides[0]
	}
	return m
}

func TestParseStrides(t *testing.T) {
	mem := make([]float32, 64)
	cases := []struct {
		name           string
		shape, strides []int64
		dense          bool
		span           int64
		err            string
	}{
		{name: "no strides", shape: []int64{4, 3}, dense: true, span: 12},
		{name: "row-major", shape: []int64{4, 3}, strides: []int64{3, 1}, dense: true, span: 12},
		{name: "size-1 dim with any stride", shape: []int64{4, 1}, strides: []int64{1, 1}, dense: true, span: 4},
		{name: "column-major", shape: []int64{4, 3}, strides: []int64{1, 4}, span: 12},
		{name: "padded column-major", shape: []int64{4, 3}, strides: []int64{1, 8}, span: 20},
		{name: "padded rows", shape: []int64{4, 3}, strides: []int64{5, 1}, span: 18},
		{name: "empty", shape: []int64{0, 3}, strides: []int64{1, 7}, dense: true, span: 0},
		{name: "negative", shape: []int64{4, 3}, strides: []int64{-3, 1}, err: "negative strides"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := newManaged(mem, Float, 32, 1, c.shape, c.strides)
			got, err := ParseStrided(tensorAt(m))
			if c.err != "" {
				assert.ErrorContains(t, err, c.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.dense, got.Strides == nil)
			assert.Equal(t, c.span, got.Span())
			_, err = Parse(tensorAt(m))
			if c.dense {
				assert.NoError(t, err)
			} else {
				assert.ErrorContains(t, err, "not contiguous")
			}
		})
	}
}

func TestParsePackedElements(t *testing.T) {
	mem := make([]float32, 4)
	// float4_e2m1fn_x2: two lanes of 4 bits, one byte an element.
	got, err := Parse(tensorAt(newManaged(mem, 17, 4, 2, []int64{2, 3}, nil)))
	require.NoError(t, err)
	assert.Equal(t, 1, got.DType.Size())
	_, err = Parse(tensorAt(newManaged(mem, 17, 4, 1, []int64{2, 3}, nil)))
	assert.ErrorContains(t, err, "not whole bytes")
	_, err = Parse(tensorAt(newManaged(mem, Float, 4, 3, []int64{2, 3}, nil)))
	assert.ErrorContains(t, err, "3 lanes of 4 bits")
}
