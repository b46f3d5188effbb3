// params.h: the host-kernel ABI, declared once. The kernels (intranode.cu, layout.cu,
// low_latency.cu and protocol.cuh, compiled by NVRTC or, for the emulator, by the host C++
// compiler) and the Go engines (goep/cuda, through cgo) both include this file, so a launch's
// parameter struct and the records the host reads have one definition. Plain C: no toolkit headers (NVRTC has none), no
// namespaces; every field is 8 or 4 bytes, laid out alike by every compiler (the asserts below
// and goep/cuda's TestParamLayouts check it).
#ifndef PYEP_PARAMS_H
#define PYEP_PARAMS_H

typedef unsigned long long pyep_u64;
typedef long long pyep_i64;
typedef int pyep_i32;
typedef unsigned int pyep_u32;

// Everything a kernel needs about the call and the domain.
struct pyep_ctx {
    pyep_u64 data[8];        // data region of NVLink rank i, as mapped here
    pyep_u64 ctl[8];         // control region of NVLink rank i
    pyep_u64 err;            // pyep_op_error in host-mapped memory
    pyep_u64 seq;            // this call's first barrier number (the second is seq + 1)
    pyep_u64 timeout_ns;     // bound of every wait
    pyep_u64 counter_bytes;  // tails and heads: the first counter_bytes of every data region
    pyep_u64 head_off;       // offset of the heads array
    pyep_i32 rank;           // this rank's NVLink rank
    pyep_i32 num_channels;   // C
    pyep_i32 ring_slots;     // slots of every ring (num_max_nvl_chunked_recv_tokens)
    pyep_i32 chunk;          // num_max_nvl_chunked_send_tokens (unused: warps publish as they go)
};

// notify: the count exchange of a dispatch.
struct pyep_notify_params {
    struct pyep_ctx ctx;
    pyep_u64 in_rank;              // bool [T, R]
    pyep_u64 per_rank;             // i32 [R]
    pyep_u64 per_expert;           // i32 [E]
    pyep_u64 topk;                 // i64 [T, K], or 0
    pyep_u64 rank_prefix;          // out i32 [R, R]
    pyep_u64 channel_prefix;       // out i32 [R, C]
    pyep_u64 recv_channel_prefix;  // out i32 [R, C]
    pyep_u64 recv_per_expert;      // out i32 [E/R]
    pyep_u64 result;               // NotifyResult in host-mapped memory
    pyep_u64 scratch_off;          // the scratch: R blocks of block_bytes, in every data region
    pyep_u64 block_bytes;
    pyep_i32 num_tokens, num_topk, num_experts, alignment;
    pyep_i32 num_worst;
    // Rows this rank allocated for a dispatch queued before the host learns the counts (0:
    // none). Its data blocks run only if every rank's rows fit (the result's go).
    pyep_i32 capacity;
    // The last get_dispatch_layout's record of a bad index (layout.cu; 0: no layout yet) and
    // its tag: a match fails this dispatch on every rank.
    pyep_u64 layout_rec, layout_tag;
};

// Host-mapped answer of notify; the host waits for tag == seq.
struct pyep_notify_result {
    pyep_u64 tag;
    pyep_i32 num_recv;
    pyep_i32 status;       // a kStatus
    pyep_i32 bad_rank;     // kStatusPeer: the peer; kStatusWorst: the rank receiving most
    pyep_i32 peer_status;  // kStatusPeer: the peer's own status
    pyep_i64 d0, d1, d2;
    pyep_i32 go;  // with a capacity: every rank's rows fit, the speculative dispatch runs
    pyep_i32 pad;
    // followed by i32 per_expert[E/R]
};

struct pyep_dispatch_params {
    struct pyep_ctx ctx;
    pyep_u64 x, x_scales, topk, weights, in_rank, rank_prefix, channel_prefix;
    pyep_u64 recv_x, recv_scales, recv_src, recv_topk, recv_weights, recv_channel_prefix, send_head;
    pyep_u64 off_hidden, off_scales, off_src, off_topk, off_weights;  // slot field arrays, all rings
    pyep_i32 num_tokens, num_experts, num_out_rows;
    // Scale j of token t is word t * scale_token_stride + j * scale_stride of x_scales: DeepEP's
    // callers pass column-major scales (strides 1, num_tokens) as often as row-major ones.
    pyep_i32 scale_token_stride, scale_stride;
    // 1: the kernel begins with the call's two barriers (ctx.seq, ctx.seq + 1) and resets this
    // rank's counters between them (a dispatch without a notify before it: a cached dispatch);
    // 0: the notify before it did (or, in pyep_notify_dispatch, its block 0 does).
    pyep_i32 barriers;
};

// The queued dispatch (pyep_notify_dispatch): notify in block 0, the data blocks after it, into
// num_out_rows = notify.capacity rows; both with the call's ctx.
struct pyep_notify_dispatch_params {
    struct pyep_notify_params notify;
    struct pyep_dispatch_params dispatch;
};

struct pyep_combine_params {
    struct pyep_ctx ctx;
    pyep_u64 x, weights, src_idx, rank_prefix, channel_prefix, send_head, bias0, bias1, out, out_weights;
    pyep_u64 off_row, off_src, off_weights;
    pyep_i32 num_tokens, num_rows, pad0, pad1;
};

// layout.cu's get_dispatch_layout.
struct pyep_layout_params {
    pyep_u64 topk;        // i64 [T, K]
    pyep_u64 per_rank;    // out i32 [R]
    pyep_u64 per_expert;  // out i32 [E]
    pyep_u64 in_rank;     // out bool [T, R]
    pyep_u64 result;      // host-mapped u64 [3], written only on a bad index: tag, token << 32 | choice, value
    pyep_u64 tag;         // this call's, never 0 (a graph's replays repeat it)
    pyep_u64 work;        // the engine's pyep_layout_work
    pyep_u64 timeout_ns;  // bound of the wait for block 0
    pyep_i32 num_tokens, num_topk, num_experts, num_ranks;
};

// layout.cu's workspace (device memory, zero when made): the gate, tag << 32 | the blocks yet to
// pass it, opened by block 0 once the outputs are zero and left closed (a count of 0) by the last
// block through; the lock of the bad-index record.
struct pyep_layout_work {
    pyep_u64 gate;
    pyep_u32 lock, pad;
};

// ---- the device protocol (protocol.cuh's OpError) ----------------------------------------

// A rank's first failure in normal mode, in host-mapped memory (ctx.err); the host reads it at
// its next call.
struct pyep_op_error {
    pyep_u32 code;  // published last
    pyep_i32 op;
    pyep_i32 rank;
    pyep_i32 channel;
    pyep_i32 peer;
    pyep_i32 what;
    pyep_i64 a, b, c;
    pyep_u64 waited_ns;
    pyep_u64 abort_word;  // kAborted: the word the failing peer broadcast
};

// ---- low-latency mode (low_latency.cu's LLParams, LLError) --------------------------------

#define PYEP_LL_SENT_WORDS 16384  // i32 words of a send's counters (goep/cuda/lowlatency's llMaxExperts)

struct pyep_ll_params {
    pyep_u64 peers;        // u64 [num_ranks]: every rank's region base, as mapped here (a remote peer's: its name for
                           // remote_put, remote.cuh)
    pyep_u64 remote;       // i32 [num_ranks]: nonzero where a peer is reached through remote.cuh (PYEP_LL_REMOTE only)
    pyep_u64 err;          // pyep_ll_error, host-mapped
    pyep_u64 timeout_ns;   // bound of every wait
    pyep_u64 calls;        // u64 [2]: calls received per half (this rank's engine memory)
    pyep_u64 counter;      // i32: blocks that started the receive (the last resets it; likewise)
    pyep_u64 expert_sent;  // a combine's: i32 [PYEP_LL_SENT_WORDS], its send's counters (the last count resets
                           // each): blocks done and deferred messages (low_latency_combine.cuh); a dispatch's: 0
    pyep_u64 off_ack;      // u64 [2][R]: ack[h][p], written by p
    pyep_u64 off_mask;     // i32 [R]: 1 where a rank is masked (local)
    pyep_u64 off_dflags;   // u64 [E] of half h: dispatch flags at [j * R + src]
    pyep_u64 off_cflags;   // u64 [E] of half h: combine flags at [src] (the first R)
    pyep_u64 off_ddone;    // u64 [R] of half h: dispatch done at [src], the shares of K a call src's blocks added
    pyep_u64 off_send;     // half h's send area (zero-copy combine rows)
    pyep_u64 off_recv;     // half h's recv area (a dispatch's message bodies from its start)
    pyep_u64 off_heads;    // half h's dispatch message headers (past a combine's rows in the recv area)
    pyep_u64 msg_header;   // a dispatch message header's bytes (low_latency_dispatch.cuh)
    pyep_u64 x, topk_idx, topk_weights;
    pyep_u64 recv_x, recv_scales, src_info, layout_range, count, cum_stats, wait_stats, out;
    pyep_i32 rank, num_ranks, num_experts, max_tokens;
    pyep_i32 num_tokens, half, phases, zero_copy;
    pyep_u64 timeline;  // u64 [blocks][PYEP_LL_STAMPS], host-mapped: a PYEP_LL_TIMELINE build's stamps (else 0, unread)
    pyep_u64 pending;   // u32 [2] (this rank's engine memory): per half, the seq of a call received here whose
                        // acknowledgements the next kernel sends (0: none)
    pyep_u64 off_push;  // half h's push area: the combine's flags [R] (seq << 32 | tokens), then from the next 128
                        // bytes its selections [R][M][11] (int32 expert, float32 weight)
    pyep_u64 dcalls;    // a dispatch's: u64 [2] (this rank's engine memory), the dispatch calls received per half,
                        // which its done words count (a combine's: 0)
    pyep_u64 local;     // this rank's region base (peers[rank]): read from the parameters, not the table, so that a
                        // kernel's first access to its own region waits for no load
};

// The first failed wait of a low-latency call, in host-mapped memory.
struct pyep_ll_error {
    pyep_u32 claimed, code;  // code (1: a wait timed out) is published last
    pyep_i32 peer, what;     // the rank waited for, and for what (kWait*)
    pyep_u64 waited_ns, pad;
};

// ---- the low-latency timeline (a PYEP_LL_TIMELINE build's; issue #18) --------------------
// Thread 0 of every block stores %globaltimer (ns) where a phase of its kernel ends, stamp id of
// block b at timeline[b * PYEP_LL_STAMPS + id]. A kernel's start stamp (send or receive) clears
// that kernel's later stamps, so a 0 is a phase the block did not reach in the last call (a block
// with no token casts nothing); with several batches a block, a batch's stamps replace the
// previous batch's. A stamp is thread 0's view: the block's barriers bound the others.
// X(id, kernel, phase), kernel by kernel in phase order; goep/cuda/lowlatency names them.
#define PYEP_LL_STAMP_LIST(X)                                                                    \
    X(DS_START, "dispatch send", "start")                                                        \
    X(DS_MARKED, "dispatch send", "marked")     /* acknowledgements asked, selections marked */  \
    X(DS_SETTLED, "dispatch send", "settled")   /* a batch's legs, their ranks' answers, bodies' places */ \
    X(DS_CAST, "dispatch send", "cast")         /* thread 0's warp cast and wrote its chunks */  \
    X(DS_COUNTED, "dispatch send", "counted")   /* every selection's slot counted */             \
    X(DS_HEADERS, "dispatch send", "headers")   /* the owned experts' flags, thread 0's header */ \
    X(DS_WRITTEN, "dispatch send", "written")   /* the block's barrier: every row written */     \
    X(DS_FENCED, "dispatch send", "fenced")     /* thread 0's fence before its done add */     \
    X(DS_FLAGGED, "dispatch send", "flagged")   /* thread 0's done add issued */               \
    X(DR_START, "dispatch recv", "start")                                                        \
    X(DR_FLAGS, "dispatch recv", "flags")       /* every done word arrived */                   \
    X(DR_SCANNED, "dispatch recv", "scanned")   /* the messages' headers read (rounds: the last) */ \
    X(DR_COPIED, "dispatch recv", "copied")     /* thread 0's vectors and ranges stored */       \
    X(DR_DONE, "dispatch recv", "done")         /* the receive's end */                         \
    X(CS_START, "combine send", "start")                                                         \
    X(CS_ADMITTED, "combine send", "admitted")  /* acknowledgements awaited */                  \
    X(CS_COPIED, "combine send", "copied")      /* thread 0's rows copied */                    \
    X(CS_WRITTEN, "combine send", "written")    /* the block's barrier: every row written */     \
    X(CS_FLAGGED, "combine send", "flagged")    /* thread 0's fence and flag */                 \
    X(CR_START, "combine recv", "start")                                                         \
    X(CR_SENT, "combine recv", "deferred")      /* the rows its hooked send deferred, sent */   \
    X(CR_FLAGS, "combine recv", "flags")        /* every expert's flag arrived */               \
    X(CR_SUMMED, "combine recv", "summed")      /* thread 0's warp summed its items */          \
    X(CR_DONE, "combine recv", "done")          /* the receive's end */
#define PYEP_LL_STAMP_ID(id, kernel, phase) PYEP_LL_##id,
enum pyep_ll_stamp { PYEP_LL_STAMP_LIST(PYEP_LL_STAMP_ID) PYEP_LL_STAMPS };
#undef PYEP_LL_STAMP_ID

// In a kernel (thread 0 of a block stores, the others pass): PYEP_LL_STAMP(p, id) stores stamp id;
// PYEP_LL_STAMP_START(p, id, last) stores start stamp id and clears id + 1 .. last;
// PYEP_LL_STAMPS_AT_ONCE(p, first, last) stores one time as stamps first .. last (phases that had
// nothing to do). Without PYEP_LL_TIMELINE they are nothing, and p.timeline is never read.
#if defined(PYEP_LL_TIMELINE) && PYEP_LL_TIMELINE
#define PYEP_LL_STAMP_FILL(p, first, last, v)                                                 \
    do {                                                                                      \
        if (threadIdx.x == 0) {                                                               \
            const pyep_u64 pyep_v = (v);                                                      \
            pyep_u64* pyep_row = reinterpret_cast<pyep_u64*>((p).timeline) + blockIdx.x * PYEP_LL_STAMPS; \
            for (int pyep_s = (first); pyep_s <= (last); pyep_s++) pyep_row[pyep_s] = pyep_v; \
        }                                                                                     \
    } while (0)
#define PYEP_LL_STAMP(p, id) PYEP_LL_STAMP_FILL(p, id, id, globaltimer())
#define PYEP_LL_STAMP_START(p, id, last)              \
    do {                                              \
        PYEP_LL_STAMP_FILL(p, (id) + 1, last, 0ull);  \
        PYEP_LL_STAMP(p, id);                         \
    } while (0)
#define PYEP_LL_STAMPS_AT_ONCE(p, first, last) PYEP_LL_STAMP_FILL(p, first, last, globaltimer())
#else
#define PYEP_LL_STAMP(p, id) \
    do {                     \
    } while (0)
#define PYEP_LL_STAMP_START(p, id, last) PYEP_LL_STAMP(p, id)
#define PYEP_LL_STAMPS_AT_ONCE(p, first, last) PYEP_LL_STAMP(p, first)
#endif

#ifdef __cplusplus
#define PYEP_ABI_SIZE(T, n) static_assert(sizeof(T) == n, #T " is laid out as the host expects")
#else
#define PYEP_ABI_SIZE(T, n) _Static_assert(sizeof(T) == n, #T " is laid out as the kernels expect")
#endif
PYEP_ABI_SIZE(struct pyep_ctx, 184);
PYEP_ABI_SIZE(struct pyep_notify_params, 312);
PYEP_ABI_SIZE(struct pyep_notify_result, 56);
PYEP_ABI_SIZE(struct pyep_dispatch_params, 360);
PYEP_ABI_SIZE(struct pyep_notify_dispatch_params, 672);
PYEP_ABI_SIZE(struct pyep_combine_params, 304);
PYEP_ABI_SIZE(struct pyep_layout_params, 80);
PYEP_ABI_SIZE(struct pyep_layout_work, 16);
PYEP_ABI_SIZE(struct pyep_op_error, 64);
PYEP_ABI_SIZE(struct pyep_ll_params, 288);
PYEP_ABI_SIZE(struct pyep_ll_error, 32);
#undef PYEP_ABI_SIZE

#endif  // PYEP_PARAMS_H
