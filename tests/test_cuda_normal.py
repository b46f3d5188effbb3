"""Normal mode on the cuda backend beyond test_normal.py's round trips: streams and events, several buffers, the
kernel cache across processes, large hidden sizes, and a kernel that times out.

Runs with PYEP_TEST_DEVICE=cuda (an NCCL group, one GPU a rank); skipped otherwise."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import DEVICE
from test_normal import Case, buffer_for, expected_combine, expected_receive, expert_output, inputs, on, run_case

pytestmark = pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                                reason="cuda backend tests: run with PYEP_TEST_DEVICE=cuda on GPUs")


def layout_of(buffer, topk, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def check_receive(case, me, R, recv_x, recv_topk=None, recv_w=None):
    ref_x, _, ref_topk, ref_w, _, _ = expected_receive(case, me, R)
    assert torch.equal(recv_x.cpu().view(torch.uint8), ref_x.view(torch.uint8))
    if recv_topk is not None:
        assert torch.equal(recv_topk.cpu(), ref_topk) and torch.equal(recv_w.cpu(), ref_w)


def test_async_finish_overlaps_a_matmul(group, device):
    R, me = group.size(), group.rank()
    case = Case("overlap", tokens=256, hidden=2048)
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    layout = layout_of(buffer, topk, case.experts_per_rank * R)
    a = torch.randn(2048, 2048, device=device)
    expected = a @ a
    torch.cuda.synchronize()
    busy = a @ a  # queued on the compute stream, running while the dispatch is queued
    recv, recv_topk, recv_w, _, handle, event = buffer.dispatch(
        x, **layout, topk_idx=topk, topk_weights=w, previous_event=pyep.Buffer.capture(), async_finish=True)
    more = busy @ a  # overlaps the communication stream
    assert event.event is not None and event.extra_tensors is not None
    event.current_stream_wait()
    check_receive(case, me, R, recv, recv_topk, recv_w)
    torch.testing.assert_close(busy, expected)
    assert torch.isfinite(more).all()

    y = expert_output(recv, me)
    combined, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w, async_finish=True,
                                                 previous_event=pyep.Buffer.capture())
    busy = a @ a
    event.current_stream_wait()
    ref, ref_w = expected_combine(case, me, R, ())
    assert torch.equal(combined.cpu(), ref) and torch.equal(combined_w.cpu(), ref_w)
    dist.barrier(group)


def test_previous_event_orders_the_inputs(group, device):
    """x is written on another stream after a long sleep: a dispatch that waits for previous_event sees it."""
    R, me = group.size(), group.rank()
    case = Case("ordering", tokens=128)
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    layout = layout_of(buffer, topk, case.experts_per_rank * R)
    late = torch.zeros_like(x)
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # far longer than the host takes to queue the dispatch
        late.copy_(x)
    ready = pyep.EventOverlap(pyep.EventHandle(stream=side))
    recv, _, _, _, handle, event = buffer.dispatch(late, **layout, topk_idx=topk, topk_weights=w,
                                                   previous_event=ready, async_finish=True)
    event.current_stream_wait()
    check_receive(case, me, R, recv)
    # Cached dispatch with the same ordering.
    late2 = torch.zeros_like(x)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        late2.copy_(x)
    again, *_, event = buffer.dispatch(late2, handle=handle, previous_event=pyep.EventOverlap(pyep.EventHandle(stream=side)),
                                       async_finish=True)
    event.current_stream_wait()
    check_receive(case, me, R, again)
    dist.barrier(group)


def test_usual_calls_run_on_the_current_stream(group, device):
    """The usual call runs its kernels on the current stream. A cached dispatch queued on a side stream behind a long
    sleep, then a combine on the default stream that does not wait for the side stream: the buffer orders its own
    kernels (the combine must not start before the dispatch ends). Then an async_finish call, and a usual call
    after it on another stream."""
    R, me = group.size(), group.rank()
    case = Case("streams", tokens=128)
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    layout = layout_of(buffer, topk, case.experts_per_rank * R)
    recv, recv_topk, recv_w, _, handle, _ = buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
    y = expert_output(recv, me)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # far longer than the host takes to queue both calls
        again, *_ = buffer.dispatch(x, handle=handle)
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
    torch.cuda.synchronize()
    check_receive(case, me, R, again)
    ref, ref_w = expected_combine(case, me, R, ())
    assert torch.equal(combined.cpu(), ref) and torch.equal(combined_w.cpu(), ref_w)

    # async_finish on the comm stream, then a usual call on the side stream: it waits for the comm stream's work.
    torch.cuda._sleep(50_000_000)
    third, *_, event = buffer.dispatch(x, handle=handle, async_finish=True)
    with torch.cuda.stream(side):  # nothing makes the side stream wait for the dispatch but the buffer
        combined2, _, _ = buffer.combine(y, handle, topk_weights=recv_w)
    event.current_stream_wait()
    torch.cuda.synchronize()
    check_receive(case, me, R, third)
    assert torch.equal(combined2.cpu(), ref)
    dist.barrier(group)


def test_allocate_on_comm_stream(group, device):
    R, me = group.size(), group.rank()
    case = Case("comm_alloc", tokens=96)
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    per_rank, _, per_expert, in_rank, event = buffer.get_dispatch_layout(
        topk, case.experts_per_rank * R, previous_event=pyep.Buffer.capture(), async_finish=True,
        allocate_on_comm_stream=True)
    recv, recv_topk, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
        topk_weights=w, previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    assert counts == expected_receive(case, me, R)[5]
    event.current_stream_wait()  # the compute stream reads recv next
    y = expert_output(recv, me)
    combined, _, event = buffer.combine(y, handle, previous_event=pyep.Buffer.capture(), async_finish=True,
                                        allocate_on_comm_stream=True)
    event.current_stream_wait()
    check_receive(case, me, R, recv, recv_topk, recv_w)
    assert torch.equal(combined.cpu(), expected_combine(case, me, R, ())[0])
    dist.barrier(group)


def test_two_buffers_in_one_process(group, device):
    R, me = group.size(), group.rank()
    cases = [Case("first", tokens=80, hidden=512, seed=1), Case("second", tokens=120, hidden=256, seed=2)]
    config = pyep.Buffer.get_dispatch_config(R)
    buffers = [pyep.Buffer(group, config.get_nvl_buffer_size_hint(c.hidden * 2, R), explicitly_destroy=True) for c in cases]
    handles = []
    for buffer, case in zip(buffers, cases):  # dispatch on both before either combines
        x, topk, w = on(device, inputs(case, me, R))
        recv, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout_of(buffer, topk, case.experts_per_rank * R),
                                                       topk_idx=topk, topk_weights=w)
        check_receive(case, me, R, recv)
        handles.append((recv, handle))
    for buffer, case, (recv, handle) in reversed(list(zip(buffers, cases, handles))):
        combined, _, _ = buffer.combine(expert_output(recv, me), handle)
        assert torch.equal(combined.cpu(), expected_combine(case, me, R, ())[0])
    torch.cuda.synchronize()
    dist.barrier(group)
    for b in buffers:
        b.destroy()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hidden", [2880, 7168, 8192])
def test_hidden_sizes(group, device, hidden, fp8):
    run_case(group, device, Case(f"hidden_{hidden}", tokens=64, hidden=hidden, fp8=fp8))


def test_last_launch_is_stamped_inside_the_call(group, device):
    # pyep.bench's launch time: the core stamps CLOCK_MONOTONIC (time.perf_counter's clock) at an export's entry, and
    # before and after the driver's call of each launch (bench/hostpath.py's core and driver columns).
    import time
    from pyep import _core
    R = group.size()
    hidden, K, E = 256, 2, 4 * R
    config = pyep.Buffer.get_dispatch_config(R)
    buffer = buffer_for(group, config, hidden * 2)
    x = torch.randn(16, hidden, device=device).to(torch.bfloat16)
    topk = torch.randint(0, E, (16, K), device=device)
    w = torch.rand(16, K, device=device)
    layout = layout_of(buffer, topk, E)
    for call in (lambda: buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w, config=config),
                 lambda: buffer.get_dispatch_layout(topk, E)):
        before = time.perf_counter()
        call()
        after = time.perf_counter()
        stamp = _core.call("BufferLastLaunchNs", buffer.runtime.id) / 1e9
        start = _core.call("BufferLastLaunchStartNs", buffer.runtime.id) / 1e9
        entry = _core.call("LastEntryNs") / 1e9
        assert before < entry <= start <= stamp < after
    torch.cuda.synchronize()
    dist.barrier(group)


_CHILD = textwrap.dedent("""
    import os, tempfile, torch, torch.distributed as dist
    import pyep
    from pyep import _core
    store = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{store}/s", rank=0, world_size=1)
    group = dist.group.WORLD
    cfg = pyep.Config(4, 2, 16, 6, 128)
    buffer = pyep.Buffer(group, cfg.get_nvl_buffer_size_hint(512, 1))
    topk = torch.randint(0, 8, (32, 2), device="cuda")
    x = torch.randn(32, 256, device="cuda").to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 8)
    recv, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, config=cfg)
    combined, _, _ = buffer.combine(recv, handle, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(combined.float(), x.float())
    print("STATS", _core.call("JITStats"))
    dist.destroy_process_group()
""")


def test_kernel_cache_is_reused_by_the_next_process(group, device):
    """A process compiles the kernels it needs into PYEP_JIT_CACHE_DIR; the next one compiles nothing."""
    try:
        if group.rank() == 0:
            _compile_in_two_processes(device)
    finally:
        dist.barrier(group)  # the other ranks wait here, whatever rank 0's outcome


def _compile_in_two_processes(device):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYEP_JIT_CACHE_DIR=cache, CUDA_VISIBLE_DEVICES=str(device.index))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(k, None)
        stats = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stdout + out.stderr
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("STATS")][-1]
            stats.append(list(map(int, line.split()[1:])))
            if len(stats) == 2:
                assert "pyep: compiled" not in out.stderr, out.stderr
        (_, _, first_compiles), (_, second_disk, second_compiles) = stats
        # The layout, the queued dispatch (notify in the dispatch's kernel) and the combine.
        assert first_compiles >= 3, stats
        assert second_compiles == 0 and second_disk == first_compiles, stats


def test_kernel_timeout_names_the_missing_rank(group, device):
    """The last rank never calls: the others' dispatch fails within PYEP_TIMEOUT_S, naming it, instead of hanging;
    a failure of an asynchronous cached dispatch surfaces at the next call."""
    R, me = group.size(), group.rank()
    if R < 2:
        pytest.skip("needs a peer")
    from pyep import _core
    case = Case("timeout", tokens=32)
    config = pyep.Buffer.get_dispatch_config(R)
    size = config.get_nvl_buffer_size_hint(case.hidden * 2, R)
    x, topk, w = on(device, inputs(case, me, R))
    missing = R - 1
    try:
        _core.call("SetOpTimeout", 2.0)
        buffer = pyep.Buffer(group, size, explicitly_destroy=True)
        layout = layout_of(buffer, topk, case.experts_per_rank * R)
        if me != missing:
            with pytest.raises(pyep.PyepError, match=rf"rank {missing}\b") as err:
                buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
            assert "timed out" in str(err.value) or "stopped because" in str(err.value)
            with pytest.raises(pyep.PyepError, match="unusable"):
                buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
        torch.cuda.synchronize()
        dist.barrier(group)
        buffer.destroy()

        buffer = pyep.Buffer(group, size, explicitly_destroy=True)
        layout = layout_of(buffer, topk, case.experts_per_rank * R)
        recv, _, _, _, handle, _ = buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
        check_receive(case, me, R, recv)
        if me != missing:
            buffer.dispatch(x, handle=handle)  # queued: returns before the kernel gives up
            torch.cuda.synchronize()
            with pytest.raises(pyep.PyepError, match=rf"rank {missing}\b"):
                buffer.combine(recv, handle)
        torch.cuda.synchronize()
        dist.barrier(group)
        buffer.destroy()
    finally:
        _core.call("SetOpTimeout", float(os.environ.get("PYEP_TIMEOUT_S", "100")))
    dist.barrier(group)
