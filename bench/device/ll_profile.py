"""Low-latency calls laid out for Nsight Compute: hooked dispatches and combines at the reference shape, every
kernel alone (the device synchronized and the ranks at a barrier between any two), so that ncu's kernel replay of
one rank's kernel never meets another rank's next call. A replayed send rewrites the same rows and flags; a
replayed receive finds its flags set and reads the same slots.

    PYEP_BACKEND=cuda ncu --target-processes all -k regex:'dispatch|combine' --launch-skip 8 --launch-count 4 \\
        torchrun --nproc-per-node 2 bench/device/ll_profile.py

Each rank takes GPU local_rank % count; pyep's exchanges go over a gloo group (no NCCL kernel to filter out).
"""
import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--iters", type=int, default=6)
    args = ap.parse_args()
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
    for _ in range(args.iters):
        (recv, scales), count, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True,
                                                                              return_recv_hook=True)
        alone()
        hook()
        alone()
        rows = recv.to(torch.bfloat16)  # the values do not matter to the profile, only the shapes
        _, _, hook = buffer.low_latency_combine(rows, topk_idx, weights, handle, return_recv_hook=True)
        alone()
        hook()
        alone()
    if rank == 0:
        print(f"ll_profile: {args.iters} hooked dispatch + combine pairs on {R} ranks, {M} tokens, hidden {H}, "
              f"top-{K} of {E}", flush=True)
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
