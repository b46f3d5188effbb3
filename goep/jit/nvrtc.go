//go:build cgo

package jit

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Our own spelling of the few nvrtc.h types we touch: the build must not need a CUDA toolkit.
typedef int nvrtcResult;
typedef void* nvrtcProgram;

// NV_COUNT entry points are needed to load NVRTC at all; the LTO-IR getters (CUDA 12.0 on),
// which only device linking needs, are resolved when it first does (pyep_nvrtc_lto_*).
enum {
	NV_VERSION, NV_CREATE, NV_COMPILE, NV_LOG_SIZE, NV_LOG, NV_CUBIN_SIZE, NV_CUBIN,
	NV_PTX_SIZE, NV_PTX, NV_DESTROY, NV_ERROR_STRING, NV_COUNT,
	NV_LTOIR_SIZE = NV_COUNT, NV_LTOIR, NV_ALL
};

static const char* const pyep_nvrtc_names[NV_ALL] = {
	"nvrtcVersion", "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize",
	"nvrtcGetProgramLog", "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcGetPTXSize", "nvrtcGetPTX",
	"nvrtcDestroyProgram", "nvrtcGetErrorString", "nvrtcGetLTOIRSize", "nvrtcGetLTOIR",
};

static void* pyep_nvrtc_fp[NV_ALL];

// What a compile emits: the getters of each output, by pyep_nvrtc_compile's output argument.
enum { NV_OUT_CUBIN, NV_OUT_PTX, NV_OUT_LTOIR };
static const int pyep_nvrtc_out_size[] = { NV_CUBIN_SIZE, NV_PTX_SIZE, NV_LTOIR_SIZE };
static const int pyep_nvrtc_out_get[] = { NV_CUBIN, NV_PTX, NV_LTOIR };
static void* pyep_nvrtc_builtins;

// goep/dl opens the library and resolves the entry points; these hand them over.
static const char* pyep_nvrtc_name(int i) { return pyep_nvrtc_names[i]; }
static void pyep_nvrtc_set(int i, uintptr_t fp) { pyep_nvrtc_fp[i] = (void*)fp; }

// NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> by bare name when it compiles; pip wheels
// ship it beside libnvrtc without an RPATH, so preloading it from there (the loader then matches
// the soname) is what makes a wheel's NVRTC usable outside of PyTorch's own preloading.
static char* pyep_nvrtc_preload_builtins(const char* path) {
	void* h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (h == NULL) {
		const char* e = dlerror();
		return strdup(e ? e : "dlopen failed");
	}
	pyep_nvrtc_builtins = h;
	return NULL;
}

// The file the loader actually mapped, for messages: a bare soname says little.
static const char* pyep_nvrtc_loaded_path(void) {
	Dl_info info;
	if (dladdr(pyep_nvrtc_fp[NV_VERSION], &info) == 0 || info.dli_fname == NULL) return "";
	return info.dli_fname;
}

static nvrtcResult pyep_nvrtcVersion(int* major, int* minor) {
	return ((nvrtcResult(*)(int*, int*))pyep_nvrtc_fp[NV_VERSION])(major, minor);
}

static const char* pyep_nvrtcGetErrorString(nvrtcResult r) {
	return ((const char* (*)(nvrtcResult))pyep_nvrtc_fp[NV_ERROR_STRING])(r);
}

typedef struct {
	nvrtcResult result;  // first failure, or 0
	int stage;           // 0 create, 1 compile, 2 output
	char* log;           // malloc'd, may be NULL
	char* out;           // malloc'd cubin or PTX, may be NULL
	size_t out_size;
} pyep_nvrtc_output;

// The whole create/compile/fetch/destroy sequence in one C call: one cgo crossing, and the
// program handle never leaves C.
static pyep_nvrtc_output pyep_nvrtc_compile(const char* src, const char* name, int num_headers,
		char** headers, char** include_names, int num_options, char** options, int output) {
	pyep_nvrtc_output o = {0, 0, NULL, NULL, 0};
	nvrtcProgram prog = NULL;
	o.result = ((nvrtcResult(*)(nvrtcProgram*, const char*, const char*, int, const char* const*,
		const char* const*))pyep_nvrtc_fp[NV_CREATE])(&prog, src, name, num_headers,
		(const char* const*)headers, (const char* const*)include_names);
	if (o.result != 0) return o;

	o.stage = 1;
	o.result = ((nvrtcResult(*)(nvrtcProgram, int, const char* const*))pyep_nvrtc_fp[NV_COMPILE])(
		prog, num_options, (const char* const*)options);
	size_t log_size = 0;
	if (((nvrtcResult(*)(nvrtcProgram, size_t*))pyep_nvrtc_fp[NV_LOG_SIZE])(prog, &log_size) == 0 && log_size > 1) {
		o.log = malloc(log_size);
		if (o.log != NULL && ((nvrtcResult(*)(nvrtcProgram, char*))pyep_nvrtc_fp[NV_LOG])(prog, o.log) != 0) {
			free(o.log);
			o.log = NULL;
		}
	}
	if (o.result == 0) {
		o.stage = 2;
		size_t size = 0;
		o.result = ((nvrtcResult(*)(nvrtcProgram, size_t*))pyep_nvrtc_fp[pyep_nvrtc_out_size[output]])(prog, &size);
		if (o.result == 0 && size > 0) {
			o.out = malloc(size);
			if (o.out == NULL) {
				o.result = 1;  // NVRTC_ERROR_OUT_OF_MEMORY
			} else {
				o.result = ((nvrtcResult(*)(nvrtcProgram, char*))pyep_nvrtc_fp[pyep_nvrtc_out_get[output]])(prog, o.out);
				o.out_size = size;
			}
		}
	}
	((nvrtcResult(*)(nvrtcProgram*))pyep_nvrtc_fp[NV_DESTROY])(&prog);
	return o;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"github.com/pyep/pyep/goep/dl"
)

func loadNVRTC(candidates []string) (*NVRTC, error) {
	var tried []string
	table := make([]dl.Symbol, C.NV_COUNT)
	for i := range table {
		table[i] = dl.Symbol{C.GoString(C.pyep_nvrtc_name(C.int(i)))}
	}
	for _, c := range candidates {
		found, err := dl.Open(c, table, dl.Options{})
		if err != nil {
			var missing *dl.MissingError
			var open *dl.OpenError
			msg := err.Error()
			if errors.As(err, &missing) {
				msg = fmt.Sprintf("it lacks %s (too old an NVRTC?)", missing.Symbol)
			} else if errors.As(err, &open) {
				msg = open.Detail
			}
			tried = append(tried, fmt.Sprintf("%s (%s)", c, msg))
			continue
		}
		for i, fp := range found.Addrs {
			C.pyep_nvrtc_set(C.int(i), C.uintptr_t(fp))
		}
		var major, minor C.int
		if r := C.pyep_nvrtcVersion(&major, &minor); r != 0 {
			return nil, fmt.Errorf("pyep: NVRTC at %s: nvrtcVersion: %s", c, nvrtcErrorString(r))
		}
		lib := &NVRTC{Path: C.GoString(C.pyep_nvrtc_loaded_path()), Major: int(major), Minor: int(minor)}
		if lib.Path == "" {
			lib.Path = c
		}
		if err := preloadBuiltins(lib); err != nil {
			return nil, err
		}
		return lib, nil
	}
	return nil, &NotFoundError{Tried: tried}
}

func preloadBuiltins(lib *NVRTC) error {
	builtins := filepath.Join(filepath.Dir(lib.Path), fmt.Sprintf("libnvrtc-builtins.so.%d.%d", lib.Major, lib.Minor))
	if _, err := os.Stat(builtins); err != nil {
		// Not beside it: a toolkit install, where the loader's search path finds it.
		return nil
	}
	cpath := C.CString(builtins)
	defer C.free(unsafe.Pointer(cpath))
	if msg := C.pyep_nvrtc_preload_builtins(cpath); msg != nil {
		defer C.free(unsafe.Pointer(msg))
		return fmt.Errorf("pyep: NVRTC at %s needs %s, which fails to load: %s", lib.Path, builtins, C.GoString(msg))
	}
	return nil
}

// loadLTOIR resolves the LTO-IR getters in the loaded NVRTC (a second dlopen of the same file
// only counts a reference).
func loadLTOIR(lib *NVRTC) error {
	table := []dl.Symbol{{C.GoString(C.pyep_nvrtc_name(C.NV_LTOIR_SIZE))}, {C.GoString(C.pyep_nvrtc_name(C.NV_LTOIR))}}
	found, err := dl.Open(lib.Path, table, dl.Options{})
	if err != nil {
		return fmt.Errorf("pyep: NVRTC %d.%d at %s cannot emit LTO-IR, which linking device code needs (CUDA 12.0 or newer): %w",
			lib.Major, lib.Minor, lib.Path, err)
	}
	C.pyep_nvrtc_set(C.NV_LTOIR_SIZE, C.uintptr_t(found.Addrs[0]))
	C.pyep_nvrtc_set(C.NV_LTOIR, C.uintptr_t(found.Addrs[1]))
	return nil
}

func nvrtcErrorString(r C.nvrtcResult) string {
	if s := C.pyep_nvrtcGetErrorString(r); s != nil {
		return C.GoString(s)
	}
	return fmt.Sprintf("NVRTC error %d", int(r))
}

func nvrtcCompile(name, src string, headers []Header, options []string, output outputKind) (out []byte, log string, err error) {
	// Every C string and array handed to NVRTC is freed when we return.
	var cstrs []unsafe.Pointer
	defer func() {
		for _, p := range cstrs {
			C.free(p)
		}
	}()
	cstr := func(s string) *C.char {
		p := C.CString(s)
		cstrs = append(cstrs, unsafe.Pointer(p))
		return p
	}
	carray := func(ss []string) **C.char {
		if len(ss) == 0 {
			return nil
		}
		mem := C.malloc(C.size_t(len(ss)) * C.size_t(unsafe.Sizeof((*C.char)(nil))))
		cstrs = append(cstrs, mem)
		arr := unsafe.Slice((**C.char)(mem), len(ss))
		for i, s := range ss {
			arr[i] = cstr(s)
		}
		return &arr[0]
	}
	hdrText := make([]string, len(headers))
	hdrName := make([]string, len(headers))
	for i, h := range headers {
		hdrText[i], hdrName[i] = h.Text, h.Name
	}
	o := C.pyep_nvrtc_compile(cstr(src), cstr(name), C.int(len(headers)), carray(hdrText), carray(hdrName),
		C.int(len(options)), carray(options), C.int(output))
	if o.log != nil {
		log = C.GoString(o.log)
		C.free(unsafe.Pointer(o.log))
	}
	if o.out != nil {
		out = C.GoBytes(unsafe.Pointer(o.out), C.int(o.out_size))
		C.free(unsafe.Pointer(o.out))
	}
	if o.result != 0 {
		stage := [...]string{"create a program for", "compile", "emit the output of"}[o.stage]
		return nil, log, &CompileError{Name: name, Stage: stage, Result: nvrtcErrorString(o.result), Log: log}
	}
	if output == outPTX && len(out) > 0 && out[len(out)-1] == 0 {
		out = out[:len(out)-1] // NVRTC counts PTX's terminating NUL
	}
	if len(out) == 0 {
		return nil, log, &CompileError{Name: name, Stage: "emit the output of", Result: "empty output", Log: log}
	}
	return out, log, nil
}
