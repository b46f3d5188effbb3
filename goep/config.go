package goep

// Config is DeepEP's performance config of normal mode: how many SMs (channels = NumSMs/2) the
// kernels use and how many tokens one step of a ring moves and holds.
type Config struct {
	NumSMs                      int
	NumMaxNVLChunkedSendTokens  int
	NumMaxNVLChunkedRecvTokens  int
	NumMaxRDMAChunkedSendTokens int
	NumMaxRDMAChunkedRecvTokens int
}

// The largest top-k and number of scales per token that a ring slot has room for; DeepEP's
// size hints assume the same two bounds.
const (
	MaxTopK   = 128
	MaxScales = 128
	// MaxRows bounds the tokens of a call and the rows it receives (the kernels count in int32).
	MaxRows = 1<<31 - 2
	// MaxExpertAlignment bounds expert_alignment.
	MaxExpertAlignment = 1 << 20
	// sourceMetaBytes is the per-token routing record of the internode rings.
	sourceMetaBytes = 8
)

// NewConfig validates like DeepEP's Config constructor and rounds the RDMA receive ring up to a
// whole number of send chunks.
func NewConfig(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int) (Config, error) {
	switch {
	case numSMs <= 0 || numSMs%2 != 0:
		return Config{}, Argf("num_sms = %d: expected a positive even number (two SMs a channel)", numSMs)
	case nvlSend <= 0 || nvlRecv <= 0:
		return Config{}, Argf("num_max_nvl_chunked_send_tokens = %d, num_max_nvl_chunked_recv_tokens = %d: expected both positive", nvlSend, nvlRecv)
	case nvlSend >= nvlRecv:
		return Config{}, Argf("num_max_nvl_chunked_send_tokens = %d: expected fewer than num_max_nvl_chunked_recv_tokens = %d", nvlSend, nvlRecv)
	case rdmaSend <= 0 || rdmaRecv <= 0:
		return Config{}, Argf("num_max_rdma_chunked_send_tokens = %d, num_max_rdma_chunked_recv_tokens = %d: expected both positive", rdmaSend, rdmaRecv)
	}
	rdmaRecv = (rdmaRecv + rdmaSend - 1) / rdmaSend * rdmaSend
	// The receiver frees RDMA ring slots lazily, so a sender must always find half the ring free.
	if rdmaSend > rdmaRecv/2 {
		return Config{}, Argf("num_max_rdma_chunked_send_tokens = %d: expected at most half of num_max_rdma_chunked_recv_tokens = %d (rounded up to whole chunks)", rdmaSend, rdmaRecv)
	}
	return Config{numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv}, nil
}

// NumChannels is the number of independent token streams: each uses one sending and one
// receiving SM.
func (c Config) NumChannels() int { return c.NumSMs / 2 }

func align(n, a int64) int64 { return (n + a - 1) / a * a }

// NVLBufferSizeHint is the NVLink buffer size that the rings of this config need for tokens of
// hiddenBytes among numRanks ranks; any larger buffer works as well.
func (c Config) NVLBufferSizeHint(hiddenBytes, numRanks int) (int64, error) {
	if _, err := NewTopology(0, numRanks, false); err != nil {
		return 0, err
	}
	if hiddenBytes <= 0 {
		return 0, Argf("hidden_bytes = %d: expected a positive number", hiddenBytes)
	}
	rdmaRanks := int64(max(1, numRanks/NumMaxNVLPeers))
	nvlRanks := int64(min(numRanks, NumMaxNVLPeers))
	slots := int64(c.NumChannels()) * nvlRanks * int64(c.NumMaxNVLChunkedRecvTokens)
	n := int64(c.NumChannels()) * nvlRanks * (2*rdmaRanks + 3) * 4 // ring heads, tails, prefixes
	n += slots * (int64(hiddenBytes) + sourceMetaBytes + MaxTopK*8 + MaxTopK*4 + MaxScales*4)
	return align(n, BufferAlignment), nil
}

// RDMABufferSizeHint is the RDMA buffer size normal mode needs across NVLink domains; zero
// within one domain.
func (c Config) RDMABufferSizeHint(hiddenBytes, numRanks int) (int64, error) {
	if _, err := NewTopology(0, numRanks, false); err != nil {
		return 0, err
	}
	if numRanks <= NumMaxNVLPeers {
		return 0, nil
	}
	if hiddenBytes <= 0 {
		return 0, Argf("hidden_bytes = %d: expected a positive number", hiddenBytes)
	}
	rdmaRanks := int64(numRanks / NumMaxNVLPeers)
	slots := int64(c.NumChannels()) * rdmaRanks * int64(c.NumMaxRDMAChunkedRecvTokens)
	// Send and receive halves, hence every term twice.
	n := int64(c.NumChannels()) * rdmaRanks * (NumMaxNVLPeers*2 + 2) * 2 * 4
	n += slots * (int64(hiddenBytes) + sourceMetaBytes + MaxTopK*8 + MaxTopK*4 + MaxScales*4) * 2
	return align(n, BufferAlignment), nil
}

// tuned maps a group size to DeepEP V1's recommended (nvl send, nvl recv, rdma send, rdma recv).
type tuned struct{ nvlSend, nvlRecv, rdmaSend, rdmaRecv int }

var dispatchTable = map[int]tuned{
	2: {24, 256, 6, 128}, 4: {6, 256, 6, 128}, 8: {6, 256, 6, 128},
	16: {36, 288, 20, 128}, 24: {32, 288, 8, 128}, 32: {32, 288, 8, 128},
	48: {32, 288, 8, 128}, 64: {32, 288, 8, 128}, 96: {20, 480, 12, 128},
	128: {20, 560, 12, 128}, 144: {32, 720, 12, 128}, 160: {28, 720, 12, 128},
}

var combineTable = map[int]tuned{
	2: {10, 256, 6, 128}, 4: {9, 256, 6, 128}, 8: {4, 256, 6, 128},
	16: {4, 288, 12, 128}, 24: {1, 288, 8, 128}, 32: {1, 288, 8, 128},
	48: {1, 288, 8, 128}, 64: {1, 288, 8, 128}, 96: {1, 480, 8, 128},
	128: {1, 560, 8, 128}, 144: {2, 720, 8, 128}, 160: {2, 720, 8, 128},
}

// DefaultDispatchConfig is DeepEP V1's recommended dispatch config for numRanks, with numSMs SMs.
// Group sizes DeepEP has no entry for (1, 3, 5, 6, 7) take the nearest larger domain's entry.
func DefaultDispatchConfig(numRanks, numSMs int) (Config, error) {
	return fromTable("dispatch", dispatchTable, numRanks, numSMs)
}

// DefaultCombineConfig is DeepEP V1's recommended combine config, as DefaultDispatchConfig.
func DefaultCombineConfig(numRanks, numSMs int) (Config, error) {
	return fromTable("combine", combineTable, numRanks, numSMs)
}

func fromTable(kind string, table map[int]tuned, numRanks, numSMs int) (Config, error) {
	key := numRanks
	switch {
	case numRanks == 1 || numRanks == 3:
		key = 4
	case numRanks > 4 && numRanks < 8:
		key = 8
	}
	t, ok := table[key]
	if !ok {
		return Config{}, Argf("num_ranks = %d: no recommended %s config; expected 1-8 or one of DeepEP's sizes (16, 24, 32, 48, 64, 96, 128, 144, 160), or pass config=", numRanks, kind)
	}
	return NewConfig(numSMs, t.nvlSend, t.nvlRecv, t.rdmaSend, t.rdmaRecv)
}
