"""DeepEP V1's low-latency mode on Buffer: every method with DeepEP's signature, documented as DeepEP's callers use
it. The mode is not implemented yet: each method raises `pyep.NotAvailableError` (a `pyep.PyepError` and a
`NotImplementedError`) naming itself, before it looks at its arguments, so that no call is a silent no-op."""
from typing import Callable, Optional, Tuple, Union

import torch

from ._core import not_available
from .utils import EventOverlap

_LOW_LATENCY = "low-latency mode (IBGDA all-to-all over the RDMA buffer)"


class LowLatencyMixin:
    """Buffer's low-latency methods (see the module's docstring)."""

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
        raise not_available("get_low_latency_rdma_size_hint", _LOW_LATENCY)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """
        Zeroes the parts of the RDMA buffer that low-latency kernels expect clean: needed once the buffer was used
        for anything else (normal mode, say) before the next low-latency call (a collective call).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call, the same on every rank.
            hidden: the hidden size of a token.
            num_experts: the number of experts, over all ranks.
        """
        raise not_available("clean_low_latency_buffer", _LOW_LATENCY)

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
            dispatch_wait_recv_cost_stats: `[num_ranks, num_ranks]` with `torch.int64`, to which the time spent
                waiting for each rank's tokens is added (finds slow ranks), or None.
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
        raise not_available("low_latency_dispatch", _LOW_LATENCY)

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
            use_logfmt: whether rows travel in a 10-bit logarithmic format with a dynamic scale per 64 channels.
            zero_copy: whether `x` was already written into `get_next_low_latency_combine_buffer(handle)`.
            async_finish: whether to return an event instead of making the current stream wait.
            return_recv_hook: whether to only issue the sends and return a hook that receives.
            out: `[num_combined_tokens, hidden]` with `torch.bfloat16`, written and returned when given.
            combine_wait_recv_cost_stats: `[num_ranks, num_ranks]` with `torch.int64`, to which the time spent waiting
                for each rank's rows is added, or None.

        Returns:
            combined_x: `[num_combined_tokens, hidden]` with `torch.bfloat16`, the weighted sums.
            event: the event of the combine (set when `async_finish`).
            hook: the receiving hook (with `return_recv_hook`).
        """
        raise not_available("low_latency_combine", _LOW_LATENCY)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """
        Masks a rank out of (or back into) low-latency dispatch, combine and clean: a masked rank is neither sent to
        nor waited for (needs `enable_shrink=True`).

        Arguments:
            rank_to_mask: the rank.
            mask: True to mask it, False to unmask it.
        """
        raise not_available("low_latency_update_mask_buffer", _LOW_LATENCY + " with enable_shrink")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """
        Reads which ranks are masked (needs `enable_shrink=True`).

        Arguments:
            mask_status: `[num_ranks]` with `torch.int`, written with 1 for a masked rank and 0 otherwise.
        """
        raise not_available("low_latency_query_mask_buffer", _LOW_LATENCY + " with enable_shrink")

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (needs `enable_shrink=True`)."""
        raise not_available("low_latency_clean_mask_buffer", _LOW_LATENCY + " with enable_shrink")

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """
        Gets the part of the RDMA buffer that the next `low_latency_combine` sends from, so that experts can write
        their outputs there and the combine skips the copy (`zero_copy=True`).

        Arguments:
            handle: the handle of the matching `low_latency_dispatch`.

        Returns:
            buffer: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` with `torch.bfloat16`,
                a view of the buffer for the caller to fill.
        """
        raise not_available("get_next_low_latency_combine_buffer", _LOW_LATENCY)
