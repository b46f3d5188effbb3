package goep

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewTopology(t *testing.T) {
	tests := []struct {
		rank, numRanks, perNode int
		lowLatency              bool
		want                    Topology
		err                     string
	}{
		{rank: 0, numRanks: 1, want: Topology{0, 1, 0, 1, 0, 1, 0}},
		{rank: 3, numRanks: 4, want: Topology{3, 4, 0, 1, 3, 4, 0}},
		{rank: 7, numRanks: 8, want: Topology{7, 8, 0, 1, 7, 8, 0}},
		{rank: 13, numRanks: 16, want: Topology{13, 16, 1, 2, 5, 8, 0}},
		{rank: 0, numRanks: 9, err: "num_ranks = 9: expected fewer than 8 ranks or a multiple of 8"},
		{rank: 4, numRanks: 4, err: "rank = 4: expected 0 <= rank < num_ranks = 4"},
		{rank: -1, numRanks: 4, err: "rank = -1"},
		{rank: 0, numRanks: 0, err: "num_ranks = 0"},
		{rank: 0, numRanks: 168, err: "normal mode supports at most 160 ranks"},
		{rank: 0, numRanks: 168, lowLatency: true, want: Topology{0, 168, 0, 21, 0, 8, 0}},
		// PYEP_RANKS_PER_NODE: nodes of k consecutive ranks.
		{rank: 3, numRanks: 4, perNode: 1, want: Topology{3, 4, 3, 4, 0, 1, 1}},
		{rank: 3, numRanks: 4, perNode: 2, want: Topology{3, 4, 1, 2, 1, 2, 2}},
		{rank: 2, numRanks: 3, perNode: 3, want: Topology{2, 3, 0, 1, 2, 3, 3}},
		{rank: 5, numRanks: 6, perNode: 3, want: Topology{5, 6, 1, 2, 2, 3, 3}},
		{rank: 9, numRanks: 12, perNode: 4, want: Topology{9, 12, 2, 3, 1, 4, 4}},
		{rank: 0, numRanks: 3, perNode: 2, err: "PYEP_RANKS_PER_NODE = 2: expected a node size from 1 to 8 that divides num_ranks = 3 (one of 1, 3)"},
		{rank: 0, numRanks: 16, perNode: 16, err: "PYEP_RANKS_PER_NODE = 16: expected a node size from 1 to 8"},
		{rank: 0, numRanks: 4, perNode: -1, err: "PYEP_RANKS_PER_NODE = -1"},
		{rank: 0, numRanks: 21, perNode: 1, err: "normal mode supports at most 20 ranks (20 domains of 1, PYEP_RANKS_PER_NODE = 1)"},
		{rank: 20, numRanks: 21, perNode: 1, lowLatency: true, want: Topology{20, 21, 20, 21, 0, 1, 1}},
	}
	for _, tt := range tests {
		got, err := NewNodeTopology(tt.rank, tt.numRanks, tt.perNode, tt.lowLatency)
		if tt.err != "" {
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.err)
			assert.True(t, IsArgument(err), "a bad rank is the caller's mistake")
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, tt.want, got)
		if tt.perNode == 0 {
			plain, err := NewTopology(tt.rank, tt.numRanks, tt.lowLatency)
			require.NoError(t, err)
			assert.Equal(t, got, plain)
		}
	}
}

func TestTopologyArithmetic(t *testing.T) {
	topo, err := NewTopology(13, 16, false)
	require.NoError(t, err)
	assert.Equal(t, 8, topo.DomainRank(0))
	assert.Equal(t, 15, topo.DomainRank(7))
	assert.Equal(t, 5, topo.RootRDMARank(true))
	assert.Equal(t, 0, topo.RootRDMARank(false))
	for _, perNode := range []int{0, 1, 2, 4, 8} {
		for r := 0; r < 16; r++ {
			topo, err := NewNodeTopology(r, 16, perNode, false)
			require.NoError(t, err)
			assert.Equal(t, r, topo.RDMARank*topo.NumNVLRanks+topo.NVLRank)
			assert.Equal(t, r, topo.DomainRank(topo.NVLRank))
			assert.Equal(t, topo.NVLRank, topo.RootRDMARank(true))
			for p := 0; p < 16; p++ {
				assert.Equal(t, topo.RDMARank == p/topo.NumNVLRanks, topo.SameNode(p))
			}
		}
	}
	two, err := NewNodeTopology(3, 4, 2, true)
	require.NoError(t, err)
	assert.True(t, two.SameNode(2))
	assert.False(t, two.SameNode(1))
	assert.Equal(t, "; the 4 ranks are 2 nodes because PYEP_RANKS_PER_NODE = 2: unset it to run them as one node", two.nodesHint())
	assert.Empty(t, topo.nodesHint(), "DeepEP's nodes: nothing to unset")
}

// A Buffer takes its node size from PYEP_RANKS_PER_NODE when it is made, unless Params names one.
func TestBufferReadsRanksPerNode(t *testing.T) {
	p := Params{Rank: 3, NumRanks: 4, LowLatencyMode: true}
	t.Setenv("PYEP_RANKS_PER_NODE", "2")
	b, err := NewBuffer(p, gpuBackend{})
	require.NoError(t, err)
	assert.Equal(t, Topology{3, 4, 1, 2, 1, 2, 2}, b.Topology())
	p.RanksPerNode = 4
	b, err = NewBuffer(p, gpuBackend{})
	require.NoError(t, err)
	assert.Equal(t, 1, b.Topology().NumRDMARanks)
	p.RanksPerNode = 0
	for value, msg := range map[string]string{
		"3":   "PYEP_RANKS_PER_NODE = 3: expected a node size from 1 to 8 that divides num_ranks = 4 (one of 1, 2, 4)",
		"two": `PYEP_RANKS_PER_NODE="two": expected a positive whole number`,
		"0":   `PYEP_RANKS_PER_NODE="0": expected a positive whole number`,
	} {
		t.Setenv("PYEP_RANKS_PER_NODE", value)
		_, err = NewBuffer(p, gpuBackend{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), msg)
		assert.True(t, IsArgument(err))
	}
	// Unset: DeepEP's nodes of 8.
	t.Setenv("PYEP_RANKS_PER_NODE", "")
	b, err = NewBuffer(p, gpuBackend{})
	require.NoError(t, err)
	assert.Equal(t, Topology{3, 4, 0, 1, 3, 4, 0}, b.Topology())
}

// The low-latency engine's path table: the peers of other nodes, or every peer but itself
// without NVLink (allow_nvlink_for_low_latency_mode=False); nil when all are direct.
func TestRemotePeers(t *testing.T) {
	for _, c := range []struct {
		rank, numRanks, perNode int
		noNVLink                bool
		want                    []bool
	}{
		{rank: 1, numRanks: 4, want: nil},
		{rank: 1, numRanks: 4, perNode: 2, want: []bool{false, false, true, true}},
		{rank: 2, numRanks: 4, perNode: 1, want: []bool{true, true, false, true}},
		{rank: 2, numRanks: 4, noNVLink: true, want: []bool{true, true, false, true}},
		{rank: 0, numRanks: 1, noNVLink: true, want: nil},
		{rank: 9, numRanks: 16, want: []bool{true, true, true, true, true, true, true, true, false, false, false, false, false, false, false, false}},
	} {
		topo, err := NewNodeTopology(c.rank, c.numRanks, c.perNode, true)
		require.NoError(t, err)
		b := &Buffer{topo: topo, params: Params{NoNVLinkForLowLatency: c.noNVLink}}
		assert.Equal(t, c.want, b.remotePeers(), "rank %d of %d, nodes of %d, no NVLink %v", c.rank, c.numRanks, c.perNode, c.noNVLink)
	}
}
