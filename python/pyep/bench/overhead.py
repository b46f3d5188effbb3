"""The Python layer's host time per call, the Go core stubbed: `python -m pyep.bench.overhead`.

One rank (a gloo group of one, or --device cuda on one GPU) makes a real Buffer, then the core's per-call exports are
replaced by stubs that return at once, so each figure is pyep's Python alone: the argument reads, the outputs'
torch.empty (on the device given: CUDA's caching allocator costs more than the cpu one), the returned tuples, the
gopy call's argument conversion up to the stub. The core's own part is measured by the Go benchmarks
(`go test -run '^$' -bench HostPath ./goep/cuda/normal/`), the whole host time on a GPU by `python -m pyep.bench` (launch µs).

    python -m pyep.bench.overhead                      # cpu, 64 tokens, hidden 256, top-8 of 256 experts
    python -m pyep.bench.overhead --device cuda --tokens 4096 --hidden 7168

dispatch_planned, dispatch_fp8_planned and combine_planned are a layer's calls after the call that plans them (a layout, a cached dispatch
with the handle), untimed; PYEP_PLANS=0 runs the same calls unplanned.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist

import pyep
from pyep import _core

# The layout last: the dispatches pass the tensors of the last real layout, as a model does (a stubbed one writes
# nothing and would make them tensors of another layout).
CALLS = ("dispatch_bf16", "dispatch_fp8", "dispatch_cached", "combine", "layout", "dispatch_planned",
         "dispatch_fp8_planned", "combine_planned", "ll_dispatch", "ll_combine")
# What runs before each call of these, untimed: the call before it in a layer, which plans it (README, "Notes on the Go
# binding"; PYEP_PLANS=0 measures the same calls unplanned).
PLANNED = {"dispatch_planned": "layout", "dispatch_fp8_planned": "layout", "combine_planned": "dispatch_cached"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ll-tokens", type=int, default=16, help="low-latency tokens (num_max_dispatch_tokens_per_rank)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3, help="report the least of this many medians")
    p.add_argument("--calls", default=",".join(CALLS))
    return p.parse_args(argv)


class _Stubs:
    """Replaces the core's per-call exports by stubs while entered (both the bound C functions of _core.go and the
    names _core.call looks up); returns maps export names to the stub's return value."""

    def __init__(self, returns: Dict[str, object]) -> None:
        self.returns = returns

    def __enter__(self):
        self.saved_go = {n: getattr(_core.go, n) for n in _core.go.__slots__}
        for n in _core.go.__slots__:
            if n in self.returns:
                setattr(_core.go, n, self._stub(self.returns[n]))
        self.saved_mod = _core._go
        stubs = {n: self._stub(v) for n, v in self.returns.items()}

        class Module:
            def __getattr__(self, name):
                return stubs[name] if name in stubs else getattr(self_mod, name)
        self_mod = self.saved_mod
        _core._go = Module()
        return self

    entered = 0  # perf_counter_ns when a call's core export was entered (the stub of its main export)

    @classmethod
    def _stub(cls, value) -> Callable:
        """A stub returning value; it stamps `entered` unless value is "" (an export that is not a call's main one:
        the plans, made after a launch, and what a low-latency call asks after it)."""
        if value == "":
            def stub(*args):
                return value
        else:
            def stub(*args):
                cls.entered = time.perf_counter_ns()
                return value
        return stub

    def __exit__(self, *exc) -> None:
        for n, f in self.saved_go.items():
            setattr(_core.go, n, f)
        _core._go = self.saved_mod


def _time(fn: Callable[[], object], iters: int, repeats: int, prep: Callable[[], object] = None) -> Tuple[float, float]:
    """The least of `repeats` medians of `iters` calls (each after prep, untimed), in µs: to the core's entry (what
    precedes the launches), and to the return."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        entry, whole = [], []
        for _ in range(iters):
            if prep is not None:
                prep()
            t0 = time.perf_counter_ns()
            fn()
            t1 = time.perf_counter_ns()
            entry.append(_Stubs.entered - t0)
            whole.append(t1 - t0)
        best = min(best, (statistics.median(entry) / 1e3, statistics.median(whole) / 1e3), key=lambda m: m[1])
    return best


def measure(args) -> Dict[str, Tuple[float, float]]:
    """µs per call of each of args.calls, the core stubbed: to the core's entry, and to the return."""
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)
        os.environ.setdefault("PYEP_BACKEND", "cuda")
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    M, LT = args.ll_tokens, args.ll_tokens
    calls = set(args.calls.split(","))
    nvl = pyep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1)
    rdma = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E)
    buffer = pyep.Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    x_fp8 = (x.to(torch.float8_e4m3fn), torch.ones(T, H // 128, device=device))
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=weights)
    y = recv.clone()
    ll_x, ll_topk = x[:LT].contiguous(), topk[:LT].contiguous()
    ll_w = weights[:LT].contiguous()
    if args.device == "cuda":
        torch.cuda.synchronize()
    # A real low-latency dispatch for the handle combine takes (its seq is the stub's after this).
    ll_recv, _, ll_handle, _, _ = buffer.low_latency_dispatch(ll_x, ll_topk, M, E, use_fp8=False)
    ll_y = ll_recv.clone()
    buffer.low_latency_combine(ll_y, ll_topk, ll_w, ll_handle)
    if args.device == "cuda":
        torch.cuda.synchronize()

    def new_layout():  # a dispatch's layout, whose tensors it passes
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
        layout.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    preps = {"layout": new_layout, "dispatch_cached": lambda: buffer.dispatch(x, handle=handle)}
    fns = {
        "layout": lambda: buffer.get_dispatch_layout(topk, E),
        "dispatch_bf16": lambda: buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=weights),
        "dispatch_fp8": lambda: buffer.dispatch(x_fp8, **layout, topk_idx=topk, topk_weights=weights),
        "dispatch_cached": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(y, handle, topk_weights=recv_w),
        "dispatch_planned": lambda: buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=weights),
        "dispatch_fp8_planned": lambda: buffer.dispatch(x_fp8, **layout, topk_idx=topk, topk_weights=weights),
        "combine_planned": lambda: buffer.combine(y, handle, topk_weights=recv_w),
        "ll_dispatch": lambda: buffer.low_latency_dispatch(ll_x, ll_topk, M, E, use_fp8=True),
        "ll_combine": lambda: buffer.low_latency_combine(ll_y, ll_topk, ll_w, ll_handle),
    }
    returns = {"Layout": 0, "DispatchQueued": T, "DispatchNotify": T, "DispatchRecv": 0, "DispatchCached": 0,
               "Combine": 0, "PlanDispatch": "", "DispatchPlanned": T, "PlanCombine": "", "CombinePlanned": 0,
               "LowLatencyDispatch": 1, "LowLatencyCombine": 1, "LowLatencyTimedOut": "",
               "LowLatencyDispatchNs": 1, "LowLatencyCombineNs": 1}
    result = {}
    with _Stubs(returns):
        for name in CALLS:
            if name in calls:
                result[name] = _time(fns[name], args.iters, args.repeats, preps.get(PLANNED.get(name)))
    return result


def main(argv=None) -> Dict[str, Tuple[float, float]]:
    args = parse_args(argv)
    store = tempfile.mkdtemp(prefix="pyep-overhead-")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        result = measure(args)
    finally:
        dist.destroy_process_group()
    print(f"pyep {pyep.__version__}, the Python layer per call with the core stubbed ({args.device}, {args.tokens} "
          f"tokens, hidden {args.hidden}, top-{args.topk} of {args.experts} experts; low latency {args.ll_tokens} "
          f"tokens); the least of {args.repeats} medians of {args.iters} calls")
    print(f"  {'call':16s} {'to core':>8s} {'return':>8s}  (µs)")
    for name, (entry, whole) in result.items():
        print(f"  {name:16s} {entry:8.2f} {whole:8.2f}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
