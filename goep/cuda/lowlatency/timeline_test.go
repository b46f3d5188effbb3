//go:build cgo

package cudall

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The timeline's stamps are named from params.h's list, a kernel's stamps together and each
// kernel's first its start.
func TestStampNames(t *testing.T) {
	kernels, phases := stampNames()
	require.Len(t, kernels, stampsPerBlock)
	require.Len(t, phases, stampsPerBlock)
	assert.Equal(t, []string{"dispatch send", "dispatch recv", "combine send", "combine recv"}, slices.Compact(slices.Clone(kernels)))
	for i := range kernels {
		if i == 0 || kernels[i] != kernels[i-1] {
			assert.Equal(t, "start", phases[i], "stamp %d (%s) begins its kernel", i, kernels[i])
		}
	}
	assert.Equal(t, "done", phases[stampsPerBlock-1])
}
