"""Where a normal-mode call's host time goes before its launch, on one GPU (one rank, 4096 tokens, hidden 7168, top-8 of
256): perf_counter stamps inserted after the marked lines of a copy of the call's method (the installed pyep's source),
then the core's entry (LastEntryNs), the driver's launch call (BufferLastLaunchStartNs) and its return
(BufferLastLaunchNs). Medians of 350 calls per mode, in µs. The stamps add about 0.1 µs each.

    python bench/device/call_stamps.py dispatch   # BF16, after a new layout or the same one, outputs dropped or kept
    python bench/device/call_stamps.py combine    # after its dispatch (outputs allocated ahead) or after a combine
    python bench/device/call_stamps.py cached     # a cached dispatch, back to back
    python bench/device/call_stamps.py planned-dispatch   # a dispatch after its layout, planned (_dispatch_planned)
    python bench/device/call_stamps.py planned-combine    # a combine after its dispatch, planned (_combine_planned)

dispatch, combine and cached run with the plans off (pyep._ahead._PLANS): their stamps are on the unplanned path.

Run it outside the checkout (cd /tmp), so that the installed pyep loads.
"""
import inspect
import statistics
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist

import pyep
from pyep import _ahead, _core
from pyep import _normal as N

# The lines after which a stamp goes, by the start of their text, per method of NormalMode.
MARKS = {
    "dispatch": ["f0, f1, f2, f3, f4 = self._fields", "stream, event, flags = self._order",
                 "wp, wt, wv, wn, w0, w1, ws0, ws1 = _desc2", "R, C, rid = self.group_size", "h = hb.data_ptr() + h0",
                 "r = rb.data_ptr()"],
    "combine": ["_, T, C, rows, rank_prefix", "f0, f1, f2, f3, f4 = self._fields", "stream, event, flags = self._order",
                "xp, xt, xv, xn, x0, H, xs0, xs1 = _desc2", "dtype = _DTYPE_OF.get(xt",
                "ahead, self._combine_ahead =", "combined_x, out = block, block.data_ptr()"],
    "_dispatch_cached": ["_, T, C, rows, rank_prefix", "f0, f1, f2, f3, f4 = self._fields",
                         "stream, event, flags = self._order", "sp, st, sv, sn, s0, S, ss0, ss1 = _desc2",
                         "r = block.data_ptr()"],
    "_dispatch_planned": ["num, stream, key, fp8", "xp, xt, xv = x.data_ptr()", "wp, wt, wv = topk_weights",
                          "rb, self._rows_ahead ="],
    "_combine_planned": ["xp, xt, xv = x.data_ptr()", "stream = _current_stream", "self._combine_ahead = None"],
}
# Where a method's first stamp goes: before its line starting so.
STARTS = {"dispatch": "if modes_on():", "combine": "if modes_on():", "_dispatch_cached": "if topk_idx is not None or",
          "_dispatch_planned": "num, stream, key, fp8", "_combine_planned": "try:"}
STAMPS = []


def stamped(method):
    """NormalMode.<method> with a stamp at its start and after each of MARKS[method]; the marks found."""
    src = textwrap.dedent(inspect.getsource(getattr(N.NormalMode, method)))
    out, names, started = [], ["entry"], False
    for line in src.split("\n"):
        body = line.strip()
        indent = line[:len(line) - len(line.lstrip())]
        if not started and body.startswith(STARTS[method]):
            out.append(indent + "_S.append(time.perf_counter_ns())")
            started = True
        out.append(line)
        for m in MARKS[method]:
            if body.startswith(m) and m not in names:
                out.append(indent + "_S.append(time.perf_counter_ns())")
                names.append(m)
                break
    ns = dict(vars(_ahead if method in vars(_ahead.Ahead) else N))
    ns["_S"], ns["time"] = STAMPS, time
    exec(compile("\n".join(out), f"{method}_stamped", "exec"), ns)
    setattr(N.NormalMode, method, ns[method])
    return names


def main(which):
    method = {"dispatch": "dispatch", "combine": "combine", "cached": "_dispatch_cached",
              "planned-dispatch": "_dispatch_planned", "planned-combine": "_combine_planned"}[which]
    if not which.startswith("planned"):
        _ahead._PLANS = False
    names = stamped(method)
    print("marks found:", names)
    d = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1)
    T, H, K, E = 4096, 7168, 8, 256
    buf = pyep.Buffer(dist.group.WORLD, pyep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1))
    rid = buf.runtime.id
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(d, torch.bfloat16)
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(d)
    w = torch.rand(T, K, generator=g).to(d)
    kw = dict(topk_idx=topk, topk_weights=w)

    def layout():
        pr, _, pe, ir, _ = buf.get_dispatch_layout(topk, E)
        kw.update(num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe)

    layout()
    state = {}

    def dispatch():
        layout()
        recv, _, rw, _, h, _ = buf.dispatch(x, **kw)
        state.update(y=recv.clone() if "y" not in state else state["y"], w=rw, handle=h)

    dispatch()
    if which == "planned-dispatch":
        blocks = x.float().view(T, H // 128, 128)
        amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
        x_fp8 = ((blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H), (amax / 448.0).contiguous())
        fp8 = {"on": False}
        modes = {"BF16 after its layout": (layout, False), "FP8 after its layout": (lambda: fp8.update(on=True) or layout(), False)}
        call = lambda: buf.dispatch(x_fp8 if fp8["on"] else x, **kw)
    elif which == "planned-combine":
        modes = {"after its dispatch": (dispatch, False)}
        call = lambda: buf.combine(state["y"], state["handle"], topk_weights=state["w"])
    elif which == "dispatch":
        modes = {"layout, synced before": (layout, False), "synced before": (None, False),
                 "synced, outputs kept": (None, True), "layout, synced, outputs kept": (layout, True)}
        call = lambda: buf.dispatch(x, **kw)
    elif which == "combine":
        modes = {"after its dispatch": (dispatch, False), "after a combine": (None, False)}
        call = lambda: buf.combine(state["y"], state["handle"], topk_weights=state["w"])
    else:
        modes = {"back to back, synced": (None, False)}
        call = lambda: buf.dispatch(x, handle=state["handle"])
    labels = ["to entry"] + [f"..{n[:22]}" for n in names[1:]] + ["to Go entry", "Go to driver", "driver launch",
                                                                   "after launch", "LAUNCH TOTAL"]
    for mode, (prep, keep) in modes.items():
        rows, kept, missed = [], None, 0
        for i in range(400):
            if prep is not None:
                prep()
            torch.cuda.synchronize()
            STAMPS.clear()
            t0 = time.perf_counter_ns()
            r = call()
            t1 = time.perf_counter_ns()
            if keep:
                kept = r
            del r
            entry = _core.call("LastEntryNs")
            start = _core.call("BufferLastLaunchStartNs", rid)
            launch = _core.call("BufferLastLaunchNs", rid)
            if i >= 50 and len(STAMPS) != len(names):
                missed += 1  # the call took another path (not planned): its stamps do not line up
            elif i >= 50:
                S = STAMPS
                rows.append([S[0] - t0] + [b - a for a, b in zip(S, S[1:])] +
                            [entry - S[-1], start - entry, launch - start, t1 - launch, launch - t0])
        del kept
        med = [statistics.median(c) / 1e3 for c in zip(*rows)]
        print(f"== {which}, {mode}: medians (µs)" + (f"; {missed} calls took another path" if missed else ""))
        for label, v in zip(labels, med):
            print(f"   {label:28s} {v:7.2f}")
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dispatch")
