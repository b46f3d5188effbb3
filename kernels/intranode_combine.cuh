// intranode_combine.cuh: the normal-mode combine's send, reduce and coordinate steps (DeepEP's
// combine within a node). intranode.cu includes it inside namespace pyep, after the warp groups and
// helpers that dispatch and combine share, and defines the kernel (pyep_combine).
#pragma once

// ---------------------------------------------------------------------------------------------
// Combine: block 2c returns the rows this rank received on channel c to their ranks (warp
// group g serves rank g, warp wg of it sub-ring wg, the last warp publishes the tails); block
// 2c + 1 reduces channel c's tokens: warp 0 frees ring slots as the reducers (every other warp,
// tokens round-robin) move past them.

#ifndef PYEP_HIDDEN
#define PYEP_HIDDEN 256
#endif
#ifndef PYEP_DTYPE
#define PYEP_DTYPE 1
#endif

constexpr int kHidden = PYEP_HIDDEN;
constexpr int kDType = PYEP_DTYPE;
constexpr int kElem = kDType == 3 ? 4 : 2;
constexpr int kRowBytes = kHidden * kElem;
constexpr int kPerVec = kVec / kElem;  // elements per vector
static_assert(kVec >= kElem && kRowBytes % kVec == 0, "rows are whole vectors of whole elements");
constexpr int kReducers = kWarps - 1;

// Vectors a reducer lane loads before it sums them, per source (the two biases and each rank's
// row): up to 4, 2 from 4 ranks, 1 from 8, and no more than half a lane's registers hold
// (65536 / kThreads of them, 4 a vector). With four an f32 row at 1024 threads spilled, and that
// kernel read through a null bias on an H200 (NVRTC 13.0; the emulator, and 768 threads, did
// not): PYEP_REDUCE_ROUNDS sets it, for tuning.
#ifdef PYEP_REDUCE_ROUNDS
constexpr int kReduceRounds = PYEP_REDUCE_ROUNDS;
#else
constexpr int kReduceRegs = (65536 / kThreads < 255 ? 65536 / kThreads : 255) / 2;
constexpr int kReduceFit = kReduceRegs / 4 / (kRanks + 2) > 1 ? kReduceRegs / 4 / (kRanks + 2) : 1;
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

// Sending warp wg of peer d on channel c: the rows this rank received from d on channel c with
// ordinal wg mod W, back into sub-ring wg of d's ring; it posts its tail word at *slot.
PYEP_DEVICE void combine_send(const CombineParams& p, int c, int d, int wg, int lane, u64* slot) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    const i32* rank_prefix = reinterpret_cast<const i32*>(p.rank_prefix);
    const i32* cp = reinterpret_cast<const i32*>(p.channel_prefix);
    // Rows this rank received from d on channel c: [first, first + count).
    const i32 base = d > 0 ? rank_prefix[(d - 1) * R + me] : 0;
    const i32 block = rank_prefix[d * R + me] - base;
    const i32 v = cp[d * C + c];
    const i32 end = c + 1 < C ? cp[d * C + c + 1] : block;
    const bool bad = base < 0 || v < 0 || v > end || end > block || (c == 0 && v != 0) || base + end > p.num_rows;
    if (bad) {
        if (wg == 0 && lane == 0) fail(ctx, kOpCombine, kCodeMismatch, kBadChannelPrefix, c, d, v, 0, block);
        return;
    }
    if (wg >= sr.n) return;
    const i32 first = base + v, count = end - v;
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

// Reducer warp r of channel c: tokens lo + r, lo + r + kReducers, ...
PYEP_DEVICE void combine_reduce(const CombineParams& p, int c, int r, int lane, i32* s_cur) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const SubRings sr = sub_rings(ctx, kWarpsPerRank);
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    const u8* buf = reinterpret_cast<const u8*>(ctx.data[me]);
    const i32* send_head = reinterpret_cast<const i32*>(p.send_head);
    const int ring = c * R + (lane < R ? lane : 0);
    // Lane q < R: tokens rank q has pushed on each sub-ring of our ring, as last read.
    i32 seen[kSubRings];
    for (int w = 0; w < kSubRings; w++) seen[w] = 0;
    for (i32 t = lo + r; t < hi; t += kReducers) {
        st_release_cta(s_cur + r, t);
        const i32 sh = lane < R ? ld_nc(reinterpret_cast<const int*>(send_head) + static_cast<i64>(t) * R + lane) : -1;
        // Ring token sh is token k of sub-ring w. The warp waits as one: lane q < R polls rank
        // q's tail word until it has arrived, and every lane goes round the loop until no lane
        // waits (no lane spins on its own).
        const int w = sh >= 0 ? sh % sr.n : 0;
        const i32 k = sh >= 0 ? sh / sr.n : 0;
        const u64* tail = tail_word(ctx, me, ring, w);
        bool ok = true;
        u64 start = 0;
        const u64 since = probe_clock();
        for (;;) {
            bool waiting = false;
            if (ok && sh >= 0 && seen[w] <= k) {
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
        __syncwarp();  // orders each polling lane's acquire before the whole warp's reads
        const i64 gs = sh >= 0 ? static_cast<i64>(ring) * ctx.ring_slots + static_cast<i64>(w) * sr.slots + k % sr.slots : -1;
        if (ok && sh >= 0) {
            const i32 got = ld_ring(reinterpret_cast<const int*>(buf + p.off_src) + gs);
            if (got != t) {
                fail(ctx, kOpCombine, kCodeMismatch, kBadSrc, c, lane, got, t, 0);
                ok = false;
            }
        }
        if (!__all_sync(0xffffffffu, ok)) break;
        i64 slot[kRanks];  // rank q's slot of token t, -1 if q did not get it
#pragma unroll
        for (int q = 0; q < kRanks; q++) slot[q] = __shfl_sync(0xffffffffu, gs, q);
        const V* b0 = p.bias0 != 0 ? reinterpret_cast<const V*>(p.bias0 + static_cast<u64>(t) * kRowBytes) : nullptr;
        const V* b1 = p.bias1 != 0 ? reinterpret_cast<const V*>(p.bias1 + static_cast<u64>(t) * kRowBytes) : nullptr;
        V* out = reinterpret_cast<V*>(p.out + static_cast<u64>(t) * kRowBytes);
        const V* rows[kRanks];
#pragma unroll
        for (int q = 0; q < kRanks; q++)
            rows[q] = reinterpret_cast<const V*>(buf + p.off_row + (slot[q] >= 0 ? slot[q] : 0) * kRowBytes);
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
                if (slot[q] < 0) continue;
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
                    if (slot[q] >= 0) add_vec(acc, in[q][u]);
                st_na(out + i + 32 * u, pack_vec(acc));
            }
        }
        if (kTopk > 0 && p.out_weights != 0) {
            float* ow = reinterpret_cast<float*>(p.out_weights) + static_cast<i64>(t) * kTopk;
            for (int k = lane; k < kTopk; k += 32) {
                float w = 0.0f;
#pragma unroll
                for (int q = 0; q < kRanks; q++)
                    if (slot[q] >= 0) w += ld_ring(reinterpret_cast<const float*>(buf + p.off_weights) + slot[q] * kTopk + k);
                ow[k] = w;
            }
        }
        probe_rows(1);
        __syncwarp();
    }
    st_release_cta(s_cur + r, hi);
}

// Warp 0 of a reducing block: frees ring slots behind the slowest reducer.
PYEP_DEVICE void combine_coordinate(const CombineParams& p, int c, int lane, i32* s_cur) {
    const Ctx& ctx = p.ctx;
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    i32 lo, hi;
    channel_range(p.num_tokens, C, c, lo, hi);
    const i32* send_head = reinterpret_cast<const i32*>(p.send_head);
    u32* head = head_word(ctx, lane < R ? lane : 0, c * R + me, 0);
    i32 freed = 0;  // lane q < R: slots of rank q's ring freed so far
    i32 done = lo;  // tokens below this are reduced
    for (;;) {
        i32 f = hi;
        for (int i = lane; i < kReducers; i += 32) f = min(f, ld_acquire_cta(s_cur + i));
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
                    st_release_sys(head, static_cast<u32>(freed));
                }
            }
            done = f;
        }
        if (f >= hi) break;
        if (aborted(ctx) != 0) return;
        nanosleep(32);
    }
    // Every rank must have returned exactly the rows send_head asked for.
    if (lane < R) {
        const u64* tail = tail_word(ctx, me, c * R + lane, 0);
        u64 start = 0, w;
        for (;;) {
            w = ld_acquire_sys(tail);
            if ((w >> 32) != 0) break;
            if (!keep_waiting(ctx, start, kOpCombine, kWaitAnnounce, c, lane, c, 0, 0)) return;
        }
        const i32 announced = static_cast<i32>(w >> 32) - 1;
        if (announced != freed) fail(ctx, kOpCombine, kCodeMismatch, kBadReturnCount, c, lane, announced, freed, 0);
    }
}
