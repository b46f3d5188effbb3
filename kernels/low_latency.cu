// Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine) over NVLink: every
// rank's low-latency region is mapped by every peer (CUDA IPC, or the same GPU), and a kernel
// writes straight into the peers' slots through the per-peer pointer table p.peers. The region's
// layout is goep/lowlatency's (layout.go); the offsets come in the parameters, so this file
// holds no layout arithmetic beyond a slot's index.
//
// Protocol, per half h (calls alternate halves; the host picks h):
//   - calls[h] (the engine's device memory, local) counts the calls on half h that this rank has
//     received. A call's seq is calls[h] + 1: every rank makes the same calls, so the ranks agree
//     on it without the host passing it, which keeps a captured CUDA graph correct on replay.
//   - A sender first waits until the receiver acknowledged the previous call on h
//     (ack[h][dst] >= seq - 1 in the sender's own header), then writes its rows, then the flag
//     word seq << 32 | count with release semantics (system scope: peers read it over NVLink).
//   - A receiver waits for flag == seq of every unmasked source, reads the rows, and when the
//     whole grid has read (the last block to finish counts it), writes ack[h][me] = seq into
//     every unmasked peer's header and sets calls[h] = seq. Nothing is ever zeroed between calls.
// phases: bit 0 the send half, bit 1 the receive half (return_recv_hook launches them apart).
//
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8 PYEP_LL_FP8=1 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=2048 PYEP_LL_TOPK=6 PYEP_LL_FP8=1 PYEP_LL_ROUND=1 PYEP_LL_UE8M0=1
// pyep:defines PYEP_LL_DISPATCH PYEP_LL_HIDDEN=384 PYEP_LL_TOPK=11 PYEP_LL_FP8=0 PYEP_LL_ROUND=0 PYEP_LL_UE8M0=0
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=7168 PYEP_LL_TOPK=8
// pyep:defines PYEP_LL_COMBINE PYEP_LL_HIDDEN=128 PYEP_LL_TOPK=1
#ifdef PYEP_EMU
#include <cmath>

#include "emu.h"
#else
#include "utils.cuh"
#endif
#include "copy.cuh"

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
constexpr bool kFP8 = PYEP_LL_FP8 != 0;
constexpr bool kRound = PYEP_LL_ROUND != 0;
constexpr int kThreads = PYEP_LL_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kScaleBlock = 128;
constexpr int kMsgHeader = 16;  // int32 source token, 3 reserved
static_assert(kHidden % kScaleBlock == 0 && kThreads % 32 == 0, "hidden is whole scale blocks");

enum : int { kPhaseSend = 1, kPhaseRecv = 2 };
// What a recorded wait was for (ErrorRecord.what); the host names it.
enum : int { kWaitAck = 1, kWaitDispatch = 2, kWaitCombine = 3 };

// The launch parameters and the error record (host-mapped) are params.h's, which the host
// includes too.
typedef struct pyep_ll_params LLParams;
typedef struct pyep_ll_error LLError;

PYEP_DEVICE u8* region(const LLParams& p, int r) { return reinterpret_cast<u8*>(reinterpret_cast<const u64*>(p.peers)[r]); }
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

// The end of a receive: once every block has finished, the last acknowledges the call to the
// unmasked peers and counts it received.
PYEP_DEVICE void finish_recv(const LLParams& p, u32 seq) {
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        i32* counter = reinterpret_cast<i32*>(p.counter);
        if (atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1) {
            for (int r = 0; r < p.num_ranks; r++)
                if (r != p.rank && !masked(p, r))
                    st_release_sys(reinterpret_cast<u64*>(region(p, r) + p.off_ack) + p.half * p.num_ranks + p.rank,
                                   static_cast<u64>(seq));
            st_volatile(counter, 0);
            st_release_sys(reinterpret_cast<u64*>(p.calls) + p.half, static_cast<u64>(seq));
        }
    }
}

// A kernel: its call's send phase, its receive phase, or both, as p.phases says.
template <typename Send, typename Recv>
PYEP_DEVICE void run_phases(const LLParams& p, Send send, Recv recv) {
    const u32 seq = call_seq(p);
    if (p.phases & kPhaseSend) send(p, seq);
    if (p.phases & kPhaseRecv) {
        recv(p, seq);
        finish_recv(p, seq);
    }
}

// ---- number conversions, bit for bit those of goep/lowlatency (cast.go) ---------------------

PYEP_DEVICE float mul_rn(float a, float b) {
#ifdef PYEP_EMU
    volatile float r = a * b;
    return r;
#else
    return __fmul_rn(a, b);
#endif
}

#ifdef PYEP_EMU
// e4m3, rounding to nearest even and saturating at 448: the GPU's cvt.rn.satfinite.e4m3x2 (utils.cuh),
// which the emulator has not.
PYEP_DEVICE u8 to_e4m3(float f) {
    const u32 b = __float_as_uint(f), u = b & 0x7fffffffu;
    const u8 sign = static_cast<u8>((b >> 24) & 0x80u);
    if (u > 0x7f800000u) return sign | 0x7f;
    if (u >= 0x43e00000u) return sign | 0x7e;  // >= 448: saturate
    if (u < (121u << 23)) {                    // e4m3 subnormal: steps of 2^-9
        const float s = __uint_as_float(u) * 512.0f;
        u32 i = static_cast<u32>(s);
        const float fr = s - static_cast<float>(i);
        if (fr > 0.5f || (fr == 0.5f && (i & 1u))) i++;
        return sign | static_cast<u8>(i);
    }
    u32 v = (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);
    const u32 rest = u & ((1u << 20) - 1u);
    if (rest > (1u << 19) || (rest == (1u << 19) && (v & 1u))) v++;
    return sign | static_cast<u8>(v);
}
#endif

// The factor that maps amax onto e4m3's range, and its inverse (the stored scale).
PYEP_DEVICE void fp8_scales(float amax, float& scale, float& inv) {
    const float max_inv = 1.0f / 448.0f;
    if (kRound) {
        const u32 bits = __float_as_uint(mul_rn(amax, max_inv));
        int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
        if ((bits & ((1u << 23) - 1u)) != 0) e++;
        scale = __uint_as_float(static_cast<u32>(127 - e) << 23);
        inv = __uint_as_float(static_cast<u32>(127 + e) << 23);
    } else {
        scale = 448.0f / amax;
        inv = mul_rn(amax, max_inv);
    }
}

// Where the phases below split their work: every block takes whole units (an expert, an
// (expert, rank) pair), and the threads of a block share the unit's rows, so that a unit of a few
// rows costs about one memory round trip rather than one per row. Every load of a round is issued
// before its first use (asm volatile loads keep program order, so a load used at once would wait
// its full latency before the next is issued).
constexpr int kChunk = 256;  // channels a warp moves per step: 8 per lane (16 B of BF16)
constexpr int kChunks = (kHidden + kChunk - 1) / kChunk;
constexpr int kCastBatch = 8;  // chunks a warp has in flight when it casts or packs messages
constexpr int kRowUnroll = 4;  // vectors a thread has in flight when a block copies rows (copy.cuh)

// Thread 0 decides whether the block may write into peer dst's half this call (dst unmasked and
// its acknowledgement of the previous call on the half arrived); every thread learns it.
PYEP_DEVICE bool block_may_send(const LLParams& p, int dst, u32 seq) {
    PYEP_SHARED(i32, s_may_send, 1);
    __syncthreads();  // the previous unit's readers are done with s_may_send
    if (threadIdx.x == 0) {
        bool ok = !masked(p, dst);
        if (ok && dst != p.rank && seq > 1) {
            const u64* ack = reinterpret_cast<const u64*>(local(p) + p.off_ack) + p.half * p.num_ranks + dst;
            u64 spent;
            ok = thread_wait(p, dst, kWaitAck, [&] { return ld_acquire_sys(ack) >= seq - 1; }, spent);
        }
        s_may_send[0] = ok ? 1 : 0;
    }
    __syncthreads();
    return s_may_send[0] != 0;
}

// Thread 0 publishes v at word once every thread of the block has made its stores.
PYEP_DEVICE void block_flag(u64* word, u64 v) {
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        st_release_sys(word, v);
    }
}

// e4m3 of eight floats, packed in channel order.
PYEP_DEVICE int2 pack_e4m3(const float (&f)[8]) {
    u32 w[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
#ifdef PYEP_EMU
        w[h] = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) w[h] |= static_cast<u32>(to_e4m3(f[4 * h + k])) << (8 * k);
#else
        w[h] = static_cast<u32>(float2_to_e4m3x2(f[4 * h], f[4 * h + 1])) |
               static_cast<u32>(float2_to_e4m3x2(f[4 * h + 2], f[4 * h + 3])) << 16;
#endif
    }
    int2 out;
    out.x = static_cast<int>(w[0]);
    out.y = static_cast<int>(w[1]);
    return out;
}

// One warp writes its items [it0, it0 + kCastBatch) of n messages: item it is chunk it % kChunks of
// the message of token tok[it / kChunks], at slots + (first + it / kChunks) messages. Lane l moves
// channels chunk * 256 + 8 l; with FP8, 16 lanes share a scale block.
PYEP_DEVICE void put_chunks(const LLParams& p, const i32* tok, int n, int it0, u8* slots, u32 first) {
    const int lane = lane_id(), items = n * kChunks;
    const u16* x = reinterpret_cast<const u16*>(p.x);
    int4 in[kCastBatch] = {};
#pragma unroll
    for (int b = 0; b < kCastBatch; b++) {
        const int it = it0 + b, c = (it % kChunks) * kChunk + lane * 8;
        if (it < items && c < kHidden) in[b] = ld_nc(reinterpret_cast<const int4*>(x + static_cast<i64>(tok[it / kChunks]) * kHidden + c));
    }
#pragma unroll
    for (int b = 0; b < kCastBatch; b++) {
        const int it = it0 + b;
        if (it >= items) break;  // warp-uniform
        const int m = it / kChunks, ch = it % kChunks, c = ch * kChunk + lane * 8;
        const bool on = c < kHidden;
        u8* msg = slots + static_cast<u64>(first + m) * p.msg_bytes;
        if (ch == 0 && lane == 0) *reinterpret_cast<i32*>(msg) = tok[m];
        if (!kFP8) {
            if (on) st_na(reinterpret_cast<int4*>(msg + kMsgHeader + 2 * c), in[b]);
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
        fp8_scales(amax, scale, inv);
#pragma unroll
        for (int k = 0; k < 8; k++) f[k] = mul_rn(f[k], scale);
        st_na(reinterpret_cast<int2*>(msg + kMsgHeader + c), pack_e4m3(f));
        if (lane % 16 == 0) reinterpret_cast<float*>(msg + kMsgHeader + kHidden)[c / kScaleBlock] = inv;
    }
}

#if defined(PYEP_LL_DISPATCH)

constexpr bool kUE8M0 = PYEP_LL_UE8M0 != 0;
constexpr int kScales = kHidden / kScaleBlock;

// Send: a block an expert. The block of expert g (on rank g / L) lists, kThreads tokens at a time
// and in token order, the tokens that selected g, writes their messages into slots 0, 1, ... of
// (g % L, this rank) at that rank (its warps share the chunks), then the flag seq << 32 | count.
PYEP_DEVICE void dispatch_send(const LLParams& p, u32 seq) {
    PYEP_SHARED(i32, s_tok, kThreads);
    PYEP_SHARED(i32, s_warp, kWarps);
    const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / 32, R = p.num_ranks, E = p.num_experts, L = E / R,
              T = p.num_tokens;
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    for (int g = static_cast<int>(blockIdx.x); g < E; g += static_cast<int>(gridDim.x)) {
        const int dst = g / L, j = g % L;
        if (!block_may_send(p, dst, seq)) continue;
        u8* slots = region(p, dst) + p.off_recv + (static_cast<u64>(j) * R + p.rank) * p.max_tokens * p.msg_bytes;
        u32 n = 0;
        for (int t0 = 0; t0 < T; t0 += kThreads) {
            const int t = t0 + static_cast<int>(threadIdx.x);
            bool sel = false;
            if (t < T) {
                i64 e[kTopk];
#pragma unroll
                for (int k = 0; k < kTopk; k++) e[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
                for (int k = 0; k < kTopk; k++) sel |= e[k] == g;
            }
            const u32 ballot = __ballot_sync(0xffffffffu, sel);
            __syncthreads();  // the previous round's readers are done with s_warp and s_tok
            if (lane == 0) s_warp[warp] = __popc(ballot);
            __syncthreads();
            int before = 0, count = 0;
            for (int w = 0; w < kWarps; w++) {
                const int c = s_warp[w];
                if (w < warp) before += c;
                count += c;
            }
            if (sel) s_tok[before + __popc(ballot & ((1u << lane) - 1u))] = t;
            __syncthreads();
            for (int it0 = warp * kCastBatch; it0 < count * kChunks; it0 += kWarps * kCastBatch)
                put_chunks(p, s_tok, count, it0, slots, n);
            n += static_cast<u32>(count);
        }
        block_flag(reinterpret_cast<u64*>(region(p, dst) + p.off_dflags) + j * R + p.rank, static_cast<u64>(seq) << 32 | n);
    }
}

// Receive: a block a pair (local expert j, source s). Warp 0 waits for the flags of s and of the
// sources before it (its rows follow theirs); then the block unpacks the pair's rows.
PYEP_DEVICE void dispatch_recv(const LLParams& p, u32 seq) {
    PYEP_SHARED(i64, s_range, 2);
    const int lane = lane_id(), R = p.num_ranks, L = p.num_experts / R, M = p.max_tokens;
    const int tid = static_cast<int>(threadIdx.x);
    const i64 RM = static_cast<i64>(R) * M;
    const u64* flags = reinterpret_cast<const u64*>(local(p) + p.off_dflags);
    for (int pair = static_cast<int>(blockIdx.x); pair < L * R; pair += static_cast<int>(gridDim.x)) {
        const int j = pair / R, s = pair % R;
        __syncthreads();  // the previous pair's readers are done with s_range
        if (tid < 32) {
            // Lane r learns the count of source r (0 when masked or timed out); a source's wait is
            // charged to it.
            i64 begin = 0, n = 0;
            for (int r0 = 0; r0 <= s; r0 += 32) {
                const int r = r0 + lane;
                i64 c = 0;
                if (r <= s && !masked(p, r)) {
                    const u64* f = flags + j * R + r;
                    u64 v = 0, spent;
                    if (thread_wait(p, r, kWaitDispatch, [&] { return static_cast<u32>((v = ld_acquire_sys(f)) >> 32) == seq; },
                                    spent))
                        c = static_cast<u32>(v);
                    if (r == s && p.wait_stats != 0)
                        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + s, static_cast<unsigned long long>(spent));
                }
                if (r < s) begin += c;
                if (r == s) n = c;
            }
            begin = warp_sum(begin);
            n = warp_sum(n);
            if (lane == 0) {
                s_range[0] = begin;
                s_range[1] = n;
            }
        }
        __syncthreads();
        const i64 begin = s_range[0], n = s_range[1] < M ? s_range[1] : M;
        const u8* slots = local(p) + p.off_recv + (static_cast<u64>(j) * R + s) * M * p.msg_bytes;
        const i64 first = j * RM + begin;
        constexpr int kRowBytes = kFP8 ? kHidden : 2 * kHidden;
        block_copy_rows<int4, kRowUnroll, true, kRowBytes / 16>(
            static_cast<int>(n), [&](int i) { return reinterpret_cast<const int4*>(slots + i * p.msg_bytes + kMsgHeader); },
            [&](int i) { return reinterpret_cast<int4*>(reinterpret_cast<u8*>(p.recv_x) + (first + i) * kRowBytes); });
        for (int i = tid; i < n; i += kThreads)
            reinterpret_cast<i32*>(p.src_info)[first + i] = ld_ring(reinterpret_cast<const i32*>(slots + i * p.msg_bytes));
        if (kFP8 && n > 0) {
            // Token fastest, so that the column-major scales are written in runs.
            constexpr int kCols = kUE8M0 ? (kScales + 3) / 4 : kScales;
            for (int q = tid; q < n * kCols; q += kThreads) {
                const int i = static_cast<int>(q % n), w = static_cast<int>(q / n);
                const float* sc = reinterpret_cast<const float*>(slots + i * p.msg_bytes + kMsgHeader + kHidden);
                if (kUE8M0) {
                    u32 word = 0;
                    for (int b = 0; b < 4 && 4 * w + b < kScales; b++)
                        word |= ((__float_as_uint(ld_ring(sc + 4 * w + b)) >> 23) & 0xffu) << (8 * b);
                    reinterpret_cast<u32*>(p.recv_scales)[(static_cast<i64>(j) * kCols + w) * RM + begin + i] = word;
                } else {
                    reinterpret_cast<float*>(p.recv_scales)[(static_cast<i64>(j) * kCols + w) * RM + begin + i] = ld_ring(sc + w);
                }
            }
        }
        if (tid == 0) {
            reinterpret_cast<i64*>(p.layout_range)[j * R + s] = begin << 32 | n;
            if (s == R - 1) {
                reinterpret_cast<i32*>(p.count)[j] = static_cast<i32>(begin + n);
                if (p.cum_stats != 0) atomicAdd(reinterpret_cast<i32*>(p.cum_stats) + j, static_cast<i32>(begin + n));
            }
        }
    }
}

// The GPU loads the kernels by their C++ names, so that profilers show pyep::ll::dispatch and ::combine (DeepEP's
// test harness finds its kernels by those names); the emulator by their C names.
#ifdef PYEP_EMU
extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_ll_dispatch(const LLParams p) {
    run_phases(p, dispatch_send, dispatch_recv);
}
#else
namespace ll {
__global__ void __launch_bounds__(kThreads, 1) dispatch(const LLParams p) { run_phases(p, dispatch_send, dispatch_recv); }
}  // namespace ll
#endif

#endif  // PYEP_LL_DISPATCH

#if defined(PYEP_LL_COMBINE)

// Send: a block a pair (local expert j, destination d): it returns j's rows from d, each into the
// slot (this rank's global expert, token) of d's recv area, then flags it.
PYEP_DEVICE void combine_send(const LLParams& p, u32 seq) {
    const int R = p.num_ranks, L = p.num_experts / R, M = p.max_tokens;
    const i64 RM = static_cast<i64>(R) * M;
    const u16* rows = p.zero_copy ? reinterpret_cast<const u16*>(local(p) + p.off_send) : reinterpret_cast<const u16*>(p.x);
    const i32* src_info = reinterpret_cast<const i32*>(p.src_info);
    for (int pair = static_cast<int>(blockIdx.x); pair < L * R; pair += static_cast<int>(gridDim.x)) {
        const int j = pair / R, d = pair % R;
        if (!block_may_send(p, d, seq)) continue;
        const i64 v = reinterpret_cast<const i64*>(p.layout_range)[j * R + d];
        const i64 first = j * RM + (v >> 32);
        const int n = static_cast<i32>(v & 0xffffffff), g = p.rank * L + j;
        u8* slots = region(p, d) + p.off_recv + static_cast<u64>(g) * M * (2 * kHidden);
        block_copy_rows<int4, kRowUnroll, false, kHidden / 8>(
            n, [&](int i) { return reinterpret_cast<const int4*>(rows + (first + i) * kHidden); },
            [&](int i) { return reinterpret_cast<int4*>(slots + static_cast<u64>(ld_nc(src_info + first + i)) * (2 * kHidden)); });
        block_flag(reinterpret_cast<u64*>(region(p, d) + p.off_cflags) + g, static_cast<u64>(seq) << 32 | 1u);
    }
}

// Receive: every block waits for every unmasked expert's flag (a thread each); then each warp of
// the grid takes (token, chunk) items and sums the chunk's rows in top-k order.
PYEP_DEVICE void combine_recv(const LLParams& p, u32 seq) {
    const int lane = lane_id(), R = p.num_ranks, E = p.num_experts, L = E / R, M = p.max_tokens;
    const u64* flags = reinterpret_cast<const u64*>(local(p) + p.off_cflags);
    for (int g = static_cast<int>(threadIdx.x); g < E; g += kThreads) {
        const int s = g / L;
        if (masked(p, s)) continue;
        u64 spent;
        thread_wait(p, s, kWaitCombine, [&] { return static_cast<u32>(ld_acquire_sys(flags + g) >> 32) == seq; }, spent);
        if (blockIdx.x == 0 && p.wait_stats != 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + s, static_cast<unsigned long long>(spent));
    }
    __syncthreads();
    fence_acq_rel_sys();
    const i64* idx = reinterpret_cast<const i64*>(p.topk_idx);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    const u8* slots = local(p) + p.off_recv;
    const int nw = static_cast<int>(gridDim.x) * kWarps;
    for (int it = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32; it < p.num_tokens * kChunks;
         it += nw) {
        const int t = it / kChunks, c = (it % kChunks) * kChunk + lane * 8;
        i64 g[kTopk];
        float w[kTopk];
        i32 off[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++) g[k] = ld_nc(idx + static_cast<i64>(t) * kTopk + k);
#pragma unroll
        for (int k = 0; k < kTopk; k++) w[k] = ld_nc(wts + static_cast<i64>(t) * kTopk + k);
#pragma unroll
        for (int k = 0; k < kTopk; k++) {
            if (g[k] >= E) g[k] = -1;
            off[k] = g[k] >= 0 ? ld_volatile(reinterpret_cast<const i32*>(local(p) + p.off_mask) + g[k] / L) : 1;
        }
        if (c >= kHidden) continue;
        int4 v[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; k++)
            if (off[k] == 0) v[k] = ld_ring(reinterpret_cast<const int4*>(slots + (static_cast<u64>(g[k]) * M + t) * (2 * kHidden)) + c / 8);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k < kTopk; k++) {
            if (off[k] != 0) continue;
            const u32 words[4] = {static_cast<u32>(v[k].x), static_cast<u32>(v[k].y), static_cast<u32>(v[k].z), static_cast<u32>(v[k].w)};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                acc[2 * q] += mul_rn(bf16_to_float(static_cast<u16>(words[q] & 0xffffu)), w[k]);
                acc[2 * q + 1] += mul_rn(bf16_to_float(static_cast<u16>(words[q] >> 16)), w[k]);
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

#ifdef PYEP_EMU
extern "C" __global__ void __launch_bounds__(kThreads, 1) pyep_ll_combine(const LLParams p) {
    run_phases(p, combine_send, combine_recv);
}
#else
namespace ll {
__global__ void __launch_bounds__(kThreads, 1) combine(const LLParams p) { run_phases(p, combine_send, combine_recv); }
}  // namespace ll
#endif

#endif  // PYEP_LL_COMBINE

}  // namespace pyep
