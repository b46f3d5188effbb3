// notify.cuh: the count exchange of a dispatch (notify), by one block: every rank learns what
// every rank sends where, checks its own arguments, passes the call's two barriers (resetting
// this rank's ring counters between them) and answers the host. intranode.cu runs it as a kernel
// of its own (pyep_notify) and as block 0 of the queued dispatch's kernel (pyep_notify_dispatch);
// it includes this file inside namespace pyep after its Ctx, kRanks and channel_range.
//
// Shared arrays here are named s_n*: the emulator gives a block one allocation per name, so a
// kernel that runs this beside its own code must not reuse them.

typedef pyep_notify_params NotifyParams;  // params.h

// Host-mapped answer of notify; the host waits for tag == seq (params.h).
typedef pyep_notify_result NotifyResult;

enum : i32 {
    kStatusOK = 0,
    kStatusTopk = 1,       // topk_idx[d0, d1] = d2 out of range
    kStatusPerRank = 2,    // num_tokens_per_rank[d0] = d1 but is_token_in_rank routes d2
    kStatusPerExpert = 3,  // num_tokens_per_expert[d0] = d1 < 0
    kStatusPeer = 4,       // rank bad_rank has invalid arguments (peer_status, d0..d2)
    kStatusWorst = 5,      // num_worst_tokens too small: rank bad_rank receives d0
    kStatusLayout = 6,     // get_dispatch_layout's topk_idx[d0, d1] = d2 out of range (d0 0xffffffff: it timed out)
};

// Scratch block of one sender in a receiver's region: i64 status[4], i32 per_rank[R],
// i32 counts[C] (its tokens to this receiver per channel), i32 per_expert[E/R] (for this
// receiver's experts), i32 capacity.

// Notify by a block of kNT threads (every thread calls it). Thread 0 calls decided(go) once the
// verdict on a dispatch into p.capacity rows is known (go: every rank's rows fit and every rank's
// arguments are valid; the same on every rank, as every rank sees every rank's counts), after
// every output in global memory is written and before it answers the host. A block that stops on
// a failure (recorded, and the abort word set) returns without calling it.
template <int kNT, typename Decided>
PYEP_DEVICE void notify_block(const NotifyParams& p, Decided decided) {
    const Ctx& ctx = p.ctx;
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    constexpr int kNW = kNT / 32;
    static_assert(kNT % 32 == 0 && kNT >= 32, "whole warps");
    const int R = kRanks, me = ctx.rank, C = ctx.num_channels;
    const i32 T = p.num_tokens, K = p.num_topk, E = p.num_experts, EPR = E / R;
    PYEP_SHARED(i64, s_nstatus, 4);
    PYEP_SHARED(i64, s_nbad_topk, 1);
    PYEP_SHARED(i32, s_nbad_expert, 1);
    PYEP_SHARED(i32, s_nsum, kRanks);
    PYEP_SHARED(i32, s_nstop, 1);
    PYEP_SHARED(i64, s_ncol, kRanks);
    if (tid == 0) {
        s_nbad_topk[0] = 0x7fffffffffffffffll;
        s_nbad_expert[0] = 0x7fffffff;
        s_nstop[0] = start_ok(ctx, kOpNotify) ? 0 : 1;
    }
    __syncthreads();
    if (s_nstop[0] != 0) return;

    // Tokens per (channel, destination), into channel_prefix for now.
    const u8* in_rank = reinterpret_cast<const u8*>(p.in_rank);
    i32* cp = reinterpret_cast<i32*>(p.channel_prefix);
    for (int c = warp; c < C; c += kNW) {
        i32 lo, hi;
        channel_range(T, C, c, lo, hi);
        i32 cnt[kRanks];
#pragma unroll
        for (int d = 0; d < kRanks; d++) cnt[d] = 0;
        // A lane reads whole rows: R independent byte loads, coalesced over the warp.
#pragma unroll 4
        for (i32 t = lo + lane; t < hi; t += 32) {
            const u8* row = in_rank + static_cast<i64>(t) * kRanks;
#pragma unroll
            for (int d = 0; d < kRanks; d++) cnt[d] += row[d] != 0 ? 1 : 0;
        }
#pragma unroll
        for (int d = 0; d < kRanks; d++) {
            const i32 v = warp_sum(cnt[d]);
            if (lane == 0) cp[d * C + c] = v;
        }
    }
    // Our own arguments.
    if (p.topk != 0) {
        // Eight loads in flight per thread (the scan of [T, K] is most of notify's time), one
        // shared atomic per warp.
        constexpr int kU = 8;
        const i64* topk = reinterpret_cast<const i64*>(p.topk);
        const i64 n = static_cast<i64>(T) * K;
        i64 bad = 0x7fffffffffffffffll;
        for (i64 base = tid; base < n; base += kNT * kU) {
            i64 e[kU];
#pragma unroll
            for (int u = 0; u < kU; u++) {
                const i64 i = base + static_cast<i64>(u) * kNT;
                e[u] = i < n ? ld_nc(topk + i) : 0;
            }
#pragma unroll
            for (int u = 0; u < kU; u++)
                if (e[u] < -1 || e[u] >= E) bad = min(bad, base + static_cast<i64>(u) * kNT);
        }
        bad = warp_min(bad);
        if (lane == 0 && bad != 0x7fffffffffffffffll)
            atomicMin(reinterpret_cast<long long*>(s_nbad_topk), static_cast<long long>(bad));
    }
    const i32* per_expert = reinterpret_cast<const i32*>(p.per_expert);
    for (int e = tid; e < E; e += kNT)
        if (per_expert[e] < 0) atomicMin(s_nbad_expert, e);
    __syncthreads();
    for (int d = warp; d < R; d += kNW) {
        i32 s = 0;
        for (int c = lane; c < C; c += 32) s += cp[d * C + c];
        s = warp_sum(s);
        if (lane == 0) s_nsum[d] = s;
    }
    __syncthreads();
    if (tid == 0) {
        const i32* per_rank = reinterpret_cast<const i32*>(p.per_rank);
        i64 st[4] = {kStatusOK, 0, 0, 0};
        const u64* lrec = reinterpret_cast<const u64*>(p.layout_rec);
        if (s_nbad_topk[0] != 0x7fffffffffffffffll) {
            const i64 i = s_nbad_topk[0];
            st[0] = kStatusTopk, st[1] = i / K, st[2] = i % K, st[3] = reinterpret_cast<const i64*>(p.topk)[i];
        } else if (lrec != nullptr && ld_acquire_sys(lrec) == p.layout_tag) {
            const u64 at = ld_volatile(lrec + 1);
            st[0] = kStatusLayout, st[1] = static_cast<i64>(at >> 32), st[2] = static_cast<i64>(at & 0xffffffffu),
            st[3] = static_cast<i64>(ld_volatile(lrec + 2));
        } else {
            for (int d = 0; d < R; d++) {
                if (per_rank[d] != s_nsum[d]) {
                    st[0] = kStatusPerRank, st[1] = d, st[2] = per_rank[d], st[3] = s_nsum[d];
                    break;
                }
            }
            if (st[0] == kStatusOK && s_nbad_expert[0] != 0x7fffffff)
                st[0] = kStatusPerExpert, st[1] = s_nbad_expert[0], st[2] = per_expert[s_nbad_expert[0]];
        }
        for (int i = 0; i < 4; i++) s_nstatus[i] = st[i];
    }
    __syncthreads();

    // Barrier: every rank is here, so nothing of an earlier call touches our memory any more.
    if (warp == 0 && !barrier(ctx, kOpNotify, ctx.seq) && lane == 0) s_nstop[0] = 1;
    __syncthreads();
    if (s_nstop[0] != 0) return;

    // Our block into every receiver's scratch; our counters to zero.
    const i32* per_rank = reinterpret_cast<const i32*>(p.per_rank);
    for (int d = 0; d < R; d++) {
        u8* blk = reinterpret_cast<u8*>(ctx.data[d] + p.scratch_off + static_cast<u64>(me) * p.block_bytes);
        i64* st = reinterpret_cast<i64*>(blk);
        i32* ints = reinterpret_cast<i32*>(blk + 32);
        if (tid < 4) st[tid] = s_nstatus[tid];
        if (tid < R) ints[tid] = per_rank[tid];
        for (int c = tid; c < C; c += kNT) ints[R + c] = cp[d * C + c];
        for (int i = tid; i < EPR; i += kNT) ints[R + C + i] = per_expert[d * EPR + i];
        if (tid == 0) ints[R + C + EPR] = p.capacity;
    }
    {
        u64* z = reinterpret_cast<u64*>(ctx.data[me]);
        for (u64 i = tid; i < ctx.counter_bytes / 8; i += kNT) z[i] = 0;
    }
    __syncthreads();
    if (warp == 0 && !barrier(ctx, kOpNotify, ctx.seq + 1) && lane == 0) s_nstop[0] = 1;
    __syncthreads();
    if (s_nstop[0] != 0) return;

    // Every sender's block is in our scratch.
    const u8* scratch = reinterpret_cast<const u8*>(ctx.data[me] + p.scratch_off);
    auto blk_status = [&](int src, int i) -> i64 {
        return ld_ring(reinterpret_cast<const i64*>(scratch + static_cast<u64>(src) * p.block_bytes) + i);
    };
    auto blk_int = [&](int src, int i) -> i32 {
        return ld_ring(reinterpret_cast<const int*>(scratch + static_cast<u64>(src) * p.block_bytes + 32) + i);
    };
    i32* rank_prefix = reinterpret_cast<i32*>(p.rank_prefix);
    if (tid < R) {
        i64 run = 0;
        for (int src = 0; src < R; src++) {
            run += blk_int(src, tid);
            rank_prefix[src * R + tid] = static_cast<i32>(run);
        }
        s_ncol[tid] = run;
    }
    for (int src = warp; src < R; src += kNW) {
        // recv_channel_prefix[src][c]: exclusive prefix over channels of what src sends here.
        i32* rcp = reinterpret_cast<i32*>(p.recv_channel_prefix);
        i32 carry = 0;
        for (int base = 0; base < C; base += 32) {
            const int c = base + lane;
            const i32 v = c < C ? blk_int(src, R + c) : 0;
            i32 incl = v;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const i32 o = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += o;
            }
            if (c < C) rcp[src * C + c] = carry + incl - v;
            carry += __shfl_sync(0xffffffffu, incl, 31);
        }
        // Our own send side: inclusive prefix, in place.
        const int d = src;
        carry = 0;
        for (int base = 0; base < C; base += 32) {
            const int c = base + lane;
            const i32 v = c < C ? cp[d * C + c] : 0;
            i32 incl = v;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const i32 o = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += o;
            }
            __syncwarp();
            if (c < C) cp[d * C + c] = carry + incl;
            carry += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    NotifyResult* res = reinterpret_cast<NotifyResult*>(p.result);
    i32* res_experts = reinterpret_cast<i32*>(res + 1);
    i32* recv_per_expert = reinterpret_cast<i32*>(p.recv_per_expert);
    const i64 align = p.alignment > 0 ? p.alignment : 1;
    for (int i = tid; i < EPR; i += kNT) {
        i64 n = 0;
        for (int src = 0; src < R; src++) n += blk_int(src, R + C + i);
        n = (n + align - 1) / align * align;
        recv_per_expert[i] = static_cast<i32>(n);
        st_relaxed_sys(res_experts + i, static_cast<i32>(n));
    }
    __syncthreads();  // every output above before the verdict that releases them (decided)
    if (tid == 0) {
        i32 status = static_cast<i32>(s_nstatus[0]), bad_rank = -1, peer_status = 0;
        i64 d0 = s_nstatus[1], d1 = s_nstatus[2], d2 = s_nstatus[3];
        if (status == kStatusOK) {
            for (int src = 0; src < R; src++) {
                const i64 ps = blk_status(src, 0);
                if (src != me && ps != kStatusOK) {
                    status = kStatusPeer, bad_rank = src, peer_status = static_cast<i32>(ps);
                    d0 = blk_status(src, 1), d1 = blk_status(src, 2), d2 = blk_status(src, 3);
                    break;
                }
            }
        }
        if (status == kStatusOK && p.num_worst > 0) {
            int worst = -1;
            for (int j = 0; j < R; j++)
                if (s_ncol[j] > p.num_worst && (worst < 0 || s_ncol[j] > s_ncol[worst])) worst = j;
            if (worst >= 0) status = kStatusWorst, bad_rank = worst, d0 = s_ncol[worst];
        }
        // Every rank sees every rank's rows, capacity and status, so all decide alike.
        i32 go = 0;
        if (status == kStatusOK && p.capacity > 0) {
            go = 1;
            for (int j = 0; j < R; j++) {
                const i32 cap = blk_int(j, R + C + EPR);
                if (cap > 0 && s_ncol[j] > cap) go = 0;
            }
        }
        decided(go != 0);
        st_relaxed_sys(&res->go, go);
        st_relaxed_sys(&res->num_recv, static_cast<i32>(s_ncol[me]));
        st_relaxed_sys(&res->status, status);
        st_relaxed_sys(&res->bad_rank, bad_rank);
        st_relaxed_sys(&res->peer_status, peer_status);
        st_relaxed_sys(&res->d0, d0);
        st_relaxed_sys(&res->d1, d1);
        st_relaxed_sys(&res->d2, d2);
        st_release_sys(&res->tag, ctx.seq);
    }
}
