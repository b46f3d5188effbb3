//go:build cgo

package cudall

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// The launch parameters cross to the kernels as raw bytes, declared once in kernels/params.h
// (which asserts their sizes in every compiler that includes it): check the layout cgo gave Go.
func TestParamLayouts(t *testing.T) {
	assert.EqualValues(t, 288, unsafe.Sizeof(llParams{}))
	assert.EqualValues(t, 128, unsafe.Offsetof(llParams{}.x))
	assert.EqualValues(t, 216, unsafe.Offsetof(llParams{}.rank))
	assert.EqualValues(t, 244, unsafe.Offsetof(llParams{}.zero_copy))
	assert.EqualValues(t, 48, unsafe.Offsetof(llParams{}.expert_sent))
	assert.EqualValues(t, 248, unsafe.Offsetof(llParams{}.timeline))
	assert.EqualValues(t, 256, unsafe.Offsetof(llParams{}.pending))
	assert.EqualValues(t, 32, unsafe.Sizeof(llError{}))
	assert.EqualValues(t, 16, unsafe.Offsetof(llError{}.waited_ns))
}
