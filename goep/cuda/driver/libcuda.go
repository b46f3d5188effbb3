//go:build cgo

package driver

/*
#cgo LDFLAGS: -ldl
#include "libcuda.h"
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/pyep/pyep/goep/dl"
)

// libcudaName is the driver's soname: the one file every driver install provides, without a
// toolkit (libcuda.so without the .1 only comes with development packages).
const libcudaName = "libcuda.so.1"

var (
	openOnce sync.Once
	openErr  error
	theLib   = &libcuda{}
)

// Open loads the CUDA driver on first use and initialises it; later calls return the same
// result. Nothing is loaded before: a process that only uses the cpu backend never touches
// libcuda.
func Open() (Driver, error) {
	openOnce.Do(func() { openErr = load(libcudaName) })
	if openErr != nil {
		return nil, openErr
	}
	return theLib, nil
}

// cuTable is the driver's entry points as goep/dl resolves them, from pyep_cu_names.
func cuTable() []dl.Symbol {
	table := make([]dl.Symbol, C.CU_COUNT)
	for i := range table {
		for alt := range 2 {
			if n := C.pyep_cu_name(C.int(i), C.int(alt)); n != nil {
				table[i] = append(table[i], C.GoString(n))
			}
		}
	}
	return table
}

func load(name string) error {
	lib, err := dl.Open(name, cuTable(), dl.Options{})
	var missing *dl.MissingError
	switch {
	case errors.As(err, &missing):
		return fmt.Errorf("pyep: the CUDA driver (%s) lacks %s (%s): it is older than pyep supports; update the NVIDIA driver",
			name, missing.Symbol, missing.Detail)
	case err != nil:
		var open *dl.OpenError
		if errors.As(err, &open) {
			err = errors.New(open.Detail)
		}
		return fmt.Errorf("pyep: cannot load the CUDA driver (%s): %v; the cpu backend needs none", name, err)
	}
	for i, fp := range lib.Addrs {
		C.pyep_cu_set(C.int(i), C.uintptr_t(fp))
	}
	loaded.Store(true)
	if r := Result(C.pyep_cuInit(0)); r != Success {
		return fmt.Errorf("pyep: the CUDA driver (%s) loaded, but cuInit failed: %w", name, r)
	}
	return nil
}

// driverErrorText asks the loaded driver to name r.
func driverErrorText(r Result) (name, desc string, ok bool) {
	if !loaded.Load() {
		return "", "", false
	}
	var n, d *C.char
	if C.pyep_cuGetErrorName(C.CUresult(r), &n) != 0 || n == nil {
		return "", "", false
	}
	if C.pyep_cuGetErrorString(C.CUresult(r), &d) != 0 || d == nil {
		return C.GoString(n), "", true
	}
	return C.GoString(n), C.GoString(d), true
}

// libcuda is the real Driver. It is stateless: all state is the driver's.
type libcuda struct{}

func res(r C.CUresult) Result { return Result(r) }

func sizeOK(op string, n int) error {
	if n < 0 {
		return fmt.Errorf("pyep: %s: negative size %d: %w", op, n, ErrorInvalidValue)
	}
	return nil
}

func (l *libcuda) DriverVersion() (int, error) {
	var v C.int
	return int(v), wrap("cuDriverGetVersion", res(C.pyep_cuDriverGetVersion(&v)))
}

func (l *libcuda) DeviceCount() (int, error) {
	var n C.int
	return int(n), wrap("cuDeviceGetCount", res(C.pyep_cuDeviceGetCount(&n)))
}

func (l *libcuda) DeviceGet(ordinal int) (Device, error) {
	var d C.CUdevice
	if err := wrap(fmt.Sprintf("cuDeviceGet(%d)", ordinal), res(C.pyep_cuDeviceGet(&d, C.int(ordinal)))); err != nil {
		return Device{}, err
	}
	return NewDevice(l, int(d)), nil
}

func (l *libcuda) DeviceGetAttribute(dev Device, attr DeviceAttribute) (int, error) {
	var v C.int
	r := res(C.pyep_cuDeviceGetAttribute(&v, C.int(attr), C.CUdevice(dev.dev)))
	if r != Success {
		return 0, wrap(fmt.Sprintf("cuDeviceGetAttribute(%d, device %d)", attr, dev.dev), r)
	}
	return int(v), nil
}

func (l *libcuda) DeviceGetName(dev Device) (string, error) {
	var buf [256]C.char
	if err := wrap("cuDeviceGetName", res(C.pyep_cuDeviceGetName(&buf[0], C.int(len(buf)), C.CUdevice(dev.dev)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (l *libcuda) DeviceGetPCIBusID(dev Device) (string, error) {
	var buf [64]C.char
	if err := wrap("cuDeviceGetPCIBusId", res(C.pyep_cuDeviceGetPCIBusId(&buf[0], C.int(len(buf)), C.CUdevice(dev.dev)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (l *libcuda) DeviceTotalMem(dev Device) (int, error) {
	var n C.size_t
	return int(n), wrap("cuDeviceTotalMem_v2", res(C.pyep_cuDeviceTotalMem(&n, C.CUdevice(dev.dev))))
}

func (l *libcuda) DeviceCanAccessPeer(dev, peer Device) (bool, error) {
	var ok C.int
	err := wrap(fmt.Sprintf("cuDeviceCanAccessPeer(%d, %d)", dev.dev, peer.dev),
		res(C.pyep_cuDeviceCanAccessPeer(&ok, C.CUdevice(dev.dev), C.CUdevice(peer.dev))))
	return ok != 0, err
}

func (l *libcuda) DevicePrimaryCtxRetain(dev Device) (Context, error) {
	var c C.uintptr_t
	if err := wrap(fmt.Sprintf("cuDevicePrimaryCtxRetain(device %d)", dev.dev), res(C.pyep_cuDevicePrimaryCtxRetain(&c, C.CUdevice(dev.dev)))); err != nil {
		return Context{}, err
	}
	return NewContext(l, uintptr(c), dev), nil
}

func (l *libcuda) DevicePrimaryCtxRelease(dev Device) error {
	return wrap("cuDevicePrimaryCtxRelease_v2", res(C.pyep_cuDevicePrimaryCtxRelease(C.CUdevice(dev.dev))))
}

func (l *libcuda) CtxSetCurrent(ctx Context) error {
	return wrap("cuCtxSetCurrent", res(C.pyep_make_current(C.uintptr_t(ctx.h))))
}

func (l *libcuda) CtxGetCurrent() (Context, error) {
	var c C.uintptr_t
	var d C.CUdevice
	if err := wrap("cuCtxGetCurrent", res(C.pyep_get_current(&c, &d))); err != nil {
		return Context{}, err
	}
	return NewContext(l, uintptr(c), NewDevice(l, int(d))), nil
}

func (l *libcuda) CtxSynchronize() error {
	return wrap("cuCtxSynchronize", res(C.pyep_cuCtxSynchronize()))
}

func (l *libcuda) CtxGetStreamPriorityRange() (least, greatest int, err error) {
	var lo, hi C.int
	err = wrap("cuCtxGetStreamPriorityRange", res(C.pyep_cuCtxGetStreamPriorityRange(&lo, &hi)))
	return int(lo), int(hi), err
}

func (l *libcuda) MemGetInfo() (free, total int, err error) {
	var f, t C.size_t
	err = wrap("cuMemGetInfo_v2", res(C.pyep_cuMemGetInfo(&f, &t)))
	return int(f), int(t), err
}

func (l *libcuda) MemAlloc(bytes int) (DevicePtr, error) {
	if err := sizeOK("cuMemAlloc_v2", bytes); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	if err := wrap(fmt.Sprintf("cuMemAlloc_v2(%d bytes)", bytes), res(C.pyep_cuMemAlloc(&p, C.size_t(bytes)))); err != nil {
		return 0, err
	}
	return DevicePtr(p), nil
}

func (l *libcuda) MemFree(p DevicePtr) error {
	return wrap("cuMemFree_v2", res(C.pyep_cuMemFree(C.CUdeviceptr(p))))
}

func (l *libcuda) MemsetD8(p DevicePtr, value byte, bytes int) error {
	if err := sizeOK("cuMemsetD8_v2", bytes); err != nil {
		return err
	}
	return wrap("cuMemsetD8_v2", res(C.pyep_cuMemsetD8(C.CUdeviceptr(p), C.uchar(value), C.size_t(bytes))))
}

func (l *libcuda) MemsetD8Async(p DevicePtr, value byte, bytes int, s Stream) error {
	if err := sizeOK("cuMemsetD8Async", bytes); err != nil {
		return err
	}
	return wrap("cuMemsetD8Async", res(C.pyep_cuMemsetD8Async(C.CUdeviceptr(p), C.uchar(value), C.size_t(bytes), C.uintptr_t(s.h))))
}

func (l *libcuda) MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return wrap("cuMemcpyHtoD_v2", res(C.pyep_cuMemcpyHtoD(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)))))
}

func (l *libcuda) MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	return wrap("cuMemcpyDtoH_v2", res(C.pyep_cuMemcpyDtoH(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)))))
}

func (l *libcuda) MemcpyAsync(dst, src DevicePtr, bytes int, s Stream) error {
	if err := sizeOK("cuMemcpyAsync", bytes); err != nil {
		return err
	}
	return wrap("cuMemcpyAsync", res(C.pyep_cuMemcpyAsync(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(bytes), C.uintptr_t(s.h))))
}

func (l *libcuda) MemHostAlloc(bytes int, flags HostAllocFlags) (unsafe.Pointer, error) {
	if err := sizeOK("cuMemHostAlloc", bytes); err != nil {
		return nil, err
	}
	var r C.CUresult
	p := C.pyep_cuMemHostAlloc(C.size_t(bytes), C.uint(flags), &r)
	if err := wrap(fmt.Sprintf("cuMemHostAlloc(%d bytes)", bytes), res(r)); err != nil {
		return nil, err
	}
	return p, nil
}

func (l *libcuda) MemHostGetDevicePointer(p unsafe.Pointer) (DevicePtr, error) {
	var d C.CUdeviceptr
	if err := wrap("cuMemHostGetDevicePointer_v2", res(C.pyep_cuMemHostGetDevicePointer(&d, p))); err != nil {
		return 0, err
	}
	return DevicePtr(d), nil
}

func (l *libcuda) MemFreeHost(p unsafe.Pointer) error {
	return wrap("cuMemFreeHost", res(C.pyep_cuMemFreeHost(p)))
}

func (l *libcuda) PointerGetAttribute(attr PointerAttribute, p DevicePtr) (uint64, error) {
	var v C.ulonglong
	if err := wrap(fmt.Sprintf("cuPointerGetAttribute(%d)", attr), res(C.pyep_cuPointerGetAttribute(&v, C.int(attr), C.CUdeviceptr(p)))); err != nil {
		return 0, err
	}
	return uint64(v), nil
}

func (l *libcuda) IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	var h IpcMemHandle
	err := wrap("cuIpcGetMemHandle", res(C.pyep_cuIpcGetMemHandle((*C.pyep_ipc_handle)(unsafe.Pointer(&h)), C.CUdeviceptr(p))))
	return h, err
}

func (l *libcuda) IpcOpenMemHandle(h IpcMemHandle) (DevicePtr, error) {
	var p C.CUdeviceptr
	if err := wrap("cuIpcOpenMemHandle_v2", res(C.pyep_cuIpcOpenMemHandle(&p, *(*C.pyep_ipc_handle)(unsafe.Pointer(&h))))); err != nil {
		return 0, err
	}
	return DevicePtr(p), nil
}

func (l *libcuda) IpcCloseMemHandle(p DevicePtr) error {
	return wrap("cuIpcCloseMemHandle", res(C.pyep_cuIpcCloseMemHandle(C.CUdeviceptr(p))))
}

func (l *libcuda) MemGetAllocationGranularity(prop MemAllocationProp, option GranularityOption) (int, error) {
	var g C.size_t
	err := wrap("cuMemGetAllocationGranularity", res(C.pyep_cuMemGetAllocationGranularity(&g,
		C.int(prop.Location.dev), C.int(prop.HandleTypes), C.int(option))))
	return int(g), err
}

func (l *libcuda) MemCreate(bytes int, prop MemAllocationProp) (MemHandle, error) {
	if err := sizeOK("cuMemCreate", bytes); err != nil {
		return 0, err
	}
	var h C.CUmemGenericAllocationHandle
	r := res(C.pyep_cuMemCreate(&h, C.size_t(bytes), C.int(prop.Location.dev), C.int(prop.HandleTypes)))
	if r != Success {
		return 0, wrap(fmt.Sprintf("cuMemCreate(%d bytes on device %d, handle types %d)", bytes, prop.Location.dev, prop.HandleTypes), r)
	}
	return MemHandle(h), nil
}

func (l *libcuda) MemRelease(h MemHandle) error {
	return wrap("cuMemRelease", res(C.pyep_cuMemRelease(C.CUmemGenericAllocationHandle(h))))
}

func (l *libcuda) MemAddressReserve(bytes, alignment int) (DevicePtr, error) {
	if err := sizeOK("cuMemAddressReserve", bytes); err != nil {
		return 0, err
	}
	if err := sizeOK("cuMemAddressReserve alignment", alignment); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	if err := wrap(fmt.Sprintf("cuMemAddressReserve(%d bytes)", bytes), res(C.pyep_cuMemAddressReserve(&p, C.size_t(bytes), C.size_t(alignment)))); err != nil {
		return 0, err
	}
	return DevicePtr(p), nil
}

func (l *libcuda) MemAddressFree(p DevicePtr, bytes int) error {
	if err := sizeOK("cuMemAddressFree", bytes); err != nil {
		return err
	}
	return wrap("cuMemAddressFree", res(C.pyep_cuMemAddressFree(C.CUdeviceptr(p), C.size_t(bytes))))
}

func (l *libcuda) MemMap(p DevicePtr, bytes int, h MemHandle) error {
	if err := sizeOK("cuMemMap", bytes); err != nil {
		return err
	}
	return wrap(fmt.Sprintf("cuMemMap(%d bytes)", bytes), res(C.pyep_cuMemMap(C.CUdeviceptr(p), C.size_t(bytes), C.CUmemGenericAllocationHandle(h))))
}

func (l *libcuda) MemUnmap(p DevicePtr, bytes int) error {
	if err := sizeOK("cuMemUnmap", bytes); err != nil {
		return err
	}
	return wrap("cuMemUnmap", res(C.pyep_cuMemUnmap(C.CUdeviceptr(p), C.size_t(bytes))))
}

func (l *libcuda) MemSetAccess(p DevicePtr, bytes int, dev Device, flags MemAccessFlags) error {
	if err := sizeOK("cuMemSetAccess", bytes); err != nil {
		return err
	}
	return wrap(fmt.Sprintf("cuMemSetAccess(device %d)", dev.dev), res(C.pyep_cuMemSetAccess(C.CUdeviceptr(p), C.size_t(bytes), C.int(dev.dev), C.int(flags))))
}

func (l *libcuda) MemExportToFD(h MemHandle) (int, error) {
	var fd C.int
	if err := wrap("cuMemExportToShareableHandle(POSIX file descriptor)", res(C.pyep_cuMemExportToFD(&fd, C.CUmemGenericAllocationHandle(h)))); err != nil {
		return -1, err
	}
	return int(fd), nil
}

func (l *libcuda) MemExportToFabric(h MemHandle) (FabricHandle, error) {
	var fh FabricHandle
	err := wrap("cuMemExportToShareableHandle(fabric)", res(C.pyep_cuMemExportToFabric((*C.pyep_fabric_handle)(unsafe.Pointer(&fh)), C.CUmemGenericAllocationHandle(h))))
	return fh, err
}

func (l *libcuda) MemImportFromFD(fd int) (MemHandle, error) {
	var h C.CUmemGenericAllocationHandle
	if err := wrap("cuMemImportFromShareableHandle(POSIX file descriptor)", res(C.pyep_cuMemImportFromFD(&h, C.int(fd)))); err != nil {
		return 0, err
	}
	return MemHandle(h), nil
}

func (l *libcuda) MemImportFromFabric(fh FabricHandle) (MemHandle, error) {
	var h C.CUmemGenericAllocationHandle
	if err := wrap("cuMemImportFromShareableHandle(fabric)", res(C.pyep_cuMemImportFromFabric(&h, (*C.pyep_fabric_handle)(unsafe.Pointer(&fh))))); err != nil {
		return 0, err
	}
	return MemHandle(h), nil
}

func (l *libcuda) ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 {
		return Module{}, wrap("cuModuleLoadData(empty image)", ErrorInvalidImage)
	}
	// The driver reads PTX as a C string; cubins are ELF and carry their own size.
	if !bytes.HasPrefix(image, []byte("\x7fELF")) && image[len(image)-1] != 0 {
		image = append(image[:len(image):len(image)], 0)
	}
	var m C.uintptr_t
	if err := wrap("cuModuleLoadData", res(C.pyep_cuModuleLoadData(&m, unsafe.Pointer(&image[0])))); err != nil {
		return Module{}, err
	}
	return WrapModule(l, uintptr(m)), nil
}

func (l *libcuda) ModuleGetFunction(m Module, name string) (Function, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var f C.uintptr_t
	if err := wrap(fmt.Sprintf("cuModuleGetFunction(%q)", name), res(C.pyep_cuModuleGetFunction(&f, C.uintptr_t(m.h), cname))); err != nil {
		return Function{}, err
	}
	return WrapFunction(l, uintptr(f), name), nil
}

func (l *libcuda) ModuleUnload(m Module) error {
	return wrap("cuModuleUnload", res(C.pyep_cuModuleUnload(C.uintptr_t(m.h))))
}

func (l *libcuda) FuncGetAttribute(f Function, attr FuncAttribute) (int, error) {
	var v C.int
	if r := res(C.pyep_cuFuncGetAttribute(&v, C.int(attr), C.uintptr_t(f.h))); r != Success {
		return 0, wrap(fmt.Sprintf("cuFuncGetAttribute(%s, %d)", f.name, attr), r)
	}
	return int(v), nil
}

func (l *libcuda) FuncSetAttribute(f Function, attr FuncAttribute, value int) error {
	if r := res(C.pyep_cuFuncSetAttribute(C.uintptr_t(f.h), C.int(attr), C.int(value))); r != Success {
		return wrap(fmt.Sprintf("cuFuncSetAttribute(%s, %d, %d)", f.name, attr, value), r)
	}
	return nil
}

func (l *libcuda) LaunchKernel(f Function, grid, block [3]uint32, sharedBytes uint32, s Stream, args KernelArgs) error {
	var a C.pyep_kernel_args
	for i := 0; i < args.N; i++ {
		a.p[i] = args.P[i]
	}
	r := res(C.pyep_cuLaunchKernel(C.uintptr_t(f.h), C.uint(grid[0]), C.uint(grid[1]), C.uint(grid[2]),
		C.uint(block[0]), C.uint(block[1]), C.uint(block[2]), C.uint(sharedBytes), C.uintptr_t(s.h), a))
	if r != Success {
		return wrap(fmt.Sprintf("cuLaunchKernel(%s, grid %v, block %v, %d bytes shared)", f.name, grid, block, sharedBytes), r)
	}
	return nil
}

func (l *libcuda) StreamCreate(flags StreamFlags, priority int) (Stream, error) {
	var s C.uintptr_t
	if err := wrap("cuStreamCreateWithPriority", res(C.pyep_cuStreamCreate(&s, C.uint(flags), C.int(priority)))); err != nil {
		return Stream{}, err
	}
	return WrapStream(l, uintptr(s)), nil
}

func (l *libcuda) StreamDestroy(s Stream) error {
	return wrap("cuStreamDestroy_v2", res(C.pyep_cuStreamDestroy(C.uintptr_t(s.h))))
}

func (l *libcuda) StreamSynchronize(s Stream) error {
	return wrap("cuStreamSynchronize", res(C.pyep_cuStreamSynchronize(C.uintptr_t(s.h))))
}

func (l *libcuda) StreamQuery(s Stream) (bool, error) {
	return ready("cuStreamQuery", res(C.pyep_cuStreamQuery(C.uintptr_t(s.h))))
}

func (l *libcuda) StreamWaitEvent(s Stream, e Event) error {
	return wrap("cuStreamWaitEvent", res(C.pyep_cuStreamWaitEvent(C.uintptr_t(s.h), C.uintptr_t(e.h))))
}

func (l *libcuda) EventCreate(flags EventFlags) (Event, error) {
	var e C.uintptr_t
	if err := wrap("cuEventCreate", res(C.pyep_cuEventCreate(&e, C.uint(flags)))); err != nil {
		return Event{}, err
	}
	return WrapEvent(l, uintptr(e)), nil
}

func (l *libcuda) EventRecord(e Event, s Stream) error {
	return wrap("cuEventRecord", res(C.pyep_cuEventRecord(C.uintptr_t(e.h), C.uintptr_t(s.h))))
}

func (l *libcuda) EventQuery(e Event) (bool, error) {
	return ready("cuEventQuery", res(C.pyep_cuEventQuery(C.uintptr_t(e.h))))
}

func (l *libcuda) EventSynchronize(e Event) error {
	return wrap("cuEventSynchronize", res(C.pyep_cuEventSynchronize(C.uintptr_t(e.h))))
}

func (l *libcuda) EventDestroy(e Event) error {
	return wrap("cuEventDestroy_v2", res(C.pyep_cuEventDestroy(C.uintptr_t(e.h))))
}

func (l *libcuda) EventElapsedTime(start, end Event) (float32, error) {
	var ms C.float
	err := wrap("cuEventElapsedTime", res(C.pyep_cuEventElapsedTime(&ms, C.uintptr_t(start.h), C.uintptr_t(end.h))))
	return float32(ms), err
}

// ready maps the query calls' "not yet" to false rather than an error.
func ready(op string, r Result) (bool, error) {
	if r == ErrorNotReady {
		return false, nil
	}
	return r == Success, wrap(op, r)
}
