"""
pyep's benchmark: `python -m pyep.bench` measures normal-mode get_dispatch_layout, dispatch (BF16, FP8,
cached) and combine over a sweep of shapes and Configs, next to the all-to-all a user would write without
an EP library (the "baseline") and, where `import deep_ep` works, DeepEP itself.

Launch:
    python -m pyep.bench --quick                    # spawns one rank per GPU (or 4 ranks on the cpu backend)
    python -m pyep.bench --nprocs 2 --tokens 256    # cpu: 2 ranks
    torchrun --nproc-per-node 8 -m pyep.bench       # each rank a torchrun process

With GPUs every rank takes its GPU (`torch.cuda.set_device(local_rank)`) in an NCCL group (the cuda
backend); without, a gloo group and CPU tensors (the cpu backend). See bench/README.md for the metrics,
flags and outputs, and `python -m pyep.bench --help`.

In code: `main(argv)` (returns the report on rank 0 or in the launching process, None elsewhere), or
`run(args, group)` inside a process group that already exists (args from `parse_args`).
"""
import argparse
import datetime
import importlib
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import pyep
from . import tuning

SCHEMA = "pyep-bench/1"
OPS = ("layout", "dispatch_bf16", "dispatch_fp8", "dispatch_cached", "combine_bf16")
# The NCCL all_to_all_single alone of a dispatch's BF16 rows, already in send order: what the fabric gives this
# traffic through NCCL, a reference for dispatch and combine rather than code a user would run.
FABRIC_OPS = ("alltoall_bf16",)
IMPLS = ("pyep", "baseline", "deepep")
# The baseline has no cached dispatch: its split sizes are already known on the host.
BASELINE_OPS = ("layout", "dispatch_bf16", "dispatch_fp8", "combine_bf16") + FABRIC_OPS
# FP8 dispatch moves 1-byte elements plus one float32 scale per 128: DeepEP counts it as BF16 bytes times this.
FP8_FACTOR = (1 + 4 / 128) / 2
# Tuning: which measured op stands for which kind of a tuning file.
TUNE_KINDS = {"dispatch_bf16": "dispatch", "dispatch_fp8": "dispatch_fp8", "combine_bf16": "combine"}

# The reference case (DeepEP's tests/test_intranode.py): 4096 tokens a rank, hidden 7168, top-8 of 256, 24 SMs.
REFERENCE = {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "num_sms": 24}

# Sweep lists of each preset and backend; None in the chunk lists: the op's recommended (get_*_config) value.
_SWEEPS = {
    ("quick", "cuda"): dict(tokens=[4096], hidden=[7168], topk=[8], experts=[256], sms=[24], nvl_send=[None], nvl_recv=[None]),
    # The cpu backend copies with goroutines; the reference 4096 x 7168 takes long, the quick case is smaller.
    ("quick", "cpu"): dict(tokens=[1024], hidden=[2048], topk=[8], experts=[256], sms=[24], nvl_send=[None], nvl_recv=[None]),
    ("sweep", "cuda"): dict(tokens=[128 << i for i in range(7)], hidden=[2048, 4096, 7168], topk=[8], experts=[256],
                            sms=[8, 12, 16, 20, 24], nvl_send=[None], nvl_recv=[None]),
    ("sweep", "cpu"): dict(tokens=[128 << i for i in range(5)], hidden=[2048, 4096, 7168], topk=[8], experts=[256],
                           sms=[8, 16, 24], nvl_send=[None], nvl_recv=[None]),
    ("tune", "cuda"): dict(tokens=[4096], hidden=[2048, 4096, 7168], topk=[8], experts=[256], sms=[8, 12, 16, 20, 24],
                           nvl_send=[None, 1, 2, 4, 6, 8, 12, 16, 24, 32], nvl_recv=[None]),
    ("tune", "cpu"): dict(tokens=[1024], hidden=[2048], topk=[8], experts=[256], sms=[8, 16, 24],
                          nvl_send=[None, 4, 8, 16, 32], nvl_recv=[None]),
}
_ITERS = {"cuda": dict(warmup=20, iters=50, host_iters=10), "cpu": dict(warmup=1, iters=5, host_iters=2)}
_NOTES = {("quick", "cpu"): "cpu backend: --quick uses 1024 tokens x hidden 2048 instead of the reference 4096 x 7168 "
                            "(pass --tokens/--hidden to change)"}


# ---- command line ------------------------------------------------------------------------------------------

def _int_list(text: str, allow_default: bool = False) -> List[Optional[int]]:
    """Parses "1,2,4", "8:24:4" (inclusive, step 4), "128:8192:x2" (doubling); "default" for None."""
    out: List[Optional[int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if allow_default and part in ("default", "auto", "none"):
            out.append(None)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) not in (2, 3):
                raise argparse.ArgumentTypeError(f"{part!r}: expected START:STOP[:STEP] or START:STOP:xFACTOR")
            start, stop = int(bits[0]), int(bits[1])
            step = bits[2] if len(bits) == 3 else "1"
            if step.startswith("x"):
                factor = int(step[1:])
                if factor < 2 or start <= 0:
                    raise argparse.ArgumentTypeError(f"{part!r}: a factor needs START > 0 and FACTOR >= 2")
                v = start
                while v <= stop:
                    out.append(v)
                    v *= factor
            else:
                if int(step) <= 0:
                    raise argparse.ArgumentTypeError(f"{part!r}: STEP must be positive")
                out.extend(range(start, stop + 1, int(step)))
        else:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: empty list")
    return list(dict.fromkeys(out))


def _chunk_list(text: str) -> List[Optional[int]]:
    return _int_list(text, allow_default=True)


def _name_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(choices)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pyep.bench",
        description="Benchmark pyep's normal-mode dispatch/combine against an all_to_all_single baseline and DeepEP.",
        epilog="Lists: 1,2,4 or START:STOP[:STEP] (inclusive) or START:STOP:xFACTOR; chunk lists also take 'default'. "
               "Without --quick/--full/--tune the sweep varies one thing at a time around the reference case "
               "(tokens x hidden, SMs x hidden, top-k x experts, send x recv chunks). See bench/README.md.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the reference case only: 4096 tokens, hidden 7168, top-8 of 256 experts, 24 SMs (smaller on cpu)")
    mode.add_argument("--full", action="store_true", help="the full product of every list")
    mode.add_argument("--tune", action="store_true", help="sweep SMs x NVL chunks for pyep and write the tuning file")
    p.add_argument("--tokens", type=_int_list, help="tokens per rank (default 128:8192:x2 on GPU, 128:2048:x2 on cpu)")
    p.add_argument("--hidden", type=_int_list, help="hidden sizes (default 2048,4096,7168)")
    p.add_argument("--topk", type=_int_list, help="experts per token (default 8)")
    p.add_argument("--experts", type=_int_list, help="total experts, rounded down to a multiple of the ranks (default 256)")
    p.add_argument("--sms", type=_int_list, help="SM counts, even (default 8:24:4 on GPU, 8,16,24 on cpu)")
    p.add_argument("--nvl-send", type=_chunk_list, dest="nvl_send", help="Config num_max_nvl_chunked_send_tokens values ('default': the op's recommended)")
    p.add_argument("--nvl-recv", type=_chunk_list, dest="nvl_recv", help="Config num_max_nvl_chunked_recv_tokens values ('default': the op's recommended)")
    p.add_argument("--ops", type=_name_list(OPS + FABRIC_OPS),
                   help=f"operations to measure (default all: {','.join(OPS + FABRIC_OPS)})")
    p.add_argument("--impls", type=_name_list(IMPLS), help="implementations (default pyep,baseline,deepep; pyep with --tune)")
    p.add_argument("--mask-ratio", type=float, default=0.0, dest="mask_ratio", help="fraction of top-k choices set to -1 (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default 20 on GPU, 1 on cpu)")
    p.add_argument("--iters", type=int, help="timed calls per measurement (default 50 on GPU, 5 on cpu)")
    p.add_argument("--host-iters", type=int, dest="host_iters", help="calls timed on the host (async_finish=True) (default 10 on GPU, 2 on cpu; 0: skip)")
    p.add_argument("--flush-mb", type=int, default=256, dest="flush_mb", help="MiB written between timed GPU iterations to flush L2 (default 256)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cuda (NCCL) or cpu (gloo) backend (default: cuda if GPUs)")
    p.add_argument("--nprocs", type=int, help="ranks to spawn when not under torchrun (default: GPU count, or 4 on cpu)")
    p.add_argument("--spawn", action="store_true", help="spawn ranks even if torchrun's environment or a process group is present")
    p.add_argument("--out", help="output folder (default bench/results/<host>-<timestamp>/)")
    p.add_argument("--no-plots", action="store_true", dest="no_plots", help="skip the PNG plots")
    p.add_argument("--replot", metavar="DIR", help="measure nothing: draw the PNG plots of DIR/results.json (a run on a "
                   "machine without matplotlib) into DIR and record them there")
    p.add_argument("--tuning-file", dest="tuning_file", help=f"where --tune writes (default ${tuning.ENV_FILE} or ~/.cache/pyep/tuning/<gpu>-<ranks>.json)")
    p.add_argument("--timeout", type=float, default=600, help="process group timeout, seconds (default 600)")
    p.add_argument("--quiet", action="store_true", help="no table rows or progress on stdout/stderr (JSON and files only)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("warmup", "iters", "host_iters", "nprocs"):
        v = getattr(args, name)
        if v is not None and v < (1 if name in ("iters", "nprocs") else 0):
            raise SystemExit(f"--{name.replace('_', '-')} = {v}: out of range")
    if not 0 <= args.mask_ratio < 1:
        raise SystemExit(f"--mask-ratio = {args.mask_ratio}: expected 0 <= r < 1")
    return args


# ---- the sweep ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One point of the sweep. nvl_send/nvl_recv None: the op's recommended value (Buffer.get_*_config)."""
    tokens: int
    hidden: int
    topk: int
    experts: int
    num_sms: int
    nvl_send: Optional[int] = None
    nvl_recv: Optional[int] = None

    def sort_key(self):
        return (self.experts, self.topk, self.tokens, self.hidden, self.num_sms,
                -1 if self.nvl_send is None else self.nvl_send, -1 if self.nvl_recv is None else self.nvl_recv)


@dataclass
class Plan:
    mode: str            # quick | sweep | full | tune
    backend: str         # cuda | cpu
    lists: dict
    reference: dict
    cases: List[Case]
    ops: List[str]
    impls: List[str]
    warmup: int
    iters: int
    host_iters: int
    notes: List[str]


def _reference(values: list, preferred):
    """The reference value of a dimension: the list's value nearest the reference case's (None, the
    recommended chunk size, if the list holds it, else the first)."""
    if preferred in values:
        return preferred
    if preferred is None or any(v is None for v in values):
        return values[0]
    return min(values, key=lambda v: (abs(v - preferred), -v))


def make_plan(args: argparse.Namespace, backend: str, num_ranks: int) -> Plan:
    """Resolves presets, explicit lists and the sweep mode into the list of cases."""
    mode = "quick" if args.quick else "tune" if args.tune else "full" if args.full else "sweep"
    preset = _SWEEPS[("quick" if mode == "quick" else "tune" if mode == "tune" else "sweep", backend)]
    notes = []
    lists = {}
    for dim in ("tokens", "hidden", "topk", "experts", "sms", "nvl_send", "nvl_recv"):
        given = getattr(args, dim)
        lists[dim] = list(given) if given is not None else list(preset[dim])
    note = _NOTES.get((mode, backend))
    if note and (args.tokens is None or args.hidden is None):
        notes.append(note)
    experts = []
    for e in lists["experts"]:
        eff = max(num_ranks, e // num_ranks * num_ranks)
        if eff != e:
            notes.append(f"experts {e} -> {eff}: a multiple of the {num_ranks} ranks")
        experts.append(eff)
    lists["experts"] = list(dict.fromkeys(experts))
    for name in ("tokens", "hidden", "topk"):
        if min(lists[name]) <= 0:
            raise SystemExit(f"--{name}: values must be positive")
    if max(lists["topk"]) > min(lists["experts"]):
        raise SystemExit(f"--topk {max(lists['topk'])}: more than the {min(lists['experts'])} experts")

    ref = {"tokens": _reference(lists["tokens"], REFERENCE["tokens"]),
           "hidden": _reference(lists["hidden"], REFERENCE["hidden"]),
           "topk": _reference(lists["topk"], REFERENCE["topk"]),
           "experts": _reference(lists["experts"], REFERENCE["experts"]),
           "num_sms": _reference(lists["sms"], REFERENCE["num_sms"]),
           "nvl_send": _reference(lists["nvl_send"], None),
           "nvl_recv": _reference(lists["nvl_recv"], None)}

    def case(tokens=None, hidden=None, topk=None, experts=None, num_sms=None, nvl_send="ref", nvl_recv="ref"):
        return Case(tokens or ref["tokens"], hidden or ref["hidden"], topk or ref["topk"], experts or ref["experts"],
                    num_sms or ref["num_sms"], ref["nvl_send"] if nvl_send == "ref" else nvl_send,
                    ref["nvl_recv"] if nvl_recv == "ref" else nvl_recv)

    L = lists
    if mode in ("full", "tune"):
        cases = [Case(*c) for c in itertools.product(L["tokens"], L["hidden"], L["topk"], L["experts"], L["sms"],
                                                      L["nvl_send"], L["nvl_recv"])]
    else:
        # One thing at a time around the reference (each pair that a plot needs varies together).
        cases = [case(tokens=t, hidden=h) for t in L["tokens"] for h in L["hidden"]]
        cases += [case(num_sms=s, hidden=h) for s in L["sms"] for h in L["hidden"]]
        cases += [case(topk=k, experts=e) for k in L["topk"] for e in L["experts"]]
        cases += [case(nvl_send=s, nvl_recv=r) for s in L["nvl_send"] for r in L["nvl_recv"]]
    cases = sorted(dict.fromkeys(cases), key=Case.sort_key)

    impls = list(args.impls) if args.impls else (["pyep"] if mode == "tune" else list(IMPLS))
    ops = list(args.ops) if args.ops else (list(TUNE_KINDS) if mode == "tune" else list(OPS + FABRIC_OPS))
    if mode == "tune" and "pyep" not in impls:
        raise SystemExit("--tune measures pyep: include it in --impls")
    it = _ITERS[backend]
    return Plan(mode=mode, backend=backend, lists=lists, reference=ref, cases=cases, ops=ops, impls=impls,
                warmup=it["warmup"] if args.warmup is None else args.warmup,
                iters=it["iters"] if args.iters is None else args.iters,
                host_iters=it["host_iters"] if args.host_iters is None else args.host_iters, notes=notes)


# ---- inputs ------------------------------------------------------------------------------------------------

def make_routing(tokens: int, experts: int, topk: int, rank: int, seed: int, mask_ratio: float,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random top-k as DeepEP's tests route: scores = |randn| + 1, the top-k largest (unsorted); optionally a
    fraction of the choices masked to -1. Returns topk_idx [T, K] int64 and topk_weights [T, K] float32."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 7919 + tokens * 31 + experts * 17 + topk)
    scores = torch.randn((tokens, experts), generator=g, device=device).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=-1, largest=True, sorted=False).indices
    if mask_ratio > 0:
        topk_idx.masked_fill_(torch.rand((tokens, topk), generator=g, device=device) < mask_ratio, -1)
    topk_weights = torch.rand((tokens, topk), generator=g, device=device)
    return topk_idx.contiguous(), topk_weights


def make_x(tokens: int, hidden: int, rank: int, seed: int, device: torch.device):
    """x [T, H] BF16, and its FP8 form as DeepEP's tests make it (per 128 columns: e4m3 values and float32
    scales [T, H/128]); the FP8 pair is None when hidden is not a multiple of 128."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 7919 + tokens * 13 + hidden + 1)
    x = torch.randn((tokens, hidden), generator=g, device=device, dtype=torch.float32)
    fp8 = None
    if hidden % 128 == 0:
        blocks = x.view(tokens, hidden // 128, 128)
        amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
        fp8 = ((blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(tokens, hidden),
               (amax / 448.0).contiguous())
    return x.to(torch.bfloat16), fp8


# ---- timing ------------------------------------------------------------------------------------------------

class Timer:
    """CUDA events around each call with L2 flushed before each timed call (GPU), or time.perf_counter (cpu)."""

    def __init__(self, device: torch.device, flush_mb: int) -> None:
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda and flush_mb > 0:
            self.flush = torch.empty(flush_mb * (1 << 20) // 4, dtype=torch.int32, device=device)

    def run(self, fn: Callable[[], object], warmup: int, iters: int) -> List[float]:
        """Seconds of each of `iters` calls after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if self.flush is not None:
                self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]

    def host(self, fn: Callable[[], object], wait: Callable[[object], None], iters: int,
             launched: Optional[Callable[[], float]] = None) -> Tuple[List[float], List[float]]:
        """Seconds from the Python call to its return, and (with `launched`, the time.perf_counter clock
        reading right after the implementation's latest kernel launch) to its last launch, without
        synchronizing inside; the device is idle before each call and `wait` joins the result afterwards."""
        times, launches = [], []
        for _ in range(iters):
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            times.append(time.perf_counter() - t0)
            if launched is not None:
                launches.append(launched() - t0)
            wait(r)
        if self.cuda:
            torch.cuda.synchronize()
        return times, launches


# ---- implementations ---------------------------------------------------------------------------------------

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


# ---- environment -------------------------------------------------------------------------------------------

def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device, group: dist.ProcessGroup, deepep: dict) -> dict:
    env = {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyep": pyep.__version__,
        "backend": device.type,
        "dist_backend": str(dist.get_backend(group)),
        "num_ranks": group.size(),
        "deep_ep": deepep,
        "gpu": None, "gpu_count": 0, "driver": None, "cuda": torch.version.cuda, "nccl": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), driver=_driver_version(),
                   gpu_sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory,
                   gpu_l2_bytes=getattr(props, "L2_cache_size", None),
                   gpu_capability=f"{props.major}.{props.minor}")
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            env["nccl"] = f"unknown ({e})"
    return env


def _import_deepep() -> Tuple[object, dict]:
    """(module or None, {"version", "skipped"}) for DeepEP; never raises."""
    try:
        mod = importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, {"version": None, "skipped": f"import deep_ep failed: {type(e).__name__}: {e}"}
    if mod is pyep or getattr(mod, "__name__", "") == "pyep" or os.path.dirname(getattr(mod, "__file__", "") or "") == os.path.dirname(pyep.__file__):
        return None, {"version": None, "skipped": "deep_ep is pyep itself"}
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            from importlib import metadata
            for dist_name in ("deep_ep", "deep-ep", "deepep"):
                try:
                    version = metadata.version(dist_name)
                    break
                except metadata.PackageNotFoundError:
                    continue
        except ImportError:
            pass
    return mod, {"version": version, "skipped": None}


# ---- report ------------------------------------------------------------------------------------------------

def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _bytes_of(op: str, recv_tokens: int, hidden: int) -> int:
    """Bytes DeepEP's tests count for an op on one rank: dispatch BF16, combine and alltoall, the received rows as BF16
    (combine's rows sent back are the same rows); FP8, that times (1 + 4/128) / 2; layout, none."""
    if op == "layout":
        return 0
    bf16 = recv_tokens * hidden * 2
    return int(bf16 * FP8_FACTOR) if op == "dispatch_fp8" else bf16


def _merge(records: List[dict]) -> dict:
    """One result from every rank's record of one measurement (same order on all ranks)."""
    first = records[0]
    out = {k: first[k] for k in ("impl", "op", "tokens", "hidden", "topk", "experts", "num_sms", "nvl_send", "nvl_recv", "config")}
    errors = [r["error"] for r in records if r.get("error")]  # agreed: the same on every rank, naming the rank
    out["error"] = errors[0] if errors else None
    if errors:
        out["per_rank"] = []
        return out
    per_rank = [{k: r.get(k) for k in ("rank", "median_us", "min_us", "max_us", "host_us", "launch_us", "recv_tokens",
                                        "bytes", "gbps", "times_us")}
                for r in records]
    out["per_rank"] = per_rank
    medians = [r["median_us"] for r in per_rank]
    out["time_us_avg"] = round(statistics.fmean(medians), 3)
    out["time_us_max_rank"] = round(max(medians), 3)
    out["time_us_min"] = round(min(r["min_us"] for r in per_rank), 3)
    out["time_us_max"] = round(max(r["max_us"] for r in per_rank), 3)
    gb = [r["gbps"] for r in per_rank if r["gbps"] is not None]
    out["gbps_avg"] = round(statistics.fmean(gb), 3) if gb else None
    out["gbps_min"] = round(min(gb), 3) if gb else None
    hosts = [r["host_us"] for r in per_rank if r["host_us"] is not None]
    out["host_us_avg"] = round(statistics.fmean(hosts), 3) if hosts else None
    launches = [r["launch_us"] for r in per_rank if r["launch_us"] is not None]
    out["launch_us_avg"] = round(statistics.fmean(launches), 3) if launches else None
    recv = [r["recv_tokens"] for r in per_rank if r["recv_tokens"] is not None]
    out["recv_tokens_avg"] = round(statistics.fmean(recv), 1) if recv else None
    out["bytes_total"] = sum(r["bytes"] for r in per_rank)
    return out


class Table:
    """The stdout table, one row a measurement."""

    def __init__(self) -> None:
        enc = (getattr(sys.stdout, "encoding", None) or "").lower()
        self.mu = "µs" if "utf" in enc else "us"
        self.cols = [("impl", 8, "<"), ("op", 15, "<"), ("tokens", 6, ">"), ("hidden", 6, ">"), ("topk", 4, ">"),
                     ("experts", 7, ">"), ("SMs", 3, ">"), ("nvl s/r", 7, ">"), ("recv", 7, ">"),
                     (f"time {self.mu}", 10, ">"), ("(min-max)", 23, "<"), ("GB/s avg", 8, ">"), ("GB/s min", 8, ">"),
                     (f"host {self.mu}", 9, ">"), (f"launch {self.mu}", 10, ">")]

    def header(self) -> str:
        head = " ".join(f"{name:{align}{width}}" for name, width, align in self.cols).rstrip()
        return head + "\n" + "-" * len(head)

    def row(self, r: dict) -> str:
        def num(v, fmt):
            return "-" if v is None else format(v, fmt)
        cfg = r.get("config")
        if cfg:
            chunks = f"{cfg[1]}/{cfg[2]}"
        elif r["nvl_send"] is not None or r["nvl_recv"] is not None:  # asked for, but no Config came of it
            chunks = f"{r['nvl_send'] or 'd'}/{r['nvl_recv'] or 'd'}"
        else:
            chunks = "-"
        sms = str(r["num_sms"]) if r["num_sms"] is not None else "-"
        head = [r["impl"], r["op"], str(r["tokens"]), str(r["hidden"]), str(r["topk"]), str(r["experts"]), sms, chunks]
        if r.get("error"):
            vals = head + [f"ERROR {r['error']}"]
            return " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, self.cols)).rstrip()
        vals = head + [num(r["recv_tokens_avg"], ".0f"), num(r["time_us_avg"], ".1f"),
                       f"({r['time_us_min']:.1f}-{r['time_us_max']:.1f})", num(r["gbps_avg"], ".2f"),
                       num(r["gbps_min"], ".2f"), num(r["host_us_avg"], ".1f"), num(r.get("launch_us_avg"), ".1f")]
        return " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, self.cols)).rstrip()


class Progress:
    """A plain-text progress bar on stderr (tqdm when importable and stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled = total, 0, enabled and total > 1
        self.tty = self.enabled and sys.stderr.isatty()
        self.bar = None
        self.last_pct = -1
        self.t0 = time.perf_counter()
        if self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="case", file=sys.stderr, leave=False)
            except ImportError:
                self.bar = None

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(line, flush=True)
        if self.tty:
            self._draw()

    def _draw(self) -> None:
        if not self.enabled or self.bar is not None:
            return
        pct = int(100 * self.n / self.total)
        width = 30
        filled = width * self.n // self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.n * (self.total - self.n) if self.n else 0
        text = f"[{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} cases {pct:3d}% eta {eta:5.0f}s"
        if self.tty:
            sys.stderr.write("\r" + text)
            sys.stderr.flush()
        elif pct // 10 != self.last_pct // 10 or self.n == self.total:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        self.last_pct = pct

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            self._draw()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self.bar, self.enabled, self.tty = None, False, False


def default_out_dir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("bench", "results", f"{socket.gethostname()}-{stamp}")


def plot(results: List[dict], reference: dict, out_dir: str) -> Tuple[List[str], Optional[str]]:
    """GB/s against tokens (at the reference SMs) and against SMs (at the reference tokens), one panel an op,
    one line an (impl, hidden). Returns (paths written, why nothing was written or None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"matplotlib is not importable ({e}): no plots"
    ok = [r for r in results if not r.get("error") and r.get("gbps_avg") is not None
          and r["topk"] == reference["topk"] and r["experts"] == reference["experts"]
          and r["nvl_send"] == reference["nvl_send"] and r["nvl_recv"] == reference["nvl_recv"]]
    ops = [op for op in OPS + FABRIC_OPS if op != "layout" and any(r["op"] == op for r in ok)]
    written = []

    def figure(xkey: str, fixed: Callable[[dict], bool], fname: str, xlabel: str, log2: bool) -> None:
        panels = []
        for op in ops:
            lines: Dict[Tuple[str, int], List[Tuple[int, float]]] = {}
            flat: Dict[Tuple[str, int], float] = {}
            for r in ok:
                if r["op"] != op or not fixed(r):
                    continue
                if xkey == "num_sms" and r["num_sms"] is None:
                    # The baseline uses no SMs setting: a flat line at its value.
                    flat[(r["impl"], r["hidden"])] = r["gbps_avg"]
                else:
                    lines.setdefault((r["impl"], r["hidden"]), []).append((r[xkey], r["gbps_avg"]))
            lines = {k: sorted(v) for k, v in lines.items() if len(v) >= 2}
            if lines:
                panels.append((op, lines, flat))
        if not panels:
            return
        ncols = min(2, len(panels))
        nrows = (len(panels) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
        hiddens = sorted({h for _, lines, flat in panels for (_, h) in list(lines) + list(flat)})
        colors = {h: f"C{i % 10}" for i, h in enumerate(hiddens)}
        styles = {"pyep": "-", "baseline": "--", "deepep": ":"}
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (op, lines, flat) in zip(axes.flat, panels):
            for (impl, hidden), pts in sorted(lines.items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=colors[hidden],
                        linestyle=styles.get(impl, "-"), label=f"{impl} h={hidden}")
            for (impl, hidden), v in sorted(flat.items()):
                ax.axhline(v, linestyle=styles.get(impl, "--"), linewidth=1, color=colors[hidden], alpha=0.6,
                           label=f"{impl} h={hidden}")
            xs = sorted({p[0] for pts in lines.values() for p in pts})
            if log2:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(v) for v in xs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(op)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("GB/s (avg over ranks)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    figure("tokens", lambda r: r["num_sms"] in (None, reference["num_sms"]), "gbps_vs_tokens.png", "tokens per rank", True)
    figure("num_sms", lambda r: r["tokens"] == reference["tokens"], "gbps_vs_sms.png", "SMs", False)
    return written, (None if written else "too few points for a plot (need a line of 2 or more)")


def tune_table(results: List[dict], num_ranks: int, device: str, default_hidden: Optional[int] = None,
               source: Optional[dict] = None) -> dict:
    """The tuning file content (see pyep.tuning) from a report's results: pyep's dispatch_bf16, dispatch_fp8 and
    combine_bf16 measurements, per (hidden, config) the time and GB/s averaged over the tokens measured."""
    acc: Dict[Tuple[int, str], Dict[Tuple[int, ...], List[Tuple[float, float]]]] = {}
    for r in results:
        if r["impl"] != "pyep" or r["op"] not in TUNE_KINDS or r.get("error") or not r.get("config"):
            continue
        acc.setdefault((r["hidden"], TUNE_KINDS[r["op"]]), {}).setdefault(tuple(r["config"]), []).append(
            (r["time_us_avg"], r["gbps_avg"] or 0.0))
    measured = {key: {cfg: (statistics.fmean(t for t, _ in v), statistics.fmean(g for _, g in v)) for cfg, v in by.items()}
                for key, by in acc.items()}
    return tuning.make_table(num_ranks, device, measured, default_hidden=default_hidden, source=source,
                             pyep_version=pyep.__version__)


# ---- the run -----------------------------------------------------------------------------------------------

def _agree(group: dist.ProcessGroup, error: Optional[str]) -> Optional[str]:
    """Every rank's error (or None) to every rank: the first one, named by rank, or None if all succeeded."""
    gathered: List[Optional[str]] = [None] * group.size()
    dist.all_gather_object(gathered, error, group=group)
    for r, e in enumerate(gathered):
        if e:
            return f"rank {r}: {e}"
    return None


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _barrier(group: dist.ProcessGroup, cuda: bool) -> None:
    if cuda:
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _sync(group: dist.ProcessGroup, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    _barrier(group, cuda)


def _record(impl, case: Case, op: str, rank: int, **fields) -> dict:
    """A rank's record of one measurement: what was measured (layout has no SMs or chunks; the baseline no
    Config) and, in fields, the numbers or the error."""
    ep = isinstance(impl, EPImpl) and op != "layout"
    rec = dict(impl=impl.name, op=op, tokens=case.tokens, hidden=case.hidden, topk=case.topk, experts=case.experts,
               num_sms=case.num_sms if ep else None, nvl_send=case.nvl_send if ep else None,
               nvl_recv=case.nvl_recv if ep else None, config=None, error=None, rank=rank)
    rec.update(fields)
    return rec


def _make_impls(plan: Plan, group: dist.ProcessGroup, cuda: bool) -> Tuple[list, Dict[str, str], dict]:
    """The implementations that can run on every rank, those skipped (with why), and DeepEP's import info."""
    R = group.size()
    skipped: Dict[str, str] = {}
    deepep_mod, deepep_info = None, {"version": None, "skipped": "not requested"}
    if "deepep" in plan.impls:
        if cuda:
            deepep_mod, deepep_info = _import_deepep()
        else:
            deepep_info = {"version": None, "skipped": "cpu backend: DeepEP needs CUDA GPUs and an NCCL group"}
        why = _agree(group, deepep_info["skipped"] if deepep_mod is None else None)
        if why:
            skipped["deepep"] = why
            deepep_mod = None
    impls = []
    for name in plan.impls:
        if name in skipped:
            continue
        err, impl = None, None
        try:
            if name == "baseline":
                impl = Baseline(group)
            else:
                module = pyep if name == "pyep" else deepep_mod
                valid = []
                for c in plan.cases:
                    try:
                        EPImpl.case_configs(module, c, R)
                        valid.append(c)
                    except ValueError:
                        pass  # recorded per case when measured
                impl = EPImpl(name, module, group, EPImpl.nvl_bytes(module, valid, R) or (1 << 20))
        except Exception as e:  # noqa: BLE001 - recorded and skipped on every rank
            err = _err(e)
        why = _agree(group, err)
        if why:
            skipped[name] = why
            if impl is not None:
                impl.close()
        else:
            impls.append(impl)
    return impls, skipped, deepep_info


def _measure(impl, case: Case, ops: List[str], data: dict, plan: Plan, timer: Timer, group: dist.ProcessGroup,
             cuda: bool) -> List[dict]:
    """This rank's records of `ops` of one implementation in one case. Every failure is agreed on by all ranks,
    so that they go on (or skip) together. `layout` is prepared apart (it needs no dispatch), so that it is
    measured even where dispatch fails."""
    records = []
    stages = [[op for op in ops if op == "layout"], [op for op in ops if op != "layout"]]
    for full, stage in zip((False, True), stages):
        if stage:
            records += _measure_stage(impl, case, stage, full, data, plan, timer, group, cuda)
    return records


def _measure_stage(impl, case: Case, ops: List[str], full: bool, data: dict, plan: Plan, timer: Timer,
                   group: dist.ProcessGroup, cuda: bool) -> List[dict]:
    rank = group.rank()
    st, err = None, None
    try:
        _sync(group, cuda)
        st = impl.prepare(case, data, full)
    except Exception as e:  # noqa: BLE001 - recorded for this impl and case
        err = _err(e)
    why = _agree(group, err)
    if why:
        return [_record(impl, case, op, rank, error=f"prepare: {why}") for op in ops]
    records = []
    for op in ops:
        fields: dict = {}
        err = None
        try:
            call, host_call, wait, cfg = impl.op(op, case, data, st)
            fields["config"] = list(_config_fields(cfg)) if cfg is not None else None
            _sync(group, cuda)
            times = timer.run(call, plan.warmup, plan.iters)
            host, launch = timer.host(host_call, wait, plan.host_iters, getattr(impl, "launched", None)) \
                if plan.host_iters else ([], [])
            med = statistics.median(times)
            nbytes = _bytes_of(op, st["recv_tokens"], case.hidden)
            fields.update(median_us=_us(med), min_us=_us(min(times)), max_us=_us(max(times)),
                          times_us=[_us(t) for t in times], host_us=_us(statistics.median(host)) if host else None,
                          launch_us=_us(statistics.median(launch)) if launch else None,
                          recv_tokens=st["recv_tokens"], bytes=nbytes,
                          gbps=round(nbytes / 1e9 / med, 3) if nbytes and med > 0 else None)
        except Exception as e:  # noqa: BLE001 - recorded for this op and case
            err = _err(e)
            if os.environ.get("PYEP_BENCH_DEBUG"):
                traceback.print_exc()
        why = _agree(group, err)
        if why:
            fields = {"config": fields.get("config"), "error": why}
        records.append(_record(impl, case, op, rank, **fields))
    return records


def run(args: argparse.Namespace, group: Optional[dist.ProcessGroup] = None) -> Optional[dict]:
    """
    Runs the benchmark in every rank of an existing process group (gloo: cpu backend; NCCL: cuda backend,
    each rank on its current device). Collective: every rank calls it with the same args.

    Returns:
        report: the report written to results.json on rank 0; None on other ranks.
    """
    group = group or dist.group.WORLD
    rank, R = group.rank(), group.size()
    cuda = "nccl" in str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = "cuda" if cuda else "cpu"
    plan = make_plan(args, backend, R)
    lead = rank == 0
    show = lead and not args.quiet
    impls, skipped, deepep_info = _make_impls(plan, group, cuda)

    env = environment(device, group, deepep_info) if lead else None
    out_dir = None
    if lead:
        out_dir = args.out or default_out_dir()
        os.makedirs(out_dir, exist_ok=True)
    table = Table()
    lines: List[str] = []
    progress = Progress(len(plan.cases), show)

    def emit(line: str) -> None:
        lines.append(line)
        if show:
            progress.write(line)

    if lead:
        emit(f"pyep {pyep.__version__} bench: {R} ranks, {backend} backend"
             + (f" ({env['gpu']})" if env.get("gpu") else "") + f", {plan.mode}: {len(plan.cases)} cases, "
             f"ops {','.join(plan.ops)}, impls {','.join(i.name for i in impls) or 'none'}, "
             f"warmup {plan.warmup}, iters {plan.iters}, host iters {plan.host_iters}")
        for name, why in skipped.items():
            emit(f"skipped {name}: {why}")
        for note in plan.notes:
            emit(f"note: {note}")
        emit(table.header())

    timer = Timer(device, args.flush_mb)
    done = set()
    results: List[dict] = []
    data: dict = {}
    data_key: dict = {}
    t_start = time.perf_counter()
    for case in plan.cases:
        # Inputs, regenerated only when their shape changes (cases are sorted for that).
        rkey = (case.tokens, case.experts, case.topk)
        if data_key.get("routing") != rkey:
            data["topk_idx"], data["topk_weights"] = make_routing(case.tokens, case.experts, case.topk, rank,
                                                                  args.seed, args.mask_ratio, device)
            data_key["routing"] = rkey
        xkey = (case.tokens, case.hidden)
        if data_key.get("x") != xkey:
            data["x"] = data["fp8"] = None
            data["x"], data["fp8"] = make_x(case.tokens, case.hidden, rank, args.seed, device)
            data_key["x"] = xkey

        records: List[dict] = []
        for impl in impls:
            todo = []
            for op in plan.ops:
                if op not in impl.ops:
                    continue
                # What a measurement depends on: layout on the routing only; the baseline not on Configs.
                if op == "layout":
                    key = (impl.name, op, case.tokens, case.topk, case.experts)
                elif isinstance(impl, Baseline):
                    key = (impl.name, op, case.tokens, case.hidden, case.topk, case.experts)
                else:
                    key = (impl.name, op, case)
                if key not in done:
                    done.add(key)
                    todo.append(op)
            if todo:
                records += _measure(impl, case, todo, data, plan, timer, group, cuda)

        gathered: List[Optional[List[dict]]] = [None] * R
        dist.all_gather_object(gathered, records, group=group)
        if lead:
            for i in range(len(records)):
                merged = _merge([gathered[r][i] for r in range(R)])
                results.append(merged)
                emit(table.row(merged))
        progress.update()
    progress.close()
    elapsed = time.perf_counter() - t_start
    for impl in impls:
        impl.close()
    data.clear()

    if not lead:
        _barrier(group, cuda)
        return None
    try:
        return _finish(args, plan, env, skipped, results, elapsed, out_dir, table, lines, emit, R, cuda)
    finally:
        _barrier(group, cuda)


def _finish(args, plan: Plan, env: dict, skipped: dict, results: List[dict], elapsed: float, out_dir: str,
            table: Table, lines: List[str], emit: Callable[[str], None], R: int, cuda: bool) -> dict:
    """Rank 0: the tuning file, the plots, results.json and table.txt."""
    report = {
        "schema": SCHEMA,
        "env": env,
        "args": dict(vars(args)),
        "plan": {"mode": plan.mode, "backend": plan.backend, "lists": plan.lists, "reference": plan.reference,
                 "ops": plan.ops, "impls": plan.impls, "warmup": plan.warmup, "iters": plan.iters,
                 "host_iters": plan.host_iters, "flush_mb": args.flush_mb if cuda else 0,
                 "num_cases": len(plan.cases), "notes": plan.notes},
        "metrics": {
            "time": "per rank: median (min, max) over the timed calls; across ranks: the average of the medians",
            "gbps": "per rank: bytes / median time; dispatch_bf16, dispatch_cached, combine_bf16, alltoall_bf16: recv_tokens * hidden * 2;"
                    " dispatch_fp8: that * (1 + 4/128) / 2; layout: none. Reported as average and min over ranks",
            "host_us": "per rank: median of time.perf_counter around one call with async_finish=True (baseline: the plain call)",
            "launch_us": "per rank (pyep on cuda): median time from the Python call to right after its last kernel launch, "
                         "the core's CLOCK_MONOTONIC stamp; a dispatch returns later, once notify's counts reach the host",
        },
        "skipped": skipped,
        "elapsed_s": round(elapsed, 3),
        "results": results,
        "tuning": None,
        "plots": [],
        "plots_skipped": None,
        "out_dir": os.path.abspath(out_dir),
    }
    if plan.mode == "tune":
        dev_name = tuning.device_name() if cuda else "cpu"
        source = {"tokens": plan.lists["tokens"], "topk": plan.lists["topk"], "experts": plan.lists["experts"],
                  "iters": plan.iters, "warmup": plan.warmup, "backend": plan.backend}
        tuned = tune_table(results, R, dev_name, plan.reference["hidden"], source)
        path = None
        if tuned["hidden"]:
            path = tuning.save(tuned, args.tuning_file or tuning.tuning_path(R, dev_name))
            emit(f"tuning file: {path}")
        else:
            emit("tuning: no pyep measurement succeeded; no tuning file written")
        report["tuning"] = {"path": path, "table": tuned}
        for hidden, kinds in tuned["hidden"].items():
            for kind, entry in kinds.items():
                b = entry["best"]
                emit(f"  hidden {hidden} {kind:<12} best Config{tuple(b['config'])}: {b['gbps']:.2f} GB/s, "
                     f"{b['time_us']:.1f} {table.mu}")
    if args.no_plots:
        report["plots_skipped"] = "--no-plots"
    else:
        try:
            plots, report["plots_skipped"] = plot(results, plan.reference, out_dir)
            report["plots"] = [os.path.basename(p) for p in plots]
        except Exception as e:  # noqa: BLE001 - a plot must not lose the measurements
            report["plots_skipped"] = f"plotting failed: {_err(e)}"
        if report["plots_skipped"]:
            emit(f"plots: {report['plots_skipped']}")
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        f.write(tuning.dumps(report) + "\n")
    emit(f"wrote {path}" + "".join(f", {os.path.join(out_dir, p)}" for p in report["plots"]) + f" ({elapsed:.1f} s)")
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return report


def replot(out_dir: str) -> dict:
    """Draws the plots of the report in out_dir/results.json into out_dir and records them in the report."""
    path = os.path.join(out_dir, "results.json")
    with open(path) as f:
        report = json.load(f)
    plots, why = plot(report["results"], report["plan"]["reference"], out_dir)
    report["plots"], report["plots_skipped"] = [os.path.basename(p) for p in plots], why
    with open(path, "w") as f:
        f.write(tuning.dumps(report) + "\n")
    print(f"plots: {why}" if why else "wrote " + ", ".join(plots))
    return report


# ---- launching ---------------------------------------------------------------------------------------------

def _want_cuda(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return False
    available = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not available:
        raise SystemExit("--device cuda: no CUDA device is available")
    return available


def _device_id(cuda: bool) -> dict:
    """init_process_group's device_id (binds the NCCL group to this rank's GPU) where torch has it."""
    import inspect
    if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": torch.device("cuda", torch.cuda.current_device())}
    return {}


def _set_cpu_threads(local_world: int) -> None:
    # Ranks share the cores: without OMP_NUM_THREADS, give each an equal share.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))


def _worker(local_rank: int, nprocs: int, opts: dict, host: str, port: int) -> None:
    """A spawned rank: joins the group through the launcher's store and runs the bench."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=host, MASTER_PORT=str(port))
    args = argparse.Namespace(**opts)
    cuda = opts["_cuda"]
    timeout = datetime.timedelta(seconds=args.timeout)
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        _set_cpu_threads(nprocs)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=local_rank, world_size=nprocs, timeout=timeout,
                            **_device_id(cuda))
    try:
        run(args, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _spawn(args: argparse.Namespace) -> Optional[dict]:
    import torch.multiprocessing as mp

    cuda = _want_cuda(args)
    count = torch.cuda.device_count() if cuda else None
    nprocs = args.nprocs or (count if cuda else 4)
    if cuda and nprocs > count:
        raise SystemExit(f"--nprocs {nprocs}: only {count} GPUs")
    make_plan(args, "cuda" if cuda else "cpu", nprocs)  # argument errors here, not in every rank
    opts = dict(vars(args))
    opts["out"] = args.out or default_out_dir()
    opts["_cuda"] = cuda
    host = "127.0.0.1"
    # The launcher holds the rendezvous store on a port the OS picks: no clash with another group.
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    worker = importlib.import_module("pyep.bench")._worker  # picklable by name also under `python -m`
    mp.spawn(worker, args=(nprocs, opts, host, store.port), nprocs=nprocs, join=True)
    del store
    path = os.path.join(opts["out"], "results.json")
    with open(path) as f:
        return json.load(f)


def main(argv: Optional[Sequence[str]] = None) -> Optional[dict]:
    """
    Command-line entry. Under torchrun (its environment set) or inside an initialized process group, runs in
    this process as one rank; otherwise (or with --spawn) spawns the ranks and returns rank 0's report.
    """
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if args.spawn or not (under_torchrun or dist.is_initialized()):
        return _spawn(args)
    own = False
    if not dist.is_initialized():
        cuda = _want_cuda(args)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        else:
            _set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                                **_device_id(cuda))
        own = True
    try:
        return run(args, dist.group.WORLD)
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
