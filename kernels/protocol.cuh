// protocol.cuh: what every kernel of a communication domain does alike, whatever it moves:
// barriers numbered by the host, waits bounded in time, the first failure of a rank recorded
// for the host and broadcast so that every rank stops, and rings whose progress is counted in
// tail words (written by the sender) and head words (written by the receiver). intranode.cu
// uses it; the low-latency and internode kernels are to reuse it.
//
// The helpers take the kernel file's context (its Ctx, passed through), which has at least
//   u64 ctl[]        control region of rank i, as mapped here
//   u64 err          the OpError record, in host-mapped memory
//   u64 timeout_ns   the bound of every wait
//   i32 rank         this rank
// and, for the ring words, u64 data[] (data region of rank i), u64 head_off and i32 ring_slots.
// Beside its Ctx the file declares domain_ranks(const Ctx&): the ranks that a barrier waits for
// and that an abort reaches.
//
// Control region (goep.ControlBytes, zeroed at allocation): barrier signals (one u64 per rank,
// the sequence number of the last barrier that rank reached; the host numbers barriers, every
// rank alike), the abort word and the claim of the error record; words from offset 80 on are
// the kernel file's own.
//
// Every wait is bounded by ctx.timeout_ns. The first failure of a rank claims its error record
// (host-mapped memory the host reads at its next call) and sets the abort word of the rank and
// of every peer; every wait polls the abort word, so all ranks stop within a poll instead of
// each waiting for its own timeout, and a later kernel on a buffer whose abort word is set
// returns at once.
#pragma once

#ifdef PYEP_EMU
#include "emu.h"
#else
#include "utils.cuh"
#endif

namespace pyep {

// The host-kernel ABI (the error record below), in this namespace as every kernel file has it, so
// that argument-dependent lookup finds a kernel file's functions of its Ctx.
#include "params.h"

// Control region offsets.
constexpr int kCtlSignals = 0;  // u64 [8]
constexpr int kCtlAbort = 64;   // u64
constexpr int kCtlClaim = 72;   // u32

// The error record the host reads: params.h's pyep_op_error, which goep/cuda includes too.
typedef struct pyep_op_error OpError;

enum : u32 { kCodeTimeout = 1, kCodeMismatch = 2, kCodeAborted = 3 };
// The call a failure happened in (2 was the separate prologue kernel's, now the dispatch's or the
// combine's own barriers).
enum : i32 { kOpNotify = 1, kOpDispatch = 3, kOpCombine = 4 };
// What a rank waited for, or what did not match.
enum : i32 {
    kWaitBarrier = 1,      // peer to reach barrier a (seen b)
    kWaitTail = 2,         // dispatch: peer to push tokens (a received of b)
    kWaitHead = 3,         // peer to free ring slots (head a, pushed b, ring c)
    kWaitAnnounce = 4,     // peer to announce its count for channel a
    kWaitToken = 5,        // combine: peer to return token a (slot b, tail c)
    kWaitVerdict = 6,      // queued dispatch: this rank's notify (block 0) to decide on call a (last decided b)
    kBadRows = 10,         // peer sends a rows here, rank_prefix_matrix says b
    kBadInRank = 11,       // is_token_in_rank has a tokens for peer in the channel, channel_prefix_matrix b
    kRowsOverflow = 12,    // rows [a, b) do not fit c output rows
    kBadSrc = 13,          // peer returned the row of token a where send_head expects token b
    kBadReturnCount = 14,  // peer returns a rows, send_head expects b
    kBadChannelPrefix = 15,// channel_prefix_matrix[peer, channel] = a not within [b, c]
    kBadSendHead = 16,     // send_head[a, peer] = b but peer returns only c rows
};

// Word off of rank r's control region.
template <typename Ctx>
PYEP_DEVICE u64* ctl_word(const Ctx& ctx, int r, int off) {
    return reinterpret_cast<u64*>(ctx.ctl[r] + off);
}
// Words per ring in the tails and heads arrays, the most sub-rings a ring has (goep/cuda's
// ringWords).
constexpr int kSubRings = 32;
// Word w of rank r's tails[i] and heads[i]: for ring (c, s -> r) the tails are tails[c*R + s]
// of r, the heads heads[c*R + r] of s.
template <typename Ctx>
PYEP_DEVICE u64* tail_word(const Ctx& ctx, int r, int ring, int w) {
    return reinterpret_cast<u64*>(ctx.data[r]) + ring * kSubRings + w;
}
template <typename Ctx>
PYEP_DEVICE u32* head_word(const Ctx& ctx, int r, int ring, int w) {
    return reinterpret_cast<u32*>(ctx.data[r] + ctx.head_off) + ring * kSubRings + w;
}

// The word a failing rank broadcasts: who failed, why, waiting for whom, on which channel.
PYEP_DEVICE u64 abort_word(i32 rank, u32 code, i32 what, i32 peer, i32 channel) {
    return (1ull << 63) | (static_cast<u64>(rank & 0x7f) << 56) | (static_cast<u64>(what & 0xff) << 48) |
           (static_cast<u64>(peer & 0xff) << 40) | (static_cast<u64>(code & 0xff) << 32) |
           static_cast<u64>(static_cast<u32>(channel));
}

// The rank that failed first, from its abort word.
PYEP_DEVICE int abort_origin(u64 w) { return static_cast<int>((w >> 56) & 0x7f); }

// Records this rank's first failure for the host and makes every rank stop. Any thread may call
// it; only the first call of a rank fills the record.
template <typename Ctx>
PYEP_DEVICE void fail(const Ctx& ctx, i32 op, u32 code, i32 what, i32 channel, i32 peer, i64 a, i64 b, i64 c,
                      u64 waited_ns = 0, u64 foreign = 0) {
    const int me = ctx.rank;
    const u64 word = foreign != 0 ? foreign : abort_word(me, code, what, peer, channel);
    atomic_cas_sys(ctl_word(ctx, me, kCtlAbort), 0ull, word);
    u32* claim = reinterpret_cast<u32*>(ctx.ctl[me] + kCtlClaim);
    if (atomicCAS(claim, 0u, 1u) == 0u) {
        OpError* e = reinterpret_cast<OpError*>(ctx.err);
        st_relaxed_sys(&e->op, op);
        st_relaxed_sys(&e->rank, me);
        st_relaxed_sys(&e->channel, channel);
        st_relaxed_sys(&e->peer, peer);
        st_relaxed_sys(&e->what, what);
        st_relaxed_sys(&e->a, a);
        st_relaxed_sys(&e->b, b);
        st_relaxed_sys(&e->c, c);
        st_relaxed_sys(&e->waited_ns, waited_ns);
        st_relaxed_sys(&e->abort_word, foreign);
        st_release_sys(&e->code, code);
    }
    if (foreign == 0) {
        for (int p = 0; p < domain_ranks(ctx); p++)
            if (p != me) atomic_cas_sys(ctl_word(ctx, p, kCtlAbort), 0ull, word);
    }
}

// The abort word of this rank: 0 while every rank is fine.
template <typename Ctx>
PYEP_DEVICE u64 aborted(const Ctx& ctx) { return ld_volatile(ctl_word(ctx, ctx.rank, kCtlAbort)); }

// Called after a poll that found the condition unmet: returns true to poll again, false (after
// recording why, unless another thread of this rank already did) to give up.
template <typename Ctx>
PYEP_DEVICE bool keep_waiting(const Ctx& ctx, u64& start, i32 op, i32 what, i32 channel, i32 peer, i64 a, i64 b,
                              i64 c) {
    const u64 w = aborted(ctx);
    if (w != 0) {
        if (abort_origin(w) != ctx.rank) fail(ctx, op, kCodeAborted, what, channel, peer, a, b, c, 0, w);
        return false;
    }
    const u64 now = globaltimer();
    if (start == 0) {
        start = now;
        return true;
    }
    if (now - start > ctx.timeout_ns) {
        fail(ctx, op, kCodeTimeout, what, channel, peer, a, b, c, now - start);
        return false;
    }
    return true;
}

// A kernel's first act: on a buffer that failed before, stop at once (recording why, so that a
// rank that only learns of a peer's failure now reports it).
template <typename Ctx>
PYEP_DEVICE bool start_ok(const Ctx& ctx, i32 op) {
    const u64 w = aborted(ctx);
    if (w == 0) return true;
    if (abort_origin(w) != ctx.rank) fail(ctx, op, kCodeAborted, 0, -1, abort_origin(w), 0, 0, 0, 0, w);
    return false;
}

// Waits until every rank has reached barrier `seq`, without arriving itself: one full warp (lane
// r polls rank r's signal in this rank's control region), in a block that must not touch the
// call's memory before the barrier is complete while another block of its kernel arrives for the
// rank. A lane that gives up names the rank furthest behind (the lowest signal), not its own: a
// rank that waits in the barrier itself is not at fault. Returns false (on every lane) after a
// failure.
template <typename Ctx>
PYEP_DEVICE bool barrier_wait(const Ctx& ctx, i32 op, u64 seq) {
    const int lane = static_cast<int>(lane_id());
    bool ok = true;
    if (lane < domain_ranks(ctx)) {
        const u64* signals = ctl_word(ctx, ctx.rank, kCtlSignals);
        u64 start = 0;
        for (;;) {
            u64 seen = ld_acquire_sys(signals + lane);
            if (seen >= seq) break;
            i32 who = lane;
            for (int r = 0; r < domain_ranks(ctx); r++) {
                const u64 v = ld_volatile(signals + r);
                if (v < seen) seen = v, who = r;
            }
            if (!keep_waiting(ctx, start, op, kWaitBarrier, -1, who, static_cast<i64>(seq),
                              static_cast<i64>(seen), 0)) {
                ok = false;
                break;
            }
        }
    }
    return __all_sync(0xffffffffu, ok);
}

// All ranks reach barrier `seq`; one full warp calls it, after a __syncthreads that orders the
// block's earlier writes before it. Returns false (on every lane) after a failure.
template <typename Ctx>
PYEP_DEVICE bool barrier(const Ctx& ctx, i32 op, u64 seq) {
    const int lane = static_cast<int>(lane_id());
    if (lane < domain_ranks(ctx)) st_release_sys(ctl_word(ctx, lane, kCtlSignals) + ctx.rank, seq);
    return barrier_wait(ctx, op, seq);
}

// The sub-rings of every ring of a call (intranode.cu's Memory): the sending and the receiving side derive
// them alike from the ring's slots.
struct SubRings {
    i32 n;      // W: sub-rings, one per sending (and receiving) warp of a peer
    i32 slots;  // S: slots of each
};
template <typename Ctx>
PYEP_DEVICE SubRings sub_rings(const Ctx& ctx, int warps_per_peer) {
    const i32 n = min(min(warps_per_peer, kSubRings), ctx.ring_slots);
    return {n, ctx.ring_slots / n};
}

// Lane 0 polls *word (ld.acquire.sys) until ready(value); the warp learns the value. After a
// failure (recorded by keep_waiting with what, a, b and c) it returns false on every lane. The
// __syncwarp orders lane 0's acquire before the warp's later accesses.
template <typename Ctx, typename T, typename Ready>
PYEP_DEVICE bool warp_poll(const Ctx& ctx, const T* word, T& value, Ready ready, i32 op, i32 what, i32 channel,
                           i32 peer, i64 a, i64 b, i64 c, int lane) {
    i32 ok = 1;
    T v = 0;
    if (lane == 0) {
        u64 start = 0;
        for (;;) {
            v = ld_acquire_sys(word);
            if (ready(v)) break;
            if (!keep_waiting(ctx, start, op, what, channel, peer, a, b, c)) {
                ok = 0;
                break;
            }
        }
    }
    value = __shfl_sync(0xffffffffu, v, 0);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    return ok != 0;
}

// A sending warp's progress, for its block's publisher: lane 0 releases v (the tail word the
// warp wants published) at CTA scope after the warp's stores, which costs the warp no wait for
// them to land.
PYEP_DEVICE void post(u64* slot, u64 v, int lane) {
    __syncwarp();
    if (lane == 0) st_release_cta(slot, v);
}

// Lane 0 publishes v at *word (st.release.sys) after the warp's earlier stores.
template <typename T>
PYEP_DEVICE void warp_publish(T* word, T v, int lane) {
    __syncwarp();
    if (lane == 0) st_release_sys(word, v);
}

}  // namespace pyep
