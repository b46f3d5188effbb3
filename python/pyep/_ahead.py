"""What a normal-mode call prepares for the next call of an MoE layer, after its own launch, while its kernel runs.

A layer calls get_dispatch_layout, then its dispatch, then the combine of that dispatch's handle. Each call knows the
shapes of the next one, so the usual call (on the caller's stream: no previous_event, async_finish or
allocate_on_comm_stream) prepares it:
- a layout writes its last block again when nothing holds it, and makes room in it for the next dispatch's handle;
- a layout allocates the next dispatch's received rows ("rows ahead"), a dispatch the next combine's outputs;
- a layout plans the next dispatch, and a dispatch the next combine, in the core (goep's plans): every argument but
  the tensors the model makes in between, so that the planned call passes a third of the integers across gopy and
  its Python reads only those tensors.
A call that is not the one prepared lets what was prepared go and runs as before. PYEP_PLANS=0 turns the plans off
(for measuring them); what is allocated ahead stays."""
import array
import functools
import os
import sys
from typing import Optional, Tuple

import torch

from . import _core, tuning
from ._tensors import _DT, _DTYPE_OF, _DV, _ITEMSIZE, _NONE, _raise_int
from .utils import EventOverlap

_PLANS = os.environ.get("PYEP_PLANS", "1") != "0"

# goep.StreamOrder's flags.
_WAIT, _JOIN, _ON_COMM, _PREVIOUS = 1, 2, 4, 8
_USUAL = _WAIT | _JOIN  # no previous_event, async_finish or allocate_on_comm_stream

# How many tensors share a storage (a private torch function; without it no layout's outputs are reused).
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_refcount = sys.getrefcount
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_go = _core.go


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


@functools.lru_cache(maxsize=256)
def _handle_layout(R: int, C: int, T: int, rows: int, per_expert: int) -> Tuple[int, ...]:
    """Offsets (in int32s) of rank_prefix_matrix [R, R], channel_prefix_matrix and recv_channel_prefix_matrix
    [R, C], send_head [T, R], recv_src_idx [rows] and num_recv_tokens_per_expert in a handle's int32 block, each on
    a 256-byte boundary, and the block's int32s."""
    offsets, end = [], 0
    for n in (R * R, R * C, R * C, T * R, rows, per_expert):
        offsets.append(end)
        end += _align(4 * n) // 4
    return tuple(offsets) + (max(end, 64),)


@functools.lru_cache(maxsize=256)
def _recv_layout(rows: int, row_bytes: int, S: int, K: int) -> Tuple[int, ...]:
    """Byte offsets of recv_x [rows, row_bytes], its scales [rows, S] float32, recv_topk_idx [rows, K] int64 and
    recv_topk_weights [rows, K] float32 in one block, each on a 256-byte boundary, and the block's float32s (the
    block's type: the views of scales and weights need no view of its type)."""
    offsets, end = [], 0
    for n in (rows * row_bytes, rows * S * 4, rows * K * 8, rows * K * 4):
        offsets.append(end)
        end += _align(n)
    return tuple(offsets) + (max(end, 256) // 4,)


def _rows(typed: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    """The row-major [rows, cols] tensor at byte offset of a block viewed as typed."""
    return typed.as_strided((rows, cols), (cols, 1), offset // typed.itemsize)


class Ahead:
    """NormalMode's preparation of the next call; `_ahead_init` sets its state."""

    def _ahead_init(self) -> None:
        self._queued_rows = 0  # the most rows a queued dispatch of this rank had to redo
        self._handle_block = None  # the last dispatch's handle block, its key and storage use count (_kept_block)
        self._cached_block = None  # the last cached dispatch's rows, likewise, until another call (_cached_rows)
        # What the next dispatch will likely be, from the last usual one: (channels, row bytes, scales, top-k, FP8),
        # for the layout's handle room and rows ahead; and those rows: (block, float32s, stream, its plan or None).
        self._next_dispatch = None
        self._rows_ahead = None
        # What the next combine will likely be, from the last usual one: (dtype code, top-k of its weights or 0); and
        # its outputs' block that a usual dispatch allocated after its launch: (block, the weights' byte offset,
        # (T, H, dtype code, top-k, stream), and when planned the handle, the plan's number, (H, dtype code, top-k,
        # stream) and (num_sms, tuning generation); else four None).
        self._next_combine = None
        self._combine_ahead = None
        self._plan_number = 0
        self._counts = array.array("i", bytes(4 * 64))  # num_recv_tokens_per_expert, written by the core

    @staticmethod
    def _reusable_layout(lay: tuple) -> bool:
        """Whether nothing but `lay` (the last layout's record) holds its outputs: no reference to the three tensors
        (the tuple's and getrefcount's own are the two counted) and no other tensor on their memory (a view or a
        handle's is_token_in_rank: the storage's use count as when they were made). The usual call on the same stream
        may then write them again instead of allocating: the caching allocator would hand that memory to the same
        stream, in the same order, once they were freed."""
        return (_refcount(lay[0]) == 2 and _refcount(lay[1]) == 2 and _refcount(lay[2]) == 2
                and _USE_COUNT(lay[2].untyped_storage()._cdata) == lay[9])

    @staticmethod
    def _let_go(kept: Optional[tuple], key: tuple) -> bool:
        """Whether `kept` (a block, its key, its storage's use count when made) has `key` and nothing but `kept` holds
        its block any more: no reference (the tuple's and getrefcount's own are the two counted) and no tensor on its
        memory (a view), as _reusable_layout decides for a layout."""
        return (kept is not None and kept[1] == key and _refcount(kept[0]) == 2
                and _USE_COUNT(kept[0].untyped_storage()._cdata) == kept[2])

    def _kept_block(self, name: str, flags: int, key: tuple, make) -> torch.Tensor:
        """The memory of a call's outputs: the usual call (not during a CUDA graph capture) gets the block of the last
        call like it (kept in attribute `name`, with the same `key`: sizes and stream) back once the caller let it go,
        as the caching allocator would hand it to the same stream, without the allocator's 2-4 µs; else `make()`'s new
        block, kept for next time. The block itself never leaves: callers get views of it."""
        kept = getattr(self, name)
        if flags != _USUAL or _USE_COUNT is None or (self._cuda and _capturing()):
            return make()
        if self._let_go(kept, key):
            return kept[0]
        setattr(self, name, None)
        del kept  # let go first: its memory may serve this call
        block = make()
        setattr(self, name, (block, key, _USE_COUNT(block.untyped_storage()._cdata)))
        return block

    def _int32_block(self, flags: int, stream: int, n: int) -> torch.Tensor:
        """n int32s for a dispatch's handle: the last handle's block when the handle was dropped (_kept_block). A
        handle is small (its largest part is R int32s a token), so keeping it costs little memory."""
        return self._kept_block("_handle_block", flags, (n, stream),
                                lambda: torch.empty(n, dtype=torch.int32, device=self._device))

    def _cached_rows(self, flags: int, stream: int, rows: int, H: int, xt: int, words: int) -> Tuple[torch.Tensor, int]:
        """A cached dispatch's received rows (as _rows_block lays them out): the last cached dispatch's block when its
        outputs were dropped (_kept_block). The block is kept only from one cached dispatch to the next: a layout,
        another dispatch or a combine lets it go (combine, dispatch and get_dispatch_layout in _normal.py), so that
        a training step's backward (a cached dispatch, the experts holding its rows, the combine) keeps no rows that
        the caller let go, as DeepEP keeps none."""
        at = _align(rows * H * _ITEMSIZE.get(xt, 1)) if words else 0
        return self._kept_block("_cached_block", flags, (rows, H, xt, words, stream),
                                lambda: self._rows_block(flags, rows, H, xt, words)[0]), at

    def _queued_capacity(self, R: int, T: int) -> int:
        """The rows a queued dispatch of T tokens allocates: the most this rank receives when every rank has as many
        tokens, or the most it had to redo before."""
        return max(R * T, self._queued_rows, 1)

    def _take_rows_ahead(self, flags: int, stream: int, n: int) -> torch.Tensor:
        """n float32s for a queued dispatch's rows: those the layout allocated ahead when they are that many on this
        stream and the call is the usual one, else new ones (the ones ahead are let go either way)."""
        ahead, self._rows_ahead = self._rows_ahead, None
        if ahead is not None and ahead[1] == n and ahead[2] == stream and flags == _USUAL:
            return ahead[0]
        del ahead  # let go first: its memory may serve this call
        return self._empty(flags, n, torch.float32)

    def _counts_for(self, n: int) -> int:
        """The address of room for n int32 counts."""
        if len(self._counts) < n:
            self._counts = array.array("i", bytes(4 * n))
        return self._counts.buffer_info()[0]

    def _next_number(self) -> int:
        self._plan_number += 1
        return self._plan_number

    # ---- a layout's next dispatch ---------------------------------------------------------------------------------

    def _plan_dispatch(self, lay: tuple, nxt: tuple, cap: int, stream: int, before: Optional[tuple]) -> Optional[tuple]:
        """After a usual layout's launch (`lay` its record, its room made for `nxt`, the next dispatch as the last usual
        one was, of `cap` rows): that dispatch planned in the core, with the rows ahead; what _dispatch_planned needs,
        or None when it cannot be planned (another config's channels now, another top-k). `before`, the plan that no
        dispatch took (of the layout before, with the same rows), stands when it was made of the same arguments."""
        C, row_bytes, S, K, fp8 = nxt
        f = self._fields(None, "dispatch_fp8" if fp8 else "dispatch")
        tp, tt, tv, tn, T, tK, ts0, ts1 = lay[7]
        if not _PLANS or f[0] != 2 * C or tK != K:
            return None
        R, E, gp = lay[4][4], lay[4][12], lay[4][16]  # num_tokens_per_rank's and per_expert's sizes, in_rank's data
        made = (nxt, f, cap, stream, lay[4], lay[7], lay[10], self._counts_for(E // R))
        if before is not None and before[-1] == made:
            return before
        hl = _handle_layout(R, C, T, cap, E // R)
        rl = _recv_layout(cap, row_bytes, S, K)
        h, r, num = lay[4][0] + lay[10], self._rows_ahead[0].data_ptr(), self._next_number()
        try:
            _go.PlanDispatch(self._rid, num, *f, cap, tp, tt, tv, tn, T, tK, ts0, ts1, *lay[4],
                             h, h + 4 * hl[1], h + 4 * hl[2], h + 4 * hl[5], h + 4 * hl[3], self._counts_for(E // R),
                             r, r + rl[1] if S else 0, h + 4 * hl[4], r + rl[2] if K else 0, r + rl[3] if K else 0,
                             stream)
        except RuntimeError as e:
            raise _core.error(e) from None
        return (num, stream, (type(self).num_sms, tuning.generation), fp8, row_bytes, S, hl, rl, cap, R, C, T, E // R, gp,
                made)

    def _dispatch_planned(self, plan: tuple, x, topk_weights, expert_alignment, in_rank: torch.Tensor):
        """The dispatch that `plan` (see _plan_dispatch) prepared, when x, its scales and the stream are the ones it was
        prepared for; else None (the rows ahead stay, for the call's usual path to take or let go)."""
        num, stream, key, fp8, row_bytes, S, hl, rl, cap, R, C, T, per_expert, gp, _ = plan
        if ((type(x) is tuple) is not fp8 or (type(self).num_sms, tuning.generation) != key
                or (_current_stream(self._device_index) if self._cuda else 0) != stream):
            return None
        # The descriptions of _desc2, read in place (a device's code looked up only when it is not the buffer's: its
        # index is cheaper to read); anything unusual takes the call's usual path.
        di, dv = self._device_index, self._device_code
        try:
            if fp8:
                x, scales = x
                s0, xS = scales.shape
                ss0, ss1 = scales.stride()
                sp, st, sn = scales.data_ptr(), _DT[scales.dtype], 2
                sv = dv if scales.get_device() == di else _DV[scales.device]
            else:
                scales, (sp, st, sv, sn, s0, xS, ss0, ss1) = None, _NONE
            xT, H = x.shape
            xs0, xs1 = x.stride()
            xp, xt, xv = x.data_ptr(), _DT[x.dtype], dv if x.get_device() == di else _DV[x.device]
            w0, K = topk_weights.shape
            ws0, ws1 = topk_weights.stride()
            wp, wt = topk_weights.data_ptr(), _DT[topk_weights.dtype]
            wv = dv if topk_weights.get_device() == di else _DV[topk_weights.device]
        except (AttributeError, TypeError, ValueError):
            return None
        if H * _ITEMSIZE.get(xt, 1) != row_bytes or xS != S or not (xp and wp and (sp or not fp8)):
            return None  # no data (a meta tensor, or none to send): the usual path says what is wrong
        rb, self._rows_ahead = self._rows_ahead[0], None
        try:
            n = _go.DispatchPlanned(self._rid, num, expert_alignment, xp, xt, xv, 2, xT, H, xs0, xs1,
                                    sp, st, sv, sn, s0, S, ss0, ss1, wp, wt, wv, 2, w0, K, ws0, ws1)
        except RuntimeError as e:
            raise _core.error(e) from None
        except TypeError as e:
            _raise_int(e, expert_alignment=(expert_alignment, 1))
        lay = self._layout
        return self._dispatch_outputs(
            n >= 0, n if n >= 0 else -n - 1, True, cap, rb, rl, lay[0], lay[10], hl, _USUAL, stream, T, H, R, C, xt, st,
            S, K, scales, per_expert, row_bytes, gp, in_rank, 0, False, ())

    # ---- a dispatch's next combine --------------------------------------------------------------------------------

    def _prepare_combine(self, flags: int, stream: int, T: int, H: int) -> None:
        """After a usual dispatch's launch, while its kernel runs: the block of the outputs of the combine that follows
        it in a layer ([T, H] of the last usual combine's dtype, and its weights), which that combine takes when it is
        the usual call on the same stream with that shape (see combine; any other combine lets it go)."""
        self._combine_ahead = None
        nxt = self._next_combine
        if nxt is None or flags != _USUAL or (self._cuda and _capturing()):
            return
        block, at = self._rows_block(flags, T, H, nxt[0], nxt[1])
        self._combine_ahead = (block, at, (T, H) + nxt + (stream,), None, None, None, None)

    def _plan_combine(self, handle: tuple) -> None:
        """After a usual dispatch (cached or not) with `handle` prepared its combine's outputs: that combine planned in
        the core. The plan holds the handle until the combine takes it, or the next layout or dispatch lets it go."""
        ahead = self._combine_ahead
        if ahead is None or not _PLANS or type(handle) is not tuple:
            return
        _, T, C, rows, rank_prefix, _, recv_channel_prefix, src_idx, _, send_head = handle[0]._pyep_handle
        block, at, key = ahead[0], ahead[1], ahead[2]
        out, num = block.data_ptr(), self._next_number()
        try:
            _go.PlanCombine(self._rid, num, *self._fields(None, "combine", C), T, C, rows, src_idx, rank_prefix,
                            recv_channel_prefix, send_head, out, out + at if key[3] else 0, key[4])
        except RuntimeError as e:
            raise _core.error(e) from None
        self._combine_ahead = (block, at, key, handle, num, key[1:], (type(self).num_sms, tuning.generation))

    def _drop_combine_plan(self) -> None:
        """Lets the planned combine's handle go (its outputs stay ahead): a layout's or a dispatch's reuse of memory
        counts the references to the handle's tensors."""
        ahead = self._combine_ahead
        if ahead is not None and ahead[3] is not None:
            self._combine_ahead = ahead[:3] + (None, None, None, None)

    def _combine_planned(self, ahead: tuple, x, topk_weights):
        """The combine that `ahead` planned (see _plan_combine), when x, the weights and the stream are the ones it
        was planned for; else None (the outputs ahead stay, for the call's usual path to take or let go)."""
        di, dv = self._device_index, self._device_code  # as in _dispatch_planned
        try:
            x0, H = x.shape
            xs0, xs1 = x.stride()
            xp, xt, xv = x.data_ptr(), _DT[x.dtype], dv if x.get_device() == di else _DV[x.device]
            if topk_weights is None:
                wp, wt, wv, wn, w0, K, ws0, ws1 = _NONE
            else:
                w0, K = topk_weights.shape
                ws0, ws1 = topk_weights.stride()
                wp, wt, wn = topk_weights.data_ptr(), _DT[topk_weights.dtype], 2
                wv = dv if topk_weights.get_device() == di else _DV[topk_weights.device]
        except (AttributeError, TypeError, ValueError):
            return None
        if not (xp and (wp or topk_weights is None)):
            return None  # no data: the usual path says what is wrong
        stream = _current_stream(self._device_index) if self._cuda else 0
        if ((H, xt, 0 if topk_weights is None else K, stream) != ahead[5]
                or (type(self).num_sms, tuning.generation) != ahead[6] or (self._cuda and _capturing())):
            return None
        self._combine_ahead = None
        try:
            _go.CombinePlanned(self._rid, ahead[4], xp, xt, xv, 2, x0, H, xs0, xs1, wp, wt, wv, wn, w0, K, ws0, ws1)
        except RuntimeError as e:
            raise _core.error(e) from None
        block, T = ahead[0], ahead[2][0]
        if topk_weights is None:
            return block, None, EventOverlap(None)
        return _rows(block.view(_DTYPE_OF[xt]), 0, T, H), _rows(block, ahead[1], T, K), EventOverlap(None)
