# In-process A/B of the planned dispatch's Python: HEAD's _dispatch_planned (from .device/old_planned.py) against the
# working tree's, alternating call by call; medians of python / core / driver / launch, µs. One rank, one GPU.
import os, statistics, sys, tempfile, textwrap, time
import torch, torch.distributed as dist
torch.cuda.set_device(0)
os.environ["PYEP_BACKEND"] = "cuda"
store = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
import pyep
from pyep import _core, _ahead
here = os.path.dirname(os.path.abspath(__file__))
ns = dict(vars(_ahead))
exec(open(os.path.join(here, "old_planned.py")).read(), ns)
variants = {"old": ns["_dispatch_planned"], "new": _ahead.Ahead._dispatch_planned}
T, H, K, E = 4096, 7168, 8, 256
buffer = pyep.Buffer(dist.group.WORLD, pyep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1))
rid = buffer.runtime.id
g = torch.Generator().manual_seed(0)
x = torch.randn(T, H, generator=g).cuda()
x_bf16 = x.to(torch.bfloat16)
blocks = x.view(T, H // 128, 128)
amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
x_fp8 = ((blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H), (amax / 448.0).contiguous())
topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
weights = torch.rand(T, K, generator=g).cuda()
layout = {}
def new_layout():
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    layout.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
new_layout()
buffer.dispatch(x_bf16, **layout, topk_idx=topk, topk_weights=weights)
buffer.dispatch(x_fp8, **layout, topk_idx=topk, topk_weights=weights)
for name, xx in (("dispatch_bf16", x_bf16), ("dispatch_fp8", x_fp8)):
    s = {v: {c: [] for c in ("python", "core", "driver", "launch")} for v in variants}
    for i in range(40 + 2 * int(sys.argv[1] if len(sys.argv) > 1 else 300)):
        v = ("old", "new")[i % 2]
        _ahead.Ahead._dispatch_planned = variants[v]
        new_layout()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        buffer.dispatch(xx, **layout, topk_idx=topk, topk_weights=weights)
        entry = _core.call("LastEntryNs"); launch = _core.call("BufferLastLaunchNs", rid)
        start = _core.call("BufferLastLaunchStartNs", rid)
        if i < 40:
            continue
        for c, val in (("python", entry - t0), ("core", start - entry), ("driver", launch - start), ("launch", launch - t0)):
            s[v][c].append(val / 1e3)
    for v in variants:
        print(f"{name} {v}: " + " ".join(f"{c} {statistics.median(vals):.2f}" for c, vals in s[v].items()), flush=True)
_ahead.Ahead._dispatch_planned = variants["new"]
torch.cuda.synchronize()
dist.destroy_process_group()
