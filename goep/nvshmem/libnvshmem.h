// libnvshmem.h: the C side of the NVSHMEM host binding, included by libnvshmem.go alone (its
// statics live in that one cgo translation unit): our own spelling of the few types of
// NVSHMEM's headers that we pass, the table of entry points that goep/dl resolves, and one
// wrapper per entry point.
#ifndef PYEP_LIBNVSHMEM_H
#define PYEP_LIBNVSHMEM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

// The unique-id bootstrap's types, laid out as bootstrap_device_host/nvshmem_uniqueid.h and
// device_host/nvshmem_types.h of NVSHMEM 3.x have them (the header's own static_asserts give
// the same sizes). A struct's version is (struct version << 16) + its size.
typedef struct {  // nvshmemx_uniqueid_t (v1)
	int version;
	char internal[124];
} pyep_nvshmem_uniqueid;

typedef struct {  // nvshmemx_uniqueid_args_t (v1)
	int version;
	pyep_nvshmem_uniqueid* id;
	int myrank;
	int nranks;
} pyep_nvshmem_uniqueid_args;

typedef struct {  // nvshmemx_init_args_t (v2: v1 with the CUDA device taken from its padding)
	int version;
	pyep_nvshmem_uniqueid_args uid_args;
	int cuda_device_id;  // -1: the device current on the calling thread
	char content[92];
} pyep_nvshmem_init_args;

typedef struct {  // nvshmemx_init_attr_t (v2)
	int version;
	void* mpi_comm;
	pyep_nvshmem_init_args args;
} pyep_nvshmem_init_attr;

_Static_assert(sizeof(pyep_nvshmem_uniqueid) == 128, "nvshmemx_uniqueid_t is 128 bytes");
_Static_assert(sizeof(pyep_nvshmem_uniqueid_args) == 24, "nvshmemx_uniqueid_args_t is 24 bytes");
_Static_assert(sizeof(pyep_nvshmem_init_args) == 128, "nvshmemx_init_args_t is 128 bytes");
_Static_assert(sizeof(pyep_nvshmem_init_attr) == 144, "nvshmemx_init_attr_t is 144 bytes");
_Static_assert(offsetof(pyep_nvshmem_init_attr, args) == 16, "init_attr.args at 16");
_Static_assert(offsetof(pyep_nvshmem_init_attr, args.uid_args.id) == 32, "uid_args.id at 32");
_Static_assert(offsetof(pyep_nvshmem_init_attr, args.cuda_device_id) == 48, "cuda_device_id at 48");

#define PYEP_NVSHMEM_VERSION(v, type) (((v) << 16) + (int)sizeof(type))
#define PYEP_NVSHMEM_UNIQUEID_VERSION PYEP_NVSHMEM_VERSION(1, pyep_nvshmem_uniqueid)
#define PYEP_NVSHMEMX_INIT_WITH_UNIQUEID (1 << 3)

enum {
	SH_VENDOR_VERSION, SH_GET_UNIQUEID, SH_SET_ATTR_UNIQUEID_ARGS, SH_HOSTLIB_INIT_ATTR,
	SH_HOSTLIB_FINALIZE, SH_INIT_STATUS, SH_MY_PE, SH_N_PES, SH_MALLOC, SH_FREE, SH_BARRIER_ALL,
	SH_PTR, SH_CUMODULE_INIT, SH_CUMODULE_FINALIZE,
	SH_COUNT
};

// The exported names. nvshmemx_init_attr and nvshmem_finalize of the headers are inline
// functions that call into libnvshmem_device.a (nvshmemi_init_thread, nvshmemi_finalize), which
// a process that links its device code at run time does not have; the host library's own
// entry points for that case are nvshmemx_hostlib_init_attr and nvshmemx_hostlib_finalize, the
// device state reaching each module through nvshmemx_cumodule_init.
static const char* const pyep_nvshmem_names[SH_COUNT] = {
	"nvshmemx_vendor_get_version_info", "nvshmemx_get_uniqueid", "nvshmemx_set_attr_uniqueid_args",
	"nvshmemx_hostlib_init_attr", "nvshmemx_hostlib_finalize", "nvshmemx_init_status",
	"nvshmem_my_pe", "nvshmem_n_pes", "nvshmem_malloc", "nvshmem_free", "nvshmem_barrier_all",
	"nvshmem_ptr", "nvshmemx_cumodule_init", "nvshmemx_cumodule_finalize",
};

static void* pyep_nvshmem_fp[SH_COUNT];

// goep/dl opens the library and resolves the entry points; these hand them over.
static const char* pyep_nvshmem_name(int i) { return pyep_nvshmem_names[i]; }
static void pyep_nvshmem_set(int i, uintptr_t fp) { pyep_nvshmem_fp[i] = (void*)fp; }

static void pyep_nvshmem_version(int* major, int* minor, int* patch) {
	((void (*)(int*, int*, int*))pyep_nvshmem_fp[SH_VENDOR_VERSION])(major, minor, patch);
}

static int pyep_nvshmem_get_uniqueid(void* out) {
	pyep_nvshmem_uniqueid id;
	memset(&id, 0, sizeof(id));
	id.version = PYEP_NVSHMEM_UNIQUEID_VERSION;  // NVSHMEMX_UNIQUEID_INITIALIZER
	int r = ((int (*)(pyep_nvshmem_uniqueid*))pyep_nvshmem_fp[SH_GET_UNIQUEID])(&id);
	memcpy(out, &id, sizeof(id));
	return r;
}

// Init from a unique id in one C call: the attribute points at the id, which lives on this
// stack frame until NVSHMEM has bootstrapped. stage says which call failed: 0 set_attr, 1 init.
static int pyep_nvshmem_init_uniqueid(const void* id128, int rank, int nranks, int device, int* stage) {
	pyep_nvshmem_uniqueid id;
	memcpy(&id, id128, sizeof(id));
	pyep_nvshmem_init_attr attr;  // NVSHMEMX_INIT_ATTR_INITIALIZER
	memset(&attr, 0, sizeof(attr));
	attr.version = PYEP_NVSHMEM_VERSION(2, pyep_nvshmem_init_attr);
	attr.args.version = PYEP_NVSHMEM_VERSION(2, pyep_nvshmem_init_args);
	attr.args.uid_args.version = PYEP_NVSHMEM_VERSION(1, pyep_nvshmem_uniqueid_args);
	attr.args.uid_args.myrank = -1;
	attr.args.uid_args.nranks = -1;
	attr.args.cuda_device_id = device;
	*stage = 0;
	int r = ((int (*)(int, int, const pyep_nvshmem_uniqueid*, pyep_nvshmem_init_attr*))
		pyep_nvshmem_fp[SH_SET_ATTR_UNIQUEID_ARGS])(rank, nranks, &id, &attr);
	if (r != 0) return r;
	*stage = 1;
	return ((int (*)(unsigned int, pyep_nvshmem_init_attr*))pyep_nvshmem_fp[SH_HOSTLIB_INIT_ATTR])(
		PYEP_NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
}

static void pyep_nvshmem_finalize(void) { ((void (*)(void))pyep_nvshmem_fp[SH_HOSTLIB_FINALIZE])(); }
static int pyep_nvshmem_init_status(void) { return ((int (*)(void))pyep_nvshmem_fp[SH_INIT_STATUS])(); }
static int pyep_nvshmem_my_pe(void) { return ((int (*)(void))pyep_nvshmem_fp[SH_MY_PE])(); }
static int pyep_nvshmem_n_pes(void) { return ((int (*)(void))pyep_nvshmem_fp[SH_N_PES])(); }

static uintptr_t pyep_nvshmem_malloc(size_t size) {
	return (uintptr_t)((void* (*)(size_t))pyep_nvshmem_fp[SH_MALLOC])(size);
}

static void pyep_nvshmem_free(uintptr_t p) { ((void (*)(void*))pyep_nvshmem_fp[SH_FREE])((void*)p); }
static void pyep_nvshmem_barrier_all(void) { ((void (*)(void))pyep_nvshmem_fp[SH_BARRIER_ALL])(); }

static uintptr_t pyep_nvshmem_ptr(uintptr_t p, int pe) {
	return (uintptr_t)((void* (*)(const void*, int))pyep_nvshmem_fp[SH_PTR])((const void*)p, pe);
}

// CUmodule is a pointer-sized handle; Go holds it as an integer.
static int pyep_nvshmem_cumodule_init(uintptr_t m) {
	return ((int (*)(void*))pyep_nvshmem_fp[SH_CUMODULE_INIT])((void*)m);
}

static int pyep_nvshmem_cumodule_finalize(uintptr_t m) {
	return ((int (*)(void*))pyep_nvshmem_fp[SH_CUMODULE_FINALIZE])((void*)m);
}

#endif
