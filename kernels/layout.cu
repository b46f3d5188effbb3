// layout.cu: get_dispatch_layout. From topk_idx [T, K] (global expert indices, -1 for none),
// with experts split evenly over R ranks (rank r holds [r*E/R, (r+1)*E/R)):
//   num_tokens_per_rank [R]   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] (token, choice) pairs choosing expert e
//   is_token_in_rank [T, R]   token t goes to rank r
// and the first out-of-range index. The host does not wait for this kernel: the last block records
// a bad index, with the call's tag, in host-mapped memory that the next notify reads, so that the
// dispatch after the layout fails on every rank (see NotifyParams.layout_rec in intranode.cu).
//
// One pass, a token a thread: every thread loads its token's K indices at once (one memory
// latency, not one a choice), writes the token's row of is_token_in_rank and counts its ranks and
// experts in shared memory. Each block then adds its counts to the engine's workspace (device
// memory, zero between calls; params.h's pyep_layout_work) and takes a ticket; the block that
// takes the last one writes the outputs from the workspace and zeroes it for the next call. The
// buffer's kernels never overlap (goep/cuda/normal/order.go), so one workspace serves every call.
// More experts than kSharedExperts, or ranks than kMaskRanks, are counted in the workspace
// directly.
//
// pyep:defines PYEP_LAYOUT_THREADS=512
// pyep:defines PYEP_LAYOUT_THREADS=128 PYEP_LAYOUT_SHARED_EXPERTS=64
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
#ifndef PYEP_LAYOUT_SHARED_EXPERTS
#define PYEP_LAYOUT_SHARED_EXPERTS 2048
#endif

constexpr int kLayoutThreads = PYEP_LAYOUT_THREADS;
constexpr int kSharedExperts = PYEP_LAYOUT_SHARED_EXPERTS;
constexpr int kMaskRanks = 64;   // a token's ranks as the bits of a u64
constexpr int kStagedTopk = 8;   // indices loaded together
constexpr i64 kNoBad = 0x7fffffffffffffffll;

typedef pyep_layout_params LayoutParams;  // params.h
typedef pyep_layout_work LayoutWork;

// Writes a row of R <= kMaskRanks bytes, byte r = bit r of mask: four at a time where aligned.
PYEP_DEVICE void write_row(u8* out, i32 R, u64 mask) {
    if ((R & 3) == 0 && (reinterpret_cast<u64>(out) & 3) == 0) {
        for (i32 r = 0; r < R; r += 4) {
            const u32 m = static_cast<u32>(mask >> r);
            reinterpret_cast<u32*>(out)[r / 4] = (m & 1u) | (m & 2u) << 7 | (m & 4u) << 14 | (m & 8u) << 21;
        }
        return;
    }
    for (i32 r = 0; r < R; r++) out[r] = static_cast<u8>(mask >> r & 1u);
}

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1) pyep_layout(const LayoutParams p) {
    const int tid = static_cast<int>(threadIdx.x);
    const i32 T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const i32 experts_per_rank = E / R;
    const i64* topk = reinterpret_cast<const i64*>(p.topk);
    u8* in_rank = reinterpret_cast<u8*>(p.in_rank);
    LayoutWork* work = reinterpret_cast<LayoutWork*>(p.work);
    i32* acc = reinterpret_cast<i32*>(work + 1);  // [R] tokens per rank, then [E] per expert
    PYEP_SHARED(i32, s_rank, kMaskRanks);
    PYEP_SHARED(i32, s_expert, kSharedExperts);
    PYEP_SHARED(i32, s_last, 1);
    const bool mask_ranks = R <= kMaskRanks, shared_experts = E <= kSharedExperts;
    for (int i = tid; i < kMaskRanks; i += kLayoutThreads) s_rank[i] = 0;
    for (int i = tid; shared_experts && i < E; i += kLayoutThreads) s_expert[i] = 0;
    __syncthreads();
    i32* rank_count = mask_ranks ? s_rank : acc;
    i32* expert_count = shared_experts ? s_expert : acc + R;

    i64 bad = kNoBad;
    const i64 stride = static_cast<i64>(gridDim.x) * kLayoutThreads;
    for (i64 t = static_cast<i64>(blockIdx.x) * kLayoutThreads + tid; t < T; t += stride) {
        const i64* row = topk + t * K;
        u8* out = in_rank + t * R;
        if (!mask_ranks)
            for (i32 r = 0; r < R; r++) out[r] = 0;
        u64 mask = 0;
        for (i32 k0 = 0; k0 < K; k0 += kStagedTopk) {
            i64 e[kStagedTopk];
#pragma unroll
            for (int j = 0; j < kStagedTopk; j++) e[j] = k0 + j < K ? ld_nc(row + k0 + j) : -1;
#pragma unroll
            for (int j = 0; j < kStagedTopk; j++) {
                if (e[j] < -1 || e[j] >= E) bad = min(bad, t * K + k0 + j);
                if (e[j] < 0 || e[j] >= E) continue;
                atomicAdd(expert_count + e[j], 1);
                const i32 r = static_cast<i32>(e[j] / experts_per_rank);
                if (mask_ranks) {
                    mask |= 1ull << r;
                } else if (out[r] == 0) {  // this thread's own row: its earlier stores are visible to it
                    out[r] = 1;
                    atomicAdd(rank_count + r, 1);
                }
            }
        }
        if (mask_ranks) {
            write_row(out, R, mask);
            for (i32 r = 0; r < R; r++)
                if (mask >> r & 1u) atomicAdd(s_rank + r, 1);
        }
    }
    // The smallest bad flat index, as its complement: the largest wins, and 0 (none) loses.
    if (bad != kNoBad) atomicMax(&work->bad, ~static_cast<u64>(bad));
    __syncthreads();
    for (int i = tid; mask_ranks && i < R; i += kLayoutThreads)
        if (s_rank[i] != 0) atomicAdd(acc + i, s_rank[i]);
    for (int i = tid; shared_experts && i < E; i += kLayoutThreads)
        if (s_expert[i] != 0) atomicAdd(acc + R + i, s_expert[i]);
    fence_acq_rel_gpu();  // this thread's sums before the block's ticket
    __syncthreads();
    if (tid == 0) s_last[0] = atomicAdd(&work->ticket, 1u) == gridDim.x - 1 ? 1 : 0;
    __syncthreads();
    if (s_last[0] == 0) return;

    // The last block: every block's sums are in; take them and leave zeros.
    fence_acq_rel_gpu();
    for (int i = tid; i < R; i += kLayoutThreads) reinterpret_cast<i32*>(p.per_rank)[i] = atomicExch(acc + i, 0);
    for (int i = tid; i < E; i += kLayoutThreads) reinterpret_cast<i32*>(p.per_expert)[i] = atomicExch(acc + R + i, 0);
    if (tid == 0) {
        atomicExch(&work->ticket, 0u);
        const u64 b = atomicExch(&work->bad, 0ull);
        if (b != 0) {
            // Calls are ordered on one stream: no other kernel writes the record meanwhile.
            const i64 first = static_cast<i64>(~b);
            u64* res = reinterpret_cast<u64*>(p.result);
            st_relaxed_sys(res + 1, static_cast<u64>(first / K) << 32 | static_cast<u64>(first % K));
            st_relaxed_sys(res + 2, static_cast<u64>(topk[first]));
            st_release_sys(res, p.tag);
        }
    }
}

}  // namespace pyep
