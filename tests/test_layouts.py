"""Every input DeepEP's normal mode takes, taken alike: FP8 scales column-major (DeepEP's own tests pass
`scales.T.contiguous().T`, DeepGEMM TMA-aligned ones) or int32, rows of any dtype, a handle as a list, DeepEP's
argument types for Buffer; and what pyep refuses, with the argument's name. Runs on the cpu backend and with
PYEP_TEST_DEVICE=cuda, against test_normal's reference."""
import weakref

import numpy as np
import pytest
import torch

import pyep
from conftest import TorchCalls
from test_normal import Case, buffer_for, expected_combine, expected_receive, expert_output, inputs, on


def layout_of(buffer, topk, E):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def expected_layout(topk, E, R):
    """get_dispatch_layout's outputs, from torch: tokens per rank, (token, choice) pairs per expert, token in rank."""
    t = topk.cpu()
    ranks = torch.where(t >= 0, t // (E // R), -1)
    in_rank = torch.stack([(ranks == r).any(1) for r in range(R)], 1)
    return in_rank.sum(0).int(), torch.bincount(t[t >= 0], minlength=E).int(), in_rank


def assert_layout(outs, topk, E, R):
    per_rank, _, per_expert, in_rank, _ = outs
    ref_rank, ref_expert, ref_in = expected_layout(topk, E, R)
    assert torch.equal(per_rank.cpu(), ref_rank) and torch.equal(per_expert.cpu(), ref_expert)
    assert torch.equal(in_rank.cpu(), ref_in)


def test_layout_outputs_written_again_only_when_nothing_holds_them(group, device):
    """The usual get_dispatch_layout writes the last one's tensors again when nothing else holds them (no reference,
    no tensor on their memory), instead of allocating; never while a reference, a view or a detached copy is held, nor
    on another stream."""
    R = group.size()
    E, T, K = 8 * R, 37, 4
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), 256)
    g = torch.Generator().manual_seed(100 + group.rank())

    def topk():
        return torch.randint(-1, E, (T, K), generator=g).to(device)

    t = topk()
    first = buffer.get_dispatch_layout(t, E)
    assert_layout(first, t, E, R)
    was = weakref.ref(first[0])
    del first
    t = topk()
    second = buffer.get_dispatch_layout(t, E)
    assert second[0] is was(), "dropped outputs were not written again"
    assert_layout(second, t, E, R)
    del second

    for name, hold in (("a tensor", lambda o: o[0]), ("a view", lambda o: o[3][:, 0]),
                       ("a detached tensor", lambda o: o[2].detach())):
        t = topk()
        outs = buffer.get_dispatch_layout(t, E)
        held, was = hold(outs), weakref.ref(outs[0])
        kept = held.clone()
        del outs
        t = topk()
        new = buffer.get_dispatch_layout(t, E)
        assert new[0] is not was(), f"outputs written again while {name} of them was held"
        assert torch.equal(held, kept), f"{name} of the last layout's outputs changed"
        assert_layout(new, t, E, R)
        del new, held
    if device.type == "cuda":
        was = weakref.ref(buffer.get_dispatch_layout(topk(), E)[0])
        with torch.cuda.stream(torch.cuda.Stream()):
            t = topk()
            other = buffer.get_dispatch_layout(t, E)
            assert other[0] is not was(), "outputs of one stream written again on another"
            assert_layout(other, t, E, R)
        torch.cuda.synchronize()


class RoundTrip:
    """A small dispatch and combine on the kept buffer of their size: the inputs, and `combines`, which checks that
    combining expert outputs with a handle gives the reference."""

    def __init__(self, group, device, name: str):
        self.case = case = Case(name, tokens=29, hidden=256)
        self.me, self.R = me, R = group.rank(), group.size()
        self.E = case.experts_per_rank * R
        self.buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
        self.x, self.topk, self.w = on(device, inputs(case, me, R))
        self.ref_combined, _ = expected_combine(case, me, R, ())

    def combines(self, y, recv_w, handle):
        combined, _, _ = self.buffer.combine(y, handle, topk_weights=recv_w)
        assert torch.equal(combined.cpu(), self.ref_combined)


def test_handle_block_written_again_only_when_nothing_holds_it(group, device):
    """The usual dispatch writes its handle into the last handle's int32 block when nothing holds that handle any more
    (no reference to its tensors, no tensor on their memory), instead of allocating; never while the handle or one of
    its tensors is held, nor on another stream; and every handle combines its own dispatch."""
    rt = RoundTrip(group, device, "handles")
    me, E, buffer, x, topk, w, combines = rt.me, rt.E, rt.buffer, rt.x, rt.topk, rt.w, rt.combines

    def dispatch():
        layout = layout_of(buffer, topk, E)
        # Then another layout: the dispatch's is not the last one, so its handle gets no room in the layout's memory
        # (test_layout_makes_room_for_the_next_dispatch) and goes in a block of its own, the one this test is about.
        buffer.get_dispatch_layout(topk, E)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
        return expert_output(recv_x, me), recv_w, handle

    y, recv_w, handle = dispatch()
    combines(y, recv_w, handle)
    was = handle[0].data_ptr()
    del handle
    y, recv_w, handle = dispatch()
    assert handle[0].data_ptr() == was, "a dropped handle's block was not written again"
    combines(y, recv_w, handle)
    for name, hold in (("the handle", lambda h: h), ("its send_head", lambda h: h[5]),
                       ("a view of its recv_src_idx", lambda h: h[3][1:])):
        held, kept = hold(handle), [t.clone() if isinstance(t, torch.Tensor) else t for t in handle]
        was = handle[0].data_ptr()
        del handle
        y2, recv_w2, handle = dispatch()
        assert handle[0].data_ptr() != was, f"a handle's block written again while {name} was held"
        combines(y2, recv_w2, handle)
        old = held if name == "the handle" else None
        if old is not None:
            assert all(not isinstance(t, torch.Tensor) or torch.equal(t, k) for t, k in zip(old, kept))
            combines(y, recv_w, old)
        del held, old
        y, recv_w = y2, recv_w2
    if device.type == "cuda":
        was = handle[0].data_ptr()
        del handle
        with torch.cuda.stream(torch.cuda.Stream()):
            y, recv_w, handle = dispatch()
            assert handle[0].data_ptr() != was, "a handle's block of one stream written again on another"
            combines(y, recv_w, handle)
        torch.cuda.synchronize()


def test_cached_dispatch_rows_written_again_only_when_dropped(group, device):
    """The usual cached dispatch writes its rows into the last one's block when nothing holds those rows any more,
    instead of allocating; never while they or a view of them are held, nor on another stream, nor after another call
    (a combine, a layout, a dispatch: the block is let go); and every call's rows are its own."""
    rt = RoundTrip(group, device, "cached")
    buffer, x = rt.buffer, rt.x
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=rt.topk, topk_weights=rt.w,
                                                 **layout_of(buffer, rt.topk, rt.E))
    want = recv_x.cpu()
    del recv_x

    def cached(scale):
        rows = buffer.dispatch(x * scale, handle=handle)[0]
        assert torch.equal(rows.cpu(), want * scale)
        return rows

    rows = cached(1)
    was = rows.data_ptr()
    del rows
    rows = cached(2)
    assert rows.data_ptr() == was, "a dropped cached dispatch's rows were not written again"
    for name, hold in (("the rows", lambda r: r), ("a view of them", lambda r: r[1:])):
        held = hold(rows)
        kept = held.clone()
        was = rows.data_ptr()
        del rows
        rows = cached(4)
        assert rows.data_ptr() != was, f"a cached dispatch's rows written again while {name} was held"
        assert torch.equal(held.cpu(), kept.cpu()), f"{name} changed"
        del held
    for name, call in (("a combine", lambda: rt.combines(expert_output(want.to(x.device), rt.me), None, handle)),
                       ("a layout", lambda: buffer.get_dispatch_layout(rt.topk, rt.E)),
                       ("a dispatch", lambda: buffer.dispatch(x, topk_idx=rt.topk, topk_weights=rt.w,
                                                              **layout_of(buffer, rt.topk, rt.E)))):
        del rows
        assert buffer._cached_block is not None
        call()
        assert buffer._cached_block is None, f"a cached dispatch's rows kept past {name}"
        rows = cached(1)
    if device.type == "cuda":
        was = rows.data_ptr()
        del rows
        with torch.cuda.stream(torch.cuda.Stream()):
            rows = cached(1)
            assert rows.data_ptr() != was, "a cached dispatch's rows of one stream written again on another"
        torch.cuda.synchronize()


def test_layout_makes_room_for_the_next_dispatch(group, device):
    """After a usual dispatch, the usual get_dispatch_layout makes room in its own memory for the int32s of the next
    dispatch's handle and allocates that dispatch's rows after its launch, so that a dispatch with this layout
    allocates nothing. The room serves one handle at a time (a second dispatch with the same layout while the first
    handle is held gets a block of its own), and the rows ahead are let go by any dispatch that does not match them
    (other shape, num_worst_tokens, async_finish, cached); every handle still combines its own dispatch."""
    rt = RoundTrip(group, device, "room")
    case, me, R, E, buffer, x, topk, w = rt.case, rt.me, rt.R, rt.E, rt.buffer, rt.x, rt.topk, rt.w

    def combines(recv_x, recv_w, handle):
        rt.combines(expert_output(recv_x, me), recv_w, handle)

    def storage(t):
        return t.untyped_storage().data_ptr()

    fresh = pyep.Buffer(group, pyep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(case.hidden * 2, R),
                        explicitly_destroy=True)
    try:
        fresh.get_dispatch_layout(topk, E)
        assert fresh._rows_ahead is None, "rows allocated ahead before any dispatch"
    finally:
        fresh.destroy()
    layout = layout_of(buffer, topk, E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    combines(recv_x, recv_w, handle)
    del recv_x, recv_w, handle, layout

    layout = layout_of(buffer, topk, E)
    ahead = storage(buffer._rows_ahead[0])
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    assert buffer._rows_ahead is None
    assert storage(recv_x) == ahead, "the dispatch did not take the rows its layout allocated ahead"
    in_rank = layout["is_token_in_rank"]
    assert all(storage(handle[i]) == storage(in_rank) for i in (0, 1, 2, 3, 5)), "handle not in its layout's room"
    kept = [t.clone() for t in handle if isinstance(t, torch.Tensor)]
    # The same layout again while that handle is held: a block of its own, and the first handle unchanged.
    recv_x2, _, recv_w2, _, handle2, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    assert storage(handle2[0]) != storage(in_rank), "the layout's room written while a handle in it was held"
    assert all(torch.equal(a, b) for a, b in zip([t for t in handle if isinstance(t, torch.Tensor)], kept))
    combines(recv_x2, recv_w2, handle2)
    combines(recv_x, recv_w, handle)
    # Once both handles are dropped, the room serves the next dispatch with that layout.
    del recv_x, recv_w, handle, recv_x2, recv_w2, handle2, kept
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    assert storage(handle[0]) == storage(in_rank)
    combines(recv_x, recv_w, handle)

    # Rows ahead that do not match are let go, and the call allocates as before.
    others = [("another hidden size", lambda lay: buffer.dispatch(x[:, :128].contiguous(), topk_idx=topk,
                                                                     topk_weights=w, **lay)),
              ("num_worst_tokens", lambda lay: buffer.dispatch(x, topk_idx=topk, topk_weights=w,
                                                                num_worst_tokens=R * case.tokens, **lay)),
              ("a cached dispatch", lambda lay: buffer.dispatch(x, handle=handle)),
              ("async_finish", lambda lay: buffer.dispatch(x, topk_idx=topk, topk_weights=w, async_finish=True,
                                                            **lay))]
    for name, call in others:
        del layout
        layout = layout_of(buffer, topk, E)
        assert buffer._rows_ahead is not None, f"no rows ahead before {name}"
        ahead = buffer._rows_ahead[0]  # held here, so that memory let go cannot come back as the call's rows
        out = call(layout)
        recv = out[0][0] if isinstance(out[0], tuple) else out[0]
        assert buffer._rows_ahead is None, f"rows ahead kept after {name}"
        assert storage(recv) != storage(ahead), f"rows ahead used by {name}"
        if name == "async_finish":
            out[5].current_stream_wait()
        del out, recv, ahead
        # The usual dispatch comes back to the usual rows.
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
        combines(recv_x, recv_w, handle)


def test_dispatch_allocates_the_next_combines_outputs(group, device):
    """After a usual combine, the usual dispatch (cached or not) allocates, after its launch, the outputs of the combine
    like it (the dispatch's tokens and hidden size, the combine's dtype and weights, the same stream), and that
    combine returns them instead of allocating; a combine that does not match them (no weights, async_finish) lets
    them go and allocates as before. Every combine gives the reference."""
    rt = RoundTrip(group, device, "combine-ahead")
    me, E, buffer, x, topk, w = rt.me, rt.E, rt.buffer, rt.x, rt.topk, rt.w

    def storage(t):
        return t.untyped_storage().data_ptr()

    fresh = pyep.Buffer(group, pyep.Buffer.get_dispatch_config(rt.R).get_nvl_buffer_size_hint(rt.case.hidden * 2, rt.R),
                        explicitly_destroy=True)
    try:
        recv_x, _, recv_w, _, handle, _ = fresh.dispatch(x, topk_idx=topk, topk_weights=w, **layout_of(fresh, topk, E))
        assert fresh._combine_ahead is None, "a combine's outputs allocated before any combine"
        del recv_x, recv_w, handle
    finally:
        fresh.destroy()
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout_of(buffer, topk, E))
    y = expert_output(recv_x, me)
    rt.combines(y, recv_w, handle)  # the usual combine, with weights: what the next dispatch prepares for

    for name, dispatch in (("a dispatch", lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=w,
                                                                    **layout_of(buffer, topk, E))),
                           ("a cached dispatch", lambda: buffer.dispatch(x, handle=handle))):
        dispatch()
        assert buffer._combine_ahead is not None, f"nothing allocated ahead by {name}"
        ahead = buffer._combine_ahead[0]  # held, so that a new allocation cannot land on the same memory
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
        assert buffer._combine_ahead is None
        assert storage(combined) == storage(ahead) == storage(combined_w), f"the combine after {name} allocated"
        assert torch.equal(combined.cpu(), rt.ref_combined)
        del ahead, combined, combined_w

    others = [("no weights", lambda: buffer.combine(y, handle)),
              ("async_finish", lambda: buffer.combine(y, handle, topk_weights=recv_w, async_finish=True))]
    for name, combine in others:
        buffer.dispatch(x, handle=handle)
        ahead = buffer._combine_ahead[0]
        combined, _, event = combine()
        if name == "async_finish":
            event.current_stream_wait()
        assert buffer._combine_ahead is None, f"outputs ahead kept after a combine with {name}"
        assert storage(combined) != storage(ahead), f"outputs ahead used by a combine with {name}"
        assert torch.equal(combined.cpu(), rt.ref_combined)
        del ahead, combined


def test_calls_run_without_torch_function_modes(group, device):
    """Under a torch function mode (torch.set_default_device's, in DeepEP's tests) the layout, dispatch, cached
    dispatch and combine route no torch call through it (each would cost microseconds of Python), and return what
    they return without it."""
    case = Case("modes", tokens=29, hidden=256)
    me, R = group.rank(), group.size()
    E = case.experts_per_rank * R
    config = pyep.Buffer.get_dispatch_config(R)
    buffer = buffer_for(group, config, case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    ref_x, _, ref_topk, ref_w, _, ref_counts = expected_receive(case, me, R)
    with TorchCalls() as calls:
        layout = buffer.get_dispatch_layout(topk, E)
        recv_x, recv_topk, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=topk, topk_weights=w, config=config)
        again, *_ = buffer.dispatch(x, handle=handle, config=config)
    assert calls.seen == []
    y = expert_output(recv_x, me)
    with TorchCalls() as calls:
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, config=config)
    assert calls.seen == []
    assert_layout(layout, topk, E, R)
    assert torch.equal(recv_x.cpu(), ref_x) and torch.equal(recv_topk.cpu(), ref_topk)
    assert torch.equal(recv_w.cpu(), ref_w) and counts == ref_counts
    assert torch.equal(again.cpu(), ref_x)
    ref_combined, ref_weights = expected_combine(case, me, R, ())
    assert torch.equal(combined.cpu(), ref_combined) and torch.equal(combined_w.cpu(), ref_weights)


def column_major(scales, pad=0):
    """scales [T, S] column-major, each column padded to T + pad (garbage there), as DeepGEMM aligns them for TMA."""
    T, S = scales.shape
    cols = torch.full((S, T + pad), -7.0, dtype=scales.dtype, device=scales.device)
    cols[:, :T] = scales.T
    return cols.T[:T]


SCALE_LAYOUTS = {
    "column_major": lambda s: s.T.contiguous().T,
    "column_major_tma_padded": lambda s: column_major(s, pad=-s.size(0) % 4 + 4),
    "int32": lambda s: s.view(torch.int32),
    "int32_column_major": lambda s: s.view(torch.int32).T.contiguous().T,
    "padded_rows": lambda s: torch.cat([s, torch.zeros_like(s)], 1)[:, :s.size(1)],
}


@pytest.mark.parametrize("name", sorted(SCALE_LAYOUTS))
def test_fp8_scales_layouts_move_as_row_major(group, device, name):
    case = Case("fp8_layouts", tokens=45, hidden=512, fp8=True)
    me, R = group.rank(), group.size()
    E = case.experts_per_rank * R
    config = pyep.Buffer.get_dispatch_config(R)
    buffer = buffer_for(group, config, case.hidden * 2)
    (x, scales), topk, w = on(device, inputs(case, me, R))
    scales_in = SCALE_LAYOUTS[name](scales)
    if name.endswith("column_major") or name.endswith("padded"):
        assert scales_in.stride()[0] == 1 and not scales_in.is_contiguous()
    layout = layout_of(buffer, topk, E)
    ref_x, ref_scales, ref_topk, ref_w, _, ref_counts = expected_receive(case, me, R)
    n = ref_x.size(0)

    (recv_x, recv_scales), recv_topk, recv_w, counts, handle, _ = buffer.dispatch(
        (x, scales_in), **layout, topk_idx=topk, topk_weights=w, config=config)
    assert torch.equal(recv_x.cpu().view(torch.uint8), ref_x.view(torch.uint8))
    # Received scales are row-major, of the scales' dtype, as DeepEP's.
    assert recv_scales.dtype == scales_in.dtype and recv_scales.shape == (n, scales.size(1)) and recv_scales.is_contiguous()
    assert torch.equal(recv_scales.cpu().view(torch.float32), ref_scales)
    assert torch.equal(recv_topk.cpu(), ref_topk) and torch.equal(recv_w.cpu(), ref_w) and counts == ref_counts

    # Cached dispatch reads the same layout, and combine returns every token.
    (again_x, again_scales), *_ = buffer.dispatch((x, scales_in), handle=handle, config=config)
    assert torch.equal(again_x.cpu().view(torch.uint8), ref_x.view(torch.uint8))
    assert torch.equal(again_scales.cpu().view(torch.float32), ref_scales)
    y = on(device, expert_output(recv_x.cpu().float().to(torch.bfloat16), me))
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, config=config)
    ref_combined, ref_weights = expected_combine(case, me, R, ())
    assert torch.equal(combined.cpu(), ref_combined) and torch.equal(combined_w.cpu(), ref_weights)


def test_fp8_scales_other_strides_refused(group, device):
    case = Case("fp8_strides", tokens=45, hidden=512, fp8=True)
    me, R = group.rank(), group.size()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    (x, scales), topk, w = on(device, inputs(case, me, R))
    layout = layout_of(buffer, topk, case.experts_per_rank * R)
    every_other = torch.cat([scales, scales], 1)[:, ::2]
    with pytest.raises(ValueError, match=r"x\[1\]: strides \(8, 2\) for shape \[45, 4\]: expected row-major \(4, 1\) or "
                                         r"column-major \(1, 45\) scales"):
        buffer.dispatch((x, every_other), **layout)
    with pytest.raises(ValueError, match=r"x\[1\]: dtype torch.float16, expected torch.float32 or torch.int32"):
        buffer.dispatch((x, scales.half()), **layout)
    with pytest.raises(ValueError, match=r"x\[0\]: dtype torch.bfloat16, expected 1-byte elements with scales"):
        buffer.dispatch((x.to(torch.bfloat16), scales), **layout)
    with pytest.raises(ValueError, match=r"x: a tuple of 3, expected a tensor or the pair \(x, x_scales\)"):
        buffer.dispatch((x, scales, scales), **layout)


def expected_rows(case, me, R, make):
    """The rows of make(src) [T, *] that rank me receives, in dispatch's order."""
    rows = []
    for src in range(R):
        _, topk, _ = inputs(case, src, R)
        epr = case.experts_per_rank
        rows.append(make(src)[((topk >= me * epr) & (topk < (me + 1) * epr)).any(1)])
    return torch.cat(rows)


ROW_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float64]


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
def test_rows_of_any_dtype_move_as_bytes(group, device, dtype):
    """DeepEP's dispatch copies rows as bytes: per-token metadata rides along, often by cached dispatch."""
    case = Case("any_dtype", tokens=40)
    me, R = group.rank(), group.size()
    config = pyep.Buffer.get_dispatch_config(R)
    buffer = buffer_for(group, config, case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))

    def make(src):
        g = torch.Generator().manual_seed(100 + src)
        raw = torch.randint(0, 256, (case.tokens, 48), generator=g, dtype=torch.uint8)
        return (raw & 1 if dtype == torch.bool else raw).view(dtype)  # indexing makes bools 0 or 1

    layout = layout_of(buffer, topk, case.experts_per_rank * R)
    recv, _, _, _, handle, _ = buffer.dispatch(make(me).to(device), **layout, topk_idx=topk, topk_weights=w, config=config)
    want = expected_rows(case, me, R, make)
    assert recv.dtype == dtype and torch.equal(recv.cpu().view(torch.uint8), want.view(torch.uint8))
    # The handle as a list, as DeepEP unpacks any 6 elements.
    cached, *_ = buffer.dispatch(make(me).to(device), handle=list(handle), config=config)
    assert torch.equal(cached.cpu().view(torch.uint8), want.view(torch.uint8))
    y, *_ = buffer.dispatch(x, handle=handle, config=config)
    combined, _, _ = buffer.combine(y, list(handle), config=config)
    assert combined.shape == x.shape


def test_topk_idx_int32_refused_with_the_dtype_to_use(group, device):
    case = Case("int32", tokens=16)
    me, R = group.rank(), group.size()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    E = case.experts_per_rank * R
    hint = r"topk_idx: dtype torch.int32, expected torch.int64 \(pyep.topk_idx_t, as DeepEP's default build"
    with pytest.raises(ValueError, match=hint):
        buffer.get_dispatch_layout(topk.int(), E)
    with pytest.raises(ValueError, match=hint):
        buffer.dispatch(x, **layout_of(buffer, topk, E), topk_idx=topk.int(), topk_weights=w)


def test_num_tokens_per_rdma_rank_ignored_within_one_domain(group, device):
    case = Case("rdma_rank", tokens=16)
    me, R = group.rank(), group.size()
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(R), case.hidden * 2)
    x, topk, w = on(device, inputs(case, me, R))
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, case.experts_per_rank * R)
    assert per_rdma is None
    recv, *_ = buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rank[:1].clone(),
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert torch.equal(recv.cpu(), expected_receive(case, me, R)[0])


def test_across_domains_dispatch_and_combine_go_to_internode(group, device, monkeypatch):
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(group.size()), 256 * 2)
    monkeypatch.setattr(buffer, "_multi_domain", True)
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=device)
    with pytest.raises(pyep.NotAvailableError, match=r"^Buffer\.internode_dispatch: normal mode across NVLink domains"):
        buffer.dispatch(x)
    with pytest.raises(pyep.NotAvailableError, match=r"^Buffer\.internode_combine: "):
        buffer.combine(x, ())


def test_buffer_takes_deepep_argument_types(group):
    # numpy integers and 0/1 flags pass DeepEP's binding; pyep takes them too.
    buffer = pyep.Buffer(group, np.int64(1 << 20), explicitly_destroy=np.bool_(True), allow_mnnvl=1)
    assert buffer.num_nvl_bytes == 1 << 20 and type(buffer.num_nvl_bytes) is int and buffer.explicitly_destroy is True
    buffer.destroy()


def test_buffer_refuses_what_it_cannot_do_by_name(group):
    with pytest.raises(ValueError, match=r"enable_shrink=True: .* expected low_latency_mode=True"):
        pyep.Buffer(group, 1 << 20, enable_shrink=True)
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup or None, got str"):
        pyep.Buffer("world", 1 << 20)
    with pytest.raises(TypeError, match=r"comm must be an mpi4py communicator .* got object"):
        pyep.Buffer(None, 1 << 20, comm=object())
    with pytest.raises(TypeError, match=r"num_nvl_bytes must be an int, got float"):
        pyep.Buffer(group, 1.5e6)
    with pytest.raises(TypeError, match=r"use_fabric must be a bool, got 'yes'"):
        pyep.Buffer(group, 1 << 20, use_fabric="yes")


def test_nvlink_domain_spanning_machines_raises(group, monkeypatch):
    """allow_mnnvl=True on one machine needs nothing; a domain across machines needs MNNVL, which pyep lacks."""
    buffer = buffer_for(group, pyep.Buffer.get_dispatch_config(group.size()), 256 * 2)
    monkeypatch.setattr(buffer.runtime, "_num_nvl_ranks", 4)
    one = [("boot-a", "h1")] * 4
    containers = [("boot-a", f"pod{i}") for i in range(4)]  # one kernel: one machine
    buffer._check_hosts(one + [("boot-b", "h2")] * 4, True)
    buffer._check_hosts(containers, False)
    spread = [("boot-a", "h1")] * 2 + [("boot-b", "h2")] * 2
    with pytest.raises(pyep.NotAvailableError, match=r"^Buffer\.__init__: allow_mnnvl=True: ranks 0-3, one NVLink domain, "
                                                     r"run on 2 machines \(h1, h2\): multi-node NVLink \(MNNVL\) is not"):
        buffer._check_hosts(spread, True)
    with pytest.raises(pyep.PyepError, match=r"ranks 0-3, one NVLink domain, run on 2 machines \(h1, h2\); pyep needs"):
        buffer._check_hosts(spread, False)
    # Without a boot id, host names decide.
    buffer._check_hosts([(None, "h1")] * 4, True)
    with pytest.raises(pyep.PyepError, match="run on 2 machines"):
        buffer._check_hosts([(None, "h1"), ("boot-a", "h1"), (None, "h2"), (None, "h2")], False)
