package goep

const (
	// NumMaxNVLPeers is the size of an NVLink domain: ranks r and r' share one when
	// r/NumMaxNVLPeers == r'/NumMaxNVLPeers. DeepEP fixes the same 8.
	NumMaxNVLPeers = 8
	// NumMaxRDMAPeers bounds the number of NVLink domains in normal (non low-latency) mode.
	NumMaxRDMAPeers = 20
	// BufferAlignment is the granularity of every buffer size.
	BufferAlignment = 128
)

// Topology is a rank's place in the group: rank = RDMARank*NumMaxNVLPeers + NVLRank.
type Topology struct {
	Rank, NumRanks         int
	RDMARank, NumRDMARanks int
	NVLRank, NumNVLRanks   int
}

// NewTopology checks (rank, numRanks) as DeepEP does and splits the rank into its RDMA and
// NVLink coordinates.
func NewTopology(rank, numRanks int, lowLatency bool) (Topology, error) {
	if numRanks <= 0 {
		return Topology{}, Argf("num_ranks = %d: expected a positive group size", numRanks)
	}
	if rank < 0 || rank >= numRanks {
		return Topology{}, Argf("rank = %d: expected 0 <= rank < num_ranks = %d", rank, numRanks)
	}
	if numRanks > NumMaxNVLPeers && numRanks%NumMaxNVLPeers != 0 {
		return Topology{}, Argf("num_ranks = %d: expected fewer than %d ranks or a multiple of %d (whole NVLink domains)",
			numRanks, NumMaxNVLPeers, NumMaxNVLPeers)
	}
	if !lowLatency && numRanks > NumMaxNVLPeers*NumMaxRDMAPeers {
		return Topology{}, Argf("num_ranks = %d: normal mode supports at most %d ranks (%d domains of %d)",
			numRanks, NumMaxNVLPeers*NumMaxRDMAPeers, NumMaxRDMAPeers, NumMaxNVLPeers)
	}
	return Topology{
		Rank:         rank,
		NumRanks:     numRanks,
		RDMARank:     rank / NumMaxNVLPeers,
		NumRDMARanks: max(1, numRanks/NumMaxNVLPeers),
		NVLRank:      rank % NumMaxNVLPeers,
		NumNVLRanks:  min(numRanks, NumMaxNVLPeers),
	}, nil
}

// DomainRank is the group rank of NVLink peer nvlRank in this rank's domain.
func (t Topology) DomainRank(nvlRank int) int { return t.RDMARank*t.NumNVLRanks + nvlRank }

// RootRDMARank is the rank whose NVSHMEM unique id the group uses: with global set, the group
// rank of RDMA rank 0 that has this rank's NVLink index; otherwise the RDMA rank 0.
func (t Topology) RootRDMARank(global bool) int {
	if global {
		return t.NVLRank
	}
	return 0
}
