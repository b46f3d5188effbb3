package cuda

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// The launch parameters cross to the kernels as raw bytes: their sizes must be what
// kernels/intranode.cu and layout.cu static_assert.
func TestNormalParamLayouts(t *testing.T) {
	assert.EqualValues(t, ctxBytes, unsafe.Sizeof(kctx{}))
	assert.EqualValues(t, notifyParamsBytes, unsafe.Sizeof(notifyParams{}))
	assert.EqualValues(t, 192, unsafe.Sizeof(prologueParams{}))
	assert.EqualValues(t, 368, unsafe.Sizeof(dispatchParams{}))
	assert.EqualValues(t, 360, unsafe.Offsetof(dispatchParams{}.GoSeq))
	assert.EqualValues(t, 348, unsafe.Offsetof(dispatchParams{}.ScaleTokenStride))
	assert.EqualValues(t, 296, unsafe.Offsetof(notifyParams{}.LayoutRec))
	assert.EqualValues(t, 304, unsafe.Sizeof(combineParams{}))
	assert.EqualValues(t, 64, unsafe.Sizeof(layoutParams{}))
	assert.EqualValues(t, opErrorBytes, unsafe.Sizeof(opError{}))
	assert.EqualValues(t, notifyResultBytes, unsafe.Sizeof(notifyResult{}))
	assert.EqualValues(t, 128, unsafe.Offsetof(kctx{}.Err))
	assert.EqualValues(t, 168, unsafe.Offsetof(kctx{}.Rank))
	assert.EqualValues(t, 184, unsafe.Offsetof(dispatchParams{}.X))
	assert.EqualValues(t, 336, unsafe.Offsetof(dispatchParams{}.NumTokens))
	assert.EqualValues(t, 288, unsafe.Offsetof(combineParams{}.NumTokens))
	assert.EqualValues(t, 56, unsafe.Offsetof(opError{}.AbortWord))
}

func TestVecBytes(t *testing.T) {
	assert.Equal(t, 16, vecBytes(14336, 0x1000, 0x2000))
	assert.Equal(t, 8, vecBytes(14336, 0x1008))
	assert.Equal(t, 2, vecBytes(198, 0x1000))
	assert.Equal(t, 1, vecBytes(99))
}
