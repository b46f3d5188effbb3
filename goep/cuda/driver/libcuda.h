// libcuda.h: the C side of the driver binding, included by libcuda.go alone (its statics
// live in that one cgo translation unit): our own spelling of the cuda.h types we pass, the
// table of entry points that goep/dl resolves, and one wrapper per entry point.
#ifndef PYEP_LIBCUDA_H
#define PYEP_LIBCUDA_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#endif  // PYEP_LIBCUDA_H
