"""Buffer lifecycle on the cpu backend: construct, sync, see peers' memory, misuse, destroy.

test_cuda_buffer.py holds the cuda backend's counterparts; under PYEP_TEST_DEVICE=cuda this module still tests the
cpu backend, over a gloo group of its own."""
import gc
import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import DEVICE
from pyep import _core

NVL_BYTES = 1 << 20


@pytest.fixture(scope="module")
def group(group):
    """The cpu backend's group: the session's gloo group, or under PYEP_TEST_DEVICE=cuda a gloo group of this module
    with PYEP_BACKEND=cpu while it runs."""
    if DEVICE != "cuda":
        yield group
        return
    saved = os.environ.get("PYEP_BACKEND")
    os.environ["PYEP_BACKEND"] = "cpu"
    gloo = dist.new_group(backend="gloo")
    try:
        yield gloo
        dist.barrier(gloo)
    finally:
        if saved is None:
            del os.environ["PYEP_BACKEND"]
        else:
            os.environ["PYEP_BACKEND"] = saved


def own_segments(pid=None):
    return glob.glob(f"/dev/shm/pyep-{pid or os.getpid()}-*")


def run_python(code, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, **kwargs)


def only_rank0(rank):
    if rank != 0:
        pytest.skip("not collective: runs on rank 0 only")


def test_gc_callback_removed():
    assert not [cb for cb in gc.callbacks if getattr(cb, "__name__", "") == "_gopy_gc_cb"]
    gc.collect()


def test_go_panic_becomes_exception():
    with pytest.raises(pyep.PyepError, match="internal error in DebugPanic: on purpose"):
        _core.call("DebugPanic", "on purpose")
    # The Go runtime is still there.
    assert pyep.Config().num_sms == 20


def test_core_calls_take_the_fast_path(group, rank, num_ranks):
    """The per-call exports are the core's METH_FASTCALL functions (pyep/fastcall_cpython.go), with gopy's errors:
    a stale buffer, a wrong argument count, a non-integer; a call through them does what gopy's wrapper does."""
    assert _core.go.fast
    assert type(_core.go.Layout).__name__ == "builtin_function_or_method"
    gopy = _core._go._core
    with pytest.raises(RuntimeError, match="does not exist") as fast_err:
        _core.go.Layout(-3, *(0,) * 15)
    with pytest.raises(RuntimeError, match="does not exist") as gopy_err:
        gopy.pyep_Layout(-3, *(0,) * 15)
    assert str(fast_err.value) == str(gopy_err.value)
    with pytest.raises(TypeError, match="Layout takes 16 arguments"):
        try:
            _core.go.Layout(1, 2, 3)
        except RuntimeError as e:
            raise _core.error(e) from None
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        _core.go.Layout(*(0,) * 15, 1.5)
    with pytest.raises(OverflowError):
        _core.go.Layout(*(0,) * 15, 1 << 70)
    assert _core.go.LastEntryNs() >= gopy.pyep_LastEntryNs() > 0
    buffer = pyep.Buffer(group, NVL_BYTES, explicitly_destroy=True)
    try:
        topk = torch.tensor([[0, num_ranks], [-1, 1]], dtype=torch.int64)
        E = 2 * num_ranks
        want = buffer.get_dispatch_layout(topk, E)
        saved = _core.go.Layout
        try:
            _core.go.Layout = gopy.pyep_Layout
            have = buffer.get_dispatch_layout(topk, E)
        finally:
            _core.go.Layout = saved
        for a, b in zip(want[:4], have[:4]):
            assert (a is None and b is None) or torch.equal(a, b)
        per_rank = [0] * num_ranks  # two experts a rank: token 0 goes to ranks 0 and R // 2, token 1 to rank 0
        per_rank[0], per_rank[num_ranks // 2] = 2, 2 if num_ranks == 1 else 1
        assert want[0].tolist() == per_rank
    finally:
        buffer.destroy()


def test_attributes_and_runtime(group, rank, num_ranks):
    buffer = pyep.Buffer(group, NVL_BYTES)
    assert (buffer.rank, buffer.group_size, buffer.group) == (rank, num_ranks, group)
    assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.low_latency_mode) == (NVL_BYTES, 0, False)
    assert buffer.is_available()
    rt = buffer.runtime
    assert rt.get_local_device_id() == -1
    assert rt.get_num_rdma_ranks() == 1 and rt.get_rdma_rank() == 0
    assert rt.get_root_rdma_rank(True) == rank % 8 and rt.get_root_rdma_rank(False) == 0
    assert len(buffer.get_local_buffer_tensor(torch.uint8)) == NVL_BYTES
    assert buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=256).shape == (4, 8)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float8_e4m3fn])
def test_peers_see_each_others_writes(group, rank, num_ranks, dtype):
    buffer = pyep.Buffer(group, NVL_BYTES)
    n = 1000
    pattern = lambda r: ((torch.arange(n) * 7 + r * 1000 + 3) % 100).to(dtype)  # noqa: E731
    local = buffer.get_local_buffer_tensor(dtype, torch.Size([n]))
    local.copy_(pattern(rank))
    dist.barrier(group)
    for peer in range(num_ranks):
        seen = buffer.get_peer_buffer_tensor(peer, dtype, torch.Size([n]))
        assert torch.equal(seen.float(), pattern(peer).float()), f"rank {rank} reads peer {peer}"
    dist.barrier(group)
    # Writes through a peer's view land in that peer's buffer.
    buffer.get_peer_buffer_tensor((rank + 1) % num_ranks, torch.int32, torch.Size([1]), offset=8192 + 4 * rank)[0] = rank + 1
    dist.barrier(group)
    got = buffer.get_local_buffer_tensor(torch.int32, torch.Size([1]), offset=8192 + 4 * ((rank - 1) % num_ranks))
    assert got.item() == (rank - 1) % num_ranks + 1
    dist.barrier(group)


def test_sync_misuse_raises_and_buffer_survives(group, rank, num_ranks):
    buffer = pyep.Buffer(group, NVL_BYTES)
    other = pyep.Buffer(group, NVL_BYTES)
    rt = buffer.runtime
    device_ids = [-1] * num_ranks
    with pytest.raises(pyep.PyepError, match="already synced"):
        rt.sync(device_ids, [rt.get_local_ipc_handle()] * num_ranks)
    # A fresh runtime of the same shape, not yet synced.
    fresh = pyep.buffer._Runtime("cpu", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)
    try:
        if num_ranks > 1:
            with pytest.raises(pyep.PyepError, match="not synced"):
                fresh.get_local_buffer_tensor(torch.uint8, 0, False, (rank + 1) % num_ranks)
        own = fresh.get_local_ipc_handle()
        handles = buffer._all_gather(own)
        with pytest.raises(ValueError, match=f"device_ids has {num_ranks + 1} entries: expected num_ranks = {num_ranks}"):
            fresh.sync([-1] * (num_ranks + 1), handles)
        with pytest.raises(ValueError, match=rf"ipc_handles\[{rank}\] is missing"):
            fresh.sync(device_ids, [None] * num_ranks)
        swapped = list(handles)
        swapped[rank] = other.runtime.get_local_ipc_handle()
        with pytest.raises(ValueError, match="not this rank's own handle"):
            fresh.sync(device_ids, swapped)
        if num_ranks > 1:
            peer = (rank + 1) % num_ranks
            bad = list(handles)
            bad[peer] = b"garbage"
            with pytest.raises(ValueError, match=rf"ipc_handles\[{peer}\]: not a pyep buffer handle"):
                fresh.sync(device_ids, bad)
            bad[peer] = own  # this rank's handle in a peer's slot
            with pytest.raises(ValueError, match=rf"made by rank {rank} of {num_ranks}: expected rank {peer}"):
                fresh.sync(device_ids, bad)
        with pytest.raises(TypeError, match="ipc_handles"):
            fresh.sync(device_ids, "not a list")
        assert not fresh.is_available()
    finally:
        fresh.destroy()
    # The synced buffers still work after all of that.
    assert buffer.is_available() and other.is_available()
    buffer.get_local_buffer_tensor(torch.uint8)[:4] = 1
    dist.barrier(group)


def test_stale_handle_of_destroyed_buffer(group, rank, num_ranks):
    if num_ranks == 1:
        pytest.skip("needs a peer: one rank opens no handle")
    gone = pyep.Buffer(group, NVL_BYTES, explicitly_destroy=True)
    handles = [None] * num_ranks
    handles = gone._all_gather(gone.runtime.get_local_ipc_handle())
    gone.destroy()
    dist.barrier(group)
    fresh = pyep.buffer._Runtime("cpu", rank, num_ranks, NVL_BYTES, 0, False, False, False, False)
    try:
        handles[rank] = fresh.get_local_ipc_handle()
        with pytest.raises(pyep.PyepError, match="open peer .* segment no longer exists"):
            fresh.sync([-1] * num_ranks, handles)
    finally:
        fresh.destroy()
    dist.barrier(group)


def test_destroy_lifecycle(group):
    buffer = pyep.Buffer(group, NVL_BYTES, explicitly_destroy=True)
    rt = buffer.runtime
    buffer.destroy()
    buffer.destroy()  # idempotent
    assert not buffer.is_available()
    with pytest.raises(pyep.PyepError, match="does not exist"):
        buffer.get_local_buffer_tensor(torch.uint8)
    with pytest.raises(pyep.PyepError, match="does not exist"):
        rt.sync([-1], [None])
    assert not own_segments()
    implicit = pyep.Buffer(group, NVL_BYTES)
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        implicit.destroy()
    assert implicit.is_available()
    dist.barrier(group)


def test_constructor_validation(group, num_ranks):
    with pytest.raises(ValueError, match="num_nvl_bytes = 100: expected a non-negative multiple of 128"):
        pyep.Buffer(group, 100)
    with pytest.raises(ValueError, match="num_rdma_bytes = 1024: an RDMA buffer needs more than 8 ranks"):
        pyep.Buffer(group, NVL_BYTES, 1024)
    with pytest.raises(TypeError, match="num_nvl_bytes must be an int"):
        pyep.Buffer(group, 1.5)
    with pytest.raises(ValueError, match="group"):
        pyep.Buffer(None)
    with pytest.raises(ValueError, match="num_ranks = 9: expected fewer than 8 ranks or a multiple of 8"):
        pyep.buffer._Runtime("cpu", 0, 9, NVL_BYTES, 0, False, False, False, False)
    with pytest.raises(ValueError, match="rank = 5: expected 0 <= rank < num_ranks = 4"):
        pyep.buffer._Runtime("cpu", 5, 4, NVL_BYTES, 0, False, False, False, False)
    with pytest.raises(ValueError, match="backend \"tpu\""):
        pyep.buffer._Runtime("tpu", 0, 1, NVL_BYTES, 0, False, False, False, False)
    assert not own_segments()


def test_low_latency_mode_unique_id_and_rdma_buffer(group):
    buffer = pyep.Buffer(group, NVL_BYTES, 1 << 16, low_latency_mode=True)
    assert buffer.is_available()
    rdma = buffer.get_local_buffer_tensor(torch.float32, use_rdma_buffer=True)
    assert rdma.numel() == (1 << 16) // 4
    rdma.fill_(2.5)
    assert rdma.sum().item() == 2.5 * rdma.numel()
    assert len(buffer.runtime.get_local_nvshmem_unique_id()) == 128
    with pytest.raises(ValueError, match="num_qps_per_rank = 0"):
        pyep.Buffer(group, NVL_BYTES, 1 << 16, low_latency_mode=True, num_qps_per_rank=0)
    dist.barrier(group)


def test_buffer_without_nvl_bytes(group):
    buffer = pyep.Buffer(group, 0)
    assert buffer.is_available()
    with pytest.raises(pyep.PyepError, match="num_nvl_bytes = 0"):
        buffer.get_local_buffer_tensor(torch.uint8)


def test_get_local_buffer_tensor_checks(group):
    buffer = pyep.Buffer(group, NVL_BYTES)
    with pytest.raises(ValueError, match="offset = 3: expected a multiple of the torch.float32 element size"):
        buffer.get_local_buffer_tensor(torch.float32, offset=3)
    with pytest.raises(ValueError, match=f"offset = {NVL_BYTES + 4}: expected"):
        buffer.get_local_buffer_tensor(torch.float32, offset=NVL_BYTES + 4)
    assert buffer.get_local_buffer_tensor(torch.uint8, offset=3).numel() == NVL_BYTES - 3
    with pytest.raises(ValueError, match="size = "):
        buffer.get_local_buffer_tensor(torch.float32, torch.Size([NVL_BYTES]))
    with pytest.raises(pyep.PyepError, match="no RDMA buffer"):
        buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    with pytest.raises(TypeError, match="dtype"):
        buffer.get_local_buffer_tensor("float32")


def test_no_shared_memory_left_after_exit(rank):
    only_rank0(rank)
    proc = run_python("""
        import os, tempfile, time, torch.distributed as dist, pyep
        dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/s", rank=0, world_size=1)
        b = pyep.Buffer(dist.group.WORLD, 1 << 20)
        # A gloo worker thread drops its reference to a collective's tensors after the call returns, which takes the
        # GIL; if the interpreter is finalizing by then, torch aborts the process ("terminate called without an
        # active exception", about 1 exit in 60 here). Letting the worker finish first keeps this about pyep.
        time.sleep(0.1)
        print(os.getpid(), flush=True)
    """)
    assert proc.returncode == 0, proc.stderr
    assert not own_segments(int(proc.stdout.split()[0]))


def test_killed_rank_leaves_nothing_behind(rank):
    only_rank0(rank)
    # A runtime made but never synced keeps its segment's name until its peers map it; kill it there.
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, pyep
        rt = pyep.buffer._Runtime("cpu", 0, 2, 1 << 20, 0, False, False, False, False)
        print(os.getpid(), flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert own_segments(pid), "the unsynced segment exists while its process lives"
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # The next buffer made on this machine sweeps segments of dead processes.
    fresh = pyep.buffer._Runtime("cpu", 0, 1, 1 << 20, 0, False, False, False, False)
    fresh.destroy()
    assert not own_segments(pid)


def test_segments_are_private(group, rank, num_ranks):
    fresh = pyep.buffer._Runtime("cpu", 0, 2, NVL_BYTES, 0, False, False, False, False)
    try:
        (path,) = own_segments()
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert len(os.path.basename(path).split("-")[2]) == 32  # 128 random bits
    finally:
        fresh.destroy()
    assert not own_segments()


def test_forked_child_never_calls_go(rank):
    only_rank0(rank)
    pid = os.fork()
    if pid == 0:
        try:
            pyep.Config()
        except pyep.PyepError as e:
            os._exit(0 if "forked child" in str(e) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pyep.Config().num_sms == 20
