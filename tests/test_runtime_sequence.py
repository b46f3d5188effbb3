"""rtp-llm's sequence: a C++ engine (rtp-llm's DeepEPBuffer) drives DeepEP's runtime object directly, without the
Python Buffer. It makes the runtime, gathers every rank's device id and IPC handle and, in low-latency mode, rank 0's
NVSHMEM unique id, then calls sync once with all three. pyep's `_Runtime` has DeepEP's method names; this test walks
that sequence on one node and across nodes emulated with PYEP_RANKS_PER_NODE (rtp-llm passes num_nvl_bytes = 0 in
low-latency mode, as here)."""
import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import BACKEND

M, H, EXPERTS_PER_RANK = 8, 256, 2


def gather(group, value):
    out = [None] * group.size()
    dist.all_gather_object(out, value, group=group)
    return out


@pytest.mark.parametrize("ranks_per_node", [None, 1, 2])
def test_rtp_llm_sync_sequence(group, rank, num_ranks, monkeypatch, ranks_per_node):
    if ranks_per_node is not None and num_ranks % ranks_per_node:
        pytest.skip(f"PYEP_RANKS_PER_NODE={ranks_per_node} does not divide {num_ranks} ranks")
    rdma_bytes = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, num_ranks, EXPERTS_PER_RANK * num_ranks)
    with monkeypatch.context() as m:
        if ranks_per_node is None:
            m.delenv("PYEP_RANKS_PER_NODE", raising=False)
        else:
            m.setenv("PYEP_RANKS_PER_NODE", str(ranks_per_node))
        # (rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, enable_shrink,
        # use_fabric): DeepEP's constructor arguments.
        rt = pyep.buffer._Runtime(BACKEND, rank, num_ranks, 0, rdma_bytes, True, True, False, False)
    try:
        node = ranks_per_node or min(num_ranks, 8)
        assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank()) == (num_ranks // node, rank // node)
        assert not rt.is_available()
        device_ids = gather(group, rt.get_local_device_id())
        handles = gather(group, rt.get_local_ipc_handle() or None)
        root = gather(group, rt.get_local_nvshmem_unique_id() if rank == 0 else None)[0]
        assert isinstance(root, bytes) and len(root) == 128
        rt.sync(device_ids, handles, root)
        assert rt.is_available()
        with pytest.raises(pyep.PyepError, match="already synced"):
            rt.sync(device_ids, handles, root)

        # The RDMA buffer is this rank's own (as DeepEP's NVSHMEM buffer): addressable here, never a peer's.
        mine = rt.get_local_buffer_tensor(torch.int32, 0, True)
        assert mine.numel() == rdma_bytes // 4
        mine[:16] = rank + 1
        assert mine[:16].tolist() == [rank + 1] * 16
        if node > 1:
            with pytest.raises(pyep.PyepError, match="use_rdma_buffer: only the local RDMA buffer is addressable"):
                rt.get_local_buffer_tensor(torch.int32, 0, True, (rank + 1) % node)
        dist.barrier(group)
    finally:
        rt.destroy()
