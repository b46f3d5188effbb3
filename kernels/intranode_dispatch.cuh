// intranode_dispatch.cuh: the normal-mode dispatch's send, receive and local steps and its data
// block (DeepEP's dispatch within a node). intranode.cu includes it inside namespace pyep, after
// the warp groups and helpers that dispatch and combine share, and defines the kernels
// (pyep_dispatch, pyep_notify_dispatch).
#pragma once

// ---------------------------------------------------------------------------------------------
// Dispatch: blocks 2c and 2c + 1 (its halves, q = 0 and 1) both send channel c's tokens to every
// peer and receive channel c from every peer: a ring's sub-rings are fed by the sending warps of
// both halves and drained by the receiving warps of both, one warp a sub-ring at each end, and
// each half's last warp publishes the tails of its sending warps. The tokens a rank routes to
// itself skip the rings: the own group of this rank in both halves copies them from x straight
// into the received rows (dispatch_local), one copy instead of two.

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

// The groups' sizes. A peer's row costs a sending warp a copy over NVLink and a receiving warp a
// copy out of the ring; an own row one copy, from x. With groups of one size the own groups were
// through their rows halfway through the call and then idle (2x H200, FP8, probe: own warps ended
// at 54-66 µs, the peers' at 124-133; bench/results/h200x2-2026-11-27-probe). Two layouts, chosen
// by the host per row (goep/cuda/normal/defines.go):
//   PYEP_SPLIT_SEND=0  block 2c sends and block 2c + 1 receives, as DeepEP's dispatch does; a
//                      peer's group has twice the own group's warps, (kWarps - 1) / (2P + 1)
//                      rounded for the own, P peers: every group is through its rows at about
//                      the same time. BF16 rows.
//   PYEP_SPLIT_SEND=1  both halves send and receive: each has, for every peer, a group of sending
//                      warps and one of receiving warps, and its own group, all of about one size,
//                      so every SM of the call writes over NVLink. FP8 rows (4% faster there, 2%
//                      slower for BF16; at 2 ranks both then cross NVLink at about 290 GB/s a
//                      direction, NCCL's all_to_all_single at 261).
// A block of fewer than 2P + 2 warps takes the first (the host gives a block a warp for each rank
// and one more at least; the emulator's blocks are small). PYEP_LOCAL_DIRECT=0 makes this rank's
// own tokens take its rings as a peer's do (no own group). A half's warps: the peers' sending
// groups (group g serves peer g, or g + 1 from this rank's own on), their receiving groups, the
// own group, then idle warps and the publisher.
#ifndef PYEP_SPLIT_SEND
#define PYEP_SPLIT_SEND 1
#endif
constexpr int kPeerGroups = kLocalDirect ? kRanks - 1 : kRanks;
constexpr int kFreeWarps = kWarps - 1;  // all but the publisher
constexpr bool kSplitSend = PYEP_SPLIT_SEND != 0 && kFreeWarps >= 2 * kPeerGroups + (kLocalDirect ? 1 : 0);
constexpr int kOwnWarps = !kLocalDirect ? 0
                          : kPeerGroups == 0 ? kFreeWarps
                          : kSplitSend ? kFreeWarps / (2 * kPeerGroups + 1)
                                       : (kFreeWarps + kPeerGroups) / (2 * kPeerGroups + 1);
constexpr int kPeerFit = kPeerGroups == 0 ? 1 : (kFreeWarps - kOwnWarps) / (kSplitSend ? 2 * kPeerGroups : kPeerGroups);
constexpr int kPeerWarps = kPeerGroups == 0 ? 1 : (kPeerFit < 32 / kPeerGroups ? kPeerFit : 32 / kPeerGroups);
static_assert(kPeerWarps >= 1 && (!kLocalDirect || kOwnWarps >= 1), "a warp for each group");
static_assert(kPeerGroups * kPeerWarps * (kSplitSend ? 2 : 1) + kOwnWarps <= kFreeWarps, "the groups fit the block");

// Sending and receiving warps a group of half q has (which sub-rings they take: sub_ring below).
PYEP_DEVICE constexpr int send_warps(int q) { return kSplitSend || q == 0 ? kPeerWarps : 0; }
PYEP_DEVICE constexpr int recv_warps(int q) { return kSplitSend || q == 1 ? kPeerWarps : 0; }
constexpr int kRingWarps = kSplitSend ? 2 * kPeerWarps : kPeerWarps;  // sending warps of a ring, both halves

// 1, the default: with both halves sending, they take alternate sub-rings. A ring's i-th token goes
// to sub-ring i mod W, so a count that W does not divide gives its first sub-rings one token more;
// dealt half 0's first, those all fell to half 0, whose SM then had more rows to write over NVLink
// than its pair (2x H200, 340 tokens a channel over 16 sub-rings: 172 rows against 168). Own rows
// alike (dispatch_local). PYEP_INTERLEAVE=0: half 0 takes the first sub-rings, for comparison.
#ifndef PYEP_INTERLEAVE
#define PYEP_INTERLEAVE 1
#endif
constexpr bool kInterleave = kSplitSend && PYEP_INTERLEAVE != 0;

// The sub-ring of warp i of a peer's sending (or receiving) group in half q.
PYEP_DEVICE constexpr int sub_ring(int q, int i) {
    return kInterleave ? 2 * i + q : q == 0 ? i : (kSplitSend ? kPeerWarps : 0) + i;
}

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

// The sending warp of sub-ring wg of peer d on channel c (in either half): the channel's tokens for
// d with ordinal wg mod W (W sub-rings), into sub-ring wg; it posts its tail word to its half's
// publisher at *slot. The warp of sub-ring 0 also writes send_head and checks the count against
// is_token_in_rank.
PYEP_DEVICE void dispatch_send(const DispatchParams& p, int c, int d, int wg, int lane, u64* slot) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const SubRings sr = sub_rings(ctx, kRingWarps);
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
                const u64 since = probe_clock();
                if (!warp_poll(ctx, head, freed, [&](u32 h) { return want - static_cast<i32>(h) < sr.slots; }, kOpDispatch,
                               kWaitHead, c, d, freed, pushed, sr.slots, lane))
                    return;
                probe_waited(since);
            }
            push_token(p, d, sub + pushed % sr.slots, t + b, lane);
            probe_rows(1);
            pushed++;
            post(slot, hdr | static_cast<u64>(pushed), lane);
        }
        ord += __popc(mask);
    }
    // is_token_in_rank must route exactly the channel_prefix_matrix's count here.
    if (wg == 0 && ord != count && lane == 0) fail(ctx, kOpDispatch, kCodeMismatch, kBadInRank, c, d, ord, count, 0);
}

// Receiving warp i of group g (peer s) of half q on channel c: sub-ring wg = sub_ring(q, i), into
// rows base + wg, base + wg + W, ... The half's first receiving warp of the group finds base; the
// half that drains sub-ring 0 also checks the counts.
PYEP_DEVICE void dispatch_recv(const DispatchParams& p, int c, int g, int s, int q, int i, int lane, i64* s_avail) {
    const int wg = sub_ring(q, i);
    const bool checks = q == (recv_warps(0) > 0 ? 0 : 1);
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const int ring = c * R + s;
    const i32* rank_prefix = reinterpret_cast<const i32*>(p.rank_prefix);
    // The leader warp collects s's announced counts of channels 0..c: our rows start after
    // those of channels before c.
    const u64 announced = probe_clock();
    if (i == 0) {
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
            if (ok && checks && c == C - 1 && base + mine != rank_prefix[s * R + me]) {
                fail(ctx, kOpDispatch, kCodeMismatch, kBadRows, c, s,
                     base + mine - (s > 0 ? rank_prefix[(s - 1) * R + me] : 0),
                     rank_prefix[s * R + me] - (s > 0 ? rank_prefix[(s - 1) * R + me] : 0), 0);
                flag = 1;
            }
            if (ok && checks && flag == 0 && (base < 0 || base + mine > p.num_out_rows)) {
                fail(ctx, kOpDispatch, kCodeMismatch, kRowsOverflow, c, s, base, base + mine, p.num_out_rows);
                flag = 1;
            }
            if (ok && !checks && (base < 0 || base + mine > p.num_out_rows)) flag = 1;  // the other half says why
            if (flag == 0 && checks && p.recv_channel_prefix != 0)
                reinterpret_cast<i32*>(p.recv_channel_prefix)[s * C + c] = static_cast<i32>(before);
            s_avail[2 * s] = flag ? -1 : base;
            s_avail[2 * s + 1] = mine;
        }
    }
    bar_sync(1 + g, recv_warps(q) * 32);
    probe_waited(announced);
    const i64 base = s_avail[2 * s];
    const i32 count = static_cast<i32>(s_avail[2 * s + 1]);
    const SubRings sr = sub_rings(ctx, kRingWarps);
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
            const u64 since = probe_clock();
            if (!warp_poll(ctx, tail, v, [&](u64 w) { return static_cast<i32>(static_cast<u32>(w)) > want; }, kOpDispatch,
                           kWaitTail, c, s, wg + static_cast<i64>(k) * sr.n, count, 0, lane))
                return;
            probe_waited(since);
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
        probe_rows(1);
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

// Channel c's tokens for this rank itself, copied by the own groups of both its blocks (the
// sending block's is part 0, the receiving block's part 1): warp j = 2 wg + part (part * W + wg
// without kInterleave) takes the ordinals j mod 2W, into rows after those of the lower ranks and
// of channels before c (which the channel_prefix_matrix gives; the receiver learns a peer's from
// its announcements). Warp 0 of
// part 0 writes send_head and checks is_token_in_rank against the count, as dispatch_send does
// for a peer; it also checks the rows, as dispatch_recv does.
PYEP_DEVICE void dispatch_local(const DispatchParams& p, int c, int part, int wg, int lane) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    constexpr int kParts = 2 * kOwnWarps;
    const int j = kInterleave ? 2 * wg + part : part * kOwnWarps + wg;
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
            if (o % kParts == j && o < count) copy_local_token(p, base + o, t + b, lane), probe_rows(1);
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
    PYEP_SHARED(i64, s_avail, 2 * kRanks);
    PYEP_SHARED(u64, s_tail, kPeerGroups > 0 ? kPeerGroups * kPeerWarps : 1);
    PYEP_SHARED(i32, s_left, 1);  // sending warps not done
    const int q = b % 2, sending = kPeerGroups * send_warps(q), receiving = kPeerGroups * recv_warps(q);
    for (int i = tid; i < sending; i += kThreads) s_tail[i] = 0;
    if (tid == 0) s_left[0] = sending;
    probe_entry();
    if (!start(tid)) return;
    probe_start();
    const int me = p.ctx.rank;
    int role = kProbeIdle, peer = me;
    if (warp < sending) {  // sending group g
        const int g = warp / send_warps(q), i = warp % send_warps(q);
        peer = group_rank(g, me, kLocalDirect);
        dispatch_send(p, c, peer, sub_ring(q, i), lane, s_tail + warp);
        if (lane == 0) red_add_release_cta(s_left, -1);
        role = kProbeSend;
    } else if (warp < sending + receiving) {  // receiving group g
        const int g = (warp - sending) / recv_warps(q), i = (warp - sending) % recv_warps(q);
        peer = group_rank(g, me, kLocalDirect);
        dispatch_recv(p, c, g, peer, q, i, lane, s_avail);
        role = kProbeRecv;
    } else if (warp < sending + receiving + kOwnWarps) {
        dispatch_local(p, c, q, warp - sending - receiving, lane);
        role = q == 0 ? kProbeLocalSend : kProbeLocalRecv;
    } else if (warp == kPublisher && sending > 0) {
        publish_tails<kPeerGroups, kPeerWarps, kLocalDirect>(p.ctx, c, s_tail, s_left, lane, sub_ring(q, 0),
                                                            sub_ring(q, 1) - sub_ring(q, 0));
        role = kProbePublish;
    }
    if (q == 1 && pad && p.num_out_rows > 0) dispatch_pad(p, c * kWarps + warp, p.ctx.num_channels * kWarps, lane);
    probe_end(kProbeDispatch, role, peer);
}
