"""Low-latency mode across nodes, which PYEP_RANKS_PER_NODE=k emulates on one machine (each k consecutive ranks are
one node): the rank arithmetic the Buffer reports, the errors for a bad k and for what does not run across nodes, and
the same calls on a buffer of several nodes (peers of other nodes written through the put/signal path: goep/lowlatency's
on the cpu backend, NVSHMEM's on cuda, which skips where NVSHMEM cannot run) and on a buffer of one node, with equal
results, bit for bit. allow_nvlink_for_low_latency_mode=False (every
peer through that path) likewise.

The variable is read when a Buffer is made: each test sets it for its buffer only (monkeypatch) and restores it."""
import os

import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import BACKEND
from test_low_latency import check_dispatch, cpu, dev, dispatch, expert_outputs, make_inputs, ref_combine

M, H, EXPERTS_PER_RANK, K = 6, 256, 3, 4
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def make_buffer(group, monkeypatch, ranks_per_node=None, **kw):
    """A Buffer made with PYEP_RANKS_PER_NODE=ranks_per_node (None: unset), which is restored at once."""
    with monkeypatch.context() as m:
        if ranks_per_node is None:
            m.delenv("PYEP_RANKS_PER_NODE", raising=False)
        else:
            m.setenv("PYEP_RANKS_PER_NODE", str(ranks_per_node))
        return pyep.Buffer(group, explicitly_destroy=True, **kw)


def ll_buffer(group, monkeypatch, ranks_per_node=None, **kw):
    R = group.size()
    size = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, EXPERTS_PER_RANK * R)
    return make_buffer(group, monkeypatch, ranks_per_node, num_rdma_bytes=size, low_latency_mode=True, **kw)


def node_sizes(R):
    return [k for k in range(1, 9) if R % k == 0]


@pytest.mark.parametrize("k", range(1, 9))
def test_rank_arithmetic_follows_ranks_per_node(group, rank, num_ranks, monkeypatch, k):
    if num_ranks % k:
        pytest.skip(f"PYEP_RANKS_PER_NODE={k} does not divide {num_ranks} ranks")
    buffer = make_buffer(group, monkeypatch, k, num_nvl_bytes=1 << 20)
    try:
        rt = buffer.runtime
        assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank()) == (num_ranks // k, rank // k)
        assert (rt.get_root_rdma_rank(True), rt.get_root_rdma_rank(False)) == (rank % k, 0)
        assert (rt._num_nvl_ranks, rt.ranks_per_node) == (k, k)
        # The NVLink buffer is shared within the node: peers are its k ranks.
        assert len(buffer.get_peer_buffer_tensor(k - 1, torch.uint8)) == 1 << 20
        with pytest.raises(ValueError, match=rf"nvl_rank = {k}: expected 0 <= nvl_rank < {k}"):
            buffer.get_peer_buffer_tensor(k, torch.uint8)
        if num_ranks // k > 1:
            # The layout runs across nodes: num_tokens_per_rdma_rank counts a token once for each node it goes to.
            N, E, T = num_ranks // k, 4 * num_ranks, 37
            g = torch.Generator().manual_seed(11 + rank)
            topk = torch.rand(T, E, generator=g).topk(3, dim=1).indices
            topk[::5, 1] = -1
            per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk.to(buffer._device), E)
            ref_in_rank = torch.zeros(T, num_ranks, dtype=torch.bool)
            for t, row in enumerate(topk.tolist()):
                for e in row:
                    if e >= 0:
                        ref_in_rank[t, e // (E // num_ranks)] = True
            assert torch.equal(in_rank.cpu(), ref_in_rank)
            assert per_rank.tolist() == ref_in_rank.sum(0).tolist()
            assert per_node.dtype == torch.int32 and per_node.tolist() == ref_in_rank.view(T, N, k).any(2).sum(0).tolist()
            assert per_expert.tolist() == torch.bincount(topk[topk >= 0], minlength=E).tolist()
            x = torch.zeros(4, 128, dtype=torch.bfloat16, device=buffer._device)
            hint = rf"the {num_ranks} ranks are {num_ranks // k} nodes because PYEP_RANKS_PER_NODE={k}"
            with pytest.raises(pyep.NotAvailableError, match=rf"^Buffer\.internode_dispatch: normal mode across .*; {hint}"):
                buffer.dispatch(x)
            with pytest.raises(pyep.NotAvailableError, match=rf"^Buffer\.internode_combine: .*{hint} .*: unset it"):
                buffer.combine(x, ())
    finally:
        buffer.destroy()
    # Unset: DeepEP's nodes of 8.
    plain = make_buffer(group, monkeypatch, None, num_nvl_bytes=1 << 20)
    try:
        rt = plain.runtime
        assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank(), rt.ranks_per_node) == (1, 0, 0)
        assert rt.get_root_rdma_rank(True) == rank % 8
    finally:
        plain.destroy()


def test_bad_ranks_per_node_raises_naming_it(group, num_ranks, monkeypatch):
    bad = next(k for k in range(2, 9) if num_ranks % k)
    with pytest.raises(ValueError, match=rf"^PYEP_RANKS_PER_NODE = {bad}: expected a node size from 1 to 8 that "
                                         rf"divides num_ranks = {num_ranks} \(one of "):
        make_buffer(group, monkeypatch, bad, num_nvl_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"^PYEP_RANKS_PER_NODE = 16: expected a node size from 1 to 8"):
        make_buffer(group, monkeypatch, 16, num_nvl_bytes=1 << 20)
    for value in ("two", "0"):
        with pytest.raises(ValueError, match=rf"^PYEP_RANKS_PER_NODE=\"{value}\": expected a positive whole number"):
            make_buffer(group, monkeypatch, value, num_nvl_bytes=1 << 20)
    # Nothing was left behind: the next buffer works.
    make_buffer(group, monkeypatch, None, num_nvl_bytes=1 << 20).destroy()


def run_calls(buffer, rank, R):
    """One sequence of low-latency calls (BF16 with and without hooks, FP8 with each scale format, a zero-copy
    combine) on every rank; returns every output, on the cpu."""
    E = EXPERTS_PER_RANK * R
    outs = []
    buffer.clean_low_latency_buffer(M, H, E)
    calls = [dict(use_fp8=False), dict(use_fp8=False, hook=True), dict(use_fp8=True),
             dict(use_fp8=True, round_scale=True), dict(use_fp8=True, round_scale=True, use_ue8m0=True),
             dict(use_fp8=False, zero_copy=True)]
    for seed, kw in enumerate(calls):
        kw = dict(kw)
        hook, zero_copy = kw.pop("hook", False), kw.pop("zero_copy", False)
        tokens = [M if r == seed % R else (M * (r + seed)) % (M + 1) for r in range(R)]
        inp = make_inputs(100 + seed, R, tokens, H, E, K)
        recv, count, handle, h, cum, _ = dispatch(buffer, inp, rank, M, E, hook=hook, **kw)
        if h is not None:
            h()
        check_dispatch(inp, rank, R, M, E, recv, count, handle, cum, fp8=kw["use_fp8"],
                       round_scale=kw.get("round_scale", False), ue8m0=kw.get("use_ue8m0", False))
        outs += received(recv, count, handle, cum)
        if kw["use_fp8"]:
            continue
        y = expert_outputs(recv, handle, rank, E, R)
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:] = y
            y = torch.empty(0)
        out, _, h = buffer.low_latency_combine(y, inp.topk[rank].to(dev()), inp.w[rank].to(dev()), handle,
                                               zero_copy=zero_copy, return_recv_hook=hook)
        if h is not None:
            h()
        assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))
        outs.append(out.cpu())
    return outs


def received(recv, count, handle, cum):
    """A dispatch's outputs that hold data: each expert's first recv_count rows (the rest of recv_x is whatever
    torch.empty left), as bytes, and the counts, ranges and statistics."""
    rows, scales = cpu(recv) if isinstance(recv, tuple) else (cpu(recv), None)
    count, src_info = cpu(count), cpu(handle[0])
    outs = [count, cpu(handle[1]), cpu(cum)]
    for j, n in enumerate(count.tolist()):
        outs += [rows[j, :n].contiguous().view(torch.uint8), src_info[j, :n]]
        if scales is not None:
            outs.append(scales[j, :n].contiguous())
    return outs


@pytest.fixture(scope="module")
def one_node_results(group):
    """The calls' results on a buffer of one node (PYEP_RANKS_PER_NODE unset), once for the module."""
    if group.size() < 2:
        return None
    saved = os.environ.pop("PYEP_RANKS_PER_NODE", None)
    try:
        R = group.size()
        size = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, EXPERTS_PER_RANK * R)
        buffer = pyep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
    finally:
        if saved is not None:
            os.environ["PYEP_RANKS_PER_NODE"] = saved
    try:
        return run_calls(buffer, group.rank(), R)
    finally:
        buffer.destroy()


def skip_without_nvshmem(buffer, group, E):
    """On the cuda backend, skips (on every rank alike) where NVSHMEM cannot run, with the core's reason."""
    if BACKEND == "cpu":
        return
    reason = None
    try:
        buffer.clean_low_latency_buffer(M, H, E)
    except pyep.NotAvailableError as e:
        reason = str(e)
    reasons = [None] * group.size()
    dist.all_gather_object(reasons, reason, group=group)
    if any(reasons):
        buffer.destroy()
        pytest.skip(f"low-latency mode across nodes on cuda needs NVSHMEM here: {next(r for r in reasons if r)}")


@pytest.mark.skipif(WORLD < 2, reason="nodes need at least 2 ranks")
@pytest.mark.parametrize("ranks_per_node,allow_nvlink", [(1, True), (2, True), (None, False), (2, False)])
def test_across_nodes_equals_one_node(group, rank, num_ranks, monkeypatch, one_node_results, ranks_per_node,
                                      allow_nvlink):
    if ranks_per_node is not None and num_ranks % ranks_per_node:
        pytest.skip(f"PYEP_RANKS_PER_NODE={ranks_per_node} does not divide {num_ranks} ranks")
    if ranks_per_node == num_ranks and allow_nvlink:
        pytest.skip(f"PYEP_RANKS_PER_NODE={ranks_per_node} on {num_ranks} ranks is one node")
    buffer = ll_buffer(group, monkeypatch, ranks_per_node, allow_nvlink_for_low_latency_mode=allow_nvlink)
    skip_without_nvshmem(buffer, group, EXPERTS_PER_RANK * num_ranks)
    try:
        if ranks_per_node is not None:
            assert buffer.runtime.get_num_rdma_ranks() == num_ranks // ranks_per_node
        got = run_calls(buffer, rank, num_ranks)
    finally:
        buffer.destroy()
    assert len(got) == len(one_node_results)
    for i, (a, b) in enumerate(zip(got, one_node_results)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}"
        assert torch.equal(a, b), f"output {i} differs from one node's"


@pytest.mark.skipif(WORLD < 2, reason="masking needs a second rank to mask")
def test_masked_rank_on_another_node(group, rank, num_ranks, monkeypatch):
    R, E = num_ranks, EXPERTS_PER_RANK * num_ranks
    last = R - 1
    buffer = ll_buffer(group, monkeypatch, 1, enable_shrink=True)
    skip_without_nvshmem(buffer, group, E)
    try:
        buffer.clean_low_latency_buffer(M, H, E)
        if rank != last:
            buffer.low_latency_update_mask_buffer(last, True)
            inp = make_inputs(200, R, [M] * R, H, E, K)
            recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
            check_dispatch(inp, rank, R, M, E, recv, count, handle, masked={last})
            out, _, _ = buffer.low_latency_combine(expert_outputs(recv, handle, rank, E, R), inp.topk[rank].to(dev()),
                                                   inp.w[rank].to(dev()), handle)
            assert torch.equal(out.cpu(), ref_combine(inp, rank, {last}, E // R))
            buffer.low_latency_clean_mask_buffer()
        dist.barrier(group)
        buffer.clean_low_latency_buffer(M, H, E)
    finally:
        buffer.destroy()


@pytest.mark.skipif(BACKEND != "cuda", reason="the cuda backend's refusal where NVSHMEM cannot run")
@pytest.mark.skipif(WORLD < 2, reason="nodes need at least 2 ranks")
def test_cuda_across_nodes_without_nvshmem_is_not_available(group, rank, num_ranks, monkeypatch):
    """Where NVSHMEM cannot run (NVSHMEM_DIR pointing nowhere is read only before the process first loads it, so this
    checks the message where it is missing), the buffer syncs and every call says why."""
    buffer = ll_buffer(group, monkeypatch, 1)
    try:
        try:
            buffer.clean_low_latency_buffer(M, H, EXPERTS_PER_RANK * num_ranks)
        except pyep.NotAvailableError as e:
            assert "NVSHMEM" in str(e) and "PYEP_RANKS_PER_NODE" in str(e), str(e)
        else:
            pytest.skip("NVSHMEM runs here: test_across_nodes_equals_one_node covers it")
    finally:
        buffer.destroy()
