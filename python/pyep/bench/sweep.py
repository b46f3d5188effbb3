"""The run: every case's measurements on every rank, failures agreed on by all ranks."""
import argparse
import os
import statistics
import time
import traceback
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import pyep
from . import baseline as baseline_mod, deepep_runner, deepep_v2_runner
from .baseline import Baseline
from .deepep_runner import DeepEPRunner, _import_deepep
from .deepep_v2_runner import DeepEPV2Runner, _import_deepep_v2
from .env import environment
from .ep_runner import EPRunner
from .gpus import SHARED_NOTE, Placement, placement
from .inputs import make_routing, make_x
from .ll_runner import LowLatencyRunner
from .plan import LL_OPS, Case, Plan, ll_nodes_key, make_plan
from .report import Part, Progress, Table, _bytes_of, _err, _finish, _gbps, _merge, _us, default_out_dir
from .pyep_runner import PyepRunner
from .timing import Timer

# The launcher's two sets of processes (launch.py), given to run as `part`: FIRST runs everything but the emulated-node
# rows (--ll-nodes), NODES those rows alone (pyep's low-latency Buffers of emulated nodes, no normal-mode case).
FIRST, NODES = "first", "nodes"
# A test aid: the cpu backend takes --ll-nodes as the cuda backend must (see one_nvshmem_group).
NODES_APART_ENV = "PYEP_BENCH_NODES_APART"
NVSHMEM_TAKEN = ("DeepEP's low-latency Buffer made this process's NVSHMEM group, and NVSHMEM is initialised once a "
                 "process: the bench's own launcher (python -m pyep.bench --nprocs N ..., not torchrun or a process "
                 "group of yours) runs these rows in a second set of processes; or leave deepep out of --impls")


def one_nvshmem_group(cuda: bool) -> bool:
    """Whether a process holds one NVSHMEM group at most, so that pyep's emulated-node Buffers (an NVSHMEM group on
    cuda) cannot share a process with DeepEP's low-latency Buffer (one of its own): on cuda; on cpu with
    PYEP_BENCH_NODES_APART=1, so that tests take the paths of cuda (the launcher's second set of processes, the skip
    in a process group that is not the launcher's)."""
    return cuda or os.environ.get(NODES_APART_ENV) == "1"


def _agreed_try(group: dist.ProcessGroup, fn) -> Optional[str]:
    """Runs fn; then every rank learns the first rank's failure (see _agree), so that all go on or skip together."""
    err = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded and skipped on every rank
        err = _err(e)
        if os.environ.get("PYEP_BENCH_DEBUG"):
            traceback.print_exc()
    return _agree(group, err)


def _agree(group: dist.ProcessGroup, error: Optional[str]) -> Optional[str]:
    """Every rank's error (or None) to every rank: the first one, named by rank, or None if all succeeded."""
    gathered: List[Optional[str]] = [None] * group.size()
    dist.all_gather_object(gathered, error, group=group)
    for r, e in enumerate(gathered):
        if e:
            return f"rank {r}: {e}"
    return None


def _barrier(group: dist.ProcessGroup, where: Placement) -> None:
    if where.nccl:
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _sync(group: dist.ProcessGroup, where: Placement) -> None:
    if where.cuda:
        torch.cuda.synchronize()
    _barrier(group, where)


def _median_us(seconds: List[float]) -> Optional[float]:
    return _us(statistics.median(seconds)) if seconds else None


def _record(impl, case: Case, op: str, rank: int, **fields) -> dict:
    """A rank's record of one measurement: what was measured (layout has no SMs or chunks; the baseline no
    Config) and, in fields, the numbers or the error."""
    ep = isinstance(impl, EPRunner) and op != "layout"
    chunks = ep and not isinstance(impl, DeepEPV2Runner)  # V2 has no Config: SMs only
    rec = dict(impl=impl.name, op=op, tokens=case.tokens, hidden=case.hidden, topk=case.topk, experts=case.experts,
               num_sms=case.num_sms if ep else None, nvl_send=case.nvl_send if chunks else None,
               nvl_recv=case.nvl_recv if chunks else None, config=None, error=None, rank=rank)
    if isinstance(impl, LowLatencyRunner):
        # The low-latency Buffer's nodes: ranks_per_node 0 for one node (PYEP_RANKS_PER_NODE unset).
        rec.update(ranks_per_node=impl.ranks_per_node, num_nodes=impl.num_nodes)
    rec.update(fields)
    return rec


def _make_impls(plan: Plan, group: dist.ProcessGroup, where: Placement,
                part: Optional[str] = None) -> Tuple[list, list, Dict[str, str], dict, dict]:
    """The implementations that can run on every rank, their low-latency runners (each with its Buffer; pyep's once
    more per --ll-nodes size, after the one-node runners), those skipped (with why; "<impl> low-latency" where only
    that Buffer failed, "pyep low-latency ranks_per_node=k" for a node size that did not run), and DeepEP's import
    info and DeepEP V2's. part FIRST: no emulated-node runner (the launcher's second set runs them); NODES: those
    alone."""
    R = group.size()
    skipped: Dict[str, str] = {}
    deepep_mod, deepep_info = None, {"version": None, "skipped": "not requested"}
    if "deepep" in plan.impls:
        why = deepep_runner.why_not(where.cuda, where.shared, R, where.gpus)
        if why is None:
            deepep_mod, deepep_info = _import_deepep()
        else:
            deepep_info = {"version": None, "skipped": why}
        why = _agree(group, deepep_info["skipped"] if deepep_mod is None else None)
        if why:
            skipped["deepep"] = why
            deepep_mod = None
    v2_mod, v2_info = None, {"version": None, "skipped": "not requested", "path": None}
    if "deepep_v2" in plan.impls:
        why = deepep_v2_runner.why_not(where.cuda, where.shared, R, where.gpus)
        if why is None:
            v2_mod, v2_info = _import_deepep_v2()
        else:
            v2_info = {"version": None, "skipped": why, "path": None}
        why = _agree(group, v2_info["skipped"] if v2_mod is None else None)
        if why:
            skipped["deepep_v2"] = why
            v2_mod = None
    if "baseline" in plan.impls:
        why = baseline_mod.why_not(where.cuda, where.nccl, where.shared)
        if why:
            skipped["baseline"] = why
    impls = []
    for name in plan.impls:
        if name in skipped:
            continue
        made = []

        def make():
            if name == "baseline":
                made.append(Baseline(group))
                return
            made.append(PyepRunner(group) if name == "pyep" else DeepEPV2Runner(v2_mod, group) if name == "deepep_v2"
                        else DeepEPRunner(deepep_mod, group))
            if plan.cases:
                made[0].open(plan.cases)

        why = _agreed_try(group, make)
        impl = made[0] if made else None
        if why:
            skipped[name] = why
            if impl is not None:
                impl.close()
        else:
            impls.append(impl)
    lls = []
    for impl in impls if plan.ll_cases and part != NODES else []:
        if not isinstance(impl, EPRunner):
            continue
        ll = impl.low_latency()
        why = _agreed_try(group, lambda: ll.open(plan.ll_cases))
        if why:
            skipped[ll.label] = why
            ll.close()
        else:
            lls.append(ll)
    # --ll-nodes: pyep's low-latency rows again on a Buffer of emulated nodes each (PYEP_RANKS_PER_NODE=k around its
    # construction only). They are made later, one at a time (on cuda each is an NVSHMEM group, one a process).
    pyep_impl = next((i for i in impls if i.name == "pyep" and isinstance(i, EPRunner)), None)
    for k, why in plan.ll_nodes_skipped.items():
        skipped[ll_nodes_key(k)] = why
    # DeepEP's low-latency Buffer is an NVSHMEM group of its own in this process, which NVSHMEM allows once.
    nvshmem_taken = one_nvshmem_group(where.cuda) and any(ll.name == "deepep" for ll in lls)
    for k in plan.ll_nodes if plan.ll_cases else []:
        if pyep_impl is None:
            skipped[ll_nodes_key(k)] = "pyep did not run"
        elif part == FIRST:
            continue
        elif nvshmem_taken:
            skipped[ll_nodes_key(k)] = NVSHMEM_TAKEN
        else:
            lls.append(pyep_impl.low_latency(ranks_per_node=k))
    return impls, lls, skipped, deepep_info, v2_info


def _measure(impl, case: Case, ops: List[str], data: dict, plan: Plan, timer: Timer, group: dist.ProcessGroup,
             where: Placement) -> List[dict]:
    """This rank's records of `ops` of one implementation in one case. Every failure is agreed on by all ranks,
    so that they go on (or skip) together. `layout` is prepared apart (it needs no dispatch), so that it is
    measured even where dispatch fails."""
    records = []
    stages = [[op for op in ops if op == "layout"], [op for op in ops if op != "layout"]]
    for full, stage in zip((False, True), stages):
        if stage:
            records += _measure_stage(impl, case, stage, full, data, plan, timer, group, where)
    return records


def _measure_stage(impl, case: Case, ops: List[str], full: bool, data: dict, plan: Plan, timer: Timer,
                   group: dist.ProcessGroup, where: Placement) -> List[dict]:
    rank = group.rank()
    st, err = None, None
    try:
        _sync(group, where)
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
            call, host_call, wait, rc = impl.op(op, case, data, st)
            fields["config"] = list(rc.fields) if rc is not None else None
            _sync(group, where)
            times = timer.run(call, plan.warmup, plan.iters)
            prep = impl.host_prep(op, case, data, st) if hasattr(impl, "host_prep") else None
            host = timer.host(host_call, wait, plan.host_iters, getattr(impl, "launched", None),
                              before=lambda: (_barrier(group, where), prep is not None and prep()))
            med = statistics.median(times)
            nbytes = impl.op_bytes(op, case, st) if hasattr(impl, "op_bytes") else _bytes_of(op, st["recv_tokens"], case.hidden)
            send = impl.send_phase(op, case, data, st) if hasattr(impl, "send_phase") else None
            if send is not None:
                sends, recvs = timer.phases(send, lambda: _barrier(group, where), plan.warmup, plan.iters)
                fields.update(send_us=_median_us(sends), recv_us=_median_us(recvs))
            if "combine_err" in st:
                fields["combine_err"] = st["combine_err"]
            fields.update(median_us=_us(med), min_us=_us(min(times)), max_us=_us(max(times)),
                          times_us=[_us(t) for t in times], host_us=_median_us(host.calls),
                          launch_us=_median_us(host.launches), result_us=_median_us(host.results),
                          recv_tokens=st["recv_tokens"], bytes=nbytes,
                          gbps=_gbps(nbytes / 1e9 / med) if nbytes and med > 0 else None)
        except Exception as e:  # noqa: BLE001 - recorded for this op and case
            err = _err(e)
            if os.environ.get("PYEP_BENCH_DEBUG"):
                traceback.print_exc()
        why = _agree(group, err)
        if why:
            fields = {"config": fields.get("config"), "error": why}
        records.append(_record(impl, case, op, rank, **fields))
    return records


def run(args: argparse.Namespace, group: Optional[dist.ProcessGroup] = None, part: Optional[str] = None):
    """
    Runs the benchmark in every rank of an existing process group (gloo: cpu backend; NCCL: cuda backend,
    each rank on its current device; gloo with PYEP_BACKEND=cuda: cuda backend, ranks that may share GPUs).
    Collective: every rank calls it with the same args.

    Args:
        part: None, the whole run. FIRST or NODES: one of the launcher's two sets of processes (launch.py), the run
            without its emulated-node rows (--ll-nodes) or those rows alone; the launcher merges the two and writes
            the report.

    Returns:
        report: the report written to results.json on rank 0 (with part, rank 0's Part, nothing written); None on
            other ranks.
    """
    group = group or dist.group.WORLD
    rank, R = group.rank(), group.size()
    where = placement(args.device, group)
    device, cuda = where.device, where.cuda
    plan = make_plan(args, where.backend, R)
    if part == NODES:
        plan.cases, plan.impls = [], ["pyep"]
    if where.shared:
        plan.notes.append(SHARED_NOTE)
    lead = rank == 0
    show = lead and not args.quiet
    impls, lls, skipped, deepep_info, v2_info = _make_impls(plan, group, where, part)
    plan.notes += [impl.note for impl in impls if getattr(impl, "note", None)]
    # Node sizes of emulated-node rows: made here (lls), or left to the launcher's second set of processes.
    later = [k for k in plan.ll_nodes if part == FIRST and ll_nodes_key(k) not in skipped]
    if later:
        plan.notes.append(f"pyep's low-latency rows on emulated nodes (--ll-nodes {','.join(map(str, later))}) run in "
                          f"a second set of {R} processes after these: on the cuda backend a process holds one NVSHMEM "
                          "group, and DeepEP's low-latency Buffer makes its own"
                          f"{'' if cuda else f' ({NODES_APART_ENV}=1: the cpu backend does as the cuda backend)'}")
    node_sizes = [(ll.num_nodes, ll.ranks_per_node) for ll in lls if ll.ranks_per_node] + [(R // k, k) for k in later]

    env = environment(where, group, deepep_info, v2_info) if lead else None
    out_dir = None
    if lead:
        out_dir = args.out or default_out_dir()
        os.makedirs(out_dir, exist_ok=True)
    table = Table()
    lines: List[str] = []
    ll_buffers = (part != NODES) + sum(1 for ll in lls if ll.ranks_per_node)  # the one-node set, then each size
    progress = Progress(len(plan.cases) + len(plan.ll_cases) * ll_buffers, show)

    def emit(line: str) -> None:
        lines.append(line)
        if show:
            progress.write(line)

    if lead and part == NODES:
        # The first set said the rest: what is new here (pyep that failed this time) follows its rows.
        for name, why in skipped.items():
            if name not in {ll_nodes_key(k) for k in plan.ll_nodes_skipped}:
                emit(f"skipped {name}: {why}")
    elif lead:
        emit(f"pyep {pyep.__version__} bench: {where.describe(R, env.get('gpu'))}, {plan.mode}: {len(plan.cases)} cases"
             f"{f' + {len(plan.ll_cases)} low-latency' if plan.ll_cases else ''}, "
             f"ops {','.join(plan.ops)}, impls {','.join(i.name for i in impls) or 'none'}, "
             f"{''.join(f'pyep low-latency on {n}x{k} nodes, ' for n, k in node_sizes)}"
             f"warmup {plan.warmup}, iters {plan.iters}, host iters {plan.host_iters}")
        for name, why in skipped.items():
            emit(f"skipped {name}: {why}")
        for note in plan.notes:
            emit(f"note: {note}")
        if plan.cases:
            emit(table.header())

    timer = Timer(device, args.flush_mb)
    done = set()
    results: List[dict] = []
    data: dict = {}
    data_key: dict = {}
    t_start = time.perf_counter()

    def inputs(case) -> None:
        """The case's inputs in data, regenerated only when their shape changes (cases are sorted for that)."""
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

    def gather(records: List[dict]) -> None:
        gathered: List[Optional[List[dict]]] = [None] * R
        dist.all_gather_object(gathered, records, group=group)
        if lead:
            for i in range(len(records)):
                merged = _merge([gathered[r][i] for r in range(R)])
                results.append(merged)
                emit(table.row(merged))
        progress.update()

    for case in plan.cases:
        inputs(case)
        records: List[dict] = []
        for impl in impls:
            todo = []
            for op in plan.ops:
                if op not in impl.ops:
                    continue
                # What a measurement depends on: layout on the routing only; the baseline not on Configs, DeepEP V2
                # (no Config) on the SMs alone.
                if op == "layout":
                    key = (impl.name, op, case.tokens, case.topk, case.experts)
                elif isinstance(impl, Baseline):
                    key = (impl.name, op, case.tokens, case.hidden, case.topk, case.experts)
                elif isinstance(impl, DeepEPV2Runner):
                    key = (impl.name, op, case.tokens, case.hidden, case.topk, case.experts, case.num_sms)
                else:
                    key = (impl.name, op, case)
                if key not in done:
                    done.add(key)
                    todo.append(op)
            if todo:
                records += _measure(impl, case, todo, data, plan, timer, group, where)
        gather(records)

    # Low-latency mode: each implementation's own Buffer (made in _make_impls), after the normal-mode cases; then
    # pyep's emulated-node runners, each Buffer made, measured over every case and destroyed before the next (on cuda
    # a Buffer across nodes is an NVSHMEM group, one a process; the one-node Buffers, DeepEP's NVSHMEM among them,
    # are destroyed first).
    ll_ops = [op for op in plan.ops if op in LL_OPS]
    nodes = [ll for ll in lls if ll.ranks_per_node]
    lls = [ll for ll in lls if not ll.ranks_per_node]
    if lead and part != NODES and plan.ll_cases and (lls or node_sizes):
        emit(table.ll_header())
    for case in plan.ll_cases if part != NODES else []:
        inputs(case)
        records = []
        for ll in lls:
            records += _measure(ll, case, ll_ops, data, plan, timer, group, where)
        gather(records)
    for ll in lls:
        ll.close()
    for ll in nodes:
        why = _agreed_try(group, lambda: ll.open(plan.ll_cases))
        if why:
            skipped[ll.label] = why
            ll.close()
            if lead:
                emit(f"skipped {ll.label}: {why}")
            continue
        for case in plan.ll_cases:
            inputs(case)
            gather(_measure(ll, case, ll_ops, data, plan, timer, group, where))
        ll.close()
    progress.close()
    elapsed = time.perf_counter() - t_start
    for impl in impls:
        impl.close()
    data.clear()

    if not lead:
        _barrier(group, where)
        return None
    try:
        done_part = Part(plan=plan, env=env, skipped=skipped, results=results, lines=lines, elapsed=elapsed,
                         out_dir=out_dir, num_ranks=R, cuda=cuda, shared=where.shared)
        return done_part if part else _finish(args, done_part, table, emit)
    finally:
        _barrier(group, where)
