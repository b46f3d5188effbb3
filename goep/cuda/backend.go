package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
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
	nvshmem bool // BackendOptions.NVSHMEM

	comm driver.Stream // pyep's communication stream

	// launchStart and launchEnd are CLOCK_MONOTONIC (ns) when the latest kernel launch (Launch)
	// entered the driver and after it returned.
	launchStart, launchEnd atomic.Int64

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
	// NVSHMEM lets the backend bootstrap NVSHMEM for a low-latency buffer across nodes
	// (symmetric.go); SharedBackend, over the real driver, sets it. Without it (the fake
	// driver's tests) such a buffer's calls raise NotAvailableError.
	NVSHMEM bool
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
		busID: bus, host: hostID(), process: opts.Process, nvshmem: opts.NVSHMEM,
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
	if err := b.SyncDevice(b.timeout); err != nil {
		return fmt.Errorf("pyep: closing the cuda backend: %w", err)
	}
	errs = append(errs, b.release()...)
	return errors.Join(errs...)
}

// BackendOf is the Backend that a buffer's engine is made for (goep.EngineEnv's): the
// engines of goep/cuda/normal and goep/cuda/lowlatency run on a cuda Backend only.
func BackendOf(be goep.Backend) (*Backend, error) {
	b, ok := be.(*Backend)
	if !ok || b == nil {
		return nil, fmt.Errorf("pyep: a cuda engine needs a cuda backend, not %T", be)
	}
	return b, nil
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

// HostAlloc allocates n bytes of zeroed, device-mapped host memory (an engine's records that
// its kernels write and the host polls): the host's pointer and the device's address. Free it
// with Driver().MemFreeHost; the context must be current.
func (b *Backend) HostAlloc(n int) (unsafe.Pointer, driver.DevicePtr, error) {
	p, err := b.drv.MemHostAlloc(n, driver.HostAllocPortable|driver.HostAllocDeviceMap)
	if err != nil {
		return nil, 0, err
	}
	d, err := b.drv.MemHostGetDevicePointer(p)
	if err != nil {
		_ = b.drv.MemFreeHost(p)
		return nil, 0, err
	}
	clear(unsafe.Slice((*byte)(p), n))
	return p, d, nil
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

// SyncDevice waits up to timeout for all the GPU's work in the context (cuCtxSynchronize).
// The synchronisation runs in a goroutine of its own, so a stuck kernel costs a blocked
// thread, not a hang; later calls join the one in flight.
func (b *Backend) SyncDevice(timeout time.Duration) error {
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
