//go:build cgo

package driver

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// CLOCK_MONOTONIC, the clock of Python's time.perf_counter.
static int64_t pyep_monotonic_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// Our own spelling of the cuda.h types we pass: the build must not need a CUDA toolkit. Handles
// cross into Go as uintptr_t, which Go holds as plain integers.
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUhandle;  // CUcontext, CUmodule, CUfunction, CUstream, CUevent
typedef struct { char reserved[64]; } pyep_ipc_handle;

// The virtual memory management types, laid out as cuda.h's (enums are int-sized).
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } pyep_mem_location;  // CUmemLocation
typedef struct {                                         // CUmemAllocationProp
	int type;                  // CUmemAllocationType
	int requestedHandleTypes;  // CUmemAllocationHandleType bits
	pyep_mem_location location;
	void* win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} pyep_mem_prop;
typedef struct { pyep_mem_location location; int flags; } pyep_mem_access_desc;  // CUmemAccessDesc
typedef struct { unsigned char data[64]; } pyep_fabric_handle;                    // CUmemFabricHandle
_Static_assert(sizeof(pyep_mem_prop) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(pyep_mem_access_desc) == 12, "CUmemAccessDesc is 12 bytes");

enum {
	PYEP_MEM_ALLOCATION_TYPE_PINNED = 1,
	PYEP_MEM_LOCATION_TYPE_DEVICE = 1,
	PYEP_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
	PYEP_MEM_HANDLE_TYPE_FABRIC = 8,
};

#define PYEP_MAX_KERNEL_ARGS 64
typedef struct { void* p[PYEP_MAX_KERNEL_ARGS]; } pyep_kernel_args;

enum {
	CU_INIT, CU_DRIVER_GET_VERSION, CU_GET_ERROR_NAME, CU_GET_ERROR_STRING,
	CU_DEVICE_GET, CU_DEVICE_GET_COUNT, CU_DEVICE_GET_ATTRIBUTE, CU_DEVICE_GET_NAME,
	CU_DEVICE_GET_PCI_BUS_ID, CU_DEVICE_TOTAL_MEM, CU_DEVICE_CAN_ACCESS_PEER,
	CU_PRIMARY_CTX_RETAIN, CU_PRIMARY_CTX_RELEASE, CU_CTX_GET_CURRENT, CU_CTX_SET_CURRENT,
	CU_CTX_GET_DEVICE, CU_CTX_SYNCHRONIZE, CU_CTX_GET_STREAM_PRIORITY_RANGE,
	CU_MEM_GET_INFO, CU_MEM_ALLOC, CU_MEM_FREE, CU_MEMSET_D8, CU_MEMSET_D8_ASYNC,
	CU_MEMCPY_HTOD, CU_MEMCPY_DTOH, CU_MEMCPY_ASYNC,
	CU_MEM_HOST_ALLOC, CU_MEM_HOST_GET_DEVICE_POINTER, CU_MEM_FREE_HOST, CU_POINTER_GET_ATTRIBUTE,
	CU_IPC_GET_MEM_HANDLE, CU_IPC_OPEN_MEM_HANDLE, CU_IPC_CLOSE_MEM_HANDLE,
	CU_MEM_GET_ALLOCATION_GRANULARITY, CU_MEM_CREATE, CU_MEM_RELEASE, CU_MEM_ADDRESS_RESERVE,
	CU_MEM_ADDRESS_FREE, CU_MEM_MAP, CU_MEM_UNMAP, CU_MEM_SET_ACCESS,
	CU_MEM_EXPORT_TO_SHAREABLE_HANDLE, CU_MEM_IMPORT_FROM_SHAREABLE_HANDLE,
	CU_MODULE_LOAD_DATA, CU_MODULE_GET_FUNCTION, CU_MODULE_UNLOAD,
	CU_FUNC_GET_ATTRIBUTE, CU_FUNC_SET_ATTRIBUTE, CU_LAUNCH_KERNEL,
	CU_STREAM_CREATE, CU_STREAM_DESTROY, CU_STREAM_SYNCHRONIZE, CU_STREAM_QUERY, CU_STREAM_WAIT_EVENT,
	CU_EVENT_CREATE, CU_EVENT_RECORD, CU_EVENT_QUERY, CU_EVENT_SYNCHRONIZE, CU_EVENT_DESTROY,
	CU_EVENT_ELAPSED_TIME,
	CU_COUNT
};

// The exported names, newest first where the driver keeps several versions of a call: cuda.h
// maps each API name to one of these (cuMemAlloc to cuMemAlloc_v2, ...) and so must we, or we
// would get the old ABI. The plain (legacy default stream) variants, not _ptds/_ptsz: pyep
// always passes explicit streams.
static const char* const pyep_cu_names[CU_COUNT][2] = {
	{"cuInit", 0}, {"cuDriverGetVersion", 0}, {"cuGetErrorName", 0}, {"cuGetErrorString", 0},
	{"cuDeviceGet", 0}, {"cuDeviceGetCount", 0}, {"cuDeviceGetAttribute", 0}, {"cuDeviceGetName", 0},
	{"cuDeviceGetPCIBusId", 0}, {"cuDeviceTotalMem_v2", 0}, {"cuDeviceCanAccessPeer", 0},
	{"cuDevicePrimaryCtxRetain", 0}, {"cuDevicePrimaryCtxRelease_v2", 0}, {"cuCtxGetCurrent", 0},
	{"cuCtxSetCurrent", 0}, {"cuCtxGetDevice", 0}, {"cuCtxSynchronize", 0},
	{"cuCtxGetStreamPriorityRange", 0},
	{"cuMemGetInfo_v2", 0}, {"cuMemAlloc_v2", 0}, {"cuMemFree_v2", 0}, {"cuMemsetD8_v2", 0},
	{"cuMemsetD8Async", 0}, {"cuMemcpyHtoD_v2", 0}, {"cuMemcpyDtoH_v2", 0}, {"cuMemcpyAsync", 0},
	{"cuMemHostAlloc", 0}, {"cuMemHostGetDevicePointer_v2", 0}, {"cuMemFreeHost", 0},
	{"cuPointerGetAttribute", 0},
	{"cuIpcGetMemHandle", 0}, {"cuIpcOpenMemHandle_v2", 0}, {"cuIpcCloseMemHandle", 0},
	// The virtual memory management calls: CUDA 10.2 and later, unversioned.
	{"cuMemGetAllocationGranularity", 0}, {"cuMemCreate", 0}, {"cuMemRelease", 0},
	{"cuMemAddressReserve", 0}, {"cuMemAddressFree", 0}, {"cuMemMap", 0}, {"cuMemUnmap", 0},
	{"cuMemSetAccess", 0}, {"cuMemExportToShareableHandle", 0}, {"cuMemImportFromShareableHandle", 0},
	{"cuModuleLoadData", 0}, {"cuModuleGetFunction", 0}, {"cuModuleUnload", 0},
	{"cuFuncGetAttribute", 0}, {"cuFuncSetAttribute", 0}, {"cuLaunchKernel", 0},
	{"cuStreamCreateWithPriority", 0}, {"cuStreamDestroy_v2", 0}, {"cuStreamSynchronize", 0},
	{"cuStreamQuery", 0}, {"cuStreamWaitEvent", 0},
	{"cuEventCreate", 0}, {"cuEventRecord", 0}, {"cuEventQuery", 0}, {"cuEventSynchronize", 0},
	{"cuEventDestroy_v2", 0},
	// _v2 (CUDA 12.8+) is what cuda.h 13 maps to; older drivers have only the original.
	{"cuEventElapsedTime_v2", "cuEventElapsedTime"},
};

static void* pyep_cu_fp[CU_COUNT];

static const char* pyep_cu_name(int i, int alt) { return pyep_cu_names[i][alt]; }

// Entry point i, resolved by goep/dl.
static void pyep_cu_set(int i, uintptr_t fp) { pyep_cu_fp[i] = (void*)fp; }

#define PYEP_FN(id, params) ((CUresult(*) params)pyep_cu_fp[id])

static CUresult pyep_cuInit(unsigned flags) { return PYEP_FN(CU_INIT, (unsigned))(flags); }
static CUresult pyep_cuDriverGetVersion(int* v) { return PYEP_FN(CU_DRIVER_GET_VERSION, (int*))(v); }
static CUresult pyep_cuGetErrorName(CUresult r, const char** s) { return PYEP_FN(CU_GET_ERROR_NAME, (CUresult, const char**))(r, s); }
static CUresult pyep_cuGetErrorString(CUresult r, const char** s) { return PYEP_FN(CU_GET_ERROR_STRING, (CUresult, const char**))(r, s); }

static CUresult pyep_cuDeviceGet(CUdevice* d, int ordinal) { return PYEP_FN(CU_DEVICE_GET, (CUdevice*, int))(d, ordinal); }
static CUresult pyep_cuDeviceGetCount(int* n) { return PYEP_FN(CU_DEVICE_GET_COUNT, (int*))(n); }
static CUresult pyep_cuDeviceGetAttribute(int* v, int attr, CUdevice d) { return PYEP_FN(CU_DEVICE_GET_ATTRIBUTE, (int*, int, CUdevice))(v, attr, d); }
static CUresult pyep_cuDeviceGetName(char* s, int n, CUdevice d) { return PYEP_FN(CU_DEVICE_GET_NAME, (char*, int, CUdevice))(s, n, d); }
static CUresult pyep_cuDeviceGetPCIBusId(char* s, int n, CUdevice d) { return PYEP_FN(CU_DEVICE_GET_PCI_BUS_ID, (char*, int, CUdevice))(s, n, d); }
static CUresult pyep_cuDeviceTotalMem(size_t* n, CUdevice d) { return PYEP_FN(CU_DEVICE_TOTAL_MEM, (size_t*, CUdevice))(n, d); }
static CUresult pyep_cuDeviceCanAccessPeer(int* ok, CUdevice d, CUdevice peer) { return PYEP_FN(CU_DEVICE_CAN_ACCESS_PEER, (int*, CUdevice, CUdevice))(ok, d, peer); }

static CUresult pyep_cuDevicePrimaryCtxRetain(uintptr_t* c, CUdevice d) {
	CUhandle h = NULL;
	CUresult r = PYEP_FN(CU_PRIMARY_CTX_RETAIN, (CUhandle*, CUdevice))(&h, d);
	*c = (uintptr_t)h;
	return r;
}
static CUresult pyep_cuDevicePrimaryCtxRelease(CUdevice d) { return PYEP_FN(CU_PRIMARY_CTX_RELEASE, (CUdevice))(d); }

// One cgo call that is a no-op when ctx is already current: MakeCurrent runs at every entry.
static CUresult pyep_make_current(uintptr_t ctx) {
	CUhandle cur = NULL;
	CUresult r = PYEP_FN(CU_CTX_GET_CURRENT, (CUhandle*))(&cur);
	if (r != 0 || (uintptr_t)cur == ctx) return r;
	return PYEP_FN(CU_CTX_SET_CURRENT, (CUhandle))((CUhandle)ctx);
}
static CUresult pyep_get_current(uintptr_t* ctx, CUdevice* dev) {
	CUhandle cur = NULL;
	*dev = -1;
	CUresult r = PYEP_FN(CU_CTX_GET_CURRENT, (CUhandle*))(&cur);
	*ctx = (uintptr_t)cur;
	if (r != 0 || cur == NULL) return r;
	return PYEP_FN(CU_CTX_GET_DEVICE, (CUdevice*))(dev);
}
static CUresult pyep_cuCtxSynchronize(void) { return PYEP_FN(CU_CTX_SYNCHRONIZE, (void))(); }
static CUresult pyep_cuCtxGetStreamPriorityRange(int* least, int* greatest) { return PYEP_FN(CU_CTX_GET_STREAM_PRIORITY_RANGE, (int*, int*))(least, greatest); }

static CUresult pyep_cuMemGetInfo(size_t* free_, size_t* total) { return PYEP_FN(CU_MEM_GET_INFO, (size_t*, size_t*))(free_, total); }
static CUresult pyep_cuMemAlloc(CUdeviceptr* p, size_t n) { return PYEP_FN(CU_MEM_ALLOC, (CUdeviceptr*, size_t))(p, n); }
static CUresult pyep_cuMemFree(CUdeviceptr p) { return PYEP_FN(CU_MEM_FREE, (CUdeviceptr))(p); }
static CUresult pyep_cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) { return PYEP_FN(CU_MEMSET_D8, (CUdeviceptr, unsigned char, size_t))(p, v, n); }
static CUresult pyep_cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, uintptr_t s) { return PYEP_FN(CU_MEMSET_D8_ASYNC, (CUdeviceptr, unsigned char, size_t, CUhandle))(p, v, n, (CUhandle)s); }
static CUresult pyep_cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) { return PYEP_FN(CU_MEMCPY_HTOD, (CUdeviceptr, const void*, size_t))(dst, src, n); }
static CUresult pyep_cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) { return PYEP_FN(CU_MEMCPY_DTOH, (void*, CUdeviceptr, size_t))(dst, src, n); }
static CUresult pyep_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, uintptr_t s) { return PYEP_FN(CU_MEMCPY_ASYNC, (CUdeviceptr, CUdeviceptr, size_t, CUhandle))(dst, src, n, (CUhandle)s); }
// Returns the pointer rather than filling a void** so Go never hands C the address of a Go
// pointer variable.
static void* pyep_cuMemHostAlloc(size_t n, unsigned flags, CUresult* r) {
	void* p = NULL;
	*r = PYEP_FN(CU_MEM_HOST_ALLOC, (void**, size_t, unsigned))(&p, n, flags);
	return p;
}
static CUresult pyep_cuMemHostGetDevicePointer(CUdeviceptr* d, void* p) { return PYEP_FN(CU_MEM_HOST_GET_DEVICE_POINTER, (CUdeviceptr*, void*, unsigned))(d, p, 0); }
static CUresult pyep_cuMemFreeHost(void* p) { return PYEP_FN(CU_MEM_FREE_HOST, (void*))(p); }
static CUresult pyep_cuPointerGetAttribute(unsigned long long* v, int attr, CUdeviceptr p) {
	// Attributes are 4 or 8 bytes wide; a zeroed 8-byte slot reads right either way (little
	// endian), so one wrapper serves all.
	*v = 0;
	return PYEP_FN(CU_POINTER_GET_ATTRIBUTE, (void*, int, CUdeviceptr))(v, attr, p);
}

static CUresult pyep_cuIpcGetMemHandle(pyep_ipc_handle* h, CUdeviceptr p) { return PYEP_FN(CU_IPC_GET_MEM_HANDLE, (pyep_ipc_handle*, CUdeviceptr))(h, p); }
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: peer access is enabled on demand, as DeepEP does.
static CUresult pyep_cuIpcOpenMemHandle(CUdeviceptr* p, pyep_ipc_handle h) { return PYEP_FN(CU_IPC_OPEN_MEM_HANDLE, (CUdeviceptr*, pyep_ipc_handle, unsigned))(p, h, 1); }
static CUresult pyep_cuIpcCloseMemHandle(CUdeviceptr p) { return PYEP_FN(CU_IPC_CLOSE_MEM_HANDLE, (CUdeviceptr))(p); }

// Pinned memory on device dev, exportable as handleTypes.
static pyep_mem_prop pyep_mem_prop_of(int dev, int handleTypes) {
	pyep_mem_prop p;
	memset(&p, 0, sizeof p);
	p.type = PYEP_MEM_ALLOCATION_TYPE_PINNED;
	p.requestedHandleTypes = handleTypes;
	p.location.type = PYEP_MEM_LOCATION_TYPE_DEVICE;
	p.location.id = dev;
	return p;
}
static CUresult pyep_cuMemGetAllocationGranularity(size_t* g, int dev, int handleTypes, int option) {
	pyep_mem_prop p = pyep_mem_prop_of(dev, handleTypes);
	return PYEP_FN(CU_MEM_GET_ALLOCATION_GRANULARITY, (size_t*, const pyep_mem_prop*, int))(g, &p, option);
}
static CUresult pyep_cuMemCreate(CUmemGenericAllocationHandle* h, size_t n, int dev, int handleTypes) {
	pyep_mem_prop p = pyep_mem_prop_of(dev, handleTypes);
	return PYEP_FN(CU_MEM_CREATE, (CUmemGenericAllocationHandle*, size_t, const pyep_mem_prop*, unsigned long long))(h, n, &p, 0);
}
static CUresult pyep_cuMemRelease(CUmemGenericAllocationHandle h) { return PYEP_FN(CU_MEM_RELEASE, (CUmemGenericAllocationHandle))(h); }
static CUresult pyep_cuMemAddressReserve(CUdeviceptr* p, size_t n, size_t align) {
	return PYEP_FN(CU_MEM_ADDRESS_RESERVE, (CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long))(p, n, align, 0, 0);
}
static CUresult pyep_cuMemAddressFree(CUdeviceptr p, size_t n) { return PYEP_FN(CU_MEM_ADDRESS_FREE, (CUdeviceptr, size_t))(p, n); }
static CUresult pyep_cuMemMap(CUdeviceptr p, size_t n, CUmemGenericAllocationHandle h) {
	return PYEP_FN(CU_MEM_MAP, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))(p, n, 0, h, 0);
}
static CUresult pyep_cuMemUnmap(CUdeviceptr p, size_t n) { return PYEP_FN(CU_MEM_UNMAP, (CUdeviceptr, size_t))(p, n); }
static CUresult pyep_cuMemSetAccess(CUdeviceptr p, size_t n, int dev, int flags) {
	pyep_mem_access_desc d;
	memset(&d, 0, sizeof d);
	d.location.type = PYEP_MEM_LOCATION_TYPE_DEVICE;
	d.location.id = dev;
	d.flags = flags;
	return PYEP_FN(CU_MEM_SET_ACCESS, (CUdeviceptr, size_t, const pyep_mem_access_desc*, size_t))(p, n, &d, 1);
}
#define PYEP_MEM_EXPORT PYEP_FN(CU_MEM_EXPORT_TO_SHAREABLE_HANDLE, (void*, CUmemGenericAllocationHandle, int, unsigned long long))
#define PYEP_MEM_IMPORT PYEP_FN(CU_MEM_IMPORT_FROM_SHAREABLE_HANDLE, (CUmemGenericAllocationHandle*, void*, int))
static CUresult pyep_cuMemExportToFD(int* fd, CUmemGenericAllocationHandle h) {
	*fd = -1;
	return PYEP_MEM_EXPORT(fd, h, PYEP_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}
static CUresult pyep_cuMemExportToFabric(pyep_fabric_handle* fh, CUmemGenericAllocationHandle h) {
	return PYEP_MEM_EXPORT(fh, h, PYEP_MEM_HANDLE_TYPE_FABRIC, 0);
}
// A file descriptor is passed as the pointer's value, a fabric handle by its address.
static CUresult pyep_cuMemImportFromFD(CUmemGenericAllocationHandle* h, int fd) {
	return PYEP_MEM_IMPORT(h, (void*)(uintptr_t)fd, PYEP_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}
static CUresult pyep_cuMemImportFromFabric(CUmemGenericAllocationHandle* h, pyep_fabric_handle* fh) {
	return PYEP_MEM_IMPORT(h, fh, PYEP_MEM_HANDLE_TYPE_FABRIC);
}

static CUresult pyep_cuModuleLoadData(uintptr_t* m, const void* image) {
	CUhandle h = NULL;
	CUresult r = PYEP_FN(CU_MODULE_LOAD_DATA, (CUhandle*, const void*))(&h, image);
	*m = (uintptr_t)h;
	return r;
}
static CUresult pyep_cuModuleGetFunction(uintptr_t* f, uintptr_t m, const char* name) {
	CUhandle h = NULL;
	CUresult r = PYEP_FN(CU_MODULE_GET_FUNCTION, (CUhandle*, CUhandle, const char*))(&h, (CUhandle)m, name);
	*f = (uintptr_t)h;
	return r;
}
static CUresult pyep_cuModuleUnload(uintptr_t m) { return PYEP_FN(CU_MODULE_UNLOAD, (CUhandle))((CUhandle)m); }
static CUresult pyep_cuFuncGetAttribute(int* v, int attr, uintptr_t f) { return PYEP_FN(CU_FUNC_GET_ATTRIBUTE, (int*, int, CUhandle))(v, attr, (CUhandle)f); }
static CUresult pyep_cuFuncSetAttribute(uintptr_t f, int attr, int v) { return PYEP_FN(CU_FUNC_SET_ATTRIBUTE, (CUhandle, int, int))((CUhandle)f, attr, v); }

// args arrives by value: its pointers live on this C stack for the duration of the call, which
// is all cuLaunchKernel needs (it copies the parameter values before returning).
static CUresult pyep_cuLaunchKernel(uintptr_t f, unsigned gx, unsigned gy, unsigned gz,
		unsigned bx, unsigned by, unsigned bz, unsigned shared, uintptr_t s, pyep_kernel_args args) {
	return PYEP_FN(CU_LAUNCH_KERNEL, (CUhandle, unsigned, unsigned, unsigned, unsigned, unsigned,
		unsigned, unsigned, CUhandle, void**, void**))((CUhandle)f, gx, gy, gz, bx, by, bz, shared,
		(CUhandle)s, args.p, NULL);
}

static CUresult pyep_cuStreamCreate(uintptr_t* s, unsigned flags, int priority) {
	CUhandle h = NULL;
	CUresult r = PYEP_FN(CU_STREAM_CREATE, (CUhandle*, unsigned, int))(&h, flags, priority);
	*s = (uintptr_t)h;
	return r;
}
static CUresult pyep_cuStreamDestroy(uintptr_t s) { return PYEP_FN(CU_STREAM_DESTROY, (CUhandle))((CUhandle)s); }
static CUresult pyep_cuStreamSynchronize(uintptr_t s) { return PYEP_FN(CU_STREAM_SYNCHRONIZE, (CUhandle))((CUhandle)s); }
static CUresult pyep_cuStreamQuery(uintptr_t s) { return PYEP_FN(CU_STREAM_QUERY, (CUhandle))((CUhandle)s); }
static CUresult pyep_cuStreamWaitEvent(uintptr_t s, uintptr_t e) { return PYEP_FN(CU_STREAM_WAIT_EVENT, (CUhandle, CUhandle, unsigned))((CUhandle)s, (CUhandle)e, 0); }

static CUresult pyep_cuEventCreate(uintptr_t* e, unsigned flags) {
	CUhandle h = NULL;
	CUresult r = PYEP_FN(CU_EVENT_CREATE, (CUhandle*, unsigned))(&h, flags);
	*e = (uintptr_t)h;
	return r;
}
static CUresult pyep_cuEventRecord(uintptr_t e, uintptr_t s) { return PYEP_FN(CU_EVENT_RECORD, (CUhandle, CUhandle))((CUhandle)e, (CUhandle)s); }
static CUresult pyep_cuEventQuery(uintptr_t e) { return PYEP_FN(CU_EVENT_QUERY, (CUhandle))((CUhandle)e); }
static CUresult pyep_cuEventSynchronize(uintptr_t e) { return PYEP_FN(CU_EVENT_SYNCHRONIZE, (CUhandle))((CUhandle)e); }
static CUresult pyep_cuEventDestroy(uintptr_t e) { return PYEP_FN(CU_EVENT_DESTROY, (CUhandle))((CUhandle)e); }
static CUresult pyep_cuEventElapsedTime(float* ms, uintptr_t start, uintptr_t end) { return PYEP_FN(CU_EVENT_ELAPSED_TIME, (float*, CUhandle, CUhandle))(ms, (CUhandle)start, (CUhandle)end); }
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

// MonotonicNS reads CLOCK_MONOTONIC, in nanoseconds: the clock of Python's time.perf_counter.
func MonotonicNS() int64 { return int64(C.pyep_monotonic_ns()) }

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
