// layout.cu: get_dispatch_layout. From topk_idx [T, K] (global expert indices, -1 for none),
// with experts split evenly over R ranks (rank r holds [r*E/R, (r+1)*E/R)):
//   num_tokens_per_rank [R]   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] (token, choice) pairs choosing expert e
//   is_token_in_rank [T, R]   token t goes to rank r
// and the first out-of-range index. The host does not wait for this kernel: block 0 records a bad
// index, with the call's tag, in host-mapped memory that the next notify reads, so that the
// dispatch after the layout fails on every rank (see NotifyParams.layout_rec in intranode.cu).
//
// Blocks [0, R) are rank blocks (block r writes column r of is_token_in_rank and counts rank
// r; block 0 also checks every index), blocks [R, R + ceil(E/kExpertsPerBlock)) count experts.
// No block depends on another, so no output needs zeroing first.
//
// pyep:defines PYEP_LAYOUT_THREADS=512
// pyep:defines PYEP_LAYOUT_THREADS=256 PYEP_LAYOUT_EXPERTS_PER_BLOCK=32
#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif

namespace pyep {

// The host-kernel ABI.
#include "params.h"

#ifndef PYEP_LAYOUT_THREADS
#define PYEP_LAYOUT_THREADS 512
#endif
#ifndef PYEP_LAYOUT_EXPERTS_PER_BLOCK
#define PYEP_LAYOUT_EXPERTS_PER_BLOCK 64
#endif

constexpr int kLayoutThreads = PYEP_LAYOUT_THREADS;
constexpr int kExpertsPerBlock = PYEP_LAYOUT_EXPERTS_PER_BLOCK;

typedef pyep_layout_params LayoutParams;  // params.h

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1) pyep_layout(const LayoutParams p) {
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    constexpr int kNW = kLayoutThreads / 32;
    const int b = static_cast<int>(blockIdx.x);
    const i32 T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const i64* topk = reinterpret_cast<const i64*>(p.topk);
    PYEP_SHARED(i32, s_count, kExpertsPerBlock);
    PYEP_SHARED(i64, s_bad, kNW);
    PYEP_SHARED(i32, s_sum, kNW);
    if (b < R) {
        const i64 lo = static_cast<i64>(b) * (E / R), hi = lo + E / R;
        const bool check = b == 0;
        i64 bad = 0x7fffffffffffffffll;
        i32 n = 0;
        u8* in_rank = reinterpret_cast<u8*>(p.in_rank);
        for (i32 t = tid; t < T; t += kLayoutThreads) {
            bool in = false;
            for (i32 k = 0; k < K; k++) {
                const i64 e = ld_nc(topk + static_cast<i64>(t) * K + k);
                in = in || (e >= lo && e < hi);
                if (check && (e < -1 || e >= E)) bad = min(bad, static_cast<i64>(t) * K + k);
            }
            in_rank[static_cast<i64>(t) * R + b] = in ? 1 : 0;
            n += in ? 1 : 0;
        }
        n = warp_sum(n);
        bad = warp_min(bad);
        if (lane == 0) s_sum[warp] = n, s_bad[warp] = bad;
        __syncthreads();
        if (tid == 0) {
            i32 total = 0;
            i64 first = 0x7fffffffffffffffll;
            for (int w = 0; w < kNW; w++) total += s_sum[w], first = min(first, s_bad[w]);
            reinterpret_cast<i32*>(p.per_rank)[b] = total;
            if (check && first != 0x7fffffffffffffffll) {
                // Calls are ordered on one stream: no other kernel writes the record meanwhile.
                u64* res = reinterpret_cast<u64*>(p.result);
                st_relaxed_sys(res + 1, static_cast<u64>(first / K) << 32 | static_cast<u64>(first % K));
                st_relaxed_sys(res + 2, static_cast<u64>(topk[first]));
                st_release_sys(res, p.tag);
            }
        }
        return;
    }
    const i32 e0 = (b - R) * kExpertsPerBlock, e1 = min(E, e0 + kExpertsPerBlock);
    for (int i = tid; i < kExpertsPerBlock; i += kLayoutThreads) s_count[i] = 0;
    __syncthreads();
    const i64 n = static_cast<i64>(T) * K;
    for (i64 i = tid; i < n; i += kLayoutThreads) {
        const i64 e = ld_nc(topk + i);
        if (e >= e0 && e < e1) atomicAdd(s_count + (e - e0), 1);
    }
    __syncthreads();
    for (int e = e0 + tid; e < e1; e += kLayoutThreads) reinterpret_cast<i32*>(p.per_expert)[e] = s_count[e - e0];
}

}  // namespace pyep
