// layout.cu: get_dispatch_layout. From topk_idx [T, K] (global expert indices, -1 for none),
// with experts split evenly over R ranks (rank r holds [r*E/R, (r+1)*E/R)):
//   num_tokens_per_rank [R]   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] (token, choice) pairs choosing expert e
//   is_token_in_rank [T, R]   token t goes to rank r
// and the first out-of-range index. The host does not wait for this kernel: a block that finds a
// bad index records it, with the call's tag, in host-mapped memory that the next notify reads, so
// that the dispatch after the layout fails on every rank (see NotifyParams.layout_rec).
//
// One pass, a token a thread, in blocks of 128 (4096 tokens on 32 SMs: 512 took 8.0 µs in ncu, 128
// with the two below 6.3): every thread loads its token's K indices at once (one memory latency,
// not one a choice; two a load where the rows allow it), writes the token's row of is_token_in_rank
// and counts its ranks and experts in shared memory (with shared-memory atomics: count_tokens is
// compiled apart for that case, where the pointers would otherwise be generic). Block 0 zeroes the
// two count outputs and then lets the other blocks in (pyep_layout_work.gate); every block adds its
// counts to the outputs, and the kernel's end is the sums' end: no block waits for another to
// finish and no last block sums them, which cost a fence, a ticket and an exchange of the sums,
// about 2.9 of the 9 µs of the kernel it replaced (docs/performance-history.md). A block waits only
// for block 0, which waits for nothing, so the kernel needs no two of its blocks resident at once
// (ranks sharing a GPU under MPS). More experts than kSharedExperts, or ranks than kMaskRanks, are
// counted in the outputs directly, once block 0 has zeroed them.
//
// pyep:defines PYEP_LAYOUT_THREADS=128
// pyep:defines PYEP_LAYOUT_THREADS=512 PYEP_LAYOUT_SHARED_EXPERTS=64
#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif

namespace pyep {

// The host-kernel ABI.
#include "params.h"

#ifndef PYEP_LAYOUT_THREADS
#define PYEP_LAYOUT_THREADS 128
#endif
#ifndef PYEP_LAYOUT_SHARED_EXPERTS
#define PYEP_LAYOUT_SHARED_EXPERTS 2048
#endif

constexpr int kLayoutThreads = PYEP_LAYOUT_THREADS;
constexpr int kSharedExperts = PYEP_LAYOUT_SHARED_EXPERTS;
constexpr int kMaskRanks = 64;   // a token's ranks as the bits of a u64
constexpr int kStagedTopk = 8;   // indices loaded together
constexpr i64 kNoBad = 0x7fffffffffffffffll;
constexpr u64 kGateTimedOut = ~0ull;  // a record's token << 32 | choice: a block waited past the timeout

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

// The i64 whose low and high 32-bit words are lo and hi (as they lie in memory).
PYEP_DEVICE i64 of_words(int lo, int hi) {
    return static_cast<i64>(static_cast<u64>(static_cast<u32>(lo)) | static_cast<u64>(static_cast<u32>(hi)) << 32);
}

// A token's choices k0 .. k0 + kStagedTopk - 1 (-1 past K), all loaded before any is used; two a
// load where every row allows it (K even, topk 16-byte aligned).
PYEP_DEVICE void load_choices(const i64* row, i32 k0, i32 K, bool pairs, i64 (&e)[kStagedTopk]) {
    if (pairs) {
#pragma unroll
        for (int j = 0; j < kStagedTopk; j += 2) {
            e[j] = e[j + 1] = -1;
            if (k0 + j < K) {
                const int4 v = ld_nc(reinterpret_cast<const int4*>(row + k0 + j));
                e[j] = of_words(v.x, v.y), e[j + 1] = of_words(v.z, v.w);
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < kStagedTopk; j++) e[j] = k0 + j < K ? ld_nc(row + k0 + j) : -1;
}

// Counts tokens first, first + stride, ...: each token's experts in expert_count and its ranks in
// its row of in_rank and in rank_count; bad becomes the lowest flat index of a bad choice seen.
// kShared: both counts are this block's shared arrays (R <= kMaskRanks, E <= kSharedExperts),
// which the compiler then updates with shared-memory atomics; otherwise either may be an output.
template <bool kShared>
PYEP_DEVICE void count_tokens(const LayoutParams& p, i64 first, i64 stride, bool pairs, i32* expert_count,
                              i32* rank_count, i64& bad) {
    const i32 T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const u32 experts_per_rank = static_cast<u32>(E / R);
    const bool mask_ranks = kShared || R <= kMaskRanks;
    for (i64 t = first; t < T; t += stride) {
        const i64* row = reinterpret_cast<const i64*>(p.topk) + t * K;
        u8* out = reinterpret_cast<u8*>(p.in_rank) + t * R;
        if (!mask_ranks)
            for (i32 r = 0; r < R; r++) out[r] = 0;
        u64 mask = 0;
        for (i32 k0 = 0; k0 < K; k0 += kStagedTopk) {
            i64 e[kStagedTopk];
            load_choices(row, k0, K, pairs, e);
#pragma unroll
            for (int j = 0; j < kStagedTopk; j++) {
                if (e[j] < -1 || e[j] >= E) bad = min(bad, t * K + k0 + j);
                if (e[j] < 0 || e[j] >= E) continue;
                atomicAdd(expert_count + e[j], 1);
                const i32 r = static_cast<i32>(static_cast<u32>(e[j]) / experts_per_rank);
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
                if (mask >> r & 1u) atomicAdd(rank_count + r, 1);
        }
    }
}

// Records, under the workspace's lock, `at` (token << 32 | choice, or kGateTimedOut, which no
// index replaces) and `value` for the next notify, unless an earlier index of this call is
// recorded. Only blocks that found something take the lock, and a holder is running: the wait
// is short (bounded all the same).
PYEP_DEVICE void record_bad(const LayoutParams& p, LayoutWork* work, u64 at, i64 value) {
    u64* res = reinterpret_cast<u64*>(p.result);
    const i32 K = p.num_topk;
    const u64 start = globaltimer();
    while (atomicCAS(&work->lock, 0u, 1u) != 0u)
        if (globaltimer() - start > p.timeout_ns) return;
    fence_acq_rel_sys();
    const u64 had = ld_volatile(res + 1);
    if (ld_volatile(res) != p.tag || at == kGateTimedOut ||
        (had != kGateTimedOut && (had >> 32) * K + (had & 0xffffffffu) > (at >> 32) * K + (at & 0xffffffffu))) {
        st_relaxed_sys(res + 1, at);
        st_relaxed_sys(res + 2, static_cast<u64>(value));
        st_release_sys(res, p.tag);
    }
    fence_acq_rel_sys();
    atomicExch(&work->lock, 0u);
}

// Blocks other than 0: waits until block 0 has zeroed the outputs of this launch (the gate holds
// this call's tag and the blocks not yet in), then takes its place. False past the timeout (the
// next dispatch then fails; a block that never came leaves the count above 0, which only a
// replay of the same captured layout, with the same tag, would misread).
PYEP_DEVICE bool pass_gate(const LayoutParams& p, LayoutWork* work) {
    const u64 start = globaltimer();
    for (;;) {
        const u64 g = ld_acquire_gpu(&work->gate);
        if (g >> 32 == (p.tag & 0xffffffffu) && (g & 0xffffffffu) != 0) break;
        if (globaltimer() - start > p.timeout_ns) return false;
    }
    atomicAdd(&work->gate, ~0ull);  // one block fewer to come (the count is above 0: no borrow)
    return true;
}

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1) pyep_layout(const LayoutParams p) {
    const int tid = static_cast<int>(threadIdx.x);
    const i32 K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const i64* topk = reinterpret_cast<const i64*>(p.topk);
    i32* per_rank = reinterpret_cast<i32*>(p.per_rank);
    i32* per_expert = reinterpret_cast<i32*>(p.per_expert);
    LayoutWork* work = reinterpret_cast<LayoutWork*>(p.work);
    PYEP_SHARED(i32, s_rank, kMaskRanks);
    PYEP_SHARED(i32, s_expert, kSharedExperts);
    PYEP_SHARED(i32, s_open, 1);
    PYEP_SHARED(i64, s_bad, 1);
    const bool mask_ranks = R <= kMaskRanks, shared_experts = E <= kSharedExperts;
    const bool direct = !mask_ranks || !shared_experts;  // some counts go straight to the outputs
    if (blockIdx.x == 0) {
        for (int i = tid; i < R; i += kLayoutThreads) per_rank[i] = 0;
        for (int i = tid; i < E; i += kLayoutThreads) per_expert[i] = 0;
        fence_acq_rel_gpu();  // the zeros before the gate opens, and before this block's own sums
    }
    for (int i = tid; i < kMaskRanks; i += kLayoutThreads) s_rank[i] = 0;
    for (int i = tid; shared_experts && i < E; i += kLayoutThreads) s_expert[i] = 0;
    if (tid == 0) s_open[0] = 1, s_bad[0] = kNoBad;
    __syncthreads();
    if (tid == 0 && blockIdx.x == 0 && gridDim.x > 1)
        st_release_gpu(&work->gate, (p.tag & 0xffffffffu) << 32 | (gridDim.x - 1));
    bool open = true;  // counting, with the outputs zeroed where it writes them
    if (direct && blockIdx.x != 0) {
        if (tid == 0) s_open[0] = pass_gate(p, work) ? 1 : 0;
        __syncthreads();
        open = s_open[0] != 0;
    }
    const i64 own = static_cast<i64>(blockIdx.x) * kLayoutThreads + tid;  // this thread's first token
    const i64 stride = static_cast<i64>(gridDim.x) * kLayoutThreads;
    const bool pairs = (K & 1) == 0 && (reinterpret_cast<u64>(topk) & 15) == 0;
    i64 bad = kNoBad;
    if (open && !direct) {
        count_tokens<true>(p, own, stride, pairs, s_expert, s_rank, bad);
    } else if (open) {
        count_tokens<false>(p, own, stride, pairs, shared_experts ? s_expert : per_expert,
                            mask_ranks ? s_rank : per_rank, bad);
    }
    if (bad != kNoBad) atomicMin(s_bad, bad);
    // Thread 0 passes the gate while the other threads finish counting (its latency hidden there).
    if (!direct && blockIdx.x != 0 && tid == 0) s_open[0] = pass_gate(p, work) ? 1 : 0;
    __syncthreads();
    if (s_open[0] != 0) {
        for (int i = tid; mask_ranks && i < R; i += kLayoutThreads)
            if (s_rank[i] != 0) atomicAdd(per_rank + i, s_rank[i]);
        for (int i = tid; shared_experts && i < E; i += kLayoutThreads)
            if (s_expert[i] != 0) atomicAdd(per_expert + i, s_expert[i]);
    }
    if (tid != 0) return;
    if (s_open[0] == 0) {
        record_bad(p, work, kGateTimedOut, 0);
    } else if (s_bad[0] != kNoBad) {
        const i64 first = s_bad[0];
        record_bad(p, work, static_cast<u64>(first / K) << 32 | static_cast<u64>(first % K), topk[first]);
    }
}

}  // namespace pyep
