"""The driver of a Buffer with DeepEP V1's API, for pyep and DeepEP alike.

It touches only what DeepEP V1's public API has (deep_ep/buffer.py and the deep_ep_cpp module): `Buffer(group,
num_nvl_bytes)`, `get_dispatch_layout`, `dispatch`, `combine` and their return tuples, `EventOverlap.
current_stream_wait`, `topk_idx_t`, `Config(num_sms, nvl send, nvl recv, rdma send, rdma recv)` and its
`get_nvl_buffer_size_hint`. DeepEP's Config has no readable fields, so the bench keeps each Config's numbers
itself (RunConfig) and never reads them back. What differs between the two lives in the subclasses
(pyep_runner, deepep_runner): the module, the recommended numbers and pyep's launch stamp.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .ll_runner import LowLatencyRunner
from .plan import OPS, Case

# DeepEP V1's Config constructor arguments, in order.
CONFIG_FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")


def config_numbers(fields: Sequence[int]) -> Tuple[int, ...]:
    """The five numbers a Config made of `fields` holds: both DeepEP's and pyep's constructors round the RDMA
    receive chunk up to whole send chunks."""
    num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv = (int(v) for v in fields)
    if rdma_send > 0:
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
    return (num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)


@dataclass(frozen=True)
class RunConfig:
    """A Config of the implementation's module and the numbers it was made of (what the JSON records)."""
    fields: Tuple[int, ...]
    config: object


class EPRunner:
    """pyep or DeepEP through DeepEP V1's Buffer API. Subclasses set `name` and `module` and give
    `recommended(kind, num_sms)`; `launched` (a clock reading of the latest kernel launch) is pyep's extension."""

    name = ""
    ops: Tuple[str, ...] = OPS
    note: Optional[str] = None  # said once in the output when set

    def __init__(self, module, group: dist.ProcessGroup) -> None:
        self.module, self.group = module, group
        self.num_ranks = group.size()
        self.topk_t = module.topk_idx_t
        self.buffer = None
        self.launched: Optional[Callable[[], float]] = None

    def recommended(self, kind: str, num_sms: int) -> Tuple[int, ...]:
        """The five Config numbers the implementation recommends for `kind` (dispatch or combine) at `num_sms`."""
        raise NotImplementedError

    def make_buffer(self, num_nvl_bytes: int):
        return self.module.Buffer(self.group, num_nvl_bytes)

    def case_configs(self, case: Case, kinds: Tuple[str, ...] = ("dispatch", "combine")) -> Tuple[RunConfig, ...]:
        """The RunConfigs of a case for kinds (dispatch, combine; dispatch_fp8): the recommended numbers for
        case.num_sms, with the NVL chunk sizes put in where the case sets them. The module's Config constructor
        checks them (pyep: ValueError; DeepEP: RuntimeError from its host assertions)."""
        out = []
        for kind in kinds:
            f = list(self.recommended(kind, case.num_sms))
            if case.nvl_send is not None:
                f[1] = case.nvl_send
            if case.nvl_recv is not None:
                f[2] = case.nvl_recv
            out.append(RunConfig(config_numbers(f), self.module.Config(*f)))
        return tuple(out)

    def open(self, cases: List[Case]) -> None:
        """Makes the Buffer, its NVL part sized for the largest rings of any case's Configs (hidden as BF16, the
        widest rows). A case whose Config is refused is left out here and recorded as an error when measured."""
        size = 0
        for c in cases:
            try:
                configs = self.case_configs(c, ("dispatch", "combine", "dispatch_fp8"))
            except Exception:  # noqa: BLE001 - recorded per case when measured
                continue
            for rc in configs:
                size = max(size, int(rc.config.get_nvl_buffer_size_hint(c.hidden * 2, self.num_ranks)))
        self.buffer = self.make_buffer(size or (1 << 20))

    def prepare(self, case: Case, data: dict, full: bool = True) -> dict:
        """Untimed: the layout and (full) one dispatch, for the handle (cached dispatch, combine) and the
        received rows. Without full, what `layout` needs only (no Config, no dispatch)."""
        topk_idx = data["topk_idx"].to(self.topk_t)
        if not full:
            return dict(topk_idx=topk_idx, recv_tokens=None)
        dcfg, ccfg, fcfg = self.case_configs(case, ("dispatch", "combine", "dispatch_fp8"))
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, case.experts)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=data["topk_weights"])
        recv_x, _, _, _, handle, _ = self.buffer.dispatch(data["x"], config=dcfg.config, **kw)
        return dict(dcfg=dcfg, ccfg=ccfg, fcfg=fcfg, topk_idx=topk_idx, kw=kw, recv_x=recv_x, handle=handle,
                    recv_tokens=int(recv_x.size(0)))

    def op(self, op: str, case: Case, data: dict, st: dict):
        """(timed callable, host callable: the usual call, DeepEP's defaults, wait for the host callable's result,
        RunConfig or None)."""
        b, x = self.buffer, data["x"]

        if op == "layout":
            def call():
                return b.get_dispatch_layout(st["topk_idx"], case.experts)
            rc = None
        elif op in ("dispatch_bf16", "dispatch_fp8"):
            if op == "dispatch_fp8" and data["fp8"] is None:
                raise ValueError(f"hidden {case.hidden}: FP8 needs a multiple of 128")
            xx = x if op == "dispatch_bf16" else data["fp8"]
            rc = st["dcfg"] if op == "dispatch_bf16" else st["fcfg"]

            def call():
                return b.dispatch(xx, config=rc.config, **st["kw"])
        elif op == "dispatch_cached":
            rc = st["dcfg"]

            def call():
                return b.dispatch(x, handle=st["handle"], config=rc.config)
        elif op == "combine_bf16":
            rc = st["ccfg"]

            def call():
                return b.combine(st["recv_x"], st["handle"], config=rc.config)
        else:
            raise ValueError(op)
        return call, call, (lambda r: None), rc  # the usual call: nothing to join

    def host_prep(self, op: str, case: Case, data: dict, st: dict) -> Optional[Callable[[], None]]:
        """What runs before each host-timed call, untimed, as in a model's layer: a dispatch gets a new layout, a combine
        a new dispatch (with its layout) whose handle and rows it takes. pyep's layout allocates ahead for the dispatch
        that follows it, and its dispatch for the combine."""
        if op not in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
            return None

        def layout():
            per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(st["topk_idx"], case.experts)
            st["kw"].update(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

        def dispatch():
            layout()
            st["recv_x"], _, _, _, st["handle"], _ = self.buffer.dispatch(data["x"], config=st["dcfg"].config, **st["kw"])
        return dispatch if op == "combine_bf16" else layout

    def low_latency(self) -> LowLatencyRunner:
        """The implementation's low-latency runner (a Buffer of its own, made by its open)."""
        return LowLatencyRunner(self.name, self.module, self.group)

    def close(self) -> None:
        self.buffer = None
