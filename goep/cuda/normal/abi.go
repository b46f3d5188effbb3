//go:build cgo

package cudanormal

/*
#include "../../../kernels/params.h"
*/
import "C"

import "unsafe"

// The launch parameter structs and the records the host reads are kernels/params.h's, which the kernels
// include too: one declaration, laid out by the C compiler (the header asserts the sizes on
// both sides). Go writes their fields by their C names.
type (
	kctx           = C.struct_pyep_ctx
	notifyParams   = C.struct_pyep_notify_params
	notifyResult   = C.struct_pyep_notify_result
	dispatchParams = C.struct_pyep_dispatch_params
	// The queued dispatch's kernel's: notify's and the dispatch's, one after the other.
	notifyDispatchParams = C.struct_pyep_notify_dispatch_params
	combineParams        = C.struct_pyep_combine_params
	layoutParams         = C.struct_pyep_layout_params
)

// u64 and i32 are values of the header's integer types.
func u64[T ~uint64 | ~int64 | ~int | ~uintptr](v T) C.pyep_u64 { return C.pyep_u64(v) }
func i32[T ~int32 | ~int](v T) C.pyep_i32                      { return C.pyep_i32(v) }

// notifyTag is where notify's answer is complete: its tag, which the kernel writes last.
func notifyTag(r *notifyResult) *uint64 { return (*uint64)(unsafe.Pointer(&r.tag)) }

const notifyResultBytes = int(unsafe.Sizeof(notifyResult{}))

// opError is the kernels' error record (protocol.cuh's OpError): the device protocol, read by
// the host.
type opError = C.struct_pyep_op_error

// opErrorCode is where the record is complete: its code, which the kernel writes last.
func opErrorCode(r *opError) *uint32 { return (*uint32)(unsafe.Pointer(&r.code)) }

const opErrorBytes = int(unsafe.Sizeof(opError{}))

// layoutWorkBytes is the layout kernel's workspace (params.h's pyep_layout_work).
const layoutWorkBytes = int(unsafe.Sizeof(C.struct_pyep_layout_work{}))
