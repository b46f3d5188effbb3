"""Every mistake in an argument of get_dispatch_layout, dispatch, cached dispatch and combine raises ValueError (or
TypeError) naming the argument and what was expected, before anything is launched; the next call works.

The core checks the arguments (the Python layer only reads tensors into integers), with the messages that the
Python checks raised before. Every rank makes the same mistake, so no rank waits for another."""
import pytest
import torch
import torch.distributed as dist

import pyep
from test_normal import Case, buffer_for, good_call, inputs, layout_dict, on


@pytest.fixture(scope="module")
def setup(group, device):
    R, me = group.size(), group.rank()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), 256 * 2)
    case = Case("args", tokens=32)
    x, topk, w = on(device, inputs(case, me, R))
    E = case.experts_per_rank * R
    layout = layout_dict(buffer.get_dispatch_layout(topk, E))
    handle = good_call(group, device, buffer)
    return buffer, x, topk, w, E, layout, handle


def last_launch(buffer):
    from pyep import _core
    return _core.call("BufferLastLaunchNs", buffer.runtime.id) if buffer.runtime.backend == "cuda" else 0


def layout_calls(device, R, x, topk, w, E, layout):
    T = topk.size(0)
    return [
        ("topk_idx: dtype torch.int32, expected torch.int64", ValueError, lambda b: b.get_dispatch_layout(topk.int(), E)),
        (r"topk_idx: shape \[32\], expected \[\*, \*\]", ValueError, lambda b: b.get_dispatch_layout(topk[:, 0], E)),
        (r"topk_idx: shape \[2, 16, \.\.\.\], expected \[\*, \*\]", ValueError,
         lambda b: b.get_dispatch_layout(topk.view(2, 16, -1), E)),
        ("topk_idx must be a torch.Tensor, got NoneType", TypeError, lambda b: b.get_dispatch_layout(None, E)),
        ("topk_idx must be a torch.Tensor, got list", TypeError, lambda b: b.get_dispatch_layout([[0]], E)),
        (rf"topk_idx: on meta, expected {device} \(the buffer's device\)", ValueError,
         lambda b: b.get_dispatch_layout(topk.to("meta"), E)),
        (r"topk_idx: not contiguous; pass topk_idx.contiguous\(\)", ValueError,
         lambda b: b.get_dispatch_layout(topk.t().contiguous().t(), E)),
        ("num_experts = 0: expected an int >= 1", ValueError, lambda b: b.get_dispatch_layout(topk, 0)),
        (r"num_experts = 1.5: expected an int >= 1", ValueError, lambda b: b.get_dispatch_layout(topk, 1.5)),
        ("allocate_on_comm_stream=True needs previous_event and async_finish=True", ValueError,
         lambda b: b.get_dispatch_layout(topk, E, allocate_on_comm_stream=True)),
        ("previous_event must be an EventOverlap or None, got int", TypeError,
         lambda b: b.get_dispatch_layout(topk, E, previous_event=1)),
    ]


def dispatch_calls(device, R, x, topk, w, E, layout):
    T = x.size(0)
    fp8 = (x.to(torch.float8_e4m3fn), torch.rand(T, 2, device=device))
    no = dict(layout)
    no["num_tokens_per_rank"] = None
    bad_rank = dict(layout, num_tokens_per_rank=layout["num_tokens_per_rank"][:0])
    bad_expert = dict(layout, num_tokens_per_expert=layout["num_tokens_per_expert"].long())
    no_experts = dict(layout, num_tokens_per_expert=layout["num_tokens_per_expert"][:0])
    meta_in_rank = dict(layout, is_token_in_rank=layout["is_token_in_rank"].to("meta"))
    return [
        (r"x: dtype torch.complex64, expected a real, integer or bool dtype \(rows move as bytes\)", ValueError,
         lambda b: b.dispatch(x.to(torch.complex64), **layout)),
        (r"x: shape \[8192\], expected \[\*, \*\]", ValueError, lambda b: b.dispatch(x.flatten(), **layout)),
        ("x must be a torch.Tensor, got NoneType", TypeError, lambda b: b.dispatch(None, **layout)),
        (r"x\[0\]: dtype torch.bfloat16, expected 1-byte elements with scales \(torch.float8_e4m3fn\)", ValueError,
         lambda b: b.dispatch((x, fp8[1]), **layout)),
        (r"x\[1\]: dtype torch.float16, expected torch.float32 or torch.int32", ValueError,
         lambda b: b.dispatch((fp8[0], fp8[1].half()), **layout)),
        (rf"x\[1\]: shape \[16, 2\], expected \[{T}, \*\]", ValueError,
         lambda b: b.dispatch((fp8[0], fp8[1][:16]), **layout)),
        (rf"x\[1\]: strides \(4, 2\) for shape \[{T}, 2\]: expected row-major \(2, 1\) or column-major \(1, {T}\)", ValueError,
         lambda b: b.dispatch((fp8[0], torch.rand(T, 4, device=device)[:, ::2]), **layout)),
        ("num_tokens_per_rank: required without a handle \\(from get_dispatch_layout\\)", ValueError,
         lambda b: b.dispatch(x, **no)),
        (rf"num_tokens_per_rank: shape \[0\], expected \[{R}\]", ValueError, lambda b: b.dispatch(x, **bad_rank)),
        ("num_tokens_per_expert: dtype torch.int64, expected torch.int32", ValueError,
         lambda b: b.dispatch(x, **bad_expert)),
        (rf"num_tokens_per_expert: 0 experts, expected a positive multiple of num_ranks = {R}", ValueError,
         lambda b: b.dispatch(x, **no_experts)),
        (rf"is_token_in_rank: on meta, expected {device}", ValueError, lambda b: b.dispatch(x, **meta_in_rank)),
        (rf"is_token_in_rank: shape \[16, {R}\], expected \[32, {R}\]", ValueError,
         lambda b: b.dispatch(x, **dict(layout, is_token_in_rank=layout["is_token_in_rank"][:16]))),
        ("topk_idx, topk_weights: pass both or neither", ValueError, lambda b: b.dispatch(x, **layout, topk_idx=topk)),
        ("topk_idx: dtype torch.int32, expected torch.int64", ValueError,
         lambda b: b.dispatch(x, **layout, topk_idx=topk.int(), topk_weights=w)),
        (r"topk_weights: shape \[32, 3\], expected \[32, 8\]", ValueError,
         lambda b: b.dispatch(x, **layout, topk_idx=topk, topk_weights=w[:, :3].contiguous())),
        (r"topk_weights: not contiguous; pass topk_weights.contiguous\(\)", ValueError,
         lambda b: b.dispatch(x, **layout, topk_idx=topk, topk_weights=w.t().contiguous().t())),
        ("expert_alignment = 0: expected an int >= 1", ValueError, lambda b: b.dispatch(x, **layout, expert_alignment=0)),
        ("expert_alignment = 1.5: expected an int >= 1", ValueError,
         lambda b: b.dispatch(x, **layout, expert_alignment=1.5)),
        ("num_worst_tokens = -1: expected an int >= 0", ValueError, lambda b: b.dispatch(x, **layout, num_worst_tokens=-1)),
        ("num_worst_tokens = None: expected an int >= 0", ValueError,
         lambda b: b.dispatch(x, **layout, num_worst_tokens=None)),
        ("config must be a pyep.Config, got tuple", TypeError, lambda b: b.dispatch(x, **layout, config=(20, 6, 256, 6, 128))),
        ("allocate_on_comm_stream=True needs previous_event and async_finish=True", ValueError,
         lambda b: b.dispatch(x, **layout, previous_event=pyep.Buffer.capture(), allocate_on_comm_stream=True)),
    ]


def cached_and_combine_calls(device, R, x, topk, w, E, handle):
    rows = handle[3].size(0)
    y = torch.zeros(rows, x.size(1), dtype=x.dtype, device=device)
    other = pyep.Config(4, 2, 16, 6, 128)
    return [
        (rf"handle is_token_in_rank: shape \[32, {R}\], expected \[16, {R}\]", ValueError,
         lambda b: b.dispatch(x[:16], handle=handle)),
        ("config: 2 channels, the handle's dispatch used 10", ValueError,
         lambda b: b.dispatch(x, handle=handle, config=other)),
        (r"x: dtype torch.float8_e4m3fn, expected torch.bfloat16 or torch.float16 or torch.float32", ValueError,
         lambda b: b.combine(y.to(torch.float8_e4m3fn), handle)),
        (rf"x: {rows - 1} rows, expected the dispatch's {rows} received rows", ValueError,
         lambda b: b.combine(y[1:], handle)),
        (r"config: 2 channels, the handle's dispatch used 10 \(num_sms = 20\)", ValueError,
         lambda b: b.combine(y, handle, config=other)),
        (rf"topk_weights: shape \[{rows + 1}, 8\], expected \[{rows}, \*\]", ValueError,
         lambda b: b.combine(y, handle, topk_weights=torch.zeros(rows + 1, 8, device=device))),
        (r"bias\[0\]: dtype torch.float32, expected torch.bfloat16", ValueError,
         lambda b: b.combine(y, handle, bias=torch.zeros(32, x.size(1), device=device))),
        (rf"bias\[1\]: shape \[31, {x.size(1)}\], expected \[32, {x.size(1)}\]", ValueError,
         lambda b: b.combine(y, handle, bias=(x, x[1:]))),
        ("bias: expected None, a tensor or a pair of tensors, got 3 tensors", ValueError,
         lambda b: b.combine(y, handle, bias=(x, x, x))),
        ("x must be a torch.Tensor, got NoneType", TypeError, lambda b: b.combine(None, handle)),
        ("handle: expected the 6-tuple returned by this buffer's dispatch", ValueError, lambda b: b.combine(y, handle[:5])),
    ]


def check_all(group, buffer, calls):
    for message, kind, call in calls:
        before = last_launch(buffer)
        with pytest.raises(kind, match=message):
            call(buffer)
        assert last_launch(buffer) == before, f"{message}: launched before raising"


def test_layout_arguments(group, device, setup):
    buffer, x, topk, w, E, layout, _ = setup
    check_all(group, buffer, layout_calls(device, group.size(), x, topk, w, E, layout))
    good_call(group, device, buffer)
    dist.barrier(group)


def test_dispatch_arguments(group, device, setup):
    buffer, x, topk, w, E, layout, _ = setup
    check_all(group, buffer, dispatch_calls(device, group.size(), x, topk, w, E, layout))
    good_call(group, device, buffer)
    dist.barrier(group)


def test_cached_dispatch_and_combine_arguments(group, device, setup):
    buffer, x, topk, w, E, _, handle = setup
    check_all(group, buffer, cached_and_combine_calls(device, group.size(), x, topk, w, E, handle))
    good_call(group, device, buffer)
    dist.barrier(group)


def test_layout_tensors_changed_in_place_are_read_again(group, device, setup):
    # A dispatch takes the descriptions of the tensors the last layout took and returned while they are unchanged
    # (the same objects, their version counters unmoved); a tensor changed in place since is read again.
    buffer, x, topk, w, E, _, _ = setup
    layout = layout_dict(buffer.get_dispatch_layout(topk, E))
    layout["num_tokens_per_expert"].unsqueeze_(0)
    with pytest.raises(ValueError, match=rf"num_tokens_per_expert: shape \[1, {E}\], expected \[\*\]"):
        buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
    mine = topk.clone()
    layout = layout_dict(buffer.get_dispatch_layout(mine, E))
    mine.t_()
    with pytest.raises(ValueError, match=r"topk_idx: shape \[8, 32\], expected \[32, \*\]"):
        buffer.dispatch(x, **layout, topk_idx=mine, topk_weights=w)
    mine.t_()
    with pytest.raises(ValueError, match=r"topk_idx: not contiguous"):
        buffer.dispatch(x, **layout, topk_idx=mine.t().contiguous().t(), topk_weights=w)
    # Values written in place: read again, the dispatch works.
    layout["num_tokens_per_rank"].add_(0)
    recv, *_ = buffer.dispatch(x, **layout, topk_idx=mine, topk_weights=w)
    good_call(group, device, buffer)
    dist.barrier(group)


def test_fp8_dispatch_without_config_takes_the_tuned_fp8_entry(group, device, setup, monkeypatch, tmp_path):
    # A dispatch of FP8 rows without a config runs with the tuning file's dispatch_fp8 entry for Buffer.num_sms (the
    # BF16 dispatch keeps its own); here an entry whose receive chunk is too large for the buffer shows which it took.
    from pyep import tuning
    buffer, x, topk, w, E, layout, _ = setup
    R, H, sms = group.size(), x.size(1), pyep.Buffer.num_sms
    cfg = pyep.Buffer.get_dispatch_config(R)
    big = (sms, cfg.num_max_nvl_chunked_send_tokens, 8 * cfg.num_max_nvl_chunked_recv_tokens, 6, 128)
    table = tuning.make_table(R, tuning.device_name(), {(H, "dispatch_fp8"): {big: (1.0, 1.0)}}, default_hidden=H,
                              source={"tokens": [x.size(0)]})
    monkeypatch.setenv(tuning.ENV_FILE, str(tmp_path / "tuning.json"))
    tuning.save(table)
    try:
        fp8 = (x.to(torch.float8_e4m3fn), torch.rand(x.size(0), H // 128, device=device))
        with pytest.raises(ValueError, match=rf"num_nvl_bytes = \d+ is too small: .*num_max_nvl_chunked_recv_tokens={big[2]}"):
            buffer.dispatch(fp8, **layout, topk_idx=topk, topk_weights=w)
        buffer.dispatch(x, **layout, topk_idx=topk, topk_weights=w)  # BF16: the dispatch table's config
    finally:
        (tmp_path / "tuning.json").unlink()
        tuning.clear_cache()
    buffer.dispatch(fp8, **layout, topk_idx=topk, topk_weights=w)  # no file: the dispatch's config again
    good_call(group, device, buffer)
    dist.barrier(group)
