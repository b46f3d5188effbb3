"""DeepEP's low-latency timing loop (tests/test_low_latency.py's bench_kineto) on pyep, every kernel placed on the
host's clock, so that the ranks' kernels can be laid side by side: which rank's kernel starts first, how long it
waits for the other, and where each rank's device sits idle between two calls.

    PYEP_BACKEND=cuda torchrun --nproc-per-node 2 bench/device/ll_chain.py [--reps 4] [--calls 30] \
        [--trace-from harness|early|now] [--fresh] [--seed 1] [--json FILE] [--timeline-first]
    python3 bench/device/ll_chain.py --traces RANK0.json RANK1.json   (deepep_ll_trace.py's traces)

The loop is the harness's: a large GEMM and an all_reduce over NCCL (a kernel: the host queues the calls while the
GEMM runs, so the calls meet the device back to back, the ranks lined up by the all_reduce), then --calls unhooked
dispatch + combine pairs, with the harness's performance inputs (rank r's routing from seed + r); --reps such loops
traced by torch's profiler. --trace-from says when tracing starts: harness, DeepEP's bench_kineto (an untraced loop,
then tracing starts with the traced ones, no warmup step); early, a loop earlier (the profiler's warmup step, that
loop dropped); now, with the first loop. Kineto puts every kernel on the host's clock, which the ranks of one host
share. Rank 0 prints, per call of the pairs (the first pair of each loop, which follows the all_reduce, apart):
  - each rank's mean kernel duration over every pair (DeepEP's harness's figure), and the first pair's;
  - each rank's median and mean kernel duration over the other pairs;
  - the start and end of rank 1..R-1's kernel against rank 0's (median and spread);
  - each rank's idle gap before the kernel (its start minus its previous kernel's end);
  - the kernel's "late start": how long after the earliest rank's start the last rank starts (what the early rank
    waits at least, since no rank's receive ends before every rank has sent);
  - each rank's "lead": the kernel's start minus the end of the host's launch call (kineto's correlation of the two;
    a lead of a few µs means the device waited for the host), and the pairs whose late start was the largest.
Then the host time of the calls: the median µs of each call's Python (perf_counter around it) in the profiled loop,
and in a plain loop of --calls pairs with the device synchronized before each call.

Each rank takes GPU local_rank % count. Without NCCL (ranks sharing a GPU) the all_reduce goes over gloo, which
waits on the host, so the loop is the host's pace, not the harness's: the script says so.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1, help="rank r's routing from seed + r (the harness's: 1)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--trace-from", choices=("harness", "early", "now"), default="harness",
                    help="when the profiler starts tracing (see the comment at the profile)")
    ap.add_argument("--timeline-first", action="store_true",
                    help="the timeline build (PYEP_LL_TIMELINE=1): print where the first traced pair's blocks spent "
                         "their time (the device is synchronized after that pair)")
    ap.add_argument("--fresh", action="store_true", help="torch.cuda.empty_cache() before each rep's GEMM")
    ap.add_argument("--json", default="", help="rank 0 writes every rank's kernels and host times there")
    ap.add_argument("--traces", nargs="*", help="only read these chrome traces (a rank each, in order: "
                    "deepep_ll_trace.py's) and print the same tables of their low-latency kernels")
    args = ap.parse_args()
    if args.traces:
        return read_traces(args)
    if args.timeline_first:
        os.environ["PYEP_LL_TIMELINE"] = "1"  # read when the Buffer is made
    import torch  # the traces' reader needs no torch
    import torch.distributed as dist
    os.environ.setdefault("PYEP_BACKEND", "cuda")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    import pyep

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, R = group.rank(), group.size()
    one_gpu_a_rank = R <= torch.cuda.device_count()
    barrier_group = dist.new_group(backend="nccl") if one_gpu_a_rank else group
    M, H, K, E = args.tokens, args.hidden, args.topk, args.experts - args.experts % R
    buffer = pyep.Buffer(group, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True)
    # The harness's performance inputs: small random rows, sorted top-k with 10 selections masked, random weights.
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    x = torch.randn((M, H), dtype=torch.bfloat16, device="cuda") * 0.1
    scores = torch.randn((M, E), device="cuda").abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
    for _ in range(10):
        topk_idx[random.randint(0, M - 1), random.randint(0, K - 1)] = -1
    weights = torch.randn((M, K), dtype=torch.float32, device="cuda").abs()
    stats = torch.zeros((E // R,), dtype=torch.int32, device="cuda")
    (recv, _), _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True)
    rows = recv.to(torch.bfloat16)  # the combine's input; its values do not matter to the times
    host = {"d": [], "c": []}

    def pair(times: dict) -> None:
        nonlocal handle
        t0 = time.perf_counter()
        handle = buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats,
                                             use_fp8=True)[2]
        t1 = time.perf_counter()
        buffer.low_latency_combine(rows, topk_idx, weights, handle)
        times["d"].append((t1 - t0) * 1e6)
        times["c"].append((time.perf_counter() - t1) * 1e6)

    for _ in range(8):
        pair({"d": [], "c": []})
    dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"), group=barrier_group)  # NCCL's setup, untimed
    torch.cuda.synchronize()
    dist.barrier(group)

    from torch.profiler import ProfilerActivity, profile
    # The profiler's steps: --trace-from harness is DeepEP's bench_kineto (a rep untraced, then tracing starts with the
    # traced rep); early starts tracing a rep before the traced ones and drops that rep; now traces from the first rep.
    wait, warmup = {"harness": (1, 0), "early": (0, 1), "now": (0, 0)}[args.trace_from]
    kernels, launches, others = [], {}, []

    def collect(p) -> None:
        for e in p.profiler.kineto_results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA:
                if "pyep" in e.name() and ("dispatch" in e.name() or "combine" in e.name()):
                    kernels.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.correlation_id()))
                else:
                    others.append((e.name()[:40], e.duration_ns()))
            elif "LaunchKernel" in e.name():  # the host's launch call (driver or runtime API), on the same clock
                launches[e.correlation_id()] = e.start_ns() + e.duration_ns()

    with profile(activities=[ProfilerActivity.CUDA], on_trace_ready=collect,
                 schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=args.reps, repeat=1)) as prof:
        for step in range(wait + warmup + args.reps):
            if args.fresh:
                torch.cuda.empty_cache()  # the next allocations are new mappings
            lhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
            rhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
            lhs @ rhs
            dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"), group=barrier_group)
            for i in range(args.calls):
                pair(host)
                if args.timeline_first and i == 0 and step == wait + warmup:
                    torch.cuda.synchronize()  # the first traced pair's stamps; the loop's later calls meet the host
                    first_stamps = buffer._low_latency_timeline()
            torch.cuda.synchronize()
            prof.step()
    kernels = [(s, e, launches.get(c, 0)) for s, e, c in sorted(kernels)]
    if args.timeline_first:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ll_profile import print_timeline, timeline_report
        reports = [None] * R
        dist.all_gather_object(reports, timeline_report(first_stamps[0], [first_stamps[1]]), group=group)
        if rank == 0:
            print("ll_chain --timeline-first: the first traced pair's kernels", flush=True)
            print_timeline(reports, 1)

    plain = {"d": [], "c": []}
    for _ in range(args.calls):
        torch.cuda.synchronize()
        pair(plain)
    torch.cuda.synchronize()

    got = [None] * R
    dist.all_gather_object(got, {"kernels": kernels, "host": host, "plain": plain, "others": others}, group=group)
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": got}, f)
        report(got, args, one_gpu_a_rank)
    buffer.destroy()
    dist.destroy_process_group()


def read_traces(args) -> None:
    """The tables of the low-latency kernels in chrome traces (one a rank, one loop of pairs each), pyep's or DeepEP's."""
    got = []
    for path in args.traces:
        with open(path) as f:
            trace = json.load(f)
        base = int(trace.get("baseTimeNanoseconds", 0))
        kernels = sorted((base + int(e["ts"] * 1e3), base + int((e["ts"] + e["dur"]) * 1e3), 0)
                         for e in trace["traceEvents"] if e.get("cat") == "kernel"
                         and ("pyep" in e.get("name", "") or "deep_ep" in e.get("name", ""))
                         and ("dispatch" in e["name"] or "combine" in e["name"]))
        got.append({"kernels": kernels})
    args.calls, args.reps = len(got[0]["kernels"]) // 2, 1
    print(f"ll_chain --traces: {', '.join(args.traces)}")
    report(got, args, True)


def report(got: list, args, one_gpu_a_rank: bool) -> None:
    R, n = len(got), 2 * args.calls
    want = n * args.reps
    print(f"ll_chain: {R} ranks, {args.reps} reps of {args.calls} dispatch + combine pairs (each rep's first pair "
          f"apart), {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}")
    if not one_gpu_a_rank:
        print("note: ranks share a GPU: the all_reduce went over gloo (NCCL refuses), so the host sets the pace, not "
              "the harness's back-to-back kernels")
    for r, g in enumerate(got):
        if len(g["kernels"]) != want:
            print(f"rank {r}: {len(g['kernels'])} low-latency kernels seen, expected {want}: no table")
            return

    def med(v: list) -> str:
        return f"{statistics.median(v):6.2f}" if v else "     -"

    def spread(v: list) -> str:
        v = [a for a in v if a == a]  # a kernel whose launch call kineto did not see has no lead (nan)
        if not v:
            return "-"
        q = sorted(v)
        return f"{statistics.median(v):6.2f} [{q[len(q) // 10]:6.2f} {q[(9 * len(q)) // 10]:6.2f}]"

    us = 1e-3
    for j, op in enumerate(("dispatch", "combine")):
        dur = [[] for _ in range(R)]
        gap = [[] for _ in range(R)]
        start_vs0 = [[] for _ in range(R)]
        end_vs0 = [[] for _ in range(R)]
        late, lead = [], [[] for _ in range(R)]
        for rep in range(args.reps):
            for i in range(1, args.calls):
                k = rep * n + 2 * i + j
                s = [got[r]["kernels"][k][0] for r in range(R)]
                e = [got[r]["kernels"][k][1] for r in range(R)]
                late.append((max(s) - min(s)) * us)
                for r in range(R):
                    dur[r].append((e[r] - s[r]) * us)
                    gap[r].append((s[r] - got[r]["kernels"][k - 1][1]) * us)
                    start_vs0[r].append((s[r] - s[0]) * us)
                    end_vs0[r].append((e[r] - e[0]) * us)
                    launched = got[r]["kernels"][k][2]
                    lead[r].append((s[r] - launched) * us if launched else float("nan"))
        first = [[(got[r]["kernels"][rep * n + j][1] - got[r]["kernels"][rep * n + j][0]) * us for rep in range(args.reps)]
                 for r in range(R)]
        print(f"\n{op}: late start (last rank's start - first's), median [p10 p90]: {spread(late)} µs")
        print("  the harness's figure, the mean of every pair's kernel (the first of a rep included): " + ", ".join(
            f"rank {r} {statistics.mean(dur[r] + first[r]):.2f}" for r in range(R)) + " µs; the first of a rep: "
            + ", ".join(f"rank {r} " + "/".join(f"{v:.1f}" for v in first[r]) for r in range(R)) + " µs")
        print(f"  {'rank':>4} {'duration':>8} {'mean':>6} {'idle before':>11}   {'start - rank 0 [p10 p90]':>26}   "
              f"{'end - rank 0 [p10 p90]':>26}   {'lead [p10 p90]':>26}")
        for r in range(R):
            print(f"  {r:>4} {med(dur[r]):>8} {statistics.mean(dur[r]):6.2f} {med(gap[r]):>11}   "
                  f"{spread(start_vs0[r]):>26}   {spread(end_vs0[r]):>26}   {spread(lead[r]):>26}")
        worst = sorted(range(len(late)), key=lambda q: -late[q])[:6]
        print("  largest late starts: " + "; ".join(
            f"rep {q // (args.calls - 1)} pair {q % (args.calls - 1) + 1}: {late[q]:.1f} µs (lead "
            + "/".join(f"{lead[r][q]:.0f}" for r in range(R)) + ", idle before "
            + "/".join(f"{gap[r][q]:.1f}" for r in range(R)) + ")" for q in worst))
    if "host" not in got[0]:
        return
    print("\nhost µs of a call (Python's call; profiled loop: median p90 max | plain loop, device idle before each: "
          "median):")
    for r, g in enumerate(got):
        def tail(v: list) -> str:
            q = sorted(v)
            return f"{statistics.median(q):6.2f} {q[(9 * len(q)) // 10]:6.2f} {q[-1]:7.1f}"
        print(f"  rank {r}: dispatch {tail(g['host']['d'])} | {med(g['plain']['d'])}   combine {tail(g['host']['c'])} | "
              f"{med(g['plain']['c'])}")
    for r, g in enumerate(got):
        names = {}
        for name, d in g["others"]:
            names.setdefault(name, []).append(d / 1e3)
        print(f"  rank {r}'s other kernels: " + "; ".join(f"{k} x{len(v)} median {statistics.median(v):.1f} µs"
                                                        for k, v in sorted(names.items())))
    print(flush=True)


if __name__ == "__main__":
    main()
