// copy.cuh: how a warp or a block moves rows: every load of a round is issued before its stores, so a
// lane has U loads in flight instead of waiting a full round trip for each (the loads and stores
// are asm volatile, which keeps them in program order: a plain loop of load-then-store would wait
// for every load). intranode.cu copies its rows with warp_copy, low_latency.cu with block_copy_rows.
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

// Copies rows rows of N vectors each with the whole block, U vectors in flight per thread: row r
// from src(r) to dst(r) (functions of the row that return its first vector; a row whose dst is
// null is skipped). The block shares every row, so a unit of a few rows costs one round trip, not
// one per row.
template <typename V, int U, bool kRingSource, int N, typename Src, typename Dst>
PYEP_DEVICE void block_copy_rows(int rows, Src src, Dst dst) {
    const int total = rows * N, nt = static_cast<int>(blockDim.x);
    for (int i = static_cast<int>(threadIdx.x); i < total; i += nt * U) {
        V v[U];
        V* to[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = i + nt * u;
            to[u] = k < total ? dst(k / N) : nullptr;
            if (to[u] != nullptr) v[u] = kRingSource ? ld_ring(src(k / N) + k % N) : ld_nc(src(k / N) + k % N);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
            if (to[u] != nullptr) st_na(to[u] + (i + nt * u) % N, v[u]);
    }
}

}  // namespace pyep
