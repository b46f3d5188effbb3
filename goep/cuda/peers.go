package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// Peers' regions: CheckPeers' topology check, Open, and the RDMA buffer.

// CheckPeers is called by goep.Buffer.Sync before it opens any peer: tokens are the regions of
// every rank of the NVLink domain (index = NVLink rank; tokens[nvlRank] is this rank's own,
// made by this Backend) and ranks their group ranks. It checks that all of them live on this
// host, on distinct GPUs connected pairwise by NVLink, and tells the Backend which header slot
// each rank writes, for the release handshake of Destroy. Every rank runs the same check, so
// they all fail alike.
func (b *Backend) CheckPeers(nvlRank int, ranks []int, tokens [][]byte) error {
	n := len(tokens)
	switch {
	case len(ranks) != n:
		return fmt.Errorf("pyep: cuda: %d ranks for %d tokens", len(ranks), n)
	case nvlRank < 0 || nvlRank >= n:
		return fmt.Errorf("pyep: cuda: NVLink rank %d of %d", nvlRank, n)
	case n > maxSlots:
		return fmt.Errorf("pyep: cuda: NVLink domain of %d ranks: at most %d supported", n, maxSlots)
	}
	if err := b.usable(); err != nil {
		return err
	}
	b.mu.Lock()
	var own *localRegion
	for l := range b.locals {
		if bytes.Equal(l.tok, tokens[nvlRank]) {
			own = l
		}
	}
	b.mu.Unlock()
	if own == nil {
		return fmt.Errorf("pyep: cuda: the token of NVLink rank %d (this rank) is not a live buffer of this backend", nvlRank)
	}
	gpus := make([]peerGPU, n)
	procs := make([]string, n)
	for i, raw := range tokens {
		for j := range i {
			if bytes.Equal(tokens[j], raw) {
				return fmt.Errorf("rank %d and rank %d gave the same buffer handle: every rank must make its own Buffer", ranks[j], ranks[i])
			}
		}
		t, err := decodeToken(raw)
		if err != nil {
			return fmt.Errorf("rank %d's buffer: %w", ranks[i], err)
		}
		if t.Host != b.host {
			return fmt.Errorf("rank %d's buffer is on another host than rank %d's: %s", ranks[i], ranks[nvlRank], oneHost(t.Kind))
		}
		gpus[i] = peerGPU{fmt.Sprintf("rank %d", ranks[i]), t.BusID}
		procs[i] = t.Process
	}
	b.linksMu.Lock()
	err := checkNVLink(b.probe, gpus, b.links)
	b.linksMu.Unlock()
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	own.self, own.ranks, own.peerTokens = nvlRank, append([]int(nil), ranks...), nil
	own.procs = procs
	for i, raw := range tokens {
		if i != nvlRank {
			b.slots[string(raw)] = nvlRank
			b.checked[string(raw)] = true
			own.peerTokens = append(own.peerTokens, string(raw))
		}
	}
	return nil
}

// oneHost says why a peer's buffer on another host is refused.
func oneHost(k memKind) string {
	if k == kindIPC {
		return "CUDA IPC shares memory within one host only"
	}
	return "pyep's cuda backend shares NVLink buffers within one host only (multi-node NVLink is not implemented)"
}

// peerRegion is a peer's allocation mapped here.
type peerRegion struct {
	region
	kind   memKind
	mem    vmem // kindFD, kindFabric: the imported handle and its mapping
	slot   int  // this rank's slot in the peer's header; -1: no handshake
	closed bool // guarded by b.mu
}

// Open implements goep.Backend: it maps a peer's region (cuIpcOpenMemHandle, peer access
// enabled lazily; or the imported cuMem handle, made accessible to this GPU), checks its
// header against the token, and marks the mapping in the peer's header. Without a CheckPeers
// for this token, it checks the NVLink pair itself.
func (b *Backend) Open(raw []byte, size int64) (goep.Region, error) {
	t, err := decodeToken(raw)
	switch {
	case err != nil:
		return nil, err
	case t.Kind == kindDevice:
		return nil, errors.New("the peer's handle names its GPU only: it has no NVLink buffer (num_nvl_bytes = 0 there)")
	case t.Size != size:
		return nil, fmt.Errorf("the peer's buffer has %d bytes: expected %d", t.Size, size)
	case t.Host != b.host:
		return nil, errors.New("the peer's buffer is on another host: " + oneHost(t.Kind))
	case t.Process == b.process:
		return nil, errors.New("the buffer was made by this process: CUDA IPC maps other processes' memory only (one rank per process)")
	}
	if err := b.usable(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	slot, ok := b.slots[string(raw)]
	if !ok {
		slot = -1
	}
	checked := b.checked[string(raw)]
	b.mu.Unlock()
	if !checked {
		b.linksMu.Lock()
		err := checkNVLink(b.probe, []peerGPU{{"this rank", b.busID}, {"the peer", t.BusID}}, b.links)
		b.linksMu.Unlock()
		if err != nil {
			return nil, err
		}
	}
	fd := -1
	if t.Kind == kindFD {
		// Before Enter: this waits for the owner (bounded by Timeout) on an unlocked thread.
		if fd, err = receiveFD(t.Socket, t.Nonce, t.Process, b.timeout); err != nil {
			return nil, err
		}
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		if fd >= 0 {
			_ = closeFD(fd)
		}
		return nil, err
	}
	r := &peerRegion{region: region{b: b, size: size}, kind: t.Kind, slot: slot}
	if t.Kind == kindIPC {
		r.base, err = b.drv.IpcOpenMemHandle(t.IPC)
	} else {
		err = b.importVMM(&r.mem, t, fd)
		r.base = r.mem.base
	}
	if err != nil {
		return nil, err
	}
	p := r.base
	var hdr [16]byte
	err = b.copyOut(hdr[:], p)
	if err == nil && (string(hdr[:8]) != headerMagic || binary.LittleEndian.Uint64(hdr[8:]) != t.Nonce) {
		err = errors.New("the handle's buffer no longer exists (it was destroyed and its memory reused): the handles are stale")
	}
	if err == nil && slot >= 0 {
		err = b.copyIn(p.Add(slotsOffset+4*slot), le32(slotMapped))
	}
	if err != nil {
		_ = r.unmap()
		return nil, err
	}
	return r, nil
}

// unmap undoes Open's mapping; the context must be current.
func (r *peerRegion) unmap() error {
	if r.kind == kindIPC {
		return r.b.drv.IpcCloseMemHandle(r.base)
	}
	return r.b.releaseVMM(&r.mem)
}

// Close implements goep.Region: see Backend for the handshake.
func (r *peerRegion) Close() error {
	b := r.b
	b.mu.Lock()
	if r.closed {
		b.mu.Unlock()
		return nil
	}
	r.closed = true
	b.mu.Unlock()
	if err := b.SyncDevice(b.timeout); err != nil {
		return fmt.Errorf("pyep: cuda: unmapping a peer's buffer: %w; the mapping is kept", err)
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	var errs []error
	if r.slot >= 0 {
		errs = append(errs, b.copyIn(r.base.Add(slotsOffset+4*r.slot), le32(slotReleased)))
	}
	errs = append(errs, r.unmap())
	return errors.Join(errs...)
}

func le32(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }

// rdmaRegion is the RDMA buffer: plain device memory until NVSHMEM comes.
type rdmaRegion struct {
	b      *Backend
	base   driver.DevicePtr
	closed bool
}

func (r *rdmaRegion) Data() unsafe.Pointer { return devicePointer(r.base) }

// Close frees the memory once the GPU's work is done (bounded by Timeout; on timeout the
// memory is kept).
func (r *rdmaRegion) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	if err := r.b.SyncDevice(r.b.timeout); err != nil {
		return fmt.Errorf("pyep: cuda: freeing the RDMA buffer: %w; its memory is kept", err)
	}
	exit, err := r.b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	return r.b.drv.MemFree(r.base)
}

// AllocateRDMA implements goep.Backend: zeroed device memory.
func (b *Backend) AllocateRDMA(size int64) (goep.RDMARegion, error) {
	if size <= 0 || size != int64(int(size)) {
		return nil, fmt.Errorf("num_rdma_bytes = %d: out of range for this process", size)
	}
	if err := b.usable(); err != nil {
		return nil, err
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return nil, err
	}
	p, err := b.drv.MemAlloc(int(size))
	if err != nil {
		return nil, err
	}
	b.ctrlMu.Lock()
	err = b.drv.MemsetD8Async(p, 0, int(size), b.ctrl)
	if err == nil {
		err = b.waitCtrlLocked()
	}
	b.ctrlMu.Unlock()
	if err != nil {
		_ = b.drv.MemFree(p)
		return nil, err
	}
	return &rdmaRegion{b: b, base: p}, nil
}
