"""Where a dispatch's host time goes before its launch, on one GPU (one rank, 4096 tokens, hidden 7168, top-8 of 256):
perf_counter stamps inserted after the marked lines of a copy of NormalMode.dispatch (the installed pyep's source), then
the core's entry (LastEntryNs) and its last launch (BufferLastLaunchNs). Medians of 350 BF16 dispatches per mode, in
µs: with a new layout before each (untimed, as a model's layer makes one) or the same layout, the device idle before
each or the calls back to back, the outputs dropped or kept until the next call. The stamps add about 0.1 µs each.

    python bench/device/dispatch_stamps.py      # run outside the checkout (cd /tmp), so that the installed pyep loads
"""
import inspect, os, sys, tempfile, textwrap, time, statistics, torch
import torch.distributed as dist
import pyep
from pyep import _normal as N, _core
S = []
src = textwrap.dedent(inspect.getsource(N.NormalMode.dispatch))
marks = ["f0, f1, f2, f3, f4 = self._fields", "stream, event, flags = self._order", "wp, wt, wv, wn, w0, w1, ws0, ws1 = _desc2",
         "R, C, rid = self.group_size", "h = hb.data_ptr() + h0", "r = rb.data_ptr()"]
out, names = [], ["entry"]
for line in src.split("\n"):
    if line.strip().startswith('if modes_on():') and not names[1:]:
        out.append(line[:len(line) - len(line.lstrip())] + "_S.append(time.perf_counter_ns())")
    out.append(line)
    for m in marks:
        if line.strip().startswith(m) and m not in names:
            out.append(line[:len(line) - len(line.lstrip())] + "_S.append(time.perf_counter_ns())"); names.append(m); break
ns = dict(vars(N)); ns["_S"] = S; ns["time"] = time
exec(compile("\n".join(out), "dispatch_stamped", "exec"), ns)
N.NormalMode.dispatch = ns["dispatch"]
print("marks found:", names)
d = torch.device("cuda", 0); torch.cuda.set_device(0)
store = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{store}/s", rank=0, world_size=1)
T,H,K,E = 4096,7168,8,256
buf = pyep.Buffer(dist.group.WORLD, pyep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H*2,1))
rid = buf.runtime.id
g=torch.Generator().manual_seed(0)
x=torch.randn(T,H,generator=g).to(d,torch.bfloat16)
topk=torch.rand(T,E,generator=g).topk(K,dim=1).indices.to(d)
w=torch.rand(T,K,generator=g).to(d)
pr,_,pe,ir,_=buf.get_dispatch_layout(topk,E)
kw = dict(num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe, topk_idx=topk, topk_weights=w)
for mode in ("layout, synced before", "synced before", "back to back", "synced, outputs kept", "layout, synced, outputs kept"):
    rows = []
    keep = None
    for i in range(400):
        if mode.startswith("layout"):
            pr,_,pe,ir,_=buf.get_dispatch_layout(topk,E); kw.update(num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe)
        if mode != "back to back": torch.cuda.synchronize()
        S.clear(); t0 = time.perf_counter_ns()
        r = buf.dispatch(x, **kw)
        t1 = time.perf_counter_ns()
        if "kept" in mode: keep = r
        del r
        entry = _core.call("LastEntryNs"); launch = _core.call("BufferLastLaunchNs", rid)
        if i >= 50:
            rows.append([S[0]-t0] + [b - a for a, b in zip(S, S[1:])] + [entry - S[-1], launch - entry, t1 - launch, launch - t0])
    med = [statistics.median(c)/1e3 for c in zip(*rows)]
    labels = ["to entry"] + [f"..{n[:22]}" for n in names[1:]] + ["to Go entry", "Go to launch", "after launch", "LAUNCH TOTAL"]
    print(f"== {mode}: medians (us)"); [print(f"   {l:28s} {v:7.2f}") for l, v in zip(labels, med)]
torch.cuda.synchronize(); dist.destroy_process_group()
