package cuda

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// Backend is goep's cuda backend for one GPU: the NVLink-domain buffers are device memory
// shared between the ranks' processes through CUDA IPC (Allocate), or through cuMem handles,
// fabric or POSIX file descriptors (AllocateFabric, for use_fabric); the RDMA buffer is device
// memory.
//
// It works in the device's primary context (PyTorch's), retained for the Backend's life and
// made current on the calling OS thread at every entry (see Enter). Region addresses
// (Control, Data) are device addresses in the unified address space: opaque pointers that the
// host never dereferences; kernels take them as DevicePtr (PtrOf).
//
// Layout of every NVLink-domain allocation:
//
//	[HeaderBytes: this backend's header][goep.ControlBytes: control][size: data]
//
// The header holds a magic and the allocation's nonce (checked by every Open, so that the
// handle of a destroyed buffer whose memory was reused is refused), and one slot per NVLink
// rank that the opener writes: mapped on Open, released on Close.
//
// Destroy ordering (goep.Buffer.Destroy closes the peers' regions, then its own). Freeing
// memory that a peer still maps, or that a kernel still uses, is unsafe, so:
//   - Closing a peer's region waits for this GPU's work (cuCtxSynchronize, bounded by
//     Timeout), writes "released" into this rank's slot of the peer's header, then unmaps it
//     (cuIpcCloseMemHandle; or cuMemUnmap, cuMemAddressFree and cuMemRelease). If the GPU's
//     work does not finish in time, the mapping is kept and Close returns an error.
//   - Closing this rank's own region stops serving its file descriptor (if shared so), waits
//     (bounded by Timeout) for its GPU's work and for every peer slot to leave "mapped", then
//     frees (cuMemFree; or cuMemUnmap, cuMemAddressFree and cuMemRelease). On timeout the free is
//     deferred, not skipped and not forced: the error names the ranks that still map the
//     buffer, and the next Allocate, region Close or Backend.Close on this Backend frees it
//     once they have released it; a peer that exited without releasing leaves it allocated
//     until this process exits. Nothing waits longer than Timeout.
//
// The slots are only known once CheckPeers has told the Backend which NVLink rank opens
// which token; a region opened without CheckPeers (goep.Buffer not wiring it) skips the
// release handshake and is freed at once, as the cpu backend does.
//
// A Backend is safe for concurrent use.
type Backend struct {
	drv     driver.Driver
	dev     driver.Device
	ctx     driver.Context
	timeout time.Duration
	probe   NVLinkProbe
	busID   string
	host    string
	process string

	comm driver.Stream // pyep's communication stream

	// lastLaunch is CLOCK_MONOTONIC (ns) after the latest kernel launch on comm.
	lastLaunch atomic.Int64

	// ctrl is a private non-blocking stream for the control copies (zeroing, headers, release
	// slots), so that they never queue behind other work; scratch is a pinned, device-mapped
	// host page they copy through. ctrlMu guards both.
	ctrlMu     sync.Mutex
	ctrl       driver.Stream
	scratch    unsafe.Pointer
	scratchDev driver.DevicePtr

	waitMu sync.Mutex
	waitEv driver.Event // StreamWait's event, recorded and waited on under waitMu

	linksMu sync.Mutex
	links   map[[2]string]string // NVLink probe answers by bus-id pair

	mu       sync.Mutex
	closed   bool
	locals   map[*localRegion]bool
	slots    map[string]int  // peer token -> this rank's slot in that region's header
	checked  map[string]bool // peer tokens whose NVLink pair CheckPeers verified
	deferred []*localRegion  // regions closed while peers still mapped them

	syncMu  sync.Mutex
	syncing *syncCall // the bounded device synchronisation in flight, if any

	// kernels are the device's compiled kernels, which every buffer's engine shares.
	kernels kernelCache

	fabricMu  sync.Mutex
	fabricErr error // why fabric handles failed here: AllocateFabric goes straight to file descriptors
}

var _ goep.Backend = (*Backend)(nil)

// BackendOptions tune NewBackend; the zero value is the default.
type BackendOptions struct {
	// Timeout bounds every wait of the backend: for the GPU's work to finish before memory
	// is unmapped or freed, for peers to release a buffer, for control copies. 0: DefaultTimeout.
	Timeout time.Duration
	// NVLink checks the topology in CheckPeers and Open; nil: NVML().
	NVLink NVLinkProbe
	// Process identifies this process in tokens (a rank cannot open a buffer of its own
	// process through CUDA IPC); "": the pid. Tests that run several fake processes in one OS
	// process set it.
	Process string
}

// DefaultTimeout is BackendOptions.Timeout's default, DeepEP's kernel timeout (about 100 s).
const DefaultTimeout = 100 * time.Second

// HeaderBytes is the cuda backend's header in front of each NVLink-domain region's control
// region: the data region starts HeaderBytes+goep.ControlBytes into the allocation.
const HeaderBytes = 4096

const (
	headerMagic  = "pyepcuda"
	slotsOffset  = 64 // the slots: uint32 each, indexed by NVLink rank
	maxSlots     = (HeaderBytes - slotsOffset) / 4
	slotMapped   = 1
	slotReleased = 2
	scratchBytes = HeaderBytes
)

// NewBackend makes the backend of device ordinal of drv: it retains the device's primary
// context and creates pyep's communication stream (non-blocking, of the highest priority).
// Close releases them.
func NewBackend(drv driver.Driver, ordinal int, opts BackendOptions) (b *Backend, err error) {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.NVLink == nil {
		opts.NVLink = NVML()
	}
	if opts.Process == "" {
		opts.Process = strconv.Itoa(os.Getpid())
	}
	dev, err := drv.DeviceGet(ordinal)
	if err != nil {
		return nil, err
	}
	bus, err := dev.PCIBusID()
	if err != nil {
		return nil, err
	}
	ctx, err := dev.PrimaryContext()
	if err != nil {
		return nil, err
	}
	b = &Backend{
		drv: drv, dev: dev, ctx: ctx, timeout: opts.Timeout, probe: opts.NVLink,
		busID: bus, host: hostID(), process: opts.Process,
		links: map[[2]string]string{}, locals: map[*localRegion]bool{},
		slots: map[string]int{}, checked: map[string]bool{},
	}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		_ = ctx.Release()
		return nil, err
	}
	defer func() {
		if err != nil {
			b.release()
			err = fmt.Errorf("pyep: cuda backend on device %d: %w", ordinal, err)
		}
	}()
	_, greatest, err := drv.CtxGetStreamPriorityRange()
	if err != nil {
		return nil, err
	}
	if b.comm, err = drv.StreamCreate(driver.StreamNonBlocking, greatest); err != nil {
		return nil, err
	}
	if b.ctrl, err = drv.StreamCreate(driver.StreamNonBlocking, greatest); err != nil {
		return nil, err
	}
	if b.waitEv, err = drv.EventCreate(driver.EventDisableTiming); err != nil {
		return nil, err
	}
	if b.scratch, err = drv.MemHostAlloc(scratchBytes, driver.HostAllocPortable|driver.HostAllocDeviceMap); err != nil {
		return nil, err
	}
	if b.scratchDev, err = drv.MemHostGetDevicePointer(b.scratch); err != nil {
		return nil, err
	}
	return b, nil
}

// release frees what NewBackend made; the context must be current.
func (b *Backend) release() []error {
	var errs []error
	if b.scratch != nil {
		errs = append(errs, b.drv.MemFreeHost(b.scratch))
		b.scratch = nil
	}
	if b.waitEv.Raw() != 0 {
		errs = append(errs, b.waitEv.Destroy())
		b.waitEv = driver.Event{}
	}
	for _, s := range []*driver.Stream{&b.ctrl, &b.comm} {
		if s.Raw() != 0 {
			errs = append(errs, s.Destroy())
			*s = driver.Stream{}
		}
	}
	errs = append(errs, b.ctx.Release())
	return errs
}

// Close frees what the backend holds: deferred regions whose peers have released them (it
// reports those that are still mapped, and keeps them), its streams, and its reference to the
// primary context. Regions still open stay valid until closed; the backend must not be used
// afterwards. Idempotent.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	errs := []error{b.sweep(true)}
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	if err := b.syncDevice(b.timeout); err != nil {
		return fmt.Errorf("pyep: closing the cuda backend: %w", err)
	}
	errs = append(errs, b.release()...)
	return errors.Join(errs...)
}

// Name implements goep.Backend.
func (b *Backend) Name() string { return "cuda" }

// DeviceID implements goep.Backend: the device ordinal.
func (b *Backend) DeviceID() int { return b.dev.Ordinal() }

// Driver is the driver the backend calls.
func (b *Backend) Driver() driver.Driver { return b.drv }

// Device is the backend's GPU.
func (b *Backend) Device() driver.Device { return b.dev }

// Context is the device's primary context.
func (b *Backend) Context() driver.Context { return b.ctx }

// PCIBusID is the GPU's PCI address, as tokens carry it.
func (b *Backend) PCIBusID() string { return b.busID }

// Timeout is the bound of the backend's waits.
func (b *Backend) Timeout() time.Duration { return b.timeout }

// Enter locks the calling goroutine to its OS thread and makes the backend's context current
// there; call exit when done, also on error. Every driver call sequence of the backend (and
// of launchers using it) runs between the two.
func (b *Backend) Enter() (exit func(), err error) {
	runtime.LockOSThread()
	if err := b.ctx.MakeCurrent(); err != nil {
		runtime.UnlockOSThread()
		return func() {}, err
	}
	return runtime.UnlockOSThread, nil
}

// PtrOf is the device address behind a Region's Control() or Data().
func PtrOf(p unsafe.Pointer) driver.DevicePtr { return driver.DevicePtr(uintptr(p)) }

// devicePointer makes a device address an unsafe.Pointer for goep's Region interface. The
// address is outside the Go heap (unified addressing reserves it for the device), so the
// garbage collector ignores it; it is never dereferenced on the host.
func devicePointer(p driver.DevicePtr) unsafe.Pointer {
	u := uintptr(p)
	return *(*unsafe.Pointer)(unsafe.Pointer(&u))
}

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
	if err := b.syncDevice(b.timeout); err != nil {
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
		if err := b.syncDevice(max(wait, time.Millisecond)); err != nil {
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
	if err := b.syncDevice(b.timeout); err != nil {
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
	if err := r.b.syncDevice(r.b.timeout); err != nil {
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

// copyIn writes src to device memory at dst through the control stream; the context must be
// current (or is made so).
func (b *Backend) copyIn(dst driver.DevicePtr, src []byte) error {
	b.ctrlMu.Lock()
	defer b.ctrlMu.Unlock()
	return b.copyInLocked(dst, src)
}

func (b *Backend) copyInLocked(dst driver.DevicePtr, src []byte) error {
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	copy(unsafe.Slice((*byte)(b.scratch), scratchBytes), src)
	if err := b.drv.MemcpyAsync(dst, b.scratchDev, len(src), b.ctrl); err != nil {
		return err
	}
	return b.waitCtrlLocked()
}

// copyOut reads device memory at src into dst through the control stream.
func (b *Backend) copyOut(dst []byte, src driver.DevicePtr) error {
	b.ctrlMu.Lock()
	defer b.ctrlMu.Unlock()
	exit, err := b.Enter()
	defer exit()
	if err != nil {
		return err
	}
	if err := b.drv.MemcpyAsync(b.scratchDev, src, len(dst), b.ctrl); err != nil {
		return err
	}
	if err := b.waitCtrlLocked(); err != nil {
		return err
	}
	copy(dst, unsafe.Slice((*byte)(b.scratch), len(dst)))
	return nil
}

func (b *Backend) waitCtrlLocked() error {
	if err := waitStream(b.ctrl, b.timeout); err != nil {
		return fmt.Errorf("pyep: cuda: a control copy: %w", err)
	}
	return nil
}

// waitStream polls s until its work is done, an error, or timeout.
func waitStream(s driver.Stream, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for pause := time.Duration(0); ; pause = min(max(2*pause, 10*time.Microsecond), time.Millisecond) {
		done, err := s.Query()
		if err != nil || done {
			return err
		}
		if !time.Now().Before(deadline) {
			return fmt.Errorf("the GPU did not finish within %v", timeout)
		}
		time.Sleep(pause)
	}
}

type syncCall struct {
	done chan struct{}
	err  error
}

// syncDevice waits up to timeout for all the GPU's work in the context (cuCtxSynchronize).
// The synchronisation runs in a goroutine of its own, so a stuck kernel costs a blocked
// thread, not a hang; later calls join the one in flight.
func (b *Backend) syncDevice(timeout time.Duration) error {
	b.syncMu.Lock()
	c := b.syncing
	if c == nil {
		c = &syncCall{done: make(chan struct{})}
		b.syncing = c
		go func() {
			exit, err := b.Enter()
			if err == nil {
				err = b.ctx.Synchronize()
			}
			exit()
			b.syncMu.Lock()
			b.syncing = nil
			b.syncMu.Unlock()
			c.err = err
			close(c.done)
		}()
	}
	b.syncMu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-c.done:
		return c.err
	case <-t.C:
		return fmt.Errorf("the GPU's work (device %d) did not finish within %v: a kernel is stuck, or waits for a peer that never came", b.dev.Ordinal(), timeout)
	}
}
