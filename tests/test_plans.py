"""A layer's dispatch planned by its layout and its combine by its dispatch (python/pyep/_ahead.py,
goep/normal_plan.go): the usual layer's calls after the first run planned and return what the unplanned calls return;
any call that is not the one planned runs unplanned, and a plan serves one call. Runs on the cpu backend and with
PYEP_TEST_DEVICE=cuda."""
import contextlib

import pytest
import torch

import pyep
from pyep import _ahead, _core
from test_layouts import layout_of
from test_normal import Case, expected_combine, expert_output, inputs, on


@contextlib.contextmanager
def counted(*names):
    """Counts the calls of the core's exports `names` (pyep._core.go's), passing them through."""
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(_core.go, n) for n in names}

    def wrap(name):
        def call(*args):
            counts[name] += 1
            return saved[name](*args)
        return call

    for n in names:
        setattr(_core.go, n, wrap(n))
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(_core.go, n, f)


class Layer:
    """A fresh buffer (no call before: nothing planned) and one rank's inputs, BF16 and FP8, with the references."""

    def __init__(self, group, device, name):
        self.me, self.R = group.rank(), group.size()
        self.case = Case(name, tokens=29, hidden=256)
        self.fp8_case = Case(name, tokens=29, hidden=256, fp8=True)
        self.E = self.case.experts_per_rank * self.R
        size = pyep.Buffer.get_dispatch_config(self.R).get_nvl_buffer_size_hint(self.case.hidden * 2, self.R)
        self.buffer = pyep.Buffer(group, size, explicitly_destroy=True)
        self.x, self.topk, self.w = on(device, inputs(self.case, self.me, self.R))
        self.x_fp8, _, _ = on(device, inputs(self.fp8_case, self.me, self.R))
        self.ref_combined, _ = expected_combine(self.case, self.me, self.R, ())
        self.ref_fp8, _ = expected_combine(self.fp8_case, self.me, self.R, ())

    def dispatch(self, x, **kw):
        recv_x, recv_idx, recv_w, counts, handle, self.event = self.buffer.dispatch(
            x, topk_idx=self.topk, topk_weights=self.w, **layout_of(self.buffer, self.topk, self.E), **kw)
        return recv_x, recv_idx, recv_w, counts, handle

    def combine(self, recv_x, recv_w, handle, **kw):
        """Combines the expert outputs of recv_x (FP8 rows: of their BF16 values, unscaled) and checks the result."""
        fp8 = isinstance(recv_x, tuple)
        y = expert_output(recv_x[0].to(torch.bfloat16) if fp8 else recv_x, self.me)
        combined, combined_w, _ = self.buffer.combine(y, handle, topk_weights=recv_w, **kw)
        assert torch.equal(combined.cpu(), self.ref_fp8 if fp8 else self.ref_combined)
        return combined_w


def same(a, b, what):
    """Equal outputs of a dispatch (tensors, tuples of them, lists), compared on the host."""
    if isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (u, v) in enumerate(zip(a, b)):
            same(u, v, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert torch.equal(a.cpu().view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a.cpu(),
                           b.cpu().view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b.cpu()), what
    else:
        assert a == b, what


def test_layer_runs_planned(group, device):
    """A model's layers: layout, dispatch, combine. From the second layer on the dispatch and the combine run planned,
    and every output equals the first (unplanned) layer's, BF16 and FP8 (whose first dispatch after a BF16 one has
    nothing planned for its kind)."""
    layer = Layer(group, device, "plans-layers")
    try:
        for x in (layer.x, layer.x_fp8):
            names = ("DispatchQueued", "DispatchPlanned", "Combine", "CombinePlanned")
            with counted(*names) as n:
                first, first_w = None, None
                for i in range(4):
                    out = layer.dispatch(x)
                    combined_w = layer.combine(out[0], out[2], out[4])
                    if first is None:
                        first, first_w = [host(o) for o in out], combined_w.cpu()
                    else:
                        same([host(o) for o in out], first, f"layer {i}'s dispatch")
                        assert torch.equal(combined_w.cpu(), first_w)
                    del out
            fp8 = isinstance(x, tuple)
            assert n == {"DispatchQueued": 1, "DispatchPlanned": 3, "Combine": 0 if fp8 else 1,
                         "CombinePlanned": 4 if fp8 else 3}, n
    finally:
        layer.buffer.destroy()


def host(o):
    if isinstance(o, (tuple, list)):
        return type(o)(host(v) for v in o)
    return o.cpu() if isinstance(o, torch.Tensor) else o


def test_layout_again_keeps_its_plan(group, device):
    """A layout again with nothing between (DeepEP's harness times get_dispatch_layout so) keeps the rows ahead and the
    plan that no dispatch took when they are the same, instead of allocating and planning again; another topk_idx
    plans again; the dispatch after either runs planned and gives the first layer's outputs."""
    layer = Layer(group, device, "plans-again")
    buffer, topk, E = layer.buffer, layer.topk, layer.E
    try:
        out = layer.dispatch(layer.x)
        first = [host(o) for o in out]
        del out
        with counted("PlanDispatch", "DispatchPlanned") as n:
            buffer.get_dispatch_layout(topk, E)  # the dispatch took the rows ahead: new ones, planned
            rows = buffer._rows_ahead[0].data_ptr()
            for _ in range(3):
                buffer.get_dispatch_layout(topk, E)
            assert n == {"PlanDispatch": 1, "DispatchPlanned": 0}, n
            assert buffer._rows_ahead[0].data_ptr() == rows, "the rows ahead were allocated again"
            out = layer.dispatch(layer.x)  # a fifth layout, then the planned dispatch
            same([host(o) for o in out], first, "the dispatch after layouts again")
            assert n == {"PlanDispatch": 1, "DispatchPlanned": 1}, n
            del out
            other = topk.clone()
            buffer.get_dispatch_layout(topk, E)
            buffer.get_dispatch_layout(other, E)
            assert n["PlanDispatch"] == 3, n
            recv_x, _, _, _, handle, _ = buffer.dispatch(layer.x, topk_idx=other, topk_weights=layer.w,
                                                         **layout_of(buffer, other, E))
            same(host(recv_x), first[0], "the dispatch after another topk_idx")
            assert n == {"PlanDispatch": 3, "DispatchPlanned": 2}, n
    finally:
        buffer.destroy()


def test_calls_not_planned_run_unplanned(group, device):
    """Each call that is not the one planned (another hidden size, a config, async_finish, num_worst_tokens, another
    handle, a bias, the same handle twice) runs unplanned and gives the reference; the plan is not used later."""
    layer = Layer(group, device, "plans-others")
    buffer, R = layer.buffer, layer.R
    try:
        recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
        layer.combine(recv_x, recv_w, handle)  # now the next layout and dispatch plan
        config = pyep.Buffer.get_dispatch_config(R)
        dispatches = [("a config", {"config": config}), ("async_finish", {"async_finish": True}),
                      ("num_worst_tokens", {"num_worst_tokens": R * layer.case.tokens})]
        for name, kw in dispatches:
            with counted("DispatchPlanned") as n:
                recv_x, _, recv_w, _, handle = layer.dispatch(layer.x, **kw)
                assert n["DispatchPlanned"] == 0, name
            if name == "async_finish":
                layer.event.current_stream_wait()  # the outputs are the comm stream's until then
            rows = int(handle[3].numel())
            layer.combine(recv_x[:rows], recv_w[:rows], handle)
        with counted("DispatchPlanned") as n:
            narrow = layer.x[:, :128].contiguous()
            recv_narrow, _, _, _, _ = layer.dispatch(narrow)
            assert n["DispatchPlanned"] == 0, "another hidden size"
            assert buffer._rows_ahead is None
        del recv_narrow

        recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)  # planned: its combine too
        older = handle
        recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
        y = expert_output(recv_x, layer.me)
        with counted("CombinePlanned", "Combine") as n:
            # Another handle than the one planned (the older one's rows are the same: same inputs).
            combined, _, _ = buffer.combine(y, older, topk_weights=recv_w)
            assert torch.equal(combined.cpu(), layer.ref_combined)
            assert n == {"CombinePlanned": 0, "Combine": 1}, n
            buffer.dispatch(layer.x, handle=handle)  # a cached dispatch plans the combine of its handle
            combined, _, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=torch.zeros_like(combined))
            assert torch.equal(combined.cpu(), layer.ref_combined)
            assert n == {"CombinePlanned": 0, "Combine": 2}, n
            buffer.dispatch(layer.x, handle=handle)
            for _ in range(2):  # the plan serves the first combine only
                combined, _, _ = buffer.combine(y, handle, topk_weights=recv_w)
                assert torch.equal(combined.cpu(), layer.ref_combined)
            assert n == {"CombinePlanned": 1, "Combine": 3}, n
    finally:
        buffer.destroy()


def test_plans_off(group, device, monkeypatch):
    """PYEP_PLANS=0 (read at import; here the module's switch): nothing planned, the same outputs."""
    monkeypatch.setattr(_ahead, "_PLANS", False)
    layer = Layer(group, device, "plans-off")
    try:
        with counted("DispatchPlanned", "CombinePlanned", "PlanDispatch", "PlanCombine") as n:
            for _ in range(3):
                recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
                layer.combine(recv_x, recv_w, handle)
        assert set(n.values()) == {0}, n
    finally:
        layer.buffer.destroy()


def test_planned_call_with_bad_input_raises_and_next_call_works(group, device):
    """A planned call checks every argument as the unplanned one does: a bad one raises ValueError naming it, before
    any launch, the plan is spent, and the next calls work."""
    layer = Layer(group, device, "plans-bad")
    try:
        recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
        layer.combine(recv_x, recv_w, handle)
        with counted("DispatchPlanned", "CombinePlanned") as n:
            with pytest.raises(ValueError, match="topk_weights"):
                layer.buffer.dispatch(layer.x, topk_idx=layer.topk, topk_weights=layer.w.double(),
                                      **layout_of(layer.buffer, layer.topk, layer.E))
            assert n["DispatchPlanned"] == 1, "the bad dispatch was not the planned one"
            recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)  # planned again: its layout planned it
            y = expert_output(recv_x, layer.me)
            with pytest.raises(ValueError, match="rows"):
                layer.buffer.combine(y[:-1], handle, topk_weights=recv_w[:-1])
            assert n == {"DispatchPlanned": 2, "CombinePlanned": 1}, n
            layer.combine(recv_x, recv_w, handle)  # unplanned now, and right
            recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
            layer.combine(recv_x, recv_w, handle)
            assert n == {"DispatchPlanned": 3, "CombinePlanned": 2}, n
    finally:
        layer.buffer.destroy()


def test_planned_call_elsewhere_names_the_device(group, device):
    """The planned dispatch and combine read a tensor's device index, not its torch.device: x or topk_weights
    elsewhere (a meta tensor; on cuda, one in host memory) still raises the usual ValueError naming the argument and
    the buffer's device, and the next planned call works."""
    layer = Layer(group, device, "plans-device")
    try:
        recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
        layer.combine(recv_x, recv_w, handle)
        places = ["meta"] + (["cpu"] if layer.x.is_cuda else [])
        with counted("DispatchPlanned") as n:
            for place in places:
                for name, x, w in (("x", layer.x.to(place), layer.w), ("topk_weights", layer.x, layer.w.to(place))):
                    with pytest.raises(ValueError, match=f"{name}: on {place}, expected {layer.x.device}"):
                        layer.buffer.dispatch(x, topk_idx=layer.topk, topk_weights=w,
                                              **layout_of(layer.buffer, layer.topk, layer.E))
            calls = n["DispatchPlanned"]
            recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
            assert n["DispatchPlanned"] == calls + 1, "the next dispatch ran planned"
        with counted("CombinePlanned") as n:  # the combine that dispatch planned, likewise
            y = expert_output(recv_x, layer.me)
            for place in places:
                for name, x, w in (("x", y.to(place), recv_w), ("topk_weights", y, recv_w.to(place))):
                    with pytest.raises(ValueError, match=f"{name}: on {place}, expected {layer.x.device}"):
                        layer.buffer.combine(x, handle, topk_weights=w)
            layer.combine(recv_x, recv_w, handle)
            recv_x, _, recv_w, _, handle = layer.dispatch(layer.x)
            layer.combine(recv_x, recv_w, handle)
            # The first bad call's usual path let the plan go: the right combine after it ran unplanned, the next
            # layer's planned.
            assert n["CombinePlanned"] == 1, n
    finally:
        layer.buffer.destroy()
