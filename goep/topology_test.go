package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewTopology(t *testing.T) {
	tests := []struct {
		rank, numRanks int
		lowLatency     bool
		want           Topology
		err            string
	}{
		{rank: 0, numRanks: 1, want: Topology{0, 1, 0, 1, 0, 1}},
		{rank: 3, numRanks: 4, want: Topology{3, 4, 0, 1, 3, 4}},
		{rank: 7, numRanks: 8, want: Topology{7, 8, 0, 1, 7, 8}},
		{rank: 13, numRanks: 16, want: Topology{13, 16, 1, 2, 5, 8}},
		{rank: 0, numRanks: 9, err: "num_ranks = 9: expected fewer than 8 ranks or a multiple of 8"},
		{rank: 4, numRanks: 4, err: "rank = 4: expected 0 <= rank < num_ranks = 4"},
		{rank: -1, numRanks: 4, err: "rank = -1"},
		{rank: 0, numRanks: 0, err: "num_ranks = 0"},
		{rank: 0, numRanks: 168, err: "normal mode supports at most 160 ranks"},
		{rank: 0, numRanks: 168, lowLatency: true, want: Topology{0, 168, 0, 21, 0, 8}},
	}
	for _, tt := range tests {
		got, err := NewTopology(tt.rank, tt.numRanks, tt.lowLatency)
		if tt.err != "" {
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.err)
			assert.True(t, IsArgument(err), "a bad rank is the caller's mistake")
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, tt.want, got)
	}
}

func TestTopologyArithmetic(t *testing.T) {
	topo, err := NewTopology(13, 16, false)
	require.NoError(t, err)
	assert.Equal(t, 8, topo.DomainRank(0))
	assert.Equal(t, 15, topo.DomainRank(7))
	assert.Equal(t, 5, topo.RootRDMARank(true))
	assert.Equal(t, 0, topo.RootRDMARank(false))
	for r := 0; r < 16; r++ {
		topo, err := NewTopology(r, 16, false)
		require.NoError(t, err)
		assert.Equal(t, r, topo.RDMARank*NumMaxNVLPeers+topo.NVLRank)
		assert.Equal(t, r, topo.DomainRank(topo.NVLRank))
	}
}
