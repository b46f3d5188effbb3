//go:build cgo

package jit

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

// dlerror's text is per thread, so it is copied in the same C call as the failure.
static void* pyep_host_dlopen(const char* path, char** msg) {
	void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char* e = dlerror();
		*msg = strdup(e ? e : "dlopen failed");
	}
	return h;
}

static void* pyep_host_dlsym(void* h, const char* name, char** msg) {
	dlerror();
	void* p = dlsym(h, name);
	if (p == NULL) {
		const char* e = dlerror();
		*msg = strdup(e ? e : "no such symbol");
	}
	return p;
}
*/
import "C"

import (
	"errors"
	"unsafe"
)

func dlopen(path string) (unsafe.Pointer, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg *C.char
	h := C.pyep_host_dlopen(cpath, &msg)
	if h == nil {
		defer C.free(unsafe.Pointer(msg))
		return nil, errors.New(C.GoString(msg))
	}
	return h, nil
}

func dlsym(h unsafe.Pointer, name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var msg *C.char
	p := C.pyep_host_dlsym(h, cname, &msg)
	if p == nil {
		defer C.free(unsafe.Pointer(msg))
		return nil, errors.New(C.GoString(msg))
	}
	return p, nil
}
