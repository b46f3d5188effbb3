"""Normal mode (get_dispatch_layout, dispatch, cached dispatch, combine) against a pure-torch reference.

The same suite runs on the cpu backend (CI) and, with PYEP_TEST_DEVICE=cuda, on GPUs: inputs are made on the CPU,
moved to the test device, and results compared on the CPU.

Every rank makes every rank's inputs from the same seeds, so it computes what it must receive without any
communication; the library's results are compared with that reference bit for bit (combine sums in float32 in
increasing rank order and rounds once, which the reference repeats)."""
import resource
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import pyep


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int = 96
    hidden: int = 256
    topk: int = 8
    experts_per_rank: int = 4
    routing: str = "random"  # random | silent | deaf | one | none
    fp8: bool = False
    dtype: torch.dtype = torch.bfloat16
    alignment: int = 1
    worst: int = 0  # 0, or extra rows of num_worst_tokens beyond the largest receive
    config: tuple = ()  # Config fields; () for the recommended one
    seed: int = 0


def inputs(case: Case, src: int, num_ranks: int):
    """Rank src's tokens: x (or (fp8, scales)), topk_idx and topk_weights."""
    g = torch.Generator().manual_seed(case.seed * 1000 + src)
    E = case.experts_per_rank * num_ranks
    T, K = case.tokens, case.topk
    scores = torch.rand(T, E, generator=g)
    if case.routing == "deaf":  # nobody picks the last rank's experts
        scores[:, E - case.experts_per_rank:] = -1
    if case.routing == "one":  # everything goes to rank 0's experts
        scores[:, case.experts_per_rank:] = -1
    topk = scores.topk(min(K, E), dim=1).indices
    if K > E:
        topk = torch.cat([topk, torch.full((T, K - E), -1)], 1)
    topk = torch.where(scores.gather(1, topk.clamp(min=0)) < 0, -1, topk)
    topk[torch.rand(T, K, generator=g) < 0.1] = -1
    if case.routing == "silent" and src == 0 or case.routing == "none":
        topk[:] = -1
    weights = torch.rand(T, K, generator=g)
    x = torch.randn(T, case.hidden, generator=g) * 4
    if case.fp8:
        return (x.to(torch.float8_e4m3fn), torch.rand(T, case.hidden // 128, generator=g) + 0.5), topk, weights
    return x.to(case.dtype), topk, weights


def expected_receive(case: Case, me: int, num_ranks: int):
    """What rank me receives: rows, local top-k, weights, source indices, per-expert counts."""
    epr = case.experts_per_rank
    rows, scales, topks, weights, src_idx = [], [], [], [], []
    for src in range(num_ranks):
        x, topk, w = inputs(case, src, num_ranks)
        mine = (topk >= me * epr) & (topk < (me + 1) * epr)
        sel = mine.any(1).nonzero().flatten()
        x, x_scales = x if case.fp8 else (x, None)
        rows.append(x[sel])
        if case.fp8:
            scales.append(x_scales[sel])
        topks.append(torch.where(mine[sel], topk[sel] - me * epr, -1))
        weights.append(torch.where(mine[sel], w[sel], 0.0))
        src_idx.append(sel.int())
    local = torch.cat(topks)
    counts = [int((local == e).sum()) for e in range(epr)]
    aligned = [(c + case.alignment - 1) // case.alignment * case.alignment for c in counts]
    return torch.cat(rows), (torch.cat(scales) if case.fp8 else None), local, torch.cat(weights), torch.cat(src_idx), aligned


def expert_output(recv_x: torch.Tensor, me: int) -> torch.Tensor:
    """What rank me returns in combine: its received rows, scaled so that each rank's copy differs."""
    return (recv_x.float() * (me + 1) / 4).to(recv_x.dtype)


def expected_combine(case: Case, me: int, num_ranks: int, bias):
    x, topk, w = inputs(case, me, num_ranks)
    x = x[0].float() if case.fp8 else x
    dtype = torch.bfloat16 if case.fp8 else case.dtype
    acc = torch.zeros(case.tokens, case.hidden)
    for b in bias:
        acc += b.float()
    for dst in range(num_ranks):
        goes = ((topk >= dst * case.experts_per_rank) & (topk < (dst + 1) * case.experts_per_rank)).any(1, keepdim=True)
        acc += torch.where(goes, expert_output(x.to(dtype), dst).float(), 0.0)
    weights = torch.where(topk >= 0, w, 0.0)
    return acc.to(dtype), weights


_buffers = {}


def buffer_for(group, config: pyep.Config, hidden_bytes: int) -> pyep.Buffer:
    """One buffer per needed size, kept across cases (as a model keeps its buffer)."""
    size = config.get_nvl_buffer_size_hint(hidden_bytes, group.size())
    if size not in _buffers:
        _buffers[size] = pyep.Buffer(group, size)
    return _buffers[size]


def on(device, value):
    """Moves a tensor, or a tuple of tensors, to device."""
    if isinstance(value, tuple):
        return tuple(on(device, v) for v in value)
    return value.to(device)


def host(value):
    if isinstance(value, tuple):
        return tuple(host(v) for v in value)
    return None if value is None else value.cpu()


def check_layout(topk: torch.Tensor, E: int, R: int, per_rank, per_expert, in_rank) -> None:
    """get_dispatch_layout's outputs against torch's reading of topk (experts split evenly over R ranks)."""
    topk_h, epr, T = topk.cpu(), E // R, topk.size(0)
    ref_in_rank = torch.stack([((topk_h >= r * epr) & (topk_h < (r + 1) * epr)).any(1) for r in range(R)], 1) if T \
        else torch.zeros(0, R, dtype=torch.bool)
    assert torch.equal(in_rank.cpu(), ref_in_rank)
    assert torch.equal(per_rank.cpu(), ref_in_rank.sum(0).int())
    assert torch.equal(per_expert.cpu(), torch.stack([(topk_h == e).any(1) for e in range(E)], 1).sum(0).int()
                       if T else torch.zeros(E, dtype=torch.int32))


def run_case(group, device, case: Case):
    me, R = group.rank(), group.size()
    config = pyep.Config(*case.config) if case.config else pyep.Buffer.get_dispatch_config(R)
    dtype = torch.bfloat16 if case.fp8 else case.dtype
    hidden_bytes = case.hidden * torch.empty((), dtype=dtype).element_size()
    buffer = buffer_for(group, config, hidden_bytes)
    x, topk, w = on(device, inputs(case, me, R))
    E = case.experts_per_rank * R
    if case.name == "buffer_smaller_than_data":
        assert buffer.num_nvl_bytes < case.tokens * hidden_bytes, "the rings are much smaller than one rank's tokens"

    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    assert per_rdma is None
    check_layout(topk, E, R, per_rank, per_expert, in_rank)

    ref_x, ref_scales, ref_topk, ref_w, ref_src, ref_counts = expected_receive(case, me, R)
    n = ref_x.size(0)
    worst = 0
    if case.worst:
        worst = max(expected_receive(case, r, R)[0].size(0) for r in range(R)) + case.worst
    recv, recv_topk, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk, topk_weights=w, expert_alignment=case.alignment, num_worst_tokens=worst, config=config)
    recv_x, recv_scales = recv if case.fp8 else (recv, None)
    dev_recv_x, dev_recv_w = recv_x, recv_w
    recv_x, recv_scales, recv_topk, recv_w = host((recv_x, recv_scales, recv_topk, recv_w))
    rows = worst or n
    assert recv_x.shape == (rows, case.hidden) and recv_x.dtype == x[0].dtype if case.fp8 else recv_x.dtype == case.dtype
    assert torch.equal(recv_x[:n].view(torch.uint8), ref_x.view(torch.uint8)), "dispatch moves rows bit for bit"
    if case.fp8:
        assert torch.equal(recv_scales[:n], ref_scales)
    assert torch.equal(recv_topk[:n], ref_topk) and torch.equal(recv_w[:n], ref_w)
    assert (recv_topk[n:] == -1).all() and (recv_w[n:] == 0).all()
    assert counts == ([] if worst else ref_counts)
    assert handle[4] is in_rank
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, handle_in_rank, send_head = host(handle)
    assert torch.equal(recv_src_idx[:n], ref_src)
    assert rank_prefix[R - 1, me].item() == n
    assert channel_prefix.shape == recv_channel_prefix.shape == (R, config.num_sms // 2)
    assert torch.equal(channel_prefix[:, -1], per_rank.cpu())
    assert torch.equal((send_head >= 0), handle_in_rank)

    # Cached dispatch moves the same rows again.
    again, *rest, event = buffer.dispatch(x, handle=handle, config=config)
    assert rest == [None, None, None, None]
    again_x = (again[0] if case.fp8 else again).cpu()
    assert torch.equal(again_x[:n].view(torch.uint8), ref_x.view(torch.uint8))

    # Combine: each rank returns its rows scaled; no bias, one bias, two biases.
    y = on(device, expert_output(recv_x.float().to(torch.bfloat16) if case.fp8 else recv_x, me))
    g = torch.Generator().manual_seed(7 + me)
    for num_bias in (0, 1, 2):
        bias = tuple(torch.randn(case.tokens, case.hidden, generator=g).to(y.dtype) for _ in range(num_bias))
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=dev_recv_w,
                                                 bias=on(device, bias[0] if num_bias == 1 else (bias or None)) if bias else None,
                                                 config=config)
        ref_combined, ref_weights = expected_combine(case, me, R, bias)
        assert torch.equal(combined.cpu(), ref_combined), f"combine with {num_bias} biases"
        assert torch.equal(combined_w.cpu(), ref_weights)


CASES = [
    Case("random"),
    Case("topk1", topk=1),
    Case("topk9", topk=9, experts_per_rank=3),
    Case("silent_rank", routing="silent"),
    Case("deaf_rank", routing="deaf"),
    Case("all_to_one_rank", routing="one"),
    Case("no_experts", routing="none"),
    Case("zero_tokens", tokens=0),
    Case("hidden_7168", hidden=7168, tokens=48),
    Case("hidden_2880", hidden=2880, tokens=48),
    Case("fp8", hidden=7168, tokens=48, fp8=True),
    Case("fp8_small", hidden=512, fp8=True, routing="deaf"),
    Case("float32", dtype=torch.float32),
    Case("float16", dtype=torch.float16),
    Case("alignment_128", alignment=128),
    Case("worst_tokens", worst=5),
    Case("buffer_smaller_than_data", tokens=512, hidden=1024, config=(4, 2, 8, 6, 128)),
    Case("odd_config", config=(6, 3, 7, 6, 128), tokens=200),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_round_trip(group, device, case):
    run_case(group, device, case)


def test_async_and_events(group, device):
    case = Case("events")
    R = group.size()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, group.rank(), R))
    previous = pyep.Buffer.capture()
    per_rank, _, per_expert, in_rank, event = buffer.get_dispatch_layout(
        topk, case.experts_per_rank * R, previous_event=previous, async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    recv, _, _, _, handle, event = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, async_finish=True)
    with event:
        pass
    assert event.extra_tensors is not None
    with pytest.raises(ValueError, match="allocate_on_comm_stream=True needs previous_event"):
        buffer.get_dispatch_layout(topk, case.experts_per_rank * R, allocate_on_comm_stream=True)


def good_call(group, device, buffer):
    run = Case("after_error", tokens=32)
    R = group.size()
    x, topk, w = on(device, inputs(run, group.rank(), R))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, run.experts_per_rank * R)
    recv, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
    assert torch.equal(recv.cpu(), expected_receive(run, group.rank(), R)[0])
    combined, _, _ = buffer.combine(recv, handle)
    return handle


def layout_dict(layout):
    per_rank, _, per_expert, in_rank, _ = layout
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset_8_bytes"])
@pytest.mark.parametrize("topk_n", [6, 8, 9, 10])
def test_layout_of_any_topk_width_and_alignment(group, device, topk_n, offset):
    # The cuda kernel loads a token's choices two at a time when every row is 16-byte aligned (an even top-k and an
    # aligned tensor) and one at a time otherwise: both, with choices past the first eight and dropped ones (-1).
    R = group.size()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), 256 * 2)
    T, E = 1000, 12 * R
    g = torch.Generator().manual_seed(topk_n * 10 + offset)
    topk_h = torch.rand(T, E, generator=g).topk(topk_n, dim=1).indices
    topk_h[::5, topk_n - 1] = -1
    flat = torch.empty(offset + T * topk_n, dtype=torch.int64, device=device)
    topk = flat[offset:].view(T, topk_n)
    topk.copy_(topk_h)
    assert topk.data_ptr() % 16 == 8 * offset
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    check_layout(topk, E, R, per_rank, per_expert, in_rank)
    dist.barrier(group)


def test_bad_input_raises_and_next_call_works(group, device):
    R, me = group.size(), group.rank()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), 256 * 2)
    case = Case("bad", tokens=32)
    x, topk, w = on(device, inputs(case, me, R))
    E = case.experts_per_rank * R
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    with pytest.raises(ValueError, match=r"x\[0\]: dtype torch.int32, expected 1-byte elements with scales"):
        buffer.dispatch((x.int(), torch.ones(32, 2, device=device)), **layout)
    with pytest.raises(ValueError, match=r"topk_weights: shape \[32, 3\], expected \[32, 8\]"):
        buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w[:, :3].contiguous())
    with pytest.raises(ValueError, match=r"is_token_in_rank: shape"):
        buffer.dispatch(x[:16], **layout)
    bad_layout = torch.full_like(topk, E)
    if device.type == "cuda":
        # The layout does not wait for the GPU: the dispatch after it reports the index, on every rank.
        bad = layout_dict(buffer.get_dispatch_layout(bad_layout, E))
        with pytest.raises(ValueError, match=rf"last get_dispatch_layout, topk_idx\[0,0\] = {E} is out of range"):
            buffer.dispatch(x, **bad)
        # Bad indices in three of the layout kernel's blocks (512 tokens each): each block records its first unless
        # an earlier one is recorded, so the first in topk_idx's order is reported whichever block comes last.
        many = torch.zeros(2000, case.topk, dtype=topk.dtype, device=device)
        many[1500, 2], many[700, 5], many[1200, 0] = E, -7, E + 3
        xs = torch.zeros(2000, case.hidden, dtype=x.dtype, device=device)
        with pytest.raises(ValueError, match=r"last get_dispatch_layout, topk_idx\[700,5\] = -7 is out of range"):
            buffer.dispatch(xs, **layout_dict(buffer.get_dispatch_layout(many, E)))
    else:
        with pytest.raises(ValueError, match=rf"topk_idx\[\d+,\d+\] = {E} is out of range"):
            buffer.get_dispatch_layout(bad_layout, E)
    with pytest.raises(ValueError, match=r"num_experts = 0"):
        buffer.get_dispatch_layout(topk, 0)
    if R > 1:
        with pytest.raises(ValueError, match=rf"num_experts = {E + 1}: expected a multiple of num_ranks = {R}"):
            buffer.get_dispatch_layout(topk, E + 1)
    with pytest.raises(ValueError, match=rf"topk_idx: on meta, expected {device}"):
        buffer.get_dispatch_layout(topk.to("meta"), E)
    with pytest.raises(ValueError, match=r"not contiguous"):
        buffer.get_dispatch_layout(topk.t(), E)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        buffer.dispatch([1, 2], **layout)
    with pytest.raises(ValueError, match="expert_alignment = 0"):
        buffer.dispatch(x, **layout, expert_alignment=0)
    handle = good_call(group, device, buffer)

    other = pyep.Buffer(group, buffer.num_nvl_bytes)
    with pytest.raises(ValueError, match="handle: not returned by a dispatch of this buffer"):
        other.dispatch(x, handle=handle)
    with pytest.raises(ValueError, match="handle: not returned by a dispatch of this buffer"):
        other.combine(x, handle)
    with pytest.raises(ValueError, match="topk_idx, topk_weights: must be None with a handle"):
        buffer.dispatch(x, handle=handle, topk_idx=topk, topk_weights=w)
    # The core takes a handle's tensors as bare addresses: a tuple with a tensor the dispatch did not return is
    # refused, even with the dispatch's first tensor.
    forged = handle[:5] + (handle[5].clone(),)
    with pytest.raises(ValueError, match="handle: not returned by a dispatch of this buffer"):
        buffer.combine(x, forged)
    with pytest.raises(ValueError, match="handle: not returned by a dispatch of this buffer"):
        buffer.dispatch(x, handle=handle[:3] + (handle[3].clone(),) + handle[4:])
    good_call(group, device, buffer)

    # An index out of range inside dispatch is caught by the core before anything moves, on every rank.
    bad_topk = topk.clone()
    bad_topk[3, 2] = E + 5
    with pytest.raises(ValueError, match=r"topk_idx\[3,2\]"):
        buffer.dispatch(x, **layout, topk_idx=bad_topk, topk_weights=w)
    good_call(group, device, buffer)

    # num_worst_tokens smaller than what some rank receives: the same error everywhere.
    with pytest.raises(ValueError, match="num_worst_tokens"):
        buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w, num_worst_tokens=1)
    good_call(group, device, buffer)

    # A buffer too small for the config's rings says so before anything moves.
    small = pyep.Buffer(group, 1 << 12)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        small.dispatch(x, **layout)
    good_call(group, device, buffer)
    dist.barrier(group)


@pytest.mark.parametrize("queued", [True, False], ids=["queued", "notify_first"])
def test_dispatch_with_and_without_the_queued_data_phase(group, device, monkeypatch, queued):
    # By default the data phase is queued behind notify (PYEP_QUEUED_DISPATCH); both paths give the same rows.
    monkeypatch.setattr(pyep._normal, "_QUEUED_DISPATCH", queued)
    run_case(group, device, Case("random", tokens=200, hidden=512, seed=3))
    run_case(group, device, Case("all_to_one_rank", routing="one", tokens=64, hidden=512, seed=4))


def test_queued_dispatch_redoes_rows_that_do_not_fit(group, device):
    # Rank r has 8 + 40 r tokens, all for rank 0's experts: rank 0 receives more than num_ranks times its own
    # tokens, so its queued data phase does not run (on cuda, on no rank) and runs again into exact rows; the next
    # dispatch allocates what the first one needed and fits.
    R, me = group.size(), group.rank()
    if R < 2:
        pytest.skip("needs two ranks: one rank always fits its own tokens")
    hidden, K, E = 256, 2, 4 * R

    def tokens_of(r):
        g = torch.Generator().manual_seed(700 + r)
        T = 8 + 40 * r
        return torch.randn(T, hidden, generator=g).to(torch.bfloat16), torch.rand(T, K, generator=g)

    config = pyep.Buffer.get_dispatch_config(R)
    buffer = pyep.Buffer(group, config.get_nvl_buffer_size_hint(hidden * 2, R))
    x, w = on(device, tokens_of(me))
    topk = torch.tensor([[0, 1]], device=device).expand(x.size(0), K).contiguous()
    want = torch.cat([tokens_of(r)[0] for r in range(R)]) if me == 0 else torch.empty(0, hidden, dtype=torch.bfloat16)
    for _ in range(2):
        layout = layout_dict(buffer.get_dispatch_layout(topk, E))
        recv, recv_topk, recv_w, counts, handle, _ = buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w,
                                                                     config=config)
        assert torch.equal(recv.cpu(), want)
        assert recv_topk.shape == (want.size(0), K) and counts == ([want.size(0)] * 2 + [0, 0] if me == 0 else [0] * 4)
        assert torch.equal(handle[3].cpu(), torch.cat([torch.arange(8 + 40 * r) for r in range(R)]).int() if me == 0
                           else torch.empty(0, dtype=torch.int32))
        combined, _, _ = buffer.combine(recv, handle)
        assert torch.equal(combined.cpu(), x.cpu()), "each token went to one rank, so combine returns it unchanged"
    assert buffer._queued_rows == (want.size(0) if me == 0 else 0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_1000_calls_with_changing_shapes_flat_memory(group, device):
    R, me = group.size(), group.rank()
    config = pyep.Config(4, 2, 16, 6, 128)
    buffer = pyep.Buffer(group, config.get_nvl_buffer_size_hint(512 * 2, R))
    rss = []
    for i in range(1000):
        case = Case("loop", tokens=(i * 7) % 33, hidden=(64, 128, 512)[i % 3], topk=1 + i % 4, seed=i)
        x, topk, w = on(device, inputs(case, me, R))
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, case.experts_per_rank * R)
        recv, recv_topk, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, topk_weights=w, config=config)
        combined, _, _ = buffer.combine(recv, handle, config=config)
        if i % 97 == 0:
            assert torch.equal(recv.cpu(), expected_receive(case, me, R)[0])
        if i in (200, 999):
            rss.append(rss_bytes())
    assert rss[1] - rss[0] < 16 << 20, f"memory grew by {(rss[1] - rss[0]) >> 20} MiB over 800 calls"
