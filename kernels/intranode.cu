// intranode.cu: normal-mode dispatch and combine within one NVLink domain.
//
// One source, four kernels, chosen by defines (the host compiles each with the constants it is
// specialised on):
//   PYEP_NOTIFY    pyep_notify (the count exchange of a dispatch, notify.cuh); constants:
//                  PYEP_RANKS.
//   PYEP_DISPATCH  pyep_dispatch; constants: PYEP_RANKS, PYEP_HIDDEN_BYTES, PYEP_SCALES_BYTES,
//                  PYEP_TOPK, PYEP_VEC.
//   both           pyep_notify_dispatch, the queued dispatch in one launch: notify in block 0,
//                  pyep_dispatch's blocks after it; the dispatch's constants.
//   PYEP_COMBINE   pyep_combine; constants: PYEP_RANKS, PYEP_HIDDEN, PYEP_DTYPE (1 bf16,
//                  2 fp16, 3 fp32), PYEP_TOPK, PYEP_VEC.
//
// pyep:defines PYEP_NOTIFY PYEP_RANKS=2
// pyep:defines PYEP_NOTIFY PYEP_RANKS=8
// pyep:defines PYEP_DISPATCH PYEP_RANKS=4 PYEP_HIDDEN_BYTES=14336 PYEP_SCALES_BYTES=0 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=8 PYEP_HIDDEN_BYTES=7168 PYEP_SCALES_BYTES=224 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=3 PYEP_HIDDEN_BYTES=5760 PYEP_SCALES_BYTES=0 PYEP_TOPK=0 PYEP_VEC=16
// pyep:defines PYEP_DISPATCH PYEP_RANKS=2 PYEP_HIDDEN_BYTES=198 PYEP_SCALES_BYTES=4 PYEP_TOPK=9 PYEP_VEC=2
// pyep:defines PYEP_NOTIFY PYEP_DISPATCH PYEP_RANKS=8 PYEP_HIDDEN_BYTES=7168 PYEP_SCALES_BYTES=224 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_NOTIFY PYEP_DISPATCH PYEP_RANKS=2 PYEP_HIDDEN_BYTES=198 PYEP_SCALES_BYTES=4 PYEP_TOPK=9 PYEP_VEC=2
// pyep:defines PYEP_COMBINE PYEP_RANKS=4 PYEP_HIDDEN=7168 PYEP_DTYPE=1 PYEP_TOPK=8 PYEP_VEC=16
// pyep:defines PYEP_COMBINE PYEP_RANKS=8 PYEP_HIDDEN=2880 PYEP_DTYPE=2 PYEP_TOPK=0 PYEP_VEC=16
// pyep:defines PYEP_COMBINE PYEP_RANKS=1 PYEP_HIDDEN=100 PYEP_DTYPE=3 PYEP_TOPK=33 PYEP_VEC=16
// pyep:defines PYEP_COMBINE PYEP_RANKS=5 PYEP_HIDDEN=99 PYEP_DTYPE=1 PYEP_TOPK=1 PYEP_VEC=2
// pyep:defines PYEP_COMBINE PYEP_RANKS=4 PYEP_HIDDEN=2880 PYEP_DTYPE=1 PYEP_TOPK=8 PYEP_VEC=16
//
// # Memory
//
// Every rank's data region (num_nvl_bytes) holds, for one call:
//
//   [tails: u64 [C*R][kSubRings]][heads: u32 [C*R][kSubRings]][ring slot fields ...] ... [notify scratch]
//
// Ring (c, s -> r), for channel c from sender s to receiver r, lives in r's region: its slots
// (one array per field, all rings' slots of a field in one array). A ring is split into W
// sub-rings of S = ring_slots / W slots (sub_rings below): the ring's i-th token goes to
// sub-ring i % W, slot (i / W) % S, so that sending warp w and receiving warp w of a pair of
// blocks stream sub-ring w on their own, with no barrier between the warps of a block. The tail
// words tails[c*R + s][w] there are written by s: (count + 1) << 32 | tokens of sub-ring w
// pushed so far, count being what s will push on the whole ring in this call (0: not announced
// yet). The head words, in the sender's region (heads[c*R + r][w] of s, written by r), count
// what r has consumed: per sub-ring in dispatch; in combine, word 0 counts the ring's tokens
// freed (the reducers take tokens in token order, not by sub-ring). So both sides poll their own
// memory and only write across NVLink.
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
// Shared by dispatch and combine: the warp groups of a block. Warps [g*WPR, (g+1)*WPR) serve
// peer g; a group synchronises on named barrier 1 + g.

// A sending block's warps: kWarpsPerRank for each peer (warp group g serves peer g), then the
// publisher (the last warp). A receiving block groups its warps alike.
constexpr int kWarpsPerRank = (kWarps - 1) / kRanks;
constexpr int kPublisher = kWarps - 1;
static_assert(kRanks * kWarpsPerRank <= 32, "a publisher lane per sending warp");

PYEP_DEVICE void group_sync(int g) { bar_sync(1 + g, kWarpsPerRank * 32); }

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

// The sending block's publisher: lane j serves sending warp j (peer j / kWarpsPerRank, sub-ring
// j % kWarpsPerRank) of channel c. Whenever some of them posted progress, one fence (cumulative:
// it covers the stores the warps released to it) and then their tail words, so the sending warps
// stream without ever waiting on a system-scope fence. Returns once every sending warp counted
// itself out of s_left (after its last post), or the buffer aborted.
PYEP_DEVICE void publish_tails(const Ctx& ctx, int c, const u64* s_tail, const i32* s_left, int lane) {
    const int R = kRanks, d = lane / kWarpsPerRank, w = lane % kWarpsPerRank;
    const bool mine = lane < R * kWarpsPerRank;
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

// Vectors in flight per lane when a warp copies a row (PYEP_COPY_UNROLL overrides, for tuning).
#ifndef PYEP_COPY_UNROLL
#define PYEP_COPY_UNROLL 8
#endif
constexpr int kCopyUnroll = PYEP_COPY_UNROLL;

#endif  // PYEP_DISPATCH || PYEP_COMBINE

#if defined(PYEP_DISPATCH)

// ---------------------------------------------------------------------------------------------
// Dispatch: block 2c sends channel c's tokens to every rank, block 2c + 1 receives channel c
// from every rank. In both, warp group g serves rank g, warp wg of it sub-ring wg; the sending
// block's last warp publishes the tails.

#ifndef PYEP_HIDDEN_BYTES
#define PYEP_HIDDEN_BYTES 512
#endif
#ifndef PYEP_SCALES_BYTES
#define PYEP_SCALES_BYTES 0
#endif

constexpr int kHiddenBytes = PYEP_HIDDEN_BYTES;
constexpr int kScalesBytes = PYEP_SCALES_BYTES;
static_assert(kHiddenBytes % kVec == 0 && kScalesBytes % 4 == 0, "rows are whole vectors");

typedef pyep_dispatch_params DispatchParams;  // params.h

// One warp copies token tok of x into slot gs (ring * slots + slot) of rank d's rings.
PYEP_DEVICE void push_token(const DispatchParams& p, int d, i64 gs, i32 tok, int lane) {
    u8* base = reinterpret_cast<u8*>(p.ctx.data[d]);
    // The top-k loads go out before the row's copy, so that their latency hides behind it.
    const i64* topk = reinterpret_cast<const i64*>(p.topk) + static_cast<i64>(tok) * kTopk;
    const float* w = reinterpret_cast<const float*>(p.weights) + static_cast<i64>(tok) * kTopk;
    i64 e0 = -1;
    float w0 = 0.0f;
    if (kTopk > 0 && lane < kTopk) e0 = ld_nc(topk + lane), w0 = ld_nc(w + lane);
    warp_copy<V, kCopyUnroll, false>(reinterpret_cast<V*>(base + p.off_hidden + gs * kHiddenBytes),
                           reinterpret_cast<const V*>(p.x + static_cast<u64>(tok) * kHiddenBytes), kHiddenBytes / kVec,
                           lane);
    if (kScalesBytes > 0) {
        float* dst = reinterpret_cast<float*>(base + p.off_scales + gs * kScalesBytes);
        const float* src = reinterpret_cast<const float*>(p.x_scales) + static_cast<i64>(tok) * p.scale_token_stride;
        for (int i = lane; i < kScalesBytes / 4; i += 32) dst[i] = ld_nc(src + static_cast<i64>(i) * p.scale_stride);
    }
    if (lane == 0) reinterpret_cast<i32*>(base + p.off_src)[gs] = tok;
    if (kTopk > 0) {
        const i64 epr = p.num_experts / kRanks, lo = static_cast<i64>(d) * epr;
        i64* dst_idx = reinterpret_cast<i64*>(base + p.off_topk) + gs * kTopk;
        float* dst_w = reinterpret_cast<float*>(base + p.off_weights) + gs * kTopk;
        for (int k = lane; k < kTopk; k += 32) {
            const i64 e = (k == lane ? e0 : ld_nc(topk + k)) - lo;
            const bool mine = e >= 0 && e < epr;
            dst_idx[k] = mine ? e : -1;
            dst_w[k] = mine ? (k == lane ? w0 : ld_nc(w + k)) : 0.0f;
        }
    }
}

// Sending warp wg of peer d on channel c: the channel's tokens for d with ordinal wg mod W, into
// sub-ring wg; it posts its tail word to the publisher at *slot. Warp 0 also writes send_head and
// checks the count against is_token_in_rank.
PYEP_DEVICE void dispatch_send(const DispatchParams& p, int c, int d, int wg, int lane, u64* slot) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    if (wg >= sr.n) return;
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    const u8* in_rank = reinterpret_cast<const u8*>(p.in_rank);
    i32 count;
    if (p.channel_prefix != 0) {
        const i32* cp = reinterpret_cast<const i32*>(p.channel_prefix);
        count = cp[d * C + c] - (c > 0 ? cp[d * C + c - 1] : 0);
    } else {
        i32 n = 0;
        for (i32 t = lo + lane; t < hi; t += 32) n += in_rank[static_cast<i64>(t) * R + d] != 0 ? 1 : 0;
        count = warp_sum(n);
    }
    const int ring = c * R + me;
    const u32* head = head_word(ctx, me, c * R + d, wg);
    const u64 hdr = static_cast<u64>(count + 1) << 32;
    post(slot, hdr, lane);
    const i64 sub = static_cast<i64>(ring) * ctx.ring_slots + static_cast<i64>(wg) * sr.slots;
    i32* send_head = reinterpret_cast<i32*>(p.send_head);
    i32 ord = 0, pushed = 0;
    u32 freed = 0;  // tokens of the sub-ring the receiver consumed, as last read
    for (i32 t = lo; t < hi; t += 32) {
        const i32 tok = t + lane;
        const bool in = tok < hi && in_rank[static_cast<i64>(tok) * R + d] != 0;
        const u32 mask = __ballot_sync(0xffffffffu, in);
        if (send_head != nullptr && wg == 0 && tok < hi)
            send_head[static_cast<i64>(tok) * R + d] = in ? ord + __popc(mask & lanemask_lt()) : -1;
        u32 m = mask;
        for (i32 o = ord; m != 0; o++) {
            const int b = __ffs(m) - 1;
            m &= m - 1;
            if (o % sr.n != wg || o >= count) continue;
            if (pushed - static_cast<i32>(freed) >= sr.slots) {
                const i32 want = pushed;
                if (!warp_poll(ctx, head, freed, [&](u32 h) { return want - static_cast<i32>(h) < sr.slots; }, kOpDispatch,
                               kWaitHead, c, d, freed, pushed, sr.slots, lane))
                    return;
            }
            push_token(p, d, sub + pushed % sr.slots, t + b, lane);
            pushed++;
            post(slot, hdr | static_cast<u64>(pushed), lane);
        }
        ord += __popc(mask);
    }
    // is_token_in_rank must route exactly the channel_prefix_matrix's count here.
    if (wg == 0 && ord != count && lane == 0) fail(ctx, kOpDispatch, kCodeMismatch, kBadInRank, c, d, ord, count, 0);
}

// Receiving warp wg of peer s on channel c: sub-ring wg, into rows base + wg, base + wg + W, ...
PYEP_DEVICE void dispatch_recv(const DispatchParams& p, int c, int s, int wg, int lane, i64* s_avail) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const int ring = c * R + s;
    const i32* rank_prefix = reinterpret_cast<const i32*>(p.rank_prefix);
    // The leader warp collects s's announced counts of channels 0..c: our rows start after
    // those of channels before c.
    if (wg == 0) {
        i64 before = 0, mine = 0;
        bool ok = true;
        for (int cc = lane; cc <= c && ok; cc += 32) {
            const u64* w = tail_word(ctx, me, cc * R + s, 0);
            u64 start = 0, v;
            for (;;) {
                v = ld_acquire_sys(w);
                if ((v >> 32) != 0) break;
                if (!keep_waiting(ctx, start, kOpDispatch, kWaitAnnounce, c, s, cc, 0, 0)) {
                    ok = false;
                    break;
                }
            }
            if (ok) {
                const i64 n = static_cast<i64>(v >> 32) - 1;
                if (cc < c) before += n;
                else mine = n;
            }
        }
        ok = __all_sync(0xffffffffu, ok);
        before = warp_sum(before);
        mine = warp_sum(mine);
        if (lane == 0) {
            i64 flag = ok ? 0 : 1;
            const i64 base = (s > 0 ? rank_prefix[(s - 1) * R + me] : 0) + before;
            if (ok && c == C - 1 && base + mine != rank_prefix[s * R + me]) {
                fail(ctx, kOpDispatch, kCodeMismatch, kBadRows, c, s,
                     base + mine - (s > 0 ? rank_prefix[(s - 1) * R + me] : 0),
                     rank_prefix[s * R + me] - (s > 0 ? rank_prefix[(s - 1) * R + me] : 0), 0);
                flag = 1;
            }
            if (ok && flag == 0 && (base < 0 || base + mine > p.num_out_rows)) {
                fail(ctx, kOpDispatch, kCodeMismatch, kRowsOverflow, c, s, base, base + mine, p.num_out_rows);
                flag = 1;
            }
            if (flag == 0 && p.recv_channel_prefix != 0)
                reinterpret_cast<i32*>(p.recv_channel_prefix)[s * C + c] = static_cast<i32>(before);
            s_avail[2 * s] = flag ? -1 : base;
            s_avail[2 * s + 1] = mine;
        }
    }
    group_sync(s);
    const i64 base = s_avail[2 * s];
    const i32 count = static_cast<i32>(s_avail[2 * s + 1]);
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    if (base < 0 || wg >= sr.n) return;

    const u8* buf = reinterpret_cast<const u8*>(ctx.data[me]);
    const u64* tail = tail_word(ctx, me, ring, wg);
    u32* head = head_word(ctx, s, c * R + me, wg);
    const i64 sub = static_cast<i64>(ring) * ctx.ring_slots + static_cast<i64>(wg) * sr.slots;
    // Our tokens; the head goes out every half sub-ring (the sender waits only on a full one),
    // and before every wait, so that a sender waiting for room always learns of it.
    const i32 mine = count > wg ? (count - wg + sr.n - 1) / sr.n : 0;
    const i32 free_every = max(1, sr.slots / 2);
    i32 avail = 0, freed = 0;
    for (i32 k = 0; k < mine; k++) {
        if (k >= avail) {
            if (k > freed) {
                warp_publish(head, static_cast<u32>(k), lane);
                freed = k;
            }
            u64 v;
            const i32 want = k;
            if (!warp_poll(ctx, tail, v, [&](u64 w) { return static_cast<i32>(static_cast<u32>(w)) > want; }, kOpDispatch,
                           kWaitTail, c, s, wg + static_cast<i64>(k) * sr.n, count, 0, lane))
                return;
            avail = min(static_cast<i32>(static_cast<u32>(v)), mine);
        }
        const i64 gs = sub + k % sr.slots;
        const i64 row = base + wg + static_cast<i64>(k) * sr.n;
        // The small fields' loads go out before the row's copy (their latency hides behind it).
        const i64* si = reinterpret_cast<const i64*>(buf + p.off_topk) + gs * kTopk;
        const float* sw = reinterpret_cast<const float*>(buf + p.off_weights) + gs * kTopk;
        i64 e0 = -1;
        float w0 = 0.0f;
        if (kTopk > 0 && p.recv_topk != 0 && lane < kTopk) e0 = ld_ring(si + lane), w0 = ld_ring(sw + lane);
        const i32 src0 = lane == 0 && p.recv_src != 0 ? ld_ring(reinterpret_cast<const int*>(buf + p.off_src) + gs) : 0;
        warp_copy<V, kCopyUnroll, true>(reinterpret_cast<V*>(p.recv_x + row * kHiddenBytes),
                                        reinterpret_cast<const V*>(buf + p.off_hidden + gs * kHiddenBytes),
                                        kHiddenBytes / kVec, lane);
        if (kScalesBytes > 0) {
            const float* src = reinterpret_cast<const float*>(buf + p.off_scales + gs * kScalesBytes);
            float* dst = reinterpret_cast<float*>(p.recv_scales + row * kScalesBytes);
            for (int q = lane; q < kScalesBytes / 4; q += 32) dst[q] = ld_ring(src + q);
        }
        if (lane == 0 && p.recv_src != 0) reinterpret_cast<i32*>(p.recv_src)[row] = src0;
        if (kTopk > 0 && p.recv_topk != 0) {
            i64* di = reinterpret_cast<i64*>(p.recv_topk) + row * kTopk;
            float* dw = reinterpret_cast<float*>(p.recv_weights) + row * kTopk;
            for (int q = lane; q < kTopk; q += 32) {
                di[q] = q == lane ? e0 : ld_ring(si + q);
                dw[q] = q == lane ? w0 : ld_ring(sw + q);
            }
        }
        if (k + 1 - freed >= free_every) {
            warp_publish(head, static_cast<u32>(k + 1), lane);
            freed = k + 1;
        }
    }
    if (mine > freed) warp_publish(head, static_cast<u32>(mine), lane);
}

// Padding rows [num_recv, num_out_rows) of a num_worst_tokens dispatch, spread over the
// warps of the receiving blocks.
PYEP_DEVICE void dispatch_pad(const DispatchParams& p, int gw, int nw, int lane) {
    const i32 num_recv = reinterpret_cast<const i32*>(p.rank_prefix)[(kRanks - 1) * kRanks + p.ctx.rank];
    for (i64 row = num_recv + gw; row < p.num_out_rows; row += nw) {
        V* dst = reinterpret_cast<V*>(p.recv_x + row * kHiddenBytes);
        for (int i = lane; i < kHiddenBytes / kVec; i += 32) st_na(dst + i, vec_zero<V>());
        if (kScalesBytes > 0)
            for (int k = lane; k < kScalesBytes / 4; k += 32)
                reinterpret_cast<float*>(p.recv_scales + row * kScalesBytes)[k] = 0.0f;
        if (lane == 0 && p.recv_src != 0) reinterpret_cast<i32*>(p.recv_src)[row] = -1;
        if (kTopk > 0 && p.recv_topk != 0)
            for (int k = lane; k < kTopk; k += 32) {
                reinterpret_cast<i64*>(p.recv_topk)[row * kTopk + k] = -1;
                reinterpret_cast<float*>(p.recv_weights)[row * kTopk + k] = 0.0f;
            }
    }
}

// Data block b of a dispatch (channel b / 2, sending when b is even), once start(tid), which every
// thread calls after the block's shared memory is set, lets it touch the rings (false, on every
// thread: the block returns). Only num_worst_tokens pads (pad): a queued dispatch's spare rows
// are not returned.
template <typename Start>
PYEP_DEVICE void dispatch_block(const DispatchParams& p, int b, bool pad, Start start) {
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    const int c = b / 2;
    const bool sender = b % 2 == 0;
    PYEP_SHARED(i64, s_avail, 2 * kRanks);
    PYEP_SHARED(u64, s_tail, kRanks * kWarpsPerRank);
    PYEP_SHARED(i32, s_left, 1);  // sending warps not done
    for (int i = tid; i < kRanks * kWarpsPerRank; i += kThreads) s_tail[i] = 0;
    if (tid == 0) s_left[0] = kRanks * kWarpsPerRank;
    if (!start(tid)) return;
    const int g = warp / kWarpsPerRank, wg = warp % kWarpsPerRank;
    if (sender && g < kRanks) {
        dispatch_send(p, c, g, wg, lane, s_tail + warp);
        if (lane == 0) red_add_release_cta(s_left, -1);
    } else if (sender && warp == kPublisher) {
        publish_tails(p.ctx, c, s_tail, s_left, lane);
    } else if (!sender && g < kRanks) {
        dispatch_recv(p, c, g, wg, lane, s_avail);
    }
    if (!sender && pad && p.num_out_rows > 0) dispatch_pad(p, c * kWarps + warp, p.ctx.num_channels * kWarps, lane);
}

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
        s_flag[1] = kRanks * kWarpsPerRank;
    }
    __syncthreads();
    if (s_flag[0] != 0) return;
    if (!call_barriers(p.ctx, kOpCombine, tid)) return;
    if (sender) {
        const int g = warp / kWarpsPerRank, wg = warp % kWarpsPerRank;
        if (g < kRanks) {
            combine_send(p, c, g, wg, lane, s_tail + warp);
            if (lane == 0) red_add_release_cta(s_flag + 1, -1);
        } else if (warp == kPublisher) {
            publish_tails(p.ctx, c, s_tail, s_flag + 1, lane);
        }
    } else if (warp == 0) {
        combine_coordinate(p, c, lane, s_cur);
    } else {
        combine_reduce(p, c, warp - 1, lane, s_cur);
    }
}

#endif  // PYEP_COMBINE

}  // namespace pyep
