// nvshmem_probe.cu: the smallest kernel that calls into NVSHMEM's device library, for the tests of
// the link step (goep/jit: linked to a cubin without a GPU) and of the host binding (goep/nvshmem:
// run on one PE where a GPU is). It exists only in a build with PYEP_NVSHMEM_PROBE, linked with
// NVSHMEM; any other build of this file (the plain NVRTC compile of every kernel) is empty.
#include "utils.cuh"

#if defined(PYEP_NVSHMEM_PROBE)
#include "nvshmem_nvrtc.cuh"

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
#endif  // PYEP_NVSHMEM_PROBE
