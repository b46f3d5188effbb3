//go:build cgo

package cudall

/*
#include "../../../kernels/params.h"
*/
import "C"

// llParams and llError are low-latency mode's launch parameters and error record
// (low_latency.cu's LLParams, LLError), kernels/params.h's, which the kernels include too: one
// declaration, laid out by the C compiler (the header asserts the sizes on both sides). Go
// writes their fields by their C names.
type (
	llParams = C.struct_pyep_ll_params
	llError  = C.struct_pyep_ll_error
)

// llSentWords is the size, in i32 words, of a kernel's send counters (p.expert_sent).
const llSentWords = C.PYEP_LL_SENT_WORDS

// u64 and i32 are values of the header's integer types.
func u64[T ~uint64 | ~int64 | ~int | ~uintptr](v T) C.pyep_u64 { return C.pyep_u64(v) }
func i32[T ~int32 | ~int](v T) C.pyep_i32                      { return C.pyep_i32(v) }
