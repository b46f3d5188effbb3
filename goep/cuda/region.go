package cuda

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// This rank's own regions: allocation, the header, and the release handshake of Close.

// region is an NVLink-domain allocation as this process addresses it.
type region struct {
	b    *Backend
	base driver.DevicePtr
	size int64 // data bytes
}

func (r *region) Control() unsafe.Pointer { return devicePointer(r.base.Add(HeaderBytes)) }
func (r *region) Data() unsafe.Pointer {
	return devicePointer(r.base.Add(HeaderBytes + goep.ControlBytes))
}
func allocationBytes(size int64) int64 { return HeaderBytes + goep.ControlBytes + size }

// localRegion is this rank's own allocation.
type localRegion struct {
	region
	kind   memKind
	mapped int  // bytes of the allocation, header included
	mem    vmem // kindFD, kindFabric: the cuMem allocation and its mapping here
	fd     int  // kindFD: the exported descriptor, served by srv; -1 when none
	srv    *fdServer
	tok    []byte
	nonce  uint64
	closed bool // guarded by b.mu
	// Set by CheckPeers (guarded by b.mu): this rank's NVLink rank, the domain's group ranks,
	// the peers' tokens (to forget their slots when this region goes) and their processes by
	// slot (a peer whose process has exited no longer maps anything).
	self       int
	ranks      []int
	peerTokens []string
	procs      []string
}

func (l *localRegion) Token() []byte { return bytes.Clone(l.tok) }

// Allocate implements goep.Backend: zeroed device memory for the header, control and data
// regions, exported through cuIpcGetMemHandle.
func (b *Backend) Allocate(size int64, numPeers int) (goep.LocalRegion, error) {
	return b.allocate(size, numPeers, b.allocateIPC)
}

// AllocateFabric implements goep.FabricAllocator (use_fabric): the region is cuMemCreate
// memory, shared through a fabric handle where the device supports them and the host lets
// this process export one (an IMEX channel), else through a POSIX file descriptor, with one
// line on stderr saying why (once per process). PYEP_MEM_HANDLE=auto|fabric|fd, read at each
// call, forces the kind.
func (b *Backend) AllocateFabric(size int64, numPeers int) (goep.LocalRegion, error) {
	mode, err := memHandleMode()
	if err != nil {
		return nil, err
	}
	return b.allocate(size, numPeers, func(size int64) (*localRegion, error) { return b.allocateShared(size, mode) })
}

// allocate checks the arguments, makes the region with alloc in the backend's context and
// registers it.
func (b *Backend) allocate(size int64, numPeers int, alloc func(size int64) (*localRegion, error)) (goep.LocalRegion, error) {
	if size < 0 || size != int64(int(size)) {
		return nil, fmt.Errorf("pyep: cuda: allocating %d data bytes: out of range", size)
	}
	if numPeers < 0 || numPeers >= maxSlots {
		return nil, fmt.Errorf("pyep: cuda: %d peers: at most %d supported", numPeers, maxSlots-1)
	}
	if err := b.usable(); err != nil {
		return nil, err
	}
	_ = b.sweep(false)
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return nil, err
	}
	l, err := alloc(size)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.locals[l] = true
	b.mu.Unlock()
	return l, nil
}

func (b *Backend) allocateIPC(size int64) (*localRegion, error) {
	total := int(allocationBytes(size))
	p, err := b.drv.MemAlloc(total)
	if err != nil {
		return nil, err
	}
	l := &localRegion{region: region{b, p, size}, kind: kindIPC, mapped: total, fd: -1, self: -1}
	if err = b.initRegion(l); err == nil {
		t := b.tokenOf(l)
		if t.IPC, err = b.drv.IpcGetMemHandle(p); err == nil {
			l.tok = t.encode()
			return l, nil
		}
	}
	_ = b.drv.MemFree(p)
	return nil, err
}

// initRegion zeroes the allocation and writes its header with a fresh nonce.
func (b *Backend) initRegion(l *localRegion) error {
	var nonce [8]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return err
	}
	l.nonce = binary.LittleEndian.Uint64(nonce[:])
	var hdr [16]byte
	copy(hdr[:8], headerMagic)
	copy(hdr[8:], nonce[:])
	b.ctrlMu.Lock()
	err := b.drv.MemsetD8Async(l.base, 0, l.mapped, b.ctrl)
	if err == nil {
		err = b.copyInLocked(l.base, hdr[:])
	}
	b.ctrlMu.Unlock()
	return err
}

// tokenOf is l's token without its handle.
func (b *Backend) tokenOf(l *localRegion) token {
	return token{Kind: l.kind, Nonce: l.nonce, Size: l.size, Mapped: int64(l.mapped), BusID: b.busID, Host: b.host, Process: b.process}
}

// Close implements goep.Region for this rank's own region: see Backend for the handshake.
func (l *localRegion) Close() error {
	b := l.b
	b.mu.Lock()
	if l.closed {
		b.mu.Unlock()
		return nil
	}
	l.closed = true
	delete(b.locals, l)
	for _, t := range l.peerTokens {
		delete(b.slots, t)
		delete(b.checked, t)
	}
	b.mu.Unlock()
	// No peer opens a closed buffer: its descriptor is served no longer.
	unshareErr := l.unshare()
	if err := b.SyncDevice(b.timeout); err != nil {
		b.defer_(l)
		return fmt.Errorf("pyep: cuda: freeing this rank's buffer: %w; its memory is kept", err)
	}
	mapped, err := b.stillMapped(l, b.timeout)
	if err == nil && len(mapped) > 0 {
		err = fmt.Errorf("pyep: cuda: %s this rank's buffer after %v (not destroyed there yet, or exited): "+
			"its %d bytes stay allocated until released (a later Buffer call on this GPU frees them) or this process exits",
			mappedBy(l, mapped), b.timeout, allocationBytes(l.size))
	}
	if err != nil {
		b.defer_(l)
		return err
	}
	err = b.free(l)
	return errors.Join(unshareErr, err, b.sweep(false))
}

func mappedBy(l *localRegion, slots []int) string {
	names := make([]string, len(slots))
	for i, s := range slots {
		names[i] = strconv.Itoa(l.ranks[s])
	}
	if len(names) == 1 {
		return "rank " + names[0] + " still maps"
	}
	return "ranks " + strings.Join(names, ", ") + " still map"
}

func (b *Backend) free(l *localRegion) error {
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	if l.kind == kindIPC {
		return b.drv.MemFree(l.base)
	}
	return b.releaseVMM(&l.mem)
}

// unshare stops serving l's file descriptor and closes it; idempotent.
func (l *localRegion) unshare() error {
	var errs []error
	if l.srv != nil {
		errs = append(errs, l.srv.Close())
		l.srv = nil
	}
	if l.fd >= 0 {
		errs = append(errs, closeFD(l.fd))
		l.fd = -1
	}
	return errors.Join(errs...)
}

func (b *Backend) defer_(l *localRegion) {
	b.mu.Lock()
	b.deferred = append(b.deferred, l)
	b.mu.Unlock()
}

// stillMapped polls l's slots until none reads mapped or timeout passes, and returns the
// slots still mapped. A region CheckPeers never saw has no handshake. A peer whose process has
// exited (a rank that died) counts as released: the driver dropped its mappings with it.
func (b *Backend) stillMapped(l *localRegion, timeout time.Duration) ([]int, error) {
	b.mu.Lock()
	self, n, procs := l.self, len(l.ranks), l.procs
	b.mu.Unlock()
	if self < 0 || n <= 1 {
		return nil, nil
	}
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 4*n)
	for pause := 50 * time.Microsecond; ; pause = min(2*pause, 5*time.Millisecond) {
		if err := b.copyOut(buf, l.base.Add(slotsOffset)); err != nil {
			return nil, err
		}
		var mapped []int
		for s := range n {
			if s != self && binary.LittleEndian.Uint32(buf[4*s:]) == slotMapped && !exited(procs[s]) {
				mapped = append(mapped, s)
			}
		}
		if len(mapped) == 0 || !time.Now().Before(deadline) {
			return mapped, nil
		}
		time.Sleep(pause)
	}
}

// sweep frees deferred regions that nobody maps any longer. With final, it waits for them as
// long as Timeout and reports those still mapped.
func (b *Backend) sweep(final bool) error {
	b.mu.Lock()
	pending := b.deferred
	b.deferred = nil
	b.mu.Unlock()
	var errs []error
	var keep []*localRegion
	wait := time.Duration(0)
	if final {
		wait = b.timeout
	}
	for _, l := range pending {
		if err := b.SyncDevice(max(wait, time.Millisecond)); err != nil {
			keep = append(keep, l)
			continue
		}
		mapped, err := b.stillMapped(l, wait)
		switch {
		case err != nil:
			errs = append(errs, err)
			keep = append(keep, l)
		case len(mapped) > 0:
			keep = append(keep, l)
			if final {
				errs = append(errs, fmt.Errorf("pyep: cuda: %s a buffer of this rank: its memory is kept until this process exits", mappedBy(l, mapped)))
			}
		default:
			errs = append(errs, b.free(l))
		}
	}
	b.mu.Lock()
	b.deferred = append(b.deferred, keep...)
	b.mu.Unlock()
	return errors.Join(errs...)
}

// Deferred is the number of closed regions whose memory waits for peers to release it.
func (b *Backend) Deferred() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.deferred)
}

func (b *Backend) usable() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("pyep: cuda: the backend was closed")
	}
	return nil
}
