"""Low-latency calls laid out for Nsight Compute: hooked dispatches and combines at the reference shape, every
kernel alone (the device synchronized and the ranks at a barrier between any two), so that ncu's kernel replay of
one rank's kernel never meets another rank's next call. A replayed send rewrites the same rows and flags; a
replayed receive finds its flags set and reads the same slots.

    PYEP_BACKEND=cuda ncu --target-processes all -k regex:'dispatch|combine' --launch-skip 8 --launch-count 4 \\
        torchrun --nproc-per-node 2 bench/device/ll_profile.py

With --timeline (PYEP_LL_TIMELINE=1, set here before the Buffer is made) the kernels are the timeline build, which
stamps %globaltimer where each phase of each block ends (kernels/params.h), and the script prints, per kernel and
phase, the median and max over blocks (and the iterations after the first) of the phase's duration (from the block's
previous stamp) and of its end (from the kernel's earliest start on that rank), for rank 0 and the kernel's slowest
rank (the greatest max end of its last phase):

    PYEP_BACKEND=cuda torchrun --nproc-per-node 2 bench/device/ll_profile.py --timeline

With --timeline --twice every iteration makes a second hooked dispatch right after the first one's hook, and the
second's kernels are reported apart ("after a dispatch"): the same code just ran on every SM, while the first follows a
combine's kernels (whether the kernels' first phases wait on instruction fetches).

With --kineto the script times whole (unhooked) calls instead, as DeepEP's harness does (torch's profiler, every
kernel's duration on the device): sequences of calls repeated back to back ("dc": a dispatch then a combine, as the
harness; "ddc": two dispatches then a combine; "d": dispatches only), and prints the median duration of the kernel at
each place of a sequence.

Each rank takes GPU local_rank % count; pyep's exchanges go over a gloo group (no NCCL kernel to filter out).
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--timeline", action="store_true", help="stamp each phase of each block and print where time goes")
    ap.add_argument("--twice", action="store_true", help="with --timeline: a second dispatch after each, reported apart")
    ap.add_argument("--kineto", default="", help="time unhooked calls in these comma-separated sequences, e.g. dc,ddc,d")
    args = ap.parse_args()
    if args.timeline:
        os.environ["PYEP_LL_TIMELINE"] = "1"  # read when the Buffer is made
    gpu = torch.cuda.is_available()  # without one (a dry run of this script) the cpu backend
    if gpu:
        os.environ.setdefault("PYEP_BACKEND", "cuda")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dev = "cuda" if gpu else "cpu"
    import pyep

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, R = group.rank(), group.size()
    M, H, K, E = args.tokens, args.hidden, args.topk, args.experts - args.experts % R
    buffer = pyep.Buffer(group, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True)
    torch.manual_seed(rank)
    x = torch.randn((M, H), dtype=torch.bfloat16, device=dev)
    scores = torch.randn((M, E), device=dev).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False)[1]
    weights = torch.rand((M, K), dtype=torch.float32, device=dev)

    def alone() -> None:
        if gpu:
            torch.cuda.synchronize()
        dist.barrier(group)

    buffer.clean_low_latency_buffer(M, H, E)
    alone()
    if args.kineto:
        kineto_sequences(buffer, x, topk_idx, weights, M, E, args.kineto.split(","), args.iters, rank, alone)
        buffer.destroy()
        dist.destroy_process_group()
        return

    def hooked_dispatch():
        got = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True, return_recv_hook=True)
        alone()
        got[-1]()
        alone()
        return got

    timelines = []
    for it in range(args.iters):
        (recv, scales), count, handle, _, hook = hooked_dispatch()
        if args.timeline and args.twice:
            first = buffer._low_latency_timeline()  # this iteration's first dispatch (and the last one's combine)
            (recv, scales), count, handle, _, hook = hooked_dispatch()
        rows = recv.to(torch.bfloat16)  # the values do not matter to the profile, only the shapes
        _, _, hook = buffer.low_latency_combine(rows, topk_idx, weights, handle, return_recv_hook=True)
        alone()
        hook()
        alone()
        if args.timeline:
            phases, stamps = buffer._low_latency_timeline()
            if args.twice:  # the first dispatch's kernels under their names, the second's as "after a dispatch"
                cols = [i for i, (k, _) in enumerate(first[0]) if k.startswith("dispatch")]
                phases = [(k, ph) for k, ph in first[0] if k.startswith("dispatch")] + [
                    (k + " after a dispatch" if k.startswith("dispatch") else k, ph) for k, ph in phases]
                stamps = torch.cat([first[1][:, cols], stamps], dim=1)
            if it > 0:  # the first calls meet cold caches and TLBs
                timelines.append(stamps)
    if args.timeline:
        report = timeline_report(phases, timelines)
        reports = [None] * R
        dist.all_gather_object(reports, report, group=group)
        if rank == 0:
            print_timeline(reports, len(timelines))
    if rank == 0:
        print(f"ll_profile: {args.iters} hooked dispatch + combine pairs on {R} ranks, {M} tokens, hidden {H}, "
              f"top-{K} of {E}", flush=True)
    buffer.destroy()
    dist.destroy_process_group()


def kineto_sequences(buffer, x, topk_idx, weights, M: int, E: int, seqs: list, iters: int, rank: int, alone) -> None:
    """Unhooked calls in each sequence of seqs ("d" a dispatch, "c" a combine of the last dispatch's rows), the
    sequence repeated 4 * iters times back to back under torch's profiler; rank 0 prints, per place in the sequence,
    the median and min device duration of pyep's low-latency kernel there (each rank's, so the slower shows)."""
    from torch.profiler import ProfilerActivity, profile

    (recv, _), _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True)
    rows = recv.to(torch.bfloat16)
    buffer.low_latency_combine(rows, topk_idx, weights, handle)
    alone()
    lines = []
    for seq in seqs:
        def once():
            nonlocal handle
            for op in seq:
                if op == "d":
                    handle = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True)[2]
                else:
                    buffer.low_latency_combine(rows, topk_idx, weights, handle)
        for _ in range(4):
            once()
        alone()
        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            for _ in range(4 * iters):
                once()
            alone()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and "pyep" in e.name and ("dispatch" in e.name or "combine" in e.name)),
                         key=lambda e: e.time_range.start)
        n = len(seq)
        if len(kernels) != n * 4 * iters:
            lines.append(f"  {seq}: {len(kernels)} kernels seen, expected {n * 4 * iters} (names: "
                         f"{sorted({e.name for e in kernels})})")
            continue
        cells = []
        for j, op in enumerate(seq):
            d = [e.time_range.elapsed_us() for e in kernels[j::n]]
            cells.append(f"{op}{j}: {statistics.median(d):6.2f} (min {min(d):6.2f})")
        lines.append(f"  {seq:<6} " + "   ".join(cells))
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, lines)
    if rank == 0:
        print(f"ll_profile --kineto: {4 * iters} repeats a sequence, device µs of each place's kernel, median (min)")
        for r, ls in enumerate(got):
            print(f"rank {r}:")
            print("\n".join(ls), flush=True)


def timeline_report(phases: list, timelines: list) -> dict:
    """This rank's statistics, by kernel: its phases, each with the durations and ends (ns) of every block of every
    iteration that reached it, and the kernel's blocks; also the smallest step seen between two stamps (the timer's
    resolution, or less)."""
    out = {"kernels": {}, "step": None}
    for stamps in timelines:
        values = sorted(set(stamps[stamps >= 0].tolist()))
        steps = [b - a for a, b in zip(values, values[1:]) if b > a]
        if steps:
            out["step"] = min(steps + ([out["step"]] if out["step"] else []))
        for kernel in dict.fromkeys(k for k, _ in phases):
            cols = [i for i, (k, _) in enumerate(phases) if k == kernel]
            rows = stamps[:, cols].tolist()
            starts = [r[0] for r in rows if r[0] >= 0]
            if not starts:
                continue
            t0 = min(starts)
            k = out["kernels"].setdefault(kernel, {"phases": [phases[i][1] for i in cols], "blocks": len(starts),
                                                   "dur": [[] for _ in cols], "end": [[] for _ in cols]})
            for r in rows:
                prev = None
                for j, v in enumerate(r):
                    if v < 0:
                        continue
                    k["end"][j].append(v - t0)
                    if prev is not None:
                        k["dur"][j].append(v - prev)
                    prev = v
    return out


def print_timeline(reports: list, iters: int) -> None:
    """Rank 0's and each kernel's slowest rank's phases: median and max over blocks of duration and end, in µs."""
    def stats(v: list) -> str:
        return f"{statistics.median(v) / 1e3:7.2f} {max(v) / 1e3:7.2f}" if v else f"{'-':>7} {'-':>7}"

    steps = [r["step"] for r in reports if r["step"]]
    print(f"ll_profile --timeline: {iters} iterations a rank after the first, each kernel alone; per phase, median "
          f"and max over blocks (and iterations) of its duration (since the block's previous stamp) and of its end "
          f"(since the kernel's first block started), in µs; the smallest step between two stamps was "
          f"{min(steps) if steps else '-'} ns", flush=True)
    for kernel in reports[0]["kernels"]:
        def last_end(r: int) -> float:
            k = reports[r]["kernels"].get(kernel)
            return max(k["end"][-1], default=0) if k else 0
        slow = max(range(len(reports)), key=last_end)
        k0, ks = reports[0]["kernels"][kernel], reports[slow]["kernels"][kernel]
        print(f"\n{kernel}: {k0['blocks']} blocks; rank 0 ends by {last_end(0) / 1e3:.2f} µs, the slowest rank "
              f"({slow}) by {last_end(slow) / 1e3:.2f} µs")
        print(f"  {'phase':<10} | {'rank 0: dur med max':>21} {'end med max':>15} | {f'rank {slow}: dur med max':>21} "
              f"{'end med max':>15}")
        for j, phase in enumerate(k0["phases"]):
            print(f"  {phase:<10} | {stats(k0['dur'][j]):>21} {stats(k0['end'][j]):>15} | {stats(ks['dur'][j]):>21} "
                  f"{stats(ks['end'][j]):>15}")
    print(flush=True)


if __name__ == "__main__":
    main()
