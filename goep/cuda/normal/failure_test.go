//go:build cgo

package cudanormal

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pyep/pyep/goep"
)

// The layout's record in words: a bad index is the caller's argument; a block that waited past the
// timeout for block 0 (layout.cu's kGateTimedOut, token and choice all ones) is not, and says that
// the counts are not valid.
func TestStatusErrorLayoutRecords(t *testing.T) {
	err := statusError(6, 1, 700, 5, -7, 256)
	assert.True(t, goep.IsArgument(err))
	assert.Contains(t, err.Error(), "rank 1: in its last get_dispatch_layout, topk_idx[700,5] = -7 is out of range [0, 256)")

	err = statusError(6, 1, layoutGateTimedOut, layoutGateTimedOut, 0, 256)
	assert.False(t, goep.IsArgument(err))
	assert.Contains(t, err.Error(), "rank 1: its last get_dispatch_layout's blocks waited past the timeout for its block 0")
	assert.Contains(t, err.Error(), "its counts are not valid")
}
