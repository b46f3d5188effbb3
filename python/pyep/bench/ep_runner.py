"""The driver of a Buffer with DeepEP V1's API: pyep or DeepEP."""
from typing import List, Tuple

import torch
import torch.distributed as dist

import pyep
from .plan import OPS, Case


def _config_fields(cfg) -> Tuple[int, ...]:
    return tuple(int(getattr(cfg, n)) for n in pyep.Config.__slots__)


class EPImpl:
    """pyep or DeepEP: the same Buffer API, so one driver serves both."""

    def __init__(self, name: str, module, group: dist.ProcessGroup, num_nvl_bytes: int) -> None:
        self.name, self.mod, self.group = name, module, group
        self.num_ranks = group.size()
        self.topk_t = getattr(module, "topk_idx_t", torch.int64)
        self.buffer = module.Buffer(group, num_nvl_bytes)
        self.ops = OPS
        # pyep on cuda stamps its latest kernel launch (CLOCK_MONOTONIC, perf_counter's clock).
        self.launched = None
        if module is pyep and self.buffer.runtime.backend == "cuda":
            rid = self.buffer.runtime.id
            self.launched = lambda: pyep._core.call("BufferLastLaunchNs", rid) / 1e9

    @staticmethod
    def nvl_bytes(module, cases: List[Case], num_ranks: int) -> int:
        """The largest NVL buffer any case's configs need (hidden as BF16, the widest rows)."""
        size = 0
        for c in cases:
            for cfg in EPImpl.case_configs(module, c, num_ranks):
                size = max(size, cfg.get_nvl_buffer_size_hint(c.hidden * 2, num_ranks))
        return size

    @staticmethod
    def case_configs(module, case: Case, num_ranks: int):
        """(dispatch config, combine config) of the module for a case: the recommended ones for case.num_sms,
        with the NVL chunk sizes replaced where the case sets them. pyep.Config checks the values (ValueError)."""
        saved = module.Buffer.num_sms
        try:
            module.Buffer.set_num_sms(case.num_sms)
            recommended = (module.Buffer.get_dispatch_config(num_ranks), module.Buffer.get_combine_config(num_ranks))
        finally:
            module.Buffer.num_sms = saved
        out = []
        for cfg in recommended:
            f = list(_config_fields(cfg))
            if case.nvl_send is not None:
                f[1] = case.nvl_send
            if case.nvl_recv is not None:
                f[2] = case.nvl_recv
            pyep.Config(*f)  # raises ValueError on an impossible combination, for either module
            out.append(module.Config(*f))
        return tuple(out)

    def prepare(self, case: Case, data: dict, full: bool = True) -> dict:
        """Untimed: the layout and (full) one dispatch, for the handle (cached dispatch, combine) and the
        received rows. Without full, what `layout` needs only (no Config, no dispatch)."""
        topk_idx = data["topk_idx"].to(self.topk_t)
        if not full:
            return dict(topk_idx=topk_idx, recv_tokens=None)
        dcfg, ccfg = self.case_configs(self.mod, case, self.num_ranks)
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, case.experts)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=data["topk_weights"])
        recv_x, _, _, _, handle, _ = self.buffer.dispatch(data["x"], config=dcfg, **kw)
        return dict(dcfg=dcfg, ccfg=ccfg, topk_idx=topk_idx, kw=kw, recv_x=recv_x, handle=handle,
                    recv_tokens=int(recv_x.size(0)))

    def op(self, op: str, case: Case, data: dict, st: dict):
        """(timed callable, host callable with async_finish=True, wait for the host callable's result, config)."""
        b, x = self.buffer, data["x"]

        def wait(r):
            r[-1].current_stream_wait()

        if op == "layout":
            def call(**a):
                return b.get_dispatch_layout(st["topk_idx"], case.experts, **a)
            cfg = None
        elif op in ("dispatch_bf16", "dispatch_fp8"):
            if op == "dispatch_fp8" and data["fp8"] is None:
                raise ValueError(f"hidden {case.hidden}: FP8 needs a multiple of 128")
            xx = x if op == "dispatch_bf16" else data["fp8"]

            def call(**a):
                return b.dispatch(xx, config=st["dcfg"], **st["kw"], **a)
            cfg = st["dcfg"]
        elif op == "dispatch_cached":
            def call(**a):
                return b.dispatch(x, handle=st["handle"], config=st["dcfg"], **a)
            cfg = st["dcfg"]
        elif op == "combine_bf16":
            def call(**a):
                return b.combine(st["recv_x"], st["handle"], config=st["ccfg"], **a)
            cfg = st["ccfg"]
        else:
            raise ValueError(op)
        return call, (lambda: call(async_finish=True)), wait, cfg

    def close(self) -> None:
        self.buffer = None
