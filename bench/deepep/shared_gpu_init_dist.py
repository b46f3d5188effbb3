# ---- pyep: bench/deepep/shared_gpu_init_dist.py --------------------------------------------------------------
# run_deepep_test.sh appends this file to its copy of DeepEP's tests/utils.py when the ranks outnumber the GPUs,
# so that this init_dist replaces DeepEP's. The one change: ranks share GPUs, which NCCL refuses, so the group
# is gloo and pyep is told to run its cuda backend anyway. The rest is what DeepEP's init_dist does, and one
# adapter for gloo: dist.all_gather_into_tensor into a stacked output [world, *input.shape] (test_low_latency.py's
# use), which NCCL takes and gloo refuses, gets the same memory as the concatenated [world * n, ...] it takes.
# (Its imports bind the same modules that utils.py binds to these names.)
import os

import torch
import torch.distributed as dist


def init_dist(local_rank: int, num_local_ranks: int):
    """DeepEP's init_dist(local_rank, num_local_ranks) for ranks that share GPUs: a gloo group over tcp://
    MASTER_ADDR:MASTER_PORT (defaults 127.0.0.1:8361; WORLD_SIZE nodes, this one RANK, as DeepEP reads them),
    PYEP_BACKEND=cuda before any Buffer, rank i on GPU i % device_count, BF16 and cuda as torch's defaults.

    Returns:
        rank, world size, and a new group of all ranks.
    """
    host = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    world_size = num_nodes * num_local_ranks

    # pyep picks its cpu backend for a gloo group; these ranks' tensors live on GPUs.
    os.environ["PYEP_BACKEND"] = "cuda"
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # No device_id: that binds an NCCL group to a GPU, and this group is gloo.
    dist.init_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=world_size,
                                  rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(world_size)))


_all_gather_into_tensor = dist.all_gather_into_tensor


def _all_gather_stacked(output_tensor, input_tensor, group=None, async_op=False):
    if output_tensor.dim() == input_tensor.dim() + 1 and input_tensor.dim() > 0:
        output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
    return _all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


dist.all_gather_into_tensor = _all_gather_stacked
