//go:build cgo

package jit

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

// Our own spelling of the nvJitLink.h types we touch: the build must not need a CUDA toolkit.
typedef int nvJitLinkResult;
typedef void* nvJitLinkHandle;

enum {
	JL_VERSION, JL_CREATE, JL_ADD_DATA, JL_COMPLETE, JL_CUBIN_SIZE, JL_CUBIN,
	JL_ERROR_LOG_SIZE, JL_ERROR_LOG, JL_INFO_LOG_SIZE, JL_INFO_LOG, JL_DESTROY, JL_COUNT
};

// nvJitLink.h maps each call to a versioned export (nvJitLinkCreate to __nvJitLinkCreate_12_0,
// ...); CUDA 13's library also exports the plain names. Plain first, then the oldest versioned
// name of each major, which a newer library of that major keeps.
static const char* const pyep_jl_names[JL_COUNT][3] = {
	{"nvJitLinkVersion", NULL, NULL},
	{"nvJitLinkCreate", "__nvJitLinkCreate_13_0", "__nvJitLinkCreate_12_0"},
	{"nvJitLinkAddData", "__nvJitLinkAddData_13_0", "__nvJitLinkAddData_12_0"},
	{"nvJitLinkComplete", "__nvJitLinkComplete_13_0", "__nvJitLinkComplete_12_0"},
	{"nvJitLinkGetLinkedCubinSize", "__nvJitLinkGetLinkedCubinSize_13_0", "__nvJitLinkGetLinkedCubinSize_12_0"},
	{"nvJitLinkGetLinkedCubin", "__nvJitLinkGetLinkedCubin_13_0", "__nvJitLinkGetLinkedCubin_12_0"},
	{"nvJitLinkGetErrorLogSize", "__nvJitLinkGetErrorLogSize_13_0", "__nvJitLinkGetErrorLogSize_12_0"},
	{"nvJitLinkGetErrorLog", "__nvJitLinkGetErrorLog_13_0", "__nvJitLinkGetErrorLog_12_0"},
	{"nvJitLinkGetInfoLogSize", "__nvJitLinkGetInfoLogSize_13_0", "__nvJitLinkGetInfoLogSize_12_0"},
	{"nvJitLinkGetInfoLog", "__nvJitLinkGetInfoLog_13_0", "__nvJitLinkGetInfoLog_12_0"},
	{"nvJitLinkDestroy", "__nvJitLinkDestroy_13_0", "__nvJitLinkDestroy_12_0"},
};

static void* pyep_jl_fp[JL_COUNT];

static const char* pyep_jl_name(int i, int alt) { return pyep_jl_names[i][alt]; }
static void pyep_jl_set(int i, uintptr_t fp) { pyep_jl_fp[i] = (void*)fp; }

static const char* pyep_jl_loaded_path(void) {
	Dl_info info;
	if (dladdr(pyep_jl_fp[JL_CREATE], &info) == 0 || info.dli_fname == NULL) return "";
	return info.dli_fname;
}

static nvJitLinkResult pyep_jl_version(unsigned int* major, unsigned int* minor) {
	return ((nvJitLinkResult(*)(unsigned int*, unsigned int*))pyep_jl_fp[JL_VERSION])(major, minor);
}

typedef struct {
	nvJitLinkResult result;  // first failure, or 0
	int stage;               // 0 create, 1 add input, 2 complete, 3 output
	int input;               // the input being added when stage is 1
	char* error_log;         // malloc'd, may be NULL
	char* info_log;          // malloc'd, may be NULL
	char* out;               // malloc'd cubin, may be NULL
	size_t out_size;
} pyep_jl_output;

static char* pyep_jl_log(nvJitLinkHandle h, int size_fn, int get_fn) {
	size_t n = 0;
	if (((nvJitLinkResult(*)(nvJitLinkHandle, size_t*))pyep_jl_fp[size_fn])(h, &n) != 0 || n <= 1) return NULL;
	char* log = malloc(n);
	if (log != NULL && ((nvJitLinkResult(*)(nvJitLinkHandle, char*))pyep_jl_fp[get_fn])(h, log) != 0) {
		free(log);
		log = NULL;
	}
	return log;
}

// The whole create/add/complete/fetch/destroy sequence in one C call: one cgo crossing, and
// the handle never leaves C. Inputs are in C memory: kinds are nvJitLinkInputType values.
static pyep_jl_output pyep_jl_link(int num_options, char** options, int num_inputs, int* kinds,
		void** data, size_t* sizes, char** names) {
	pyep_jl_output o = {0, 0, -1, NULL, NULL, NULL, 0};
	nvJitLinkHandle h = NULL;
	o.result = ((nvJitLinkResult(*)(nvJitLinkHandle*, uint32_t, const char**))pyep_jl_fp[JL_CREATE])(
		&h, (uint32_t)num_options, (const char**)options);
	if (o.result != 0) return o;
	o.stage = 1;
	for (int i = 0; i < num_inputs && o.result == 0; i++) {
		o.input = i;
		o.result = ((nvJitLinkResult(*)(nvJitLinkHandle, int, const void*, size_t, const char*))pyep_jl_fp[JL_ADD_DATA])(
			h, kinds[i], data[i], sizes[i], names[i]);
	}
	if (o.result == 0) {
		o.stage = 2;
		o.result = ((nvJitLinkResult(*)(nvJitLinkHandle))pyep_jl_fp[JL_COMPLETE])(h);
	}
	if (o.result == 0) {
		o.stage = 3;
		size_t size = 0;
		o.result = ((nvJitLinkResult(*)(nvJitLinkHandle, size_t*))pyep_jl_fp[JL_CUBIN_SIZE])(h, &size);
		if (o.result == 0 && size > 0) {
			o.out = malloc(size);
			if (o.out == NULL) {
				o.result = 6;  // NVJITLINK_ERROR_INTERNAL
			} else {
				o.result = ((nvJitLinkResult(*)(nvJitLinkHandle, void*))pyep_jl_fp[JL_CUBIN])(h, o.out);
				o.out_size = size;
			}
		}
	}
	o.error_log = pyep_jl_log(h, JL_ERROR_LOG_SIZE, JL_ERROR_LOG);
	o.info_log = pyep_jl_log(h, JL_INFO_LOG_SIZE, JL_INFO_LOG);
	((nvJitLinkResult(*)(nvJitLinkHandle*))pyep_jl_fp[JL_DESTROY])(&h);
	return o;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/pyep/pyep/goep/dl"
)

func jitLinkTable() []dl.Symbol {
	table := make([]dl.Symbol, C.JL_COUNT)
	for i := range table {
		for alt := range 3 {
			if n := C.pyep_jl_name(C.int(i), C.int(alt)); n != nil {
				table[i] = append(table[i], C.GoString(n))
			}
		}
	}
	return table
}

// loadNVJitLink opens the first candidate that exports every entry point and can link what nv
// emits: the same major version as NVRTC and no older (a linker reads the LTO-IR of its own
// version and older ones).
func loadNVJitLink(candidates []string, nv *NVRTC) (*NVJitLink, error) {
	var tried []string
	for _, c := range candidates {
		found, err := dl.Open(c, jitLinkTable(), dl.Options{})
		if err != nil {
			var missing *dl.MissingError
			var open *dl.OpenError
			msg := err.Error()
			if errors.As(err, &missing) {
				msg = fmt.Sprintf("it lacks %s (older than CUDA 12.3?)", missing.Symbol)
			} else if errors.As(err, &open) {
				msg = open.Detail
			}
			tried = append(tried, fmt.Sprintf("%s (%s)", c, msg))
			continue
		}
		for i, fp := range found.Addrs {
			C.pyep_jl_set(C.int(i), C.uintptr_t(fp))
		}
		var major, minor C.uint
		if r := C.pyep_jl_version(&major, &minor); r != 0 {
			tried = append(tried, fmt.Sprintf("%s (nvJitLinkVersion: %s)", c, jitLinkResultName(int(r))))
			continue
		}
		lib := &NVJitLink{Path: C.GoString(C.pyep_jl_loaded_path()), Major: int(major), Minor: int(minor)}
		if lib.Path == "" {
			lib.Path = c
		}
		if nv != nil && (lib.Major != nv.Major || lib.Minor < nv.Minor) {
			tried = append(tried, fmt.Sprintf("%s (nvJitLink %d.%d cannot link the LTO-IR of NVRTC %d.%d at %s)",
				lib.Path, lib.Major, lib.Minor, nv.Major, nv.Minor, nv.Path))
			continue
		}
		return lib, nil
	}
	return nil, &JitLinkNotFoundError{Tried: tried}
}

// jitLink runs one link; inputs are copied to C memory for the call.
func jitLink(options []string, inputs []LinkInput) (cubin []byte, log string, err error) {
	var cmem []unsafe.Pointer
	defer func() {
		for _, p := range cmem {
			C.free(p)
		}
	}()
	alloc := func(n int) unsafe.Pointer {
		p := C.malloc(C.size_t(max(n, 1)))
		cmem = append(cmem, p)
		return p
	}
	ptrSize := int(unsafe.Sizeof(uintptr(0)))
	opts := unsafe.Slice((**C.char)(alloc(len(options)*ptrSize)), max(len(options), 1))
	for i, o := range options {
		opts[i] = C.CString(o)
		cmem = append(cmem, unsafe.Pointer(opts[i]))
	}
	n := len(inputs)
	kinds := unsafe.Slice((*C.int)(alloc(n*4)), max(n, 1))
	data := unsafe.Slice((*unsafe.Pointer)(alloc(n*ptrSize)), max(n, 1))
	sizes := unsafe.Slice((*C.size_t)(alloc(n*8)), max(n, 1))
	names := unsafe.Slice((**C.char)(alloc(n*ptrSize)), max(n, 1))
	for i, in := range inputs {
		kinds[i] = C.int(in.Kind)
		data[i] = C.CBytes(in.Data)
		cmem = append(cmem, data[i])
		sizes[i] = C.size_t(len(in.Data))
		names[i] = C.CString(in.Name)
		cmem = append(cmem, unsafe.Pointer(names[i]))
	}
	o := C.pyep_jl_link(C.int(len(options)), &opts[0], C.int(n), &kinds[0], &data[0], &sizes[0], &names[0])
	for _, l := range []*C.char{o.error_log, o.info_log} {
		if l != nil {
			if log != "" && !strings.HasSuffix(log, "\n") {
				log += "\n"
			}
			log += C.GoString(l)
			C.free(unsafe.Pointer(l))
		}
	}
	if o.out != nil {
		cubin = C.GoBytes(unsafe.Pointer(o.out), C.int(o.out_size))
		C.free(unsafe.Pointer(o.out))
	}
	if o.result != 0 {
		e := &LinkError{Stage: [...]string{"start", "add an input to", "complete", "emit the output of"}[o.stage],
			Result: jitLinkResultName(int(o.result)), Log: log}
		if o.stage == 1 && int(o.input) >= 0 && int(o.input) < n {
			e.Input = inputs[o.input].Name
		}
		return nil, log, e
	}
	if len(cubin) == 0 {
		return nil, log, &LinkError{Stage: "emit the output of", Result: "empty output", Log: log}
	}
	return cubin, log, nil
}
