//go:build cgo

package cudanormal

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// The launch parameters cross to the kernels as raw bytes, declared once in kernels/params.h
// (which asserts their sizes in every compiler that includes it): check the layout cgo gave Go.
func TestParamLayouts(t *testing.T) {
	assert.EqualValues(t, 184, unsafe.Sizeof(kctx{}))
	assert.EqualValues(t, 312, unsafe.Sizeof(notifyParams{}))
	assert.EqualValues(t, 360, unsafe.Sizeof(dispatchParams{}))
	assert.EqualValues(t, 348, unsafe.Offsetof(dispatchParams{}.scale_token_stride))
	assert.EqualValues(t, 356, unsafe.Offsetof(dispatchParams{}.barriers))
	// The queued dispatch's kernel takes both, one after the other, well within the 4 KB of
	// parameters a launch may pass.
	assert.EqualValues(t, 672, unsafe.Sizeof(notifyDispatchParams{}))
	assert.EqualValues(t, 0, unsafe.Offsetof(notifyDispatchParams{}.notify))
	assert.EqualValues(t, 312, unsafe.Offsetof(notifyDispatchParams{}.dispatch))
	assert.Less(t, unsafe.Sizeof(notifyDispatchParams{}), uintptr(4096))
	assert.EqualValues(t, 296, unsafe.Offsetof(notifyParams{}.layout_rec))
	assert.EqualValues(t, 304, unsafe.Sizeof(combineParams{}))
	assert.EqualValues(t, 80, unsafe.Sizeof(layoutParams{}))
	assert.EqualValues(t, 16, layoutWorkBytes)
	assert.EqualValues(t, opErrorBytes, unsafe.Sizeof(opError{}))
	assert.EqualValues(t, 56, notifyResultBytes)
	assert.EqualValues(t, 128, unsafe.Offsetof(kctx{}.err))
	assert.EqualValues(t, 168, unsafe.Offsetof(kctx{}.rank))
	assert.EqualValues(t, 184, unsafe.Offsetof(dispatchParams{}.x))
	assert.EqualValues(t, 336, unsafe.Offsetof(dispatchParams{}.num_tokens))
	assert.EqualValues(t, 288, unsafe.Offsetof(combineParams{}.num_tokens))
	assert.EqualValues(t, 64, opErrorBytes)
	assert.EqualValues(t, 56, unsafe.Offsetof(opError{}.abort_word))
}

func TestVecBytes(t *testing.T) {
	assert.Equal(t, 16, vecBytes(14336, 0x1000, 0x2000))
	assert.Equal(t, 8, vecBytes(14336, 0x1008))
	assert.Equal(t, 2, vecBytes(198, 0x1000))
	assert.Equal(t, 1, vecBytes(99))
}
