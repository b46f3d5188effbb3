package driver

import "unsafe"

// Driver is the part of the CUDA driver API that pyep's cuda backend uses. Open returns the
// real one (libcuda through dlopen); goep/cuda/driver/fake implements it over host memory, so that the
// backend's logic (buffer layout, IPC handle exchange, launch plumbing, error paths) is tested
// on machines without a GPU. The handle types (Device, Stream, ...) carry their Driver, so code
// written against them runs unchanged on either.
//
// Except for the Device* calls, calls act on the calling OS thread's current context: see
// Context.MakeCurrent. Sizes are in bytes. Errors wrap a Result.
type Driver interface {
	// DriverVersion is the CUDA version the driver supports, e.g. 13000 for 13.0.
	DriverVersion() (int, error)
	DeviceCount() (int, error)
	DeviceGet(ordinal int) (Device, error)
	DeviceGetAttribute(dev Device, attr DeviceAttribute) (int, error)
	DeviceGetName(dev Device) (string, error)
	DeviceGetPCIBusID(dev Device) (string, error)
	DeviceTotalMem(dev Device) (int, error)
	DeviceCanAccessPeer(dev, peer Device) (bool, error)

	DevicePrimaryCtxRetain(dev Device) (Context, error)
	DevicePrimaryCtxRelease(dev Device) error
	// CtxSetCurrent binds ctx to the calling OS thread (a no-op when it already is).
	CtxSetCurrent(ctx Context) error
	// CtxGetCurrent is the calling thread's context; Raw() == 0 when there is none.
	CtxGetCurrent() (Context, error)
	CtxSynchronize() error
	// CtxGetStreamPriorityRange: numerically lower priorities are scheduled first.
	CtxGetStreamPriorityRange() (least, greatest int, err error)

	MemGetInfo() (free, total int, err error)
	MemAlloc(bytes int) (DevicePtr, error)
	MemFree(p DevicePtr) error
	MemsetD8(p DevicePtr, value byte, bytes int) error
	MemsetD8Async(p DevicePtr, value byte, bytes int, s Stream) error
	MemcpyHtoD(dst DevicePtr, src []byte) error
	MemcpyDtoH(dst []byte, src DevicePtr) error
	// MemcpyAsync copies between any two addresses of the unified address space.
	MemcpyAsync(dst, src DevicePtr, bytes int, s Stream) error
	// MemHostAlloc allocates page-locked host memory; with HostAllocDeviceMap the device
	// reaches it at MemHostGetDevicePointer(p).
	MemHostAlloc(bytes int, flags HostAllocFlags) (unsafe.Pointer, error)
	MemHostGetDevicePointer(p unsafe.Pointer) (DevicePtr, error)
	MemFreeHost(p unsafe.Pointer) error
	// PointerGetAttribute returns the attribute widened to 64 bits (a MemoryType, an ordinal, a
	// DevicePtr, a size or a raw CUcontext, by attr).
	PointerGetAttribute(attr PointerAttribute, p DevicePtr) (uint64, error)

	// IpcGetMemHandle exports an allocation made by MemAlloc (p must be its start).
	IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error)
	// IpcOpenMemHandle maps another process's allocation into the current context, enabling
	// peer access as needed.
	IpcOpenMemHandle(h IpcMemHandle) (DevicePtr, error)
	IpcCloseMemHandle(p DevicePtr) error

	// The virtual memory management calls (cuMem*): physical memory (MemCreate, or imported
	// from another process) is mapped into a reserved address range and made accessible to a
	// device. Sizes and addresses are multiples of MemGetAllocationGranularity.

	MemGetAllocationGranularity(prop MemAllocationProp, option GranularityOption) (int, error)
	MemCreate(bytes int, prop MemAllocationProp) (MemHandle, error)
	// MemRelease drops a handle; the memory lives on while any process maps it.
	MemRelease(h MemHandle) error
	// MemAddressReserve reserves an address range; alignment 0 is the granularity.
	MemAddressReserve(bytes, alignment int) (DevicePtr, error)
	MemAddressFree(p DevicePtr, bytes int) error
	// MemMap maps the first bytes of h's memory at p, within a reserved range.
	MemMap(p DevicePtr, bytes int, h MemHandle) error
	MemUnmap(p DevicePtr, bytes int) error
	// MemSetAccess grants dev access to the mapped range [p, p+bytes).
	MemSetAccess(p DevicePtr, bytes int, dev Device, flags MemAccessFlags) error
	// MemExportToFD is cuMemExportToShareableHandle for MemHandlePosixFD: a new file
	// descriptor, which the caller closes.
	MemExportToFD(h MemHandle) (int, error)
	// MemExportToFabric is cuMemExportToShareableHandle for MemHandleFabric.
	MemExportToFabric(h MemHandle) (FabricHandle, error)
	// MemImportFromFD is cuMemImportFromShareableHandle for MemHandlePosixFD; the caller still
	// owns fd (and closes it).
	MemImportFromFD(fd int) (MemHandle, error)
	// MemImportFromFabric is cuMemImportFromShareableHandle for MemHandleFabric.
	MemImportFromFabric(fh FabricHandle) (MemHandle, error)

	// ModuleLoadData loads a cubin or PTX image (PTX need not be NUL-terminated).
	ModuleLoadData(image []byte) (Module, error)
	ModuleGetFunction(m Module, name string) (Function, error)
	ModuleUnload(m Module) error
	FuncGetAttribute(f Function, attr FuncAttribute) (int, error)
	FuncSetAttribute(f Function, attr FuncAttribute, value int) error
	// LaunchKernel takes args by value: through an interface, a pointer would make every
	// launch allocate.
	LaunchKernel(f Function, grid, block [3]uint32, sharedBytes uint32, s Stream, args KernelArgs) error

	StreamCreate(flags StreamFlags, priority int) (Stream, error)
	StreamDestroy(s Stream) error
	StreamSynchronize(s Stream) error
	// StreamQuery reports whether s is idle (CUDA_ERROR_NOT_READY is "false", not an error).
	StreamQuery(s Stream) (bool, error)
	StreamWaitEvent(s Stream, e Event) error

	EventCreate(flags EventFlags) (Event, error)
	EventRecord(e Event, s Stream) error
	// EventQuery reports whether e's work is done (CUDA_ERROR_NOT_READY is "false").
	EventQuery(e Event) (bool, error)
	EventSynchronize(e Event) error
	EventDestroy(e Event) error
	// EventElapsedTime is the time between two recorded events, in milliseconds.
	EventElapsedTime(start, end Event) (float32, error)
}
