package goep

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/pyep/pyep/goep/env"
)

// Params are a Buffer's constructor arguments, named as DeepEP's.
type Params struct {
	Rank, NumRanks                  int
	NumNVLBytes, NumRDMABytes       int64
	LowLatencyMode                  bool
	ExplicitlyDestroy, EnableShrink bool
	// UseFabric allocates the NVLink-domain region through the backend's FabricAllocator, if
	// it has one (cuda: cuMem handles instead of CUDA IPC); the cpu backend ignores it.
	UseFabric bool
	// NoNVLinkForLowLatency is allow_nvlink_for_low_latency_mode=False: the cpu backend's
	// low-latency engine reaches every peer, its own node's too, through the remote path
	// (goep/lowlatency's remotePut/remoteSignal), as DeepEP sends everything over RDMA then; the
	// cuda backend's, through NVSHMEM's puts and signals (low_latency_nvshmem.go).
	NoNVLinkForLowLatency bool
	// RanksPerNode makes each RanksPerNode consecutive ranks one node (NVLink domain); 0: what
	// PYEP_RANKS_PER_NODE says when the buffer is made, and unset DeepEP's nodes of 8.
	RanksPerNode int
	// Engines make the buffer's engines where the backend does not (engine.go); zero: the
	// backend's.
	Engines Engines
}

type state int

const (
	created   state = iota // allocated, peers not yet opened
	available              // synced: every peer's region is addressable
	destroyed
)

// UniqueIDBytes is the size of an NVSHMEM unique id (nvshmemx_uniqueid_t).
const UniqueIDBytes = 128

// Buffer owns one rank's communication memory and its view of its NVLink peers.
type Buffer struct {
	mu      sync.Mutex
	params  Params
	topo    Topology
	backend Backend
	state   state

	local        LocalRegion
	peers        []Region // by NVLink rank; peers[NVLRank] is local
	rdma         RDMARegion
	rootUniqueID []byte

	// The dispatch whose notify ran and whose data phase waits for recv tensors of pendingRows
	// rows (DispatchRecv); under mu.
	pending     *DispatchOp
	pendingRows int
	// The layer's next dispatch and combine, as the calls before them planned them (normal_plan.go);
	// under mu.
	plans plans

	// The engines of the modes this buffer ran (engine.go), in the order they were made; Destroy
	// closes them before the memory. Low-latency and internode engines are siblings of normal.
	engines []Engine
	normal  NormalEngine

	// Low-latency mode's shared RDMA region and engine (low_latency_mode.go); nil outside it.
	ll *lowLatency
}

// NewBuffer validates p as DeepEP's Buffer constructor does and allocates the local NVLink-domain
// region (when NumNVLBytes > 0) and the RDMA region (when NumRDMABytes > 0) through backend.
func NewBuffer(p Params, backend Backend) (*Buffer, error) {
	if p.RanksPerNode == 0 {
		k, err := env.NodeSize()
		if err != nil {
			return nil, &ArgumentError{msg: err.Error()}
		}
		p.RanksPerNode = k
	}
	topo, err := NewNodeTopology(p.Rank, p.NumRanks, p.RanksPerNode, p.LowLatencyMode)
	if err != nil {
		return nil, err
	}
	switch {
	case p.NumNVLBytes < 0 || p.NumNVLBytes%BufferAlignment != 0:
		return nil, Argf("num_nvl_bytes = %d: expected a non-negative multiple of %d", p.NumNVLBytes, BufferAlignment)
	case p.NumRDMABytes < 0 || p.NumRDMABytes%BufferAlignment != 0:
		return nil, Argf("num_rdma_bytes = %d: expected a non-negative multiple of %d", p.NumRDMABytes, BufferAlignment)
	case p.NumNVLBytes > math.MaxInt32 && p.NumRDMABytes > 0:
		return nil, Argf("num_nvl_bytes = %d: expected at most %d when num_rdma_bytes > 0 (internode offsets are 32-bit)", p.NumNVLBytes, math.MaxInt32)
	case p.NumRDMABytes > math.MaxInt32 && !p.LowLatencyMode:
		return nil, Argf("num_rdma_bytes = %d: expected at most %d outside low-latency mode", p.NumRDMABytes, math.MaxInt32)
	case p.NumRDMABytes > 0 && !(topo.NumRDMARanks > 1 || p.LowLatencyMode):
		node := NumMaxNVLPeers
		if p.RanksPerNode != 0 {
			node = p.RanksPerNode
		}
		return nil, Argf("num_rdma_bytes = %d: an RDMA buffer needs more than %d ranks (more than one node) or low_latency_mode=True",
			p.NumRDMABytes, node)
	case p.EnableShrink && !p.LowLatencyMode:
		// DeepEP allocates the rank mask of shrink mode with low-latency mode's buffers only.
		return nil, Argf("enable_shrink=True: shrink mode masks ranks in low-latency mode; expected low_latency_mode=True")
	case backend == nil:
		return nil, errors.New("no backend")
	}
	b := &Buffer{params: p, topo: topo, backend: backend, peers: make([]Region, topo.NumNVLRanks)}
	if p.NumNVLBytes > 0 {
		allocate := backend.Allocate
		if fa, ok := backend.(FabricAllocator); ok && p.UseFabric {
			allocate = fa.AllocateFabric
		}
		if b.local, err = allocate(p.NumNVLBytes, topo.NumNVLRanks-1); err != nil {
			return nil, fmt.Errorf("rank %d: allocate %d NVLink-buffer bytes on %s: %w", p.Rank, p.NumNVLBytes, backend.Name(), err)
		}
		b.peers[topo.NVLRank] = b.local
	}
	if p.NumRDMABytes > 0 {
		if b.rdma, err = b.allocateRDMA(); err != nil {
			if b.local != nil {
				_ = b.local.Close()
			}
			return nil, fmt.Errorf("rank %d: allocate %d RDMA-buffer bytes on %s: %w", p.Rank, p.NumRDMABytes, backend.Name(), err)
		}
	}
	return b, nil
}

// Topology is the rank arithmetic of this buffer.
func (b *Buffer) Topology() Topology { return b.topo }

// Backend is the backend that owns this buffer's memory.
func (b *Buffer) Backend() Backend { return b.backend }

// LocalDeviceID is the device of this rank's memory (-1 for host memory).
func (b *Buffer) LocalDeviceID() int { return b.backend.DeviceID() }

// LocalIPCHandle is what every peer needs to open this rank's NVLink-domain region; empty when
// there is none (num_nvl_bytes = 0).
func (b *Buffer) LocalIPCHandle() ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == destroyed {
		return nil, errDestroyed
	}
	if b.local == nil && b.ll == nil {
		return nil, nil
	}
	return b.localHandle(), nil
}

func (b *Buffer) localHandle() []byte {
	h := Handle{Backend: b.backend.Name(), Rank: b.topo.Rank, NumRanks: b.topo.NumRanks}
	if b.local != nil {
		h.Size, h.Token = b.params.NumNVLBytes, b.local.Token()
	} else if dt, ok := b.backend.(DeviceTokens); ok {
		h.Token = dt.DeviceToken() // Size 0: nothing to map, only the GPU
	}
	if b.ll != nil {
		// Over NVSHMEM the region is made at sync (no token yet), but the size is still checked.
		h.RDMASize = b.params.NumRDMABytes
		if b.ll.local != nil {
			h.RDMAToken = b.ll.local.Token()
		}
	}
	return h.Encode()
}

// LocalNVSHMEMUniqueID makes a fresh unique id for the root rank to share: NVSHMEM's where the
// buffer bootstraps NVSHMEM at sync (a device buffer in low-latency mode across nodes), else
// random bytes that only identify the group (the cpu backend has no NVSHMEM).
func (b *Buffer) LocalNVSHMEMUniqueID() ([]byte, error) {
	return b.nvshmemUniqueID()
}

var (
	errDestroyed = errors.New("the buffer was destroyed")
	errNotSynced = errors.New("the buffer is not synced with its peers yet (Buffer.__init__ calls sync)")
)

// Sync opens every NVLink peer's region from the all-gathered device ids and handles (a nil
// handle is one a rank did not provide) and keeps the root unique id. On error, every peer
// opened so far is closed again and the buffer stays unsynced, so sync may be retried.
func (b *Buffer) Sync(deviceIDs []int, handles [][]byte, rootUniqueID []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state {
	case destroyed:
		return fmt.Errorf("sync rank %d: %w", b.topo.Rank, errDestroyed)
	case available:
		return fmt.Errorf("sync rank %d: already synced; a buffer syncs once", b.topo.Rank)
	}
	if b.local != nil {
		if err := b.openPeers(deviceIDs, handles); err != nil {
			b.closePeers()
			return fmt.Errorf("sync rank %d: %w", b.topo.Rank, err)
		}
	}
	if b.topo.NumRDMARanks > 1 || b.params.LowLatencyMode {
		if len(rootUniqueID) != UniqueIDBytes {
			b.closePeers()
			return Argf("sync rank %d: root_unique_id has %d bytes: expected the %d of get_local_nvshmem_unique_id()", b.topo.Rank, len(rootUniqueID), UniqueIDBytes)
		}
	}
	if err := b.openLowLatency(handles, rootUniqueID); err != nil {
		b.closePeers()
		b.closeLowLatencyPeers()
		return fmt.Errorf("sync rank %d: %w", b.topo.Rank, err)
	}
	if b.topo.NumRDMARanks > 1 || b.params.LowLatencyMode {
		b.rootUniqueID = bytes.Clone(rootUniqueID)
	}
	b.state = available
	return nil
}

func (b *Buffer) openPeers(deviceIDs []int, handles [][]byte) error {
	t := b.topo
	if len(deviceIDs) != t.NumRanks {
		return Argf("device_ids has %d entries: expected num_ranks = %d", len(deviceIDs), t.NumRanks)
	}
	if len(handles) != t.NumRanks {
		return Argf("ipc_handles has %d entries: expected num_ranks = %d", len(handles), t.NumRanks)
	}
	// Check every handle before opening any, so that a wrong list fails without side effects.
	if own := t.DomainRank(t.NVLRank); handles[own] == nil {
		return Argf("ipc_handles[%d] is missing: every rank of the NVLink domain must provide its handle", own)
	} else if !bytes.Equal(handles[own], b.localHandle()) {
		return Argf("ipc_handles[%d] is not this rank's own handle: the handles belong to another buffer or are out of order", own)
	}
	peers := make([]Handle, t.NumNVLRanks)
	for nvl := range peers {
		r := t.DomainRank(nvl)
		if nvl == t.NVLRank {
			continue
		}
		if handles[r] == nil {
			return Argf("ipc_handles[%d] is missing: every rank of the NVLink domain must provide its handle", r)
		}
		h, err := DecodeHandle(handles[r])
		if err == nil {
			err = b.checkPeerHandle(r, h)
		}
		if err != nil {
			return Argf("ipc_handles[%d]: %v", r, err)
		}
		peers[nvl] = h
	}
	if pc, ok := b.backend.(PeerChecker); ok {
		ranks := make([]int, t.NumNVLRanks)
		tokens := make([][]byte, t.NumNVLRanks)
		for nvl := range ranks {
			ranks[nvl], tokens[nvl] = t.DomainRank(nvl), peers[nvl].Token
		}
		tokens[t.NVLRank] = b.local.Token()
		if err := pc.CheckPeers(t.NVLRank, ranks, tokens); err != nil {
			return err
		}
	}
	for nvl, h := range peers {
		if nvl == t.NVLRank {
			continue
		}
		region, err := b.backend.Open(h.Token, h.Size)
		if err != nil {
			return fmt.Errorf("open peer %d's buffer: %w", t.DomainRank(nvl), err)
		}
		b.peers[nvl] = region
	}
	return nil
}

func (b *Buffer) checkPeerHandle(r int, h Handle) error {
	switch {
	case h.Backend != b.backend.Name():
		return fmt.Errorf("made by the %s backend: expected %s (all ranks must use the same device type)", h.Backend, b.backend.Name())
	case h.Rank != r || h.NumRanks != b.topo.NumRanks:
		return fmt.Errorf("made by rank %d of %d: expected rank %d of %d (a handle of another buffer or group)", h.Rank, h.NumRanks, r, b.topo.NumRanks)
	case h.Size != b.params.NumNVLBytes:
		return fmt.Errorf("peer buffer has %d bytes: expected num_nvl_bytes = %d on every rank", h.Size, b.params.NumNVLBytes)
	}
	return nil
}

// closePeers unmaps every peer region, keeping the local one.
func (b *Buffer) closePeers() {
	for i, p := range b.peers {
		if p != nil && i != b.topo.NVLRank {
			_ = p.Close()
			b.peers[i] = nil
		}
	}
}

// IsAvailable reports whether the buffer is synced and not destroyed.
func (b *Buffer) IsAvailable() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state == available
}

// Destroy releases the peers' mappings, then this rank's own memory. Idempotent: a second call
// returns nil.
//
// On cpu no barrier with peers is needed before freeing: a peer's mapping of this rank's region
// keeps the memory alive until that peer unmaps it. On cuda the backend waits (bounded by its
// timeout) until every peer has released its mapping, so destroy is collective there.
func (b *Buffer) Destroy() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == destroyed {
		return nil
	}
	b.state = destroyed
	var failed error // a peer that failed the NVSHMEM engine: its region is abandoned, not freed
	if b.ll != nil && b.ll.nvshmem && b.rdma != nil {
		if f, ok := b.ll.device.(PeerFailures); ok {
			failed = f.PeerFailure()
		}
	}
	// The engines first: their kernels use the memory.
	errs := []error{b.closeEngines()}
	b.closePeers()
	b.closeLowLatencyPeers()
	if b.ll != nil && b.ll.nvshmem && b.rdma != nil {
		// NVSHMEM's region, kernels and group go first (collective: every rank destroys).
		errs = append(errs, b.closeSymmetric(failed))
	}
	if b.local != nil {
		errs = append(errs, b.local.Close())
		b.peers[b.topo.NVLRank] = nil
	}
	if b.rdma != nil {
		errs = append(errs, b.rdma.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("destroy rank %d: %w", b.topo.Rank, err)
	}
	return nil
}

// LocalData returns this rank's NVLink (or RDMA) data region and its size, for tensors over it.
func (b *Buffer) LocalData(rdma bool) (unsafe.Pointer, int64, error) {
	return b.PeerData(b.topo.NVLRank, rdma)
}

// noRDMABuffer says why a buffer has no RDMA region to view (b.mu held): none was asked for,
// or, over NVSHMEM, it is made at sync and was not (not synced yet, or NVSHMEM cannot run).
func (b *Buffer) noRDMABuffer() error {
	const op = "use_rdma_buffer=True"
	switch {
	case b.ll == nil || !b.ll.nvshmem:
		return errors.New(op + ": this buffer has no RDMA buffer (num_rdma_bytes = 0)")
	case b.state != available:
		return fmt.Errorf("%s: %w", op, errNotSynced)
	case b.ll.unavailable != nil:
		return b.nvshmemUnavailable(op)
	}
	return fmt.Errorf("%s: low-latency mode is not available on the %s backend with %d ranks", op, b.backend.Name(), b.topo.NumRanks)
}

// PeerData returns NVLink peer nvlRank's data region as mapped here (RDMA: only the local one).
func (b *Buffer) PeerData(nvlRank int, rdma bool) (unsafe.Pointer, int64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == destroyed {
		return nil, 0, errDestroyed
	}
	if rdma {
		if nvlRank != b.topo.NVLRank {
			return nil, 0, errors.New("use_rdma_buffer: only the local RDMA buffer is addressable")
		}
		if b.rdma == nil {
			return nil, 0, b.noRDMABuffer()
		}
		return b.rdma.Data(), b.params.NumRDMABytes, nil
	}
	if nvlRank < 0 || nvlRank >= b.topo.NumNVLRanks {
		return nil, 0, Argf("nvl_rank = %d: expected 0 <= nvl_rank < %d", nvlRank, b.topo.NumNVLRanks)
	}
	if b.local == nil {
		return nil, 0, errors.New("this buffer has no NVLink buffer (num_nvl_bytes = 0)")
	}
	if nvlRank != b.topo.NVLRank && b.state != available {
		return nil, 0, errNotSynced
	}
	return b.peers[nvlRank].Data(), b.params.NumNVLBytes, nil
}

// Peers returns every NVLink peer's region (index = NVLink rank) of a synced buffer; operations
// hold the returned slice only for the duration of one call.
func (b *Buffer) Peers() ([]Region, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.state == destroyed:
		return nil, errDestroyed
	case b.state != available:
		return nil, errNotSynced
	case b.local == nil:
		return nil, errors.New("this buffer has no NVLink buffer: pass num_nvl_bytes > 0 (see Config.get_nvl_buffer_size_hint)")
	}
	return b.peers, nil
}
