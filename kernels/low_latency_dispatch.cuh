// low_latency_dispatch.cuh: the send and receive phases of the low-latency dispatch (DeepEP's
// low_latency_dispatch). low_latency.cu includes it inside namespace pyep, after the helpers the
// phases share with the combine (waits, flags, the work split, prefix sums), and defines the kernel.
//
// The message format: token t of source rank s crosses to a destination rank d once, whatever number
// of d's experts it selected, as message i = s * M + t of d's receive area (of the call's half), in
// two parts, at offsets the host passes (goep/cuda/lowlatency's msgFormat checks that they fit the
// layout's areas):
//   - its body, kBodyBytes at recv + i * kBodyBytes: the row (H FP8 bytes, or 2H BF16 bytes), then
//     with FP8 its H/128 float32 scales, padded to 16 bytes;
//   - its header, p.msg_header bytes (16-byte aligned) at p.off_heads + i * p.msg_header: u32 the
//     call's seq, i32 t, i32 n, then n entries j * M + slot, one a local expert j of d's that t
//     selected: the slot is the row's place among pair (j, s)'s rows (the tokens of s before t that
//     selected j, so that each pair's rows stay in token order, as the reference's).
// The receiver expands a message into a row per entry. The headers lie past the rows of a combine
// (the two calls share a half's receive area: [E][M] rows of 2H), so a header's place holds only
// headers: this call's (its seq), an earlier call's on the half (an older seq), or zeros (the
// allocation, clean_low_latency_buffer). Their size depends on L only (room for min(11, L)
// entries), so a call with another top-k or dtype finds the headers where the last call left them.

// The balanced receive holds every pair's prefix sum in a block (when the pairs fit) and moves an
// equal share of rows, kRowsRound located at once, kRowUnroll vectors in flight a thread.
constexpr int kPairsShared = 4 * kThreads;  // pairs a block holds the prefix sums of
constexpr int kRowsRound = 64;               // rows a block locates at once
constexpr int kRowUnroll = 4;

constexpr bool kFP8 = PYEP_LL_FP8 != 0;
constexpr bool kRound = PYEP_LL_ROUND != 0;
constexpr bool kUE8M0 = PYEP_LL_UE8M0 != 0;
constexpr int kCastBatch = 8;  // chunks a warp has in flight when it casts or packs messages
constexpr int kScales = kHidden / kScaleBlock;
constexpr int kRowBytes = kFP8 ? kHidden : 2 * kHidden;
constexpr int kScaleVecs = kFP8 ? (kScales + 3) / 4 : 0;  // 16-byte vectors of a body's scales
constexpr int kBodyVecs = kRowBytes / 16 + kScaleVecs;
constexpr int kBodyBytes = 16 * kBodyVecs;
constexpr int kHeadWords = 3;                             // a header's words before its entries: seq, token, entries
constexpr int kHeadVecs = (kHeadWords + kTopk + 3) / 4;  // the most 16-byte vectors a header of this build fills

// The one step that writes a piece of a message's body into a destination (this rank's or a peer's,
// reached through p.peers): the v at byte off of the body at slot.
template <typename V>
PYEP_DEVICE void put_piece(u64 slot, int off, V v) {
    st_na(reinterpret_cast<V*>(reinterpret_cast<u8*>(slot) + off), v);
}

// One warp casts its items it0, it0 + stride, ... (kCastBatch of them, those < total) once each
// and writes each into every body of its token: locate(it, tok, ch, slots) says that item it is
// chunk ch of token tok, whose body goes to slots[0..kTopk) (a leg each; 0: none). Lane l moves channels
// ch * 256 + 8 l; with FP8, 16 lanes share a scale block.
template <typename Locate>
PYEP_DEVICE void put_chunks(const LLParams& p, int it0, int stride, int total, Locate locate) {
    const int lane = lane_id();
    const u16* x = reinterpret_cast<const u16*>(p.x);
    int4 in[kCastBatch] = {};
    i32 tok[kCastBatch];
    int ch[kCastBatch];
    const u64* slots[kCastBatch];
#pragma unroll
    for (int b = 0; b < kCastBatch; b++) {
        const int it = it0 + b * stride;
        tok[b] = 0, ch[b] = 0, slots[b] = nullptr;
        if (it < total) locate(it, tok[b], ch[b], slots[b]);
        const int c = ch[b] * kChunk + lane * 8;
        if (it < total && c < kHidden) in[b] = ld_nc(reinterpret_cast<const int4*>(x + static_cast<i64>(tok[b]) * kHidden + c));
    }
#pragma unroll
    for (int b = 0; b < kCastBatch; b++) {
        if (it0 + b * stride >= total) break;  // warp-uniform
        const int c = ch[b] * kChunk + lane * 8;
        const bool on = c < kHidden;
        if (!kFP8) {
            for (int k = 0; k < kTopk; k++) {
                const u64 slot = slots[b][k];
                if (slot == 0) continue;
                if (on) put_piece(slot, 2 * c, in[b]);
            }
            continue;
        }
        float f[8];
        float amax = 1e-4f;
        const u32 words[4] = {static_cast<u32>(in[b].x), static_cast<u32>(in[b].y), static_cast<u32>(in[b].z), static_cast<u32>(in[b].w)};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = bf16_to_float(static_cast<u16>(words[k] & 0xffffu));
            f[2 * k + 1] = bf16_to_float(static_cast<u16>(words[k] >> 16));
        }
        if (on)
#pragma unroll
            for (int k = 0; k < 8; k++) amax = fmaxf(amax, fabsf(f[k]));
#pragma unroll
        for (int m2 = 1; m2 < 16; m2 <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m2));
        if (!on) continue;
        float scale, inv;
        fp8_scales<kRound>(amax, scale, inv);
#pragma unroll
        for (int k = 0; k < 8; k++) f[k] = mul_rn(f[k], scale);
        const int2 packed = pack_e4m3(f);
        for (int k = 0; k < kTopk; k++) {
            const u64 slot = slots[b][k];
            if (slot == 0) continue;
            put_piece(slot, c, packed);
            if (lane % 16 == 0) put_piece(slot, kRowBytes + 4 * (c / kScaleBlock), static_cast<int>(__float_as_uint(inv)));
        }
    }
}

// Counts, over this rank's tokens, those that selected expert g[q] (total[q]) and those of them
// before token before_tok[q] (before[q]), for q < nq (g[q] = -1 counts nothing); before and total
// start at 0. The block's threads take a token each, and every query is a ballot a warp.
PYEP_DEVICE void count_selections(const LLParams& p, const i32* g, const i32* before_tok, int nq, i32* before, i32* total) {
    const int lane = lane_id();
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    for (int t0 = 0; t0 < p.num_tokens; t0 += kThreads) {
        const int t = t0 + static_cast<int>(threadIdx.x);
        i64 e[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++) e[k] = t < p.num_tokens ? ld_nc(idx + static_cast<i64>(t) * kTopk + k) : -1;
        for (int q = 0; q < nq; q++) {
            const i64 want = g[q];
            bool hit = false;
#pragma unroll
            for (int k = 0; k < kTopk; k++) hit |= e[k] == want;
            hit = hit && want >= 0;
            const u32 all = __ballot_sync(0xffffffffu, hit), early = __ballot_sync(0xffffffffu, hit && t < before_tok[q]);
            if (lane == 0 && all != 0u) {
                atomicAdd(total + q, __popc(all));
                if (early != 0u) atomicAdd(before + q, __popc(early));
            }
        }
    }
}

// The same counts from per-expert bitmaps of the tokens that selected each expert (mark_selections:
// word w of expert g's row, bit i for token 32 w + i), which every block builds once a call in
// shared memory: a query is then a few popcounts instead of a ballot of every warp.
constexpr int kMarkWords = 8192;  // E * ceil(T / 32) words at most; more experts or tokens count by ballots
PYEP_DEVICE void mark_selections(const LLParams& p, u32* marks, int W) {
    const int tid = static_cast<int>(threadIdx.x), E = p.num_experts;
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    for (int i = tid; i < E * W; i += kThreads) marks[i] = 0;
    __syncthreads();
    for (int t = tid; t < p.num_tokens; t += kThreads) {
        i64 e[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++) e[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
        for (int k = 0; k < kTopk; k++)
            if (e[k] >= 0 && e[k] < E) atomicOr(marks + e[k] * W + t / 32, 1u << (t % 32));
    }
    __syncthreads();
}
PYEP_DEVICE void count_marked(const u32* marks, int W, const i32* g, const i32* before_tok, int nq, i32* before, i32* total) {
    for (int q = static_cast<int>(threadIdx.x); q < nq; q += kThreads) {
        if (g[q] < 0) continue;
        const u32* m = marks + g[q] * W;
        const int t = before_tok[q];
        int all = 0, early = 0;
        for (int w = 0; w < W; w++) {
            const u32 v = m[w];
            all += __popc(v);
            if (w < t / 32) early += __popc(v);
            if (w == t / 32) early += __popc(v & ((1u << (t % 32)) - 1u));
        }
        before[q] = early, total[q] = all;
    }
}

// One shared array of the dispatch kernel: the send's bitmaps (mark_selections), then the receive's
// prefix sums (its first barrier, count_recv's, comes after the send's last use).
constexpr int kMsgsShared = 8 * kThreads;  // messages a block holds the prefix sums of (with kPairsShared pairs)
constexpr int kArenaWords = kMarkWords > kPairsShared + kMsgsShared + 2 ? kMarkWords : kPairsShared + kMsgsShared + 2;
PYEP_DEVICE u32* dispatch_arena() {
    PYEP_SHARED(u32, s_arena, kArenaWords);
    return s_arena;
}

// Writes the header of leg q (the token's first selection of an expert on the leg's rank; its
// other selections there name q as their leg) at head: the call's seq, the token, and an entry
// for every selection of the leg.
PYEP_DEVICE void write_header(u8* head, u32 seq, int q, const i32* s_g, const i32* s_t, const i32* s_before, const i32* s_leg,
                              int L, int M) {
    u32 w[4 * kHeadVecs] = {};
    int n = 0;
    const int q0 = q - q % kTopk;  // the token's first selection
    for (int k = 0; k < kTopk; k++)
        if (s_leg[q0 + k] == q) w[kHeadWords + n++] = static_cast<u32>((s_g[q0 + k] % L) * M + s_before[q0 + k]);
    w[0] = seq, w[1] = static_cast<u32>(s_t[q]), w[2] = static_cast<u32>(n);
    for (int v = 0; v < (kHeadWords + n + 3) / 4; v++) {
        int4 x;
        x.x = static_cast<int>(w[4 * v]), x.y = static_cast<int>(w[4 * v + 1]), x.z = static_cast<int>(w[4 * v + 2]),
        x.w = static_cast<int>(w[4 * v + 3]);
        st_na(reinterpret_cast<int4*>(head) + v, x);
    }
}

// Send: a unit is a token. For a batch of its tokens, the block settles every selection (expert g
// of token t, once however often t selected g): its slot at g is the number of tokens before t that
// selected g, and its leg, the token's first selection of an expert on g's rank, which leads the
// token's message to that rank (whether a rank may be written is asked once a block, at its start:
// ask_writable). A leg's thread places its body (by the token alone: message(t) at the rank), the
// warps cast each chunk of every token once and write it into the body of every leg of the token,
// and then, while those writes drain, the slots are counted and each leg's thread writes the
// message's header (its selections' entries).
// Expert g's flag, seq << 32 | count (every block knows how many tokens selected g), is stored
// early, by block g % G, which asks about its experts (kOwn a batch) in the same counting pass as
// its tokens' selections. What says that the messages are written is the done word of this rank
// at each destination: once all its messages are written, every block fences once and adds its
// share of kDoneShares to it (a red, no reply awaited), so the word reaches dseq * kDoneShares when
// every block's messages of the half's dseq-th dispatch call are there. (Each selection used to count itself in its
// expert's counter, and the one completing the count fenced again and stored the flag: 2.5-3 µs
// of the send's end on two H200s, bench/results/h200x2-2026-11-27-done.) A leg whose rank is
// remote is not written there: the token's body is cast once into this rank's send area (body t)
// and the leg's header staged there too (header [rank][t], after the M bodies); after the barrier
// a warp puts both from there to the rank; the flags and the done word's add are signals.
constexpr int kSel = kBatch * kTopk;  // selections of a batch
// PYEP_LL_CAST_FIRST=0: the bodies cast after the headers, for comparison.
#ifndef PYEP_LL_CAST_FIRST
#define PYEP_LL_CAST_FIRST 1
#endif
constexpr bool kCastFirst = PYEP_LL_CAST_FIRST != 0;
constexpr int kOwn = 16;              // experts a block asks about for their flags, a batch
constexpr u64 kDoneShares = 1ull << 20;  // what the blocks of a call add to a done word, together

// Block b's share of kDoneShares (of G blocks): the shares of any grid sum to kDoneShares, so the
// receiver need not know the sender's grid.
PYEP_DEVICE u64 done_share(int b, int G) { return kDoneShares * (b + 1) / G - kDoneShares * b / G; }
// Source src's done word in rank r's half.
PYEP_DEVICE u64* done_word(const LLParams& p, int r, int src) { return reinterpret_cast<u64*>(region(p, r) + p.off_ddone) + src; }
PYEP_DEVICE void dispatch_send(const LLParams& p, u32 seq) {
    // Queries [0, S) are the batch's selections, [S, S + own) the experts whose flags the block stores.
    PYEP_SHARED(i32, s_g, kSel + kOwn);       // query q's expert, or -1 (none, or a repeat)
    PYEP_SHARED(i32, s_t, kSel + kOwn);       // selection q's token
    PYEP_SHARED(i32, s_before, kSel + kOwn);  // tokens before q's that selected its expert
    PYEP_SHARED(i32, s_total, kSel + kOwn);   // tokens that selected q's expert
    PYEP_SHARED(i32, s_leg, kSel);            // selection q's leg (q: q leads it), or -1 (no expert)
    PYEP_SHARED(u64, s_slot, kSel);           // leg q's body at its rank (0: none, or not a leg), or the staged body
    PYEP_SHARED(u64, s_rslot, kSel);          // leg q's body at its rank when that is remote (0: none)
    PYEP_SHARED(u64, s_head, kSel + kOwn);    // leg q's header place (staged, for a remote rank), or the flag of
                                              // owned query q; 0: not written (their addresses are loaded before the cast)
    PYEP_SHARED(i32, s_dok, kThreads);        // whether rank d may be written (d < kThreads)
    const int warp = static_cast<int>(threadIdx.x) / 32, tid = static_cast<int>(threadIdx.x), R = p.num_ranks,
              E = p.num_experts, L = E / R, T = p.num_tokens, M = p.max_tokens, G = static_cast<int>(gridDim.x),
              b = static_cast<int>(blockIdx.x);
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    auto flag = [&](int g) { return reinterpret_cast<u64*>(region(p, g / L) + p.off_dflags) + (g % L) * R + p.rank; };
    u8* staged = local(p) + p.off_send;  // remote ranks' messages: bodies by token, then headers by (rank, token)
    u8* staged_heads = staged + static_cast<u64>(M) * kBodyBytes;
    auto message = [&](int t) { return static_cast<u64>(p.rank) * M + t; };  // this rank's message of token t at a rank
    const int owned = b < E ? (E - b + G - 1) / G : 0;  // experts b, b + G, ...
    PYEP_LL_STAMP_START(p, PYEP_LL_DS_START, PYEP_LL_DS_FLAGGED);
    u32* s_marks = dispatch_arena();
    const int W = (T + 31) / 32;
    const bool marked = E * W <= kMarkWords;  // block-uniform
    // The acknowledgements' loads beside the selections' (the barriers of mark_selections or of the first batch order them).
    const Writable writable = b < T || owned > 0 ? ask_writable(p, seq, s_dok) : Writable{p, seq, s_dok};
    if (marked && (b < T || owned > 0)) mark_selections(p, s_marks, W);
    PYEP_LL_STAMP(p, PYEP_LL_DS_MARKED);
    for (int u0 = b, asked = 0; u0 < T || asked < owned; u0 += kBatch * G) {
        const int P = u0 < T ? batch_units(u0, T) : 0, S = P * kTopk;
        const int own = owned - asked < kOwn ? owned - asked : kOwn;
        __syncthreads();  // the previous batch's readers are done with the shared arrays
        // A thread a token: its selections' loads all in flight, repeats and legs found in registers.
        for (int i = tid; i < P; i += kThreads) {
            const int t = u0 + i * G;
            i64 e[kTopk];
            int d[kTopk];  // selection k's rank, or -1 (no expert, or a repeat)
#pragma unroll
            for (int k = 0; k < kTopk; k++) e[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
            for (int k = 0; k < kTopk; k++) {
                bool first = e[k] >= 0 && e[k] < E;
#pragma unroll
                for (int k2 = 0; k2 < k; k2++) first = first && e[k2] != e[k];
                d[k] = first ? static_cast<int>(e[k]) / L : -1;  // 32-bit: e[k] < E
                const int s = i * kTopk + k;
                s_g[s] = first ? static_cast<i32>(e[k]) : -1;
                s_t[s] = t, s_before[s] = 0, s_total[s] = 0;
            }
#pragma unroll
            for (int k = 0; k < kTopk; k++) {
                int leg = d[k] < 0 ? -1 : k;
#pragma unroll
                for (int k2 = k - 1; k2 >= 0; k2--)
                    if (d[k] >= 0 && d[k2] == d[k]) leg = k2;
                s_leg[i * kTopk + k] = leg < 0 ? -1 : i * kTopk + leg;
            }
        }
        for (int q = tid; q < own; q += kThreads) s_g[S + q] = b + (asked + q) * G, s_t[S + q] = 0, s_before[S + q] = 0, s_total[S + q] = 0;
        __syncthreads();
        // A thread a leg: whether its rank may be written, and if so its body's place there (which the
        // token alone decides). A remote rank's body is placed by the put after the barrier (s_rslot).
        // The header's place and an owned expert's flag are found here too, so that no load of the peer
        // table waits behind the cast's stores.
        for (int s = tid; s < S + own; s += kThreads) {
            const int g = s_g[s], d = g / L, t = s_t[s];
            if (s >= S) {
                s_head[s] = may_write(writable, d) ? reinterpret_cast<u64>(flag(g)) : 0;
                continue;
            }
            const bool leg = s_leg[s] == s && may_write(writable, d), rem = kRemote && leg && is_remote(p, d);
            u8* at = leg ? region(p, d) : nullptr;
            const u64 body = leg ? reinterpret_cast<u64>(at + p.off_recv + message(t) * kBodyBytes) : 0;
            s_slot[s] = rem ? 0 : body;
            if (kRemote) s_rslot[s] = rem ? body : 0;
            s_head[s] = !leg ? 0
                        : rem ? reinterpret_cast<u64>(staged_heads + (static_cast<u64>(d) * M + t) * p.msg_header)
                              : reinterpret_cast<u64>(at + p.off_heads + message(t) * p.msg_header);
        }
        __syncthreads();
        if (kRemote) {
            // A token with remote legs has its body cast once into the send area (in its first such leg's slot).
            for (int i = tid; i < P; i += kThreads)
                for (int k = 0; k < kTopk; k++)
                    if (s_rslot[i * kTopk + k] != 0) {
                        s_slot[i * kTopk + k] = reinterpret_cast<u64>(staged + static_cast<u64>(u0 + i * G) * kBodyBytes);
                        break;
                    }
            __syncthreads();
        }
        PYEP_LL_STAMP(p, PYEP_LL_DS_SETTLED);
        // Item it is chunk it % kChunks of the batch's token it / kChunks; warp w takes items w, w + kWarps, ...
        auto cast = [&] {
            const int total = P * kChunks;
            for (int it0 = warp; it0 < total; it0 += kWarps * kCastBatch)
                put_chunks(p, it0, kWarps, total, [&](int it, i32& tok, int& ch, const u64*& slots) {
                    const int i = it / kChunks;
                    ch = it % kChunks;
                    tok = u0 + i * G;
                    slots = s_slot + i * kTopk;
                });
        };
        // The bodies first: their writes drain while the slots are counted and the headers written.
        if (kCastFirst) cast();
        PYEP_LL_STAMP(p, PYEP_LL_DS_CAST);
        if (marked)
            count_marked(s_marks, W, s_g, s_t, S + own, s_before, s_total);
        else
            count_selections(p, s_g, s_t, S + own, s_before, s_total);
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_DS_COUNTED);
        // The flags of the experts the block asks about: ordered by the done words, not by themselves.
        for (int q = tid; q < own; q += kThreads)
            if (s_head[S + q] != 0)
                signal_peer<true>(p, s_g[S + q] / L, reinterpret_cast<u64*>(s_head[S + q]), static_cast<u64>(seq) << 32 | static_cast<u32>(s_total[S + q]));
        asked += own;
        if (P == 0) {  // block-uniform
            PYEP_LL_STAMPS_AT_ONCE(p, PYEP_LL_DS_HEADERS, PYEP_LL_DS_WRITTEN);  // a round with no token writes nothing
            continue;
        }
        // A thread a leg that may be written (a body placed, or to be put): its header (staged, for a remote rank).
        for (int s = tid; s < S; s += kThreads)
            if (s_head[s] != 0) write_header(reinterpret_cast<u8*>(s_head[s]), seq, s, s_g, s_t, s_before, s_leg, L, M);
        PYEP_LL_STAMP(p, PYEP_LL_DS_HEADERS);
        if (!kCastFirst) cast();
        __syncthreads();  // the block's messages are written
        PYEP_LL_STAMP(p, PYEP_LL_DS_WRITTEN);
        if (kRemote)
            for (int s = warp; s < S; s += kWarps)
                if (s_rslot[s] != 0) {  // warp-uniform
                    const int d = s_g[s] / L, t = s_t[s];
                    put_peer(d, reinterpret_cast<void*>(s_rslot[s]), staged + static_cast<u64>(t) * kBodyBytes, kBodyBytes);
                    put_peer(d, region(p, d) + p.off_heads + message(t) * p.msg_header, staged_heads + (static_cast<u64>(d) * M + t) * p.msg_header,
                             p.msg_header);
                }
    }
    if (b >= T && owned == 0) PYEP_LL_STAMPS_AT_ONCE(p, PYEP_LL_DS_MARKED, PYEP_LL_DS_WRITTEN);  // a block with nothing to do
    // Every block, once its messages are written (or put) and its flags stored: its share to this rank's
    // done word at every rank not masked, a thread a rank, each after a fence (which the barrier makes
    // cover the whole block's stores).
    __syncthreads();
    for (int r = tid; r < R; r += kThreads) {
        if (masked(p, r)) continue;
        fence_acq_rel_sys();
        if (r == tid) PYEP_LL_STAMP(p, PYEP_LL_DS_FENCED);
        signal_peer<true, true>(p, r, done_word(p, r, p.rank), done_share(b, G));
    }
    PYEP_LL_STAMP(p, PYEP_LL_DS_FLAGGED);
}

// Receive: the flags (a thread an (expert, source) pair: pair (j, s)'s count and, by their prefix
// sums, its first row among j's) and the done words (a thread a source). Once s's done word
// reached dseq * kDoneShares (dseq: the call's seq among the half's dispatch calls, run_phases),
// every message and flag of s's for this call is written, and a message's
// header is the one with this call's seq. An item is an entry of a message: the message's body becomes row
// j * RM + begin(j, s) + slot of recv_x, its token that row's src_info. The items are dealt to the
// blocks by the prefix sums of the messages' entries; a message's body is read once an entry (the
// repeats are L2 hits).

// PYEP_LL_COUNTS_BESIDE=0: the balanced receive reads the flags after the done words, for comparison.
#ifndef PYEP_LL_COUNTS_BESIDE
#define PYEP_LL_COUNTS_BESIDE 1
#endif
constexpr bool kCountsBeside = PYEP_LL_COUNTS_BESIDE != 0;

// What the count n of a flag that arrived says, at most M rows.
PYEP_DEVICE int flag_count(const LLParams& p, u64 v) {
    const int n = static_cast<int>(static_cast<u32>(v));
    return n < p.max_tokens ? n : p.max_tokens;
}

// Adds spent ns to source r's wait statistics (when the call asked for them).
PYEP_DEVICE void add_wait(const LLParams& p, int r, u64 spent) {
    if (p.wait_stats != 0) atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + r, static_cast<unsigned long long>(spent));
}

// One thread waits until source r's done word says that its messages and flags of this call are
// written (or r is masked or timed out); block r % G adds the wait to r's statistics. A barrier
// after it orders every thread's reads of them after the wait. Returns false when r was lost in
// the wait (masked by then, or timed out), true when it arrived or was masked before.
PYEP_DEVICE bool await_source(const LLParams& p, int r, u32 dseq) {
    if (masked(p, r)) return true;
    const u64* w = done_word(p, p.rank, r);
    const u64 want = static_cast<u64>(dseq) * kDoneShares;
    u64 spent;
    const bool ok = thread_wait(p, r, kWaitDispatch, [&] { return ld_acquire_sys(w) >= want; }, spent);
    if (r % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x)) add_wait(p, r, spent);
    return ok;
}

// Every source's done word (a thread a source), then the block's barrier.
PYEP_DEVICE void wait_sources(const LLParams& p, u32 dseq) {
    for (int r = static_cast<int>(threadIdx.x); r < p.num_ranks; r += kThreads) await_source(p, r, dseq);
    __syncthreads();
}

// Source r's count of messages for local expert j, read without its done word: the flag holds the
// call's seq beside the count and is stored once a call, early in the source's send (the owning
// block's first batch). Waits until it holds this call's seq; 0 when r is masked or timed out. Pair
// (j, r)'s owner (owner: its block) adds the wait to r's statistics.
PYEP_DEVICE int await_count(const LLParams& p, int j, int r, u32 seq, bool owner) {
    const bool gone = masked(p, r);  // its load in flight with the flag's
    const u64* f = reinterpret_cast<const u64*>(local(p) + p.off_dflags) + j * p.num_ranks + r;
    u64 v = 0, spent;
    const bool ok = thread_wait(p, r, kWaitDispatch, [&] {
        v = ld_relaxed_sys(f);
        return static_cast<u32>(v >> 32) == seq;
    }, spent);
    if (owner && ok) add_wait(p, r, spent);
    return ok && !gone ? flag_count(p, v) : 0;
}

// Source r's count of messages for local expert j, after wait_sources (0 when r is masked or timed
// out, or its flag is not this call's).
PYEP_DEVICE int arrived_count(const LLParams& p, int j, int r, u32 seq) {
    if (masked(p, r)) return 0;
    const u64 v = ld_relaxed_sys(reinterpret_cast<const u64*>(local(p) + p.off_dflags) + j * p.num_ranks + r);
    return static_cast<u32>(v >> 32) == seq ? flag_count(p, v) : 0;
}

// What the receive records of pair (local expert j, source s) once its count n and its first row
// begin among j's rows are known: layout_range, and with the last source j's count and statistics.
PYEP_DEVICE void record_pair(const LLParams& p, int j, int s, i64 begin, i64 n) {
    reinterpret_cast<i64*>(p.layout_range)[j * p.num_ranks + s] = begin << 32 | n;
    if (s == p.num_ranks - 1) {
        reinterpret_cast<i32*>(p.count)[j] = static_cast<i32>(begin + n);
        if (p.cum_stats != 0) atomicAdd(reinterpret_cast<i32*>(p.cum_stats) + j, static_cast<i32>(begin + n));
    }
}

PYEP_DEVICE const int* message_header(const LLParams& p, int i) {
    return reinterpret_cast<const int*>(local(p) + p.off_heads + static_cast<u64>(i) * p.msg_header);
}

// Message i's first 16 header bytes (seq, token, entries, the first entry).
PYEP_DEVICE int4 message_head(const LLParams& p, int i) { return ld_ring(reinterpret_cast<const int4*>(message_header(p, i))); }

// A message's entries when its header (h: message_head) is this call's (else 0), at most what its header holds.
PYEP_DEVICE int message_entries(const LLParams& p, int4 h, u32 seq) {
    if (static_cast<u32>(h.x) != seq || h.z < 0) return 0;
    const int room = static_cast<int>(p.msg_header / 4) - kHeadWords, most = room < kTopk ? room : kTopk;
    return h.z < most ? h.z : most;
}

// Moves n items' bodies, kRowUnroll vectors in flight a thread: item k's body (at s_body[k]) into row
// s_row[k] of recv_x (of all experts' rows; -1: none), its scales (four a vector) into their
// column-major places.
PYEP_DEVICE void move_bodies(const LLParams& p, int n, const i64* s_row, const u64* s_body) {
    const i64 RM = static_cast<i64>(p.num_ranks) * p.max_tokens;
    const int total = n * kBodyVecs;
    for (int q0 = static_cast<int>(threadIdx.x); q0 < total; q0 += kThreads * kRowUnroll) {
        int4 v[kRowUnroll];
#pragma unroll
        for (int u = 0; u < kRowUnroll; u++) {
            const int q = q0 + u * kThreads;
            if (q >= total) break;
            if (s_row[q / kBodyVecs] >= 0) v[u] = ld_ring(reinterpret_cast<const int4*>(s_body[q / kBodyVecs]) + q % kBodyVecs);
        }
#pragma unroll
        for (int u = 0; u < kRowUnroll; u++) {
            const int q = q0 + u * kThreads;
            if (q >= total) break;
            const i64 row = s_row[q / kBodyVecs];
            if (row < 0) continue;
            const int w = q % kBodyVecs;
            if (w < kRowBytes / 16) {
                st_na(reinterpret_cast<int4*>(reinterpret_cast<u8*>(p.recv_x) + row * kRowBytes) + w, v[u]);
                continue;
            }
            // Scales 4c .. 4c + 3 (those < kScales); column-major: column c of expert j at (j * cols + c) * RM.
            const int c = w - kRowBytes / 16;
            const u32 f[4] = {static_cast<u32>(v[u].x), static_cast<u32>(v[u].y), static_cast<u32>(v[u].z), static_cast<u32>(v[u].w)};
            const i64 j = row / RM, r = row - j * RM;
            if (kUE8M0) {
                u32 word = 0;
#pragma unroll
                for (int b = 0; b < 4; b++)
                    if (4 * c + b < kScales) word |= ((f[b] >> 23) & 0xffu) << (8 * b);
                st_na(reinterpret_cast<int*>(p.recv_scales) + (j * kScaleVecs + c) * RM + r, static_cast<int>(word));
            } else {
#pragma unroll
                for (int b = 0; b < 4; b++)
                    if (4 * c + b < kScales) st_na(reinterpret_cast<int*>(p.recv_scales) + (j * kScales + 4 * c + b) * RM + r, static_cast<int>(f[b]));
            }
        }
    }
}

// Moves items [k0, k1) (block-uniform; every thread calls it), kRowsRound located at once: item k is
// entry e of message i (locate(k, i, e)), and place(j, s, slot) is the row of recv_x (of all experts'
// rows) of pair (j, s)'s slot, or -1 where the entry names no row of this call (a source that timed out).
template <typename Locate, typename Place>
PYEP_DEVICE void move_items(const LLParams& p, int k0, int k1, Locate locate, Place place) {
    PYEP_SHARED(i64, s_row, kRowsRound);  // the round's items: their rows (-1: none),
    PYEP_SHARED(u64, s_body, kRowsRound);  // and their messages' bodies
    const int tid = static_cast<int>(threadIdx.x), M = p.max_tokens, L = p.num_experts / p.num_ranks;
    for (; k0 < k1; k0 += kRowsRound) {
        const int n = k1 - k0 < kRowsRound ? k1 - k0 : kRowsRound;
        if (tid < n) {
            int i, e;
            locate(k0 + tid, i, e);
            const int* h = message_header(p, i);
            const int token = ld_ring(h + 1), entry = ld_ring(h + kHeadWords + e);
            const int j = entry / M, slot = entry % M;
            const i64 row = entry >= 0 && j < L ? place(j, i / M, slot) : -1;
            s_row[tid] = row;
            s_body[tid] = reinterpret_cast<u64>(local(p) + p.off_recv + static_cast<u64>(i) * kBodyBytes);
            if (row >= 0) st_na(reinterpret_cast<int*>(p.src_info) + row, token);
        }
        __syncthreads();
        move_bodies(p, n, s_row, s_body);
        __syncthreads();  // the round's readers are done with s_row, s_body
    }
}

// Receive, rows balanced over the blocks (when a block can hold every pair's count and every
// message's entries): every block waits for the sources, then reads the counts of all pairs (local
// expert j, source s), j-major (a thread a pair; pair c's owner, block c % G, records the pair) with
// its first messages' headers in flight, takes the pairs' prefix sums, then those of the messages'
// entries, and moves an equal share of the items: its [N b / G, N (b + 1) / G) of the N, each item's
// message found by a binary search over the sums. A block's time is then its share, not the units it
// was dealt (whose rows vary with the routing).
PYEP_DEVICE void dispatch_recv_balanced(const LLParams& p, u32 seq, u32 dseq) {
    PYEP_SHARED(i32, s_warp, kWarps + 1);
    const int R = p.num_ranks, L = p.num_experts / R, NP = L * R, NM = R * p.max_tokens, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x), b = static_cast<int>(blockIdx.x);
    const i64 RM = static_cast<i64>(R) * p.max_tokens;
    i32* s_first = reinterpret_cast<i32*>(dispatch_arena());  // pair c's first row among all received; [NP] = rows
    i32* s_mfirst = s_first + NP + 1;                           // message i's first item; [NM] = items
    PYEP_LL_STAMP_START(p, PYEP_LL_DR_START, PYEP_LL_DR_DONE);
    // The counts beside the done words (when the block has a thread for each pair and each source):
    // the flags come early in the sources' sends, their done words last, so the counts' prefix sums
    // are taken while the messages still arrive; threads kThreads - 1 - r wait for the done words,
    // and the sums' barriers order every later read after them. Otherwise the done words first.
    // A source lost in that wait (masked or timed out) counts nothing: the sums are taken again.
    const bool beside = kCountsBeside && NP + R <= kThreads;  // block-uniform
    const bool lost = beside && tid >= kThreads - R && !await_source(p, kThreads - 1 - tid, dseq);
    if (!beside) wait_sources(p, dseq);
    auto sum_counts = [&](bool early) {
        int carry = 0;
        for (int c0 = 0; c0 < NP; c0 += kThreads) {  // block-uniform
            const int c = c0 + tid;
            const int n = c >= NP ? 0 : early ? await_count(p, c / R, c % R, seq, c % G == b) : arrived_count(p, c / R, c % R, seq);
            int total;
            const int before = block_exclusive_sum(n, s_warp, total);
            if (c < NP) s_first[c] = carry + before;
            carry += total;
        }
        return carry;
    };
    int carry = sum_counts(beside);
    if (beside && __syncthreads_or(lost)) carry = sum_counts(false);
    if (tid == 0) s_first[NP] = carry;
    const int4 head0 = tid < NM ? message_head(p, tid) : int4{};  // after the done words
    __syncthreads();
    PYEP_LL_STAMP(p, PYEP_LL_DR_FLAGS);
    for (int c = b + tid * G; c < NP; c += kThreads * G) {
        const int j = c / R;
        record_pair(p, j, c % R, s_first[c] - s_first[j * R], s_first[c + 1] - s_first[c]);
    }
    carry = 0;
    for (int i0 = 0; i0 < NM; i0 += kThreads) {  // block-uniform
        const int i = i0 + tid;
        int total;
        const int before = block_exclusive_sum(i < NM ? message_entries(p, i0 == 0 ? head0 : message_head(p, i), seq) : 0, s_warp, total);
        if (i < NM) s_mfirst[i] = carry + before;
        carry += total;
    }
    if (tid == 0) s_mfirst[NM] = carry;
    __syncthreads();
    PYEP_LL_STAMP(p, PYEP_LL_DR_SCANNED);
    const int N = carry;
    move_items(
        p, static_cast<int>(static_cast<i64>(N) * b / G), static_cast<int>(static_cast<i64>(N) * (b + 1) / G),
        [&](int k, int& i, int& e) {
            i = unit_of(s_mfirst, NM, k);
            e = k - s_mfirst[i];
        },
        [&](int j, int s, int slot) -> i64 {
            const int c = j * R + s;
            return slot < s_first[c + 1] - s_first[c] ? j * RM + (s_first[c] - s_first[j * R]) + slot : -1;
        });
    PYEP_LL_STAMP(p, PYEP_LL_DR_COPIED);
}

// Receive in rounds (more pairs or messages than a block holds the sums of): every block waits for
// the sources but keeps no count; a pair's owner (block c % G) records it, and a row's place sums its
// sources' counts from the flags. Block b takes the messages in rounds of
// kRowsRound, rounds b, b + G, ...: the round's entries' prefix sums, then its items.
PYEP_DEVICE void dispatch_recv_rounds(const LLParams& p, u32 seq, u32 dseq) {
    PYEP_SHARED(i32, s_efirst, kRowsRound + 1);  // the round's message i0 + m's first item; [n] = items
    PYEP_SHARED(i32, s_warp, kWarps + 1);
    const int R = p.num_ranks, L = p.num_experts / R, NP = L * R, NM = R * p.max_tokens, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x), b = static_cast<int>(blockIdx.x);
    const i64 RM = static_cast<i64>(R) * p.max_tokens;
    PYEP_LL_STAMP_START(p, PYEP_LL_DR_START, PYEP_LL_DR_DONE);
    wait_sources(p, dseq);
    PYEP_LL_STAMP(p, PYEP_LL_DR_FLAGS);
    auto begin = [&](int j, int s) {
        int n = 0;
        for (int r = 0; r < s; r++) n += arrived_count(p, j, r, seq);
        return n;
    };
    for (int c = b + tid * G; c < NP; c += kThreads * G) record_pair(p, c / R, c % R, begin(c / R, c % R), arrived_count(p, c / R, c % R, seq));
    if (b * kRowsRound >= NM) PYEP_LL_STAMP(p, PYEP_LL_DR_SCANNED);  // no round
    for (int i0 = b * kRowsRound; i0 < NM; i0 += G * kRowsRound) {
        const int n = NM - i0 < kRowsRound ? NM - i0 : kRowsRound;
        int total;
        const int before = block_exclusive_sum(tid < n ? message_entries(p, message_head(p, i0 + tid), seq) : 0, s_warp, total);
        if (tid < n) s_efirst[tid] = before;
        if (tid == 0) s_efirst[n] = total;
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_DR_SCANNED);
        move_items(
            p, 0, total,
            [&](int k, int& i, int& e) {
                const int m = unit_of(s_efirst, n, k);
                i = i0 + m, e = k - s_efirst[m];
            },
            [&](int j, int s, int slot) -> i64 { return slot < arrived_count(p, j, s, seq) ? j * RM + begin(j, s) + slot : -1; });
    }
    PYEP_LL_STAMP(p, PYEP_LL_DR_COPIED);
}

static_assert(kRowsRound <= kThreads, "a round's items are located a thread each");

PYEP_DEVICE void dispatch_recv(const LLParams& p, u32 seq, u32 dseq) {
    if (p.num_experts <= kPairsShared && p.num_ranks * p.max_tokens <= kMsgsShared)  // L * R pairs, R * M messages
        dispatch_recv_balanced(p, seq, dseq);
    else
        dispatch_recv_rounds(p, seq, dseq);
}
