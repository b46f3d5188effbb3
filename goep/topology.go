package goep

import "fmt"

const (
	// NumMaxNVLPeers is the size of an NVLink domain: ranks r and r' share one when
	// r/NumMaxNVLPeers == r'/NumMaxNVLPeers. DeepEP fixes the same 8; PYEP_RANKS_PER_NODE makes
	// nodes of fewer ranks (Params.RanksPerNode).
	NumMaxNVLPeers = 8
	// NumMaxRDMAPeers bounds the number of NVLink domains in normal (non low-latency) mode.
	NumMaxRDMAPeers = 20
	// BufferAlignment is the granularity of every buffer size.
	BufferAlignment = 128
)

// Topology is a rank's place in the group: rank = RDMARank*NumNVLRanks + NVLRank, where a node
// (one NVLink domain) is NumMaxNVLPeers ranks, the whole group when it is smaller, or the
// RanksPerNode that PYEP_RANKS_PER_NODE asked for.
type Topology struct {
	Rank, NumRanks         int
	RDMARank, NumRDMARanks int
	NVLRank, NumNVLRanks   int
	// RanksPerNode is PYEP_RANKS_PER_NODE's node size, 0 when unset: the nodes are emulated
	// (errors say to unset it where it is why a mode is not available).
	RanksPerNode int
}

// NewTopology checks (rank, numRanks) as DeepEP does and splits the rank into its RDMA and
// NVLink coordinates, with DeepEP's nodes of NumMaxNVLPeers ranks.
func NewTopology(rank, numRanks int, lowLatency bool) (Topology, error) {
	return NewNodeTopology(rank, numRanks, 0, lowLatency)
}

// NewNodeTopology is NewTopology with nodes of ranksPerNode ranks (PYEP_RANKS_PER_NODE; 0:
// DeepEP's): each ranksPerNode consecutive ranks are one node, which must divide the group and
// hold at most NumMaxNVLPeers ranks.
func NewNodeTopology(rank, numRanks, ranksPerNode int, lowLatency bool) (Topology, error) {
	if numRanks <= 0 {
		return Topology{}, Argf("num_ranks = %d: expected a positive group size", numRanks)
	}
	if rank < 0 || rank >= numRanks {
		return Topology{}, Argf("rank = %d: expected 0 <= rank < num_ranks = %d", rank, numRanks)
	}
	k := ranksPerNode
	switch {
	case k == 0:
		if numRanks > NumMaxNVLPeers && numRanks%NumMaxNVLPeers != 0 {
			return Topology{}, Argf("num_ranks = %d: expected fewer than %d ranks or a multiple of %d (whole NVLink domains)",
				numRanks, NumMaxNVLPeers, NumMaxNVLPeers)
		}
		k = min(numRanks, NumMaxNVLPeers)
	case k < 1 || k > NumMaxNVLPeers || numRanks%k != 0:
		return Topology{}, Argf("PYEP_RANKS_PER_NODE = %d: expected a node size from 1 to %d that divides num_ranks = %d "+
			"(%s), or unset it for DeepEP's nodes of %d", k, NumMaxNVLPeers, numRanks, divisors(numRanks), NumMaxNVLPeers)
	}
	if !lowLatency && numRanks/k > NumMaxRDMAPeers {
		why := fmt.Sprintf("%d domains of %d", NumMaxRDMAPeers, k)
		if ranksPerNode != 0 {
			why += fmt.Sprintf(", PYEP_RANKS_PER_NODE = %d", k)
		}
		return Topology{}, Argf("num_ranks = %d: normal mode supports at most %d ranks (%s)", numRanks, NumMaxRDMAPeers*k, why)
	}
	return Topology{
		Rank:         rank,
		NumRanks:     numRanks,
		RDMARank:     rank / k,
		NumRDMARanks: numRanks / k,
		NVLRank:      rank % k,
		NumNVLRanks:  k,
		RanksPerNode: ranksPerNode,
	}, nil
}

// divisors lists the node sizes that fit numRanks, for the error that names them.
func divisors(numRanks int) string {
	s := ""
	for k := 1; k <= NumMaxNVLPeers; k++ {
		if numRanks%k == 0 {
			if s != "" {
				s += ", "
			}
			s += fmt.Sprint(k)
		}
	}
	return "one of " + s
}

// DomainRank is the group rank of NVLink peer nvlRank in this rank's domain.
func (t Topology) DomainRank(nvlRank int) int { return t.RDMARank*t.NumNVLRanks + nvlRank }

// SameNode reports whether rank p is in this rank's node (NVLink domain).
func (t Topology) SameNode(p int) bool { return p/t.NumNVLRanks == t.RDMARank }

// RootRDMARank is the rank whose NVSHMEM unique id the group uses: with global set, the group
// rank of RDMA rank 0 that has this rank's NVLink index; otherwise the RDMA rank 0.
func (t Topology) RootRDMARank(global bool) int {
	if global {
		return t.NVLRank
	}
	return 0
}

// nodesHint is what an error about a mode that does not run across nodes adds when
// PYEP_RANKS_PER_NODE made them: what to unset ("" when the nodes are DeepEP's).
func (t Topology) nodesHint() string {
	if t.RanksPerNode == 0 {
		return ""
	}
	hint := fmt.Sprintf("; the %d ranks are %d nodes because PYEP_RANKS_PER_NODE = %d", t.NumRanks, t.NumRDMARanks, t.RanksPerNode)
	if t.NumRanks <= NumMaxNVLPeers {
		hint += ": unset it to run them as one node"
	}
	return hint
}
