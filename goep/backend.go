package goep

import (
	"unsafe"

	"github.com/pyep/pyep/goep/normal"
)

// ControlBytes is the control region in front of every NVLink-domain data region: barrier
// signals and the counters of the normal-mode rings' handshakes. It is zeroed at allocation.
const ControlBytes = normal.ControlBytes

// Region is memory of the NVLink domain that this process can address: its own, or a peer's
// after Backend.Open.
type Region interface {
	// Control is ControlBytes of zeroed control memory; Data is the user-visible buffer.
	Control() unsafe.Pointer
	Data() unsafe.Pointer
	// Close releases this process's mapping (or, for its own region, the memory); idempotent.
	Close() error
}

// LocalRegion is this rank's own NVLink-domain region.
type LocalRegion interface {
	Region
	// Token is what a peer passes to Backend.Open to map this region.
	Token() []byte
}

// Backend owns memory and its sharing between the ranks of one NVLink domain.
type Backend interface {
	// Name identifies the backend in handles ("cpu", "cuda"); ranks must all use the same one.
	Name() string
	// DeviceID is the device the memory lives on (-1 for host memory).
	DeviceID() int
	// Allocate makes this rank's region with size data bytes, to be opened by numPeers peers.
	Allocate(size int64, numPeers int) (LocalRegion, error)
	// Open maps a peer's region from its token; size is the data size every rank allocated.
	Open(token []byte, size int64) (Region, error)
	// AllocateRDMA makes the RDMA (NVSHMEM-heap) buffer of size bytes, zeroed.
	AllocateRDMA(size int64) (RDMARegion, error)
}

// FabricAllocator is an optional Backend method: goep.Buffer allocates its NVLink-domain region
// with AllocateFabric instead of Allocate when Params.UseFabric is set (DeepEP's use_fabric).
// The cuda backend then shares the memory through cuMem handles (fabric, or POSIX file
// descriptors) instead of CUDA IPC. Backends without it (cpu) ignore use_fabric.
type FabricAllocator interface {
	AllocateFabric(size int64, numPeers int) (LocalRegion, error)
}

// RDMARegion is the RDMA buffer.
type RDMARegion interface {
	Data() unsafe.Pointer
	Close() error
}

// DeviceTokens is a device backend whose buffers without an NVLink region still tell their peers
// which GPU they run on: the token goes in the handle's Token (nothing maps it), so that a
// low-latency engine across nodes learns which ranks share its GPU.
type DeviceTokens interface {
	DeviceToken() []byte
}

// PeerChecker is an optional Backend method that Buffer.Sync calls before opening any peer:
// tokens[i] is NVLink rank i's token (tokens[nvlRank] this rank's own), ranks their group ranks.
// The cuda backend checks there that every pair of GPUs is joined by NVLink.
type PeerChecker interface {
	CheckPeers(nvlRank int, ranks []int, tokens [][]byte) error
}
