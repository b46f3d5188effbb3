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
//     read of the receive before it) writes ack[h][me] = seq into every unmasked peer's header.
//     A call on h is never the next kernel after the receive of the one before on h: the other
//     half's call comes between. Nothing is ever zeroed between calls.
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

// Where the phases below split their work: a unit is a token (dispatch send) or an (expert, rank)
// pair (dispatch receive, combine send); block b takes units b, b + G, b + 2G, ... (G blocks), up
// to kBatch of them at once: the batch's waits are settled together first (warp 0, a lane a unit
// or a (unit, source) item; the dispatch send, a thread a selection), then the whole block moves
// the rows of every unit of the batch as one list, so that a block's units cost about one memory
// round trip together rather than one each.
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

// Which unit of a batch item k belongs to, given each unit's first item (first[0] = 0,
// nondecreasing, first[P] the total).
PYEP_DEVICE int unit_of(const i32* first, int P, int k) {
    int i = 0;
    while (i + 1 < P && first[i + 1] <= k) i++;
    return i;
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

// The pair of row k: the last of the NP pairs whose first row (first[c], nondecreasing) is <= k.
PYEP_DEVICE int pair_of_row(const i32* first, int NP, int k) {
    int lo = 0, hi = NP - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= k) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

#if defined(PYEP_LL_DISPATCH)

constexpr bool kFP8 = PYEP_LL_FP8 != 0;
constexpr bool kRound = PYEP_LL_ROUND != 0;
constexpr int kMsgHeader = 16;  // a message: int32 source token, 3 reserved, the row, its scales
constexpr int kCastBatch = 8;   // chunks a warp has in flight when it casts or packs messages
constexpr bool kUE8M0 = PYEP_LL_UE8M0 != 0;
constexpr int kScales = kHidden / kScaleBlock;

// The one step that writes a piece of a message into a destination slot (this rank's or a peer's,
// reached through p.peers): the v at byte off of the message at slot.
template <typename V>
PYEP_DEVICE void put_piece(u64 slot, int off, V v) {
    st_na(reinterpret_cast<V*>(reinterpret_cast<u8*>(slot) + off), v);
}

// One warp casts its items it0, it0 + stride, ... (kCastBatch of them, those < total) once each
// and writes each into every slot of its token: locate(it, tok, ch, slots) says that item it is
// chunk ch of token tok, whose message goes to slots[0..kTopk) (0: none). Lane l moves channels
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
                if (ch[b] == 0 && lane == 0) put_piece(slot, 0, static_cast<int>(tok[b]));
                if (on) put_piece(slot, kMsgHeader + 2 * c, in[b]);
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
            if (ch[b] == 0 && lane == 0) put_piece(slot, 0, static_cast<int>(tok[b]));
            put_piece(slot, kMsgHeader + c, packed);
            if (lane % 16 == 0) put_piece(slot, kMsgHeader + kHidden + 4 * (c / kScaleBlock), static_cast<int>(__float_as_uint(inv)));
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

// Send: a unit is a token. For a batch of its tokens, the block settles every selection (expert g
// of token t, once however often t selected g): its slot at g's rank is the number of tokens
// before t that selected g (so that receivers get g's rows in token order, as the reference
// does), and whether g's rank may be written. Then the warps cast each chunk of every token once
// and write it into all of the token's slots; after a barrier, every selection counts itself in
// g's counter (p.expert_sent), and the selection that completes g's count (every block knows how
// many tokens selected g) stores g's flag seq << 32 | count. Experts that no token selected get
// their flag (count 0) from block g % G, which asks for its experts (kOwn a batch) in the same
// counting pass as its tokens' selections. A selection whose rank is remote is not written there:
// the token's message is cast once into this rank's send area (message t), and after the barrier
// a warp puts it from there into the slot, before any count (a barrier again); its flag is a signal.
constexpr int kSel = kBatch * kTopk;  // selections of a batch
constexpr int kOwn = 16;              // experts a block asks about for their zero flags, a batch
PYEP_DEVICE void dispatch_send(const LLParams& p, u32 seq) {
    // Queries [0, S) are the batch's selections, [S, S + own) the experts the block flags when no token selected them.
    PYEP_SHARED(i32, s_g, kSel + kOwn);       // query q's expert, or -1 (none, or a repeat)
    PYEP_SHARED(i32, s_t, kSel + kOwn);       // selection q's token
    PYEP_SHARED(i32, s_before, kSel + kOwn);  // tokens before q's that selected its expert
    PYEP_SHARED(i32, s_total, kSel + kOwn);   // tokens that selected q's expert
    PYEP_SHARED(u64, s_slot, kSel);           // selection q's slot at its rank (0: not written), or the staged message
    PYEP_SHARED(u64, s_rslot, kSel);          // selection q's slot at its rank when that is remote (0: none)
    const int warp = static_cast<int>(threadIdx.x) / 32, tid = static_cast<int>(threadIdx.x), R = p.num_ranks,
              E = p.num_experts, L = E / R, T = p.num_tokens, G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    i32* sent = reinterpret_cast<i32*>(p.expert_sent);
    auto flag = [&](int g) { return reinterpret_cast<u64*>(region(p, g / L) + p.off_dflags) + (g % L) * R + p.rank; };
    u8* staged = local(p) + p.off_send;  // remote ranks' messages, by token
    const int owned = b < E ? (E - b + G - 1) / G : 0;  // experts b, b + G, ...
    PYEP_LL_STAMP_START(p, PYEP_LL_DS_START, PYEP_LL_DS_FLAGGED);
    PYEP_SHARED(u32, s_marks, kMarkWords);
    const int W = (T + 31) / 32;
    const bool marked = E * W <= kMarkWords;  // block-uniform
    if (marked && (b < T || owned > 0)) mark_selections(p, s_marks, W);
    for (int u0 = b, asked = 0; u0 < T || asked < owned; u0 += kBatch * G) {
        const int P = u0 < T ? batch_units(u0, T) : 0, S = P * kTopk;
        const int own = owned - asked < kOwn ? owned - asked : kOwn;
        __syncthreads();  // the previous batch's readers are done with the shared arrays
        // A thread a token: its selections' loads all in flight, repeats found in registers.
        for (int i = tid; i < P; i += kThreads) {
            const int t = u0 + i * G;
            i64 e[kTopk];
#pragma unroll
            for (int k = 0; k < kTopk; k++) e[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
            for (int k = 0; k < kTopk; k++) {
                bool first = e[k] >= 0 && e[k] < E;
#pragma unroll
                for (int k2 = 0; k2 < k; k2++) first = first && e[k2] != e[k];
                const int s = i * kTopk + k;
                s_g[s] = first ? static_cast<i32>(e[k]) : -1;
                s_t[s] = t, s_before[s] = 0, s_total[s] = 0;
            }
        }
        for (int q = tid; q < own; q += kThreads) s_g[S + q] = b + (asked + q) * G, s_t[S + q] = 0, s_before[S + q] = 0, s_total[S + q] = 0;
        __syncthreads();
        // A thread a selection: whether its rank may be written (acknowledgements awaited side by side).
        for (int s = tid; s < S; s += kThreads) s_slot[s] = s_g[s] >= 0 && may_send(p, s_g[s] / L, seq) ? 1 : 0;
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_DS_SETTLED);
        if (marked)
            count_marked(s_marks, W, s_g, s_t, S + own, s_before, s_total);
        else
            count_selections(p, s_g, s_t, S + own, s_before, s_total);
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_DS_COUNTED);
        for (int q = tid; q < own; q += kThreads) {
            const int g = s_g[S + q];
            if (s_total[S + q] == 0 && may_send(p, g / L, seq)) signal_peer(p, g / L, flag(g), static_cast<u64>(seq) << 32);
        }
        asked += own;
        if (P == 0) {  // block-uniform
            PYEP_LL_STAMPS_AT_ONCE(p, PYEP_LL_DS_SLOTS, PYEP_LL_DS_FLAGGED);  // a round with no token writes nothing
            continue;
        }
        for (int s = tid; s < S; s += kThreads) {
            if (kRemote) s_rslot[s] = 0;
            if (s_slot[s] != 0) {
                const int g = s_g[s];
                const u64 slot = reinterpret_cast<u64>(region(p, g / L) + p.off_recv +
                                                       ((static_cast<u64>(g % L) * R + p.rank) * p.max_tokens + s_before[s]) * p.msg_bytes);
                const bool rem = is_remote(p, g / L);
                s_slot[s] = rem ? 0 : slot;
                if (rem) s_rslot[s] = slot;
            }
        }
        __syncthreads();
        if (kRemote) {
            // A token with remote selections has its message cast once into the send area (in its first such slot).
            for (int i = tid; i < P; i += kThreads)
                for (int k = 0; k < kTopk; k++)
                    if (s_rslot[i * kTopk + k] != 0) {
                        s_slot[i * kTopk + k] = reinterpret_cast<u64>(staged + static_cast<u64>(u0 + i * G) * p.msg_bytes);
                        break;
                    }
            __syncthreads();
        }
        PYEP_LL_STAMP(p, PYEP_LL_DS_SLOTS);
        // Item it is chunk it % kChunks of the batch's token it / kChunks; warp w takes items w, w + kWarps, ...
        const int total = P * kChunks;
        for (int it0 = warp; it0 < total; it0 += kWarps * kCastBatch)
            put_chunks(p, it0, kWarps, total, [&](int it, i32& tok, int& ch, const u64*& slots) {
                const int i = it / kChunks;
                ch = it % kChunks;
                tok = u0 + i * G;
                slots = s_slot + i * kTopk;
            });
        PYEP_LL_STAMP(p, PYEP_LL_DS_CAST);
        __syncthreads();  // the block's messages are written
        PYEP_LL_STAMP(p, PYEP_LL_DS_WRITTEN);
        PYEP_LL_STAMP(p, PYEP_LL_DS_FENCED);  // in case thread 0 has no selection to count
        if (kRemote) {
            for (int s = warp; s < S; s += kWarps)
                if (s_rslot[s] != 0)  // warp-uniform
                    put_peer(s_g[s] / L, reinterpret_cast<void*>(s_rslot[s]), staged + static_cast<u64>(s_t[s]) * p.msg_bytes,
                             p.msg_bytes);
            __syncthreads();  // every put of the block is issued before any of its counts
        }
        for (int s = tid; s < S; s += kThreads) {
            const int g = s_g[s];
            if (g < 0) continue;
            fence_acq_rel_sys();  // the block's messages (ordered before this by the barrier) before the count
            if (s == tid) PYEP_LL_STAMP(p, PYEP_LL_DS_FENCED);
            if (atomicAdd(sent + g, 1) + 1 != s_total[s]) continue;
            // The last of g's selections: every block's messages for g are ordered before this.
            fence_acq_rel_sys();
            st_volatile(sent + g, 0);  // for the next call (a later kernel)
            if (!masked(p, g / L))
                signal_peer<true>(p, g / L, flag(g), static_cast<u64>(seq) << 32 | static_cast<u32>(s_total[s]));
        }
        PYEP_LL_STAMP(p, PYEP_LL_DS_FLAGGED);
    }
    if (b >= T && owned == 0) PYEP_LL_STAMPS_AT_ONCE(p, PYEP_LL_DS_SETTLED, PYEP_LL_DS_FLAGGED);  // a block with nothing to do
}

// Receive: a unit is a pair (local expert j, source s); its rows follow those of the sources before
// s. For a batch of pairs, warp 0 waits for the flags (a lane a (pair, source) item), then the
// block reads every pair's messages as one list of 16-byte vectors (header, row, scales; a thread
// kRowUnroll in flight) and stores each where it goes: the source token into src_info, the row
// into recv_x, the scales (four a vector) into their column-major places.
constexpr int kRowBytes = kFP8 ? kHidden : 2 * kHidden;
constexpr int kScaleVecs = kFP8 ? (kScales + 3) / 4 : 0;                // 16-byte vectors of a message's scales
constexpr int kMsgVecs = kMsgHeader / 16 + kRowBytes / 16 + kScaleVecs;  // the vectors of a message that are read
static_assert(kMsgHeader == 16, "a message's header is one vector");
// Moves the vectors of `rows` messages, kRowUnroll in flight a thread: locate(k, j, row, msg) says
// that message k (of this block's list) is for local expert j, goes to row `row` of recv_x (of all
// experts' rows) and is at msg in this rank's receive area.
template <typename Locate>
PYEP_DEVICE void move_messages(const LLParams& p, int rows, Locate locate) {
    const i64 RM = static_cast<i64>(p.num_ranks) * p.max_tokens;
    const int total = rows * kMsgVecs;
    for (int q0 = static_cast<int>(threadIdx.x); q0 < total; q0 += kThreads * kRowUnroll) {
        int4 v[kRowUnroll];
        i64 row[kRowUnroll];  // the message's row in recv_x (of all experts' rows)
        int j[kRowUnroll];
#pragma unroll
        for (int u = 0; u < kRowUnroll; u++) {
            const int q = q0 + u * kThreads;
            if (q >= total) break;
            const u8* msg;
            locate(q / kMsgVecs, j[u], row[u], msg);
            v[u] = ld_ring(reinterpret_cast<const int4*>(msg) + q % kMsgVecs);
        }
#pragma unroll
        for (int u = 0; u < kRowUnroll; u++) {
            const int q = q0 + u * kThreads;
            if (q >= total) break;
            const int w = q % kMsgVecs - 1;  // the vector's place after the header
            if (w < 0) {
                st_na(reinterpret_cast<int*>(p.src_info) + row[u], v[u].x);
            } else if (w < kRowBytes / 16) {
                st_na(reinterpret_cast<int4*>(reinterpret_cast<u8*>(p.recv_x) + row[u] * kRowBytes) + w, v[u]);
            } else {
                // Scales 4c .. 4c + 3 (those < kScales); column-major: column c of expert j at (j * cols + c) * RM.
                const int c = w - kRowBytes / 16;
                const u32 f[4] = {static_cast<u32>(v[u].x), static_cast<u32>(v[u].y), static_cast<u32>(v[u].z), static_cast<u32>(v[u].w)};
                const i64 r = row[u] - static_cast<i64>(j[u]) * RM;
                if (kUE8M0) {
                    u32 word = 0;
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        if (4 * c + b < kScales) word |= ((f[b] >> 23) & 0xffu) << (8 * b);
                    st_na(reinterpret_cast<int*>(p.recv_scales) + (static_cast<i64>(j[u]) * kScaleVecs + c) * RM + r, static_cast<int>(word));
                } else {
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        if (4 * c + b < kScales)
                            st_na(reinterpret_cast<int*>(p.recv_scales) + (static_cast<i64>(j[u]) * kScales + 4 * c + b) * RM + r,
                                  static_cast<int>(f[b]));
                }
            }
        }
    }
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

// Source r's count of messages for local expert j, once its flag for this call arrived (0 when r
// is masked or timed out); charge: whether this thread adds the wait to r's statistics.
PYEP_DEVICE int source_count(const LLParams& p, int j, int r, u32 seq, bool charge) {
    if (masked(p, r)) return 0;
    const u64* f = reinterpret_cast<const u64*>(local(p) + p.off_dflags) + j * p.num_ranks + r;
    u64 v = 0, spent;
    const bool ok = thread_wait(p, r, kWaitDispatch, [&] { return static_cast<u32>((v = ld_acquire_sys(f)) >> 32) == seq; }, spent);
    if (charge && p.wait_stats != 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + r, static_cast<unsigned long long>(spent));
    const int n = ok ? static_cast<int>(static_cast<u32>(v)) : 0;
    return n < p.max_tokens ? n : p.max_tokens;
}

// Receive, rows balanced over the blocks (when a block can hold every pair's count): every block
// reads the counts of all pairs (local expert j, source s), j-major (a thread a pair; pair c's
// owner, block c % G, charges the waits and records the pair), takes their prefix sums, and moves
// an equal share of the rows: its rows [N b / G, N (b + 1) / G) of the N received, kRowsRound a
// round, each row's pair found by a binary search over the prefix sums. A block's time is then
// its share, not the pairs it was dealt (whose rows vary with the routing).
PYEP_DEVICE void dispatch_recv_balanced(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_first, kPairsShared + 1);  // pair c's first row among all received; [NP] = N
    PYEP_SHARED(i32, s_warp, kWarps + 1);
    PYEP_SHARED(i32, s_pair, kRowsRound);  // the pair of each row of the round
    const int R = p.num_ranks, L = p.num_experts / R, NP = L * R, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x), b = static_cast<int>(blockIdx.x);
    const i64 RM = static_cast<i64>(R) * p.max_tokens;
    const u8* recv = local(p) + p.off_recv;
    PYEP_LL_STAMP_START(p, PYEP_LL_DR_START, PYEP_LL_DR_DONE);
    int carry = 0;
    for (int c0 = 0; c0 < NP; c0 += kThreads) {  // block-uniform
        const int c = c0 + tid;
        const int n = c < NP ? source_count(p, c / R, c % R, seq, c % G == b) : 0;
        int total;
        const int before = block_exclusive_sum(n, s_warp, total);
        if (c < NP) s_first[c] = carry + before;
        carry += total;
    }
    if (tid == 0) s_first[NP] = carry;
    __syncthreads();
    PYEP_LL_STAMP(p, PYEP_LL_DR_FLAGS);
    for (int c = b + tid * G; c < NP; c += kThreads * G) {
        const int j = c / R;
        record_pair(p, j, c % R, s_first[c] - s_first[j * R], s_first[c + 1] - s_first[c]);
    }
    const int N = carry;
    const int r0 = static_cast<int>(static_cast<i64>(N) * b / G), r1 = static_cast<int>(static_cast<i64>(N) * (b + 1) / G);
    for (int k0 = r0; k0 < r1; k0 += kRowsRound) {
        const int rows = r1 - k0 < kRowsRound ? r1 - k0 : kRowsRound;
        if (tid < rows) s_pair[tid] = pair_of_row(s_first, NP, k0 + tid);
        __syncthreads();
        move_messages(p, rows, [&](int k, int& j, i64& row, const u8*& msg) {
            const int c = s_pair[k], i = k0 + k - s_first[c];
            j = c / R;
            row = j * RM + (s_first[c] - s_first[j * R]) + i;
            msg = recv + (static_cast<u64>(c) * p.max_tokens + i) * p.msg_bytes;
        });
        __syncthreads();  // the round's readers are done with s_pair
    }
    PYEP_LL_STAMP(p, PYEP_LL_DR_COPIED);
}

PYEP_DEVICE void dispatch_recv(const LLParams& p, u32 seq) {
    if (p.num_experts <= kPairsShared) {  // L * R pairs
        dispatch_recv_balanced(p, seq);
        return;
    }
    PYEP_SHARED(i32, s_begin, kBatch);  // pair i's first row in j's rows
    PYEP_SHARED(i32, s_n, kBatch);      // pair i's rows
    PYEP_SHARED(i32, s_row, kBatch + 1);
    const int lane = lane_id(), R = p.num_ranks, L = p.num_experts / R, M = p.max_tokens, G = static_cast<int>(gridDim.x);
    const int tid = static_cast<int>(threadIdx.x);
    const i64 RM = static_cast<i64>(R) * M;
    const u8* recv = local(p) + p.off_recv;
    PYEP_LL_STAMP_START(p, PYEP_LL_DR_START, PYEP_LL_DR_DONE);
    for (int u0 = static_cast<int>(blockIdx.x); u0 < L * R; u0 += kBatch * G) {
        const int P = batch_units(u0, L * R);
        __syncthreads();  // the previous batch's readers are done with the shared arrays
        if (tid < P) s_begin[tid] = 0, s_n[tid] = 0;
        __syncthreads();
        if (tid < 32) {
            // Item c: source r's count for pair i; a source's wait is charged to it.
            for (int c = lane; c < P * R; c += 32) {
                const int i = c / R, r = c % R, pair = u0 + i * G, s = pair % R;
                if (r > s) continue;
                const int n = source_count(p, pair / R, r, seq, r == s);
                if (r < s) atomicAdd(s_begin + i, n);
                else s_n[i] = n;
            }
            warp0_prefix(s_n, s_row, P, 1);
        }
        __syncthreads();
        PYEP_LL_STAMP(p, PYEP_LL_DR_FLAGS);
        move_messages(p, s_row[P], [&](int k, int& j, i64& row, const u8*& msg) {
            const int i = unit_of(s_row, P, k), pair = u0 + i * G;
            j = pair / R;
            row = j * RM + s_begin[i] + (k - s_row[i]);
            msg = recv + ((static_cast<u64>(j) * R + pair % R) * M + (k - s_row[i])) * p.msg_bytes;
        });
        if (tid < P) {
            const int pair = u0 + tid * G;
            record_pair(p, pair / R, pair % R, s_begin[tid], s_n[tid]);
        }
        PYEP_LL_STAMP(p, PYEP_LL_DR_COPIED);
    }
}

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
            const int k = k0 + tid, c = pair_of_row(s_cfirst, NP, k), j = c / R, d = c % R;
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
    const int c_lo = r0 < r1 ? pair_of_row(s_cfirst, NP, r0) : NP;
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
