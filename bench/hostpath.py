"""Host time of pyep's calls, one rank, one GPU (or the cpu backend): where each call's microseconds go.

    python bench/hostpath.py                      # 4096 tokens, hidden 7168, top-8 of 256 experts, Buffer.num_sms
    python bench/hostpath.py --tokens 1024 --iters 500 --json out.json
    python bench/hostpath.py --ll                 # low-latency mode: 128 tokens, hidden 7168, top-8 of 288 experts

For get_dispatch_layout, dispatch (BF16, FP8), cached dispatch and combine it times, per call, with the device idle
before each one (torch.cuda.synchronize) and the medians of --iters calls:
    python  Python's part: from the call to the Go core's entry (LastEntryNs, the core's CLOCK_MONOTONIC stamp, which
            is time.perf_counter's clock);
    go      from there to right after the last kernel launch (BufferLastLaunchNs; cuda only), split into
    core      the Go core up to the driver's launch call (BufferLastLaunchStartNs), and
    driver    that call (cuLaunchKernel);
    launch  the two together: the call's host time up to its last launch;
    return  the call to its return (a dispatch waits for notify's count; the call's Python after the core included).
Every dispatch passes the tensors its layout returned, as a model does, and its layout is made anew before it (untimed,
before the device goes idle), as a model's layer makes it: the layout allocates ahead what the dispatch would (see
the README's "Notes on the Go binding"). Likewise every combine follows a dispatch (with its layout, untimed), whose
handle it takes: the dispatch allocates ahead the combine's outputs (combine_again: the same combine after a combine,
which allocates them). The layout also plans its dispatch, and the dispatch its combine (README, "Notes on the Go
binding"): with PYEP_PLANS=0 they run unplanned, for an A/B. A pyep build without LastEntryNs (before the host path)
still gives launch and return.

With --ll the calls are low-latency mode's, on a low-latency Buffer of the one rank: ll_dispatch_fp8 and
ll_dispatch_bf16 (unhooked), ll_combine (after a dispatch, untimed, whose handle it takes), ll_dispatch_send (a
dispatch with return_recv_hook=True: the send; its hook is called after, untimed) and ll_dispatch_hook (that hook:
the receive, after an untimed hooked dispatch). --harness times the unhooked dispatches.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import pyep
from pyep import _core


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ll", action="store_true", help="low-latency mode's calls instead of normal mode's")
    p.add_argument("--ll-tokens", type=int, default=128, help="with --ll: num_max_dispatch_tokens_per_rank, all sent")
    p.add_argument("--ll-experts", type=int, default=288)
    p.add_argument("--sms", type=int, default=None, help="Buffer.set_num_sms (default: pyep's)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", help="also write the medians (and every sample) here")
    p.add_argument("--default-device", action="store_true",
                   help="torch.set_default_device(the device) first, as DeepEP's tests do (a torch function mode)")
    p.add_argument("--side-stream", action="store_true",
                   help="run the timed calls on a torch.cuda.Stream() of their own instead of the default (legacy) stream")
    p.add_argument("--harness", action="store_true",
                   help="also time each call as DeepEP V1's tests/utils.py bench does (calls back to back, events "
                        "around each): the event time, and the host time of the same calls")
    return p.parse_args(argv)


def stamps(rid, cuda):
    """The core's entry, its last launch's start and end stamps, in ns (None where this build or backend has none)."""
    entry = start = launch = None
    try:
        entry = _core.call("LastEntryNs")
    except (AttributeError, _core.PyepError):
        pass
    if cuda:
        launch = _core.call("BufferLastLaunchNs", rid)
        try:
            start = _core.call("BufferLastLaunchStartNs", rid)
        except (AttributeError, _core.PyepError):
            pass
    return entry, start, launch


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="pyep-hostpath-")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    group = dist.group.WORLD
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    setup = (low_latency_calls if args.ll else normal_calls)(args, group, device)
    calls, preps = setup.calls, setup.preps
    rid = setup.buffer.runtime.id
    if cuda and args.side_stream:
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.Stream())
    if args.default_device:  # after the inputs (made from a cpu generator), before the timed calls
        torch.set_default_device(device)
    columns = ("python", "core", "driver", "go", "launch", "return")
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "pyep": pyep.__version__,
              "plans": os.environ.get("PYEP_PLANS", "1") != "0", "side_stream": bool(cuda and args.side_stream),
              **setup.shape, "iters": args.iters, "median_us": {}, "samples_us": {}}
    print(f"pyep {pyep.__version__} on {report['device']}: {setup.title}; medians of {args.iters} calls, the device "
          f"idle before each (µs); plans "
          f"{'on' if report['plans'] else 'off (PYEP_PLANS=0)'}, {'a stream of its own' if report['side_stream'] else 'the default stream'}")
    print(f"{'call':16s}" + "".join(f"{c:>10s}" for c in columns))
    for name, call in calls.items():
        samples = {c: [] for c in columns}
        prep = preps.get(name)
        for i in range(args.warmup + args.iters):
            if prep is not None:
                prep()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            entry, start, launch = stamps(rid, cuda)
            if name in setup.posts:
                setup.posts[name]()
            if i < args.warmup:
                continue
            samples["return"].append((t1 - t0) / 1e3)
            if entry is not None:
                samples["python"].append((entry - t0) / 1e3)
            if launch is not None:
                samples["launch"].append((launch - t0) / 1e3)
                if entry is not None:
                    samples["go"].append((launch - entry) / 1e3)
                if start is not None:
                    samples["driver"].append((launch - start) / 1e3)
                    if entry is not None:
                        samples["core"].append((start - entry) / 1e3)
        if name in setup.after:
            setup.after[name]()
        med = {c: round(statistics.median(v), 2) if v else None for c, v in samples.items()}
        report["median_us"][name] = med
        report["samples_us"][name] = samples
        print(f"{name:16s}" + "".join(f"{'-' if med[c] is None else format(med[c], '.1f'):>10s}" for c in columns))
    if cuda and args.harness:
        # Low-latency mode: the unhooked dispatches only (a combine back to back would reuse one handle).
        report["harness_us"] = harness({n: calls[n] for n in ("ll_dispatch_fp8", "ll_dispatch_bf16")} if args.ll
                                       else calls)
    if cuda:
        torch.cuda.synchronize()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.1)  # gloo's worker threads release the barrier's tensors (see README, Known issues)
    return report


def normal_calls(args, group, device) -> SimpleNamespace:
    """A normal-mode Buffer of the one rank and its calls at args' shape: buffer; calls; preps (untimed, before each
    call), posts (untimed, after each) and after (once after a call's samples), by call; shape (for the report) and
    title."""
    if args.sms:
        pyep.Buffer.set_num_sms(args.sms)
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    buffer = pyep.Buffer(group, pyep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(device)
    x_bf16 = x.to(torch.bfloat16)
    blocks = x.view(T, H // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    x_fp8 = ((blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H), (amax / 448.0).contiguous())
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv, _, recv_w, _, handle, _ = buffer.dispatch(x_bf16, **layout, topk_idx=topk, topk_weights=weights)
    y = recv.clone()

    def new_layout():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
        layout.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    state = {"handle": handle, "recv_w": recv_w}

    def new_dispatch():  # a combine's dispatch, as in a layer
        new_layout()
        _, _, w, _, h, _ = buffer.dispatch(x_bf16, **layout, topk_idx=topk, topk_weights=weights)
        state.update(handle=h, recv_w=w)

    # What runs before each timed call, untimed: a dispatch's layout, a combine's dispatch.
    preps = {"dispatch_bf16": new_layout, "dispatch_fp8": new_layout, "combine_bf16": new_dispatch}
    calls = {
        "layout": lambda: buffer.get_dispatch_layout(topk, E),
        "dispatch_bf16": lambda: buffer.dispatch(x_bf16, **layout, topk_idx=topk, topk_weights=weights),
        "dispatch_fp8": lambda: buffer.dispatch(x_fp8, **layout, topk_idx=topk, topk_weights=weights),
        "dispatch_cached": lambda: buffer.dispatch(x_bf16, handle=handle),
        "combine_bf16": lambda: buffer.combine(y, state["handle"], topk_weights=state["recv_w"]),
        # The same combine after a combine, with no dispatch between: nothing was allocated ahead for it.
        "combine_again": lambda: buffer.combine(y, state["handle"], topk_weights=state["recv_w"]),
    }
    return SimpleNamespace(
        buffer=buffer, calls=calls, preps=preps, posts={},
        after={"layout": new_layout},  # the calls after it pass the last layout's tensors, as a model's dispatch does
        shape={"tokens": T, "hidden": H, "topk": K, "experts": E, "num_sms": pyep.Buffer.num_sms},
        title=f"{T} tokens, hidden {H}, top-{K} of {E} experts, {pyep.Buffer.num_sms} SMs")


def low_latency_calls(args, group, device) -> SimpleNamespace:
    """A low-latency Buffer of the one rank and its calls (the module's docstring), as normal_calls's. A hooked
    dispatch's hook is called before the next call, so that at most one awaits its hook."""
    M, H, K, E = args.ll_tokens, args.hidden, args.topk, args.ll_experts
    buffer = pyep.Buffer(group, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E),
                         low_latency_mode=True, num_qps_per_rank=E)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, H, generator=g) * 0.1).to(torch.bfloat16).to(device)
    topk = torch.rand(M, E, generator=g).topk(K, dim=1).indices.to(device)
    weights = torch.rand(M, K, generator=g).to(device)
    (recv, _), _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=True)
    y = recv.to(torch.bfloat16)  # the combine's input, the experts' rows
    state = {"handle": handle, "hook": None}

    def new_dispatch():  # a combine's dispatch, as in a layer
        state["handle"] = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=True)[2]

    def hooked():
        state["hook"] = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=True, return_recv_hook=True)[4]

    def receive():
        hook, state["hook"] = state["hook"], None
        hook()

    calls = {
        "ll_dispatch_fp8": lambda: buffer.low_latency_dispatch(x, topk, M, E, use_fp8=True),
        "ll_dispatch_bf16": lambda: buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False),
        "ll_combine": lambda: buffer.low_latency_combine(y, topk, weights, state["handle"]),
        "ll_dispatch_send": hooked,
        "ll_dispatch_hook": receive,
    }
    preps = {"ll_combine": new_dispatch, "ll_dispatch_hook": hooked}
    return SimpleNamespace(
        buffer=buffer, calls=calls, preps=preps, posts={"ll_dispatch_send": receive}, after={},
        shape={"low_latency": True, "tokens": M, "hidden": H, "topk": K, "experts": E},
        title=f"low-latency mode, {M} tokens, hidden {H}, top-{K} of {E} experts")


def harness(calls, warmups=50, tests=50):
    """DeepEP V1's bench (tests/utils.py): warmups queued without a wait, one 256 MB memset, then `tests` calls
    back to back with an event before and after each; the mean of the event times after the first. Beside it the
    mean host time of those calls; the events with the device idle before each call; and with the 256 MB memset
    before each call instead (the device busy when the call is queued: its kernels' time, L2 flushed)."""
    print("DeepEP V1's harness: mean µs of the events around a call (calls back to back), the host time of those "
          "calls, the events with the device idle before each call, and with L2 flushed before each (kernel time)")
    print(f"{'call':16s}{'events':>10s}{'host':>10s}{'idle':>10s}{'flushed':>10s}")
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    out = {}
    for name, call in calls.items():
        row = []
        for mode in ("back_to_back", "idle", "flushed"):
            torch.cuda.synchronize()
            for _ in range(warmups):
                call()
            cache.zero_()
            start = [torch.cuda.Event(enable_timing=True) for _ in range(tests)]
            end = [torch.cuda.Event(enable_timing=True) for _ in range(tests)]
            host = []
            for i in range(tests):
                if mode == "idle":
                    torch.cuda.synchronize()
                elif mode == "flushed":
                    cache.zero_()
                start[i].record()
                t0 = time.perf_counter_ns()
                call()
                host.append((time.perf_counter_ns() - t0) / 1e3)
                end[i].record()
            torch.cuda.synchronize()
            ev = [s.elapsed_time(e) * 1e3 for s, e in zip(start, end)][1:]
            row += [statistics.mean(ev)] + ([statistics.mean(host[1:])] if mode == "back_to_back" else [])
        out[name] = dict(zip(("events", "host", "idle", "flushed"), (round(v, 2) for v in row)))
        print(f"{name:16s}" + "".join(f"{v:10.1f}" for v in row))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
