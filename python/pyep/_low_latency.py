"""DeepEP V1's low-latency mode on Buffer, every method with DeepEP's signature, names, shapes, dtypes and returns.

The ranks' low-latency buffers (num_rdma_bytes) are shared: on the cpu backend the Go core (goep/lowlatency) moves the
tokens through them, across nodes too (PYEP_RANKS_PER_NODE emulates them; a peer on another node is written only
through a put-then-signal path, the contract NVSHMEM keeps on GPUs); on the cuda backend the kernels of
kernels/low_latency.cu do, queued on the current stream (CUDA-graph safe), across nodes through NVSHMEM (sync bootstraps
it; without it the calls raise NotAvailableError saying why). docs/low-latency.md is the
synchronization contract. This layer checks the tensors (dtype, shape, contiguity, device) with DeepEP's rules,
allocates the outputs and passes data addresses to the core."""
import json
import os
import warnings
from typing import Callable, Optional, Tuple, Union

import torch

import torch.distributed as dist

from . import _core
from ._ahead import _USE_COUNT, _USUAL, _capturing, _refcount
from ._tensors import modes_on, without_modes
from .utils import EventHandle, EventOverlap

_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# DeepEP's kNumMaxTopK of the low-latency kernels.
_MAX_TOPK = 11


def _check(name: str, t: object, dtype: torch.dtype, shape: Optional[tuple] = None, dims: Optional[int] = None,
           optional: bool = False, device: torch.device = torch.device("cpu")) -> None:
    """Raises TypeError/ValueError naming the argument unless t is a contiguous tensor of dtype (and shape) on the
    buffer's device."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the buffer's device, {device}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {dims} dimensions")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _pos_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} = {v!r}: expected a positive int")
    return v


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _ok(t: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether t is a contiguous tensor of dtype on device: the usual case, tested at once; _check names what is wrong
    otherwise."""
    return isinstance(t, torch.Tensor) and t.dtype is dtype and t.device == device and t.is_contiguous()


def _ok_shaped(t: object, dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """_ok with the shape, for an optional tensor (None passes)."""
    return t is None or _ok(t, dtype, device) and t.shape == shape


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


def _small_views(key: tuple, device: torch.device) -> tuple:
    """A new int32 block's src_info, layout_range and count for key (L, R, R * M, stream), as _ll_small returns them."""
    L, R, RM, _ = key
    at_range = _align(4 * L * RM)
    at_count = at_range + _align(8 * L * R)
    small = torch.empty((at_count + _align(4 * L)) // 4, dtype=torch.int32, device=device)
    h = small.data_ptr()
    return (key, small.as_strided((L, RM), (RM, 1)), small.view(torch.int64).as_strided((L, R), (R, 1), at_range // 8),
            small.as_strided((L,), (1,), at_count // 4), (h, h + at_range, h + at_count), None)


class LowLatencyMixin:
    """Buffer's low-latency methods (see the module's docstring)."""

    _ll_id: Optional[int] = None  # the core's id once _ll let a call through
    # The last usual dispatch's src_info, layout_range and count (_ll_small), and the last usual combine's output
    # (Ahead._kept_block): handed out again once the caller let them go.
    _ll_small_kept: Optional[tuple] = None
    _ll_out_kept: Optional[tuple] = None

    def _ll(self, method: str):
        """The core's id of a buffer whose low-latency calls can run, or the error that says why not."""
        if not self.low_latency_mode:
            raise ValueError(f"Buffer.{method}: the buffer was made with low_latency_mode=False")
        if not getattr(self, "_ll_timeout_read", False):
            # The Go core's environment is the process's at start: PYEP_TIMEOUT_S is read here, at the first call.
            self._ll_timeout_read = True
            timeout = os.environ.get("PYEP_TIMEOUT_S")
            if timeout:
                _core.call("LowLatencyTimeout", self.runtime.id, float(timeout))
        # Nothing above changes for the buffer's life: later calls take the id without asking again.
        self._ll_id = self.runtime.id
        return self.runtime.id

    def _ll_report(self, method: str) -> None:
        """Warns about the ranks that did not answer in time and are masked now (enable_shrink). Only the cpu engine
        reports them here (a GPU's kernels mask the peer, low_latency_query_mask_buffer shows it): on cuda the call
        costs a round trip into the core for nothing, and is skipped."""
        if self._cuda:
            return
        ranks = _core.call("LowLatencyTimedOut", self.runtime.id)
        if ranks:
            warnings.warn(f"Buffer.{method}: rank(s) {ranks} did not answer within the timeout (PYEP_TIMEOUT_S) and are "
                          "masked now (see low_latency_query_mask_buffer)", RuntimeWarning, stacklevel=3)

    def _ll_stream(self) -> int:
        """The current stream, where the cuda backend queues a call (0 on cpu)."""
        return _current_stream(self._device_index) if self._cuda else 0

    def _ll_event(self, tensors: tuple) -> EventOverlap:
        """async_finish's event: recorded on the current stream after the call's kernels (complete on cpu)."""
        return EventOverlap(EventHandle(device=self._device if self._cuda else None), tensors)

    def _ll_hook(self, method: str, seq: int, keep: tuple) -> Callable[[], None]:
        """The receive hook of call seq; it keeps the call's tensors alive until it runs (on cuda, until the current
        stream has run the receive)."""
        def hook() -> None:
            try:
                _core.go.LowLatencyReceive(self.runtime.id, seq, self._ll_stream())
            except RuntimeError as e:
                raise _core.error(e) from None
            if self._cuda:
                stream = torch.cuda.current_stream(self._device)
                for t in keep:
                    if isinstance(t, torch.Tensor):
                        t.record_stream(stream)
            del keep[:]
            self._ll_report(method)
        keep = list(keep)
        return hook

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """
        Gets the least RDMA buffer size that low-latency mode needs (counted with BF16 tokens).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call, the same on every rank.
            hidden: the hidden size of a token.
            num_ranks: the number of ranks.
            num_experts: the number of experts, over all ranks.

        Returns:
            size: the bytes of `num_rdma_bytes` to pass to `Buffer(..., low_latency_mode=True)`.
        """
        return _core.call("LowLatencySizeHint", *(_pos_int(n, v) for n, v in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_ranks", num_ranks), ("num_experts", num_experts))))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """
        Zeroes the parts of the RDMA buffer that low-latency kernels expect clean: needed once the buffer was used
        for anything else (normal mode, say) before the next low-latency call (a collective call).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call, the same on every rank.
            hidden: the hidden size of a token.
            num_experts: the number of experts, over all ranks.
        """
        bid = self._ll("clean_low_latency_buffer")
        sizes = tuple(_pos_int(n, v) for n, v in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_experts", num_experts)))
        if self._cuda:
            # Every rank's kernels are done before any rank zeroes its flags, and every rank has zeroed them before
            # any rank's next call writes to it (the cpu engine passes these barriers in the shared buffers).
            torch.cuda.synchronize(self._device)
            self._barrier()
            _core.call("LowLatencyClean", bid, *sizes)
            self._barrier()
        else:
            _core.call("LowLatencyClean", bid, *sizes)
        self._ll_report("clean_low_latency_buffer")

    def _barrier(self) -> None:
        """A barrier of the group; an NCCL group's names this rank's GPU (torch warns when it has to guess)."""
        if "nccl" in str(dist.get_backend(self.group)).lower():
            dist.barrier(self.group, device_ids=[self._device.index])
        else:
            dist.barrier(self.group)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """
        Sends every token to the experts it selected, grouped by expert on the receiver, with every rank reached
        over RDMA (a collective call). The outputs live in one of two halves of the buffer that calls alternate
        between: at most two calls' results may be held at once.

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16`, at most `num_max_dispatch_tokens_per_rank` tokens.
            topk_idx: `[num_tokens, num_topk]` with `pyep.topk_idx_t`, the experts of each token (-1 for none).
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call, the same on every rank.
            num_experts: the number of experts, over all ranks.
            cumulative_local_expert_recv_stats: `[num_local_experts]` with `torch.int`, to which each local expert's
                received token count is added (load-balance statistics), or None.
            dispatch_wait_recv_cost_stats: `[num_ranks]` with `torch.int64`, to which the time spent waiting for each
                rank's tokens is added, in nanoseconds (finds slow ranks), or None.
            use_fp8: whether tokens travel as FP8 with per-128-channel scales.
            round_scale: whether the scales are rounded to powers of two.
            use_ue8m0: whether the scales travel as UE8M0, four packed in an int (needs `round_scale`).
            async_finish: whether to return an event instead of making the current stream wait.
            return_recv_hook: whether to only issue the sends and return a hook that receives; the data has arrived
                once the hook was called.

        Returns:
            recv_x: `[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]` with `torch.bfloat16`;
                with `use_fp8`, a tuple of that with `torch.float8_e4m3fn` and its scales,
                `[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden // 128]` with `torch.float`
                (`hidden // 512` with `torch.int` under `use_ue8m0`), column-major in the last two dimensions.
                Only the first `recv_count[e]` rows of expert e are tokens.
            recv_count: `[num_local_experts]` with `torch.int`, the tokens each local expert received.
            handle: for `low_latency_combine` and `get_next_low_latency_combine_buffer`.
            event: the event of the dispatch (set when `async_finish`).
            hook: the receiving hook (with `return_recv_hook`).
        """
        if modes_on():
            with without_modes():
                return self.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                 use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        bid = self._ll_id or self._ll("low_latency_dispatch")
        R, dev = self.group_size, self._device
        M, E = num_max_dispatch_tokens_per_rank, num_experts
        # The usual call passes every check in one test; any other runs them one by one, raising the first failure.
        shapes = type(x) is torch.Tensor and x.dim() == 2 and type(topk_idx) is torch.Tensor and topk_idx.dim() == 2
        T, H = x.shape if shapes else (0, 0)
        K = topk_idx.shape[1] if shapes else 0
        L = E // R if type(E) is int and E > 0 else 0
        if not (shapes and type(M) is int and M > 0 and L and E % R == 0 and H and H % 128 == 0 and T <= M
                and _ok(x, torch.bfloat16, dev) and _ok(topk_idx, torch.int64, dev) and topk_idx.shape[0] == T
                and 1 <= K <= _MAX_TOPK and _ok_shaped(cumulative_local_expert_recv_stats, torch.int32, (L,), dev)
                and _ok_shaped(dispatch_wait_recv_cost_stats, torch.int64, (R,), dev)
                and not (use_ue8m0 and use_fp8 and not round_scale) and not (async_finish and return_recv_hook)):
            self._check_ll_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
            T, H = x.shape
            K, L = topk_idx.shape[1], E // R
        use_fp8, round_scale, use_ue8m0 = bool(use_fp8), bool(round_scale), bool(use_ue8m0) and bool(use_fp8)
        # Two blocks: the received rows and their scales (which the experts read), allocated each call, and src_info,
        # layout_range and count (which the handle keeps for combine, without the rows), the last call's again when
        # the caller let them go (_ll_small).
        RM = R * M
        stream = _current_stream(self._device_index) if self._cuda else 0
        flags = 0 if async_finish else _USUAL  # the usual call's, as normal mode's (_ahead.py): blocks are reused
        _, src_info, layout_range, count, (h_src, h_range, h_count), _ = self._ll_small(flags, L, R, RM, stream)
        if use_fp8:
            S = (H // 128 + 3) // 4 if use_ue8m0 else H // 128
            at_scales = _align(L * RM * H)
            rows = torch.empty(at_scales + _align(4 * L * RM * S), dtype=torch.float8_e4m3fn, device=dev)
        else:
            rows = torch.empty((L, RM, H), dtype=torch.bfloat16, device=dev)
        r = rows.data_ptr()
        try:
            seq = _core.go.LowLatencyDispatch(
                bid, M, H, E, T, K, use_fp8, round_scale, use_ue8m0, bool(return_recv_hook), _addr(x), _addr(topk_idx),
                r, r + at_scales if use_fp8 else 0, h_src, h_range, h_count,
                _addr(cumulative_local_expert_recv_stats), _addr(dispatch_wait_recv_cost_stats), stream)
        except RuntimeError as e:
            raise _core.error(e) from None
        if use_fp8:
            recv_x = rows.as_strided((L, RM, H), (RM * H, H, 1))
            # Column-major in the last two dimensions, as DeepEP's (TMA) layout.
            scales = rows.view(torch.int32 if use_ue8m0 else torch.float32).as_strided(
                (L, RM, S), (S * RM, 1, RM), at_scales // 4)
        else:
            recv_x, scales = rows, None
        hook = None
        if return_recv_hook:
            hook = self._ll_hook("low_latency_dispatch", seq, (x, topk_idx, rows, src_info, layout_range, count,
                                                                cumulative_local_expert_recv_stats,
                                                                dispatch_wait_recv_cost_stats))
        elif not self._cuda:
            self._ll_report("low_latency_dispatch")
        handle = (src_info, layout_range, M, H, E)
        event = self._ll_event((x, topk_idx, rows, src_info, layout_range, count)) if async_finish else EventOverlap(None)
        return (recv_x, scales) if use_fp8 else recv_x, count, handle, event, hook

    def _ll_small(self, flags: int, L: int, R: int, RM: int, stream: int) -> tuple:
        """A dispatch's src_info, layout_range and count (the handle's two tensors and recv_count), views of one int32
        block: (key, src_info, layout_range, count, their addresses, the block's use count or None). As normal mode's
        _kept_block (_ahead.py) for a block, but the views are kept too: the usual call (flags _USUAL: no
        async_finish; not in a CUDA graph capture) gets the last usual call's views again when the caller let go of
        all three (the tuple's and getrefcount's own the only references, no other view of the block) on the same
        stream with the same shapes, without an allocation and four views; else new ones, kept for next time when
        usual. The received rows are not kept (hundreds of MB, allocated each call as DeepEP does, so that the
        memory serves the model between calls)."""
        key = (L, R, RM, stream)
        if flags != _USUAL or _USE_COUNT is None or (self._cuda and _capturing()):
            return _small_views(key, self._device)
        kept = self._ll_small_kept
        if (kept is not None and kept[0] == key and _refcount(kept[1]) == 2 and _refcount(kept[2]) == 2
                and _refcount(kept[3]) == 2 and _USE_COUNT(kept[1].untyped_storage()._cdata) == kept[5]):
            return kept
        self._ll_small_kept = None
        del kept  # let go first: its memory may serve this call
        made = _small_views(key, self._device)
        self._ll_small_kept = made = made[:5] + (_USE_COUNT(made[1].untyped_storage()._cdata),)
        return made

    def _check_ll_dispatch(self, x, topk_idx, M, E, cum_stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                           async_finish, return_recv_hook) -> None:
        """low_latency_dispatch's checks one by one: raises TypeError/ValueError naming the first bad argument."""
        M, E, R = _pos_int("num_max_dispatch_tokens_per_rank", M), _pos_int("num_experts", E), self.group_size
        if E % R:
            raise ValueError(f"num_experts = {E}: expected a multiple of num_ranks = {R}")
        dev = self._device
        _check("x", x, torch.bfloat16, dims=2, device=dev)
        T, H = x.shape
        if H % 128 or H == 0:
            raise ValueError(f"x: hidden = {H}, expected a positive multiple of 128")
        if T > M:
            raise ValueError(f"x: {T} tokens, expected at most num_max_dispatch_tokens_per_rank = {M}")
        _check("topk_idx", topk_idx, torch.int64, dims=2, device=dev)
        if topk_idx.shape[0] != T or not 1 <= topk_idx.shape[1] <= _MAX_TOPK:
            raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, expected [{T}, num_topk] with 1 <= num_topk <= "
                             f"{_MAX_TOPK}")
        L = E // R
        _check("cumulative_local_expert_recv_stats", cum_stats, torch.int32, (L,), optional=True, device=dev)
        _check("dispatch_wait_recv_cost_stats", wait_stats, torch.int64, (R,), optional=True, device=dev)
        if bool(use_ue8m0) and bool(use_fp8) and not bool(round_scale):
            raise ValueError("use_ue8m0=True: UE8M0 scales need round_scale=True")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish=True and return_recv_hook=True: expected at most one of them")

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """
        Sends the expert outputs back to the ranks their tokens came from and sums them there, weighted by
        `topk_weights` (a collective call; at most two calls' results may be held at once, as for dispatch).

        Arguments:
            x: `[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]` with `torch.bfloat16`, the
                expert outputs in the layout of `low_latency_dispatch`'s `recv_x`.
            topk_idx: `[num_combined_tokens, num_topk]` with `pyep.topk_idx_t`, the experts the dispatched tokens
                selected (-1 for none); `num_combined_tokens` is the number of tokens dispatched.
            topk_weights: `[num_combined_tokens, num_topk]` with `torch.float`, the weight of each selected expert.
            handle: the handle of the matching `low_latency_dispatch`.
            use_logfmt: whether rows travel in a 10-bit logarithmic format with a dynamic range per 128 channels
                (LogFMT-10, docs/low-latency.md), not with `zero_copy`.
            zero_copy: whether `x` was already written into `get_next_low_latency_combine_buffer(handle)`.
            async_finish: whether to return an event instead of making the current stream wait.
            return_recv_hook: whether to only issue the sends and return a hook that receives. The send waits for no
                peer: the rows for a peer that has not entered its combine yet are sent by the hook.
            out: `[num_combined_tokens, hidden]` with `torch.bfloat16`, written and returned when given.
            combine_wait_recv_cost_stats: `[num_ranks]` with `torch.int64`, to which the time spent waiting for each
                rank's rows is added, in nanoseconds, or None.

        Returns:
            combined_x: `[num_combined_tokens, hidden]` with `torch.bfloat16`, the weighted sums.
            event: the event of the combine (set when `async_finish`).
            hook: the receiving hook (with `return_recv_hook`).
        """
        if modes_on():
            with without_modes():
                return self.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                                return_recv_hook, out, combine_wait_recv_cost_stats)
        bid = self._ll_id or self._ll("low_latency_combine")
        R, dev = self.group_size, self._device
        # The usual call passes every check in one test; any other runs them one by one, raising the first failure.
        ok = type(handle) is tuple and len(handle) == 5 and type(topk_idx) is torch.Tensor and topk_idx.dim() == 2
        src_info, layout_range, M, H, E = handle if ok else (None, None, 0, 0, 0)
        T, K = topk_idx.shape if ok else (0, 0)
        ok = (ok and type(M) is int and type(H) is int and type(E) is int and M > 0 and H > 0 and E > 0
              and E % R == 0 and H % 128 == 0 and not (use_logfmt and zero_copy))
        L, RM = (E // R, R * M) if ok else (0, 0)
        if not (ok and _ok_shaped(src_info, torch.int32, (L, RM), dev) and src_info is not None
                and _ok_shaped(layout_range, torch.int64, (L, R), dev) and layout_range is not None
                and (zero_copy and (x is None or isinstance(x, torch.Tensor))
                     or not zero_copy and x is not None and _ok_shaped(x, torch.bfloat16, (L, RM, H), dev))
                and _ok(topk_idx, torch.int64, dev) and 1 <= K <= _MAX_TOPK and T <= M
                and topk_weights is not None and _ok_shaped(topk_weights, torch.float32, (T, K), dev)
                and _ok_shaped(combine_wait_recv_cost_stats, torch.int64, (R,), dev)
                and _ok_shaped(out, torch.bfloat16, (T, H), dev) and not (async_finish and return_recv_hook)):
            src_info, layout_range, M, H, E = self._check_ll_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                                                     zero_copy, async_finish, return_recv_hook, out,
                                                                     combine_wait_recv_cost_stats)
            T, K = topk_idx.shape
        stream = _current_stream(self._device_index) if self._cuda else 0
        if out is None:  # the last usual combine's output once the caller let it go (normal mode's _kept_block)
            out = self._kept_block("_ll_out_kept", 0 if async_finish else _USUAL, (T, H, stream),
                                   lambda: torch.empty((T, H), dtype=torch.bfloat16, device=dev))
        try:
            seq = _core.go.LowLatencyCombine(
                bid, M, H, E, T, K, bool(zero_copy), bool(return_recv_hook), bool(use_logfmt),
                0 if zero_copy else _addr(x),
                _addr(topk_idx), _addr(topk_weights), _addr(src_info), _addr(layout_range), _addr(out),
                _addr(combine_wait_recv_cost_stats), stream)
        except RuntimeError as e:
            raise _core.error(e) from None
        hook = None
        if return_recv_hook:
            hook = self._ll_hook("low_latency_combine", seq, (x, topk_idx, topk_weights, src_info, layout_range, out,
                                                               combine_wait_recv_cost_stats))
        elif not self._cuda:
            self._ll_report("low_latency_combine")
        event = self._ll_event((x, topk_idx, topk_weights, out)) if async_finish else EventOverlap(None)
        return out, event, hook

    def _check_ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                          return_recv_hook, out, combine_wait_recv_cost_stats) -> tuple:
        """low_latency_combine's checks one by one: raises TypeError/ValueError (or NotAvailableError) naming the first
        bad argument; returns the checked handle."""
        src_info, layout_range, M, H, E = self._ll_handle(handle)
        R = self.group_size
        L = E // R
        if use_logfmt and zero_copy:
            raise ValueError("use_logfmt=True and zero_copy=True: a zero-copy combine sends bf16 rows (expected at "
                             "most one of them, as DeepEP)")
        if zero_copy:
            if x is not None and not isinstance(x, torch.Tensor):
                raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        else:
            _check("x", x, torch.bfloat16, (L, R * M, H), device=self._device)
        _check("topk_idx", topk_idx, torch.int64, dims=2, device=self._device)
        T, K = topk_idx.shape
        if not 1 <= K <= _MAX_TOPK:
            raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, expected 1 <= num_topk <= {_MAX_TOPK}")
        if T > M:
            raise ValueError(f"topk_idx: {T} tokens, expected at most num_max_dispatch_tokens_per_rank = {M}")
        _check("topk_weights", topk_weights, torch.float32, (T, K), device=self._device)
        _check("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, (R,), optional=True,
               device=self._device)
        if out is not None:
            _check("out", out, torch.bfloat16, (T, H), device=self._device)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish=True and return_recv_hook=True: expected at most one of them")
        return src_info, layout_range, M, H, E

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """
        Masks a rank out of (or back into) low-latency dispatch, combine and clean: a masked rank is neither sent to
        nor waited for (needs `enable_shrink=True`).

        Arguments:
            rank_to_mask: the rank.
            mask: True to mask it, False to unmask it.
        """
        bid = self._ll("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int):
            raise TypeError(f"rank_to_mask must be an int, got {type(rank_to_mask).__name__}")
        _core.call("LowLatencyMask", bid, "low_latency_update_mask_buffer", rank_to_mask, bool(mask), 0)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """
        Reads which ranks are masked (needs `enable_shrink=True`).

        Arguments:
            mask_status: `[num_ranks]` with `torch.int`, written with 1 for a masked rank and 0 otherwise.
        """
        bid = self._ll("low_latency_query_mask_buffer")
        _check("mask_status", mask_status, torch.int32, (self.group_size,), device=self._device)
        host = torch.empty_like(mask_status, device="cpu") if self._cuda else mask_status
        _core.call("LowLatencyMask", bid, "low_latency_query_mask_buffer", 0, False, host.data_ptr())
        if host is not mask_status:
            mask_status.copy_(host)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (needs `enable_shrink=True`)."""
        bid = self._ll("low_latency_clean_mask_buffer")
        _core.call("LowLatencyMask", bid, "low_latency_clean_mask_buffer", -1, False, 0)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """
        Gets the part of the RDMA buffer that the next `low_latency_combine` sends from, so that experts can write
        their outputs there and the combine skips the copy (`zero_copy=True`).

        Arguments:
            handle: the handle of the matching `low_latency_dispatch`.

        Returns:
            buffer: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` with `torch.bfloat16`,
                a view of the buffer for the caller to fill (contiguous on pyep), valid until the next low-latency call
                after that combine.
        """
        bid = self._ll("get_next_low_latency_combine_buffer")
        _, _, M, H, E = self._ll_handle(handle)
        offset = _core.call("LowLatencyNextCombineBuffer", bid, M, H, E)
        R = self.group_size
        rows = self.get_local_buffer_tensor(torch.bfloat16, offset=offset, use_rdma_buffer=True)
        return rows[:E * M * H].view(E // R, R * M, H)

    def _low_latency_timeline(self) -> Tuple[list, torch.Tensor]:
        """
        A debug API, not DeepEP's: where the blocks of the last low-latency kernels spent their time (issue #18).
        With `PYEP_LL_TIMELINE=1` set when the Buffer was made, the cuda backend runs kernels built to stamp
        `%globaltimer` where each phase of each block ends (thread 0's view; `kernels/params.h` names the stamps).
        Reads the stamps of the kernels run since the last read (of each kernel, its last run: a call, or a hooked
        call's send and its hook) and clears them; waits for the device first. `bench/device/ll_profile.py --timeline`
        prints them.

        Returns:
            phases: a `(kernel, phase)` pair of strings a stamp, e.g. `("dispatch send", "cast")`: each kernel's
                ("dispatch send", "dispatch recv", "combine send", "combine recv") in phase order, its "start" first.
            stamps: `[num_blocks, len(phases)]` with `torch.int64` on the cpu, nanoseconds after the earliest stamp
                read, -1 where a block did not reach the phase or the kernel did not run since the last read.

        Raises PyepError on the cpu backend (no kernels) and without `PYEP_LL_TIMELINE=1`.
        """
        got = json.loads(_core.call("LowLatencyTimeline", self._ll("_low_latency_timeline")))
        phases = list(zip(got["kernels"], got["phases"]))
        return phases, torch.tensor(got["stamps"], dtype=torch.int64).view(-1, len(phases))

    def _ll_handle(self, handle: object) -> tuple:
        """A low-latency dispatch's handle, checked: (src_info, layout_range, M, hidden, num_experts)."""
        if not isinstance(handle, (tuple, list)) or len(handle) != 5:
            raise ValueError("handle: expected the 5-tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank, "
                             "hidden, num_experts) of low_latency_dispatch")
        src_info, layout_range, M, H, E = handle
        M, H, E = (_pos_int(f"handle's {n}", v) for n, v in (("num_max_dispatch_tokens_per_rank", M), ("hidden", H),
                                                              ("num_experts", E)))
        R = self.group_size
        if E % R or H % 128:
            raise ValueError(f"handle: num_experts = {E}, hidden = {H}: expected a multiple of num_ranks = {R} and of 128")
        _check("handle's src_info", src_info, torch.int32, (E // R, R * M), device=self._device)
        _check("handle's layout_range", layout_range, torch.int64, (E // R, R), device=self._device)
        return src_info, layout_range, M, H, E
