package goep

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"unsafe"
)

// Low-latency mode across nodes on a device backend (DeepEP's design): the region lives in
// NVSHMEM's symmetric heap, which sync sets up from the root unique id it already exchanges,
// sized for num_rdma_bytes. A peer that NVSHMEM maps here (same node, P2P) is written through its
// pointer, as within one node; any other (another node, or every peer with
// allow_nvlink_for_low_latency_mode=False) through NVSHMEM's puts and signals, the remote path of
// the kernels (kernels/remote.cuh). Destroy frees the region; NVSHMEM's group stays for the
// process's next such buffer (a process joins one group once: goep/cuda's symmetric.go). Without
// NVSHMEM the buffer still syncs, and its low-latency calls raise NotAvailableError saying why.

// SymmetricBackend is a device backend that runs low-latency mode across nodes over NVSHMEM.
type SymmetricBackend interface {
	// NVSHMEMUniqueID is a fresh NVSHMEM unique id (nvshmemx_get_uniqueid), for the root rank.
	NVSHMEMUniqueID() ([]byte, error)
	// OpenSymmetric joins the group of root's unique id as PE rank of numRanks (unless this
	// process is in it already) and allocates a zeroed region of numBytes in the symmetric heap;
	// collective. A NotAvailableError says that NVSHMEM cannot run here.
	OpenSymmetric(root []byte, rank, numRanks int, numBytes int64) (SymmetricRegion, error)
}

// SymmetricRegion is a low-latency region in the symmetric heap.
type SymmetricRegion interface {
	RDMARegion
	// Peer is PE p's region as mapped here (nvshmem_ptr), nil where only puts reach it.
	Peer(p int) unsafe.Pointer
	// Abandon is Close where a peer failed (cause): the region is not freed, since
	// nvshmem_free is collective and the peer would never join it; the error says that this
	// process's NVSHMEM is left unusable.
	Abandon(cause error) error
}

// PeerFailures is a device low-latency engine that can tell, once the device is idle, whether a
// peer failed it (timed out): destroy then abandons the NVSHMEM region instead of freeing it.
type PeerFailures interface {
	PeerFailure() error
}

// closeSymmetric releases an NVSHMEM buffer's region: freed (collective), or abandoned where the
// engine saw a peer fail (cause, read before the engine closed).
func (b *Buffer) closeSymmetric(cause error) error {
	r := b.rdma.(SymmetricRegion)
	b.rdma = nil
	if cause != nil {
		return r.Abandon(cause)
	}
	return r.Close()
}

// usesNVSHMEM: a device buffer in low-latency mode whose peers are not all reached by pointers
// in one node: its region is allocated at sync, in NVSHMEM's symmetric heap.
func (b *Buffer) usesNVSHMEM() bool {
	p := b.params
	return p.LowLatencyMode && p.NumRDMABytes > 0 && b.backend.DeviceID() >= 0 &&
		(b.topo.NumRDMARanks > 1 || p.NoNVLinkForLowLatency)
}

// nvshmemUniqueID is the root rank's unique id: NVSHMEM's where the buffer needs it and the
// backend has it, else random bytes (a buffer that does not run NVSHMEM only checks the size).
func (b *Buffer) nvshmemUniqueID() ([]byte, error) {
	if sb, ok := b.backend.(SymmetricBackend); ok && b.usesNVSHMEM() {
		id, err := sb.NVSHMEMUniqueID()
		if !IsNotAvailable(err) {
			return id, err
		}
		// No NVSHMEM here: sync says so again, and the calls raise it.
	}
	id := make([]byte, UniqueIDBytes)
	if _, err := rand.Read(id); err != nil {
		return nil, err
	}
	return id, nil
}

// openSymmetric is openLowLatency for a buffer that uses NVSHMEM: it bootstraps NVSHMEM from
// root, allocates the region, and makes the engine over the peers NVSHMEM maps and the rest
// reached by puts. NVSHMEM missing is no error here: ll.unavailable keeps it for the calls.
func (b *Buffer) openSymmetric(handles [][]byte, root []byte) error {
	ll, t := b.ll, b.topo
	sb, ok := b.backend.(SymmetricBackend)
	if !ok {
		ll.unavailable = NotAvailablef("the %s backend has no NVSHMEM", b.backend.Name())
		return nil
	}
	maker := b.lowLatencyMaker()
	if maker == nil {
		return nil // no device engine: the calls say the mode is not available
	}
	if err := b.sameRDMABytes(handles); err != nil {
		return err
	}
	region, err := sb.OpenSymmetric(root, t.Rank, t.NumRanks, b.params.NumRDMABytes)
	if IsNotAvailable(err) {
		ll.unavailable = err
		return nil
	}
	if err != nil {
		return err
	}
	remote := b.remotePeers()
	if remote == nil {
		remote = make([]bool, t.NumRanks)
	}
	regions, remote := symmetricPeers(t.Rank, region, remote)
	env := EngineEnv{Backend: b.backend, Topo: t, NumNVLBytes: b.params.NumNVLBytes, Remote: remote}
	d, err := maker(env, regions, b.params.NumRDMABytes, b.nvlTokens(handles))
	if err != nil {
		return fmt.Errorf("low-latency engine over NVSHMEM: %w", errors.Join(err, region.Close()))
	}
	d.SetTimeout(ll.timeout)
	ll.device, b.rdma = d, region
	return nil
}

// sameRDMABytes checks, before NVSHMEM's collective allocation (whose sizes must agree), that
// every rank whose handle is given made its buffer with this rank's num_rdma_bytes. Every rank
// sees a difference, so none enters the allocation.
func (b *Buffer) sameRDMABytes(handles [][]byte) error {
	for r, raw := range handles {
		if r == b.topo.Rank || raw == nil {
			continue
		}
		h, err := DecodeHandle(raw)
		if err != nil || h.Rank != r {
			return Argf("ipc_handles[%d]: not rank %d's get_local_ipc_handle() of this group's buffers", r, r)
		}
		if h.RDMASize != b.params.NumRDMABytes {
			return Argf("ipc_handles[%d]: rank %d made its buffer with num_rdma_bytes = %d, this rank with %d: expected "+
				"the same num_rdma_bytes on every rank (NVSHMEM allocates the region on all of them at once)", r, r,
				h.RDMASize, b.params.NumRDMABytes)
		}
	}
	return nil
}

// nvshmemUnavailable is op's error on a buffer that needs NVSHMEM where it cannot run: what
// made it need NVSHMEM (nodes, allow_nvlink_for_low_latency_mode=False), why NVSHMEM cannot run,
// and the settings that would do without it.
func (b *Buffer) nvshmemUnavailable(op string) error {
	t, noNVLink := b.topo, b.params.NoNVLinkForLowLatency
	var mode, hint string
	if t.NumRDMARanks == 1 {
		// One node: only allow_nvlink_for_low_latency_mode=False sends through NVSHMEM.
		mode = fmt.Sprintf("low-latency mode with allow_nvlink_for_low_latency_mode=False (%d ranks on one node, every "+
			"peer through NVSHMEM)", t.NumRanks)
		hint = "; pass allow_nvlink_for_low_latency_mode=True to run it on one node without NVSHMEM"
	} else {
		mode = fmt.Sprintf("low-latency mode across nodes (%d ranks, %d nodes of %d)", t.NumRanks, t.NumRDMARanks, t.NumNVLRanks)
		hint = t.nodesHint()
		if noNVLink {
			mode += " with allow_nvlink_for_low_latency_mode=False"
			if hint != "" && t.NumRanks <= NumMaxNVLPeers {
				hint += ", with allow_nvlink_for_low_latency_mode=True"
			}
		}
	}
	return NotAvailablef("%s: %s on the %s backend needs NVSHMEM (%v)%s", op, mode, b.backend.Name(), b.ll.unavailable, hint)
}

// nvlTokens are the ranks' NVLink-buffer tokens from handles, where they have one, which tell
// the engine the ranks that share this GPU (nil entries otherwise).
func (b *Buffer) nvlTokens(handles [][]byte) [][]byte {
	tokens := make([][]byte, b.topo.NumRanks)
	for r, raw := range handles {
		if r >= len(tokens) || raw == nil {
			continue
		}
		if r == b.topo.Rank && b.local != nil && bytes.Equal(raw, b.localHandle()) {
			tokens[r] = b.local.Token()
		} else if h, err := DecodeHandle(raw); err == nil && h.Rank == r {
			tokens[r] = h.Token
		}
	}
	return tokens
}

// symmetricPeers is the engine's view of every rank: this rank's region, a peer's as NVSHMEM maps
// it where it is not remote, and the remote flags (remote where the topology says, or where
// NVSHMEM maps nothing).
func symmetricPeers(rank int, region SymmetricRegion, remote []bool) ([]unsafe.Pointer, []bool) {
	n := len(remote)
	regions := make([]unsafe.Pointer, n)
	flags := make([]bool, n)
	for p := range n {
		switch {
		case p == rank:
			regions[p] = region.Data()
		case remote[p]:
			flags[p] = true
		default:
			if regions[p] = region.Peer(p); regions[p] == nil {
				flags[p] = true
			}
		}
	}
	return regions, flags
}
