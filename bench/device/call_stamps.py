"""Where a call's host time goes before its launch, on one GPU (one rank; normal mode 4096 tokens, hidden 7168, top-8 of
256; low-latency mode 128 tokens, top-8 of 288): perf_counter stamps inserted after the marked lines of a copy of the
call's method (the installed pyep's source), then the core's entry (LastEntryNs), the driver's launch call
(BufferLastLaunchStartNs) and its return (BufferLastLaunchNs). Medians of 350 calls per mode, in µs. The stamps add about 0.1 µs each.

    python bench/device/call_stamps.py dispatch   # BF16, after a new layout or the same one, outputs dropped or kept
    python bench/device/call_stamps.py combine    # after its dispatch (outputs allocated ahead) or after a combine
    python bench/device/call_stamps.py cached     # a cached dispatch, back to back
    python bench/device/call_stamps.py planned-dispatch   # a dispatch after its layout, planned (_dispatch_planned)
    python bench/device/call_stamps.py planned-combine    # a combine after its dispatch, planned (_combine_planned)
    python bench/device/call_stamps.py ll-dispatch        # low_latency_dispatch, FP8: unhooked, and with its hook
    python bench/device/call_stamps.py ll-combine         # low_latency_combine after its dispatch, or after a combine

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
from pyep import _low_latency as LL
from pyep import _normal as N

# The lines after which a stamp goes, by the start of their text, per method ("^": before the line).
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
    "low_latency_dispatch": ["bid = self._ll_id", "R, dev = self.group_size", "M, E = num_max", "shapes = type(x)",
                             "T, H = x.shape if shapes", "L = E // R if", "use_fp8, round_scale, use_ue8m0 = bool",
                             "stream = _current_stream", "_, src_info, layout_range", "rows = torch.empty",
                             "r = rows.data_ptr()"],
    "low_latency_combine": ["bid = self._ll_id", "R, dev = self.group_size", "ok = type(handle)",
                            "src_info, layout_range, M, H, E = handle if ok", "T, K = topk_idx.shape if ok",
                            "L, RM = (E // R", "stream = _current_stream", "^try:"],
}
# Where a method's first stamp goes: before its line starting so.
STARTS = {"dispatch": "if modes_on():", "combine": "if modes_on():", "_dispatch_cached": "if topk_idx is not None or",
          "_dispatch_planned": "num, stream, key, fp8", "_combine_planned": "try:",
          "low_latency_dispatch": "if modes_on():", "low_latency_combine": "if modes_on():"}
STAMPS = []


def stamped(method):
    """The method (of NormalMode, Ahead or LowLatencyMixin) with a stamp at its start and after each of MARKS[method];
    the marks found."""
    module, cls = next((m, c) for m, c in ((LL, LL.LowLatencyMixin), (_ahead, _ahead.Ahead), (N, N.NormalMode))
                       if method in vars(c))
    src = textwrap.dedent(inspect.getsource(vars(cls)[method]))
    out, names, started = [], ["entry"], False
    for line in src.split("\n"):
        body = line.strip()
        indent = line[:len(line) - len(line.lstrip())]
        if not started and body.startswith(STARTS[method]):
            out.append(indent + "_S.append(time.perf_counter_ns())")
            started = True
        before = [m for m in MARKS[method] if m[0] == "^" and started and body.startswith(m[1:]) and m not in names]
        out += [indent + "_S.append(time.perf_counter_ns())" for _ in before[:1]]
        names += before[:1]
        out.append(line)
        for m in MARKS[method]:
            if m[0] != "^" and body.startswith(m) and m not in names:
                out.append(indent + "_S.append(time.perf_counter_ns())")
                names.append(m)
                break
    ns = dict(vars(module))
    ns["_S"], ns["time"] = STAMPS, time
    exec(compile("\n".join(out), f"{method}_stamped", "exec"), ns)
    setattr(cls, method, ns[method])
    return names


def low_latency(which):
    """The modes and call of ll-dispatch or ll-combine on a low-latency Buffer of one rank; its runtime id."""
    d = torch.device("cuda", 0)
    M, H, K, E = 128, 7168, 8, 288
    buf = pyep.Buffer(dist.group.WORLD, num_rdma_bytes=pyep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E),
                      low_latency_mode=True, num_qps_per_rank=E)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, H, generator=g) * 0.1).to(d, torch.bfloat16)
    topk = torch.rand(M, E, generator=g).topk(K, dim=1).indices.to(d)
    w = torch.rand(M, K, generator=g).to(d)
    (recv, _), _, handle, _, _ = buf.low_latency_dispatch(x, topk, M, E)
    state = {"y": recv.to(torch.bfloat16), "handle": handle, "hook": None, "hooked": False}

    def receive():  # the last hooked dispatch's hook, untimed
        hook, state["hook"] = state["hook"], None
        if hook is not None:
            hook()

    def dispatch():
        r = buf.low_latency_dispatch(x, topk, M, E, return_recv_hook=state["hooked"])
        state["hook"] = r[4]
        return r

    if which == "ll-dispatch":
        modes = {"unhooked, synced before": (None, False),
                 "with its hook (called before the next)": (lambda: receive() or state.update(hooked=True), False)}
        return modes, dispatch, buf.runtime.id

    def new_handle():
        state["handle"] = buf.low_latency_dispatch(x, topk, M, E)[2]

    modes = {"after its dispatch": (new_handle, False), "after a combine": (None, False),
             "after a combine, output kept": (None, True)}
    return modes, lambda: buf.low_latency_combine(state["y"], topk, w, state["handle"]), buf.runtime.id


def main(which):
    method = {"dispatch": "dispatch", "combine": "combine", "cached": "_dispatch_cached",
              "planned-dispatch": "_dispatch_planned", "planned-combine": "_combine_planned",
              "ll-dispatch": "low_latency_dispatch", "ll-combine": "low_latency_combine"}[which]
    if not which.startswith("planned"):
        _ahead._PLANS = False
    names = stamped(method)
    print("marks found:", names)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1)
    if which.startswith("ll-"):
        modes, call, rid = low_latency(which)
        measure(which, names, modes, call, rid)
        return
    d = torch.device("cuda", 0)
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
    measure(which, names, modes, call, rid)


def measure(which, names, modes, call, rid):
    """Prints the medians of each mode's stamps: modes maps a name to (what runs before each call, untimed, or None;
    whether the call's outputs are kept until the next one)."""
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


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dispatch")
    dist.destroy_process_group()
