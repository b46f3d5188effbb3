//go:build cgo

package env

/*
#include <stdlib.h>
*/
import "C"

import "unsafe"

func getenv(name string) string {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	if v := C.getenv(cname); v != nil {
		return C.GoString(v)
	}
	return ""
}
