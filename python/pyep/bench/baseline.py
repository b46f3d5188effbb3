"""The baseline: the all_to_all_single code a user writes without an EP library."""
from typing import List, Optional

import torch
import torch.distributed as dist

from .plan import BASELINE_OPS, Case


class Baseline:
    """What a user writes without an EP library: the routing turned into a send order and split sizes on the
    host ("layout": the per-rank counts exchanged with all_to_all_single, then .tolist()); dispatch =
    index_select into send order + all_to_all_single (FP8: the e4m3 bytes and the float32 scales, two calls);
    combine = all_to_all_single back + index_add_ into token order. A token goes once to each rank holding any
    of its experts (as in DeepEP); top-k indices and weights are not sent."""

    name = "baseline"
    ops = BASELINE_OPS

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.num_ranks = group.size()

    def layout(self, topk_idx: torch.Tensor, experts: int):
        R = self.num_ranks
        owner = torch.div(topk_idx, experts // R, rounding_mode="floor").masked_fill_(topk_idx < 0, R)
        in_rank = torch.zeros((topk_idx.size(0), R + 1), dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, owner, True)
        in_rank = in_rank[:, :R]
        _, send_idx = in_rank.t().nonzero(as_tuple=True)  # rank-major: by destination, then token
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return send_idx, send_counts.tolist(), recv_counts.tolist()

    def _a2a(self, inp: torch.Tensor, out_rows: int, out_splits: List[int], in_splits: List[int]) -> torch.Tensor:
        out = torch.empty((out_rows,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        return out

    def _dispatch(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        return self._a2a(x.index_select(0, st["send_idx"]), st["recv_tokens"], st["recv_counts"], st["send_counts"])

    def prepare(self, case: Case, data: dict, full: bool = True) -> dict:
        send_idx, send_counts, recv_counts = self.layout(data["topk_idx"], case.experts)
        st = dict(send_idx=send_idx, send_counts=send_counts, recv_counts=recv_counts,
                  send_tokens=sum(send_counts), recv_tokens=sum(recv_counts))
        if full:
            st["recv_x"] = self._dispatch(data["x"], st)
        return st

    def op(self, op: str, case: Case, data: dict, st: dict):
        x = data["x"]
        if op == "layout":
            def call():
                return self.layout(data["topk_idx"], case.experts)
        elif op == "dispatch_bf16":
            def call():
                return self._dispatch(x, st)
        elif op == "dispatch_fp8":
            if data["fp8"] is None:
                raise ValueError(f"hidden {case.hidden}: FP8 needs a multiple of 128")
            xf, scales = data["fp8"]

            def call():
                return self._dispatch(xf.view(torch.uint8), st), self._dispatch(scales, st)
        elif op == "alltoall_bf16":
            send_x = x.index_select(0, st["send_idx"])

            def call():
                return self._a2a(send_x, st["recv_tokens"], st["recv_counts"], st["send_counts"])
        elif op == "combine_bf16":
            def call():
                back = self._a2a(st["recv_x"], st["send_tokens"], st["send_counts"], st["recv_counts"])
                out = torch.zeros((case.tokens, x.size(1)), dtype=x.dtype, device=x.device)
                return out.index_add_(0, st["send_idx"], back)
        else:
            raise ValueError(op)
        # Collectives on an NCCL group return once enqueued: the plain call is the asynchronous one.
        return call, call, (lambda r: None), None

    def close(self) -> None:
        pass


def why_not(cuda: bool, nccl: bool, shared_gpu: bool) -> Optional[str]:
    """Why the baseline is not measured (None: it is). On GPUs it is NCCL's all_to_all_single; over a gloo group
    (ranks that share a GPU, which NCCL refuses) the all-to-all would go through host memory, no fair baseline."""
    if cuda and not nccl:
        return ("the group is gloo" + (" (ranks share a GPU: NCCL refuses them)" if shared_gpu else "")
                + ": the baseline is NCCL's all_to_all_single, and gloo's (through host memory) is no fair baseline")
    return None
