package cuda

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A process stays in the NVSHMEM group its first buffer across nodes made: a later buffer fits
// only as the same rank of the same number of ranks, and is told which one otherwise.
func TestGroupFits(t *testing.T) {
	assert.NoError(t, groupFits(1, 4, 1, 4))
	assert.EqualError(t, groupFits(1, 4, 1, 2), "pyep: this process is PE 1 of 4 in the NVSHMEM group an earlier buffer "+
		"across nodes made, and NVSHMEM is one group per process for the process's life: a buffer across nodes here must "+
		"be rank 1 of 4 ranks, not rank 1 of 2")
	assert.ErrorContains(t, groupFits(1, 4, 0, 4), "must be rank 1 of 4 ranks, not rank 0 of 4")
}
