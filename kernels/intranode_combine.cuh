// intranode_combine.cuh: the normal-mode combine's send, reduce and coordinate steps (DeepEP's
// combine within a node). intranode.cu includes it inside namespace pyep, after the warp groups and
// helpers that dispatch and combine share, and defines the kernel (pyep_combine).
#pragma once

// ---------------------------------------------------------------------------------------------
// Combine: block 2c returns the rows this rank received from its peers on channel c to them
// (warp group g serves the g-th peer, warp wg of it sub-ring wg, the last warp publishes the
// tails), and its group of the rank's own rows reduces tokens; block 2c + 1 reduces channel c's
// tokens too: warp 0 frees ring slots as the reducers of both blocks (every other warp, tokens
// round-robin) move past them. A token's own row is read where it is, in x: only the peers' rows
// cross a ring.

#ifndef PYEP_HIDDEN
#define PYEP_HIDDEN 256
#endif
#ifndef PYEP_DTYPE
#define PYEP_DTYPE 1
#endif
#ifndef PYEP_BIASES
#define PYEP_BIASES 3
#endif

constexpr int kHidden = PYEP_HIDDEN;
constexpr int kDType = PYEP_DTYPE;
constexpr int kElem = kDType == 3 ? 4 : 2;
constexpr int kRowBytes = kHidden * kElem;
constexpr int kPerVec = kVec / kElem;  // elements per vector
static_assert(kVec >= kElem && kRowBytes % kVec == 0, "rows are whole vectors of whole elements");
// The reducers: every warp of block 2c + 1 but the first (reducer r = warp - 1), then the
// sending block's group of the rank's own rows (reducer kReducers + wg): tokens round-robin.
constexpr int kReducers = kWarps - 1;
constexpr int kAllReducers = kReducers + kWarpsPerRank;
// The biases the call adds (bit 0: bias0, bit 1: bias1): a reducer without them neither loads
// them nor keeps registers for them.
constexpr int kBiases = PYEP_BIASES;
constexpr int kNumBiases = (kBiases & 1) + ((kBiases >> 1) & 1);

// Vectors a reducer lane loads before it sums them, per source (each bias the call adds and each
// rank's row): up to 4, 2 from 4 ranks, 1 from 8, and no more than half a lane's registers hold
// (65536 / kThreads of them, 4 a vector). With four an f32 row with both biases' registers at 1024
// threads spilled, and that kernel read through a null bias on an H200 (NVRTC 13.0; the emulator,
// and 768 threads, did not): PYEP_REDUCE_ROUNDS sets it, for tuning.
#ifdef PYEP_REDUCE_ROUNDS
constexpr int kReduceRounds = PYEP_REDUCE_ROUNDS;
#else
constexpr int kReduceRegs = (65536 / kThreads < 255 ? 65536 / kThreads : 255) / 2;
constexpr int kReduceFit = kReduceRegs / 4 / (kRanks + kNumBiases) > 1 ? kReduceRegs / 4 / (kRanks + kNumBiases) : 1;
constexpr int kReduceCap = kRanks >= 8 ? 1 : (kRanks >= 4 ? 2 : 4);
constexpr int kReduceRounds = kReduceFit < kReduceCap ? kReduceFit : kReduceCap;
#endif

typedef pyep_combine_params CombineParams;  // params.h

union VecElems {
    V v;
    u16 h[kVec / 2 > 0 ? kVec / 2 : 1];
    float f[kVec / 4 > 0 ? kVec / 4 : 1];
};

PYEP_DEVICE void add_vec(float* acc, V v) {
    VecElems e;
    e.v = v;
#pragma unroll
    for (int i = 0; i < kPerVec; i++) {
        if (kDType == 1) acc[i] += bf16_to_float(e.h[i]);
        else if (kDType == 2) acc[i] += half_to_float(e.h[i]);
        else acc[i] += e.f[i];
    }
}

PYEP_DEVICE V pack_vec(const float* acc) {
    VecElems e;
#pragma unroll
    for (int i = 0; i < kPerVec; i++) {
        if (kDType == 1) e.h[i] = float_to_bf16(acc[i]);
        else if (kDType == 2) e.h[i] = float_to_half(acc[i]);
        else e.f[i] = acc[i];
    }
    return e.v;
}

// Rows this rank received from d on channel c: [first, first + count) of x (the dispatch's
// receive order). False if the prefixes do not describe a dispatch (lane 0 of a warp that
// reports records why).
PYEP_DEVICE bool channel_rows(const CombineParams& p, int c, int d, bool report, int lane, i32& first, i32& count) {
    const int R = kRanks, me = p.ctx.rank, C = p.ctx.num_channels;
    const i32* rank_prefix = reinterpret_cast<const i32*>(p.rank_prefix);
    const i32* cp = reinterpret_cast<const i32*>(p.channel_prefix);
    const i32 base = d > 0 ? rank_prefix[(d - 1) * R + me] : 0;
    const i32 block = rank_prefix[d * R + me] - base;
    const i32 v = cp[d * C + c];
    const i32 end = c + 1 < C ? cp[d * C + c + 1] : block;
    first = base + v, count = end - v;
    const bool bad = base < 0 || v < 0 || v > end || end > block || (c == 0 && v != 0) || base + end > p.num_rows;
    if (bad && report && lane == 0) fail(p.ctx, kOpCombine, kCodeMismatch, kBadChannelPrefix, c, d, v, 0, block);
    return !bad;
}

// Sending warp wg of peer d on channel c: the rows this rank received from d on channel c with
// ordinal wg mod W, back into sub-ring wg of d's ring; it posts its tail word at *slot.
PYEP_DEVICE void combine_send(const CombineParams& p, int c, int d, int wg, int lane, u64* slot) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank;
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    i32 first, count;
    if (!channel_rows(p, c, d, wg == 0, lane, first, count)) return;
    if (wg >= sr.n) return;
    const int ring = c * R + me;
    const u32* head = head_word(ctx, me, c * R + d, 0);
    const u64 hdr = static_cast<u64>(count + 1) << 32;
    post(slot, hdr, lane);
    const i32 lap = sr.n * sr.slots;  // ring tokens between two uses of a slot
    const i64 sub = static_cast<i64>(ring) * ctx.ring_slots + static_cast<i64>(wg) * sr.slots;
    u8* dbuf = reinterpret_cast<u8*>(ctx.data[d]);
    i32 pushed = 0;
    u32 freed = 0;  // ring tokens d's reducers are done with, as last read
    for (i32 i = wg; i < count; i += sr.n) {
        // The slot last held ring token i - lap.
        if (i - lap >= static_cast<i32>(freed)) {
            const i32 want = i - lap;
            const u64 since = probe_clock();
            if (!warp_poll(ctx, head, freed, [&](u32 h) { return static_cast<i32>(h) > want; }, kOpCombine, kWaitHead, c,
                           d, freed, i, lap, lane))
                return;
            probe_waited(since);
        }
        const i64 row = first + i;
        const i64 gs = sub + pushed % sr.slots;
        warp_copy<V, kCopyUnroll, false>(reinterpret_cast<V*>(dbuf + p.off_row + gs * kRowBytes),
                                         reinterpret_cast<const V*>(p.x + row * kRowBytes), kRowBytes / kVec, lane);
        if (lane == 0)
            reinterpret_cast<i32*>(dbuf + p.off_src)[gs] = ld_nc(reinterpret_cast<const int*>(p.src_idx) + row);
        if (kTopk > 0 && p.weights != 0) {
            const float* w = reinterpret_cast<const float*>(p.weights) + row * kTopk;
            float* dw = reinterpret_cast<float*>(dbuf + p.off_weights) + gs * kTopk;
            for (int k = lane; k < kTopk; k += 32) dw[k] = ld_nc(w + k);
        }
        pushed++;
        probe_rows(1);
        post(slot, hdr | static_cast<u64>(pushed), lane);
    }
}

// Where a reducer reports its progress: the token it works on (its tokens before it are
// reduced), then hi. Block 2c + 1's reducers in its shared memory; the sending block's in the
// tail words of this rank's own ring of channel c (no row crosses that ring; the call's barriers
// zeroed them), as token + 1, for the coordinator in the other block.
struct Progress {
    i32* shared;  // s_cur + r, or null
    u64* global;
};
PYEP_DEVICE void report(const Progress& cur, i32 t) {
    if (cur.shared != nullptr) st_release_cta(cur.shared, t);
    else st_release_gpu(cur.global, static_cast<u64>(t) + 1);
}

// Reducer r of channel c (of kAllReducers): tokens lo + r, lo + r + kAllReducers, ... Lane q < R
// finds rank q's row of the token: a peer's in its ring slot once the peer's tail has passed it,
// this rank's own in x.
PYEP_DEVICE void combine_reduce(const CombineParams& p, int c, int r, int lane, Progress cur) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    i32 own_first, own_count;
    if (!channel_rows(p, c, me, r == 0, lane, own_first, own_count)) return;
    const u8* buf = reinterpret_cast<const u8*>(ctx.data[me]);
    const i32* send_head = reinterpret_cast<const i32*>(p.send_head);
    const int ring = c * R + (lane < R ? lane : 0);
    const bool peer = lane < R && lane != me;
    // Lane q: tokens peer q has pushed on each sub-ring of our ring, as last read.
    i32 seen[kSubRings];
    for (int w = 0; w < kSubRings; w++) seen[w] = 0;
    for (i32 t = lo + r; t < hi; t += kAllReducers) {
        report(cur, t);
        const i32 sh = lane < R ? ld_nc(reinterpret_cast<const int*>(send_head) + static_cast<i64>(t) * R + lane) : -1;
        // A peer's ring token sh is token k of sub-ring w. The warp waits as one: lane q polls
        // peer q's tail word until it has arrived, and every lane goes round the loop until no
        // lane waits (no lane spins on its own).
        const int w = sh >= 0 ? sh % sr.n : 0;
        const i32 k = sh >= 0 ? sh / sr.n : 0;
        const u64* tail = tail_word(ctx, me, ring, w);
        bool ok = true;
        if (lane == me && sh >= own_count) {
            fail(ctx, kOpCombine, kCodeMismatch, kBadSendHead, c, lane, t, sh, own_count);
            ok = false;
        }
        u64 start = 0;
        const u64 since = probe_clock(), since_ns = probe_now();
        for (;;) {
            bool waiting = false;
            if (ok && peer && sh >= 0 && seen[w] <= k) {
                const u64 word = ld_acquire_sys(tail);
                seen[w] = static_cast<i32>(static_cast<u32>(word));
                const i64 announced = static_cast<i64>(word >> 32) - 1;
                if (announced >= 0 && sh >= announced) {
                    fail(ctx, kOpCombine, kCodeMismatch, kBadSendHead, c, lane, t, sh, announced);
                    ok = false;
                } else if (seen[w] <= k) {
                    ok = keep_waiting(ctx, start, kOpCombine, kWaitToken, c, lane, t, sh, w + static_cast<i64>(seen[w]) * sr.n);
                    waiting = ok;
                }
            }
            if (!__any_sync(0xffffffffu, waiting)) break;
        }
        probe_waited(since);
        const u64 ready_ns = probe_now();
        __syncwarp();  // orders each polling lane's acquire before the whole warp's reads
        // Lane q < R: rank q's row of token t and its weights (0: q did not get the token).
        i64 row_at = 0, weights_at = 0;
        if (ok && sh >= 0) {
            i32 got;
            if (lane == me) {
                const i64 row = own_first + sh;
                row_at = static_cast<i64>(p.x + static_cast<u64>(row) * kRowBytes);
                weights_at = p.weights != 0 ? static_cast<i64>(p.weights + static_cast<u64>(row) * kTopk * 4) : 0;
                got = ld_nc(reinterpret_cast<const int*>(p.src_idx) + row);
            } else {
                const i64 gs = static_cast<i64>(ring) * ctx.ring_slots + static_cast<i64>(w) * sr.slots + k % sr.slots;
                row_at = reinterpret_cast<i64>(buf + p.off_row + gs * kRowBytes);
                weights_at = reinterpret_cast<i64>(buf + p.off_weights + gs * kTopk * 4);
                got = ld_ring(reinterpret_cast<const int*>(buf + p.off_src) + gs);
            }
            if (got != t) {
                fail(ctx, kOpCombine, kCodeMismatch, kBadSrc, c, lane, got, t, 0);
                ok = false;
            }
        }
        if (!__all_sync(0xffffffffu, ok)) break;
        const u64 checked_ns = probe_now();
        u64 first_ns = 0;
        const V* rows[kRanks];
#pragma unroll
        for (int q = 0; q < kRanks; q++) rows[q] = reinterpret_cast<const V*>(__shfl_sync(0xffffffffu, row_at, q));
        const V* b0 = (kBiases & 1) && p.bias0 != 0 ? reinterpret_cast<const V*>(p.bias0 + static_cast<u64>(t) * kRowBytes) : nullptr;
        const V* b1 = (kBiases & 2) && p.bias1 != 0 ? reinterpret_cast<const V*>(p.bias1 + static_cast<u64>(t) * kRowBytes) : nullptr;
        V* out = reinterpret_cast<V*>(p.out + static_cast<u64>(t) * kRowBytes);
        // All loads of a round first (bias, then every rank's row), then the sums in the fixed
        // order: bias0, bias1, ranks ascending.
        constexpr int kNV = kRowBytes / kVec;
        constexpr int U = kReduceRounds;
        for (int i = lane; i < kNV; i += 32 * U) {
            V vb0[U], vb1[U], in[kRanks][U];
            if (b0 != nullptr) {
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i + 32 * u < kNV) vb0[u] = ld_nc(b0 + i + 32 * u);
            }
            if (b1 != nullptr) {
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i + 32 * u < kNV) vb1[u] = ld_nc(b1 + i + 32 * u);
            }
#pragma unroll
            for (int q = 0; q < kRanks; q++) {
                if (rows[q] == nullptr) continue;
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i + 32 * u < kNV) in[q][u] = ld_ring(rows[q] + i + 32 * u);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (i + 32 * u >= kNV) continue;
                float acc[kPerVec];
#pragma unroll
                for (int e = 0; e < kPerVec; e++) acc[e] = 0.0f;
                if (b0 != nullptr) add_vec(acc, vb0[u]);
                if (b1 != nullptr) add_vec(acc, vb1[u]);
#pragma unroll
                for (int q = 0; q < kRanks; q++)
                    if (rows[q] != nullptr) add_vec(acc, in[q][u]);
                st_na(out + i + 32 * u, pack_vec(acc));
            }
            if (first_ns == 0) first_ns = probe_now();
        }
        if (kTopk > 0 && p.out_weights != 0) {
            float* ow = reinterpret_cast<float*>(p.out_weights) + static_cast<i64>(t) * kTopk;
            const float* wq[kRanks];
#pragma unroll
            for (int q = 0; q < kRanks; q++) wq[q] = reinterpret_cast<const float*>(__shfl_sync(0xffffffffu, weights_at, q));
            for (int k = lane; k < kTopk; k += 32) {
                float w = 0.0f;
#pragma unroll
                for (int q = 0; q < kRanks; q++)
                    if (wq[q] != nullptr) w += ld_ring(wq[q] + k);
                ow[k] = w;
            }
        }
        probe_rows(1);
        probe_token(t, since_ns, ready_ns, checked_ns, first_ns);
        __syncwarp();
    }
    report(cur, hi);
}

// Warp 0 of a reducing block: frees ring slots behind the slowest reducer of both blocks (this
// block's at s_cur, the sending block's in their Progress words), then checks that every rank
// returned exactly the rows send_head asked for.
PYEP_DEVICE void combine_coordinate(const CombineParams& p, int c, int lane, const i32* s_cur) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    const i32* send_head = reinterpret_cast<const i32*>(p.send_head);
    const u64* helpers = tail_word(ctx, me, c * R + me, 0);
    u32* head = head_word(ctx, lane < R ? lane : 0, c * R + me, 0);
    i32 freed = 0;  // lane q < R: slots of rank q's ring freed so far (this rank's own: rows read)
    i32 done = lo;  // tokens below this are reduced
    for (;;) {
        i32 f = hi;
        for (int i = lane; i < kAllReducers; i += 32) {
            if (i < kReducers) {
                f = min(f, ld_acquire_cta(s_cur + i));
            } else {
                const u64 v = ld_acquire_gpu(helpers + (i - kReducers));
                f = min(f, v == 0 ? lo : static_cast<i32>(v - 1));
            }
        }
        f = warp_min(f);
        if (f > done) {
            i32 best[kRanks];
#pragma unroll
            for (int q = 0; q < kRanks; q++) best[q] = 0;
            for (i64 i = static_cast<i64>(done) * R + lane; i < static_cast<i64>(f) * R; i += 32) {
                const i32 v = ld_nc(reinterpret_cast<const int*>(send_head) + i);
                const int q = static_cast<int>(i % R);
#pragma unroll
                for (int qq = 0; qq < kRanks; qq++)
                    if (qq == q) best[qq] = max(best[qq], v + 1);
            }
#pragma unroll
            for (int q = 0; q < kRanks; q++) {
                const i32 m = warp_max(best[q]);
                if (lane == q && m > freed) {
                    freed = m;
                    if (q != me) st_release_sys(head, static_cast<u32>(freed));
                }
            }
            done = f;
        }
        if (f >= hi) break;
        if (aborted(ctx) != 0) return;
        nanosleep(32);
    }
    if (lane >= R) return;
    i32 announced;
    if (lane == me) {
        i32 first;
        if (!channel_rows(p, c, me, false, lane, first, announced)) return;  // the reducers said why
    } else {
        const u64* tail = tail_word(ctx, me, c * R + lane, 0);
        u64 start = 0, w;
        for (;;) {
            w = ld_acquire_sys(tail);
            if ((w >> 32) != 0) break;
            if (!keep_waiting(ctx, start, kOpCombine, kWaitAnnounce, c, lane, c, 0, 0)) return;
        }
        announced = static_cast<i32>(w >> 32) - 1;
    }
    if (announced != freed) fail(ctx, kOpCombine, kCodeMismatch, kBadReturnCount, c, lane, announced, freed, 0);
}
