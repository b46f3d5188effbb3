// Package fake implements driver.Driver over host memory, for testing code above goep/cuda on
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
// Beyond the interface, a Driver counts calls, reports live allocations (leak checks), can be
// told to fail a call (FailNext), to exercise error handling, and can track which launches a GPU
// would order after which (TrackOrder, order.go), to check the stream order.
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
	order      *orderState // TrackOrder's; nil until then
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
