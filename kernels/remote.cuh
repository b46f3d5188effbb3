// remote.cuh: how low-latency mode writes into a peer on another node (or into every peer, with
// allow_nvlink_for_low_latency_mode=False): the pair remote_put_warp / remote_signal, with the
// contract of goep/lowlatency/remote.go, which the cpu reference emulates:
//   - remote_put_warp(dst, src, n, pe) starts copying n bytes from src (this rank's memory) to
//     dst, which names pe's memory as NVSHMEM does (a symmetric address: the same offset in this
//     rank's own region). Nothing about those bytes is known until pe sees a later signal of
//     this rank; src must stay unchanged until then. A warp collective: every lane calls it.
//   - remote_signal(word, v, pe) stores the 8-byte v at word (named like dst) once every earlier
//     put of this rank to pe has landed; a whole-word set. One thread calls it.
//   - remote_signal_add(word, v, pe): the same, but adds v to the word (an atomic add at pe).
// The receiver polls its own region with acquire loads, so its side is the same whichever way a
// peer wrote. Only a kernel built with PYEP_LL_REMOTE has the pair (and needs NVSHMEM); a
// one-node build compiles none of this.
//
// On a GPU the pair is NVSHMEM's: a non-blocking warp put, then nvshmem_quiet (every put of this
// PE complete: delivered, and its source free) and a signal with NVSHMEM_SIGNAL_SET (or _ADD). The caller
// has ordered the puts of its block before the signal with a barrier. The emulator
// (goep/cuda/emu/remote.h) records the puts and lands them only at the signal.
#pragma once

#ifdef PYEP_LL_REMOTE
#ifdef PYEP_EMU
#include "remote.h"
#else
#include "nvshmem_nvrtc.cuh"

#include "utils.cuh"

namespace pyep {

PYEP_DEVICE void remote_put_warp(void* dst, const void* src, u64 n, int pe) {
    nvshmemx_putmem_nbi_warp(dst, src, static_cast<size_t>(n), pe);
}

PYEP_DEVICE void remote_signal(u64* word, u64 v, int pe) {
    nvshmem_quiet();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(word), static_cast<uint64_t>(v), NVSHMEM_SIGNAL_SET, pe);
}

PYEP_DEVICE void remote_signal_add(u64* word, u64 v, int pe) {
    nvshmem_quiet();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(word), static_cast<uint64_t>(v), NVSHMEM_SIGNAL_ADD, pe);
}

}  // namespace pyep
#endif  // PYEP_EMU
#endif  // PYEP_LL_REMOTE
