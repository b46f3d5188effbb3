// copy.cuh: how one warp moves a row: every load of a round is issued before its stores, so a
// lane has U loads in flight instead of waiting a full round trip for each (the loads and stores
// are asm volatile, which keeps them in program order: a plain loop of load-then-store would wait
// for every load). intranode.cu and low_latency.cu copy their rows with it.
#pragma once

#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif

namespace pyep {

// Copies n vectors from src to dst with one warp, U vectors in flight per lane; kRingSource
// reads src as a ring a peer writes (ld_ring), else as read-only input (ld_nc). Predicated, not
// a remainder loop.
template <typename V, int U, bool kRingSource>
PYEP_DEVICE void warp_copy(V* dst, const V* src, int n, int lane) {
    for (int i = lane; i < n; i += 32 * U) {
        V v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i + 32 * u < n) v[u] = kRingSource ? ld_ring(src + i + 32 * u) : ld_nc(src + i + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i + 32 * u < n) st_na(dst + i + 32 * u, v[u]);
    }
}

}  // namespace pyep
