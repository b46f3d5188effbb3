"""Where a normal-mode data kernel's time goes, warp by warp (issue #18). The probe build of intranode.cu
(PYEP_JIT_FLAGS=-DPYEP_PROBE=ADDR, which this script sets before it imports pyep, ADDR a tensor of its own) has every
warp of every dispatch and combine kernel write a record: its role (sending to a peer, receiving from one, copying this
rank's own tokens in the sending or the receiving block, publishing tails, reducing, coordinating), the rows it
moved, when it started and ended, and the cycles it spent polling a peer's word. This script runs each op at the
reference shape (4096 tokens, hidden 7168, top-8 of 256, 24 SMs; DeepEP's routing and column-major FP8 scales) a few
times, then reads the records of its last call and sums them up, per rank and role: how many warps, rows a warp,
when the first, the median and the last warp of the role ended (µs after the kernel's first entry on the rank) and
the share of its time a warp waited. For the combine, also the record its reducers keep a token: how long tokens
waited for their rows and took to reduce (from their rows' arrival: checking the sources, the first vectors, all),
and when the last rows came and the last token was done.

    torchrun --nproc-per-node 2 bench/device/normal_probe.py

Each rank takes GPU local_rank % count; pyep's exchanges go over a gloo group. Without a GPU the script runs the
calls on the cpu backend and has no records to show (a dry run).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

ROLES = ["send", "recv", "local-send", "local-recv", "publish", "coordinate", "reduce", "idle"]
OPS = ["dispatch_bf16", "dispatch_fp8", "cached_bf16", "cached_fp8", "cached_fp8_rows", "combine_bf16"]
KERNELS, BLOCKS, WARPS, WORDS = 2, 128, 32, 8  # intranode.cu's probe records: [kernel][block][warp][word]
TOKENS, TOKEN_WORDS = 16384, 8  # then the combine's tokens: [token][wait began, rows there, sources checked,
# first vectors summed, reduced, reducer, 0, 0]


def summary(op: str, rank: int, recs: list) -> str:
    """The records [role + 1, peer, rows, entry, start, end, wait cycles, cycles] of one kernel, as a table."""
    t0 = min(r[3] for r in recs)
    out = [f"{op} rank {rank}: {len(recs)} warps, kernel {(max(r[5] for r in recs) - t0) / 1e3:.1f} µs from the first "
           f"entry to the last end; the barriers passed after {statistics.median(r[4] - r[3] for r in recs) / 1e3:.1f} "
           f"µs (median)",
           f"  {'role':<11} {'warps':>5} {'rows':>6} {'rows/warp':>9} {'first end':>9} {'median end':>10} {'last end':>8} "
           f"{'waited':>7}"]
    for role, name in enumerate(ROLES):
        rs = [r for r in recs if r[0] == role + 1]
        if not rs:
            continue
        ends = [(r[5] - t0) / 1e3 for r in rs]
        waited = statistics.mean(r[6] / r[7] if r[7] > 0 else 0.0 for r in rs)
        rows = sum(r[2] for r in rs)
        out.append(f"  {name:<11} {len(rs):>5} {rows:>6} {rows / len(rs):>9.1f} {min(ends):>9.1f} "
                   f"{statistics.median(ends):>10.1f} {max(ends):>8.1f} {waited:>7.0%}")
    return "\n".join(out)


def token_summary(rank: int, recs: list, toks: list) -> str:
    """The combine's token records [wait began, rows there, checked, first vectors, reduced, block * 32 + warp, 0, 0],
    as when and how long."""
    t0 = min(r[3] for r in recs)
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    got = [t for t in toks if t[4] != 0]
    if not got:
        return f"combine_bf16 rank {rank}: no token records"
    wait = [(t[1] - t[0]) / 1e3 for t in got]
    work = [(t[4] - t[1]) / 1e3 for t in got]
    check = [(t[2] - t[1]) / 1e3 for t in got]
    first = [(t[3] - t[2]) / 1e3 for t in got]
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    by_block = {}
    for t in got:
        by_block.setdefault(t[5] // 32, []).append(t)
    last = []
    for ts in by_block.values():
        ts.sort(key=lambda t: t[1])
        last += ts[-8:]  # the 8 tokens of the block whose rows came last
    return (f"combine_bf16 rank {rank} tokens: {len(got)}; waited for rows median {q(wait, .5):.1f} µs, p90 {q(wait, .9):.1f}; "
            f"reduced in median {q(work, .5):.1f} µs (sources checked {q(check, .5):.1f}, the first vectors "
            f"{q(first, .5):.1f} more), p90 {q(work, .9):.1f}, max {max(work):.1f}; rows of the last there at "
            f"{us(max(t[1] for t in got)):.1f} µs, last reduced at {us(max(t[4] for t in got)):.1f}; each block's 8 last "
            f"tokens: there median {q([us(t[1]) for t in last], .5):.1f}, reduced in median "
            f"{q([(t[4] - t[1]) / 1e3 for t in last], .5):.1f} µs, max {max((t[4] - t[1]) / 1e3 for t in last):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--json", help="write every record here (rank 0: all ranks')")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = torch.device("cpu")
    probe = None
    if gpu:
        os.environ.setdefault("PYEP_BACKEND", "cuda")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dev = torch.device("cuda")
        probe = torch.zeros(KERNELS * BLOCKS * WARPS * WORDS + TOKENS * TOKEN_WORDS, dtype=torch.int64, device=dev)
        os.environ["PYEP_JIT_FLAGS"] = (os.environ.get("PYEP_JIT_FLAGS", "") + f" -DPYEP_PROBE={probe.data_ptr()}ull").strip()
    import pyep  # reads PYEP_JIT_FLAGS now
    from pyep.bench.inputs import make_routing, make_x

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, R = group.rank(), group.size()
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    buffer = pyep.Buffer(group, int(2e9), explicitly_destroy=True)
    pyep.Buffer.set_num_sms(args.sms)
    topk_idx, weights = make_routing(T, E, K, rank, 0, 0.0, dev)
    x, (x8, s8_rows) = make_x(T, H, rank, 0, dev)
    s8 = s8_rows.T.contiguous().T  # column-major, as DeepEP's tests pass them

    def alone() -> None:
        if gpu:
            torch.cuda.synchronize()
        dist.barrier(group)

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    ops = {
        "dispatch_bf16": lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout),
        "dispatch_fp8": lambda: buffer.dispatch((x8, s8), topk_idx=topk_idx, topk_weights=weights, **layout),
        "cached_bf16": lambda: buffer.dispatch(x, handle=handle),
        "cached_fp8": lambda: buffer.dispatch((x8, s8), handle=handle),
        "cached_fp8_rows": lambda: buffer.dispatch((x8, s8_rows), handle=handle),  # row-major scales
        "combine_bf16": lambda: buffer.combine(recv, handle),
    }
    tables, records = [], {}
    for name in args.ops.split(","):
        for _ in range(args.warmup):
            ops[name]()
        alone()
        if probe is not None:
            probe.zero_()
        alone()
        ops[name]()
        alone()
        if probe is not None:
            kernel = 1 if name.startswith("combine") else 0
            n = KERNELS * BLOCKS * WARPS * WORDS
            block = probe[:n].view(KERNELS, BLOCKS * WARPS, WORDS)[kernel].cpu().tolist()
            recs = [r for r in block if r[0] != 0]
            records[name] = recs
            if recs:
                tables.append(summary(name, rank, recs))
            if kernel == 1 and recs:
                toks = probe[n:].view(TOKENS, TOKEN_WORDS)[:T].cpu().tolist()
                records[name + "_tokens"] = toks
                tables.append(token_summary(rank, recs, toks))
    everyone = [None] * R
    dist.all_gather_object(everyone, (tables, records))
    if rank == 0:
        for name in args.ops.split(","):
            for r in range(R):
                for t in everyone[r][0]:
                    if t.startswith(name + " "):
                        print(t)
        if not gpu:
            print("no GPU: the cpu backend ran the calls, and has no probe")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([e[1] for e in everyone], f)
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
