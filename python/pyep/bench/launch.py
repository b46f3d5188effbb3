"""Starting the ranks: spawned by the launcher, or one process each under torchrun.

With --ll-nodes on the cuda backend the launcher spawns the ranks twice: NVSHMEM is one group a process, for the
process's life, and pyep's Buffers of emulated nodes make one while DeepEP's low-latency Buffer makes its own. The
first set of processes runs everything but the emulated-node rows; after it exits, a second set runs those rows alone
(pyep only); the launcher merges both into one report, as if one run. Under torchrun there is no second set."""
import argparse
import datetime
import json
import os
import pickle
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .gpus import claim_cuda_backend, device_index, shares_gpus
from .plan import ll_nodes_key, make_plan, parse_args
from .report import Part, Table, _finish, default_out_dir, merge_parts, replot
from .sweep import FIRST, NODES, one_nvshmem_group, run

_HOST = "127.0.0.1"
# The store key under which rank 0 of a set of processes hands its Part to the launcher.
_PART_KEY = "pyep-bench/part"


def _want_cuda(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return False
    available = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not available:
        raise SystemExit("--device cuda: no CUDA device is available")
    return available


def _device_id(nccl: bool) -> dict:
    """init_process_group's device_id (binds the NCCL group to this rank's GPU) where torch has it."""
    import inspect
    if nccl and "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": torch.device("cuda", torch.cuda.current_device())}
    return {}


def _set_cpu_threads(local_world: int) -> None:
    # Ranks share the cores: without OMP_NUM_THREADS, give each an equal share.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))


def _join(local_rank: int, local_world: int, cuda: bool) -> str:
    """Takes this rank's device and returns the process group backend: NCCL with a GPU a rank; gloo on the cpu
    backend, and gloo (with PYEP_BACKEND=cuda) when the local ranks outnumber the GPUs and so share them, round
    robin (NCCL refuses a communicator whose ranks share a GPU)."""
    if not cuda:
        _set_cpu_threads(local_world)
        return "gloo"
    count = torch.cuda.device_count()
    torch.cuda.set_device(device_index(local_rank, count))
    if shares_gpus(local_world, count):
        claim_cuda_backend()
        return "gloo"
    return "nccl"


def _worker(local_rank: int, nprocs: int, opts: dict, host: str, port: int, part: Optional[str] = None) -> None:
    """A spawned rank: joins the group through the launcher's store and runs the bench (part: see sweep.run; rank 0
    then hands its Part to the launcher through the store)."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=host, MASTER_PORT=str(port))
    args = argparse.Namespace(**opts)
    timeout = datetime.timedelta(seconds=args.timeout)
    backend = _join(local_rank, nprocs, opts["_cuda"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=nprocs, timeout=timeout,
                            **_device_id(backend == "nccl"))
    try:
        out = run(args, dist.group.WORLD, part)
        if part is not None and local_rank == 0:
            store.set(_PART_KEY, pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def _spawn_set(nprocs: int, opts: dict, part: Optional[str] = None) -> Optional[Part]:
    """Spawns the ranks and waits for them; with part, returns rank 0's Part."""
    import torch.multiprocessing as mp

    # The launcher holds the rendezvous store on a port the OS picks: no clash with another group. A set of processes
    # has a store of its own: a second group on the first's store would meet its keys.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=opts["timeout"]))
    # _worker pickles by its module path (pyep.bench.launch), also under `python -m pyep.bench`.
    mp.spawn(_worker, args=(nprocs, opts, _HOST, store.port, part), nprocs=nprocs, join=True)
    if part is None:
        return None
    if not store.check([_PART_KEY]):
        raise RuntimeError("rank 0 ended without its results")
    return pickle.loads(store.get(_PART_KEY))


def _failure(e: BaseException) -> str:
    """A failed set of processes in a line: torch's ProcessRaisedException holds the rank's traceback, whose last
    line is the error."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    rank = getattr(e, "error_index", None)
    where = f"rank {rank}: " if rank is not None else ""
    return f"the second set of processes failed ({where}{text[-1] if text else type(e).__name__})"[:300]


def _spawn_two_sets(args: argparse.Namespace, nprocs: int, opts: dict) -> dict:
    """--ll-nodes where a process holds one NVSHMEM group: everything else in a first set of processes, the
    emulated-node rows in a second once the first has exited; one report of both, written here."""
    first = _spawn_set(nprocs, opts, FIRST)
    part, why = first, None
    # The first set skipped every size already where pyep did not run there: no second set then.
    if any(ll_nodes_key(k) not in first.skipped for k in first.plan.ll_nodes):
        try:
            part = merge_parts(first, _spawn_set(nprocs, opts, NODES))
        except Exception as e:  # noqa: BLE001 - the first set's rows are still reported
            why = _failure(e)

    def emit(line: str) -> None:
        part.lines.append(line)
        if not args.quiet:
            print(line, flush=True)

    if why:
        for k in part.plan.ll_nodes:
            if ll_nodes_key(k) not in part.skipped:
                part.skipped[ll_nodes_key(k)] = why
                emit(f"skipped {ll_nodes_key(k)}: {why}")
    return _finish(argparse.Namespace(**opts), part, Table(), emit)


def _spawn(args: argparse.Namespace) -> Optional[dict]:
    cuda = _want_cuda(args)
    count = torch.cuda.device_count() if cuda else 0
    nprocs = args.nprocs or (count if cuda else 4)
    if shares_gpus(nprocs, count):
        claim_cuda_backend()  # here, so that a conflicting PYEP_BACKEND stops the launcher, not every rank
    plan = make_plan(args, "cuda" if cuda else "cpu", nprocs)  # argument errors here, not in every rank
    opts = dict(vars(args))
    opts["out"] = args.out or default_out_dir()
    opts["_cuda"] = cuda
    if plan.ll_nodes and one_nvshmem_group(cuda):
        return _spawn_two_sets(args, nprocs, opts)
    _spawn_set(nprocs, opts)
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
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        backend = _join(int(os.environ.get("LOCAL_RANK", "0")), local_world, _want_cuda(args))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                                **_device_id(backend == "nccl"))
        own = True
    try:
        return run(args, dist.group.WORLD)
    finally:
        if own:
            dist.destroy_process_group()
