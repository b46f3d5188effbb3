"""Normal mode of pyep.Buffer (get_dispatch_layout, dispatch, cached dispatch, combine), DeepEP V1's methods.

Each call's host time is spent where it must be: Python reads the call's objects into integers (a tensor into the
eight integers of the core's goep.Desc: data_ptr, dtype, device, dimensions, two sizes, two strides), allocates the
outputs with torch (the caching allocator) and builds the returned tuples; the Go core checks every argument once,
with the messages users see, orders the streams and launches. Nothing is checked twice, no DLPack capsule or torch
Stream object is made, and the Go functions are called without gopy's Python wrappers."""
import os
from typing import List, Optional, Tuple, Union

import torch

from . import _core, tuning
from ._ahead import (_JOIN, _ON_COMM, _PREVIOUS, _USE_COUNT, _USUAL, _WAIT, Ahead, _align, _capturing, _current_stream,
                     _handle_layout, _recv_layout, _rows)
from ._internode import tokens_per_node
from ._tensors import (_BOOL, _DTYPE_OF, _DV, _INT32, _ITEMSIZE, _NONE, _desc1, _desc2, _int, _raise_int, modes_on,
                       without_modes)
from .config import Config
from .utils import EventHandle, EventOverlap

# The dtype of expert indices that every API takes (DeepEP's deep_ep.topk_idx_t).
topk_idx_t = torch.int64

_QUEUED_DISPATCH = os.environ.get("PYEP_QUEUED_DISPATCH", "1") != "0"

_go = _core.go


class NormalMode(Ahead):
    """Buffer's normal-mode methods; `_normal_init` sets what they look up once per buffer (and what `Ahead`
    prepares between calls)."""

    def _normal_init(self) -> None:
        self._rid = self.runtime.id
        dev = self.runtime.get_local_device_id()
        self._cuda = dev >= 0
        self._device_index = dev
        self._device = torch.device("cuda", dev) if dev >= 0 else torch.device("cpu")
        self._device_code = _DV[self._device]
        self._multi_domain = self.runtime.get_num_rdma_ranks() > 1
        self._configs = {}  # recommended configs' fields, by (kind, Buffer.num_sms, tuning.generation, channels)
        self._layout = None  # the last layout's tensors and their descriptions (see get_dispatch_layout)
        self._ahead_init()

    # ---- per-call helpers ---------------------------------------------------------------------------------------

    def _fields(self, config: Optional[Config], kind: str, channels: int = 0) -> tuple:
        """The config's five fields; for None the recommended one's, looked up again only after set_num_sms or a
        tuning file's save or clear_cache (combine's with the handle's SM count: it runs on the dispatch's channels)."""
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"config must be a pyep.Config, got {type(config).__name__}")
            return (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                    config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
        key = (kind, type(self).num_sms, tuning.generation, channels)
        fields = self._configs.get(key)
        if fields is None:
            if kind == "dispatch":
                fields = self.get_dispatch_config(self.group_size)._fields()
            elif kind == "dispatch_fp8":
                fields = self._get_dispatch_fp8_config(self.group_size)._fields()
            else:
                fields = (2 * channels,) + self.get_combine_config(self.group_size)._fields()[1:]
            self._configs[key] = fields
        return fields

    def _order(self, previous_event: Optional[EventOverlap], async_finish: bool,
               allocate_on_comm_stream: bool) -> Tuple[int, int, int]:
        """The stream, event and flags of goep.StreamOrder (DeepEP's stream semantics: the work waits for
        previous_event, or else the current stream; the current stream waits for it unless async_finish)."""
        stream = _current_stream(self._device_index) if self._cuda else 0
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            return stream, 0, _USUAL  # the usual call, first
        flags = (0 if async_finish else _JOIN) | (_ON_COMM if allocate_on_comm_stream else 0)
        if previous_event is None:
            return stream, 0, flags | _WAIT
        if not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
        flags |= _PREVIOUS
        handle = previous_event.event
        if handle is None or handle.event is None:
            return stream, 0, flags | _WAIT
        if not self._cuda:
            handle.event.synchronize()  # the cpu backend's calls run on the host
            return stream, 0, flags
        return stream, handle.event.cuda_event, flags

    def _empty(self, flags: int, size: Union[int, Tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        if flags & _ON_COMM and self._cuda:
            with torch.cuda.stream(self.get_comm_stream()):
                return torch.empty(size, dtype=dtype, device=self._device)
        return torch.empty(size, dtype=dtype, device=self._device)

    def _finish(self, async_finish: bool, flags: int, tensors: tuple) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)  # the kernels ran on the current stream, or the core made it wait for them
        if not self._cuda:
            # The cpu backend has finished when its call returns: the event is already complete.
            return EventOverlap(EventHandle(), tensors)
        # The tensors stay allocated until the communication stream is past this call (and, when they were
        # allocated there, until the compute stream is past what it has queued so far).
        comm = self.get_comm_stream()
        compute = torch.cuda.current_stream() if flags & _ON_COMM else None
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(comm)
                if compute is not None:
                    t.record_stream(compute)
        return EventOverlap(EventHandle(stream=comm), tensors)

    def _rows_block(self, flags: int, rows: int, H: int, xt: int, words: int) -> Tuple[torch.Tensor, int]:
        """One allocation for `rows` rows of H elements of dtype code xt and, if words, `rows` x `words` 4-byte words
        after them (scales, weights): the block (the rows themselves when words is 0) and the words' byte offset."""
        if not words:
            return self._empty(flags, (rows, H), _DTYPE_OF.get(xt, torch.uint8)), 0
        at = _align(rows * H * _ITEMSIZE.get(xt, 1))
        return self._empty(flags, (at + _align(rows * words * 4)) // 4, torch.float32), at

    def _handle_meta(self, handle: object) -> tuple:
        """(identity, num_tokens, channels, rows, the data addresses of the six tensors) of a handle that this buffer's
        dispatch returned. The core takes a handle's tensors as bare addresses: its first tensor carries the identity
        of the buffer and of the others, so that only the tuple this buffer returned passes."""
        try:  # the usual handle in one go: unpacking and attribute errors fall through to the checks below
            t0, t1, t2, t3, t4, t5 = handle
            tag = t0._pyep_handle
            if tag[0] == (self._rid, id(t1), id(t2), id(t3), id(t4), id(t5)):
                return tag
        except (TypeError, ValueError, AttributeError):
            pass
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            raise ValueError("handle: expected the 6-tuple returned by this buffer's dispatch")
        raise ValueError("handle: not returned by a dispatch of this buffer (a handle of another buffer?)")

    def _remember(self, handle: tuple, T: int, C: int, rows: int, addresses: tuple) -> tuple:
        """Tags a handle with its identity, sizes and the data addresses of its six tensors (see _handle_meta)."""
        handle[0]._pyep_handle = ((self._rid, id(handle[1]), id(handle[2]), id(handle[3]), id(handle[4]), id(handle[5])),
                                  T, C, rows) + addresses
        return handle

    # ---- the API -----------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """
        Calculates the layout a dispatch needs from each token's experts.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `pyep.topk_idx_t` (`torch.int64`), the expert of each of a token's
                top-k choices, `-1` for none; experts are split evenly, rank r holding
                `[r * num_experts / num_ranks, (r + 1) * num_experts / num_ranks)`. An index out of range raises
                ValueError here on the cpu backend; on cuda (which does not wait for the GPU) the next dispatch
                raises it, on every rank.
            num_experts: the number of experts, a multiple of the number of ranks.
            previous_event: an event to wait for before the computation.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the tokens sent to each rank.
            num_tokens_per_rdma_rank: None within one node; across nodes `[num_rdma_ranks]` with `torch.int`, the tokens
                with at least one of their experts on each node.
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the tokens sent to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            event: the event of the computation (set when `async_finish`).
        """
        if modes_on():
            with without_modes():
                return self.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                allocate_on_comm_stream)
        tp, tt, tv, tn, T, t1, ts0, ts1 = _desc2("topk_idx", topk_idx)
        E = num_experts if type(num_experts) is int else _int("num_experts", num_experts, 1)
        stream, event, flags = self._order(previous_event, async_finish, allocate_on_comm_stream)
        R = self.group_size
        # per_rank [R] and per_expert [E] int32, then in_rank [T, R] bool, in one allocation: the last layout's when
        # nothing else holds it (see _reusable_layout).
        at_in_rank = _align(4 * (R + max(E, 0)))
        key = (T, E, stream) if flags == _USUAL and _USE_COUNT is not None and not self._multi_domain else None
        if key is not None and self._cuda and _capturing():
            key = None  # a graph's memory: never handed out again
        # The usual call after a usual dispatch also makes room, after in_rank, for the int32s of the handle of the
        # next dispatch like it (which holds in_rank, so this memory lives no longer than it would anyway).
        nxt = self._next_dispatch if key is not None and E > 0 and E % R == 0 else None
        at_handle = at_in_rank + _align(T * R)
        cap = self._queued_capacity(R, T) if nxt is not None else 0  # the next dispatch's rows
        room = _handle_layout(R, nxt[0], T, cap, E // R)[6] if nxt is not None else 0
        if key is not None:
            key += (room,)
            self._drop_combine_plan()  # a planned combine's handle holds the last in_rank
        lay = self._layout
        block = None
        if key is not None and lay is not None and lay[8] == key and self._reusable_layout(lay):
            base = lay[4][0]
        else:
            block = self._empty(flags, at_handle // 4 + room, torch.int32)
            base = block.data_ptr()
        try:
            _go.Layout(self._rid, E, tp, tt, tv, tn, T, t1, ts0, ts1, base, base + 4 * R, base + at_in_rank,
                       stream, event, flags)
        except RuntimeError as e:
            raise _core.error(e) from None
        # Launched: the next dispatch's rows, allocated while the kernel runs (see _take_rows_ahead); those of the
        # layout before when no dispatch took them and they fit (a layout again).
        ahead, self._rows_ahead = self._rows_ahead, None
        self._cached_block = None  # kept for a cached dispatch right after one only (_cached_rows)
        if nxt is not None:
            n = _recv_layout(cap, *nxt[1:4])[4]
            if ahead is None or ahead[1] != n or ahead[2] != stream:
                ahead = None  # let go first: its memory may serve this call
                ahead = (torch.empty(n, dtype=torch.float32, device=self._device), n, stream, None)
            self._rows_ahead = ahead
        if block is None:
            per_rank, per_expert, in_rank = lay[0], lay[1], lay[2]
        else:
            per_rank = block.as_strided((R,), (1,), 0)
            per_expert = block.as_strided((E,), (1,), R)
            in_rank = _rows(block.view(torch.bool), at_in_rank, T, R)
            del block
        per_rdma_rank = tokens_per_node(topk_idx, E, self.runtime.get_num_rdma_ranks()) if self._multi_domain else None
        # A dispatch that gets these tensors back unchanged (the same objects, their version counters where they were)
        # takes their descriptions from here instead of reading them again: a description costs about a microsecond.
        dev = self._device_code
        self._layout = (per_rank, per_expert, in_rank, in_rank._version,
                        (base, _INT32, dev, 1, R, 0, 1, 0, base + 4 * R, _INT32, dev, 1, E, 0, 1, 0,
                         base + at_in_rank, _BOOL, dev, 2, T, R, R, 1),
                        topk_idx, topk_idx._version, (tp, tt, tv, tn, T, t1, ts0, ts1),
                        key, None if key is None else _USE_COUNT(in_rank.untyped_storage()._cdata), at_handle, room)
        if nxt is not None:  # the next dispatch, planned with those rows (or still planned so)
            self._rows_ahead = ahead[:3] + (self._plan_dispatch(self._layout, nxt, cap, stream, ahead[3]),)
        return per_rank, per_rdma_rank, per_expert, in_rank, self._finish(
            async_finish, flags, (topk_idx, per_rank, per_expert, in_rank))

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """
        Sends every token to the ranks that hold its experts (a collective call). Received tokens are ordered by
        source rank, then by the source's token index.

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16` (rows move as bytes: any dtype works, as in DeepEP), or a
                tuple of `[num_tokens, hidden]` with `torch.float8_e4m3fn` (or another 1-byte dtype) and its scales
                `[num_tokens, hidden // 128]` with `torch.float` (or `torch.int`, packed UE8M0), row-major or column-major
                (strides `(1, num_tokens)`, as `scales.T.contiguous().T` and DeepGEMM's TMA-aligned scales, whose larger
                stride may be padded).
            handle: the handle of an earlier dispatch to reuse its layout (cached mode: the same tokens go to the same
                ranks; the top-k arguments must be None, the layout tensors are ignored); the tuple (or a list of it).
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, from `get_dispatch_layout`.
            num_tokens_per_rdma_rank: `[num_rdma_ranks]` with `torch.int` across NVLink domains; ignored within one, as
                by DeepEP (`get_dispatch_layout` returns None there).
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, from `get_dispatch_layout`.
            num_tokens_per_expert: `[num_experts]` with `torch.int`, from `get_dispatch_layout`.
            topk_idx: `[num_tokens, num_topk]` with `pyep.topk_idx_t`, the experts of each token (-1 for none), or None.
            topk_weights: `[num_tokens, num_topk]` with `torch.float`, the weights of those experts (with topk_idx).
            expert_alignment: the received token count of each local expert is aligned up to this.
            num_worst_tokens: if positive, the outputs have exactly this many rows (the received tokens first, then
                padding with `recv_topk_idx` -1) and `num_recv_tokens_per_expert_list` is empty; every rank must receive
                at most this many tokens.
            config: the performance config; `get_dispatch_config(num_ranks)` when None.
            previous_event: an event to wait for before the dispatch.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            recv_x: the received tokens, the same type (tensor or tuple) as `x`, `[num_recv_tokens, hidden]` (a view of
                rows allocated for the most this rank could receive; see the README, PYEP_QUEUED_DISPATCH); received
                scales are row-major `[num_recv_tokens, hidden // 128]` of the scales' dtype, as DeepEP's.
            recv_topk_idx: `[num_recv_tokens, num_topk]` with `pyep.topk_idx_t`: the local expert index on this rank,
                -1 for experts elsewhere (None in cached mode or without topk_idx).
            recv_topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, 0 where the index is -1 (None likewise).
            num_recv_tokens_per_expert_list: a list of `num_local_experts` ints, the tokens each local expert receives,
                each aligned up to `expert_alignment` (empty with num_worst_tokens; None in cached mode).
            handle: `(rank_prefix_matrix [num_ranks, num_ranks] int32, channel_prefix_matrix [num_ranks, num_channels]
                int32, recv_channel_prefix_matrix [num_ranks, num_channels] int32, recv_src_idx [num_recv_tokens] int32,
                is_token_in_rank [num_tokens, num_ranks] bool, send_head [num_tokens, num_ranks] int32)`, for `combine`
                and cached dispatch (None in cached mode). Pass the tuple itself: only it is accepted. Its int32
                tensors are views of one allocation; recv_x, its scales, recv_topk_idx and recv_topk_weights of another.
            event: the event of the dispatch (set when `async_finish`).
        """
        if modes_on():
            with without_modes():
                return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                     num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                     config, previous_event, async_finish, allocate_on_comm_stream)
        ahead = self._rows_ahead
        if handle is None:
            self._cached_block = None  # kept for a cached dispatch right after one only (_cached_rows)
        if ahead is not None and ahead[3] is not None:
            lay = self._layout
            if (handle is None and topk_idx is lay[5] and num_tokens_per_rank is lay[0]
                    and num_tokens_per_expert is lay[1] and is_token_in_rank is lay[2] and num_tokens_per_rdma_rank is None
                    and config is None and previous_event is None and not async_finish and not allocate_on_comm_stream
                    and num_worst_tokens == 0 and type(num_worst_tokens) is int and topk_idx._version == lay[6]
                    and is_token_in_rank._version == lay[3]):
                done = self._dispatch_planned(ahead[3], x, topk_weights, expert_alignment, is_token_in_rank)
                if done is not None:
                    return done
        if self._multi_domain:
            return self.internode_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, config,
                                           previous_event, async_finish, allocate_on_comm_stream)
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x: a tuple of {len(x)}, expected a tensor or the pair (x, x_scales)")
            x, scales = x
        else:
            scales = None
        if handle is not None:
            return self._dispatch_cached(x, scales, handle, topk_idx, topk_weights, config, previous_event, async_finish,
                                         allocate_on_comm_stream)
        self._drop_combine_plan()  # a planned combine's handle holds the last handle's block
        f0, f1, f2, f3, f4 = self._fields(config, "dispatch" if scales is None else "dispatch_fp8")
        stream, event, flags = self._order(previous_event, async_finish, allocate_on_comm_stream)
        xp, xt, xv, xn, T, H, xs0, xs1 = _desc2("x" if scales is None else "x[0]", x)
        sp, st, sv, sn, s0, S, ss0, ss1 = _desc2("x[1]", scales)
        wp, wt, wv, wn, w0, w1, ws0, ws1 = _desc2("topk_weights", topk_weights)
        lay = self._layout
        if lay is not None and topk_idx is lay[5] and topk_idx._version == lay[6]:
            ip, it, iv, in_, i0, K, is0, is1 = lay[7]
        else:
            ip, it, iv, in_, i0, K, is0, is1 = _desc2("topk_idx", topk_idx)
        if (lay is not None and num_tokens_per_rank is lay[0] and num_tokens_per_expert is lay[1]
                and is_token_in_rank is lay[2] and is_token_in_rank._version == lay[3]):
            (rp, rt, rv, rn, r0, r1, rs0, rs1, ep, et, ev, en, E, e1, es0, es1,
             gp, gt, gv, gn, g0, g1, gs0, gs1) = lay[4]
        else:
            lay = None  # not the last layout's tensors: no handle room
            rp, rt, rv, rn, r0, r1, rs0, rs1 = _desc1("num_tokens_per_rank", num_tokens_per_rank)
            ep, et, ev, en, E, e1, es0, es1 = _desc1("num_tokens_per_expert", num_tokens_per_expert)
            gp, gt, gv, gn, g0, g1, gs0, gs1 = _desc2("is_token_in_rank", is_token_in_rank)
        R, C, rid = self.group_size, f0 // 2, self._rid
        row_bytes, per_expert = H * _ITEMSIZE.get(xt, 1), E // R
        counts = self._counts_for(per_expert)
        queued = _QUEUED_DISPATCH and num_worst_tokens == 0 and type(num_worst_tokens) is int
        # The handle's int32 tensors in one allocation, the received rows' tensors in another: a handle kept for
        # combine holds no recv_x. A queued dispatch allocates rows for the most this rank can receive when every
        # rank has as many tokens (or the most seen before); with num_worst_tokens, that many.
        if queued:
            rows = self._queued_capacity(R, T)
        else:
            rows = num_worst_tokens if type(num_worst_tokens) is int and num_worst_tokens > 0 else 0
            self._rows_ahead = None
        hl = _handle_layout(R, C, T, rows, per_expert)
        # The handle's int32s go in the room their layout made when it is big enough and no other tensor is on the
        # layout's memory (no handle of an earlier dispatch with the same layout); else in a block of their own.
        if (flags == _USUAL and lay is not None and lay[11] >= hl[6]
                and _USE_COUNT(is_token_in_rank.untyped_storage()._cdata) == lay[9]):
            hb, h0 = num_tokens_per_rank, lay[10]
        else:
            hb, h0 = self._int32_block(flags, stream, hl[6]), 0
        h = hb.data_ptr() + h0
        rl = rb = None
        try:
            if queued:
                rl = _recv_layout(rows, row_bytes, S, K)
                rb = self._take_rows_ahead(flags, stream, rl[4])
                r = rb.data_ptr()
                n = _go.DispatchQueued(
                    rid, f0, f1, f2, f3, f4, expert_alignment, rows, xp, xt, xv, xn, T, H, xs0, xs1,
                    sp, st, sv, sn, s0, S, ss0, ss1, ip, it, iv, in_, i0, K, is0, is1, wp, wt, wv, wn, w0, w1, ws0, ws1,
                    rp, rt, rv, rn, r0, r1, rs0, rs1, ep, et, ev, en, E, e1, es0, es1, gp, gt, gv, gn, g0, g1, gs0, gs1,
                    h, h + 4 * hl[1], h + 4 * hl[2], h + 4 * hl[5], h + 4 * hl[3], counts,
                    r, r + rl[1] if S else 0, h + 4 * hl[4], r + rl[2] if K else 0, r + rl[3] if K else 0,
                    stream, event, flags)
                ran, out = n >= 0, (n if n >= 0 else -n - 1)
            else:
                out = _go.DispatchNotify(
                    rid, f0, f1, f2, f3, f4, expert_alignment, num_worst_tokens, xp, xt, xv, xn, T, H, xs0, xs1,
                    sp, st, sv, sn, s0, S, ss0, ss1, ip, it, iv, in_, i0, K, is0, is1, wp, wt, wv, wn, w0, w1, ws0, ws1,
                    rp, rt, rv, rn, r0, r1, rs0, rs1, ep, et, ev, en, E, e1, es0, es1, gp, gt, gv, gn, g0, g1, gs0, gs1,
                    h, h + 4 * hl[1], h + 4 * hl[2], h + 4 * hl[5], h + 4 * hl[3], counts, stream, event, flags)
                ran = False
        except RuntimeError as e:
            raise _core.error(e) from None
        except TypeError as e:
            _raise_int(e, expert_alignment=(expert_alignment, 1), num_worst_tokens=(num_worst_tokens, 0))
        if queued and flags == _USUAL:
            self._next_dispatch = (C, row_bytes, S, K, scales is not None)
        return self._dispatch_outputs(
            ran, out, queued, rows, rb, rl, hb, h0, hl, flags, stream, T, H, R, C, xt, st, S, K, scales, per_expert,
            row_bytes, gp, is_token_in_rank, num_worst_tokens, async_finish,
            (x, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, hb))

    def _dispatch_outputs(self, ran, out, queued, rows, rb, rl, hb, h0, hl, flags, stream, T, H, R, C, xt, st, S, K,
                          scales, per_expert, row_bytes, gp, in_rank, num_worst_tokens, async_finish, keep):
        """A dispatch after its notify (and its data phase when `ran`, into the `rows` rows of rb laid out as rl): the
        data phase into exact rows when it did not run, then its outputs (its handle's int32s in hb from byte h0,
        laid out as hl), the combine prepared and planned, and the returned tuple (`keep`: what an async_finish
        event holds)."""
        src_block, src_at = hb, h0 + 4 * hl[4]
        if not ran:
            # The data phase into exact rows: the count was not known, or exceeded the rows allocated.
            if queued:
                self._queued_rows = max(self._queued_rows, out)
            rl = _recv_layout(out, row_bytes, S, K)
            rb = self._empty(flags, rl[4], torch.float32)
            r = rb.data_ptr()
            if out > rows:
                src_block, src_at = self._empty(flags, max(out, 1), torch.int32), 0
            try:
                _go.DispatchRecv(self._rid, out, r, r + rl[1] if S else 0, src_block.data_ptr() + src_at,
                                 r + rl[2] if K else 0, r + rl[3] if K else 0, stream, flags)
            except RuntimeError as e:
                raise _core.error(e) from None
        self._prepare_combine(flags, stream, T, H)
        dtype = _DTYPE_OF[xt]
        recv_x = _rows(rb if dtype is torch.float32 else rb.view(dtype), 0, out, H)
        recv = recv_x if scales is None else (recv_x, _rows(rb if st != _INT32 else rb.view(torch.int32), rl[1], out, S))
        recv_topk_idx = _rows(rb.view(torch.int64), rl[2], out, K) if K else None
        recv_topk_weights = _rows(rb, rl[3], out, K) if K else None
        h = hb.data_ptr() + h0
        src = (h - h0 if src_block is hb else src_block.data_ptr()) + src_at
        handle = self._remember((_rows(hb, h0, R, R), _rows(hb, h0 + 4 * hl[1], R, C), _rows(hb, h0 + 4 * hl[2], R, C),
                                 src_block.as_strided((out,), (1,), src_at // 4), in_rank,
                                 _rows(hb, h0 + 4 * hl[3], T, R)), T, C, out,
                                (h, h + 4 * hl[1], h + 4 * hl[2], src, gp, h + 4 * hl[3]))
        self._plan_combine(handle)
        per_expert_list = [] if num_worst_tokens else self._counts[:per_expert].tolist()
        return recv, recv_topk_idx, recv_topk_weights, per_expert_list, handle, self._finish(
            async_finish, flags, keep + (rb, src_block))

    def _dispatch_cached(self, x, scales, handle, topk_idx, topk_weights, config, previous_event, async_finish,
                         allocate_on_comm_stream):
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("topk_idx, topk_weights: must be None with a handle (cached dispatch)")
        self._rows_ahead = None  # the layout's rows ahead are for a dispatch with a layout
        _, T, C, rows, rank_prefix, channel_prefix, _, _, in_rank, _ = self._handle_meta(handle)
        f0, f1, f2, f3, f4 = self._fields(config, "dispatch" if scales is None else "dispatch_fp8")
        stream, event, flags = self._order(previous_event, async_finish, allocate_on_comm_stream)
        xp, xt, xv, xn, xT, H, xs0, xs1 = _desc2("x" if scales is None else "x[0]", x)
        sp, st, sv, sn, s0, S, ss0, ss1 = _desc2("x[1]", scales)
        dtype = _DTYPE_OF.get(xt, torch.uint8)
        block, at_scales = self._cached_rows(flags, stream, rows, H, xt, 0 if scales is None else S)
        r = block.data_ptr()
        try:
            _go.DispatchCached(self._rid, f0, f1, f2, f3, f4, xp, xt, xv, xn, xT, H, xs0, xs1, sp, st, sv, sn, s0, S, ss0,
                               ss1, T, C, rows, rank_prefix, channel_prefix, in_rank, r, r + at_scales if S else 0,
                               stream, event, flags)
        except RuntimeError as e:
            raise _core.error(e) from None
        self._prepare_combine(flags, stream, T, H)
        self._plan_combine(handle)
        # Views only: the block may serve the next cached dispatch once they are dropped (_cached_rows).
        if scales is not None and S:
            recv = (_rows(block.view(dtype), 0, rows, H),
                    _rows(block if st != _INT32 else block.view(torch.int32), at_scales, rows, S))
        elif scales is not None:
            recv = (_rows(block, 0, rows, H), block.new_empty((rows, 0), dtype=_DTYPE_OF.get(st, torch.float32)))
        else:
            recv = _rows(block, 0, rows, H)
        return recv, None, None, None, None, self._finish(async_finish, flags, (x, scales, handle[0], handle[1],
                                                                                 handle[4], block))

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """
        Sends the expert outputs back to the ranks their tokens came from and sums them there (without weights;
        a collective call).

        Arguments:
            x: `[num_recv_tokens, hidden]` with `torch.bfloat16` (on the cpu backend also `torch.float16`/`torch.float32`),
                the rows received by the dispatch, in its order (padding rows of num_worst_tokens are ignored).
            handle: the handle returned by the dispatch (the tuple, or a list of it).
            topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, weights to reduce alongside, or None.
            bias: None, one or a pair of `[num_tokens, hidden]` tensors of x's dtype, added to every combined token.
            config: the performance config; when None, `get_combine_config(num_ranks)` with the dispatch's `num_sms`.
            previous_event: an event to wait for before the combine.
            async_finish: whether to return an event instead of making the current stream wait.
            allocate_on_comm_stream: whether the outputs belong to the communication stream (needs previous_event
                and async_finish).

        Returns:
            combined_x: `[num_tokens, hidden]` of x's dtype: per token, the sum of the copies returned by each rank
                it was sent to (summed in float32, rounded once), plus the bias.
            combined_topk_weights: `[num_tokens, num_topk]` with `torch.float`, the summed weights (None without
                topk_weights).
            event: the event of the combine (set when `async_finish`).
        """
        if modes_on():
            with without_modes():
                return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                    allocate_on_comm_stream)
        if self._multi_domain:
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        self._cached_block = None  # kept for a cached dispatch right after one only (_cached_rows)
        ahead = self._combine_ahead
        if (ahead is not None and handle is ahead[3] and bias is None and config is None and previous_event is None
                and not async_finish and not allocate_on_comm_stream):
            done = self._combine_planned(ahead, x, topk_weights)
            if done is not None:
                return done
        _, T, C, rows, rank_prefix, _, recv_channel_prefix, src_idx, _, send_head = self._handle_meta(handle)
        f0, f1, f2, f3, f4 = self._fields(config, "combine", C)
        stream, event, flags = self._order(previous_event, async_finish, allocate_on_comm_stream)
        xp, xt, xv, xn, x0, H, xs0, xs1 = _desc2("x", x)
        wp, wt, wv, wn, w0, K, ws0, ws1 = _desc2("topk_weights", topk_weights)
        if bias is None:
            bias0 = bias1 = None
            ap, at, av, an, a0, a1, as0, as1 = bp, bt, bv, bn, b0, b1, bs0, bs1 = _NONE
        else:
            if not isinstance(bias, tuple):
                bias0, bias1 = bias, None
            elif len(bias) > 2:
                raise ValueError(f"bias: expected None, a tensor or a pair of tensors, got {len(bias)} tensors")
            else:
                bias0, bias1 = tuple(bias) + (None,) * (2 - len(bias))
            ap, at, av, an, a0, a1, as0, as1 = _desc2("bias[0]", bias0)
            bp, bt, bv, bn, b0, b1, bs0, bs1 = _desc2("bias[1]", bias1)
        dtype = _DTYPE_OF.get(xt, torch.uint8)
        Kw = 0 if topk_weights is None else K
        ahead, self._combine_ahead = self._combine_ahead, None
        if ahead is not None and flags == _USUAL and ahead[2] == (T, H, xt, Kw, stream) and not (
                self._cuda and _capturing()):
            block, at_weights = ahead[0], ahead[1]
        else:
            ahead = None  # let go first: its memory may serve this call
            block, at_weights = self._rows_block(flags, T, H, xt, Kw)
        combined_x, out = block, block.data_ptr()
        try:
            _go.Combine(self._rid, f0, f1, f2, f3, f4, xp, xt, xv, xn, x0, H, xs0, xs1, wp, wt, wv, wn, w0, K, ws0, ws1,
                        ap, at, av, an, a0, a1, as0, as1, bp, bt, bv, bn, b0, b1, bs0, bs1, T, C, rows, src_idx,
                        rank_prefix, recv_channel_prefix, send_head, out, out + at_weights if K else 0,
                        stream, event, flags)
        except RuntimeError as e:
            raise _core.error(e) from None
        if flags == _USUAL:
            self._next_combine = (xt, Kw)
        combined_weights = None
        if topk_weights is not None:
            combined_x = _rows(block.view(dtype), 0, T, H)
            combined_weights = _rows(block, at_weights, T, K)
        return combined_x, combined_weights, self._finish(
            async_finish, flags, (x, topk_weights, bias0, bias1) + tuple(handle) + (block,))
