// layout.cu: get_dispatch_layout. From topk_idx [T, K] (global expert indices, -1 for none),
// with experts split evenly over R ranks (rank r holds [r*E/R, (r+1)*E/R)):
//   num_tokens_per_rank [R]   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] (token, choice) pairs choosing expert e
//   is_token_in_rank [T, R]   token t goes to rank r
// and the first out-of-range index. The host does not wait for this kernel: the cluster's first block records
// a bad index, with the call's tag, in host-mapped memory that the next notify reads, so that the
// dispatch after the layout fails on every rank (see NotifyParams.layout_rec in intranode.cu).
//
// One pass, a token a thread, in one thread block cluster (sm_90; params.h's PYEP_LAYOUT_CLUSTER
// blocks, the whole grid): every thread loads its token's K indices at once (one memory latency,
// not one a choice), writes the token's row of is_token_in_rank and counts its ranks and experts
// in its block's shared memory. After a cluster barrier the cluster's threads sum each count over
// the cluster's blocks (distributed shared memory) and write them out: no workspace, no atomics
// in global memory, no last block. More experts than kSharedExperts, or ranks than kMaskRanks, are
// counted in the outputs directly, which the cluster zeroes first. Before sm_90 (no clusters) the
// first block does it all and the others leave.
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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kLayoutCluster = 1;  // no clusters (utils.cuh's cluster_sync is __syncthreads)
#define PYEP_LAYOUT_CLUSTER_DIMS
#else
constexpr int kLayoutCluster = PYEP_LAYOUT_CLUSTER;  // the grid, one cluster
#define PYEP_LAYOUT_CLUSTER_DIMS __cluster_dims__(PYEP_LAYOUT_CLUSTER, 1, 1)
#endif

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

extern "C" __global__ void PYEP_LAYOUT_CLUSTER_DIMS __launch_bounds__(kLayoutThreads, 1) pyep_layout(const LayoutParams p) {
    const int tid = static_cast<int>(threadIdx.x);
    const u32 me = blockIdx.x;  // the grid is one cluster: a block's rank in it
    if (me >= static_cast<u32>(kLayoutCluster)) return;  // before sm_90
    const i32 T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const i32 experts_per_rank = E / R;
    const i64* topk = reinterpret_cast<const i64*>(p.topk);
    u8* in_rank = reinterpret_cast<u8*>(p.in_rank);
    i32* per_rank = reinterpret_cast<i32*>(p.per_rank);
    i32* per_expert = reinterpret_cast<i32*>(p.per_expert);
    PYEP_SHARED(i32, s_rank, kMaskRanks);
    PYEP_SHARED(i32, s_expert, kSharedExperts);
    PYEP_SHARED(u64, s_bad, 1);  // the complement of the block's smallest bad flat index (0: none)
    const bool mask_ranks = R <= kMaskRanks, shared_experts = E <= kSharedExperts;
    const int threads = kLayoutCluster * kLayoutThreads, ct = static_cast<int>(me) * kLayoutThreads + tid;
    for (int i = tid; i < kMaskRanks; i += kLayoutThreads) s_rank[i] = 0;
    for (int i = tid; shared_experts && i < E; i += kLayoutThreads) s_expert[i] = 0;
    if (tid == 0) s_bad[0] = 0;
    // Counts that shared memory cannot hold go straight to the outputs, which the cluster zeroes first.
    for (int i = ct; !mask_ranks && i < R; i += threads) per_rank[i] = 0;
    for (int i = ct; !shared_experts && i < E; i += threads) per_expert[i] = 0;
    if (mask_ranks && shared_experts)
        __syncthreads();
    else
        cluster_sync();
    i32* rank_count = mask_ranks ? s_rank : per_rank;
    i32* expert_count = shared_experts ? s_expert : per_expert;

    i64 bad = kNoBad;
    for (i64 t = ct; t < T; t += threads) {
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
    if (bad != kNoBad) atomicMax(s_bad, ~static_cast<u64>(bad));

    // Every block's counts are in its shared memory: the cluster's threads sum them over its blocks, a count each.
    cluster_sync();
    for (int i = ct; i < R + E; i += threads) {
        const bool rank = i < R;
        if (rank ? !mask_ranks : !shared_experts) continue;
        const i32* mine = rank ? s_rank + i : s_expert + (i - R);
        i32 sum = 0;
        for (u32 b = 0; b < kLayoutCluster; b++) sum += *cluster_map(mine, b);
        *(rank ? per_rank + i : per_expert + (i - R)) = sum;
    }
    if (ct == 0) {
        u64 b = 0;
        for (u32 k = 0; k < kLayoutCluster; k++) b = max(b, *cluster_map(static_cast<const u64*>(s_bad), k));
        if (b != 0) {
            // Calls are ordered on one stream: no other kernel writes the record meanwhile.
            const i64 first = static_cast<i64>(~b);
            u64* res = reinterpret_cast<u64*>(p.result);
            st_relaxed_sys(res + 1, static_cast<u64>(first / K) << 32 | static_cast<u64>(first % K));
            st_relaxed_sys(res + 2, static_cast<u64>(topk[first]));
            st_release_sys(res, p.tag);
        }
    }
    cluster_sync();  // a block's shared memory stays until every block has read it
}

}  // namespace pyep
