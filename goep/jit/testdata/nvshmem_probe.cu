// nvshmem_probe.cu: the smallest kernel that calls into NVSHMEM's device library, for the tests
// of the link step (goep/jit, linked to a cubin without a GPU) and of the host binding
// (goep/nvshmem, run on one PE where a GPU is).
//
// NVRTC has no C++ standard library: NVSHMEM 3.4's headers use std::is_integral and friends,
// which CCCL's <cuda/std/type_traits> provides under cuda::std.
#include <cuda/std/type_traits>
namespace std {
using cuda::std::enable_if;
using cuda::std::is_floating_point;
using cuda::std::is_integral;
using cuda::std::is_same;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
using cuda::std::remove_reference;
}  // namespace std
#include <nvshmem.h>
#include <nvshmemx.h>

// One thread: puts 1 + pe's number to *dst on pe, orders it before the signal, sets *sig on pe,
// and reports to out (plain device memory) whether pe's dst is reachable by stores
// (nvshmem_ptr) and which PE this is.
extern "C" __global__ void pyep_nvshmem_probe(int* dst, uint64_t* sig, int* out, int pe) {
	nvshmem_int_p(dst, 1 + pe, pe);
	nvshmem_fence();
	nvshmemx_signal_op(sig, 1, NVSHMEM_SIGNAL_SET, pe);
	nvshmem_quiet();
	out[0] = nvshmem_ptr(dst, pe) != nullptr;
	out[1] = nvshmem_my_pe();
	out[2] = nvshmem_n_pes();
}
