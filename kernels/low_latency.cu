// Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine): within a node every
// rank's low-latency region is mapped by every peer (CUDA IPC, or the same GPU), and a kernel
// writes straight into the peers' slots through the per-peer pointer table p.peers. Built with
// PYEP_LL_REMOTE, the kernel also reaches peers on other nodes (p.remote says which): their rows
// go through remote.cuh's remote_put_warp and their flags and acknowledgements through
// remote_signal (NVSHMEM on a GPU), from a local source (messages staged in this rank's send area,
// combine rows and selections in its own receive and push areas), and the receive side is the
// same either way. The region's layout is
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
//     A combine's send also pushes its selections to every peer first and reads the peers'
//     (low_latency_combine.cuh), under the same acknowledgements.
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
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=384 PYEP_LL_TOPK=4 PYEP_LL_LOGFMT=1
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_FP8=1 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0 PYEP_LL_TIMELINE=1
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_TIMELINE=1
// (The PYEP_LL_REMOTE builds need NVSHMEM's headers: goep/jit's TestCompileLinkedLowLatency compiles and links them.)
#ifdef PYEP_EMU
#include <cmath>

#include "emu.h"
#else
#include "utils.cuh"
#endif
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
#ifndef PYEP_LL_LOGFMT
#define PYEP_LL_LOGFMT 0
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
enum : int { kWaitAck = 1, kWaitDispatch = 2, kWaitCombine = 3, kWaitPush = 4 };

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
// store is a release already (st.release would fence again). kAdd (fenced only): adds v to the
// word instead, a red whose reply the thread does not wait for (the dispatch's done words).
template <bool kFenced = false, bool kAdd = false>
PYEP_DEVICE void signal_peer(const LLParams& p, int r, u64* word, u64 v) {
    static_assert(kFenced || !kAdd, "an add signals after the caller's fence");
#ifdef PYEP_LL_REMOTE
    if (is_remote(p, r)) {
        if (kAdd)
            remote_signal_add(word, v, r);
        else
            remote_signal(word, v, r);
        return;
    }
#endif
    if (kAdd)
        red_add_relaxed_sys(word, v);
    else if (kFenced)
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
PYEP_DEVICE u8* local(const LLParams& p) { return reinterpret_cast<u8*>(p.local); }  // region(p, p.rank), with no load
PYEP_DEVICE bool masked(const LLParams& p, int r) {
    return ld_volatile(reinterpret_cast<const i32*>(local(p) + p.off_mask) + r) != 0;
}
PYEP_DEVICE u32 call_seq(const LLParams& p) {
    return static_cast<u32>(ld_volatile(reinterpret_cast<const u64*>(p.calls) + p.half)) + 1;
}
// A dispatch's seq among the dispatch calls of its half (a half's calls need not all be of one kind), which
// its done words count; 0 in a combine.
PYEP_DEVICE u32 dispatch_seq(const LLParams& p) {
    return p.dcalls == 0 ? 0u : static_cast<u32>(ld_volatile(reinterpret_cast<const u64*>(p.dcalls) + p.half)) + 1;
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
// half (a dispatch's dcalls[h] = dseq likewise), and pending[h] = seq for the acknowledgements
// that the next kernel sends (acknowledge_pending). So the receive ends when its last row is
// read: no grid count, system-scope fence and peer stores at its end (2-3 µs of the last block's
// end, on H200s).
PYEP_DEVICE void count_recv(const LLParams& p, u32 seq, u32 dseq) {
    __syncthreads();  // every thread of the block has read its seq
    if (threadIdx.x != 0) return;
    i32* counter = reinterpret_cast<i32*>(p.counter);
    if (atomic_add_acq_rel_gpu(counter, 1) != static_cast<int>(gridDim.x) - 1) return;
    st_volatile(counter, 0);
    st_volatile(reinterpret_cast<u32*>(p.pending) + p.half, seq);
    if (p.dcalls != 0) st_volatile(reinterpret_cast<u64*>(p.dcalls) + p.half, static_cast<u64>(dseq));
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
// receive's last timeline stamp (params.h; nothing without PYEP_LL_TIMELINE). The receive gets the
// call's seq and, in a dispatch, its dispatch seq (dispatch_seq).
template <int kDone, typename Send, typename Recv>
PYEP_DEVICE void run_phases(const LLParams& p, Send send, Recv recv) {
    const u32 seq = call_seq(p);
    acknowledge_pending(p);
    if (p.phases & kPhaseSend) send(p, seq);
    if (p.phases & kPhaseRecv) {
        // Read before this block counts itself in count_recv, whose last block updates it (as calls[h]
        // above). Read at the kernel's start, it came with the send's first stamp 0.5 µs later on two
        // H200s (0.29-0.32 -> 0.86-0.90 µs, bench/results/h200x2-2026-11-27-done).
        const u32 dseq = dispatch_seq(p);
        count_recv(p, seq, dseq);
        recv(p, seq, dseq);
        PYEP_LL_STAMP(p, kDone);
    }
}

// Where the dispatch send splits its work: a unit is a token; block b takes units b,
// b + G, b + 2G, ... (G blocks), up to kBatch of them at once: the batch's waits are settled
// together first (warp 0, a lane a unit; the dispatch send, a thread a selection), then the whole
// block moves the rows of every unit of the batch as one list, so that a block's units cost about
// one memory round trip together rather than one each. (The dispatch receive deals rows or items
// instead: low_latency_dispatch.cuh.)
// Every load of a round is issued before its first use (asm volatile loads keep program order,
// so a load used at once would wait its full latency before the next is issued).
constexpr int kChunk = 256;  // channels a warp moves per step: 8 per lane (16 B of BF16)
constexpr int kChunks = (kHidden + kChunk - 1) / kChunk;
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

// Which ranks this rank may write in this call: may_send, asked once a block for the first kThreads
// ranks, rank d by thread kThreads - 1 - d (the threads a small batch of units leaves idle), so that
// the acknowledgements' loads go out beside the first loads of the lower threads. ask_writable has no
// barrier: the caller's next one must come before may_write; load_writable has one.
struct Writable {
    const LLParams& p;
    u32 seq;
    const i32* dok;
};
PYEP_DEVICE bool may_write(const Writable& w, int d) { return d < kThreads ? w.dok[d] != 0 : may_send(w.p, d, w.seq); }
PYEP_DEVICE Writable ask_writable(const LLParams& p, u32 seq, i32* s_dok) {
    const int d = kThreads - 1 - static_cast<int>(threadIdx.x);
    if (d < p.num_ranks) s_dok[d] = may_send(p, d, seq) ? 1 : 0;
    return Writable{p, seq, s_dok};
}
PYEP_DEVICE Writable load_writable(const LLParams& p, u32 seq, i32* s_dok) {
    const Writable w = ask_writable(p, seq, s_dok);
    __syncthreads();
    return w;
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
#include "low_latency_combine.cuh"  // combine_send, combine_recv

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
