package goep

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

type fakeSymmetric struct {
	base   []byte
	mapped map[int]bool // peers NVSHMEM maps here
}

func (f *fakeSymmetric) Data() unsafe.Pointer { return unsafe.Pointer(&f.base[0]) }
func (f *fakeSymmetric) Close() error         { return nil }
func (f *fakeSymmetric) Abandon(error) error  { return nil }
func (f *fakeSymmetric) Peer(p int) unsafe.Pointer {
	if f.mapped[p] {
		return unsafe.Pointer(&f.base[p])
	}
	return nil
}

// The engine's view over NVSHMEM: this rank's own region, the peers of its node by NVSHMEM's
// mapping, and remote flags for the other nodes' and for any peer NVSHMEM cannot map.
func TestSymmetricPeers(t *testing.T) {
	r := &fakeSymmetric{base: make([]byte, 8), mapped: map[int]bool{1: true, 2: true}}
	// 4 ranks, nodes of 2, rank 0: rank 1 is in its node, 2 and 3 are not (2 is mapped but remote).
	regions, remote := symmetricPeers(0, r, []bool{false, false, true, true})
	assert.Equal(t, []bool{false, false, true, true}, remote)
	assert.Equal(t, r.Data(), regions[0])
	assert.Equal(t, unsafe.Pointer(&r.base[1]), regions[1])
	assert.Nil(t, regions[2])
	assert.Nil(t, regions[3])
	// A same-node peer that NVSHMEM does not map (no P2P) is reached by puts.
	r.mapped = map[int]bool{}
	_, remote = symmetricPeers(0, r, []bool{false, false, true, true})
	assert.Equal(t, []bool{false, true, true, true}, remote)
}

// Which buffers bootstrap NVSHMEM: a device buffer in low-latency mode whose group spans nodes,
// or with allow_nvlink_for_low_latency_mode=False; never the cpu backend or one node.
func TestUsesNVSHMEM(t *testing.T) {
	for _, c := range []struct {
		device, ll, noNVLink bool
		perNode, ranks       int
		rdma                 int64
		want                 bool
	}{
		{device: true, ll: true, perNode: 1, ranks: 2, rdma: 1 << 20, want: true},
		{device: true, ll: true, perNode: 2, ranks: 4, rdma: 1 << 20, want: true},
		{device: true, ll: true, perNode: 0, ranks: 4, rdma: 1 << 20, want: false},
		{device: true, ll: true, perNode: 0, ranks: 4, rdma: 1 << 20, noNVLink: true, want: true},
		{device: true, ll: false, perNode: 1, ranks: 2, rdma: 1 << 20, want: false},
		{device: true, ll: true, perNode: 1, ranks: 2, rdma: 0, want: false},
		{device: false, ll: true, perNode: 1, ranks: 2, rdma: 1 << 20, want: false},
	} {
		topo, err := NewNodeTopology(0, c.ranks, c.perNode, c.ll)
		assert.NoError(t, err)
		dev := -1
		if c.device {
			dev = 0
		}
		b := &Buffer{topo: topo, backend: deviceBackend{id: dev}, params: Params{LowLatencyMode: c.ll, NumRDMABytes: c.rdma,
			NoNVLinkForLowLatency: c.noNVLink}}
		assert.Equal(t, c.want, b.usesNVSHMEM(), "%+v", c)
	}
}

// deviceBackend is a Backend of which only DeviceID answers.
type deviceBackend struct {
	Backend
	id int
}

func (d deviceBackend) DeviceID() int { return d.id }
