// intranode.cu: normal-mode dispatch and combine within one NVLink domain.
//
// One source, four kernels, chosen by defines (the host compiles each with the constants it is
// specialised on):
//   PYEP_NOTIFY    pyep_notify (the count exchange of a dispatch, notify.cuh); constants:
//                  PYEP_RANKS.
//   PYEP_DISPATCH  pyep_dispatch; constants: PYEP_RANKS, PYEP_HIDDEN_BYTES, PYEP_SCALES_BYTES,
//                  PYEP_TOPK, PYEP_VEC, PYEP_SPLIT_SEND (intranode_dispatch.cuh).
//   both           pyep_notify_dispatch, the queued dispatch in one launch: notify in block 0,
//                  pyep_dispatch's blocks after it; the dispatch's constants.
//   PYEP_COMBINE   pyep_combine; constants: PYEP_RANKS, PYEP_HIDDEN, PYEP_DTYPE (1 bf16,
//                  2 fp16, 3 fp32), PYEP_TOPK, PYEP_VEC, PYEP_BIASES (the biases given: bit 0
//                  bias0, bit 1 bias1).
// Dispatch and combine also take their shape, chosen per op and rank count by the host
// (goep/cuda/normal/shape.go): PYEP_THREADS (the block size) and PYEP_COPY_UNROLL.
//
// pyep:defines PYEP_NOTIFY PYEP_RANKS=2
// pyep:defines PYEP_NOTIFY PYEP_RANKS=8
// pyep:defines PYEP_DISPATCH PYEP_RANKS=4 PYEP_HIDDEN_BYTES=14336 PYEP_SCALES_BYTES=0 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=8 PYEP_HIDDEN_BYTES=7168 PYEP_SCALES_BYTES=224 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=3 PYEP_HIDDEN_BYTES=5760 PYEP_SCALES_BYTES=0 PYEP_TOPK=0 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=2 PYEP_HIDDEN_BYTES=198 PYEP_SCALES_BYTES=4 PYEP_TOPK=9 PYEP_VEC=2
// pyep:defines PYEP_NOTIFY PYEP_DISPATCH PYEP_RANKS=8 PYEP_HIDDEN_BYTES=7168 PYEP_SCALES_BYTES=224 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_NOTIFY PYEP_DISPATCH PYEP_RANKS=2 PYEP_HIDDEN_BYTES=198 PYEP_SCALES_BYTES=4 PYEP_TOPK=9 PYEP_VEC=2
// pyep:defines PYEP_COMBINE PYEP_RANKS=4 PYEP_HIDDEN=7168 PYEP_DTYPE=1 PYEP_TOPK=8 PYEP_VEC=16 PYEP_BIASES=0
// pyep:defines PYEP_COMBINE PYEP_RANKS=8 PYEP_HIDDEN=2880 PYEP_DTYPE=2 PYEP_TOPK=0 PYEP_VEC=16 PYEP_BIASES=3
// pyep:defines PYEP_COMBINE PYEP_RANKS=1 PYEP_HIDDEN=100 PYEP_DTYPE=3 PYEP_TOPK=33 PYEP_VEC=16 PYEP_BIASES=1
// pyep:defines PYEP_COMBINE PYEP_RANKS=5 PYEP_HIDDEN=99 PYEP_DTYPE=1 PYEP_TOPK=1 PYEP_VEC=2 PYEP_BIASES=2
// pyep:defines PYEP_COMBINE PYEP_RANKS=4 PYEP_HIDDEN=2880 PYEP_DTYPE=1 PYEP_TOPK=8 PYEP_VEC=16 PYEP_BIASES=0
//
// # Memory
//
// Every rank's data region (num_nvl_bytes) holds, for one call:
//
//   [tails: u64 [C*R][kSubRings]][heads: u32 [C*R][kSubRings]][ring slot fields ...] ... [notify scratch]
//
// Ring (c, s -> r), for channel c from sender s to receiver r, lives in r's region: its slots (one
// array per field, all rings' slots of a field in one array). A ring is split into W sub-rings of
// S = ring_slots / W slots (sub_rings below): the ring's i-th token goes to sub-ring i % W, slot
// (i / W) % S, so that one sending warp and one receiving warp stream each sub-ring on their own,
// with no barrier between the warps of a block (which warp takes which: intranode_dispatch.cuh's
// sub_ring). The tail words tails[c*R + s][w] there are written by s: (count + 1) << 32 | tokens of
// sub-ring w pushed so far, count being what s will push on the whole ring in this call (0: not
// announced yet). The head words, in the sender's region (heads[c*R + r][w] of s, written by r),
// count what r has consumed: per sub-ring in dispatch; in combine, word 0 counts the ring's tokens
// freed (the reducers take tokens in token order, not by sub-ring). So both sides poll their own
// memory and only write across NVLink. Ring (c, r -> r) carries no rows: in a dispatch a rank's
// own tokens go straight from x to its received rows (intranode_dispatch.cuh's dispatch_local), in
// a combine the reducers read them in x, and the sending block's reducers report their progress
// to the coordinator in that ring's tail words (intranode_combine.cuh's Progress).
//
// Counters are reset by their owner between two barriers at the start of every call: after the
// first barrier no peer still runs an earlier kernel that writes here, after the second every
// counter of every rank is zero. Notify does it for the dispatch that follows it (in the queued
// dispatch, the same kernel's block 0); a cached dispatch or a combine does it in its own kernel,
// one launch a call (call_barriers): block 0 passes the barriers and resets, every other block
// waits for the second barrier to complete before it touches a ring or a counter. The barriers
// are numbered by the host (ctx.seq and seq + 1; the engine adds 2 for every call that has them,
// so every rank numbers alike).
//
// Control region (goep.ControlBytes, zeroed at allocation): barrier signals (one u64 per rank,
// the sequence number of the last barrier that rank reached; the host numbers barriers, every
// rank alike), the abort word, the claim of the error record, and the queued dispatch's verdict
// (kCtlGo).
//
// # Ordering
//
// Data is written with plain stores. A sending warp then posts its new tail word to its block's
// publisher warp with a CTA-scope release (lane 0, after a __syncwarp, whose bar.warp.sync orders
// the lanes' stores first), which costs it no wait; the publisher acquires the posts, issues one
// fence.acq_rel.sys for all of them and stores the tail words, so the system-scope fence that
// waits for the stores to land is paid once per round of posts, by a warp that copies nothing.
// A receiving warp publishes its head itself (st.release.sys by lane 0 after a __syncwarp),
// every half sub-ring. Each side polls with ld.acquire.sys (lane 0), then the warp reads the
// ring with relaxed loads at gpu scope (served by L2, never a stale L1 line) after a __syncwarp
// with the polling lane.
//
// # Failures
//
// Every wait is bounded by ctx.timeout_ns (PYEP_TIMEOUT_S). The first failure of a rank claims
// its error record (host-mapped memory the host reads at its next call) and sets the abort
// word of the rank and of every peer; every wait polls the abort word, so all ranks stop
// within a poll instead of each waiting for its own timeout, and a later kernel on a buffer
// whose abort word is set returns at once. The host then refuses the buffer.
#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif
#include "protocol.cuh"
#include "copy.cuh"

namespace pyep {

// The host-kernel ABI, in this namespace so that the protocol helpers find this file's
// functions of a Ctx (argument-dependent lookup).
#include "params.h"

#ifndef PYEP_RANKS
#define PYEP_RANKS 2
#endif
#ifndef PYEP_THREADS
#define PYEP_THREADS 768
#endif

constexpr int kRanks = PYEP_RANKS;
constexpr int kThreads = PYEP_THREADS;
constexpr int kWarps = kThreads / 32;
static_assert(kRanks >= 1 && kRanks <= 8, "1 to 8 ranks");
static_assert(kThreads % 32 == 0 && kWarps >= kRanks + 1, "a warp per rank at least, plus one");

// Everything a kernel needs about the call and the domain (params.h, shared with the host).
typedef pyep_ctx Ctx;

// The ranks that protocol.cuh's barrier and abort reach.
PYEP_DEVICE constexpr int domain_ranks(const Ctx&) { return kRanks; }

// DeepEP's split of T tokens into C channels of consecutive tokens.
PYEP_DEVICE void channel_range(i32 num_tokens, i32 num_channels, i32 c, i32& lo, i32& hi) {
    const i32 per = (num_tokens + num_channels - 1) / num_channels;
    lo = min(c * per, num_tokens);
    hi = min(lo + per, num_tokens);
}

#if defined(PYEP_NOTIFY)

// ---------------------------------------------------------------------------------------------
// Notify: every rank learns what every rank sends where, and checks its own arguments.

#include "notify.cuh"

#if !defined(PYEP_DISPATCH)

#ifndef PYEP_NOTIFY_THREADS
#define PYEP_NOTIFY_THREADS 1024
#endif
constexpr int kNotifyThreads = PYEP_NOTIFY_THREADS;

// Notify alone (a dispatch whose rows are allocated after the counts): its verdict is the host's
// (the result's go), no kernel waits for it.
extern "C" __global__ void __launch_bounds__(kNotifyThreads, 1) pyep_notify(const NotifyParams p) {
    notify_block<kNotifyThreads>(p, [](bool) {});
}

#endif  // !PYEP_DISPATCH

#endif  // PYEP_NOTIFY

#if defined(PYEP_DISPATCH) || defined(PYEP_COMBINE)

#ifndef PYEP_TOPK
#define PYEP_TOPK 0
#endif
#ifndef PYEP_VEC
#define PYEP_VEC 16
#endif
constexpr int kTopk = PYEP_TOPK;  // a token's top-k entries that travel with it (0: none)
constexpr int kVec = PYEP_VEC;    // bytes a lane moves at once
typedef typename Vec<kVec>::T V;

// ---------------------------------------------------------------------------------------------
// Shared by dispatch and combine: the warp groups of a block, and the sending block's publisher
// (the last warp). The combine's groups are of one size: warps [g*WPR, (g+1)*WPR) serve rank g,
// this rank's own rows included. The dispatch sizes its own (intranode_dispatch.cuh).
constexpr int kWarpsPerRank = (kWarps - 1) / kRanks;
constexpr int kPublisher = kWarps - 1;
static_assert(kRanks * kWarpsPerRank <= 32, "a publisher lane per sending warp");

// The rank that group g serves: g, or with skip_self (a dispatch's peers, this rank's own rows
// having a group of their own) g + 1 from this rank's own on.
PYEP_DEVICE int group_rank(int g, int me, bool skip_self) { return skip_self && g >= me ? g + 1 : g; }

// ---------------------------------------------------------------------------------------------
// The probe, a diagnosis instrument (issue #18), built only with PYEP_JIT_FLAGS=-DPYEP_PROBE=ADDR,
// ADDR the device address of kProbeKernels * kProbeBlocks * 32 records of 8 u64s (zeroed by the
// caller): every warp of a dispatch or combine data kernel writes its record there, at
// [kernel][block][warp]: 1 + its role, the peer it served, the rows it moved, when it entered,
// started (after the call's barriers) and ended (%globaltimer ns, one clock for all SMs), the SM
// cycles it spent polling a peer's word (clock64) and its cycles from start to end (to convert
// them). After the records, kProbeTokens records of 8 u64s, one a token the combine reduces (its
// index): when its reducer began to wait for it, when its rows were all there, when their
// sources were checked, when the first run of vectors was summed, when it was reduced (ns), and
// the reducer's block * 32 + warp. bench/device/normal_probe.py reads and sums them up. Without
// PYEP_PROBE every probe_ function is empty.
enum ProbeRole : int { kProbeSend, kProbeRecv, kProbeLocalSend, kProbeLocalRecv, kProbePublish, kProbeCoordinate,
                       kProbeReduce, kProbeIdle };
enum : int { kProbeDispatch, kProbeCombine, kProbeKernels, kProbeBlocks = 128, kProbeTokens = 16384 };
#if defined(PYEP_PROBE) && !defined(PYEP_EMU)
__shared__ u64 g_probe[kWarps][5];  // wait cycles, rows, entry ns, start ns, start cycles
PYEP_DEVICE u64* probe_row() { return g_probe[threadIdx.x / 32]; }
PYEP_DEVICE void probe_entry() {
    if (threadIdx.x % 32 == 0) probe_row()[0] = 0, probe_row()[1] = 0, probe_row()[2] = globaltimer();
}
PYEP_DEVICE void probe_start() {
    if (threadIdx.x % 32 == 0) probe_row()[3] = globaltimer(), probe_row()[4] = clock64();
}
PYEP_DEVICE u64 probe_clock() { return clock64(); }
PYEP_DEVICE void probe_waited(u64 since) {
    if (threadIdx.x % 32 == 0) probe_row()[0] += clock64() - since;
}
PYEP_DEVICE void probe_rows(int n) {
    if (threadIdx.x % 32 == 0) probe_row()[1] += n;
}
PYEP_DEVICE void probe_end(int kernel, int role, int peer) {
    if (threadIdx.x % 32 != 0 || blockIdx.x >= kProbeBlocks || threadIdx.x / 32 >= 32) return;
    const u64* r = probe_row();
    u64* out = reinterpret_cast<u64*>(static_cast<unsigned long long>(PYEP_PROBE)) +
               ((static_cast<u64>(kernel) * kProbeBlocks + blockIdx.x) * 32 + threadIdx.x / 32) * 8;
    const u64 end = globaltimer(), cycles = clock64() - r[4];
    out[0] = 1 + role, out[1] = static_cast<u64>(peer), out[2] = r[1], out[3] = r[2], out[4] = r[3], out[5] = end;
    out[6] = r[0], out[7] = cycles;
}
PYEP_DEVICE u64 probe_now() { return globaltimer(); }
PYEP_DEVICE void probe_token(i64 t, u64 since, u64 ready, u64 checked, u64 first) {
    if (threadIdx.x % 32 != 0 || t < 0 || t >= kProbeTokens) return;
    u64* out = reinterpret_cast<u64*>(static_cast<unsigned long long>(PYEP_PROBE)) +
               static_cast<u64>(kProbeKernels) * kProbeBlocks * 32 * 8 + t * 8;
    out[0] = since, out[1] = ready, out[2] = checked, out[3] = first, out[4] = globaltimer();
    out[5] = blockIdx.x * 32 + threadIdx.x / 32;
}
#else
PYEP_DEVICE void probe_entry() {}
PYEP_DEVICE void probe_start() {}
PYEP_DEVICE u64 probe_clock() { return 0; }
PYEP_DEVICE void probe_waited(u64) {}
PYEP_DEVICE void probe_rows(int) {}
PYEP_DEVICE void probe_end(int, int, int) {}
PYEP_DEVICE u64 probe_now() { return 0; }
PYEP_DEVICE void probe_token(i64, u64, u64, u64, u64) {}
#endif

// The call's barriers, at the start of a cached dispatch or a combine (in place of a kernel of
// their own, which cost a launch): block 0 passes barrier seq (every rank is in this call, so no
// peer still runs an earlier kernel that writes into our memory), zeroes this rank's counters and
// passes barrier seq + 1. Every other block waits, before it touches a ring or a counter of any
// rank, until every rank's signal here has reached seq + 1: each rank (this one through block 0)
// raises it only after it zeroed its own counters, so then every counter is zero and every peer
// is in this call. A waiting block waits only on block 0 of its kernel (the first the GPU starts)
// and on the peers' block 0, never on another waiting block, so the kernel makes progress even
// when not all its blocks are resident at once (ranks sharing a GPU); its wait is bounded and
// polls the abort word like every other. Every thread calls it after the __syncthreads of the
// kernel's start verdict; it returns false on every thread of the block after a failure.
PYEP_DEVICE bool call_barriers(const Ctx& ctx, i32 op, int tid) {
    const bool lead = tid < 32;  // warp 0 signals and waits for the block
    if (blockIdx.x != 0) return !__syncthreads_or(lead && !barrier_wait(ctx, op, ctx.seq + 1));
    if (__syncthreads_or(lead && !barrier(ctx, op, ctx.seq))) return false;
    u64* z = reinterpret_cast<u64*>(ctx.data[ctx.rank]);
    for (u64 i = tid; i < ctx.counter_bytes / 8; i += kThreads) z[i] = 0;
    __syncthreads();  // the zeroes before the signals of barrier seq + 1
    return !__syncthreads_or(lead && !barrier(ctx, op, ctx.seq + 1));
}

// The sending block's publisher: lane j serves the sending warp that posts at s_tail[j], sub-ring
// first + stride * (j % kGroupWarps) of channel c to the rank of group j / kGroupWarps
// (group_rank). Whenever some of them posted progress, one fence (cumulative: it covers the stores
// the warps released to it) and then their tail words, so the sending warps stream without ever
// waiting on a system-scope fence. Returns once every sending warp counted itself out of s_left
// (after its last post), or the buffer aborted.
template <int kGroups, int kGroupWarps, bool kSkipSelf>
PYEP_DEVICE void publish_tails(const Ctx& ctx, int c, const u64* s_tail, const i32* s_left, int lane, int first,
                               int stride) {
    static_assert(kGroups * kGroupWarps <= 32, "a publisher lane per sending warp");
    const int R = kRanks, g = lane / kGroupWarps, w = first + stride * (lane % kGroupWarps);
    const int d = group_rank(g, ctx.rank, kSkipSelf);
    const bool mine = lane < kGroups * kGroupWarps;
    u64* tail = mine ? tail_word(ctx, d, c * R + ctx.rank, w) : nullptr;
    u64 published = 0;
    for (;;) {
        // Lane 0 reads the count before the lanes read the words (at 0 they are final); the warp
        // decides as one.
        i32 left = lane == 0 ? ld_acquire_cta(s_left) : 0;
        if (lane == 0 && left != 0 && aborted(ctx) != 0) left = 0;
        left = __shfl_sync(0xffffffffu, left, 0);
        __syncwarp();
        const u64 v = mine ? ld_acquire_cta(s_tail + lane) : 0;
        const bool moved = v != published;
        if (__any_sync(0xffffffffu, moved)) {
            fence_acq_rel_sys();
            if (moved) st_relaxed_sys(tail, v);
            published = v;
        }
        if (left == 0) return;
        spin_pause();
    }
}

// Vectors in flight per lane when a warp copies a row (the host sets PYEP_COPY_UNROLL: goep/cuda/normal/shape.go).
#ifndef PYEP_COPY_UNROLL
#define PYEP_COPY_UNROLL 8
#endif
constexpr int kCopyUnroll = PYEP_COPY_UNROLL;

#endif  // PYEP_DISPATCH || PYEP_COMBINE

#if defined(PYEP_DISPATCH)

#include "intranode_dispatch.cuh"

#if !defined(PYEP_NOTIFY)

// A dispatch after its notify (which passed the call's barriers and reset the counters), or a
// cached dispatch, which passes them itself (p.barriers).
extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_dispatch(const DispatchParams p) {
    dispatch_block(p, static_cast<int>(blockIdx.x), true, [&](int tid) {
        if (__syncthreads_or(tid == 0 && !start_ok(p.ctx, kOpDispatch))) return false;
        return p.barriers == 0 || call_barriers(p.ctx, kOpDispatch, tid);
    });
}

#else  // PYEP_NOTIFY

// ---------------------------------------------------------------------------------------------
// The queued dispatch, in one launch (a launch less of host time than notify, then the data
// kernel): block 0 is notify (notify.cuh), blocks 1 .. 2C are pyep_dispatch's blocks 0 .. 2C - 1,
// into rows allocated before the counts are known (p.notify.capacity of them).
//
// Block 0 publishes notify's verdict at kCtlGo of this rank with a release, after every output the
// data blocks read (channel_prefix, rank_prefix) and after the second barrier, so after every
// rank's counters were reset: the call's seq to go, seq | kNoGo not to (some rank's rows do not
// fit, or some rank's arguments are invalid: every rank decides alike). A data block waits, like
// call_barriers' waiting blocks, until every rank has reached that barrier (a rank that never
// comes is named), then for the verdict, and acquires it before it reads those outputs. Both waits
// are bounded and poll the abort word. The data blocks wait only on block 0 (the first the GPU
// starts) and the peers' block 0, never on another data block, so the kernel gets through even
// when not all its blocks are resident at once.

enum : int { kCtlGo = 80 };  // u64, in this rank's control region: the last queued dispatch's verdict
constexpr u64 kNoGo = 1ull << 63;

typedef pyep_notify_dispatch_params NotifyDispatchParams;  // params.h

// Thread 0 of a data block waits for the verdict on the call: true to go.
PYEP_DEVICE bool await_verdict(const Ctx& ctx, int c) {
    const u64* word = ctl_word(ctx, ctx.rank, kCtlGo);
    u64 start = 0;
    for (;;) {
        const u64 v = ld_acquire_sys(word);
        if ((v & ~kNoGo) == ctx.seq) return v == ctx.seq;
        if (!keep_waiting(ctx, start, kOpDispatch, kWaitVerdict, c, ctx.rank, static_cast<i64>(ctx.seq),
                          static_cast<i64>(v & ~kNoGo), 0))
            return false;
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_notify_dispatch(const NotifyDispatchParams p) {
    if (blockIdx.x == 0) {
        const Ctx& ctx = p.notify.ctx;
        u64* word = ctl_word(ctx, ctx.rank, kCtlGo);
        bool published = false;  // thread 0's
        notify_block<kThreads>(p.notify, [&](bool go) {
            st_release_sys(word, go ? ctx.seq : ctx.seq | kNoGo);
            published = true;
        });
        // Stopped on a failure (the abort word is set): no-go, for a data block already past the
        // barrier.
        if (threadIdx.x == 0 && !published) st_release_sys(word, ctx.seq | kNoGo);
        return;
    }
    const int b = static_cast<int>(blockIdx.x) - 1;
    dispatch_block(p.dispatch, b, false, [&](int tid) {
        const Ctx& ctx = p.dispatch.ctx;
        bool ok = tid >= 32 || barrier_wait(ctx, kOpDispatch, ctx.seq + 1);
        if (ok && tid == 0) ok = await_verdict(ctx, b / 2);
        return !__syncthreads_or(!ok);
    });
}

#endif  // PYEP_NOTIFY

#endif  // PYEP_DISPATCH

#if defined(PYEP_COMBINE)

#include "intranode_combine.cuh"

extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_combine(const CombineParams p) {
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    const int c = static_cast<int>(blockIdx.x) / 2;
    const bool sender = blockIdx.x % 2 == 0;
    PYEP_SHARED(i32, s_flag, 2);  // [0]: the verdict of the start, [1]: sending warps not done
    PYEP_SHARED(i32, s_cur, kReducers);
    PYEP_SHARED(u64, s_tail, kRanks * kWarpsPerRank);
    i32 lo, hi;
    channel_range(p.num_tokens, p.ctx.num_channels, c, lo, hi);
    for (int i = tid; i < kReducers; i += kThreads) s_cur[i] = lo;
    for (int i = tid; i < kRanks * kWarpsPerRank; i += kThreads) s_tail[i] = 0;
    if (tid == 0) {
        s_flag[0] = start_ok(p.ctx, kOpCombine) ? 0 : 1;
        s_flag[1] = (kRanks - 1) * kWarpsPerRank;
    }
    probe_entry();
    __syncthreads();
    if (s_flag[0] != 0) return;
    if (!call_barriers(p.ctx, kOpCombine, tid)) return;
    probe_start();
    // The sending block: warp group g < R - 1 serves peer group_rank(g), the group after them
    // reduces.
    const int me = p.ctx.rank, g = warp / kWarpsPerRank, wg = warp % kWarpsPerRank;
    int role = kProbeIdle, peer = me;
    if (sender) {
        if (g < kRanks - 1) {
            peer = group_rank(g, me, true);
            combine_send(p, c, peer, wg, lane, s_tail + warp);
            if (lane == 0) red_add_release_cta(s_flag + 1, -1);
            role = kProbeSend;
        } else if (g == kRanks - 1) {
            combine_reduce(p, c, kReducers + wg, lane, Progress{nullptr, tail_word(p.ctx, me, c * kRanks + me, wg)});
            role = kProbeReduce;
        } else if (warp == kPublisher) {
            publish_tails<kRanks - 1, kWarpsPerRank, true>(p.ctx, c, s_tail, s_flag + 1, lane, 0, 1);
            role = kProbePublish;
        }
    } else if (warp == 0) {
        combine_coordinate(p, c, lane, s_cur);
        role = kProbeCoordinate;
    } else {
        combine_reduce(p, c, warp - 1, lane, Progress{s_cur + warp - 1, nullptr});
        role = kProbeReduce;
    }
    probe_end(kProbeCombine, role, peer);
}

#endif  // PYEP_COMBINE

}  // namespace pyep
