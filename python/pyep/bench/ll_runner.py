"""The driver of low-latency mode with DeepEP V1's API, for pyep and DeepEP alike.

It touches only DeepEP V1's public low-latency API (deep_ep/buffer.py): `Buffer(group, num_rdma_bytes=...,
low_latency_mode=True, num_qps_per_rank=..., explicitly_destroy=True)`, the static
`get_low_latency_rdma_size_hint`, `clean_low_latency_buffer`, `low_latency_dispatch`, `low_latency_combine`, their
return tuples and hooks, and `destroy`. The buffer is a Buffer of its own, made once per implementation and sized for
every low-latency case of the plan; each case cleans it for its shape first (a collective call).

A case is checked once before it is timed, so that a broken run cannot print figures: every local expert's received
count against the routing of all ranks (gathered), and a combine of the dispatched rows (dequantized from FP8) against
x times the sum of the token's valid weights, token by token.
"""
import contextlib
import os
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .plan import LL_OPS, LLCase

# A combined token's relative error (L2 over hidden) against x * sum(weights) that the check accepts: FP8 e4m3 rounds
# to 3 mantissa bits (about 3 % RMS); a token that lost or doubled an expert's row is off by its weight's share.
COMBINE_TOLERANCE = 0.08
# DeepEP's count (tests/test_low_latency.py) per valid (token, expert) selection: an FP8 row, its float32 scale per 128
# channels and 16 bytes (dispatch); a BF16 row (combine).
LL_META_BYTES = 16
# pyep's node emulation: each k consecutive ranks one node, read by the core when a Buffer is made.
RANKS_PER_NODE_ENV = "PYEP_RANKS_PER_NODE"


@contextlib.contextmanager
def ranks_per_node_env(k: int) -> Iterator[None]:
    """PYEP_RANKS_PER_NODE=k while the block runs (a Buffer's construction), then the environment as it was (unset,
    or the value it had)."""
    saved = os.environ.get(RANKS_PER_NODE_ENV)
    os.environ[RANKS_PER_NODE_ENV] = str(k)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(RANKS_PER_NODE_ENV, None)
        else:
            os.environ[RANKS_PER_NODE_ENV] = saved


def ll_bytes(op: str, selections: int, hidden: int) -> int:
    """Bytes of a rank in DeepEP's low-latency count, for `selections` valid top-k entries of its tokens."""
    dispatch = selections * (hidden + hidden // 128 * 4 + LL_META_BYTES)
    combine = selections * hidden * 2
    return {"ll_dispatch": dispatch, "ll_combine": combine, "ll_dispatch_combine": dispatch + combine}[op]


def dequantize(recv: Tuple[torch.Tensor, torch.Tensor], count: torch.Tensor) -> torch.Tensor:
    """The BF16 rows of an FP8 low-latency dispatch, `[L, R*M, H]`: each expert's first count[e] rows (values times
    their scale per 128 channels), zeros after them. One expert at a time: no float copy of the whole tensor."""
    values, scales = recv
    L, RM, H = values.shape
    out = torch.zeros((L, RM, H), dtype=torch.bfloat16, device=values.device)
    for e, n in enumerate(count.tolist()):
        if n > 0:
            rows = values[e, :n].float().view(n, H // 128, 128) * scales[e, :n].float().unsqueeze(-1)
            out[e, :n] = rows.view(n, H).to(torch.bfloat16)
    return out


def combine_error(x: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, combined: torch.Tensor) -> float:
    """The combine's largest relative error (L2 over hidden) against x times the sum of each token's valid weights
    (every expert returned the token's row); raises where it exceeds COMBINE_TOLERANCE or is not finite."""
    want = x.float() * weights.masked_fill(~valid, 0).sum(dim=1, keepdim=True)
    diff = (combined.float() - want).norm(dim=1)
    err = float((diff / want.norm(dim=1).clamp_min(1e-6)).max()) if want.numel() else 0.0
    if not torch.isfinite(combined).all() or err > COMBINE_TOLERANCE:
        raise RuntimeError(f"check: combined tokens off by up to {err:.3g} (relative, L2 over hidden), "
                           f"expected at most {COMBINE_TOLERANCE}")
    return err


def ll_call(op: str, dispatch: Callable, combine: Callable, handle, handle_at: int) -> Callable:
    """The timed callable of a low-latency op from an implementation's dispatch(**kw) and combine(handle, **kw):
    ll_combine on the prepared handle, ll_dispatch_combine on the handle the new dispatch returns (at handle_at)."""
    if op == "ll_dispatch":
        return dispatch
    if op == "ll_combine":
        return lambda **a: combine(handle, **a)
    if op == "ll_dispatch_combine":
        return lambda: combine(dispatch()[handle_at])
    raise ValueError(op)


class LowLatencyRunner:
    """Low-latency mode of one implementation (pyep or DeepEP), through DeepEP V1's API. `launched` (pyep on cuda)
    is the clock reading of the latest kernel launch, as the normal-mode runner's.

    `ranks_per_node` k > 0 (pyep only): the Buffer is made with PYEP_RANKS_PER_NODE=k set around its construction
    only, so that each k consecutive ranks are one node and peers of other nodes are reached through the put/signal
    path. 0: the Buffer of one node, made in the environment as it is. After open, the node size the Buffer has
    (pyep's `runtime.ranks_per_node`, 0 where unset or for DeepEP)."""

    ops = LL_OPS
    note: Optional[str] = None

    def __init__(self, name: str, module, group: dist.ProcessGroup,
                 launched_of: Optional[Callable[[object], Optional[Callable[[], float]]]] = None,
                 ranks_per_node: int = 0) -> None:
        self.name, self.module, self.group = name, module, group
        self.num_ranks, self.rank = group.size(), group.rank()
        self.topk_t = module.topk_idx_t
        self.buffer = None
        self.launched: Optional[Callable[[], float]] = None
        self._launched_of = launched_of
        self.ranks_per_node = ranks_per_node

    @property
    def label(self) -> str:
        """The runner in `skipped` and messages: `pyep low-latency`, `pyep low-latency ranks_per_node=2`."""
        return f"{self.name} low-latency" + (f" ranks_per_node={self.ranks_per_node}" if self.ranks_per_node else "")

    @property
    def num_nodes(self) -> int:
        """The nodes of the group: num_ranks / ranks_per_node; one-node runners: DeepEP's nodes of 8 ranks."""
        k = self.ranks_per_node or 8
        return -(-self.num_ranks // k)

    def open(self, cases: List[LLCase]) -> None:
        """Makes the low-latency Buffer: num_rdma_bytes the largest size hint of the cases, num_qps_per_rank the most
        local experts (as DeepEP's test). A case whose hint is refused is left out here and fails when measured."""
        size, qps = 0, 1
        for c in cases:
            try:
                size = max(size, int(self.module.Buffer.get_low_latency_rdma_size_hint(c.tokens, c.hidden,
                                                                                       self.num_ranks, c.experts)))
            except Exception:  # noqa: BLE001 - recorded per case when measured
                continue
            qps = max(qps, c.experts // self.num_ranks)
        if size == 0:
            raise ValueError("no low-latency case has a buffer size (get_low_latency_rdma_size_hint refused them all)")
        kw = dict(num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=qps, explicitly_destroy=True)
        if self.ranks_per_node:
            with ranks_per_node_env(self.ranks_per_node):  # the core reads it here, at construction
                self.buffer = self.module.Buffer(self.group, **kw)
        else:
            self.buffer = self.module.Buffer(self.group, **kw)
        # What the Buffer has (pyep): PYEP_RANKS_PER_NODE as its core read it, 0 when unset. DeepEP: none.
        got = getattr(getattr(self.buffer, "runtime", None), "ranks_per_node", None)
        if isinstance(got, int) and not isinstance(got, bool):
            self.ranks_per_node = got
        if self._launched_of is not None:
            self.launched = self._launched_of(self.buffer)

    def prepare(self, case: LLCase, data: dict, full: bool = True) -> dict:
        """Untimed: cleans the buffer for the case's shape, dispatches once (FP8) and combines its dequantized rows;
        checks both (see the module's docstring). Returns what the ops need."""
        b, M, H, E = self.buffer, case.tokens, case.hidden, case.experts
        R, L = self.num_ranks, case.experts // self.num_ranks
        x, weights = data["x"], data["topk_weights"]
        topk_idx = data["topk_idx"].to(self.topk_t)
        dev = x.device
        b.clean_low_latency_buffer(M, H, E)
        stats = torch.zeros((L,), dtype=torch.int32, device=dev)
        recv, count, handle, _, _ = b.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats,
                                                           use_fp8=True)
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid].long().cpu(), minlength=E).tolist()
        gathered: List[Optional[list]] = [None] * R
        dist.all_gather_object(gathered, per_expert, group=self.group)
        expected = [sum(g[self.rank * L + i] for g in gathered) for i in range(L)]
        expert_rows = dequantize(recv, count)
        combined, _, _ = b.low_latency_combine(expert_rows, topk_idx, weights, handle)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        # Every collective call is done: a failed check below fails this rank only, and the ranks agree on it.
        got = count.tolist()
        if got != expected or stats.tolist() != expected:
            raise RuntimeError(f"check: recv_count {got} (stats {stats.tolist()}), expected {expected} from the routing")
        err = combine_error(x, weights, valid, combined)
        return dict(topk_idx=topk_idx, weights=weights, handle=handle, expert_rows=expert_rows,
                    recv_tokens=int(sum(got)), selections=int(valid.sum()), combine_err=round(err, 5))

    def op(self, op: str, case: LLCase, data: dict, st: dict):
        """(timed callable, host callable, wait for the host callable's result, None): the plain call (the current
        stream waits for the kernels; result µs synchronizes the device)."""
        b, x, M, E = self.buffer, data["x"], case.tokens, case.experts
        idx, w, rows = st["topk_idx"], st["weights"], st["expert_rows"]

        def dispatch(**a):
            return b.low_latency_dispatch(x, idx, M, E, use_fp8=True, **a)

        def combine(handle, **a):
            return b.low_latency_combine(rows, idx, w, handle, **a)

        call = ll_call(op, dispatch, combine, st["handle"], 2)
        return call, call, (lambda r: None), None

    def send_phase(self, op: str, case: LLCase, data: dict, st: dict) -> Optional[Callable[[], Callable[[], None]]]:
        """A callable that issues the op with return_recv_hook=True and returns its hook (None: no phases for op)."""
        b, x, M, E = self.buffer, data["x"], case.tokens, case.experts
        if op == "ll_dispatch":
            return lambda: b.low_latency_dispatch(x, st["topk_idx"], M, E, use_fp8=True, return_recv_hook=True)[4]
        if op == "ll_combine":
            return lambda: b.low_latency_combine(st["expert_rows"], st["topk_idx"], st["weights"], st["handle"],
                                                 return_recv_hook=True)[2]
        return None

    def op_bytes(self, op: str, case: LLCase, st: dict) -> int:
        return ll_bytes(op, st["selections"], case.hidden)

    def close(self) -> None:
        """Destroys the buffer (collective: every rank closes at the same point of the run)."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None and getattr(buffer, "runtime", None) is not None:
            buffer.destroy()
