//go:build cgo

package pyep

/*
#cgo LDFLAGS: -ldl
#include <stdint.h>
#include <stdlib.h>

int pyep_fast_capacity(void);
int pyep_fast_max_args(void);
void* pyep_fast_init(const char* const* names, int count);
*/
import "C"

import (
	"sync"
	"unsafe"
)

var fastTable struct {
	once sync.Once
	defs uintptr
}

// FastCalls is the address of a CPython method table (PyMethodDef entries ended by a NULL name)
// of the exports in fastCalls, as METH_FASTCALL functions that take the same integers as
// gopy's wrappers (fastcall_cpython.go); python/pyep/_core.py makes its functions from it. 0 where the
// process has no CPython to call.
func FastCalls() uintptr {
	fastTable.once.Do(func() {
		if len(fastCalls) > int(C.pyep_fast_capacity()) {
			return
		}
		for i := range fastCalls {
			if fastCalls[i].arity > int(C.pyep_fast_max_args()) {
				return // gopy's wrappers then
			}
		}
		names := make([]*C.char, len(fastCalls))
		for i := range fastCalls {
			names[i] = C.CString(fastCalls[i].name) // kept for the process: the table's entries point at them
		}
		fastTable.defs = uintptr(C.pyep_fast_init(&names[0], C.int(len(fastCalls))))
	})
	return fastTable.defs
}

//export pyepFastCall
func pyepFastCall(fn C.int, v *C.int64_t, n, given C.int, errOut **C.char) C.int64_t {
	r, err := callFast(int(fn), unsafe.Slice((*int64)(unsafe.Pointer(v)), int(n)), int(given))
	if err != nil {
		*errOut = C.CString(err.Error())
	}
	return C.int64_t(r)
}
