"""Buffer lifecycle on the cuda backend: peers see each other's device memory through CUDA IPC (over NVLink between
GPUs, inside the device between ranks that share one), or, with use_fabric=True, through cuMem fabric handles or
POSIX file descriptors.

Under PYEP_TEST_DEVICE=cuda the session group is already a cuda one (conftest: NCCL with a GPU a rank, or gloo with
PYEP_BACKEND=cuda when ranks share a GPU). In a cpu session on a machine with a GPU a rank, this module makes its own
NCCL group from the gloo one. Ranks synchronise over the session group after a torch.cuda.synchronize()."""
import os

import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import DEVICE
from test_normal import Case, expected_combine, expected_receive, expert_output, inputs, on

NVL_BYTES = 1 << 20
MiB = 1 << 20


@pytest.fixture(scope="module")
def nccl(group):
    """A group whose Buffers use the cuda backend (see the module's docstring)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the cuda backend needs one")
    if DEVICE == "cuda":
        yield group
        sync_all(group)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        pytest.skip(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} GPUs): "
                    "run ranks sharing a GPU with PYEP_TEST_DEVICE=cuda")
    torch.cuda.set_device(local_rank)
    g = dist.new_group(backend="nccl")
    yield g
    sync_all(group)
    dist.destroy_process_group(g)


@pytest.fixture
def device(nccl):
    return torch.device("cuda", torch.cuda.current_device())


def sync_all(group):
    """Every rank's GPU work so far is done and visible to every rank."""
    torch.cuda.synchronize()
    dist.barrier(group)


def make(nccl, group, *args, **kwargs):
    kwargs.setdefault("explicitly_destroy", True)
    return pyep.Buffer(nccl, *args, **kwargs)


def destroy(group, *buffers):
    sync_all(group)
    for b in buffers:
        b.destroy()
    dist.barrier(group)


def test_backend_and_attributes(nccl, group, rank, num_ranks, device):
    buffer = make(nccl, group, NVL_BYTES)
    rt = buffer.runtime
    assert rt.backend == "cuda"
    assert rt.get_local_device_id() == device.index
    assert buffer.is_available()
    local = buffer.get_local_buffer_tensor(torch.uint8)
    assert local.device == device and local.numel() == NVL_BYTES
    assert local.count_nonzero().item() == 0, "the buffer starts zeroed"
    assert buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=256).shape == (4, 8)
    destroy(group, buffer)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float8_e4m3fn])
def test_peers_see_each_others_writes(nccl, group, rank, num_ranks, device, dtype):
    buffer = make(nccl, group, NVL_BYTES)
    n = 1000
    pattern = lambda r: ((torch.arange(n, device=device) * 7 + r * 1000 + 3) % 100).to(dtype)  # noqa: E731
    buffer.get_local_buffer_tensor(dtype, torch.Size([n])).copy_(pattern(rank))
    sync_all(group)
    for peer in range(num_ranks):
        seen = buffer.get_peer_buffer_tensor(peer, dtype, torch.Size([n]))
        assert seen.device == device
        assert torch.equal(seen.float(), pattern(peer).float()), f"rank {rank} reads peer {peer}"
    sync_all(group)
    # Writes through a peer's view land in that peer's buffer.
    buffer.get_peer_buffer_tensor((rank + 1) % num_ranks, torch.int32, torch.Size([1]), offset=8192 + 4 * rank)[0] = rank + 1
    sync_all(group)
    got = buffer.get_local_buffer_tensor(torch.int32, torch.Size([1]), offset=8192 + 4 * ((rank - 1) % num_ranks))
    assert got.item() == (rank - 1) % num_ranks + 1
    destroy(group, buffer)


def test_sync_misuse_raises_and_buffer_survives(nccl, group, rank, num_ranks, device):
    buffer = make(nccl, group, NVL_BYTES)
    other = make(nccl, group, NVL_BYTES)
    rt = buffer.runtime
    device_ids = [device.index] * num_ranks
    with pytest.raises(pyep.PyepError, match="already synced"):
        rt.sync(device_ids, [rt.get_local_ipc_handle()] * num_ranks)
    fresh = pyep.buffer._Runtime(f"cuda:{device.index}", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)
    try:
        if num_ranks > 1:
            with pytest.raises(pyep.PyepError, match="not synced"):
                fresh.get_local_buffer_tensor(torch.uint8, 0, False, (rank + 1) % num_ranks)
        own = fresh.get_local_ipc_handle()
        handles = buffer._all_gather(own)
        with pytest.raises(ValueError, match=rf"ipc_handles\[{rank}\] is missing"):
            fresh.sync(device_ids, [None] * num_ranks)
        swapped = list(handles)
        swapped[rank] = other.runtime.get_local_ipc_handle()
        with pytest.raises(ValueError, match="not this rank's own handle"):
            fresh.sync(device_ids, swapped)
        if num_ranks > 1:
            peer = (rank + 1) % num_ranks
            bad = list(handles)
            bad[peer] = own  # this rank's handle in a peer's slot
            with pytest.raises(ValueError, match=rf"made by rank {rank} of {num_ranks}: expected rank {peer}"):
                fresh.sync(device_ids, bad)
        assert not fresh.is_available()
    finally:
        fresh.destroy()
    assert buffer.is_available() and other.is_available()
    buffer.get_local_buffer_tensor(torch.uint8)[:4] = 1
    destroy(group, buffer, other)


def test_stale_handle_of_destroyed_buffer(nccl, group, rank, num_ranks, device):
    if num_ranks == 1:
        pytest.skip("needs a peer: one rank opens no handle")
    gone = make(nccl, group, NVL_BYTES)
    handles = gone._all_gather(gone.runtime.get_local_ipc_handle())
    destroy(group, gone)
    fresh = pyep.buffer._Runtime(f"cuda:{device.index}", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)
    try:
        handles[rank] = fresh.get_local_ipc_handle()
        with pytest.raises(pyep.PyepError, match="open peer"):
            fresh.sync([device.index] * num_ranks, handles)
    finally:
        fresh.destroy()
    dist.barrier(group)


def test_destroy_lifecycle_returns_device_memory(nccl, group, device):
    size = 512 * MiB
    free_before, _ = torch.cuda.mem_get_info(device)
    buffer = make(nccl, group, size)
    free_mid, _ = torch.cuda.mem_get_info(device)
    assert free_mid <= free_before - size
    rt = buffer.runtime
    destroy(group, buffer)
    buffer.destroy()  # idempotent
    free_after, _ = torch.cuda.mem_get_info(device)
    assert free_after >= free_mid + size - 64 * MiB, "destroy() gives the device memory back"
    assert not buffer.is_available()
    with pytest.raises(pyep.PyepError, match="does not exist"):
        buffer.get_local_buffer_tensor(torch.uint8)
    with pytest.raises(pyep.PyepError, match="does not exist"):
        rt.sync([device.index], [None])
    implicit = pyep.Buffer(nccl, NVL_BYTES)
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        implicit.destroy()
    assert implicit.is_available()
    sync_all(group)


@pytest.mark.parametrize("mem_handle", ["auto", "fd"])
def test_use_fabric_dispatch_combine(nccl, group, rank, num_ranks, device, monkeypatch, mem_handle):
    """use_fabric=True: the buffer is cuMem memory shared through a fabric handle, or through a POSIX file descriptor
    (forced by PYEP_MEM_HANDLE=fd, which is read when the buffer is made); a dispatch and combine round trip over it
    gives the reference results."""
    monkeypatch.setenv("PYEP_MEM_HANDLE", mem_handle)
    case = Case(f"use_fabric_{mem_handle}", tokens=128, hidden=1024)
    config = pyep.Buffer.get_dispatch_config(num_ranks)
    buffer = make(nccl, group, config.get_nvl_buffer_size_hint(case.hidden * 2, num_ranks), use_fabric=True)
    assert buffer.runtime.backend == "cuda" and buffer.is_available()
    x, topk, w = on(device, inputs(case, rank, num_ranks))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, case.experts_per_rank * num_ranks)
    recv, recv_topk, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
        topk_weights=w, config=config)
    ref_x, _, ref_topk, ref_w, _, ref_counts = expected_receive(case, rank, num_ranks)
    assert torch.equal(recv.cpu().view(torch.uint8), ref_x.view(torch.uint8)), "dispatch moves rows bit for bit"
    assert torch.equal(recv_topk.cpu(), ref_topk) and torch.equal(recv_w.cpu(), ref_w)
    assert counts == ref_counts
    combined, combined_w, _ = buffer.combine(expert_output(recv, rank), handle, topk_weights=recv_w, config=config)
    ref_combined, ref_weights = expected_combine(case, rank, num_ranks, ())
    assert torch.equal(combined.cpu(), ref_combined) and torch.equal(combined_w.cpu(), ref_weights)
    destroy(group, buffer)


def test_two_buffers_in_one_process(nccl, group, rank, num_ranks, device):
    a = make(nccl, group, NVL_BYTES)
    b = make(nccl, group, 2 * NVL_BYTES)
    a.get_local_buffer_tensor(torch.int32, torch.Size([1]))[0] = 100 + rank
    b.get_local_buffer_tensor(torch.int32, torch.Size([1]))[0] = 200 + rank
    sync_all(group)
    for peer in range(num_ranks):
        assert a.get_peer_buffer_tensor(peer, torch.int32, torch.Size([1])).item() == 100 + peer
        assert b.get_peer_buffer_tensor(peer, torch.int32, torch.Size([1])).item() == 200 + peer
    assert a.get_local_buffer_tensor(torch.uint8).data_ptr() != b.get_local_buffer_tensor(torch.uint8).data_ptr()
    destroy(group, a)
    # b lives on.
    b.get_local_buffer_tensor(torch.int32, torch.Size([1]))[0] = 300 + rank
    sync_all(group)
    for peer in range(num_ranks):
        assert b.get_peer_buffer_tensor(peer, torch.int32, torch.Size([1])).item() == 300 + peer
    destroy(group, b)


def test_rdma_buffer_is_device_memory(nccl, group, device):
    buffer = make(nccl, group, NVL_BYTES, 1 << 16, low_latency_mode=True)
    rdma = buffer.get_local_buffer_tensor(torch.float32, use_rdma_buffer=True)
    assert rdma.device == device and rdma.numel() == (1 << 16) // 4
    assert rdma.count_nonzero().item() == 0
    rdma.fill_(2.5)
    assert rdma.sum().item() == 2.5 * rdma.numel()
    destroy(group, buffer)


def test_comm_stream_and_events(nccl, group, device):
    buffer = make(nccl, group, NVL_BYTES)
    other = make(nccl, group, NVL_BYTES)
    s = buffer.get_comm_stream()
    assert isinstance(s, torch.cuda.Stream) and s.device == device
    assert s.cuda_stream != torch.cuda.current_stream().cuda_stream
    assert buffer.get_comm_stream() == s and other.get_comm_stream() == s, "one comm stream per GPU and process"

    # Work on the comm stream, ordered after the current stream and back, through events.
    x = torch.full((1 << 20,), 1.0, device=device)
    x.mul_(3)  # current stream
    pyep.EventHandle(device).stream_wait(s)
    with torch.cuda.stream(s):
        x.add_(1)
        done = pyep.EventOverlap(pyep.EventHandle(stream=s))
    done.current_stream_wait()
    assert x.sum().item() == 4.0 * x.numel()

    # A raw CUstream works as well.
    raw = pyep.EventHandle(stream=s.cuda_stream, device=device)
    raw.synchronize()
    assert raw.query()

    # capture() records on the current stream; `with` makes the current stream wait on exit.
    event = pyep.Buffer.capture()
    assert isinstance(event.event.event, torch.cuda.Event)
    with event:
        pass
    event.current_stream_wait()
    torch.cuda.synchronize()
    assert event.event.query()
    destroy(group, buffer, other)


def test_cuda_backend_argument_errors(nccl, rank, num_ranks):
    with pytest.raises(pyep.PyepError, match=f"this process sees {torch.cuda.device_count()} GPUs"):
        pyep.buffer._Runtime("cuda:99", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)
    with pytest.raises(ValueError, match='backend "cuda:x"'):
        pyep.buffer._Runtime("cuda:x", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)


def test_comm_stream_needs_the_cuda_backend(group, monkeypatch):
    monkeypatch.delenv("PYEP_BACKEND", raising=False)  # set when ranks share a GPU
    gloo = dist.new_group(backend="gloo")  # its own gloo group: the session's is NCCL on GPU runs
    buffer = pyep.Buffer(gloo, NVL_BYTES, explicitly_destroy=True)  # gloo: the cpu backend
    assert buffer.runtime.backend == "cpu"
    with pytest.raises(pyep.PyepError, match="cpu backend has no CUDA stream"):
        buffer.get_comm_stream()
    buffer.destroy()
    dist.barrier(gloo)
