//go:build cgo

// Package dl opens a shared library with dlopen and resolves a table of its entry points: the
// one dlopen layer under the CUDA driver binding (goep/cuda/driver), NVRTC and nvJitLink
// (goep/jit) and NVSHMEM's host library (goep/nvshmem). A binding keeps its table of names and
// its function pointers in its own C code and fills the pointers from Library.Addrs.
// SitePackages is where those bindings look for NVIDIA's Python wheels.
package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// dlerror's text is per thread: each call copies it in the same C call as the failure.
static char* pyep_dl_error(const char* fallback) {
	const char* e = dlerror();
	return strdup(e ? e : fallback);
}

static void* pyep_dl_open(const char* path, int global, char** err) {
	void* h = dlopen(path, RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
	if (h == NULL) *err = pyep_dl_error("dlopen failed");
	return h;
}

static uintptr_t pyep_dl_sym(void* h, const char* name, char** err) {
	dlerror();
	void* p = dlsym(h, name);
	if (p == NULL) *err = pyep_dl_error("symbol not found");
	return (uintptr_t)p;
}

static void pyep_dl_close(void* h) { dlclose(h); }
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Symbol is one entry point of a table: its names, tried in order (e.g. "cuEventElapsedTime_v2",
// then "cuEventElapsedTime" for drivers older than 12.8).
type Symbol []string

// Library is an opened library and the addresses of its table's symbols, in the table's order.
type Library struct {
	Path  string
	Addrs []uintptr
	h     unsafe.Pointer
}

// OpenError is a library that dlopen could not load.
type OpenError struct{ Path, Detail string }

func (e *OpenError) Error() string { return fmt.Sprintf("%s: %s", e.Path, e.Detail) }

// MissingError is a library that lacks an entry point of the table.
type MissingError struct {
	Path, Symbol, Detail string
	Index                int // the symbol's index in the table
}

func (e *MissingError) Error() string {
	return fmt.Sprintf("%s lacks %s (%s)", e.Path, e.Symbol, e.Detail)
}

// Options of Open.
type Options struct {
	Global bool // RTLD_GLOBAL: the library's symbols resolve later loads (a dependency preloaded)
}

// Open loads path and resolves every symbol of table; it closes the library again and returns
// a *MissingError if one is absent, an *OpenError if dlopen fails.
func Open(path string, table []Symbol, o Options) (*Library, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	global := C.int(0)
	if o.Global {
		global = 1
	}
	var cerr *C.char
	h := C.pyep_dl_open(cpath, global, &cerr)
	if h == nil {
		defer C.free(unsafe.Pointer(cerr))
		return nil, &OpenError{Path: path, Detail: C.GoString(cerr)}
	}
	lib := &Library{Path: path, Addrs: make([]uintptr, len(table)), h: h}
	for i, names := range table {
		var detail string
		for _, name := range names {
			cname := C.CString(name)
			var serr *C.char
			addr := C.pyep_dl_sym(h, cname, &serr)
			C.free(unsafe.Pointer(cname))
			if addr != 0 {
				lib.Addrs[i], detail = uintptr(addr), ""
				break
			}
			if detail == "" {
				detail = C.GoString(serr)
			}
			C.free(unsafe.Pointer(serr))
		}
		if lib.Addrs[i] == 0 {
			C.pyep_dl_close(h)
			return nil, &MissingError{Path: path, Symbol: names[0], Detail: detail, Index: i}
		}
	}
	return lib, nil
}
