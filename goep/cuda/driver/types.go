package driver

import (
	"fmt"
	"time"
	"unsafe"
)

// DevicePtr is a CUdeviceptr: an address in the unified virtual address space, of device
// memory, of a peer's memory opened through IPC, or of host memory mapped for the device.
// Kernels take it by value (pass unsafe.Pointer(&p) to Launch).
type DevicePtr uint64

// Add offsets p by n bytes.
func (p DevicePtr) Add(n int) DevicePtr { return p + DevicePtr(n) }

// IpcMemHandle is a CUipcMemHandle: an opaque 64-byte token that another process on the same
// host passes to IpcOpenMemHandle to map the same device memory. Ranks exchange these through
// the process group to build their NVLink buffers.
type IpcMemHandle [64]byte

// MemHandle is a CUmemGenericAllocationHandle: physical memory made by MemCreate or imported
// from another process, mapped into an address range with MemMap.
type MemHandle uint64

// MemHandleType is a CUmemAllocationHandleType: how memory made by MemCreate may be shared.
// The values are bits; pyep requests one kind per allocation.
type MemHandleType uint32

// The handle types pyep shares memory with.
const (
	MemHandleNone MemHandleType = 0
	// MemHandlePosixFD: a file descriptor, which another process of the host receives over
	// a Unix-domain socket (SCM_RIGHTS).
	MemHandlePosixFD MemHandleType = 1
	// MemHandleFabric: a FabricHandle, plain bytes that any process of the NVLink fabric
	// imports; it needs an IMEX channel (/dev/nvidia-caps-imex-channels).
	MemHandleFabric MemHandleType = 8
)

// FabricHandle is a CUmemFabricHandle, the exported form of fabric-shareable memory.
type FabricHandle [64]byte

// MemAllocationProp is the part of CUmemAllocationProp that pyep sets: pinned device memory
// on Location, exportable as HandleTypes.
type MemAllocationProp struct {
	Location    Device
	HandleTypes MemHandleType
}

// GranularityOption is a CUmemAllocationGranularity_flags.
type GranularityOption int32

// Granularity options.
const (
	GranularityMinimum     GranularityOption = 0
	GranularityRecommended GranularityOption = 1
)

// MemAccessFlags are CUmemAccess_flags.
type MemAccessFlags int32

// Access flags.
const (
	MemAccessNone      MemAccessFlags = 0
	MemAccessRead      MemAccessFlags = 1
	MemAccessReadWrite MemAccessFlags = 3
)

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

// The device attributes pyep reads.
const (
	AttrMaxThreadsPerBlock           DeviceAttribute = 1
	AttrClockRate                    DeviceAttribute = 13 // kHz
	AttrMultiprocessorCount          DeviceAttribute = 16
	AttrCanMapHostMemory             DeviceAttribute = 19
	AttrPCIBusID                     DeviceAttribute = 33
	AttrL2CacheSize                  DeviceAttribute = 38
	AttrUnifiedAddressing            DeviceAttribute = 41
	AttrComputeCapabilityMajor       DeviceAttribute = 75
	AttrComputeCapabilityMinor       DeviceAttribute = 76
	AttrMaxSharedMemoryPerBlockOptin DeviceAttribute = 97
	// AttrVirtualMemoryManagement: cuMemCreate, cuMemAddressReserve, cuMemMap and the rest.
	AttrVirtualMemoryManagement DeviceAttribute = 102
	// AttrHandleTypePosixFD: MemExportToFD works for memory created with MemHandlePosixFD.
	AttrHandleTypePosixFD DeviceAttribute = 103
	// AttrHandleTypeFabric: MemExportToFabric works for memory created with MemHandleFabric
	// (the driver and the GPU support it; an IMEX channel is still needed to use it).
	AttrHandleTypeFabric DeviceAttribute = 128
)

// FuncAttribute is a CUfunction_attribute.
type FuncAttribute int32

// The function attributes pyep reads or sets.
const (
	FuncAttrMaxThreadsPerBlock FuncAttribute = 0
	FuncAttrSharedSizeBytes    FuncAttribute = 1
	FuncAttrNumRegs            FuncAttribute = 4
	// FuncAttrMaxDynamicSharedSizeBytes must be raised before launching with more than 48 KiB
	// of dynamic shared memory.
	FuncAttrMaxDynamicSharedSizeBytes FuncAttribute = 8
)

// PointerAttribute is a CUpointer_attribute.
type PointerAttribute int32

// The pointer attributes pyep reads.
const (
	PointerAttrContext        PointerAttribute = 1
	PointerAttrMemoryType     PointerAttribute = 2 // a MemoryType
	PointerAttrDevicePointer  PointerAttribute = 3
	PointerAttrDeviceOrdinal  PointerAttribute = 9
	PointerAttrRangeStartAddr PointerAttribute = 11
	PointerAttrRangeSize      PointerAttribute = 12
)

// MemoryType is a CUmemorytype, the value of PointerAttrMemoryType.
type MemoryType uint32

// Memory types.
const (
	MemoryTypeHost    MemoryType = 1
	MemoryTypeDevice  MemoryType = 2
	MemoryTypeArray   MemoryType = 3
	MemoryTypeUnified MemoryType = 4
)

// StreamFlags are CUstream_flags.
type StreamFlags uint32

// Stream flags.
const (
	StreamDefault StreamFlags = 0
	// StreamNonBlocking: no implicit synchronisation with the legacy default stream, so that
	// communication never waits behind unrelated work that some library put there.
	StreamNonBlocking StreamFlags = 1
)

// EventFlags are CUevent_flags.
type EventFlags uint32

// Event flags.
const (
	EventDefault      EventFlags = 0
	EventBlockingSync EventFlags = 1
	// EventDisableTiming makes record and wait cheaper; use it for events that only order
	// streams.
	EventDisableTiming EventFlags = 2
	EventInterprocess  EventFlags = 4
)

// HostAllocFlags are cuMemHostAlloc's flags.
type HostAllocFlags uint32

// Host allocation flags.
const (
	HostAllocPortable HostAllocFlags = 1
	// HostAllocDeviceMap maps the memory into the device address space: this is how kernels
	// report counters and errors that the CPU polls while they run.
	HostAllocDeviceMap     HostAllocFlags = 2
	HostAllocWriteCombined HostAllocFlags = 4
)

// Device is a CUDA device of a Driver.
type Device struct {
	drv Driver
	dev int
}

// NewDevice wraps the driver's device handle dev (a CUdevice, which is its ordinal). Drivers
// call it; others get Devices from Driver.DeviceGet.
func NewDevice(d Driver, dev int) Device { return Device{d, dev} }

// Driver is the driver d belongs to.
func (d Device) Driver() Driver { return d.drv }

// Ordinal is the CUdevice value, which CUDA numbers like the visible devices.
func (d Device) Ordinal() int { return d.dev }

// Attribute reads a device attribute.
func (d Device) Attribute(a DeviceAttribute) (int, error) { return d.drv.DeviceGetAttribute(d, a) }

// Name is the product name, e.g. "NVIDIA H200".
func (d Device) Name() (string, error) { return d.drv.DeviceGetName(d) }

// PCIBusID is the device's PCI address, e.g. "0000:19:00.0": ranks compare these to tell
// which GPUs share a host.
func (d Device) PCIBusID() (string, error) { return d.drv.DeviceGetPCIBusID(d) }

// TotalMem is the device memory in bytes.
func (d Device) TotalMem() (int, error) { return d.drv.DeviceTotalMem(d) }

// CanAccessPeer reports whether d can map peer's memory (over NVLink or PCIe).
func (d Device) CanAccessPeer(peer Device) (bool, error) { return d.drv.DeviceCanAccessPeer(d, peer) }

// ComputeCapability is the (major, minor) version, e.g. (9, 0) for Hopper.
func (d Device) ComputeCapability() (major, minor int, err error) {
	if major, err = d.Attribute(AttrComputeCapabilityMajor); err != nil {
		return 0, 0, err
	}
	minor, err = d.Attribute(AttrComputeCapabilityMinor)
	return major, minor, err
}

// Arch is the real architecture to compile kernels for, e.g. "sm_90".
func (d Device) Arch() (string, error) {
	major, minor, err := d.ComputeCapability()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("sm_%d%d", major, minor), nil
}

// PrimaryContext retains the device's primary context, the one the CUDA runtime and thus
// PyTorch use, so that pointers, streams and events are shared with PyTorch's. Release it
// when done.
func (d Device) PrimaryContext() (Context, error) { return d.drv.DevicePrimaryCtxRetain(d) }

// Context is a CUcontext.
type Context struct {
	drv Driver
	h   uintptr
	dev Device
}

// NewContext wraps a driver's raw CUcontext of device dev.
func NewContext(d Driver, raw uintptr, dev Device) Context { return Context{d, raw, dev} }

// Raw is the CUcontext.
func (c Context) Raw() uintptr { return c.h }

// Device is the context's device.
func (c Context) Device() Device { return c.dev }

// MakeCurrent binds c to the calling OS thread. The driver's current context is per thread
// while goroutines move between threads, so call it at every entry from Go, between
// runtime.LockOSThread and the calls that need it. It is cheap when c is already current.
func (c Context) MakeCurrent() error { return c.drv.CtxSetCurrent(c) }

// Synchronize waits for all work in the context; c must be current.
func (c Context) Synchronize() error { return c.drv.CtxSynchronize() }

// Release drops the reference PrimaryContext took.
func (c Context) Release() error { return c.drv.DevicePrimaryCtxRelease(c.dev) }

// Stream is a CUstream: one we created, or one we were handed such as PyTorch's current
// stream (torch.cuda.current_stream().cuda_stream).
type Stream struct {
	drv Driver
	h   uintptr
}

// StreamPerThread is CU_STREAM_PER_THREAD: a handle that names the calling OS thread's own default
// stream, so the same value is another stream on another thread (0 and CU_STREAM_LEGACY, 0x1,
// name the context's one legacy default stream).
const StreamPerThread uintptr = 0x2

// WrapStream wraps a raw CUstream of d; 0 is the legacy default stream.
func WrapStream(d Driver, raw uintptr) Stream { return Stream{d, raw} }

// Raw is the CUstream.
func (s Stream) Raw() uintptr { return s.h }

// Synchronize waits for all work queued on s.
func (s Stream) Synchronize() error { return s.drv.StreamSynchronize(s) }

// Query reports whether all work queued on s has completed.
func (s Stream) Query() (bool, error) { return s.drv.StreamQuery(s) }

// WaitEvent makes work queued on s after this call wait for e's last record.
func (s Stream) WaitEvent(e Event) error { return s.drv.StreamWaitEvent(s, e) }

// Destroy destroys a stream we created (never a wrapped one we do not own).
func (s Stream) Destroy() error { return s.drv.StreamDestroy(s) }

// Event is a CUevent.
type Event struct {
	drv Driver
	h   uintptr
}

// WrapEvent wraps a driver's raw CUevent.
func WrapEvent(d Driver, raw uintptr) Event { return Event{d, raw} }

// Raw is the CUevent.
func (e Event) Raw() uintptr { return e.h }

// Record captures the work queued on s so far.
func (e Event) Record(s Stream) error { return e.drv.EventRecord(e, s) }

// Query reports whether the recorded work has completed.
func (e Event) Query() (bool, error) { return e.drv.EventQuery(e) }

// Synchronize waits for the recorded work.
func (e Event) Synchronize() error { return e.drv.EventSynchronize(e) }

// Destroy frees the event.
func (e Event) Destroy() error { return e.drv.EventDestroy(e) }

// Elapsed is the GPU time from e's record to end's (both recorded, without
// EventDisableTiming), at the driver's resolution of about half a microsecond.
func (e Event) Elapsed(end Event) (time.Duration, error) {
	ms, err := e.drv.EventElapsedTime(e, end)
	return time.Duration(float64(ms) * float64(time.Millisecond)), err
}

// Module is a CUmodule: a loaded cubin (or PTX).
type Module struct {
	drv Driver
	h   uintptr
}

// WrapModule wraps a driver's raw CUmodule.
func WrapModule(d Driver, raw uintptr) Module { return Module{d, raw} }

// Raw is the CUmodule.
func (m Module) Raw() uintptr { return m.h }

// Function looks up a kernel by name (kernels are extern "C", so the name is as written).
func (m Module) Function(name string) (Function, error) { return m.drv.ModuleGetFunction(m, name) }

// Unload frees the module; its Functions become invalid.
func (m Module) Unload() error { return m.drv.ModuleUnload(m) }

// Function is a CUfunction, a kernel entry point.
type Function struct {
	drv  Driver
	h    uintptr
	name string
}

// WrapFunction wraps a driver's raw CUfunction; name is for messages.
func WrapFunction(d Driver, raw uintptr, name string) Function { return Function{d, raw, name} }

// Raw is the CUfunction.
func (f Function) Raw() uintptr { return f.h }

// Name is the kernel's name.
func (f Function) Name() string { return f.name }

// Attribute reads a function attribute.
func (f Function) Attribute(a FuncAttribute) (int, error) { return f.drv.FuncGetAttribute(f, a) }

// SetAttribute sets a function attribute, e.g. FuncAttrMaxDynamicSharedSizeBytes.
func (f Function) SetAttribute(a FuncAttribute, v int) error { return f.drv.FuncSetAttribute(f, a, v) }

// MaxKernelArgs bounds the parameters of one launch; pyep's largest kernels take about 40.
const MaxKernelArgs = 64

// KernelArgs carries a launch's parameters by value, in a fixed array, so that a launch needs
// no heap allocation for them: P[i] points at the i-th parameter's value.
type KernelArgs struct {
	N int
	P [MaxKernelArgs]unsafe.Pointer
}

// Slice is the N parameters in use.
func (a *KernelArgs) Slice() []unsafe.Pointer { return a.P[:a.N] }

// Launch queues f on stream over grid×block threads with sharedBytes of dynamic shared memory.
// Each args[i] points at the value of the kernel's i-th parameter, e.g. unsafe.Pointer(&ptr)
// for a DevicePtr parameter; the values are copied at launch, so they may change afterwards.
// They must be pointer-free Go values (cgo checks this). Keep them in a long-lived struct,
// reused across launches, rather than in fresh locals, and a launch allocates nothing: Go puts
// anything whose address reaches C on the heap.
func (f Function) Launch(grid, block [3]uint32, sharedBytes uint32, stream Stream, args ...unsafe.Pointer) error {
	if len(args) > MaxKernelArgs {
		return fmt.Errorf("pyep: launching %s: %d arguments, at most %d supported", f.name, len(args), MaxKernelArgs)
	}
	var ka KernelArgs
	ka.N = copy(ka.P[:], args)
	return f.drv.LaunchKernel(f, grid, block, sharedBytes, stream, ka)
}
