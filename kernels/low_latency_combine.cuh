// low_latency_combine.cuh: the send and receive phases of the low-latency combine (DeepEP's
// low_latency_combine). low_latency.cu includes it inside namespace pyep, after the helpers the
// phases share with the dispatch (waits, flags, the work split), and defines the kernel.
//
// The combine goes "by rank": a token's rows cross to its rank once per expert rank, not once per
// expert. Token t of rank s that selected experts of rank r (its selections S_r, in k order) gets
// one row from r, r's term of t:
//   - one selection (k): the expert's row as it is; s multiplies it by w_k when it sums;
//   - two or more: r's partial sum, sum over k in S_r of w_k * row_k in float32 (a product
//     rounded, then an add, as the reference), rounded once to bf16.
// s adds the terms in float32, in the order of each rank's first selection, and rounds the sum to
// bf16 (goep/lowlatency's reference, the same bit for bit). The weights are s's, given to the
// combine: so the send first pushes every rank's selections (expert and weight, MaxTopk a token)
// to every peer, into the push area of the call's half ([src][t][k] after a flag a source:
// seq << 32 | tokens), and a rank reduces the tokens of a source once its push arrived.
//
// Send. Message i = t * R + s is the row that this rank owes token t of rank s (none when t
// selected no expert here); block b takes messages [R M b / G, R M (b + 1) / G), this rank's own
// first, kMsgRound at once:
// a warp a message, a lane a selection, reads the selections (this rank's own from topk_idx, a
// peer's from the push area once its flag arrived) and finds the row of each of this rank's among
// pair (j, s)'s (a scan for the token: the dispatch receive keeps each pair's rows in token order),
// with no barrier between, so the own messages are done while the peers' wait; then the warps
// copy or reduce the messages a chunk at a time into slot (this rank, t) of s's receive area
// (rows [R][M] of 2H). A peer on another node gets its rows staged in this rank's own receive area
// (past the R M slots) and put from there. The blocks count themselves done (the combine's counter,
// p.expert_sent[0]); the last stores every peer's flag (word [this rank] of its combine flags).
// A hooked send waits for no push: a message whose source's push has not arrived is marked
// deferred, and that peer's flag waits for the receive kernel (the hook).
// Receive: the messages the send deferred first (the same blocks, the marked messages, waiting for
// their pushes; then those peers' flags); then every block waits for every unmasked rank's flag,
// and a warp an item (a token and kCombineGroup chunks) sums the token's terms.

constexpr int kPushTopk = 11;  // selections a token has in the push area (goep/lowlatency's MaxTopk)
constexpr int kMsgRound = 32;  // messages a block locates at once (a warp a message)
static_assert(kTopk <= kPushTopk && kPushTopk <= 32, "a lane a selection");

PYEP_DEVICE u64 push_entries(const LLParams& p) { return p.off_push + (8 * static_cast<u64>(p.num_ranks) + 127) / 128 * 128; }

// Pushes this rank's selections to peer d (the caller's block, every thread): T tokens of
// kPushTopk entries (expert in the low word, -1 past the top-k, the weight's bits in the high),
// then d's push flag. A remote d gets them put from this rank's own entries [rank], which no peer
// writes.
PYEP_DEVICE void push_selections(const LLParams& p, int d, u32 seq) {
    const int T = p.num_tokens, tid = static_cast<int>(threadIdx.x);
    const u64 at = push_entries(p) + static_cast<u64>(p.rank) * p.max_tokens * kPushTopk * 8;
    const bool rem = is_remote(p, d);
    int2* dst = reinterpret_cast<int2*>((rem ? local(p) : region(p, d)) + at);
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    constexpr int kInFlight = 4;  // entries a thread has loaded before it stores the first
    for (int i0 = tid; i0 < T * kPushTopk; i0 += kThreads * kInFlight) {
        int2 v[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; u++) {
            const int i = i0 + u * kThreads, t = i / kPushTopk, k = i % kPushTopk;
            const bool on = i < T * kPushTopk && k < kTopk;
            v[u].x = on ? static_cast<int>(ld_nc(idx + static_cast<i64>(t) * kTopk + k)) : -1;
            v[u].y = on ? static_cast<int>(__float_as_uint(ld_nc(wts + static_cast<i64>(t) * kTopk + k))) : 0;
        }
#pragma unroll
        for (int u = 0; u < kInFlight; u++)
            if (i0 + u * kThreads < T * kPushTopk) st_na(dst + i0 + u * kThreads, v[u]);
    }
    __syncthreads();
    if (rem && T > 0 && tid < 32) put_peer(d, region(p, d) + at, dst, static_cast<u64>(T) * kPushTopk * 8);
    if (tid == 0) {
        if (!rem) fence_acq_rel_sys();  // the block's entries (ordered before this by the barrier)
        signal_peer<true>(p, d, reinterpret_cast<u64*>(region(p, d) + p.off_push) + p.rank, static_cast<u64>(seq) << 32 | static_cast<u32>(T));
    }
}

// The place of token t among pair (j, s)'s rows of x (in token order), or -1: the tokens read
// kScan at once (a pair has about T K / E rows: a round trip or two).
constexpr int kScan = 8;
PYEP_DEVICE i64 find_row(const LLParams& p, int j, int s, int t) {
    const i64 RM = static_cast<i64>(p.num_ranks) * p.max_tokens;
    const i64 v = ld_nc(reinterpret_cast<const i64*>(p.layout_range) + static_cast<i64>(j) * p.num_ranks + s);
    const i64 first = j * RM + (v >> 32);
    const int n = static_cast<int>(v & 0xffffffff) < p.max_tokens ? static_cast<int>(v & 0xffffffff) : p.max_tokens;
    const i32* tok = reinterpret_cast<const i32*>(p.src_info) + first;
    for (int i0 = 0; i0 < n; i0 += kScan) {
        i32 got[kScan];
#pragma unroll
        for (int u = 0; u < kScan; u++) got[u] = i0 + u < n ? ld_nc(tok + i0 + u) : -1;
#pragma unroll
        for (int u = 0; u < kScan; u++)
            if (got[u] == t) return first + i0 + u;
        if (got[kScan - 1] > t) break;  // in token order: past t
    }
    return -1;
}

// Eight float32 sums rounded to bf16, as one 16-byte vector.
PYEP_DEVICE int4 bf16x8(const float* acc) {
    int4 o;
    o.x = static_cast<int>(static_cast<u32>(float_to_bf16(acc[0])) | static_cast<u32>(float_to_bf16(acc[1])) << 16);
    o.y = static_cast<int>(static_cast<u32>(float_to_bf16(acc[2])) | static_cast<u32>(float_to_bf16(acc[3])) << 16);
    o.z = static_cast<int>(static_cast<u32>(float_to_bf16(acc[4])) | static_cast<u32>(float_to_bf16(acc[5])) << 16);
    o.w = static_cast<int>(static_cast<u32>(float_to_bf16(acc[6])) | static_cast<u32>(float_to_bf16(acc[7])) << 16);
    return o;
}

// Chunk c (8 channels a lane) of a message's row: the one row as it is, or the weighted sum of n
// rows (rows[e], -1: none; weights w[e]) rounded to bf16.
PYEP_DEVICE int4 chunk_row(const u16* x, int n, const i64* rows, const float* w, int c) {
    if (n == 1) return rows[0] >= 0 ? ld_nc(reinterpret_cast<const int4*>(x + rows[0] * kHidden + c)) : vec_zero<int4>();
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    constexpr int kInFlight = 4;
    for (int e0 = 0; e0 < n; e0 += kInFlight) {
        int4 v[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; u++)
            if (e0 + u < n && rows[e0 + u] >= 0) v[u] = ld_nc(reinterpret_cast<const int4*>(x + rows[e0 + u] * kHidden + c));
#pragma unroll
        for (int u = 0; u < kInFlight; u++) {
            if (e0 + u >= n || rows[e0 + u] < 0) continue;
            const u32 words[4] = {static_cast<u32>(v[u].x), static_cast<u32>(v[u].y), static_cast<u32>(v[u].z), static_cast<u32>(v[u].w)};
#pragma unroll
            for (int h = 0; h < 4; h++) {
                acc[2 * h] += mul_rn(bf16_to_float(static_cast<u16>(words[h] & 0xffffu)), w[e0 + u]);
                acc[2 * h + 1] += mul_rn(bf16_to_float(static_cast<u16>(words[h] >> 16)), w[e0 + u]);
            }
        }
    }
    return bf16x8(acc);
}

// LogFMT-10 (use_logfmt; goep/lowlatency/logfmt.go has the format and the cpu engine's codec, which
// this one matches bit for bit): a row of 2H bytes' room holds G = H/128 groups' meta words
// (bmin | bmax << 16) and then each group's 128 10-bit fields (code | sign << 9). A chunk's lanes
// 0-15 and 16-31 are one group each; a lane's 8 values are 80 bits at byte 10 * (lane % 16).
constexpr bool kLogFMT = PYEP_LL_LOGFMT != 0;
constexpr int kLogGroup = 128, kLogGroupBytes = kLogGroup * 10 / 8, kLogGroups = kHidden / kLogGroup;
constexpr u32 kLogLevels = 509, kLogInf = 511, kLogClip = 32 * 128, kMagInf = 0x7f80;
// The bytes of a row as it crosses.
constexpr u64 kRowBytes = kLogFMT ? static_cast<u64>(kLogGroups) * (4 + kLogGroupBytes) : 2 * static_cast<u64>(kHidden);
static_assert(kHidden % kLogGroup == 0 && kChunk == 2 * kLogGroup, "a chunk is two LogFMT groups, a half-warp each");

PYEP_DEVICE u32 log_code(u32 m, u32 bmin, u32 bmax) {
    if (m >= kMagInf) return kLogInf;
    if (m == 0) return 0;
    if (m < bmin) return m + 128 < bmin ? 0 : 1;  // more than an octave below the least level: zero
    const u32 d = bmax - bmin;
    return d == 0 ? 1 : 1 + ((m - bmin) * 2 * kLogLevels + d) / (2 * d);
}

PYEP_DEVICE u32 log_mag(u32 c, u32 bmin, u32 bmax) {
    if (c == 0) return 0;
    if (c == kLogInf) return kMagInf;
    return bmin + ((c - 1) * (bmax - bmin) * 2 + kLogLevels) / (2 * kLogLevels);
}

// Writes this lane's 8 values v of chunk c (on: c < H) into a LogFMT row at slot. Every lane of
// the warp calls it (the half-warps reduce their groups' ranges with shuffles).
PYEP_DEVICE void log_store(int4 v, int c, bool on, u8* slot) {
    const u32 words[4] = {static_cast<u32>(v.x), static_cast<u32>(v.y), static_cast<u32>(v.z), static_cast<u32>(v.w)};
    u32 hi = 0, lo = 0xffffu;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 m = words[i / 2] >> (16 * (i % 2)) & 0x7fffu;
        if (on && m < kMagInf) hi = m > hi ? m : hi, lo = m != 0 && m < lo ? m : lo;
    }
    const unsigned half = 0xffffu << (lane_id() & 16);
#pragma unroll
    for (int s = 8; s > 0; s >>= 1) {
        const u32 h2 = __shfl_xor_sync(half, hi, s), l2 = __shfl_xor_sync(half, lo, s);
        hi = h2 > hi ? h2 : hi, lo = l2 < lo ? l2 : lo;
    }
    const u32 bmax = hi, bmin = lo == 0xffffu ? 0 : (bmax > lo + kLogClip ? bmax - kLogClip : lo);
    if (!on) return;
    const int g = c / kLogGroup, l = (c % kLogGroup) / 8;
    if (l == 0) st_na(reinterpret_cast<int*>(slot) + g, static_cast<int>(bmin | bmax << 16));
    u64 bits = 0;
    u32 top = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 h = words[i / 2] >> (16 * (i % 2)) & 0xffffu, f = log_code(h & 0x7fffu, bmin, bmax) | (h >> 15) << 9;
        if (i < 6) bits |= static_cast<u64>(f) << (10 * i);
        else if (i == 6) bits |= static_cast<u64>(f) << 60, top = f >> 4;
        else top |= f << 6;
    }
    short* out = reinterpret_cast<short*>(slot + 4 * kLogGroups + g * kLogGroupBytes + 10 * l);
#pragma unroll
    for (int i = 0; i < 4; i++) st_na(out + i, static_cast<short>(bits >> (16 * i)));
    st_na(out + 4, static_cast<short>(top));
}

// This lane's 8 values of chunk c of the LogFMT row at slot, as bf16 (a receive's read).
PYEP_DEVICE int4 log_load(const u8* slot, int c) {
    const int g = c / kLogGroup, l = (c % kLogGroup) / 8;
    const u32 meta = static_cast<u32>(ld_ring(reinterpret_cast<const int*>(slot) + g)), bmin = meta & 0xffffu, bmax = meta >> 16;
    const short* in = reinterpret_cast<const short*>(slot + 4 * kLogGroups + g * kLogGroupBytes + 10 * l);
    u64 bits = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) bits |= static_cast<u64>(static_cast<u16>(ld_ring(in + i))) << (16 * i);
    const u32 top = static_cast<u16>(ld_ring(in + 4));
    u32 o[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 f = (i < 6 ? static_cast<u32>(bits >> (10 * i)) : i == 6 ? static_cast<u32>(bits >> 60) | top << 4 : top >> 6) & 0x3ffu;
        o[i / 2] |= (log_mag(f & 0x1ffu, bmin, bmax) | (f >> 9) << 15) << (16 * (i % 2));
    }
    int4 r;
    r.x = static_cast<int>(o[0]), r.y = static_cast<int>(o[1]), r.z = static_cast<int>(o[2]), r.w = static_cast<int>(o[3]);
    return r;
}

// The combine's counters (p.expert_sent, PYEP_LL_SENT_WORDS i32, zero between calls): the send's blocks done, the
// messages a hooked send left to its receive hook (the deferred), those per token rank, then a bit a message.
enum : int { kSentBlocks = 0, kSentDeferred = 1, kSentPerRank = 2 };
PYEP_DEVICE i32* sent_words(const LLParams& p) { return reinterpret_cast<i32*>(p.expert_sent); }
PYEP_DEVICE u32* deferred_bits(const LLParams& p) { return reinterpret_cast<u32*>(sent_words(p) + kSentPerRank + p.num_ranks); }
PYEP_DEVICE bool can_defer(const LLParams& p) {
    const i64 R = p.num_ranks;
    return kSentPerRank + R + (R * p.max_tokens + 31) / 32 <= PYEP_LL_SENT_WORDS;
}

// How send_messages treats a peer's messages: kSendWaiting waits for the peer's push; kSendDeferring (a
// hooked send) sends them if the push is there and else marks them deferred (bit, counts) for the
// receive hook; kSendDeferred (the hook) sends the marked ones, waiting for their pushes.
enum : int { kSendWaiting, kSendDeferring, kSendDeferred };

// The block's messages (block b of G: [R M b / G, R M (b + 1) / G), this rank's own first: they
// need no push, so their rounds run while the peers' pushes travel), kMsgRound at once.
PYEP_DEVICE void send_messages(const LLParams& p, u32 seq, int pass, const Writable& writable) {
    PYEP_SHARED(i32, s_n, kMsgRound);                   // the round's message m: its selections here (0: no row),
    PYEP_SHARED(u64, s_dst, kMsgRound);                 // where its row goes (this rank's stage for a remote rank),
    PYEP_SHARED(float, s_w, kMsgRound * kPushTopk);     // and its selections' weights
    PYEP_SHARED(i64, s_row, kMsgRound * kPushTopk);     // and rows of x (-1: none)
    const int R = p.num_ranks, L = p.num_experts / R, M = p.max_tokens, G = static_cast<int>(gridDim.x), me = p.rank;
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = lane_id(), b = static_cast<int>(blockIdx.x);
    const u16* x = p.zero_copy ? reinterpret_cast<const u16*>(local(p) + p.off_send) : reinterpret_cast<const u16*>(p.x);
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    i32* sent = sent_words(p);
    u32* bits = deferred_bits(p);
    const int NM = R * M, i0 = static_cast<int>(static_cast<i64>(NM) * b / G), i1 = static_cast<int>(static_cast<i64>(NM) * (b + 1) / G);
    const int o0 = ((me - i0) % R + R) % R, own = i1 - i0 > o0 ? (i1 - i0 - o0 + R - 1) / R : 0;
    auto message = [&](int q) {
        if (q < own) return i0 + o0 + q * R;
        const int k = q - own, a = R > 1 ? k / (R - 1) : 0, r = R > 1 ? k % (R - 1) : 0;
        return i0 + a * R + r + (r >= o0 ? 1 : 0);
    };
    for (int a = 0; a < i1 - i0; a += kMsgRound) {
        const int n = i1 - i0 - a < kMsgRound ? i1 - i0 - a : kMsgRound;
        __syncthreads();  // the previous round's readers are done with the shared arrays
        // A warp a message, a lane a selection: no barrier between a message's steps, so this rank's own messages
        // are located while the warps of the peers' wait for their pushes.
        for (int m = warp; m < n; m += kWarps) {  // warp-uniform
            const int i = message(a + m), t = i / R, s = i % R;
            const u32 bit = 1u << (i % 32);
            const bool marked = pass == kSendDeferred && (ld_volatile(bits + i / 32) & bit) != 0;
            int cnt = 0;
            u64 dst = 0;
            if ((pass != kSendDeferred || marked) && may_write(writable, s)) {
                int Ts = p.num_tokens;
                if (s != me) {
                    if (lane == 0) {
                        const u64* f = reinterpret_cast<const u64*>(local(p) + p.off_push) + s;
                        u64 v = ld_acquire_sys(f), spent;
                        auto pushed = [&] { return static_cast<u32>(v >> 32) == seq; };
                        if (pass == kSendDeferring && !pushed()) {
                            if (!masked(p, s)) {
                                atomicOr(bits + i / 32, bit);
                                atomicAdd(sent + kSentPerRank + s, 1);
                                atomicAdd(sent + kSentDeferred, 1);
                            }
                        } else if (pushed() || thread_wait(p, s, kWaitPush, [&] { return (v = ld_acquire_sys(f)), pushed(); }, spent)) {
                            Ts = static_cast<int>(static_cast<u32>(v));
                        }
                        if (!pushed()) Ts = 0;
                    }
                    Ts = __shfl_sync(0xffffffffu, Ts, 0);
                }
                i64 g = -1;
                float w = 0;
                if (t < Ts && lane < kPushTopk) {
                    if (s != me) {
                        const i64 e = ld_ring(reinterpret_cast<const i64*>(local(p) + push_entries(p)) + (static_cast<i64>(s) * M + t) * kPushTopk + lane);
                        g = static_cast<i32>(static_cast<u32>(e)), w = __int_as_float(static_cast<int>(e >> 32));
                    } else if (lane < kTopk) {
                        g = ld_nc(idx + static_cast<i64>(t) * kTopk + lane), w = ld_nc(wts + static_cast<i64>(t) * kTopk + lane);
                    }
                }
                const bool on = g >= 0 && g < p.num_experts && g / L == me;
                const u32 here = __ballot_sync(0xffffffffu, on);
                cnt = __popc(here);
                if (on) {  // the selection's place among the message's, in k order
                    const int e = m * kPushTopk + __popc(here & ((1u << lane) - 1u));
                    s_w[e] = w;
                    s_row[e] = find_row(p, static_cast<int>(g - static_cast<i64>(me) * L), s, t);
                }
                const u64 slot = static_cast<u64>(is_remote(p, s) ? NM + s * M + t : me * M + t) * (2 * kHidden);
                if (cnt > 0) dst = reinterpret_cast<u64>((is_remote(p, s) ? local(p) : region(p, s)) + p.off_recv + slot);
            }
            if (marked && lane == 0) atomicAnd(bits + i / 32, ~bit);  // for the next call
            if (lane == 0) s_n[m] = cnt, s_dst[m] = dst;
        }
        __syncthreads();
        for (int it = warp; it < n * kChunks; it += kWarps) {
            const int m = it / kChunks, c = (it % kChunks) * kChunk + lane * 8;
            if (s_n[m] == 0 || s_dst[m] == 0) continue;  // warp-uniform
            if (kLogFMT) {  // every lane: the half-warps reduce their groups' ranges
                const int4 v = c < kHidden ? chunk_row(x, s_n[m], s_row + m * kPushTopk, s_w + m * kPushTopk, c) : vec_zero<int4>();
                log_store(v, c, c < kHidden, reinterpret_cast<u8*>(s_dst[m]));
            } else if (c < kHidden) {
                st_na(reinterpret_cast<int4*>(s_dst[m]) + c / 8, chunk_row(x, s_n[m], s_row + m * kPushTopk, s_w + m * kPushTopk, c));
            }
        }
        if (kRemote) {
            __syncthreads();  // the round's staged rows are written
            for (int m = warp; m < n; m += kWarps) {
                const int t = message(a + m) / R, s = message(a + m) % R;
                if (s_dst[m] != 0 && is_remote(p, s))
                    put_peer(s, region(p, s) + p.off_recv + static_cast<u64>(me * M + t) * (2 * kHidden), reinterpret_cast<const void*>(s_dst[m]),
                             kRowBytes);
            }
        }
    }
}

// After a block's messages (and its barrier): the blocks count themselves done, and the last stores
// the flags of the peers whose rows are all written (word [this rank] of their combine flags):
// after the send, those it deferred nothing for (every one after a kSendWaiting pass: no count to
// read on the last block's path); after the hook's deferred pass, the others (whose counts it
// clears for the next call).
PYEP_DEVICE void signal_sent(const LLParams& p, u32 seq, int pass, const Writable& writable) {
    const bool deferred_pass = pass == kSendDeferred;
    i32* sent = sent_words(p);
    if (threadIdx.x != 0) return;
    fence_acq_rel_sys();  // the block's rows before its count
    if (atomicAdd(sent + kSentBlocks, 1) != static_cast<int>(gridDim.x) - 1) return;
    fence_acq_rel_sys();  // every block's rows before the flags
    st_volatile(sent + kSentBlocks, 0);  // for the next call (a later kernel)
    const bool any = pass != kSendWaiting && ld_volatile(sent + kSentDeferred) != 0;
    // Every block's rows are ordered before this thread's fence: its stores need no release of their own.
    for (int s = 0; s < p.num_ranks; s++) {
        const bool later = any && ld_volatile(sent + kSentPerRank + s) != 0;
        if (later == deferred_pass && may_write(writable, s) && !masked(p, s))
            signal_peer<true>(p, s, reinterpret_cast<u64*>(region(p, s) + p.off_cflags) + p.rank, static_cast<u64>(seq) << 32 | 1u);
        if (later && deferred_pass) st_volatile(sent + kSentPerRank + s, 0);
    }
    if (deferred_pass) st_volatile(sent + kSentDeferred, 0);
}

PYEP_DEVICE void combine_send(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_dok, kThreads);  // whether rank d may be written (d < kThreads)
    PYEP_LL_STAMP_START(p, PYEP_LL_CS_START, PYEP_LL_CS_FLAGGED);
    const Writable writable = load_writable(p, seq, s_dok);
    for (int d = static_cast<int>(blockIdx.x); d < p.num_ranks; d += static_cast<int>(gridDim.x))  // block-uniform
        if (d != p.rank && may_write(writable, d)) push_selections(p, d, seq);
    PYEP_LL_STAMP(p, PYEP_LL_CS_ADMITTED);
    // A hooked send waits for no peer's push: the hook sends what it could not.
    const int pass = (p.phases & kPhaseRecv) != 0 || !can_defer(p) ? kSendWaiting : kSendDeferring;
    send_messages(p, seq, pass, writable);
    PYEP_LL_STAMP(p, PYEP_LL_CS_COPIED);
    __syncthreads();  // the block's rows are written (and its puts issued)
    PYEP_LL_STAMP(p, PYEP_LL_CS_WRITTEN);
    signal_sent(p, seq, pass, writable);
    PYEP_LL_STAMP(p, PYEP_LL_CS_FLAGGED);
}

// The receive hook's first step, when its send deferred messages: it sends them, then their flags.
PYEP_DEVICE void send_deferred(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_dok, kThreads);
    const Writable writable = load_writable(p, seq, s_dok);
    send_messages(p, seq, kSendDeferred, writable);
    __syncthreads();
    signal_sent(p, seq, kSendDeferred, writable);
}

// Receive: every block waits for every unmasked rank's flag (a thread each); the threads that
// waited acquired the rows, and the barrier orders the block's reads after them. Then each warp
// of the grid takes (token, kCombineGroup chunks) items and adds each chunk's terms, a rank's at
// its first selection.
constexpr int kCombineGroup = 2;  // chunks an item sums: a token's indices and weights are loaded once for them
constexpr int kGroups = (kChunks + kCombineGroup - 1) / kCombineGroup;
constexpr int kMaskCache = 64;  // ranks whose mask the block keeps in shared memory
PYEP_DEVICE void combine_recv(const LLParams& p, u32 seq, u32 /* a dispatch's seq */) {
    PYEP_SHARED(i32, s_mask, kMaskCache);
    const int lane = lane_id(), R = p.num_ranks, E = p.num_experts, L = E / R, M = p.max_tokens;
    const u64* flags = reinterpret_cast<const u64*>(local(p) + p.off_cflags);
    PYEP_LL_STAMP_START(p, PYEP_LL_CR_START, PYEP_LL_CR_DONE);
    // Only a hook (a receive launched alone) has deferred messages; every block reads the count before any clears it.
    if ((p.phases & kPhaseSend) == 0 && ld_volatile(sent_words(p) + kSentDeferred) != 0) send_deferred(p, seq);
    PYEP_LL_STAMP(p, PYEP_LL_CR_SENT);
    for (int s = static_cast<int>(threadIdx.x); s < R; s += kThreads) {
        if (masked(p, s)) continue;
        u64 spent;
        thread_wait(p, s, kWaitCombine, [&] { return static_cast<u32>(ld_acquire_sys(flags + s) >> 32) == seq; }, spent);
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
        int rk[kTopk];  // selection k's rank, or -1 (none, or masked)
#pragma unroll
        for (int k = 0; k < kTopk; k++) {
            const int s = g[k] >= 0 && g[k] < E ? static_cast<int>(g[k]) / L : -1;
            rk[k] = s >= 0 && (s < kMaskCache ? s_mask[s] : (masked(p, s) ? 1 : 0)) == 0 ? s : -1;
        }
        int lead[kTopk];  // at a rank's first selection: how many selections it has (else 0)
#pragma unroll
        for (int k = 0; k < kTopk; k++) {
            bool first = rk[k] >= 0;
            int n = 0;
#pragma unroll
            for (int k2 = 0; k2 < kTopk; k2++) {
                if (k2 < k && rk[k2] == rk[k]) first = false;
                if (rk[k2] == rk[k]) n++;
            }
            lead[k] = first ? n : 0;
        }
        int4 v[kCombineGroup][kTopk];
#pragma unroll
        for (int q = 0; q < kCombineGroup; q++) {
            const int c = c0 + q * kChunk;
#pragma unroll
            for (int k = 0; k < kTopk; k++)
                if (lead[k] > 0 && c < kHidden) {
                    const u8* slot = slots + (static_cast<u64>(rk[k]) * M + t) * (2 * kHidden);
                    v[q][k] = kLogFMT ? log_load(slot, c) : ld_ring(reinterpret_cast<const int4*>(slot) + c / 8);
                }
        }
#pragma unroll
        for (int q = 0; q < kCombineGroup; q++) {
            const int c = c0 + q * kChunk;
            if (c >= kHidden) continue;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int k = 0; k < kTopk; k++) {
                if (lead[k] == 0) continue;
                const u32 words[4] = {static_cast<u32>(v[q][k].x), static_cast<u32>(v[q][k].y), static_cast<u32>(v[q][k].z),
                                      static_cast<u32>(v[q][k].w)};
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    const float lo = bf16_to_float(static_cast<u16>(words[h] & 0xffffu)), hi = bf16_to_float(static_cast<u16>(words[h] >> 16));
                    acc[2 * h] += lead[k] == 1 ? mul_rn(lo, w[k]) : lo;
                    acc[2 * h + 1] += lead[k] == 1 ? mul_rn(hi, w[k]) : hi;
                }
            }
            st_na(reinterpret_cast<int4*>(reinterpret_cast<u16*>(p.out) + static_cast<i64>(t) * kHidden + c), bf16x8(acc));
        }
    }
    PYEP_LL_STAMP(p, PYEP_LL_CR_SUMMED);
}
