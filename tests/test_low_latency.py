"""Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine, masks, clean) against a pure-torch
reference: BF16 rows and combine sums bit-exact, FP8 / round_scale / UE8M0 bit-exact to the reference's cast.

Every rank builds every rank's inputs from one seed, so it knows what it must receive without communicating. One
Buffer serves the module; each test cleans it for its shape (clean_low_latency_buffer, a collective call)."""
import os
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import pyep
from conftest import BACKEND, TorchCalls



def dev():
    """Where the calls' tensors live (the references stay on the cpu)."""
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "cuda" else torch.device("cpu")


def cpu(t):
    return tuple(u.cpu() for u in t) if isinstance(t, tuple) else (None if t is None else t.cpu())


MAX_M, MAX_H, EXPERTS_PER_RANK = 16, 512, 3


@dataclass
class Inputs:
    x: list      # per rank [T, H] bf16
    topk: list   # per rank [T, K] int64, -1 for none
    w: list      # per rank [T, K] float32


def make_inputs(seed: int, R: int, tokens: list, H: int, E: int, K: int) -> Inputs:
    xs, topks, ws = [], [], []
    for r in range(R):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        T = tokens[r]
        xs.append(torch.randn((T, H), generator=g).bfloat16())
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty((0, min(K, E)))
        if K > E:
            topk = torch.cat([topk, torch.full((T, K - E), -1)], dim=1)
        topk = topk.to(torch.int64)
        topk[torch.rand((T, K), generator=g) < 0.2] = -1
        if T > 1:
            topk[1] = -1  # a token that selects nothing
        topks.append(topk.contiguous())
        ws.append(torch.rand((T, K), generator=g))
    return Inputs(xs, topks, ws)


def expected_rows(inp: Inputs, src: int, expert: int) -> list:
    """The tokens of rank src that selected expert."""
    return sorted(set((inp.topk[src] == expert).any(dim=1).nonzero().flatten().tolist()))


def ref_fp8(x: torch.Tensor, round_scale: bool):
    """DeepEP's per-128-channel e4m3 cast: the FP8 rows and the float32 scales (inverses)."""
    T, H = x.shape
    xf = x.float().view(T, H // 128, 128)
    amax = xf.abs().amax(dim=-1).clamp(min=1e-4)
    inv448 = torch.tensor(1 / 448, dtype=torch.float32)
    if round_scale:
        bits = (amax * inv448).view(torch.int32)
        exp = ((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0).int()
        scale, scale_inv = ((127 - exp) << 23).view(torch.float32), ((127 + exp) << 23).view(torch.float32)
    else:
        scale, scale_inv = torch.full_like(amax, 448).div(amax), amax * inv448  # a true division, as the kernel's
    return (xf * scale.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn), scale_inv


def expert_output(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """What expert `expert` makes of its bf16 rows (the same on the expert's rank and in the reference)."""
    return (rows.float() * (expert + 1) / 4).bfloat16()


def ref_combine(inp: Inputs, me: int, masked: set, L: int, crossing=lambda row: row) -> torch.Tensor:
    """Rank me's combine, by rank: for each token, one term per rank it selected (masked ranks left out), added in
    float32 in the order of the token's first selection of each rank and rounded to bf16 once. A rank's term is
    w * expert_output in float32 for its only selection; for several, the rank's float32 sum of those products in k
    order, rounded to bf16 (the expert's rank sends that one row). crossing(row) is a bf16 row as it arrives."""
    x, topk, w = inp.x[me], inp.topk[me], inp.w[me]
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        by_rank = {}  # rank: its selections (k, expert), in k order; ranks in the order of first selection
        for k in range(topk.shape[1]):
            g = int(topk[t, k])
            if g >= 0:
                by_rank.setdefault(g // L, []).append((k, g))
        for r, sel in by_rank.items():
            if r in masked:
                continue
            if len(sel) == 1:
                k, g = sel[0]
                term = crossing(expert_output(x[t], g)).float() * w[t, k]
            else:
                term = torch.zeros(x.shape[1], dtype=torch.float32)
                for k, g in sel:
                    term = term + expert_output(x[t], g).float() * w[t, k]
                term = crossing(term.bfloat16()).float()
            acc[t] = acc[t] + term
    return acc.bfloat16()


@pytest.fixture(scope="module")
def buffer(group):
    R = group.size()
    size = pyep.Buffer.get_low_latency_rdma_size_hint(MAX_M, MAX_H, R, EXPERTS_PER_RANK * R)
    buffer = pyep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=EXPERTS_PER_RANK,
                         explicitly_destroy=True, enable_shrink=True)
    yield buffer
    buffer.destroy()


def dispatch(buffer, inp, rank, M, E, hook=False, async_finish=False, stats=True, **kw):
    L, R = E // buffer.group_size, buffer.group_size
    cum = torch.full((L,), 5, dtype=torch.int32, device=dev()) if stats else None
    wait = torch.zeros((R,), dtype=torch.int64, device=dev()) if stats else None
    recv, count, handle, event, h = buffer.low_latency_dispatch(
        inp.x[rank].to(dev()), inp.topk[rank].to(dev()), M, E, cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wait,
        async_finish=async_finish, return_recv_hook=hook, **kw)
    assert (h is not None) == hook and (event.event is not None) == async_finish
    return recv, count, handle, h, cum, wait


def check_dispatch(inp, rank, R, M, E, recv, count, handle, cum=None, masked=(), fp8=False, round_scale=False,
                   ue8m0=False):
    L, H = E // R, inp.x[0].shape[1]
    recv, count, cum = cpu(recv), cpu(count), cpu(cum)
    src_info, layout_range, hM, hH, hE = handle
    src_info, layout_range = cpu(src_info), cpu(layout_range)
    assert (hM, hH, hE) == (M, H, E)
    assert src_info.shape == (L, R * M) and src_info.dtype == torch.int32
    assert layout_range.shape == (L, R) and layout_range.dtype == torch.int64
    assert count.shape == (L,) and count.dtype == torch.int32
    if fp8:
        rows, scales = recv
        assert rows.dtype == torch.float8_e4m3fn and rows.shape == (L, R * M, H)
        words = (H // 128 + 3) // 4 if ue8m0 else H // 128
        assert scales.shape == (L, R * M, words) and scales.stride() == (words * R * M, 1, R * M)
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
    else:
        assert recv.dtype == torch.bfloat16 and recv.shape == (L, R * M, H)
    for j in range(L):
        expert = rank * L + j
        total = 0
        for src in range(R):
            begin, n = int(layout_range[j, src]) >> 32, int(layout_range[j, src]) & 0xffffffff
            want = [] if src in masked else expected_rows(inp, src, expert)
            assert n == len(want), f"expert {expert} from rank {src}"
            got = src_info[j, begin:begin + n]
            assert sorted(got.tolist()) == want
            if n == 0:
                continue
            x = inp.x[src][got.long()]
            if not fp8:
                assert torch.equal(recv[j, begin:begin + n], x)
                continue
            q, inv = ref_fp8(x, round_scale)
            assert torch.equal(recv[0][j, begin:begin + n].view(torch.uint8), q.view(torch.uint8))
            if ue8m0:
                exps = ((inv.view(torch.int32) >> 23) & 0xff).to(torch.uint8)
                words = recv[1][j, begin:begin + n].long()
                got_bytes = torch.stack([(words >> (8 * b)) & 0xff for b in range(4)], dim=-1).flatten(1).to(torch.uint8)
                assert torch.equal(got_bytes[:, :exps.shape[1]], exps)
                assert not got_bytes[:, exps.shape[1]:].any()
            else:
                assert torch.equal(recv[1][j, begin:begin + n], inv)
        total = sum(0 if s in masked else len(expected_rows(inp, s, expert)) for s in range(R))
        assert int(count[j]) == total
        if cum is not None:
            assert int(cum[j]) == total + 5


def expert_outputs(recv, handle, rank, E, R):
    L = E // R
    return torch.stack([expert_output(recv[j], rank * L + j) for j in range(L)])


@dataclass
class Case:
    name: str
    H: int = 256
    K: int = 4
    M: int = 8
    full: bool = True    # rank 0 dispatches M tokens
    empty: bool = True   # rank 1 dispatches none
    hook: bool = False
    async_finish: bool = False
    stats: bool = True


CASES = [Case("plain"), Case("hook", hook=True, H=384), Case("async", async_finish=True, K=11),
         Case("no-stats", stats=False, M=MAX_M, H=MAX_H, K=1), Case("one-token", M=1, full=False, empty=False)]


def tokens_for(case, R):
    tokens = [max(1, case.M * 3 // 4)] * R
    if case.full:
        tokens[0] = case.M
    if case.empty and R > 1:
        tokens[1] = 0
    return tokens


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dispatch_combine_bf16(buffer, rank, num_ranks, case):
    R, E = num_ranks, EXPERTS_PER_RANK * num_ranks
    buffer.clean_low_latency_buffer(case.M, case.H, E)
    for seed in range(3):  # both halves in turn, and back to the first
        inp = make_inputs(seed, R, tokens_for(case, R), case.H, E, case.K)
        recv, count, handle, hook, cum, wait = dispatch(buffer, inp, rank, case.M, E, hook=case.hook,
                                                        async_finish=case.async_finish, stats=case.stats,
                                                        use_fp8=False)
        if hook:
            hook()
        check_dispatch(inp, rank, R, case.M, E, recv, count, handle, cum)
        if wait is not None:
            assert (wait >= 0).all()
        out, event, hook = buffer.low_latency_combine(expert_outputs(recv, handle, rank, E, R), inp.topk[rank].to(dev()),
                                                      inp.w[rank].to(dev()), handle, async_finish=case.async_finish,
                                                      return_recv_hook=case.hook)
        if hook:
            hook()
        assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))


def test_calls_run_without_torch_function_modes(buffer, rank, num_ranks):
    """Under a torch function mode (torch.set_default_device's, in DeepEP's tests) the low-latency dispatch and
    combine route no torch call through it, and return what they return without it."""
    R, E, M, H, K = num_ranks, EXPERTS_PER_RANK * num_ranks, 16, 256, 4
    buffer.clean_low_latency_buffer(M, H, E)
    inp = make_inputs(3, R, [M - 3] * R, H, E, K)
    x, topk, w = inp.x[rank].to(dev()), inp.topk[rank].to(dev()), inp.w[rank].to(dev())
    with TorchCalls() as calls:
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
    assert calls.seen == []
    check_dispatch(inp, rank, R, M, E, recv, count, handle)
    y = expert_outputs(recv, handle, rank, E, R)
    with TorchCalls() as calls:
        out, _, _ = buffer.low_latency_combine(y, topk, w, handle)
    assert calls.seen == []
    assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("H", [384, 512])
def test_dispatch_fp8_bit_exact(buffer, rank, num_ranks, round_scale, use_ue8m0, H):
    R, E, M = num_ranks, EXPERTS_PER_RANK * num_ranks, 6
    buffer.clean_low_latency_buffer(M, H, E)
    inp = make_inputs(7, R, [M] * R, H, E, 3)
    inp.x[rank % R][0, :128] = 0  # a zero block: the scale's floor
    inp.x = [x * 30 for x in inp.x]
    for r in range(R):
        inp.x[r][0, :128] = 0
    recv, count, handle, _, cum, _ = dispatch(buffer, inp, rank, M, E, use_fp8=True, round_scale=round_scale,
                                              use_ue8m0=use_ue8m0)
    check_dispatch(inp, rank, R, M, E, recv, count, handle, cum, fp8=True, round_scale=round_scale, ue8m0=use_ue8m0)


def test_zero_copy_and_out(buffer, rank, num_ranks):
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 4, 256
    buffer.clean_low_latency_buffer(M, H, E)
    for seed in range(2):
        inp = make_inputs(seed + 20, R, [M] * R, H, E, 2)
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        rows = buffer.get_next_low_latency_combine_buffer(handle)
        assert rows.shape == (E // R, R * M, H) and rows.dtype == torch.bfloat16
        rows[:] = expert_outputs(recv, handle, rank, E, R)
        out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=dev())
        stats = torch.zeros((R,), dtype=torch.int64, device=dev())
        combined, _, _ = buffer.low_latency_combine(torch.empty(0), inp.topk[rank].to(dev()), inp.w[rank].to(dev()),
                                                    handle, zero_copy=True, out=out, combine_wait_recv_cost_stats=stats)
        assert combined is out
        assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))
        assert (stats >= 0).all()


def test_handle_and_output_written_again_only_when_dropped(buffer, rank, num_ranks):
    """The usual dispatch writes src_info, layout_range and recv_count into the last usual dispatch's block once the
    caller let go of all three, and the usual combine its output into the last one's, instead of allocating; never
    while one of them or a view of them is held (those keep their values), nor with async_finish or on another
    stream (which get blocks of their own and leave the kept ones); and every call's results are their own."""
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 4, 128
    buffer.clean_low_latency_buffer(M, H, E)
    inps = [make_inputs(40 + s, R, [M] * R, H, E, 2) for s in range(2)]
    calls = iter(range(1000))

    def call(async_finish=False):
        inp = inps[next(calls) % 2]
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, async_finish=async_finish, stats=False,
                                                use_fp8=False)
        if async_finish and dev().type == "cuda":
            torch.cuda.synchronize()
        check_dispatch(inp, rank, R, M, E, recv, count, handle)
        out, event, _ = buffer.low_latency_combine(expert_outputs(recv, handle, rank, E, R), inp.topk[rank].to(dev()),
                                                   inp.w[rank].to(dev()), handle, async_finish=async_finish)
        if async_finish:
            event.current_stream_wait()
        assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))
        return count, handle, out

    count, handle, out = call()
    was = count.data_ptr(), out.data_ptr()
    del count, handle, out
    count, handle, out = call()
    assert (count.data_ptr(), out.data_ptr()) == was, "a dropped dispatch's handle and count or a combine's output " \
                                                      "were not written again"
    for name, hold in (("recv_count", lambda c, h, o: c), ("the handle", lambda c, h, o: h),
                       ("src_info", lambda c, h, o: h[0]), ("a view of layout_range", lambda c, h, o: h[1][1:]),
                       ("the combined output", lambda c, h, o: o)):
        held = hold(count, handle, out)
        kept = [t.clone() if isinstance(t, torch.Tensor) else t for t in (held if type(held) is tuple else (held,))]
        was = count.data_ptr(), out.data_ptr()
        del count, handle, out
        count, handle, out = call()
        if name == "the combined output":
            assert out.data_ptr() != was[1] and count.data_ptr() == was[0], "a held combined output written again"
        else:
            assert count.data_ptr() != was[0] and out.data_ptr() == was[1], f"written again while {name} was held"
        now = held if type(held) is tuple else (held,)
        assert all(not isinstance(t, torch.Tensor) or torch.equal(t, k) for t, k in zip(now, kept)), f"{name} changed"
        del held, now
    was = count.data_ptr(), out.data_ptr()
    del count, handle, out
    count, handle, out = call(async_finish=True)
    assert count.data_ptr() != was[0] and out.data_ptr() != was[1], "an async_finish call wrote into the kept blocks"
    del count, handle, out
    count, handle, out = call()
    assert (count.data_ptr(), out.data_ptr()) == was, "the kept blocks were not written again after async_finish"
    if dev().type == "cuda":
        was = count.data_ptr(), out.data_ptr()
        del count, handle, out
        with torch.cuda.stream(torch.cuda.Stream()):
            count, handle, out = call()
            assert count.data_ptr() != was[0] and out.data_ptr() != was[1], "one stream's outputs written on another"
        torch.cuda.synchronize()


def test_two_calls_await_their_hooks(buffer, rank, num_ranks):
    """Both halves in turn: two dispatches' hooks may be outstanding; a third call must wait for the first hook."""
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 5, 128
    buffer.clean_low_latency_buffer(M, H, E)
    a, b = (make_inputs(s, R, [M] * R, H, E, 3) for s in (30, 31))
    ra, ca, ha, hook_a, _, _ = dispatch(buffer, a, rank, M, E, hook=True, use_fp8=False)
    rb, cb, hb, hook_b, _, _ = dispatch(buffer, b, rank, M, E, hook=True, use_fp8=False)
    with pytest.raises(ValueError, match="receive hook of low-latency call 1 .* has not been called"):
        dispatch(buffer, a, rank, M, E, use_fp8=False)
    hook_a()
    with pytest.raises(ValueError, match="already ran|has no receive waiting"):
        hook_a()
    hook_b()
    check_dispatch(a, rank, R, M, E, ra, ca, ha)
    check_dispatch(b, rank, R, M, E, rb, cb, hb)
    # The first dispatch's results stay valid while later calls run.
    out, _, _ = buffer.low_latency_combine(expert_outputs(rb, hb, rank, E, R), b.topk[rank].to(dev()),
                                           b.w[rank].to(dev()), hb)
    check_dispatch(a, rank, R, M, E, ra, ca, ha)
    assert torch.equal(out.cpu(), ref_combine(b, rank, set(), E // R))


def test_hooked_combine_send_waits_for_no_peer(buffer, group, rank, num_ranks):
    """A hooked combine's send phase ends before any later rank has entered the combine: the ranks send in turn,
    rank r + 1 only once rank r's send finished. The rows that waited for a later rank's top-k go with the hook,
    and the sums are the same."""
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 6, 256
    buffer.clean_low_latency_buffer(M, H, E)
    for seed in (40, 41):  # both halves
        inp = make_inputs(seed, R, [M] * R, H, E, 4)
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        y = expert_outputs(recv, handle, rank, E, R)
        turn = torch.zeros(1, device=dev() if dist.get_backend(group) == "nccl" else "cpu")
        if rank > 0:
            dist.recv(turn, src=rank - 1, group=group)
        out, _, hook = buffer.low_latency_combine(y, inp.topk[rank].to(dev()), inp.w[rank].to(dev()), handle,
                                                  return_recv_hook=True)
        if BACKEND == "cuda":
            torch.cuda.synchronize()
        if rank < R - 1:
            dist.send(turn, dst=rank + 1, group=group)
        hook()
        assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))


def test_largest_token_count_and_beyond(group, rank, num_ranks):
    R, E, H = num_ranks, 2 * num_ranks, 128
    M = 64
    size = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buffer = pyep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
    try:
        inp = make_inputs(40, R, [M] * R, H, E, 2)
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        check_dispatch(inp, rank, R, M, E, recv, count, handle)
        with pytest.raises(ValueError, match="get_low_latency_rdma_size_hint"):
            buffer.clean_low_latency_buffer(M + 8, H, E)
        with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank = 72, .* need .* bytes"):
            dispatch(buffer, inp, rank, M + 8, E, use_fp8=False)
    finally:
        buffer.destroy()


def test_low_latency_after_normal_mode(group, rank, num_ranks):
    R, E, M, H = num_ranks, 2 * num_ranks, 4, 128
    nvl_bytes = pyep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    buffer = pyep.Buffer(group, num_nvl_bytes=max(nvl_bytes, 1 << 22), low_latency_mode=True,
                         num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E), explicitly_destroy=True)
    try:
        if buffer.runtime.get_num_rdma_ranks() > 1:
            pytest.skip(f"PYEP_RANKS_PER_NODE={buffer.runtime.ranks_per_node} makes {R} ranks several nodes, and normal "
                        "mode does not run across nodes (test_low_latency_nodes checks its error)")
        inp = make_inputs(50, R, [M] * R, H, E, 2)
        for _ in range(2):
            topk = inp.topk[rank].clamp(min=0).to(dev())
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
            x = inp.x[rank].to(dev())
            recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                         num_tokens_per_expert=per_expert)
            combined, _, _ = buffer.combine(recv_x, handle)
            assert combined.shape == x.shape
            buffer.clean_low_latency_buffer(M, H, E)
            recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
            check_dispatch(inp, rank, R, M, E, recv, count, handle)
    finally:
        buffer.destroy()


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="masking needs a second rank to mask")
def test_masked_rank_is_neither_sent_to_nor_awaited(buffer, group, rank, num_ranks):
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 4, 128
    L, last = E // R, num_ranks - 1
    buffer.clean_low_latency_buffer(M, H, E)
    status = torch.empty((R,), dtype=torch.int32, device=dev())
    if rank != last:
        buffer.low_latency_update_mask_buffer(last, True)
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == last) for r in range(R)]
        inp = make_inputs(60, R, [M] * R, H, E, 3)
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        check_dispatch(inp, rank, R, M, E, recv, count, handle, masked={last})
        out, _, _ = buffer.low_latency_combine(expert_outputs(recv, handle, rank, E, R), inp.topk[rank].to(dev()),
                                               inp.w[rank].to(dev()), handle)
        assert torch.equal(out.cpu(), ref_combine(inp, rank, {last}, L))
        buffer.low_latency_clean_mask_buffer()
    dist.barrier(group)
    buffer.low_latency_query_mask_buffer(status)
    assert not status.any()
    buffer.clean_low_latency_buffer(M, H, E)


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="a timeout needs a second rank that stays away")
@pytest.mark.parametrize("shrink", [True, False])
def test_rank_that_does_not_answer(group, rank, num_ranks, shrink, monkeypatch):
    R, E, M, H = num_ranks, 2 * num_ranks, 2, 128
    monkeypatch.setenv("PYEP_TIMEOUT_S", "1")
    buffer = pyep.Buffer(group, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink)
    last = num_ranks - 1
    try:
        inp = make_inputs(70, R, [M] * R, H, E, 2)
        if rank != last and BACKEND == "cuda":
            # The kernel does not block the host: the wait times out on the GPU, masks the rank there, and the
            # host reports it at the next call (without enable_shrink) or shows it in the mask.
            recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
            torch.cuda.synchronize()
            if shrink:
                check_dispatch(inp, rank, R, M, E, recv, count, handle, masked={last})
                status = torch.empty((R,), dtype=torch.int32, device=dev())
                buffer.low_latency_query_mask_buffer(status)
                assert status.tolist() == [int(r == last) for r in range(R)]
                buffer.low_latency_clean_mask_buffer()
            else:
                for _ in range(2):
                    with pytest.raises(pyep.PyepError, match=rf"waiting for rank {last} .*clean_low_latency_buffer"):
                        dispatch(buffer, inp, rank, M, E, use_fp8=False)
        elif rank != last:
            if shrink:
                with pytest.warns(RuntimeWarning, match=rf"rank\(s\) {last} did not answer within the timeout"):
                    recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
                check_dispatch(inp, rank, R, M, E, recv, count, handle, masked={last})
                status = torch.empty((R,), dtype=torch.int32)
                buffer.low_latency_query_mask_buffer(status)
                assert status.tolist() == [int(r == last) for r in range(R)]
                buffer.low_latency_clean_mask_buffer()
            else:
                with pytest.raises(pyep.PyepError, match=rf"rank {last} did not answer within 1s"):
                    dispatch(buffer, inp, rank, M, E, use_fp8=False)
                with pytest.raises(pyep.PyepError, match="needs clean_low_latency_buffer on every rank"):
                    dispatch(buffer, inp, rank, M, E, use_fp8=False)
        dist.barrier(group)
        buffer.clean_low_latency_buffer(M, H, E)
        recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
        check_dispatch(inp, rank, R, M, E, recv, count, handle)
    finally:
        buffer.destroy()


def test_bad_arguments_raise_and_the_next_call_works(buffer, rank, num_ranks):
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 4, 128
    buffer.clean_low_latency_buffer(M, H, E)
    inp = make_inputs(80, R, [M] * R, H, E, 2)
    x, topk, d = inp.x[rank].to(dev()), inp.topk[rank].to(dev()), dev()
    with pytest.raises(ValueError, match=r"^x: dtype torch.float32, expected torch.bfloat16$"):
        buffer.low_latency_dispatch(x.float(), topk, M, E)
    with pytest.raises(ValueError, match=r"x: 4 tokens, expected at most num_max_dispatch_tokens_per_rank = 3"):
        buffer.low_latency_dispatch(x, topk, M - 1, E)
    with pytest.raises(ValueError, match=r"topk_idx: shape \(4, 12\)"):
        buffer.low_latency_dispatch(x, torch.zeros((M, 12), dtype=torch.int64, device=d), M, E)
    if BACKEND == "cpu":  # on cuda the host does not read the indices (a sync): one out of range selects nothing
        bad = topk.clone()
        bad[0, 0] = E
        with pytest.raises(ValueError, match=rf"topk_idx\[0, 0\] = {E}: expected -1 or an expert in \[0, {E}\)"):
            buffer.low_latency_dispatch(x, bad, M, E)
    with pytest.raises(ValueError, match="use_ue8m0=True: UE8M0 scales need round_scale=True"):
        buffer.low_latency_dispatch(x, topk, M, E, use_ue8m0=True)
    with pytest.raises(ValueError, match="async_finish=True and return_recv_hook=True"):
        buffer.low_latency_dispatch(x, topk, M, E, async_finish=True, return_recv_hook=True)
    if R > 1:  # (one expert is a valid split of one rank)
        with pytest.raises(ValueError, match="num_experts = 1: expected a multiple of num_ranks"):
            buffer.low_latency_dispatch(x, topk.clamp(max=0), M, 1)
    with pytest.raises(ValueError, match=r"cumulative_local_expert_recv_stats: dtype torch.int64"):
        buffer.low_latency_dispatch(x, topk, M, E,
                                    cumulative_local_expert_recv_stats=torch.zeros(E // R, dtype=torch.int64, device=d))
    with pytest.raises(ValueError, match=r"dispatch_wait_recv_cost_stats: shape \(1, 1\)"):
        buffer.low_latency_dispatch(x, topk, M, E,
                                    dispatch_wait_recv_cost_stats=torch.zeros((1, 1), dtype=torch.int64, device=d))
    recv, count, handle, _, _, _ = dispatch(buffer, inp, rank, M, E, use_fp8=False)
    check_dispatch(inp, rank, R, M, E, recv, count, handle)
    y = expert_outputs(recv, handle, rank, E, R)
    w = inp.w[rank].to(d)
    with pytest.raises(ValueError, match="use_logfmt=True and zero_copy=True"):
        buffer.low_latency_combine(y, topk, w, handle, use_logfmt=True, zero_copy=True)
    with pytest.raises(ValueError, match="handle: expected the 5-tuple"):
        buffer.low_latency_combine(y, topk, w, handle[:4])
    with pytest.raises(ValueError, match=r"^out: shape"):
        buffer.low_latency_combine(y, topk, w, handle, out=torch.empty((1, H), dtype=torch.bfloat16, device=d))
    with pytest.raises(ValueError, match=r"^x: shape"):
        buffer.low_latency_combine(y[:, :1], topk, w, handle)
    with pytest.raises(ValueError, match=r"rank_to_mask = -3"):
        buffer.low_latency_update_mask_buffer(-3, True)
    out, _, _ = buffer.low_latency_combine(y, topk, w, handle)
    assert torch.equal(out.cpu(), ref_combine(inp, rank, set(), E // R))


def test_size_hint_and_masks_need_shrink(group, num_ranks):
    hint = pyep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert hint % 128 == 0 and hint > 2 * 288 * 128 * 7168 * 2
    assert pyep.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 288) > hint
    with pytest.raises(ValueError, match="hidden = 100: expected a positive multiple of 128"):
        pyep.Buffer.get_low_latency_rdma_size_hint(128, 100, 8, 288)
    with pytest.raises(ValueError, match="num_experts = 9: expected a positive multiple of num_ranks = 8"):
        pyep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 9)
    buffer = pyep.Buffer(group, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
    try:
        with pytest.raises(ValueError, match="masks need enable_shrink=True"):
            buffer.low_latency_update_mask_buffer(0, True)
        with pytest.raises(ValueError, match="masks need enable_shrink=True"):
            buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int32, device=dev()))
    finally:
        buffer.destroy()


def test_timeline_is_the_cuda_kernels(group, rank, num_ranks, monkeypatch):
    """Buffer._low_latency_timeline, a debug API: an error on cpu (no kernels) and on a buffer made without
    PYEP_LL_TIMELINE=1; with it, on cuda, a dispatch's stamps: every block starts and finishes each kernel, and the
    phases it reached follow each other."""
    R, E, M, H = num_ranks, EXPERTS_PER_RANK * num_ranks, 8, 256
    size = pyep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    for on in (False, True):
        monkeypatch.setenv("PYEP_LL_TIMELINE", "1" if on else "")
        buffer = pyep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
        try:
            if BACKEND != "cuda":
                with pytest.raises(pyep.PyepError, match="the cpu backend runs no kernels"):
                    buffer._low_latency_timeline()
                continue
            if not on:
                with pytest.raises(pyep.PyepError, match="set PYEP_LL_TIMELINE=1 before the Buffer is made"):
                    buffer._low_latency_timeline()
                continue
            buffer.clean_low_latency_buffer(M, H, E)
            inp = make_inputs(7, R, [M] * R, H, E, 4)
            dispatch(buffer, inp, rank, M, E, hook=True)[3]()
            phases, stamps = buffer._low_latency_timeline()
            assert stamps.dtype == torch.int64 and stamps.shape[1] == len(phases) and stamps.shape[0] > 0
            assert int(stamps[stamps >= 0].min()) == 0
            for kernel in ("dispatch send", "dispatch recv"):
                cols = [i for i, (k, _) in enumerate(phases) if k == kernel]
                assert phases[cols[0]][1] == "start" and phases[cols[-1]][1] in ("flagged", "done")
                for row in stamps[:, cols].tolist():
                    assert row[0] >= 0 and row[-1] >= 0, f"{kernel}: {row}"
                    reached = [v for v in row if v >= 0]
                    assert reached == sorted(reached), f"{kernel}: {row}"
            combine = [i for i, (k, _) in enumerate(phases) if k.startswith("combine")]
            assert (stamps[:, combine] == -1).all(), "no combine ran"
            assert (buffer._low_latency_timeline()[1] == -1).all(), "a read clears the stamps"
        finally:
            buffer.destroy()


def test_warnings_clean(buffer):
    """No call above left a pending timeout report."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer.clean_low_latency_buffer(4, 128, EXPERTS_PER_RANK * buffer.group_size)
