// Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine): within a node every
// rank's low-latency region is mapped by every peer (CUDA IPC, or the same GPU), and a kernel
// writes straight into the peers' slots through the per-peer pointer table p.peers. Built with
// PYEP_LL_REMOTE, the kernel also reaches peers on other nodes (p.remote says which): their rows
// go through remote.cuh's remote_put_warp and their flags and acknowledgements through
// remote_signal (NVSHMEM on a GPU), from a local source (the rows of x, or messages staged in this
// rank's send area), and the receive side is the same either way. The region's layout is
// goep/lowlatency's (layout.go); the offsets come in the parameters, so this file holds no
// layout arithmetic beyond a slot's index.
//
// Protocol, per half h (calls alternate halves; the host picks h):
//   - calls[h] (the engine's device memory, local) counts the calls on half h that this rank has
//     received. A call's seq is calls[h] + 1: every rank makes the same calls, so the ranks agree
//     on it without the host passing it, which keeps a captured CUDA graph correct on replay.
//   - A sender first waits until the receiver acknowledged the previous call on h
//     (ack[h][dst] >= seq - 1 in the sender's own header), then writes its rows, then the flag
//     word seq << 32 | count with release semantics (system scope: peers read it over NVLink).
//   - A receiver waits for flag == seq of every unmasked source and reads the rows. The last block
//     to start the receive (every block has read calls[h] by then) sets calls[h] = seq and
//     pending[h] = seq; the next kernel on this rank (any call's, the kernel boundary orders every
//     read of the receive before it) writes ack[h][me] = seq into every unmasked peer's header
//     as it starts, before it waits for anything. Nothing is ever zeroed between calls.
// phases: bit 0 the send half, bit 1 the receive half (return_recv_hook launches them apart).
//
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_FP8=1 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=2048 PYEP_LL_TOPK=6 PYEP_LL_FP8=1 PYEP_LL_ROUND=1 PYEP_LL_UE8M0=1
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=384 PYEP_LL_TOPK=11 PYEP_LL_FP8=0 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=128 PYEP_LL_TOPK=1
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_FP8=1 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0 PYEP_LL_TIMELINE=1
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_TIMELINE=1
// (The PYEP_LL_REMOTE builds need NVSHMEM's headers: goep/jit's TestCompileLinkedLowLatency compiles and links them.)
#ifdef PYEP_EMU
#include <cmath>

#include "emu.h"
#else
#include "utils.cuh"
#endif
#include "copy.cuh"
#include "remote.cuh"
#include "cast.cuh"

namespace pyep {

#include "params.h"  // the host-kernel ABI, in this namespace as in intranode.cu

#ifndef PYEP_LL_HIDDEN
#define PYEP_LL_HIDDEN 256
#endif
#ifndef PYEP_LL_TOPK
#define PYEP_LL_TOPK 4
#endif
#ifndef PYEP_LL_FP8
#define PYEP_LL_FP8 0
#endif
#ifndef PYEP_LL_ROUND
#define PYEP_LL_ROUND 0
#endif
#ifndef PYEP_LL_UE8M0
#define PYEP_LL_UE8M0 0
#endif
#ifndef PYEP_LL_THREADS
#define PYEP_LL_THREADS 512
#endif

constexpr int kHidden = PYEP_LL_HIDDEN;
constexpr int kTopk = PYEP_LL_TOPK;
constexpr int kThreads = PYEP_LL_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kScaleBlock = 128;
static_assert(kHidden % kScaleBlock == 0 && kThreads % 32 == 0, "hidden is whole scale blocks");

enum : int { kPhaseSend = 1, kPhaseRecv = 2 };
// What a recorded wait was for (ErrorRecord.what); the host names it.
enum : int { kWaitAck = 1, kWaitDispatch = 2, kWaitCombine = 3 };

// The launch parameters and the error record (host-mapped) are params.h's, which the host
// includes too.
typedef struct pyep_ll_params LLParams;
typedef struct pyep_ll_error LLError;

PYEP_DEVICE u8* region(const LLParams& p, int r) { return reinterpret_cast<u8*>(reinterpret_cast<const u64*>(p.peers)[r]); }

#ifdef PYEP_LL_REMOTE
constexpr bool kRemote = true;
#else
constexpr bool kRemote = false;  // every peer is in this node: none of the remote path is compiled
#endif

// Whether peer r is reached through remote.cuh; region(p, r) is then only its name for the pair.
PYEP_DEVICE bool is_remote(const LLParams& p, int r) {
    if (!kRemote) return false;
    return reinterpret_cast<const i32*>(p.remote)[r] != 0;
}

// Stores v at word (in peer r's region, from region(p, r)) with release semantics: after every
// row this rank has written or put to r before it (the caller's barriers and fences order them).
// kFenced: where what it must follow is ordered already (right after the caller's
// fence_acq_rel_sys, or at a kernel's start after the kernels before it), a relaxed system-scope
// store is a release already (st.release would fence again).
template <bool kFenced = false>
PYEP_DEVICE void signal_peer(const LLParams& p, int r, u64* word, u64 v) {
#ifdef PYEP_LL_REMOTE
    if (is_remote(p, r)) {
        remote_signal(word, v, r);
        return;
    }
#endif
    if (kFenced)
        st_relaxed_sys(word, v);
    else
        st_release_sys(word, v);
}

// One warp puts n bytes from src (local) to dst in remote peer r's region.
PYEP_DEVICE void put_peer(int r, void* dst, const void* src, u64 n) {
#ifdef PYEP_LL_REMOTE
    remote_put_warp(dst, src, n, r);
#endif
}
PYEP_DEVICE u8* local(const LLParams& p) { return region(p, p.rank); }
PYEP_DEVICE bool masked(const LLParams& p, int r) {
    return ld_volatile(reinterpret_cast<const i32*>(local(p) + p.off_mask) + r) != 0;
}
PYEP_DEVICE u32 call_seq(const LLParams& p) {
    return static_cast<u32>(ld_volatile(reinterpret_cast<const u64*>(p.calls) + p.half)) + 1;
}

// A wait for peer timed out: the peer is masked here, so that every later wait of the call on it
// ends at once (with enable_shrink it stays masked; otherwise the host reports the record and the
// buffer needs clean_low_latency_buffer, which unmasks it), and the first failure is recorded.
PYEP_DEVICE void timed_out(const LLParams& p, int peer, int what, u64 waited) {
    st_volatile(reinterpret_cast<i32*>(local(p) + p.off_mask) + peer, 1);
    LLError* e = reinterpret_cast<LLError*>(p.err);
    if (e == nullptr || atomicCAS(&e->claimed, 0u, 1u) != 0u) return;
    st_volatile(&e->peer, peer);
    st_volatile(&e->what, what);
    st_volatile(&e->waited_ns, waited);
    st_release_sys(&e->code, 1u);
}

// One thread waits until ready(), the peer is masked, or the timeout (see timed_out); spent is the
// time it waited. Returns whether ready() held.
template <typename Ready>
PYEP_DEVICE bool thread_wait(const LLParams& p, int peer, int what, Ready ready, u64& spent) {
    spent = 0;
    if (ready()) return true;
    const u64 start = globaltimer();
    bool ok = true;
    while (!ready()) {
        const u64 now = globaltimer();
        if (masked(p, peer)) {
            ok = false;
            break;
        }
        if (now - start > p.timeout_ns) {
            timed_out(p, peer, what, now - start);
            ok = false;
            break;
        }
    }
    spent = globaltimer() - start;
    return ok;
}

// The start of a receive: every block counts itself, and the last (every block has read calls[h]
// for its seq before counting) records the call received: calls[h] = seq for the next call on the
// half, and pending[h] = seq for the acknowledgements that the next kernel sends
// (acknowledge_pending). So the receive ends when its last row is read: no grid count, system-scope
// fence and peer stores at its end (2-3 µs of the last block's end, on H200s).
PYEP_DEVICE void count_recv(const LLParams& p, u32 seq) {
    __syncthreads();  // every thread of the block has read its seq
    if (threadIdx.x != 0) return;
    i32* counter = reinterpret_cast<i32*>(p.counter);
    if (atomic_add_acq_rel_gpu(counter, 1) != static_cast<int>(gridDim.x) - 1) return;
    st_volatile(counter, 0);
    st_volatile(reinterpret_cast<u32*>(p.pending) + p.half, seq);
    st_relaxed_sys(reinterpret_cast<u64*>(p.calls) + p.half, static_cast<u64>(seq));
}

// The start of every kernel: the last block's warp 0 (the one with the least to send: the units
// are dealt from block 0) acknowledges the calls received before this kernel (pending, by the
// kernel before it) to the unmasked peers, a lane a peer, and clears them. The kernel boundary
// ordered every read of those receives before this, so the stores are relaxed (a release would
// fence: 3 µs on an H200 at a kernel's start). The block does it before its own receive counts,
// so never for this kernel's call.
PYEP_DEVICE void acknowledge_pending(const LLParams& p) {
    if (blockIdx.x != gridDim.x - 1 || threadIdx.x >= 32) return;
    const int lane = lane_id();
    u32* pending = reinterpret_cast<u32*>(p.pending);
    for (int h = 0; h < 2; h++) {
        const u32 seq = ld_volatile(pending + h);
        if (seq == 0) continue;
        for (int r = lane; r < p.num_ranks; r += 32)
            if (r != p.rank && !masked(p, r))
                signal_peer<true>(p, r, reinterpret_cast<u64*>(region(p, r) + p.off_ack) + h * p.num_ranks + p.rank,
                                  static_cast<u64>(seq));
        __syncwarp();
        if (lane == 0) st_volatile(pending + h, 0u);
    }
}

// A kernel: its call's send phase, its receive phase, or both, as p.phases says. kDone is the
// receive's last timeline stamp (params.h; nothing without PYEP_LL_TIMELINE).
template <int kDone, typename Send, typename Recv>
PYEP_DEVICE void run_phases(const LLParams& p, Send send, Recv recv) {
    const u32 seq = call_seq(p);
    acknowledge_pending(p);
    if (p.phases & kPhaseSend) send(p, seq);
    if (p.phases & kPhaseRecv) {
        count_recv(p, seq);
        recv(p, seq);
        PYEP_LL_STAMP(p, kDone);
    }
}

// Where the batched phases split their work: a unit is a token (dispatch send) or an (expert, rank)
// pair (combine send to remote peers, or more pairs than a block holds); block b takes units b,
// b + G, b + 2G, ... (G blocks), up to kBatch of them at once: the batch's waits are settled
// together first (warp 0, a lane a unit; the dispatch send, a thread a selection), then the whole
// block moves the rows of every unit of the batch as one list, so that a block's units cost about
// one memory round trip together rather than one each. (The balanced phases, below, deal rows or
// items instead; low_latency_dispatch.cuh says how the dispatch receive does.)
// Every load of a round is issued before its first use (asm volatile loads keep program order,
// so a load used at once would wait its full latency before the next is issued).
constexpr int kChunk = 256;  // channels a warp moves per step: 8 per lane (16 B of BF16)
constexpr int kChunks = (kHidden + kChunk - 1) / kChunk;
constexpr int kRowUnroll = 4;  // vectors a thread has in flight when a block copies rows (copy.cuh)
constexpr int kBatch = 8;      // units a block takes at once (at most 32: a lane of warp 0 each)
static_assert(kBatch <= 32 && kBatch <= kThreads, "a unit of a batch is a lane of warp 0");

// The units of the batch that starts at unit u0 (of n, every G-th), at most kBatch.
PYEP_DEVICE int batch_units(int u0, int n) {
    const int G = static_cast<int>(gridDim.x), left = (n - u0 + G - 1) / G;
    return left < kBatch ? left : kBatch;
}

// The unit of item k: the last of the P units whose first item (first[i], nondecreasing; first[0] = 0)
// is <= k, found by a binary search (units with no item are passed over).
PYEP_DEVICE int unit_of(const i32* first, int P, int k) {
    int lo = 0, hi = P - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= k) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Whether this thread may write into peer dst's half this call: dst unmasked and its
// acknowledgement of the previous call on the half arrived.
PYEP_DEVICE bool may_send(const LLParams& p, int dst, u32 seq) {
    if (masked(p, dst)) return false;
    if (dst == p.rank || seq <= 1) return true;
    const u64* ack = reinterpret_cast<const u64*>(local(p) + p.off_ack) + p.half * p.num_ranks + dst;
    u64 spent;
    return thread_wait(p, dst, kWaitAck, [&] { return ld_acquire_sys(ack) >= seq - 1; }, spent);
}

// Warp 0's lane 0 turns the counts n[0..P) into first items (first[i] = the sum of n[<i] times
// per); the caller syncs the block after.
PYEP_DEVICE void warp0_prefix(const i32* n, i32* first, int P, int per) {
    __syncwarp();
    if (lane_id() == 0) {
        int f = 0;
        for (int i = 0; i < P; i++) {
            first[i] = f;
            f += n[i] * per;
        }
        first[P] = f;
    }
}

// The exclusive prefix sum of one value a thread, in thread order, and the block's total. Every
// thread of the block calls it (two barriers and one after, so that s_warp may be used again).
PYEP_DEVICE int block_exclusive_sum(int v, i32* s_warp, int& total) {
    const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / 32;
    int x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < kWarps ? s_warp[lane] : 0;
        int y = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int z = __shfl_up_sync(0xffffffffu, y, d);
            if (lane >= d) y += z;
        }
        if (lane < kWarps) s_warp[lane] = y - w;
        if (lane == kWarps - 1) s_warp[kWarps] = y;
    }
    __syncthreads();
    total = s_warp[kWarps];
    const int before = s_warp[warp] + x - v;
    __syncthreads();
    return before;
}

// The balanced phases (the dispatch receive, the combine send) hold every pair's prefix sum in a
// block (when the pairs fit) and move an equal share of rows, kRowsRound located at once.
constexpr int kPairsShared = 4 * kThreads;  // pairs a block holds the prefix sums of
constexpr int kRowsRound = 64;               // rows a block locates at once

#if defined(PYEP_LL_DISPATCH)
#include "low_latency_dispatch.cuh"  // dispatch_send, dispatch_recv

// The GPU loads the kernels by their C++ names, so that profilers show pyep::ll::dispatch and ::combine (DeepEP's
// test harness finds its kernels by those names); the emulator by their C names.
#ifdef PYEP_EMU
extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_ll_dispatch(const LLParams p) {
    run_phases<PYEP_LL_DR_DONE>(p, dispatch_send, dispatch_recv);
}
#else
namespace ll {
__global__ void __launch_bounds__(kThreads, 1) dispatch(const LLParams p) { run_phases<PYEP_LL_DR_DONE>(p, dispatch_send, dispatch_recv); }
}  // namespace ll
#endif

#endif  // PYEP_LL_DISPATCH

#if defined(PYEP_LL_COMBINE)

// Send: a pair (local expert j, destination d) sends j's rows from d back, each into the slot
// (this rank's global expert, token) of d's recv area, then its flag seq << 32 | 1 in d's header.
// The rows come from x (or the send area with zero copy); layout_range (this rank's dispatch
// receive wrote it) gives pair c = j * R + d's count and first row among j's.
//
// Balanced (no remote peer, every pair's count in a block): every block takes the prefix sums of
// all pairs' counts and copies an equal share of the rows, its rows [N b / G, N (b + 1) / G) of
// the N sent, kRowsRound located at once (a row whose d may not be written is skipped). Then it
// adds its rows of each pair it touched to the pair's counter (p.expert_sent, the engine's combine
// counters: an i32 a pair) after a fence, and the count that completes a pair stores its flag, as
// the dispatch send does per expert. A pair with no row gets its flag from block c % G. So a
// block's time is its share of the rows, not the rows of the pairs it was dealt, which vary with
// the routing (a block that copied a heavy pair to a peer ended the send twice the median after).
PYEP_DEVICE void combine_send_balanced(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_cfirst, kPairsShared + 1);  // pair c's first row among all sent; [NP] = N
    PYEP_SHARED(i32, s_cwarp, kWarps + 1);
    PYEP_SHARED(i32, s_dok, kThreads);  // whether destination d may be written
    PYEP_SHARED(u64, s_src, kRowsRound);  // the round's rows: where each is in x,
    PYEP_SHARED(u64, s_dst, kRowsRound);  // and its slot (0: skipped)
    const int R = p.num_ranks, L = p.num_experts / R, NP = L * R, M = p.max_tokens, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x), b = static_cast<int>(blockIdx.x);
    const i64 RM = static_cast<i64>(R) * M;
    const u16* rows = p.zero_copy ? reinterpret_cast<const u16*>(local(p) + p.off_send) : reinterpret_cast<const u16*>(p.x);
    const i32* src_info = reinterpret_cast<const i32*>(p.src_info);
    const i64* range = reinterpret_cast<const i64*>(p.layout_range);
    i32* sent = reinterpret_cast<i32*>(p.expert_sent);
    auto flag = [&](int c) { return reinterpret_cast<u64*>(region(p, c % R) + p.off_cflags) + p.rank * L + c / R; };
    PYEP_LL_STAMP_START(p, PYEP_LL_CS_START, PYEP_LL_CS_FLAGGED);
    for (int d = tid; d < R; d += kThreads) s_dok[d] = may_send(p, d, seq) ? 1 : 0;
    int carry = 0;
    for (int c0 = 0; c0 < NP; c0 += kThreads) {  // block-uniform
        const int c = c0 + tid;
        int total;
        const int before = block_exclusive_sum(c < NP ? static_cast<int>(range[c] & 0xffffffff) : 0, s_cwarp, total);
        if (c < NP) s_cfirst[c] = carry + before;
        carry += total;
    }
    if (tid == 0) s_cfirst[NP] = carry;
    __syncthreads();
    PYEP_LL_STAMP(p, PYEP_LL_CS_ADMITTED);
    for (int c = b + tid * G; c < NP; c += kThreads * G)
        if (s_cfirst[c + 1] == s_cfirst[c] && s_dok[c % R] != 0) signal_peer(p, c % R, flag(c), static_cast<u64>(seq) << 32 | 1u);
    const int N = carry;
    const int r0 = static_cast<int>(static_cast<i64>(N) * b / G), r1 = static_cast<int>(static_cast<i64>(N) * (b + 1) / G);
    for (int k0 = r0; k0 < r1; k0 += kRowsRound) {
        const int n = r1 - k0 < kRowsRound ? r1 - k0 : kRowsRound;
        if (tid < n) {
            const int k = k0 + tid, c = unit_of(s_cfirst, NP, k), j = c / R, d = c % R;
            const i64 row = j * RM + (range[c] >> 32) + (k - s_cfirst[c]);
            s_src[tid] = reinterpret_cast<u64>(rows + row * kHidden);
            s_dst[tid] = s_dok[d] == 0 ? 0
                                       : reinterpret_cast<u64>(region(p, d) + p.off_recv + static_cast<u64>(p.rank * L + j) * M * (2 * kHidden) +
                                                               static_cast<u64>(ld_nc(src_info + row)) * (2 * kHidden));
        }
        __syncthreads();
        block_copy_rows<int4, kRowUnroll, false, kHidden / 8>(
            n, [&](int k) { return reinterpret_cast<const int4*>(s_src[k]); }, [&](int k) { return reinterpret_cast<int4*>(s_dst[k]); });
        __syncthreads();  // the round's rows are written (and its readers done with s_src, s_dst)
    }
    PYEP_LL_STAMP(p, PYEP_LL_CS_COPIED);
    PYEP_LL_STAMP(p, PYEP_LL_CS_WRITTEN);
    // The block's rows of each pair it touched, pairs c_lo, c_lo + 1, ... while they start before r1.
    const int c_lo = r0 < r1 ? unit_of(s_cfirst, NP, r0) : NP;
    for (int c = c_lo + tid; c < NP && s_cfirst[c] < r1; c += kThreads) {
        const int lo = s_cfirst[c] > r0 ? s_cfirst[c] : r0, hi = s_cfirst[c + 1] < r1 ? s_cfirst[c + 1] : r1;
        if (hi <= lo) continue;
        fence_acq_rel_sys();  // the block's rows (ordered before this by the barrier) before the count
        if (atomicAdd(sent + c, hi - lo) + (hi - lo) != s_cfirst[c + 1] - s_cfirst[c]) continue;
        // The last rows of pair c: every block's rows of c are ordered before this.
        fence_acq_rel_sys();
        st_volatile(sent + c, 0);  // for the next call (a later kernel)
        if (s_dok[c % R] != 0 && !masked(p, c % R)) signal_peer<true>(p, c % R, flag(c), static_cast<u64>(seq) << 32 | 1u);
    }
    PYEP_LL_STAMP(p, PYEP_LL_CS_FLAGGED);
}

// Batched (a remote peer, or more pairs than a block holds): a unit is a pair. A batch's pairs are
// admitted by warp 0 (a lane each) and copied by the block as one list; the rows of remote pairs
// are put instead, a row a warp, straight from x (or the send area) into the slots.
PYEP_DEVICE void combine_send_batched(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_n, kBatch);     // pair i's rows (0 when it may not send)
    PYEP_SHARED(i32, s_row, kBatch + 1);
    PYEP_SHARED(i64, s_first, kBatch);  // pair i's first row of x
    PYEP_SHARED(i32, s_ok, kBatch);
    PYEP_SHARED(u64, s_slots, kBatch);  // pair i's area at d
    PYEP_SHARED(i32, s_rn, kBatch);     // pair i's rows when d is remote (then s_n[i] = 0)
    PYEP_SHARED(i32, s_rrow, kBatch + 1);
    const int R = p.num_ranks, L = p.num_experts / R, M = p.max_tokens, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32;
    const i64 RM = static_cast<i64>(R) * M;
    const u16* rows = p.zero_copy ? reinterpret_cast<const u16*>(local(p) + p.off_send) : reinterpret_cast<const u16*>(p.x);
    const i32* src_info = reinterpret_cast<const i32*>(p.src_info);
    PYEP_LL_STAMP_START(p, PYEP_LL_CS_START, PYEP_LL_CS_FLAGGED);
    for (int u0 = static_cast<int>(blockIdx.x); u0 < L * R; u0 += kBatch * G) {
        const int P = batch_units(u0, L * R);
        __syncthreads();  // the previous batch's readers are done with the shared arrays
        if (tid < 32) {
            if (tid < P) {
                const int pair = u0 + tid * G, j = pair / R, d = pair % R;
                const bool ok = may_send(p, d, seq);
                const i64 v = reinterpret_cast<const i64*>(p.layout_range)[j * R + d];
                const bool rem = is_remote(p, d);
                s_ok[tid] = ok ? 1 : 0;
                s_n[tid] = ok && !rem ? static_cast<i32>(v & 0xffffffff) : 0;
                s_rn[tid] = ok && rem ? static_cast<i32>(v & 0xffffffff) : 0;
                s_first[tid] = j * RM + (v >> 32);
                s_slots[tid] = reinterpret_cast<u64>(region(p, d) + p.off_recv + static_cast<u64>(p.rank * L + j) * M * (2 * kHidden));
            }
            warp0_prefix(s_n, s_row, P, 1);
            if (kRemote) warp0_prefix(s_rn, s_rrow, P, 1);
        }
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_CS_ADMITTED);
        if (kRemote)
            for (int k = warp; k < s_rrow[P]; k += kWarps) {
                const int i = unit_of(s_rrow, P, k);
                const i64 row = s_first[i] + k - s_rrow[i];
                put_peer((u0 + i * G) % R, reinterpret_cast<u8*>(s_slots[i]) + static_cast<u64>(ld_nc(src_info + row)) * (2 * kHidden),
                         rows + row * kHidden, 2 * kHidden);
            }
        block_copy_rows<int4, kRowUnroll, false, kHidden / 8>(
            s_row[P],
            [&](int k) {
                const int i = unit_of(s_row, P, k);
                return reinterpret_cast<const int4*>(rows + (s_first[i] + k - s_row[i]) * kHidden);
            },
            [&](int k) {
                const int i = unit_of(s_row, P, k);
                return reinterpret_cast<int4*>(reinterpret_cast<u8*>(s_slots[i]) +
                                               static_cast<u64>(ld_nc(src_info + s_first[i] + k - s_row[i])) * (2 * kHidden));
            });
        PYEP_LL_STAMP(p, PYEP_LL_CS_COPIED);
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_CS_WRITTEN);
        if (tid < P && s_ok[tid] != 0) {
            const int pair = u0 + tid * G;
            fence_acq_rel_sys();  // the block's rows (ordered before this by the barrier) reach d first
            signal_peer<true>(p, pair % R, reinterpret_cast<u64*>(region(p, pair % R) + p.off_cflags) + p.rank * L + pair / R,
                              static_cast<u64>(seq) << 32 | 1u);
        }
        PYEP_LL_STAMP(p, PYEP_LL_CS_FLAGGED);
    }
    if (static_cast<int>(blockIdx.x) >= L * R) PYEP_LL_STAMPS_AT_ONCE(p, PYEP_LL_CS_ADMITTED, PYEP_LL_CS_FLAGGED);  // no pair
}

PYEP_DEVICE void combine_send(const LLParams& p, u32 seq) {
    if (!kRemote && p.num_experts <= kPairsShared && p.num_ranks <= kThreads)
        combine_send_balanced(p, seq);
    else
        combine_send_batched(p, seq);
}

// Receive: every block waits for every unmasked expert's flag (a thread each); the threads that
// waited acquired the rows, and the barrier orders the block's reads after them. Then each warp
// of the grid takes (token, kCombineGroup chunks) items and sums each chunk's rows in top-k order.
constexpr int kCombineGroup = 2;  // chunks an item sums: a token's indices and weights are loaded once for them
constexpr int kGroups = (kChunks + kCombineGroup - 1) / kCombineGroup;
constexpr int kMaskCache = 64;  // ranks whose mask the block keeps in shared memory
PYEP_DEVICE void combine_recv(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_mask, kMaskCache);
    const int lane = lane_id(), R = p.num_ranks, E = p.num_experts, L = E / R, M = p.max_tokens;
    const u64* flags = reinterpret_cast<const u64*>(local(p) + p.off_cflags);
    PYEP_LL_STAMP_START(p, PYEP_LL_CR_START, PYEP_LL_CR_DONE);
    for (int g = static_cast<int>(threadIdx.x); g < E; g += kThreads) {
        const int s = g / L;
        if (masked(p, s)) continue;
        u64 spent;
        thread_wait(p, s, kWaitCombine, [&] { return static_cast<u32>(ld_acquire_sys(flags + g) >> 32) == seq; }, spent);
        if (blockIdx.x == 0 && p.wait_stats != 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + s, static_cast<unsigned long long>(spent));
    }
    __syncthreads();  // every wait is over: the masks are final for the call
    PYEP_LL_STAMP(p, PYEP_LL_CR_FLAGS);
    for (int r = static_cast<int>(threadIdx.x); r < R && r < kMaskCache; r += kThreads) s_mask[r] = masked(p, r) ? 1 : 0;
    __syncthreads();
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    const u8* slots = local(p) + p.off_recv;
    const int nw = static_cast<int>(gridDim.x) * kWarps;
    for (int it = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32; it < p.num_tokens * kGroups;
         it += nw) {
        const int t = it / kGroups, c0 = (it % kGroups) * kCombineGroup * kChunk + lane * 8;
        i64 g[kTopk];
        float w[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++) g[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
        for (int k = 0; k < kTopk; k++) w[k] = ld_nc(wts + static_cast<i64>(t) * kTopk + k);
        bool on[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++) {
            const int s = g[k] >= 0 && g[k] < E ? static_cast<int>(g[k] / L) : -1;
            on[k] = s >= 0 && (s < kMaskCache ? s_mask[s] : (masked(p, s) ? 1 : 0)) == 0;
        }
        int4 v[kCombineGroup][kTopk];
#pragma unroll
        for (int q = 0; q < kCombineGroup; q++) {
            const int c = c0 + q * kChunk;
#pragma unroll
            for (int k = 0; k < kTopk; k++)
                if (on[k] && c < kHidden)
                    v[q][k] = ld_ring(reinterpret_cast<const int4*>(slots + (static_cast<u64>(g[k]) * M + t) * (2 * kHidden)) + c / 8);
        }
#pragma unroll
        for (int q = 0; q < kCombineGroup; q++) {
            const int c = c0 + q * kChunk;
            if (c >= kHidden) continue;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int k = 0; k < kTopk; k++) {
                if (!on[k]) continue;
                const u32 words[4] = {static_cast<u32>(v[q][k].x), static_cast<u32>(v[q][k].y), static_cast<u32>(v[q][k].z),
                                      static_cast<u32>(v[q][k].w)};
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    acc[2 * h] += mul_rn(bf16_to_float(static_cast<u16>(words[h] & 0xffffu)), w[k]);
                    acc[2 * h + 1] += mul_rn(bf16_to_float(static_cast<u16>(words[h] >> 16)), w[k]);
                }
            }
            int4 o;
            o.x = static_cast<int>(static_cast<u32>(float_to_bf16(acc[0])) | static_cast<u32>(float_to_bf16(acc[1])) << 16);
            o.y = static_cast<int>(static_cast<u32>(float_to_bf16(acc[2])) | static_cast<u32>(float_to_bf16(acc[3])) << 16);
            o.z = static_cast<int>(static_cast<u32>(float_to_bf16(acc[4])) | static_cast<u32>(float_to_bf16(acc[5])) << 16);
            o.w = static_cast<int>(static_cast<u32>(float_to_bf16(acc[6])) | static_cast<u32>(float_to_bf16(acc[7])) << 16);
            st_na(reinterpret_cast<int4*>(reinterpret_cast<u16*>(p.out) + static_cast<i64>(t) * kHidden + c), o);
        }
    }
    PYEP_LL_STAMP(p, PYEP_LL_CR_SUMMED);
}

#ifdef PYEP_EMU
extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_ll_combine(const LLParams p) {
    run_phases<PYEP_LL_CR_DONE>(p, combine_send, combine_recv);
}
#else
namespace ll {
__global__ void __launch_bounds__(kThreads, 1) combine(const LLParams p) { run_phases<PYEP_LL_CR_DONE>(p, combine_send, combine_recv); }
}  // namespace ll
#endif

#endif  // PYEP_LL_COMBINE

}  // namespace pyep
