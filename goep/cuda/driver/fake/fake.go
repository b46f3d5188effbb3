// Package fake implements cuda.Driver over host memory, for testing code above goep/cuda on
// machines without a GPU: buffer allocation and layout, IPC handle exchange between ranks,
// stream/event plumbing, kernel launch arguments and the error paths around all of them.
//
// Model:
//   - A World is one host. Each Driver is one process in it; IPC handles exported by one Driver
//     open in another Driver of the same World and alias the same memory, as real IPC maps the
//     same physical pages (but at the same address, where the real driver picks a new one).
//   - Device memory is Go memory; a DevicePtr is its address, and Bytes returns it as a slice.
//   - Work runs synchronously when queued, so streams and events are trivially ordered.
//   - Kernels are Go functions registered on the World by name; a module's image is ignored.
//   - The virtual memory management calls (vmm.go, Linux only) are real mappings: MemCreate's
//     memory is a file on tmpfs, MemMap maps it into a range that MemAddressReserve reserved,
//     and is inaccessible until MemSetAccess, so another process maps it at its own address.
//     MemExportToFD exports a real file descriptor of that file, which crosses processes as
//     any descriptor does; a fabric handle names the memory in the World.
//   - The current context is per Driver, not per OS thread, so forgetting MakeCurrent is
//     caught only before the first one.
//
// Beyond the interface, a Driver counts calls, reports live allocations (leak checks) and can
// be told to fail a call (FailNext), to exercise error handling.
package fake

import (
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// Kernel is a fake kernel: it does on the host what the real one does on the GPU, reading its
// parameters from l.
type Kernel func(l *Launch) error

// Launch is what a Kernel is called with.
type Launch struct {
	Driver      *Driver
	Name        string
	Grid, Block [3]uint32
	SharedBytes uint32
	Stream      driver.Stream
	// Args point at the parameter values, as passed to Function.Launch.
	Args []unsafe.Pointer
}

// DevicePtr reads parameter i as a pointer.
func (l *Launch) DevicePtr(i int) driver.DevicePtr { return *(*driver.DevicePtr)(l.Args[i]) }

// Int32 reads parameter i as an int.
func (l *Launch) Int32(i int) int32 { return *(*int32)(l.Args[i]) }

// Uint64 reads parameter i as an unsigned 64-bit integer.
func (l *Launch) Uint64(i int) uint64 { return *(*uint64)(l.Args[i]) }

// Float32 reads parameter i as a float.
func (l *Launch) Float32(i int) float32 { return *(*float32)(l.Args[i]) }

// Mem is the n bytes of device (or mapped host) memory at p, as Driver.Bytes.
func (l *Launch) Mem(p driver.DevicePtr, n int) ([]byte, error) { return l.Driver.Bytes(p, n) }

// World is one fake host: the allocations its processes can share and the kernels they run.
type World struct {
	mu      sync.Mutex
	nextID  uint64
	allocs  map[uint64]*allocation // by id, for IPC
	kernels map[string]Kernel
	phys    map[uint64]*physical  // MemCreate's memory by id, for fabric handles
	files   map[fileKey]*physical // and by backing file, for file descriptors
}

// NewWorld returns an empty host.
func NewWorld() *World {
	return &World{allocs: map[uint64]*allocation{}, kernels: map[string]Kernel{},
		phys: map[uint64]*physical{}, files: map[fileKey]*physical{}}
}

// RegisterKernel makes name available to ModuleGetFunction in every Driver of w.
func (w *World) RegisterKernel(name string, k Kernel) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.kernels[name] = k
}

type allocation struct {
	id     uint64
	buf    []byte
	base   driver.DevicePtr
	owner  *Driver
	device int
	host   bool
	freed  bool
	opened int // IPC mappings of it in other Drivers
}

// Config describes a fake process's view of the host. Zero fields take the defaults shown.
type Config struct {
	World   *World // nil: a World of its own
	Devices int    // 1
	SMs     int    // 132, as an H100/H200
	Major   int    // compute capability 9.0 (with Minor)
	Minor   int
	Name    string // "pyep fake GPU"
	// MemBytes is each device's memory; allocations beyond it fail with out-of-memory.
	MemBytes int // 1 GiB
	// Guard places every allocation at the end of its own mapping, followed by an inaccessible
	// page, and makes freed memory inaccessible: an emulated kernel that reads or writes past
	// an allocation (or after its free) crashes at once, as a GPU would report an illegal
	// address, instead of silently touching the Go heap. Freed mappings keep their address
	// range (not their memory) until the process exits.
	Guard bool
	// NoVMM makes the devices lack virtual memory management (the cuMem* calls); it is always
	// so off Linux.
	NoVMM bool
	// Fabric makes the devices support fabric handles (AttrHandleTypeFabric); NoIMEX then
	// refuses to create fabric-shareable memory with CUDA_ERROR_NOT_PERMITTED, as a host
	// without an IMEX channel does.
	Fabric, NoIMEX bool
}

// Driver is one fake process.
type Driver struct {
	w   *World
	cfg Config

	// All below is guarded by w.mu: one lock for the host keeps IPC simple.
	current    driver.Context
	retained   map[int]int
	used       map[int]int                      // device memory in use, by device
	mapped     map[driver.DevicePtr]*allocation // what this process can address, by base
	imported   map[driver.DevicePtr]bool        // bases mapped through IPC
	memHandles map[driver.MemHandle]*physical   // MemCreate's and imported handles
	reserved   map[driver.DevicePtr]int         // address ranges of MemAddressReserve, by size
	vmaps      map[driver.DevicePtr]*vmap       // MemMap's mappings, by base
	streams    map[uintptr]bool
	events     map[uintptr]*event
	modules    map[uintptr]bool
	functions  map[uintptr]*function
	nextHandle uintptr
	calls      map[string]int
	failNext   map[string]driver.Result
}

type event struct {
	flags    driver.EventFlags
	recorded bool
	at       time.Time
}

type function struct {
	name   string
	kernel Kernel
	attrs  map[driver.FuncAttribute]int
}

// New returns a fake process.
func New(cfg Config) *Driver {
	if cfg.World == nil {
		cfg.World = NewWorld()
	}
	if cfg.Devices == 0 {
		cfg.Devices = 1
	}
	if cfg.SMs == 0 {
		cfg.SMs = 132
	}
	if cfg.Major == 0 {
		cfg.Major, cfg.Minor = 9, 0
	}
	if cfg.Name == "" {
		cfg.Name = "pyep fake GPU"
	}
	if cfg.MemBytes == 0 {
		cfg.MemBytes = 1 << 30
	}
	return &Driver{
		w: cfg.World, cfg: cfg,
		retained: map[int]int{}, used: map[int]int{},
		mapped: map[driver.DevicePtr]*allocation{}, imported: map[driver.DevicePtr]bool{},
		streams: map[uintptr]bool{0: true}, events: map[uintptr]*event{},
		modules: map[uintptr]bool{}, functions: map[uintptr]*function{},
		nextHandle: 0x1000, calls: map[string]int{}, failNext: map[string]driver.Result{},
		memHandles: map[driver.MemHandle]*physical{}, reserved: map[driver.DevicePtr]int{}, vmaps: map[driver.DevicePtr]*vmap{},
	}
}

var _ driver.Driver = (*Driver)(nil)

// World is the host d lives in.
func (d *Driver) World() *World { return d.w }

// FailNext makes the next call of op (a Driver method name, e.g. "MemAlloc") fail with r.
func (d *Driver) FailNext(op string, r driver.Result) {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	d.failNext[op] = r
}

// Calls is how often op (a Driver method name) was called, failed calls included.
func (d *Driver) Calls(op string) int {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	return d.calls[op]
}

// Live counts what d still holds: allocations (device and host) not freed, IPC mappings not
// closed, memory handles not released, address ranges not freed, mappings not unmapped,
// streams, events and modules not destroyed. Tests assert it returns to zero.
func (d *Driver) Live() int {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	return len(d.mapped) + len(d.streams) - 1 + len(d.events) + len(d.modules) +
		len(d.memHandles) + len(d.reserved) + len(d.vmaps)
}

// Bytes is the memory at [p, p+n): device memory, host memory or an IPC mapping of d. Writes
// through it are what kernels and copies on a real GPU would do.
func (d *Driver) Bytes(p driver.DevicePtr, n int) ([]byte, error) {
	d.w.mu.Lock()
	defer d.w.mu.Unlock()
	return d.bytes(p, n)
}

func (d *Driver) bytes(p driver.DevicePtr, n int) ([]byte, error) {
	if n < 0 {
		return nil, driver.ErrorInvalidValue
	}
	for base, a := range d.mapped {
		if p >= base && p < base+driver.DevicePtr(len(a.buf)) {
			off := int(p - base)
			if off+n > len(a.buf) {
				return nil, fmt.Errorf("pyep: fake: %d bytes at %#x overrun the %d-byte allocation at %#x: %w", n, uint64(p), len(a.buf), uint64(base), driver.ErrorIllegalAddress)
			}
			return a.buf[off : off+n : off+n], nil
		}
	}
	if base, m := d.vmapAt(p); m != nil {
		return m.bytes(base, p, n)
	}
	return nil, fmt.Errorf("pyep: fake: %#x is not memory of this process: %w", uint64(p), driver.ErrorIllegalAddress)
}

// enter counts a call and returns an injected failure, if any. w.mu must be held.
func (d *Driver) enter(op string) error {
	d.calls[op]++
	if r, ok := d.failNext[op]; ok {
		delete(d.failNext, op)
		return fmt.Errorf("pyep: fake %s (injected): %w", op, r)
	}
	return nil
}

// enterCtx is enter for calls that need a current context, like the real driver's.
func (d *Driver) enterCtx(op string) error {
	if err := d.enter(op); err != nil {
		return err
	}
	if d.current.Raw() == 0 {
		return fmt.Errorf("pyep: fake %s: no current context (call Context.MakeCurrent first): %w", op, driver.ErrorInvalidContext)
	}
	return nil
}

func (d *Driver) lock(op string, needCtx bool) (unlock func(), err error) {
	d.w.mu.Lock()
	if needCtx {
		err = d.enterCtx(op)
	} else {
		err = d.enter(op)
	}
	return d.w.mu.Unlock, err
}

func (d *Driver) handle() uintptr {
	d.nextHandle += 0x10
	return d.nextHandle
}

func (d *Driver) device(dev driver.Device) error {
	if dev.Ordinal() < 0 || dev.Ordinal() >= d.cfg.Devices {
		return fmt.Errorf("pyep: fake: device %d of %d: %w", dev.Ordinal(), d.cfg.Devices, driver.ErrorInvalidDevice)
	}
	return nil
}

func (d *Driver) stream(s driver.Stream) error {
	if !d.streams[s.Raw()] {
		return fmt.Errorf("pyep: fake: stream %#x: %w", s.Raw(), driver.ErrorInvalidHandle)
	}
	return nil
}

// DriverVersion reports CUDA 13.0.
func (d *Driver) DriverVersion() (int, error) {
	unlock, err := d.lock("DriverVersion", false)
	defer unlock()
	return 13000, err
}

// DeviceCount is Config.Devices.
func (d *Driver) DeviceCount() (int, error) {
	unlock, err := d.lock("DeviceCount", false)
	defer unlock()
	return d.cfg.Devices, err
}

// DeviceGet returns device ordinal.
func (d *Driver) DeviceGet(ordinal int) (driver.Device, error) {
	unlock, err := d.lock("DeviceGet", false)
	defer unlock()
	dev := driver.NewDevice(d, ordinal)
	if err == nil {
		err = d.device(dev)
	}
	return dev, err
}

// DeviceGetAttribute answers from Config; attributes it does not model read as 0.
func (d *Driver) DeviceGetAttribute(dev driver.Device, attr driver.DeviceAttribute) (int, error) {
	unlock, err := d.lock("DeviceGetAttribute", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return 0, err
	}
	switch attr {
	case driver.AttrMultiprocessorCount:
		return d.cfg.SMs, nil
	case driver.AttrComputeCapabilityMajor:
		return d.cfg.Major, nil
	case driver.AttrComputeCapabilityMinor:
		return d.cfg.Minor, nil
	case driver.AttrMaxThreadsPerBlock:
		return 1024, nil
	case driver.AttrMaxSharedMemoryPerBlockOptin:
		return 232448, nil
	case driver.AttrCanMapHostMemory, driver.AttrUnifiedAddressing:
		return 1, nil
	case driver.AttrPCIBusID:
		return pciBus(dev.Ordinal()), nil
	case driver.AttrVirtualMemoryManagement, driver.AttrHandleTypePosixFD:
		return b2i(d.vmm()), nil
	case driver.AttrHandleTypeFabric:
		return b2i(d.vmm() && d.cfg.Fabric), nil
	}
	return 0, nil
}

// Devices of one World sit on distinct buses, the same for every process.
func pciBus(ordinal int) int { return 0x18 + 0x10*ordinal }

// DeviceGetName is Config.Name.
func (d *Driver) DeviceGetName(dev driver.Device) (string, error) {
	unlock, err := d.lock("DeviceGetName", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	return d.cfg.Name, err
}

// DeviceGetPCIBusID is "0000:BB:00.0", BB depending on the ordinal only.
func (d *Driver) DeviceGetPCIBusID(dev driver.Device) (string, error) {
	unlock, err := d.lock("DeviceGetPCIBusID", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("0000:%02X:00.0", pciBus(dev.Ordinal())), nil
}

// DeviceTotalMem is Config.MemBytes.
func (d *Driver) DeviceTotalMem(dev driver.Device) (int, error) {
	unlock, err := d.lock("DeviceTotalMem", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	return d.cfg.MemBytes, err
}

// DeviceCanAccessPeer is true between distinct devices, as on an NVLink host.
func (d *Driver) DeviceCanAccessPeer(dev, peer driver.Device) (bool, error) {
	unlock, err := d.lock("DeviceCanAccessPeer", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err == nil {
		err = d.device(peer)
	}
	return err == nil && dev.Ordinal() != peer.Ordinal(), err
}

// DevicePrimaryCtxRetain counts references per device.
func (d *Driver) DevicePrimaryCtxRetain(dev driver.Device) (driver.Context, error) {
	unlock, err := d.lock("DevicePrimaryCtxRetain", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return driver.Context{}, err
	}
	d.retained[dev.Ordinal()]++
	return driver.NewContext(d, uintptr(0xc000+dev.Ordinal()), dev), nil
}

// DevicePrimaryCtxRelease fails when nothing is retained, where a real driver would let the
// context go.
func (d *Driver) DevicePrimaryCtxRelease(dev driver.Device) error {
	unlock, err := d.lock("DevicePrimaryCtxRelease", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return err
	}
	if d.retained[dev.Ordinal()] == 0 {
		return fmt.Errorf("pyep: fake: primary context of device %d released more often than retained: %w", dev.Ordinal(), driver.ErrorInvalidContext)
	}
	d.retained[dev.Ordinal()]--
	return nil
}

// CtxSetCurrent makes ctx current for the whole process (see the package doc).
func (d *Driver) CtxSetCurrent(ctx driver.Context) error {
	unlock, err := d.lock("CtxSetCurrent", false)
	defer unlock()
	if err != nil {
		return err
	}
	if ctx.Raw() != 0 && d.retained[ctx.Device().Ordinal()] == 0 {
		return fmt.Errorf("pyep: fake: context %#x is not retained: %w", ctx.Raw(), driver.ErrorInvalidContext)
	}
	d.current = ctx
	return nil
}

// CtxGetCurrent returns the current context.
func (d *Driver) CtxGetCurrent() (driver.Context, error) {
	unlock, err := d.lock("CtxGetCurrent", false)
	defer unlock()
	return d.current, err
}

// CtxSynchronize has nothing to wait for.
func (d *Driver) CtxSynchronize() error {
	unlock, err := d.lock("CtxSynchronize", true)
	defer unlock()
	return err
}

// CtxGetStreamPriorityRange is Hopper's (0, -5).
func (d *Driver) CtxGetStreamPriorityRange() (least, greatest int, err error) {
	unlock, err := d.lock("CtxGetStreamPriorityRange", true)
	defer unlock()
	return 0, -5, err
}

// MemGetInfo is the current device's free and total memory.
func (d *Driver) MemGetInfo() (free, total int, err error) {
	unlock, err := d.lock("MemGetInfo", true)
	defer unlock()
	if err != nil {
		return 0, 0, err
	}
	return d.cfg.MemBytes - d.used[d.current.Device().Ordinal()], d.cfg.MemBytes, nil
}

func (d *Driver) alloc(bytes int, host bool) (*allocation, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("pyep: fake: allocating %d bytes: %w", bytes, driver.ErrorInvalidValue)
	}
	dev := d.current.Device().Ordinal()
	if !host {
		if d.used[dev]+bytes > d.cfg.MemBytes {
			return nil, fmt.Errorf("pyep: fake: allocating %d bytes with %d of %d in use: %w", bytes, d.used[dev], d.cfg.MemBytes, driver.ErrorOutOfMemory)
		}
		d.used[dev] += bytes
	}
	// 256-byte alignment, like cudaMalloc's (kernels rely on it for vector loads).
	var buf []byte
	if d.cfg.Guard {
		var err error
		if buf, err = guarded(bytes); err != nil {
			return nil, fmt.Errorf("pyep: fake: allocating %d bytes: %v: %w", bytes, err, driver.ErrorOutOfMemory)
		}
	} else {
		raw := make([]byte, bytes+256)
		off := int(-uintptr(unsafe.Pointer(&raw[0])) & 255)
		buf = raw[off : off+bytes : off+bytes]
	}
	d.w.nextID++
	a := &allocation{id: d.w.nextID, buf: buf, base: driver.DevicePtr(uintptr(unsafe.Pointer(&buf[0]))), owner: d, device: dev, host: host}
	d.w.allocs[a.id] = a
	d.mapped[a.base] = a
	return a, nil
}

// own returns d's own allocation at base p (not an IPC mapping), of the given kind.
func (d *Driver) own(op string, p driver.DevicePtr, host bool) (*allocation, error) {
	a, ok := d.mapped[p]
	if !ok || a.owner != d || a.host != host {
		return nil, fmt.Errorf("pyep: fake %s: %#x is not the start of an allocation of this process: %w", op, uint64(p), driver.ErrorInvalidValue)
	}
	return a, nil
}

func (d *Driver) release(a *allocation) {
	delete(d.mapped, a.base)
	a.freed = true
	if a.opened == 0 && a.owner.cfg.Guard {
		unguard(a.buf)
	}
	if !a.host {
		d.used[a.device] -= len(a.buf)
	}
	if a.opened == 0 {
		delete(d.w.allocs, a.id)
	}
}

// MemAlloc allocates zeroed, 256-byte aligned memory (real memory is not zeroed: do not rely
// on it).
func (d *Driver) MemAlloc(bytes int) (driver.DevicePtr, error) {
	unlock, err := d.lock("MemAlloc", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.alloc(bytes, false)
	if err != nil {
		return 0, err
	}
	return a.base, nil
}

// MemFree frees an allocation; peers that opened it keep their mapping until they close it.
func (d *Driver) MemFree(p driver.DevicePtr) error {
	unlock, err := d.lock("MemFree", true)
	defer unlock()
	if err != nil {
		return err
	}
	a, err := d.own("MemFree", p, false)
	if err != nil {
		return err
	}
	d.release(a)
	return nil
}

// MemsetD8 fills memory at once.
func (d *Driver) MemsetD8(p driver.DevicePtr, value byte, bytes int) error {
	unlock, err := d.lock("MemsetD8", true)
	defer unlock()
	if err != nil {
		return err
	}
	return d.memset(p, value, bytes)
}

func (d *Driver) memset(p driver.DevicePtr, value byte, bytes int) error {
	b, err := d.bytes(p, bytes)
	if err != nil {
		return err
	}
	for i := range b {
		b[i] = value
	}
	return nil
}

// MemsetD8Async fills memory at once.
func (d *Driver) MemsetD8Async(p driver.DevicePtr, value byte, bytes int, s driver.Stream) error {
	unlock, err := d.lock("MemsetD8Async", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err != nil {
		return err
	}
	return d.memset(p, value, bytes)
}

// MemcpyHtoD copies at once.
func (d *Driver) MemcpyHtoD(dst driver.DevicePtr, src []byte) error {
	unlock, err := d.lock("MemcpyHtoD", true)
	defer unlock()
	if err != nil || len(src) == 0 {
		return err
	}
	b, err := d.bytes(dst, len(src))
	if err != nil {
		return err
	}
	copy(b, src)
	return nil
}

// MemcpyDtoH copies at once.
func (d *Driver) MemcpyDtoH(dst []byte, src driver.DevicePtr) error {
	unlock, err := d.lock("MemcpyDtoH", true)
	defer unlock()
	if err != nil || len(dst) == 0 {
		return err
	}
	b, err := d.bytes(src, len(dst))
	if err != nil {
		return err
	}
	copy(dst, b)
	return nil
}

// MemcpyAsync copies at once (overlapping ranges as memmove).
func (d *Driver) MemcpyAsync(dst, src driver.DevicePtr, bytes int, s driver.Stream) error {
	unlock, err := d.lock("MemcpyAsync", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err != nil || bytes == 0 {
		return err
	}
	from, err := d.bytes(src, bytes)
	if err != nil {
		return err
	}
	to, err := d.bytes(dst, bytes)
	if err != nil {
		return err
	}
	copy(to, from)
	return nil
}

// MemHostAlloc allocates Go memory that stands for pinned host memory.
func (d *Driver) MemHostAlloc(bytes int, flags driver.HostAllocFlags) (unsafe.Pointer, error) {
	unlock, err := d.lock("MemHostAlloc", true)
	defer unlock()
	if err != nil {
		return nil, err
	}
	a, err := d.alloc(bytes, true)
	if err != nil {
		return nil, err
	}
	return unsafe.Pointer(&a.buf[0]), nil
}

// MemHostGetDevicePointer returns the same address, as with unified addressing.
func (d *Driver) MemHostGetDevicePointer(p unsafe.Pointer) (driver.DevicePtr, error) {
	unlock, err := d.lock("MemHostGetDevicePointer", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.own("MemHostGetDevicePointer", driver.DevicePtr(uintptr(p)), true)
	if err != nil {
		return 0, err
	}
	return a.base, nil
}

// MemFreeHost frees MemHostAlloc's memory.
func (d *Driver) MemFreeHost(p unsafe.Pointer) error {
	unlock, err := d.lock("MemFreeHost", true)
	defer unlock()
	if err != nil {
		return err
	}
	a, err := d.own("MemFreeHost", driver.DevicePtr(uintptr(p)), true)
	if err != nil {
		return err
	}
	d.release(a)
	return nil
}

// PointerGetAttribute answers for any address inside memory of d.
func (d *Driver) PointerGetAttribute(attr driver.PointerAttribute, p driver.DevicePtr) (uint64, error) {
	unlock, err := d.lock("PointerGetAttribute", false)
	defer unlock()
	if err != nil {
		return 0, err
	}
	for base, a := range d.mapped {
		if p < base || p >= base+driver.DevicePtr(len(a.buf)) {
			continue
		}
		switch attr {
		case driver.PointerAttrMemoryType:
			if a.host {
				return uint64(driver.MemoryTypeHost), nil
			}
			return uint64(driver.MemoryTypeDevice), nil
		case driver.PointerAttrDeviceOrdinal:
			return uint64(a.device), nil
		case driver.PointerAttrDevicePointer:
			return uint64(p), nil
		case driver.PointerAttrRangeStartAddr:
			return uint64(base), nil
		case driver.PointerAttrRangeSize:
			return uint64(len(a.buf)), nil
		case driver.PointerAttrContext:
			return uint64(0xc000 + a.device), nil
		}
		return 0, fmt.Errorf("pyep: fake: pointer attribute %d: %w", attr, driver.ErrorNotSupported)
	}
	if base, m := d.vmapAt(p); m != nil {
		switch attr {
		case driver.PointerAttrMemoryType:
			return uint64(driver.MemoryTypeDevice), nil
		case driver.PointerAttrDeviceOrdinal:
			return uint64(m.phys.device), nil
		case driver.PointerAttrDevicePointer:
			return uint64(p), nil
		case driver.PointerAttrRangeStartAddr:
			return uint64(base), nil
		case driver.PointerAttrRangeSize:
			return uint64(m.size), nil
		}
		return 0, fmt.Errorf("pyep: fake: pointer attribute %d of mapped memory: %w", attr, driver.ErrorNotSupported)
	}
	return 0, fmt.Errorf("pyep: fake: %#x is not memory of this process: %w", uint64(p), driver.ErrorInvalidValue)
}

// ipcMagic marks fake handles, so that garbage handles are told apart from stale ones.
const ipcMagic = "pyepfake"

// IpcGetMemHandle exports one of d's device allocations.
func (d *Driver) IpcGetMemHandle(p driver.DevicePtr) (driver.IpcMemHandle, error) {
	unlock, err := d.lock("IpcGetMemHandle", true)
	defer unlock()
	var h driver.IpcMemHandle
	if err != nil {
		return h, err
	}
	a, err := d.own("IpcGetMemHandle", p, false)
	if err != nil {
		return h, err
	}
	copy(h[:], ipcMagic)
	putUint64(h[8:], a.id)
	return h, nil
}

// IpcOpenMemHandle maps another process's allocation. Like the real driver, a process cannot
// open its own handles.
func (d *Driver) IpcOpenMemHandle(h driver.IpcMemHandle) (driver.DevicePtr, error) {
	unlock, err := d.lock("IpcOpenMemHandle", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, ok := d.w.allocs[getUint64(h[8:])]
	switch {
	case string(h[:8]) != ipcMagic || !ok || a.freed:
		return 0, fmt.Errorf("pyep: fake: IPC handle of no live allocation: %w", driver.ErrorInvalidValue)
	case a.owner == d:
		return 0, fmt.Errorf("pyep: fake: opening an IPC handle in the process that exported it: %w", driver.ErrorInvalidContext)
	case d.imported[a.base]:
		return 0, fmt.Errorf("pyep: fake: IPC handle opened twice: %w", driver.ErrorInvalidValue)
	}
	a.opened++
	d.mapped[a.base] = a
	d.imported[a.base] = true
	return a.base, nil
}

// IpcCloseMemHandle unmaps what IpcOpenMemHandle mapped.
func (d *Driver) IpcCloseMemHandle(p driver.DevicePtr) error {
	unlock, err := d.lock("IpcCloseMemHandle", true)
	defer unlock()
	if err != nil {
		return err
	}
	if !d.imported[p] {
		return fmt.Errorf("pyep: fake: %#x is not an IPC mapping: %w", uint64(p), driver.ErrorInvalidValue)
	}
	a := d.mapped[p]
	delete(d.mapped, p)
	delete(d.imported, p)
	a.opened--
	if a.freed && a.opened == 0 {
		delete(d.w.allocs, a.id)
		if a.owner.cfg.Guard {
			unguard(a.buf)
		}
	}
	return nil
}

// ModuleLoadData accepts any non-empty image: kernels come from World.RegisterKernel.
func (d *Driver) ModuleLoadData(image []byte) (driver.Module, error) {
	unlock, err := d.lock("ModuleLoadData", true)
	defer unlock()
	if err == nil && len(image) == 0 {
		err = fmt.Errorf("pyep: fake: empty module image: %w", driver.ErrorInvalidImage)
	}
	if err != nil {
		return driver.Module{}, err
	}
	h := d.handle()
	d.modules[h] = true
	return driver.WrapModule(d, h), nil
}

// ModuleGetFunction finds a kernel registered on the World.
func (d *Driver) ModuleGetFunction(m driver.Module, name string) (driver.Function, error) {
	unlock, err := d.lock("ModuleGetFunction", true)
	defer unlock()
	if err == nil && !d.modules[m.Raw()] {
		err = fmt.Errorf("pyep: fake: module %#x: %w", m.Raw(), driver.ErrorInvalidHandle)
	}
	if err != nil {
		return driver.Function{}, err
	}
	k, ok := d.w.kernels[name]
	if !ok {
		return driver.Function{}, fmt.Errorf("pyep: fake: no kernel %q registered: %w", name, driver.ErrorNotFound)
	}
	h := d.handle()
	d.functions[h] = &function{name: name, kernel: k, attrs: map[driver.FuncAttribute]int{}}
	return driver.WrapFunction(d, h, name), nil
}

// ModuleUnload forgets a module.
func (d *Driver) ModuleUnload(m driver.Module) error {
	unlock, err := d.lock("ModuleUnload", true)
	defer unlock()
	if err == nil && !d.modules[m.Raw()] {
		err = fmt.Errorf("pyep: fake: module %#x: %w", m.Raw(), driver.ErrorInvalidHandle)
	}
	if err == nil {
		delete(d.modules, m.Raw())
	}
	return err
}

func (d *Driver) function(f driver.Function) (*function, error) {
	fn, ok := d.functions[f.Raw()]
	if !ok {
		return nil, fmt.Errorf("pyep: fake: function %#x: %w", f.Raw(), driver.ErrorInvalidHandle)
	}
	return fn, nil
}

// FuncGetAttribute returns what FuncSetAttribute set (0 otherwise).
func (d *Driver) FuncGetAttribute(f driver.Function, attr driver.FuncAttribute) (int, error) {
	unlock, err := d.lock("FuncGetAttribute", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	fn, err := d.function(f)
	if err != nil {
		return 0, err
	}
	return fn.attrs[attr], nil
}

// FuncSetAttribute records the attribute; LaunchKernel honours the dynamic shared memory limit.
func (d *Driver) FuncSetAttribute(f driver.Function, attr driver.FuncAttribute, value int) error {
	unlock, err := d.lock("FuncSetAttribute", true)
	defer unlock()
	if err != nil {
		return err
	}
	fn, err := d.function(f)
	if err != nil {
		return err
	}
	if attr == driver.FuncAttrMaxDynamicSharedSizeBytes && (value < 0 || value > 232448) {
		return fmt.Errorf("pyep: fake: %d bytes of dynamic shared memory: %w", value, driver.ErrorInvalidValue)
	}
	fn.attrs[attr] = value
	return nil
}

// LaunchKernel checks the launch as the real driver would, then runs the kernel at once.
func (d *Driver) LaunchKernel(f driver.Function, grid, block [3]uint32, sharedBytes uint32, s driver.Stream, args driver.KernelArgs) error {
	d.w.mu.Lock()
	err := d.enterCtx("LaunchKernel")
	if err == nil {
		err = d.stream(s)
	}
	var fn *function
	if err == nil {
		fn, err = d.function(f)
	}
	if err == nil {
		threads := uint64(block[0]) * uint64(block[1]) * uint64(block[2])
		limit := max(48<<10, fn.attrs[driver.FuncAttrMaxDynamicSharedSizeBytes])
		switch {
		case grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || threads == 0 || threads > 1024:
			err = fmt.Errorf("pyep: fake: launching %s with grid %v, block %v: %w", fn.name, grid, block, driver.ErrorInvalidValue)
		case int(sharedBytes) > limit:
			err = fmt.Errorf("pyep: fake: launching %s with %d bytes of dynamic shared memory, limit %d (FuncAttrMaxDynamicSharedSizeBytes): %w", fn.name, sharedBytes, limit, driver.ErrorInvalidValue)
		}
	}
	d.w.mu.Unlock()
	if err != nil {
		return err
	}
	// The kernel runs unlocked: it reaches memory through d.Bytes.
	l := &Launch{Driver: d, Name: fn.name, Grid: grid, Block: block, SharedBytes: sharedBytes, Stream: s,
		Args: append([]unsafe.Pointer(nil), args.Slice()...)}
	if err := fn.kernel(l); err != nil {
		return fmt.Errorf("pyep: fake: kernel %s: %w", fn.name, err)
	}
	return nil
}

// StreamCreate makes a stream; flags and priority are accepted and ignored.
func (d *Driver) StreamCreate(flags driver.StreamFlags, priority int) (driver.Stream, error) {
	unlock, err := d.lock("StreamCreate", true)
	defer unlock()
	if err != nil {
		return driver.Stream{}, err
	}
	h := d.handle()
	d.streams[h] = true
	return driver.WrapStream(d, h), nil
}

// StreamDestroy forgets a stream (not the default stream 0).
func (d *Driver) StreamDestroy(s driver.Stream) error {
	unlock, err := d.lock("StreamDestroy", true)
	defer unlock()
	if err == nil && (s.Raw() == 0 || !d.streams[s.Raw()]) {
		err = fmt.Errorf("pyep: fake: destroying stream %#x: %w", s.Raw(), driver.ErrorInvalidHandle)
	}
	if err == nil {
		delete(d.streams, s.Raw())
	}
	return err
}

// StreamSynchronize has nothing to wait for.
func (d *Driver) StreamSynchronize(s driver.Stream) error {
	unlock, err := d.lock("StreamSynchronize", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	return err
}

// StreamQuery: always idle.
func (d *Driver) StreamQuery(s driver.Stream) (bool, error) {
	unlock, err := d.lock("StreamQuery", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	return err == nil, err
}

// StreamWaitEvent: work is done when queued, so there is nothing to wait for.
func (d *Driver) StreamWaitEvent(s driver.Stream, e driver.Event) error {
	unlock, err := d.lock("StreamWaitEvent", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err == nil {
		_, err = d.event(e)
	}
	return err
}

func (d *Driver) event(e driver.Event) (*event, error) {
	ev, ok := d.events[e.Raw()]
	if !ok {
		return nil, fmt.Errorf("pyep: fake: event %#x: %w", e.Raw(), driver.ErrorInvalidHandle)
	}
	return ev, nil
}

// EventCreate makes an event.
func (d *Driver) EventCreate(flags driver.EventFlags) (driver.Event, error) {
	unlock, err := d.lock("EventCreate", true)
	defer unlock()
	if err != nil {
		return driver.Event{}, err
	}
	h := d.handle()
	d.events[h] = &event{flags: flags}
	return driver.WrapEvent(d, h), nil
}

// EventRecord stamps the event with the host clock.
func (d *Driver) EventRecord(e driver.Event, s driver.Stream) error {
	unlock, err := d.lock("EventRecord", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	var ev *event
	if err == nil {
		ev, err = d.event(e)
	}
	if err == nil {
		ev.recorded, ev.at = true, time.Now()
	}
	return err
}

// EventQuery: always complete.
func (d *Driver) EventQuery(e driver.Event) (bool, error) {
	unlock, err := d.lock("EventQuery", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	return err == nil, err
}

// EventSynchronize has nothing to wait for.
func (d *Driver) EventSynchronize(e driver.Event) error {
	unlock, err := d.lock("EventSynchronize", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	return err
}

// EventDestroy forgets an event.
func (d *Driver) EventDestroy(e driver.Event) error {
	unlock, err := d.lock("EventDestroy", true)
	defer unlock()
	if err == nil {
		_, err = d.event(e)
	}
	if err == nil {
		delete(d.events, e.Raw())
	}
	return err
}

// EventElapsedTime is the host time between the records; like the real driver it refuses
// events created with EventDisableTiming or never recorded.
func (d *Driver) EventElapsedTime(start, end driver.Event) (float32, error) {
	unlock, err := d.lock("EventElapsedTime", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.event(start)
	if err != nil {
		return 0, err
	}
	b, err := d.event(end)
	if err != nil {
		return 0, err
	}
	if !a.recorded || !b.recorded || a.flags&driver.EventDisableTiming != 0 || b.flags&driver.EventDisableTiming != 0 {
		return 0, fmt.Errorf("pyep: fake: elapsed time between untimed or unrecorded events: %w", driver.ErrorInvalidHandle)
	}
	return float32(b.at.Sub(a.at).Seconds() * 1e3), nil
}

func putUint64(b []byte, v uint64) {
	for i := 0; i < 8; i++ {
		b[i] = byte(v >> (8 * i))
	}
}

func getUint64(b []byte) uint64 {
	var v uint64
	for i := 0; i < 8; i++ {
		v |= uint64(b[i]) << (8 * i)
	}
	return v
}
