// intranode_dispatch.cuh: the normal-mode dispatch's send, receive and local steps and its data
// block (DeepEP's dispatch within a node). intranode.cu includes it inside namespace pyep, after
// the warp groups and helpers that dispatch and combine share, and defines the kernels
// (pyep_dispatch, pyep_notify_dispatch).
#pragma once

// ---------------------------------------------------------------------------------------------
// Dispatch: block 2c sends channel c's tokens to every peer, block 2c + 1 receives channel c
// from every peer. In both, warp group g serves rank g, warp wg of it sub-ring wg; the sending
// block's last warp publishes the tails. The tokens a rank routes to itself skip the rings: the
// warp groups of this rank in both blocks copy them from x straight into the received rows
// (dispatch_local), one copy instead of two.

// 1, the default: a rank's own tokens skip the rings (dispatch_local). PYEP_LOCAL_DIRECT=0 sends
// them through this rank's own rings like a peer's, for comparison. 4096 tokens, hidden 7168, 24
// SMs, µs through the rings -> without (bench/results/h200x2-2026-11-26-local):
//   2x H200: BF16 273 -> 253, FP8 199 -> 178, cached 251 -> 231 (half the rows are a rank's own);
//   4x H200: BF16 610 -> 615, FP8 313 -> 324, cached 602 -> 570 (a quarter; the fabric bounds
//   it). Only the sending block's group copying them: 631, 307, 591; only the receiving
//   block's: 620, 334, 580.
// The combine keeps a rank's own rows in its rings: with its reducers reading them from x
// instead, it fell from 421 to 368 GB/s at 2 ranks (its reducers bound it; a row its sender has
// just written to the ring is likely still in L2, x's comes from HBM).
#ifndef PYEP_LOCAL_DIRECT
#define PYEP_LOCAL_DIRECT 1
#endif
constexpr bool kLocalDirect = PYEP_LOCAL_DIRECT != 0;

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

// A row's scales: the first kScaleRegs words of each lane (word lane + 32u) are loaded before
// the row's copy, so that their latency hides behind it; words beyond them (more than 128 scales)
// after it. Loaded after the copy, a row of hidden 7168 waited two more round trips for its 56
// scales: 2x H200, FP8 dispatch 178 -> 160 µs (DeepEP's harness, column-major scales: 362 -> 429
// GB/s).
constexpr int kScaleWords = kScalesBytes / 4;
constexpr int kScaleRegs = kScaleWords == 0 ? 1 : ((kScaleWords + 31) / 32 < 4 ? (kScaleWords + 31) / 32 : 4);

template <typename Load>
PYEP_DEVICE void scales_before(float (&s)[kScaleRegs], int lane, Load load) {
#pragma unroll
    for (int u = 0; u < kScaleRegs; u++)
        if (lane + 32 * u < kScaleWords) s[u] = load(lane + 32 * u);
}

template <typename Load>
PYEP_DEVICE void scales_after(float* dst, const float (&s)[kScaleRegs], int lane, Load load) {
#pragma unroll
    for (int u = 0; u < kScaleRegs; u++)
        if (lane + 32 * u < kScaleWords) dst[lane + 32 * u] = s[u];
    for (int i = lane + 32 * kScaleRegs; i < kScaleWords; i += 32) dst[i] = load(i);
}

// Where a token of x goes: a slot of a rank's rings, or (a rank's own token) a received row.
// Null src or topk: not wanted (a cached dispatch's rows). expert_lo: the receiver's first expert.
struct TokenDst {
    u8* row;
    float* scales;
    i32* src;
    i64* topk;
    float* weights;
    i64 expert_lo;
};

// One warp copies token tok of x, with its scales, index and top-k (as the receiver's local
// experts: -1 and weight 0 for the others), to `to`.
PYEP_DEVICE void copy_token(const DispatchParams& p, i32 tok, const TokenDst& to, int lane) {
    // The small fields' loads go out before the row's copy, so that their latency hides behind it.
    const i64* topk = reinterpret_cast<const i64*>(p.topk) + static_cast<i64>(tok) * kTopk;
    const float* w = reinterpret_cast<const float*>(p.weights) + static_cast<i64>(tok) * kTopk;
    const bool with_topk = kTopk > 0 && to.topk != nullptr;
    i64 e0 = -1;
    float w0 = 0.0f;
    if (with_topk && lane < kTopk) e0 = ld_nc(topk + lane), w0 = ld_nc(w + lane);
    const float* sc = reinterpret_cast<const float*>(p.x_scales) + static_cast<i64>(tok) * p.scale_token_stride;
    auto scale = [&](int i) { return ld_nc(sc + static_cast<i64>(i) * p.scale_stride); };
    float s[kScaleRegs];
    if (kScalesBytes > 0) scales_before(s, lane, scale);
    warp_copy<V, kCopyUnroll, false>(reinterpret_cast<V*>(to.row),
                                     reinterpret_cast<const V*>(p.x + static_cast<u64>(tok) * kHiddenBytes),
                                     kHiddenBytes / kVec, lane);
    if (kScalesBytes > 0) scales_after(to.scales, s, lane, scale);
    if (lane == 0 && to.src != nullptr) *to.src = tok;
    if (with_topk) {
        const i64 epr = p.num_experts / kRanks;
        for (int k = lane; k < kTopk; k += 32) {
            const i64 e = (k == lane ? e0 : ld_nc(topk + k)) - to.expert_lo;
            const bool mine = e >= 0 && e < epr;
            to.topk[k] = mine ? e : -1;
            to.weights[k] = mine ? (k == lane ? w0 : ld_nc(w + k)) : 0.0f;
        }
    }
}

// One warp copies token tok of x into slot gs (ring * slots + slot) of rank d's rings.
PYEP_DEVICE void push_token(const DispatchParams& p, int d, i64 gs, i32 tok, int lane) {
    u8* base = reinterpret_cast<u8*>(p.ctx.data[d]);
    copy_token(p, tok,
               TokenDst{base + p.off_hidden + gs * kHiddenBytes, reinterpret_cast<float*>(base + p.off_scales + gs * kScalesBytes),
                        reinterpret_cast<i32*>(base + p.off_src) + gs, reinterpret_cast<i64*>(base + p.off_topk) + gs * kTopk,
                        reinterpret_cast<float*>(base + p.off_weights) + gs * kTopk, static_cast<i64>(d) * (p.num_experts / kRanks)},
               lane);
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
    // Every dispatch has the channel_prefix_matrix (notify's, or the handle's).
    const i32* cp = reinterpret_cast<const i32*>(p.channel_prefix);
    const i32 count = cp[d * C + c] - (c > 0 ? cp[d * C + c - 1] : 0);
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
        const float* sc = reinterpret_cast<const float*>(buf + p.off_scales + gs * kScalesBytes);
        auto scale = [&](int i) { return ld_ring(sc + i); };
        float sv[kScaleRegs];
        if (kScalesBytes > 0) scales_before(sv, lane, scale);
        warp_copy<V, kCopyUnroll, true>(reinterpret_cast<V*>(p.recv_x + row * kHiddenBytes),
                                        reinterpret_cast<const V*>(buf + p.off_hidden + gs * kHiddenBytes),
                                        kHiddenBytes / kVec, lane);
        if (kScalesBytes > 0) scales_after(reinterpret_cast<float*>(p.recv_scales + row * kScalesBytes), sv, lane, scale);
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

// A token of this rank for this rank: one warp copies token tok of x straight into received row
// row (no ring: the rows a rank routes to itself cost one copy, not two).
PYEP_DEVICE void copy_local_token(const DispatchParams& p, i64 row, i32 tok, int lane) {
    copy_token(p, tok,
               TokenDst{reinterpret_cast<u8*>(p.recv_x + row * kHiddenBytes), reinterpret_cast<float*>(p.recv_scales + row * kScalesBytes),
                        p.recv_src != 0 ? reinterpret_cast<i32*>(p.recv_src) + row : nullptr,
                        p.recv_topk != 0 ? reinterpret_cast<i64*>(p.recv_topk) + row * kTopk : nullptr,
                        reinterpret_cast<float*>(p.recv_weights) + row * kTopk,
                        static_cast<i64>(p.ctx.rank) * (p.num_experts / kRanks)},
               lane);
}

// Channel c's tokens for this rank itself, copied by the warp groups of both its blocks (the
// sending block's is part 0, the receiving block's part 1): warp j = part * W + wg takes the
// ordinals j mod 2W, into rows after those of the lower ranks and of channels before c (which the
// channel_prefix_matrix gives; the receiver learns a peer's from its announcements). Warp 0 of
// part 0 writes send_head and checks is_token_in_rank against the count, as dispatch_send does
// for a peer; it also checks the rows, as dispatch_recv does.
PYEP_DEVICE void dispatch_local(const DispatchParams& p, int c, int part, int wg, int lane) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    constexpr int kParts = 2 * kWarpsPerRank;
    const int j = part * kWarpsPerRank + wg;
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    const i32* cp = reinterpret_cast<const i32*>(p.channel_prefix);
    const i32* rank_prefix = reinterpret_cast<const i32*>(p.rank_prefix);
    const i32 before = c > 0 ? cp[me * C + c - 1] : 0;
    const i32 count = cp[me * C + c] - before;
    const i64 first = (me > 0 ? rank_prefix[(me - 1) * R + me] : 0), base = first + before;
    const i64 total = rank_prefix[me * R + me] - first;  // rows from this rank, every channel
    const bool bad_rows = c == C - 1 && before + count != total;
    const bool overflow = base < 0 || count < 0 || base + count > p.num_out_rows;
    if (bad_rows || overflow) {
        if (j == 0 && lane == 0) {
            if (bad_rows) fail(ctx, kOpDispatch, kCodeMismatch, kBadRows, c, me, before + count, total, 0);
            else fail(ctx, kOpDispatch, kCodeMismatch, kRowsOverflow, c, me, base, base + count, p.num_out_rows);
        }
        return;
    }
    if (j == 0 && lane == 0 && p.recv_channel_prefix != 0)
        reinterpret_cast<i32*>(p.recv_channel_prefix)[me * C + c] = before;
    const u8* in_rank = reinterpret_cast<const u8*>(p.in_rank);
    i32* send_head = j == 0 ? reinterpret_cast<i32*>(p.send_head) : nullptr;
    i32 ord = 0;
    for (i32 t = lo; t < hi; t += 32) {
        const i32 tok = t + lane;
        const bool in = tok < hi && in_rank[static_cast<i64>(tok) * R + me] != 0;
        const u32 mask = __ballot_sync(0xffffffffu, in);
        if (send_head != nullptr && tok < hi)
            send_head[static_cast<i64>(tok) * R + me] = in ? ord + __popc(mask & lanemask_lt()) : -1;
        u32 m = mask;
        for (i32 o = ord; m != 0; o++) {
            const int b = __ffs(m) - 1;
            m &= m - 1;
            if (o % kParts == j && o < count) copy_local_token(p, base + o, t + b, lane);
        }
        ord += __popc(mask);
    }
    if (j == 0 && ord != count && lane == 0) fail(ctx, kOpDispatch, kCodeMismatch, kBadInRank, c, me, ord, count, 0);
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
    const bool local = kLocalDirect && g == p.ctx.rank;
    if (sender && g < kRanks) {
        if (local) dispatch_local(p, c, 0, wg, lane);
        else dispatch_send(p, c, g, wg, lane, s_tail + warp);
        if (lane == 0) red_add_release_cta(s_left, -1);
    } else if (sender && warp == kPublisher) {
        publish_tails(p.ctx, c, s_tail, s_left, lane);
    } else if (!sender && g < kRanks) {
        if (local) dispatch_local(p, c, 1, wg, lane);
        else dispatch_recv(p, c, g, wg, lane, s_avail);
    }
    if (!sender && pad && p.num_out_rows > 0) dispatch_pad(p, c * kWarps + warp, p.ctx.num_channels * kWarps, lane);
}
