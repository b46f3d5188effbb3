package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
)

// The symmetric heap holds the region and NVSHMEM's own objects, in 2 MiB pages; a user's
// NVSHMEM_SYMMETRIC_SIZE is kept when it is large enough and refused, naming the fix, when not.
func TestHeapSetting(t *testing.T) {
	assert.EqualValues(t, 130<<20, cuda.SymmetricHeapBytes(1<<20))
	assert.EqualValues(t, 128<<20+2<<20, cuda.SymmetricHeapBytes(1))
	assert.EqualValues(t, 1<<30+128<<20, cuda.SymmetricHeapBytes(1<<30))
	set, err := cuda.HeapSetting("", 1<<20)
	require.NoError(t, err)
	assert.Equal(t, "136314880", set)
	for _, user := range []string{"1G", "1g", "1GiB"[:2], "2147483648", "512M"} {
		set, err := cuda.HeapSetting(user, 100<<20)
		require.NoError(t, err, user)
		assert.Empty(t, set, "%s is kept", user)
	}
	_, err = cuda.HeapSetting("64M", 100<<20)
	require.Error(t, err)
	var arg *goep.ArgumentError
	assert.ErrorAs(t, err, &arg)
	assert.Contains(t, err.Error(), "NVSHMEM_SYMMETRIC_SIZE = 64M (67108864 bytes) cannot hold num_rdma_bytes = 104857600")
	_, err = cuda.HeapSetting("lots", 1)
	assert.ErrorContains(t, err, "expected a positive size in bytes")
}
