package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
)

func TestBackendNames(t *testing.T) {
	for _, tt := range []struct{ name, err string }{
		{"cpu", ""},
		{"cuda:x", `backend "cuda:x": expected "cuda:N" with N a device ordinal`},
		{"cuda:-1", `backend "cuda:-1": expected "cuda:N" with N a device ordinal`},
		{"tpu", `backend "tpu": expected "cpu" or "cuda:N"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			be, err := Backend(tt.name)
			if tt.err == "" {
				require.NoError(t, err)
				assert.Equal(t, tt.name, be.Name())
				return
			}
			assert.True(t, goep.IsArgument(err))
			assert.EqualError(t, err, tt.err)
		})
	}
}

// A buffer's id names it until Destroy; then it is an error, and a second Destroy a no-op.
func TestBufferIDs(t *testing.T) {
	id, err := NewBuffer("cpu", goep.Params{Rank: 0, NumRanks: 1, NumNVLBytes: 1 << 20})
	require.NoError(t, err)
	b, err := Buffer(id)
	require.NoError(t, err)
	assert.Equal(t, 1, b.Topology().NumRanks)
	require.NoError(t, Destroy(id))
	_, err = Buffer(id)
	assert.ErrorContains(t, err, "does not exist")
	assert.NoError(t, Destroy(id))
}

func TestSetOpTimeout(t *testing.T) {
	was := goep.OpTimeout()
	t.Cleanup(func() { goep.SetOpTimeout(was) })
	for _, bad := range []float64{0, -1, 2e6} {
		assert.True(t, goep.IsArgument(SetOpTimeout(bad)), "%v", bad)
	}
	require.NoError(t, SetOpTimeout(1.5))
	assert.Equal(t, int64(1500), goep.OpTimeout().Milliseconds())
}
